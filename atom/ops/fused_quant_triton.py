"""Triton kernels for :mod:`atom.ops.fused_quant`: a producer writes its output and the output's
1 x G fp8 quantisation in one pass. The row is held as a ``[groups, G]`` tile, so each group's
amax is one reduction over the tile's second axis; the quantised value is that of the output
rounded to its dtype (what a separate quantisation kernel would read)."""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from atom.ops._common import FP8_AMAX_EPS, cdiv, next_pow2
from atom.ops.common_triton import exact_fp8_cast, num_warps_for, to_fp8_e4m3

#: RMSNorm rows up to this many elements (one program holds the whole row).
NORM_MAX_N = 16384
#: SiLU-and-mul: output elements (groups x G) per program.
SILU_TILE_ELEMS = 2048


@triton.jit
def _store_quantised(yf, q_row, s_row, cols, mask, g, num_groups, stride_sg, amax_eps, EXACT_FP8: tl.constexpr):
    """``yf [groups, G]`` float32 (the rounded output) -> fp8 values and one scale per group."""
    scale = tl.maximum(tl.max(tl.abs(yf), axis=1), amax_eps) / 448.0
    qv = tl.clamp(yf / scale[:, None], -448.0, 448.0)
    tl.store(q_row + cols, to_fp8_e4m3(qv, EXACT_FP8), mask=mask)
    tl.store(s_row + g * stride_sg, scale, mask=g < num_groups)


@triton.jit(do_not_specialize=["stride_sm", "stride_sg"])  # column-major scales: the batch size
def _rms_norm_quant_kernel(
    x_ptr, r_ptr, w_ptr, y_ptr, ro_ptr, q_ptr, s_ptr,
    stride_x, stride_r, stride_y, stride_ro, stride_q, stride_sm, stride_sg,
    N, num_groups, eps, amax_eps,
    G: tl.constexpr, NG: tl.constexpr, HAS_RES: tl.constexpr, EXACT_FP8: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    g = tl.arange(0, NG)
    cols = g[:, None] * G + tl.arange(0, G)[None, :]
    mask = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        r = tl.load(r_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        s = (x + r).to(ro_ptr.dtype.element_ty)  # the residual stream, rounded once
        tl.store(ro_ptr + row * stride_ro + cols, s, mask=mask)
        x = s.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(tl.sum(x * x, axis=1), axis=0) / N + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = (x * rstd * w).to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + row * stride_y + cols, y, mask=mask)
    _store_quantised(y.to(tl.float32), q_ptr + row * stride_q, s_ptr + row * stride_sm, cols, mask, g, num_groups,
                     stride_sg, amax_eps, EXACT_FP8)


def rms_norm_quant_launch(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: Optional[torch.Tensor],
                          y: torch.Tensor, residual_out: Optional[torch.Tensor], q: torch.Tensor, s: torch.Tensor,
                          group: int) -> None:
    """x/residual ``[M, N]`` (unit last stride); y/residual_out/q ``[M, N]`` contiguous; s ``[M, groups]``."""
    m, n = x.shape
    if m == 0 or n == 0:
        return
    groups = cdiv(n, group)
    ng = next_pow2(groups)
    has_res = residual is not None
    _rms_norm_quant_kernel[(m,)](
        x, residual if has_res else x, weight, y, residual_out if has_res else y, q, s,
        x.stride(0), residual.stride(0) if has_res else 0, y.stride(0), residual_out.stride(0) if has_res else 0,
        q.stride(0), s.stride(0), s.stride(1), n, groups, float(eps), FP8_AMAX_EPS,
        G=group, NG=ng, HAS_RES=has_res, EXACT_FP8=exact_fp8_cast(),
        num_warps=num_warps_for(ng * group, x.element_size()),
    )


@triton.jit(do_not_specialize=["stride_sm", "stride_sg"])
def _silu_and_mul_quant_kernel(
    x_ptr, y_ptr, q_ptr, s_ptr, stride_x, stride_y, stride_q, stride_sm, stride_sg, d, num_groups, amax_eps,
    G: tl.constexpr, GPB: tl.constexpr, EXACT_FP8: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1) * GPB + tl.arange(0, GPB)
    cols = g[:, None] * G + tl.arange(0, G)[None, :]
    mask = (g[:, None] < num_groups) & (cols < d)
    a = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(x_ptr + row * stride_x + d + cols, mask=mask, other=0.0).to(tl.float32)
    y = (a / (1.0 + tl.exp(-a)) * b).to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + row * stride_y + cols, y, mask=mask)
    _store_quantised(y.to(tl.float32), q_ptr + row * stride_q, s_ptr + row * stride_sm, cols, mask, g, num_groups,
                     stride_sg, amax_eps, EXACT_FP8)


def silu_and_mul_quant_launch(x: torch.Tensor, y: torch.Tensor, q: torch.Tensor, s: torch.Tensor, group: int) -> None:
    """x ``[M, 2d]`` (unit last stride); y/q ``[M, d]`` contiguous; s ``[M, groups]``."""
    m, d = y.shape
    if m == 0 or d == 0:
        return
    groups = cdiv(d, group)
    gpb = min(next_pow2(groups), max(1, SILU_TILE_ELEMS // group))
    _silu_and_mul_quant_kernel[(m, cdiv(groups, gpb))](
        x, y, q, s, x.stride(0), y.stride(0), q.stride(0), s.stride(0), s.stride(1), d, groups, FP8_AMAX_EPS,
        G=group, GPB=gpb, EXACT_FP8=exact_fp8_cast(),
        num_warps=num_warps_for(gpb * group, 2 * x.element_size(), max_warps=8),
    )
