"""Triton RMSNorm (+ fused residual add, + static fp8 output): one program per row."""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from atom.ops._common import cdiv, next_pow2
from atom.ops.common_triton import exact_fp8_cast, num_warps_for, to_fp8_e4m3

#: Rows up to this many elements are normalised from registers in one pass; longer rows loop
#: over chunks twice (sum of squares, then scale). Tests lower it to reach the loop path.
SINGLE_PASS_MAX_N = 16384
CHUNK_N = 4096


@triton.jit(do_not_specialize=["B"])
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, scale_ptr,
    stride_x0, stride_x1, stride_r0, stride_r1, stride_o0, stride_o1, stride_ro0, stride_ro1,
    B, N, eps,
    BLOCK_N: tl.constexpr, NUM_CHUNKS: tl.constexpr,
    HAS_RES: tl.constexpr, FP8_OUT: tl.constexpr, EXACT_FP8: tl.constexpr,
):
    # Rows are indexed over two dims [A, B] with per-tensor strides, so per-head norms of a
    # strided [T, H, D] view (e.g. a slice of a fused qkv output) need no copy.
    row = tl.program_id(0).to(tl.int64)
    a = row // B
    b = row - a * B
    x_row = x_ptr + a * stride_x0 + b * stride_x1
    r_row = res_ptr + a * stride_r0 + b * stride_r1
    o_row = out_ptr + a * stride_o0 + b * stride_o1
    ro_row = res_out_ptr + a * stride_ro0 + b * stride_ro1
    if FP8_OUT:
        # Divide (not multiply by a reciprocal) so the result is the reference's value/scale.
        scale = tl.load(scale_ptr).to(tl.float32)
    if NUM_CHUNKS == 1:
        cols = tl.arange(0, BLOCK_N)
        mask = cols < N
        x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_RES:
            r = tl.load(r_row + cols, mask=mask, other=0.0).to(tl.float32)
            # The residual stream lives in the activation dtype: round the sum once and
            # normalise the rounded value, as the unfused add-then-norm would.
            s = (x + r).to(res_out_ptr.dtype.element_ty)
            tl.store(ro_row + cols, s, mask=mask)
            x = s.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, axis=0) / N + eps)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        y = x * rstd * w
        if FP8_OUT:
            y = tl.clamp(y / scale, -448.0, 448.0)
            tl.store(o_row + cols, to_fp8_e4m3(y, EXACT_FP8), mask=mask)
        else:
            tl.store(o_row + cols, y.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        # Pass 1: sum of squares (and the residual sum, written out and re-read in pass 2).
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for c in range(NUM_CHUNKS):
            cols = c * BLOCK_N + tl.arange(0, BLOCK_N)
            mask = cols < N
            x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
            if HAS_RES:
                r = tl.load(r_row + cols, mask=mask, other=0.0).to(tl.float32)
                s = (x + r).to(res_out_ptr.dtype.element_ty)
                tl.store(ro_row + cols, s, mask=mask)
                x = s.to(tl.float32)
            acc += x * x
        rstd = tl.rsqrt(tl.sum(acc, axis=0) / N + eps)
        for c in range(NUM_CHUNKS):
            cols = c * BLOCK_N + tl.arange(0, BLOCK_N)
            mask = cols < N
            if HAS_RES:
                x = tl.load(ro_row + cols, mask=mask, other=0.0).to(tl.float32)
            else:
                x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
            y = x * rstd * w
            if FP8_OUT:
                y = tl.clamp(y / scale, -448.0, 448.0)
                tl.store(o_row + cols, to_fp8_e4m3(y, EXACT_FP8), mask=mask)
            else:
                tl.store(o_row + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm_launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor,
    residual: Optional[torch.Tensor],
    residual_out: Optional[torch.Tensor],
    scale: Optional[torch.Tensor],
) -> None:
    """All tensors are 3-D ``[A, B, N]`` views with a unit last stride (the op module makes them)."""
    a, b, n = x.shape
    rows = a * b
    if rows == 0:
        return
    if next_pow2(n) <= SINGLE_PASS_MAX_N:
        block, chunks = next_pow2(n), 1
    else:
        block = min(CHUNK_N, next_pow2(n))
        chunks = cdiv(n, block)
    has_res = residual is not None
    fp8 = scale is not None
    _rms_norm_kernel[(rows,)](
        x, residual if has_res else x, weight, out, residual_out if has_res else out,
        scale if fp8 else weight,
        x.stride(0), x.stride(1),
        residual.stride(0) if has_res else 0, residual.stride(1) if has_res else 0,
        out.stride(0), out.stride(1),
        residual_out.stride(0) if has_res else 0, residual_out.stride(1) if has_res else 0,
        b, n, float(eps),
        BLOCK_N=block, NUM_CHUNKS=chunks, HAS_RES=has_res, FP8_OUT=fp8,
        EXACT_FP8=fp8 and exact_fp8_cast(),
        num_warps=num_warps_for(block, x.element_size()),
    )

