"""Tile choice of the grouped fused-MoE GEMMs (:mod:`atom.ops.moe_triton`) by tokens per expert,
and the batch sizes its warm-up launches to meet every choice."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from atom.ops._common import cdiv, next_pow2
from atom.ops._dispatch import triton_interpreting
from atom.ops.moe_gemv_triton import gemv_max_tokens


@dataclass(frozen=True)
class MoeConfig:
    """Tiles and launch options of the two grouped GEMMs (BLOCK_N1 spans the inter dim, per
    half of ``w13``)."""

    block_m: int
    block_n1: int
    block_n2: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int
    #: both GEMMs compute ``(w_tile^T @ a_tile^T)^T``: weight rows on the MMA's M side (few
    #: tokens per expert), the tokens on its N side
    swap_ab: bool = False
    #: GEMM2's warps / stages when they differ from GEMM1's (0: the same)
    num_warps2: int = 0
    num_stages2: int = 0


#: fp8: gemm1 programs per SM (128-wide tiles) below which the small-grid tile runs (bench/NOTES.md 82, 87)
SMALL_GRID_PROGRAMS_PER_SM = 0.6


def small_grid(num_tokens: int, top_k: int, num_experts: int, inter: Optional[int], num_sms: Optional[int],
               block: int = 128) -> bool:
    """Whether 2+ tokens, up to 16 pairs per expert, have gemm1's grid at ``block``-wide tiles under
    :data:`SMALL_GRID_PROGRAMS_PER_SM` programs per SM (``min(pairs, experts)`` 16-row blocks, or ``pairs /
    16`` when more; False without ``inter`` or ``num_sms``). One token keeps the 128-wide tiles: the
    small-grid tile measured 0.87-0.90x their speed there (bench/NOTES.md entry 82)."""
    pairs = num_tokens * top_k
    if not inter or not num_sms or num_tokens < 2 or pairs > 16 * num_experts:
        return False
    programs = max(min(pairs, num_experts), cdiv(pairs, 16)) * cdiv(inter, block)
    return programs < SMALL_GRID_PROGRAMS_PER_SM * num_sms


def moe_config(num_tokens: int, top_k: int, num_experts: int, block_k_quant: Optional[int],
               dtype: torch.dtype = torch.bfloat16, inter: Optional[int] = None,
               num_sms: Optional[int] = None) -> MoeConfig:
    """Tile choice by tokens per expert (H100-shaped; tiny under the interpreter). With ``inter``
    (per rank) and ``num_sms``, fp8 batches of :func:`small_grid` take 64-wide, 5-stage tiles.

    GEMM1 computes the gate and up halves in one program, so its BLOCK_N is half the width a
    plain GEMM over ``2 * inter`` columns would use. With fp8 block scales BLOCK_K is the
    quantisation block and BLOCK_N1 equals it, so GEMM1 quantises its own output (a narrower
    BLOCK_N1, forced through ``config=``, takes a separate quantisation pass). Up to 16 fp8 pairs
    per expert A and B are swapped (``swap_ab``): 16-row tiles of a few tokens cannot use
    Hopper's warpgroup MMA, 128 weight rows can. Under the interpreter the fp8 tiles are swapped
    as on the GPU, so CPU tests run that path.
    """
    per_expert = num_tokens * top_k / max(num_experts, 1)
    if triton_interpreting():
        if block_k_quant:
            return MoeConfig(16, block_k_quant, 32, block_k_quant, 1, 4, 1, swap_ab=True)
        return MoeConfig(16, 16, 32, 32, 2, 4, 1)
    if dtype == torch.float32 and not block_k_quant:
        return MoeConfig(16, 32, 32, 32, 1, 4, 2)  # the exact-check path: fp32 tiles, 3xTF32
    if block_k_quant:
        bk = block_k_quant
        if small_grid(num_tokens, top_k, num_experts, inter, num_sms, bk):
            # twice gemm1's programs (output quantised in a separate pass): H200, bench/NOTES.md 82: 1.26 / 1.18 /
            # 1.14x faster at 2 / 3 / 4 tokens on a TP-8 rank's DeepSeek-V3 experts (32-62 programs on 132 SMs)
            return MoeConfig(16, 64, 64, bk, 1, 4, 5, swap_ab=True)
        if per_expert <= 16:
            # A and B swapped (the weight rows on the MMA's M side) and BLOCK_N1 = block_k (GEMM1
            # quantises its own output): the H200 sweep (bench/NOTES.md entry 73) had them
            # 0.91-0.97x the unswapped 64-wide tiles' time at 1-16 pairs per expert on Qwen3-30B-A3B
            # and DeepSeek-V3 experts, uniform and Zipf routing (the GEMMs at ~3.8 TB/s of 4.16 read)
            return MoeConfig(16, bk, 128, bk, 1, 4, 3, swap_ab=True)
        # BLOCK_N1 = block_k: two fp32 accumulators of that width need 8 warps to stay in
        # registers (4 warps spill at BLOCK_M >= 32, ptxas sm_90). 64-row tiles from 17 tokens per
        # expert: the H100 edge sweep (bench/NOTES.md entry 26) had them 0.60-0.93x the 32-row
        # tiles' time at 24-64 tokens per expert, and tied with the 16-row ones at 16.
        return MoeConfig(64, bk, 128, bk, 8, 8, 4)
    if per_expert <= 4:
        return MoeConfig(16, 32, 64, 128, 1, 4, 4)
    if per_expert <= 16:
        return MoeConfig(16, 64, 128, 128, 1, 4, 3)
    # 64-row tiles up to 192 tokens per expert (the sweep: 0.92-0.96x the 32-row tiles' time at
    # 32-64, 0.92x the 128-row ones' at 160; 128 rows lead from 256)
    if per_expert <= 192:
        return MoeConfig(64, 64, 128, 64, 8, 4, 4)
    return MoeConfig(128, 64, 128, 64, 8, 8, 4)


def align_chunk(num_pairs: int) -> int:
    """The align kernel's ``CHUNK`` (pairs per loop step) for ``num_pairs`` (token, expert) pairs."""
    return min(1024, max(16, next_pow2(num_pairs)))


#: ``moe_config``'s tokens-per-expert bucket edges (bf16; the fp8 edges are a subset).
MOE_CONFIG_EDGES = (4, 16, 192)


def warm_up_token_counts(top_k: int, num_local: int, inter: Optional[int] = None,
                         num_sms: Optional[int] = None, tokens: tuple[int, int] = (1, 0)) -> list[int]:
    """Batch sizes that meet every tile bucket of :func:`moe_config` (just below and above each
    edge, and the small-grid bucket's) and every ``CHUNK`` of the align kernel (pairs in each
    power-of-two bucket up to 1024), among the sizes ``tokens = (lo, hi)`` (``hi`` 0: no upper
    end): those of the full set inside, and ``lo`` itself, whose bucket may begin below it."""
    counts = {1}
    if small_grid(2, top_k, num_local, inter, num_sms):  # 2 and the first size past the small-grid bucket
        counts |= {2, next(t for t in range(3, 1 << 30) if not small_grid(t, top_k, num_local, inter, num_sms))}
    for edge in MOE_CONFIG_EDGES:
        t = max(1, edge * num_local // top_k)
        counts |= {t, t + 1}
    chunk = 16
    while chunk <= 1024:
        counts.add(max(1, chunk // (2 * top_k) + 1))
        chunk *= 2
    counts |= {gemv_max_tokens(False) + 1, gemv_max_tokens(True) + 1}  # the first grouped batches
    lo, hi = tokens
    return [lo] + sorted(t for t in counts if lo < t and (not hi or t <= hi))
