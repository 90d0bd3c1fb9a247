"""Triton SiLU-and-mul, for :mod:`atom.ops.activation`."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atom.ops._common import cdiv, next_pow2
from atom.ops.common_triton import num_warps_for

#: Columns per SiLU-and-mul program (a row of d outputs is split over cdiv(d, this) programs).
SILU_BLOCK = 2048


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, d, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    a = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(x_ptr + row * stride_x + d + cols, mask=mask, other=0.0).to(tl.float32)
    y = a / (1.0 + tl.exp(-a)) * b
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul_launch(x: torch.Tensor, out: torch.Tensor) -> None:
    """x ``[rows, 2d]``, out ``[rows, d]``, unit last strides."""
    rows, d = out.shape
    if rows == 0 or d == 0:
        return
    block = min(SILU_BLOCK, next_pow2(d))
    _silu_and_mul_kernel[(rows, cdiv(d, block))](
        x, out, x.stride(0), out.stride(0), d,
        BLOCK=block, num_warps=num_warps_for(block, 2 * x.element_size(), max_warps=8),
    )
