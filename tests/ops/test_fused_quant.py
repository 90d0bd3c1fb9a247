"""Producers that quantise their own output (atom.ops.fused_quant) against the two steps they
replace, and the consumers that read that quantisation (the block-fp8 GEMM, the fp8 experts).

Odd widths with a partial last group, M = 1, the residual add, both scale layouts. On CPU under
the Triton interpreter; real shapes on a GPU (``gpu``)."""

from __future__ import annotations

import pytest
import torch

from atom.ops import fp8_block_gemm, fused_moe, per_block_quant_fp8, rms_norm, silu_and_mul
from atom.ops.fused_quant import (
    QuantizedActivation,
    column_major,
    plain,
    rms_norm_quant_fp8,
    silu_and_mul_quant_fp8,
)
from tests.ops._helpers import DEVICE, FP8

BF16 = torch.bfloat16


def _assert_quantisation_of(y: torch.Tensor, q: torch.Tensor, s: torch.Tensor, group: int, column: bool) -> None:
    """``(q, s)`` is exactly the per-block quantisation of ``y`` (the separate kernel's result)."""
    want_q, want_s = per_block_quant_fp8.reference(y, group)
    assert q.dtype == FP8 and q.shape == y.shape
    assert torch.equal(q.float(), want_q.float())
    assert torch.equal(s, want_s)
    if column and s.shape[0] > 1 and s.shape[1] > 1:
        assert s.stride() == (1, s.shape[0])
    elif not column:
        assert s.is_contiguous()


@pytest.mark.parametrize("column", [False, True], ids=["row", "col"])
@pytest.mark.parametrize("residual", [False, True], ids=["norm", "add_norm"])
@pytest.mark.parametrize("m,k,group", [(1, 300, 128), (7, 640, 128), (5, 200, 64), (3, 96, 128)])
def test_rms_norm_quant_is_the_two_steps(m, k, group, residual, column):
    x = (torch.randn(m, k, device=DEVICE) * 3).to(BF16)
    w = (torch.rand(k, device=DEVICE) + 0.5).to(BF16)
    r = torch.randn(m, k, device=DEVICE).to(BF16) if residual else None
    got = rms_norm_quant_fp8.run("triton", x, w, 1e-6, r, group, column)
    two = rms_norm.run("triton", x, w, 1e-6, r)
    y, q, s = (got[0], got[2], got[3]) if residual else got
    y_two = two[0] if residual else two
    if residual:
        assert torch.equal(got[1], two[1])  # the new residual stream, rounded once
    torch.testing.assert_close(y.float(), y_two.float(), atol=1e-2, rtol=1e-2)
    _assert_quantisation_of(y, q, s, group, column)
    # the reference is literally the two reference steps
    ref = rms_norm_quant_fp8.reference(x, w, 1e-6, r, group, column)
    ref_y = ref[0]
    assert torch.equal(ref_y, rms_norm.reference(x, w, 1e-6, r)[0] if residual else rms_norm.reference(x, w, 1e-6))
    _assert_quantisation_of(ref_y, ref[-2], ref[-1], group, column)


@pytest.mark.parametrize("column", [False, True], ids=["row", "col"])
@pytest.mark.parametrize("m,d,group", [(1, 96, 128), (4, 300, 128), (3, 2500, 128), (2, 200, 32)])
def test_silu_and_mul_quant_is_the_two_steps(m, d, group, column):
    x = (torch.randn(m, 2 * d, device=DEVICE) * 3).to(BF16)
    y, q, s = silu_and_mul_quant_fp8.run("triton", x, group, column)
    torch.testing.assert_close(y.float(), silu_and_mul.run("triton", x).float(), atol=1e-2, rtol=1e-2)
    _assert_quantisation_of(y, q, s, group, column)
    ry, rq, rs = silu_and_mul_quant_fp8.reference(x, group, column)
    assert torch.equal(ry, silu_and_mul.reference(x))
    _assert_quantisation_of(ry, rq, rs, group, column)


def test_errors_and_carrier():
    x = torch.randn(2, 3, 64, device=DEVICE).to(BF16)
    with pytest.raises(ValueError, match=r"\[tokens, channels\]"):
        rms_norm_quant_fp8(x, torch.ones(64, device=DEVICE, dtype=BF16), 1e-6)
    with pytest.raises(ValueError, match="group"):
        silu_and_mul_quant_fp8(x[0], 0)
    with pytest.raises(ValueError, match=r"x must be \[\.\.\., 2\*d\]"):
        silu_and_mul_quant_fp8.run("triton", x[0][:, :63], 32)
    a = QuantizedActivation(*silu_and_mul_quant_fp8(x[0]))
    assert plain(a) is a.x and plain(a.x) is a.x
    s = torch.randn(5, 3, device=DEVICE)
    assert torch.equal(column_major(s), s) and column_major(s).stride() == (1, 5)
    c = column_major(s)
    assert column_major(c) is c  # already column-major: no copy


def _weights(n: int, k: int, block=(128, 128)):
    w = (torch.randn(n, k, device=DEVICE) * 100).clamp(-448, 448).to(FP8)
    return w, torch.rand(-(-n // block[0]), -(-k // block[1]), device=DEVICE) * 1e-3 + 1e-4


@pytest.mark.parametrize("column", [False, True], ids=["row", "col"])
@pytest.mark.parametrize("m", [1, 20, 70])
def test_block_gemm_reads_the_producers_quantisation(m, column):
    """With ``x_fp8`` given the W8A8 GEMM reads it (not a fresh quantisation of ``x``): the same
    result as quantising ``x`` itself when they agree, the other activation's result when not."""
    k, n = 300, 136
    w, ws = _weights(n, k)
    x = torch.randn(m, k, device=DEVICE).to(BF16)
    other = torch.randn(m, k, device=DEVICE).to(BF16)
    for backend in ("triton", "torch"):
        q, s = per_block_quant_fp8.reference(x, 128)
        s = column_major(s) if column else s
        own = fp8_block_gemm.run(backend, x, w, ws, (128, 128), w8a8_from=1)
        fed = fp8_block_gemm.run(backend, x, w, ws, (128, 128), w8a8_from=1, x_fp8=q, x_fp8_scale=s)
        assert torch.equal(own, fed), backend
        qo, so = per_block_quant_fp8.reference(other, 128)
        swapped = fp8_block_gemm.run(backend, x, w, ws, (128, 128), w8a8_from=1, x_fp8=qo, x_fp8_scale=so)
        assert torch.equal(swapped, fp8_block_gemm.run(backend, other, w, ws, (128, 128), w8a8_from=1)), backend
        # below w8a8_from the weight-only form reads x and ignores the fp8 copy
        w16 = fp8_block_gemm.run(backend, x, w, ws, (128, 128), w8a8_from=m + 1, x_fp8=qo, x_fp8_scale=so)
        assert torch.equal(w16, fp8_block_gemm.run(backend, x, w, ws, (128, 128))), backend


def test_block_gemm_validates_the_fp8_copy():
    w, ws = _weights(64, 256)
    x = torch.randn(3, 256, device=DEVICE).to(BF16)
    q, s = per_block_quant_fp8.reference(x, 128)
    with pytest.raises(ValueError, match="go together"):
        fp8_block_gemm(x, w, ws, (128, 128), x_fp8=q)
    with pytest.raises(ValueError, match="x_fp8_scale must be"):
        fp8_block_gemm(x, w, ws, (128, 128), x_fp8=q, x_fp8_scale=s[:, :1])
    with pytest.raises(ValueError, match="x_fp8 must be"):
        fp8_block_gemm(x, w, ws, (128, 128), x_fp8=x, x_fp8_scale=s)


def test_fp8_experts_read_the_producers_quantisation():
    torch.manual_seed(3)
    e, hidden, inter, t, top_k = 4, 256, 128, 9, 2
    w13 = (torch.randn(e, 2 * inter, hidden, device=DEVICE) * 50).clamp(-448, 448).to(FP8)
    w2 = (torch.randn(e, hidden, inter, device=DEVICE) * 50).clamp(-448, 448).to(FP8)
    s13 = torch.rand(e, 2 * inter // 128, hidden // 128, device=DEVICE) * 1e-3 + 1e-4
    s2 = torch.rand(e, hidden // 128, inter // 128, device=DEVICE) * 1e-3 + 1e-4
    x = torch.randn(t, hidden, device=DEVICE).to(BF16)
    other = torch.randn(t, hidden, device=DEVICE).to(BF16)
    ids = torch.randint(0, e, (t, top_k), device=DEVICE, dtype=torch.int32)
    wts = torch.rand(t, top_k, device=DEVICE)
    kw = dict(w13_scale=s13, w2_scale=s2, block_shape=[128, 128])
    for backend in ("triton", "torch"):
        own = fused_moe.run(backend, x, w13, w2, wts, ids, **kw)
        q, s = per_block_quant_fp8.reference(x, 128)
        assert torch.equal(fused_moe.run(backend, x, w13, w2, wts, ids, x_fp8=q, x_fp8_scale=column_major(s), **kw),
                           own), backend
        qo, so = per_block_quant_fp8.reference(other, 128)
        assert torch.equal(fused_moe.run(backend, x, w13, w2, wts, ids, x_fp8=qo, x_fp8_scale=so, **kw),
                           fused_moe.run(backend, other, w13, w2, wts, ids, **kw)), backend
    with pytest.raises(ValueError, match="go together"):
        fused_moe(x, w13, w2, wts, ids, x_fp8=q, **kw)


def _assert_gpu_quantisation_of(y: torch.Tensor, q: torch.Tensor, s: torch.Tensor, group: int) -> None:
    """On a GPU, against the separate Triton quantisation kernel of ``y``: the same scales, and
    the same fp8 values up to one e4m3 step in a few elements (the compiled fp32 division may
    round a quotient on a rounding boundary the other way)."""
    want_q, want_s = per_block_quant_fp8.run("triton", y, group)
    torch.testing.assert_close(s, want_s, rtol=1e-6, atol=0)
    a, b = q.float(), want_q.float()
    differ = a != b
    assert differ.float().mean() <= 1e-3, differ.float().mean()
    assert ((a - b).abs()[differ] <= b.abs()[differ] / 8 + 2 ** -9).all()


@pytest.mark.gpu
@pytest.mark.parametrize("k", [4096, 5120, 7168, 1536])
def test_gpu_real_widths(k):
    x = torch.randn(37, k, device="cuda").to(BF16)
    w = (torch.rand(k, device="cuda") + 0.5).to(BF16)
    r = torch.randn(37, k, device="cuda").to(BF16)
    y, res, q, s = rms_norm_quant_fp8(x, w, 1e-6, r, 128, True)
    y2, res2 = rms_norm(x, w, 1e-6, r)
    assert torch.equal(res, res2)
    torch.testing.assert_close(y.float(), y2.float(), atol=2e-2, rtol=2e-2)
    assert s.stride() == (1, 37)
    _assert_gpu_quantisation_of(y, q, s, 128)
    g = torch.randn(37, 2 * 3 * k, device="cuda").to(BF16)
    y, q, s = silu_and_mul_quant_fp8(g, 128, False)
    torch.testing.assert_close(y.float(), silu_and_mul(g).float(), atol=2e-2, rtol=2e-2)
    _assert_gpu_quantisation_of(y, q, s, 128)
