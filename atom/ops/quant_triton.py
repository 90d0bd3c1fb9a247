"""Triton dynamic fp8 quantisation (per token, per 1xG group), for :mod:`atom.ops.quant`."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atom.ops._common import FP8_AMAX_EPS, cdiv, next_pow2
from atom.ops.common_triton import exact_fp8_cast, num_warps_for, to_fp8_e4m3

#: Per-token quant: rows up to this many elements in one pass from registers, else two passes.
QUANT_SINGLE_PASS_MAX_K = 16384
QUANT_CHUNK_K = 4096
#: Per-block quant: elements (groups x group size) handled by one program.
GROUP_TILE_ELEMS = 2048


@triton.jit
def _per_token_quant_kernel(
    x_ptr, q_ptr, s_ptr, stride_x, stride_q, K, eps,
    BLOCK: tl.constexpr, NUM_CHUNKS: tl.constexpr, EXACT_FP8: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    q_row = q_ptr + row * stride_q
    if NUM_CHUNKS == 1:
        cols = tl.arange(0, BLOCK)
        mask = cols < K
        x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        scale = tl.maximum(tl.max(tl.abs(x), axis=0), eps) / 448.0
        y = tl.clamp(x / scale, -448.0, 448.0)
        tl.store(q_row + cols, to_fp8_e4m3(y, EXACT_FP8), mask=mask)
    else:
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for c in range(NUM_CHUNKS):
            cols = c * BLOCK + tl.arange(0, BLOCK)
            x = tl.load(x_row + cols, mask=cols < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        scale = tl.maximum(tl.max(amax, axis=0), eps) / 448.0
        for c in range(NUM_CHUNKS):
            cols = c * BLOCK + tl.arange(0, BLOCK)
            mask = cols < K
            x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
            y = tl.clamp(x / scale, -448.0, 448.0)
            tl.store(q_row + cols, to_fp8_e4m3(y, EXACT_FP8), mask=mask)
    tl.store(s_ptr + row, scale)


def per_token_quant_launch(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> None:
    """x/q ``[rows, K]`` (unit last stride), scales ``[rows]`` contiguous float32."""
    rows, k = x.shape
    if rows == 0:
        return
    if next_pow2(k) <= QUANT_SINGLE_PASS_MAX_K:
        block, chunks = next_pow2(k), 1
    else:
        block = min(QUANT_CHUNK_K, next_pow2(k))
        chunks = cdiv(k, block)
    _per_token_quant_kernel[(rows,)](
        x, q, scales, x.stride(0), q.stride(0), k, FP8_AMAX_EPS,
        BLOCK=block, NUM_CHUNKS=chunks, EXACT_FP8=exact_fp8_cast(),
        num_warps=num_warps_for(block, x.element_size()),
    )


@triton.jit
def _per_block_quant_kernel(
    x_ptr, q_ptr, s_ptr, stride_x, stride_q, stride_s, K, num_groups, group, eps,
    GROUPS: tl.constexpr, BLOCK_G: tl.constexpr, EXACT_FP8: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    j = tl.arange(0, BLOCK_G)
    cols = g[:, None] * group + j[None, :]
    mask = (g[:, None] < num_groups) & (j[None, :] < group) & (cols < K)
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), axis=1), eps) / 448.0
    y = tl.clamp(x / scale[:, None], -448.0, 448.0)
    tl.store(q_ptr + row * stride_q + cols, to_fp8_e4m3(y, EXACT_FP8), mask=mask)
    tl.store(s_ptr + row * stride_s + g, scale, mask=g < num_groups)


def per_block_quant_launch(
    x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, group: int
) -> None:
    """x/q ``[rows, K]`` (unit last stride), scales ``[rows, cdiv(K, group)]`` float32."""
    rows, k = x.shape
    num_groups = cdiv(k, group)
    if rows == 0 or num_groups == 0:
        return
    block_g = next_pow2(group)
    groups = min(next_pow2(num_groups), max(1, GROUP_TILE_ELEMS // block_g))
    _per_block_quant_kernel[(rows, cdiv(num_groups, groups))](
        x, q, scales, x.stride(0), q.stride(0), scales.stride(0), k, num_groups, group, FP8_AMAX_EPS,
        GROUPS=groups, BLOCK_G=block_g, EXACT_FP8=exact_fp8_cast(),
        num_warps=num_warps_for(groups * block_g, x.element_size(), max_warps=8),
    )
