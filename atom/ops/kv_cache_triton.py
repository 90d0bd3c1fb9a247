"""Triton paged KV-cache write (NHD layout ``[num_blocks, block_size, heads, head_size]``)."""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from atom.ops._common import cdiv, next_pow2
from atom.ops._launch import direct as direct_launch
from atom.ops.common_triton import cache_store, exact_fp8_cast, num_warps_for

#: Elements of one head-block tile (key or value) per program; ~2 KiB of bf16.
TILE_ELEMS = 1024


@triton.jit
def _reshape_and_cache_kernel(
    k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, ks_ptr, vs_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
    H, block_size,
    HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    FP8: tl.constexpr, EXACT_FP8: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = (heads[:, None] < H) & (d[None, :] < HEAD_DIM)
    # The k/v loads do not depend on the slot: issue them together with the slot load rather
    # than after it (a padding token's rows are read for nothing, which is rare and cheap).
    k = tl.load(k_ptr + t * stride_kt + heads[:, None] * stride_kh + d[None, :], mask=mask)
    v = tl.load(v_ptr + t * stride_vt + heads[:, None] * stride_vh + d[None, :], mask=mask)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    # slot < 0 marks a padding token: nothing to write.
    if slot >= 0:
        blk = slot // block_size
        off = slot - blk * block_size
        kc = kc_ptr + blk * stride_kcb + off * stride_kcs + heads[:, None] * stride_kch + d[None, :]
        vc = vc_ptr + blk * stride_vcb + off * stride_vcs + heads[:, None] * stride_vch + d[None, :]
        cache_store(kc_ptr, kc, k, mask, ks_ptr, FP8, EXACT_FP8)
        cache_store(vc_ptr, vc, v, mask, vs_ptr, FP8, EXACT_FP8)


def reshape_and_cache_launch(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    fp8: bool,
    k_scale: Optional[torch.Tensor],
    v_scale: Optional[torch.Tensor],
) -> None:
    """key/value ``[T, H, D]`` and caches ``[nb, bs, H, D]``, all with a unit last stride."""
    t, h, d = key.shape
    if t == 0:
        return
    block_d = next_pow2(d)
    block_h = min(next_pow2(h), max(1, TILE_ELEMS // block_d))
    grid = (t, cdiv(h, block_h))
    direct_launch(_reshape_and_cache_kernel)[grid](
        key, value, key_cache, value_cache, slot_mapping,
        k_scale if fp8 else slot_mapping, v_scale if fp8 else slot_mapping,
        *key.stride()[:2], *value.stride()[:2], *key_cache.stride()[:3], *value_cache.stride()[:3],
        h, key_cache.shape[1],
        HEAD_DIM=d, BLOCK_H=block_h, BLOCK_D=block_d,
        FP8=fp8, EXACT_FP8=fp8 and exact_fp8_cast(),
        num_warps=num_warps_for(block_h * block_d, key.element_size(), max_warps=8),
    )
