"""silu_and_mul and dynamic fp8 quantisation: Triton vs the torch references."""

from __future__ import annotations

import pytest
import torch

from atom.ops import quant_triton
from atom.ops.activation import SILU_AND_MUL
from atom.ops.quant import PER_BLOCK_QUANT_FP8, PER_TOKEN_QUANT_FP8
from tests.ops._helpers import (
    BF16, DEVICE, DTYPE_IDS, DTYPE_TOLS, FP8, FP32, assert_close, assert_fp8_close, poison_, rows_view,
)


# -- silu_and_mul --------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype_tol", DTYPE_TOLS, ids=DTYPE_IDS)
@pytest.mark.parametrize("d", [96, 130, 2500])
@pytest.mark.parametrize("t", [1, 7, 33])
def test_silu_and_mul_matches_reference(t, d, dtype_tol):
    dtype, atol, rtol = dtype_tol
    x = (torch.randn(t, 2 * d, device=DEVICE) * 4).to(dtype)
    out = poison_(torch.empty(t, d, dtype=dtype, device=DEVICE))
    assert SILU_AND_MUL.run("triton", x, out=out) is out
    want = SILU_AND_MUL.run("torch", x)
    assert_close(out, want, atol, rtol)
    if t == 7:  # and with the output allocated by the op
        assert_close(SILU_AND_MUL.run("triton", x), want, atol, rtol)


@pytest.mark.parametrize("dtype_tol", [FP32, BF16], ids=["fp32", "bf16"])
def test_silu_and_mul_layouts(dtype_tol):
    dtype, atol, rtol = dtype_tol
    x = rows_view(7, 2 * 130, 20, dtype)  # row-strided input
    assert_close(SILU_AND_MUL.run("triton", x), SILU_AND_MUL.run("torch", x), atol, rtol)
    x3 = torch.randn(2, 3, 2 * 96, device=DEVICE).to(dtype)
    got = SILU_AND_MUL.run("triton", x3)
    assert got.shape == (2, 3, 96)
    assert_close(got, SILU_AND_MUL.run("torch", x3), atol, rtol)
    x3t = x3.transpose(0, 1)  # gathered by the op
    assert_close(SILU_AND_MUL.run("triton", x3t), SILU_AND_MUL.run("torch", x3t), atol, rtol)


def test_silu_and_mul_reference_formula():
    x = torch.randn(5, 2 * 64, dtype=torch.float64).float() * 6
    a, b = x[:, :64].double(), x[:, 64:].double()
    want = a / (1 + torch.exp(-a)) * b
    torch.testing.assert_close(SILU_AND_MUL.run("torch", x).double(), want, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="2\\*d"):
        SILU_AND_MUL.run("torch", torch.randn(3, 5))


# -- per-token fp8 ---------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype_tol", [FP32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("k", [96, 130, 1000])
@pytest.mark.parametrize("t", [1, 7, 33])
def test_per_token_matches_reference(t, k, dtype_tol):
    dtype = dtype_tol[0]
    x = (torch.randn(t, k, device=DEVICE) * torch.rand(t, 1, device=DEVICE) * 50).to(dtype)
    x[t // 2] = 0  # an all-zero row: finite scale, zero output
    q = poison_(torch.empty(t, k, dtype=FP8, device=DEVICE))
    s = poison_(torch.empty(t, 1, dtype=torch.float32, device=DEVICE))
    gq, gs = PER_TOKEN_QUANT_FP8.run("triton", x, out=q, scales=s)
    assert gq is q and gs is s
    wq, ws = PER_TOKEN_QUANT_FP8.run("torch", x)
    assert_close(gs, ws, 0.0, 1e-6)
    assert_fp8_close(gq, wq, max_mismatch=0.001)
    assert torch.isfinite(gs).all() and (gq[t // 2].float() == 0).all()


def test_per_token_chunked_loop_path(monkeypatch):
    monkeypatch.setattr(quant_triton, "QUANT_SINGLE_PASS_MAX_K", 64)
    monkeypatch.setattr(quant_triton, "QUANT_CHUNK_K", 64)
    x = torch.randn(5, 300, device=DEVICE) * 7
    gq, gs = PER_TOKEN_QUANT_FP8.run("triton", x)
    wq, ws = PER_TOKEN_QUANT_FP8.run("torch", x)
    assert_close(gs, ws, 0.0, 1e-6)
    assert_fp8_close(gq, wq, max_mismatch=0.0)


# -- per-block fp8 ---------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype_tol", [FP32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("k,block", [(96, 128), (130, 128), (300, 64), (1000, 128)])
@pytest.mark.parametrize("t", [1, 7, 33])
def test_per_block_matches_reference(t, k, block, dtype_tol):
    dtype = dtype_tol[0]
    groups = -(-k // block)
    x = (torch.randn(t, k, device=DEVICE) * 10).to(dtype)
    x[:, :block] *= 100  # groups of very different ranges
    if t > 1:
        x[1, block:] = 0  # all-zero groups
    q = poison_(torch.empty(t, k, dtype=FP8, device=DEVICE))
    s = poison_(torch.empty(t, groups, dtype=torch.float32, device=DEVICE))
    gq, gs = PER_BLOCK_QUANT_FP8.run("triton", x, block, out=q, scales=s)
    wq, ws = PER_BLOCK_QUANT_FP8.run("torch", x, block)
    assert ws.shape == (t, groups)
    assert_close(gs, ws, 0.0, 1e-6)
    assert_fp8_close(gq, wq, max_mismatch=0.001)


@pytest.mark.parametrize("block", [128, 64])
def test_per_block_reference_dequantises(block):
    """Independent of the kernels: q * scale reconstructs x to e4m3 precision, per group."""
    x = torch.randn(6, 2, 520) * torch.logspace(-3, 3, 520)
    q, s = PER_BLOCK_QUANT_FP8.run("torch", x, block)
    groups = -(-520 // block)
    assert q.shape == x.shape and s.shape == (6, 2, groups)
    amax = torch.nn.functional.pad(x.abs(), (0, groups * block - 520)).unflatten(-1, (groups, block)).amax(-1)
    torch.testing.assert_close(s, amax / 448.0)
    deq = q.float() * s.repeat_interleave(block, dim=-1)[..., :520]
    bound = s.repeat_interleave(block, dim=-1)[..., :520] * 2.0**-9 + x.abs() * 2.0**-4
    assert ((deq - x).abs() <= bound).all()
    tq, ts = PER_TOKEN_QUANT_FP8.run("torch", x)
    assert ts.shape == (6, 2, 1)
    torch.testing.assert_close(ts[..., 0], x.abs().amax(-1) / 448.0)


def test_3d_and_strided_inputs():
    x = torch.randn(3, 4, 256, device=DEVICE)
    xt = x.transpose(0, 1)
    for xin in (x, xt, rows_view(5, 256, 16, torch.float32)):
        for op, args in ((PER_TOKEN_QUANT_FP8, ()), (PER_BLOCK_QUANT_FP8, (128,))):
            gq, gs = op.run("triton", xin, *args)
            wq, ws = op.run("torch", xin, *args)
            assert gq.shape == xin.shape and gs.shape == ws.shape
            assert_close(gs, ws, 0.0, 1e-6)
            assert_fp8_close(gq, wq, max_mismatch=0.0)


def test_validation_errors():
    x = torch.randn(3, 256, device=DEVICE)
    for backend in ("torch", "triton"):
        with pytest.raises(ValueError, match="block"):
            PER_BLOCK_QUANT_FP8.run(backend, x, 0)
        with pytest.raises(ValueError, match="scales"):
            PER_BLOCK_QUANT_FP8.run(backend, x, 128, scales=torch.empty(3, 3, device=DEVICE))
        with pytest.raises(ValueError, match="out"):
            PER_TOKEN_QUANT_FP8.run(backend, x, out=torch.empty(3, 256, device=DEVICE))
