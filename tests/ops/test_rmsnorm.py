"""rms_norm: Triton vs the torch reference; the reference vs a float64 formula."""

from __future__ import annotations

import pytest
import torch

from atom.ops import rmsnorm_triton
from atom.ops.rmsnorm import RMS_NORM
from tests.ops._helpers import (
    BF16, DEVICE, DTYPE_IDS, DTYPE_TOLS, FP8, FP16, FP32, assert_close, assert_fp8_close, fp8_scale,
    poison_, rows_view,
)

EPS = 1e-6


def _inputs(t: int, n: int, dtype: torch.dtype, residual: bool):
    x = torch.randn(t, n, device=DEVICE).to(dtype)
    w = (torch.rand(n, device=DEVICE) + 0.5).to(dtype)
    r = torch.randn(t, n, device=DEVICE).to(dtype) if residual else None
    return x, w, r


def _check_pair(got, want, out_dtype, atol, rtol):
    got_y, got_r = got if isinstance(got, tuple) else (got, None)
    want_y, want_r = want if isinstance(want, tuple) else (want, None)
    if out_dtype == FP8:
        assert_fp8_close(got_y, want_y)
    else:
        assert_close(got_y, want_y, atol, rtol)
    if want_r is not None:
        assert_close(got_r, want_r, atol, rtol)


# Every mode with fp32 and bf16; fp16 (cheap to add, same code path) for the non-fp8 modes.
MODE_DTYPES = [(m, d) for m in ("plain", "residual", "fp8", "residual_fp8") for d in (FP32, BF16)] + [
    ("plain", FP16), ("residual", FP16)]
MODE_DTYPE_IDS = [f"{m}-{i}" for m in ("plain", "residual", "fp8", "residual_fp8") for i in ("fp32", "bf16")] + [
    "plain-fp16", "residual-fp16"]


@pytest.mark.parametrize("mode,dtype_tol", MODE_DTYPES, ids=MODE_DTYPE_IDS)
@pytest.mark.parametrize("n", [96, 130])
@pytest.mark.parametrize("t", [1, 7, 33])
def test_triton_matches_reference(mode, dtype_tol, t, n):
    dtype, atol, rtol = dtype_tol
    residual = "residual" in mode
    out_dtype = FP8 if "fp8" in mode else None
    scale = fp8_scale(0.013) if out_dtype else None
    x, w, r = _inputs(t, n, dtype, residual)
    # Outputs preallocated and poisoned: every element must be written.
    out = poison_(torch.empty(t, n, dtype=out_dtype or dtype, device=DEVICE))
    res_out = poison_(torch.empty(t, n, dtype=dtype, device=DEVICE)) if residual else None
    got = RMS_NORM.run("triton", x, w, EPS, r, out_dtype, scale, out=out, residual_out=res_out)
    want = RMS_NORM.run("torch", x, w, EPS, r, out_dtype, scale)
    if residual:
        assert got[0] is out and got[1] is res_out
    else:
        assert got is out
    _check_pair(got, want, out_dtype, atol, rtol)
    if t == 7:  # and with outputs allocated by the op
        _check_pair(RMS_NORM.run("triton", x, w, EPS, r, out_dtype, scale), want, out_dtype, atol, rtol)


@pytest.mark.parametrize("dtype_tol", [FP32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("fp8", [False, True])
def test_chunked_loop_path(monkeypatch, dtype_tol, residual, fp8):
    """Rows longer than SINGLE_PASS_MAX_N take the two-pass loop (lowered here to reach it)."""
    monkeypatch.setattr(rmsnorm_triton, "SINGLE_PASS_MAX_N", 32)
    monkeypatch.setattr(rmsnorm_triton, "CHUNK_N", 32)
    dtype, atol, rtol = dtype_tol
    x, w, r = _inputs(5, 130, dtype, residual)
    out_dtype, scale = (FP8, fp8_scale(0.02)) if fp8 else (None, None)
    got = RMS_NORM.run("triton", x, w, EPS, r, out_dtype, scale)
    want = RMS_NORM.run("torch", x, w, EPS, r, out_dtype, scale)
    _check_pair(got, want, out_dtype, atol, rtol)


@pytest.mark.parametrize("dtype_tol", [FP32, BF16], ids=["fp32", "bf16"])
def test_strided_and_3d_inputs(dtype_tol):
    dtype, atol, rtol = dtype_tol
    x = rows_view(7, 130, 38, dtype)  # row stride 168, e.g. a slice of a wider projection
    r = rows_view(7, 130, 6, dtype)
    w = torch.randn(130, device=DEVICE).to(dtype)
    _check_pair(RMS_NORM.run("triton", x, w, EPS, r), RMS_NORM.run("torch", x, w, EPS, r), None, atol, rtol)
    x3 = torch.randn(3, 5, 96, device=DEVICE).to(dtype)
    x3t = x3.transpose(0, 1)  # not viewable as rows: the op gathers it
    w3 = torch.randn(96, device=DEVICE).to(dtype)
    for xin in (x3, x3t):
        got = RMS_NORM.run("triton", xin, w3, EPS)
        assert got.shape == xin.shape
        assert_close(got, RMS_NORM.run("torch", xin, w3, EPS), atol, rtol)


def test_per_head_norm_of_strided_qkv_view():
    """[T, H, D] slice of a fused qkv buffer: rows over (T, H) with two strides, in place."""
    dtype, atol, rtol = BF16
    qkv = torch.randn(7, (4 + 2 * 2) * 64, device=DEVICE).to(dtype)
    w = (torch.rand(64, device=DEVICE) + 0.5).to(dtype)
    got_buf = qkv.clone()
    q = got_buf[:, : 4 * 64].view(7, 4, 64)
    want = RMS_NORM.run("torch", q.clone(), w, EPS)
    assert RMS_NORM.run("triton", q, w, EPS, out=q) is q
    assert_close(q, want, atol, rtol)
    assert torch.equal(got_buf[:, 4 * 64:], qkv[:, 4 * 64:])  # k and v untouched


def test_in_place_aliasing():
    """out may alias x and residual_out may alias residual (vLLM's in-place fused add)."""
    dtype, atol, rtol = FP32
    x, w, r = _inputs(7, 130, dtype, True)
    want = RMS_NORM.run("torch", x, w, EPS, r)
    xi, ri = x.clone(), r.clone()
    got = RMS_NORM.run("triton", xi, w, EPS, ri, out=xi, residual_out=ri)
    assert got[0] is xi and got[1] is ri
    _check_pair(got, want, None, atol, rtol)


def test_out_dtype_conversion():
    x, w, _ = _inputs(7, 96, torch.bfloat16, False)
    got = RMS_NORM.run("triton", x, w, EPS, out_dtype=torch.float32)
    want = RMS_NORM.run("torch", x, w, EPS, out_dtype=torch.float32)
    assert got.dtype == torch.float32
    assert_close(got, want, 1e-5, 1e-5)


def test_zero_rows():
    x, w, r = _inputs(0, 96, torch.float32, True)
    y, s = RMS_NORM.run("triton", x, w, EPS, r)
    assert y.shape == (0, 96) and s.shape == (0, 96)


# -- the reference itself, over a broad sweep (torch only: cheap) ------------------------------
@pytest.mark.parametrize("shape", [(1, 8), (3, 96), (17, 130), (64, 4096), (2, 3, 5, 1000)])
@pytest.mark.parametrize("dtype_tol", DTYPE_TOLS, ids=DTYPE_IDS)
def test_reference_matches_float64_formula(shape, dtype_tol):
    dtype, atol, rtol = dtype_tol
    x = torch.randn(shape).to(dtype)
    r = torch.randn(shape).to(dtype)
    w = torch.randn(shape[-1]).to(dtype)
    s = (x.double() + r.double()).to(dtype)  # residual stream is rounded to the activation dtype
    sd = s.double()
    want = sd / torch.sqrt(sd.pow(2).mean(-1, keepdim=True) + EPS) * w.double()
    y, new_r = RMS_NORM.run("torch", x, w, EPS, r)
    assert torch.equal(new_r, s)
    assert_close(y, want.to(dtype), atol, rtol)
    scale = torch.tensor([0.05])
    q = RMS_NORM.run("torch", x, w, EPS, None, FP8, scale)
    xd = x.double()
    plain = xd / torch.sqrt(xd.pow(2).mean(-1, keepdim=True) + EPS) * w.double()
    assert_fp8_close(q, (plain / 0.05).clamp(-448, 448).to(FP8), max_mismatch=0.2)


def test_validation_errors():
    x, w, r = _inputs(3, 96, torch.float32, True)
    for backend in ("torch", "triton"):
        with pytest.raises(ValueError, match="weight"):
            RMS_NORM.run(backend, x, w[:-1], EPS)
        with pytest.raises(ValueError, match="scale"):
            RMS_NORM.run(backend, x, w, EPS, out_dtype=FP8)
        with pytest.raises(ValueError, match="residual"):
            RMS_NORM.run(backend, x, w, EPS, r[:, :-1])
        with pytest.raises(ValueError, match="scale"):
            RMS_NORM.run(backend, x, w, EPS, scale=torch.ones(1))
