"""Triton kernels of the fused MoE's small-batch path (imported by :mod:`atom.ops.moe_triton`).

Batches of at most ``ATOM_MOE_GEMV_MAX_TOKENS`` tokens (auto: 4; fp8 experts: 1, and none past
``FP8_GEMV_MAX_EXPERT_BYTES`` per expert) and no more (token, expert) pairs than experts skip the
expert sort and the grouped GEMMs: every (pair, row tile) program reads its own expert's rows and
multiplies them with the one token's activations in registers (a GEMV). See
:mod:`atom.ops.moe_triton` for the pipeline.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from atom import envs
from atom.ops._common import cdiv, next_pow2
from atom.ops._dispatch import triton_interpreting
from atom.ops.common_triton import exact_fp8_cast, to_fp8_e4m3


@triton.jit
def gated_act(gate, up, alpha, limit, SWIGLUOAI: tl.constexpr, CLAMP: tl.constexpr):
    """The expert MLP's gated activation on float32 gate/up values (both MoE paths):
    ``silu(gate) * up``, or GPT-OSS's ``(clamp(up) + 1) * g * sigmoid(alpha * g)``,
    ``g = min(gate, limit)``."""
    if SWIGLUOAI:
        if CLAMP:
            gate = tl.minimum(gate, limit)
            up = tl.minimum(tl.maximum(up, -limit), limit)
        return gate / (1.0 + tl.exp(-alpha * gate)) * (up + 1.0)
    return gate / (1.0 + tl.exp(-gate)) * up


@triton.jit
def _resolve_expert(ids_ptr, map_ptr, pair, num_local, num_global, HAS_MAP: tl.constexpr):
    """The local expert of ``pair`` and whether it is on this rank (ids outside the map or
    past the local experts, e.g. garbage routing in a warm-up pass, are on no rank)."""
    e = tl.load(ids_ptr + pair).to(tl.int32)
    if HAS_MAP:
        inb = (e >= 0) & (e < num_global)
        e = tl.where(inb, tl.load(map_ptr + tl.where(inb, e, 0)).to(tl.int32), -1)
    ok = (e >= 0) & (e < num_local)
    return tl.where(ok, e, 0).to(tl.int64), ok.to(tl.int32)  # (an int: the interpreter's masks
    # reject the boolean a jit function returns)


@triton.jit
def _qdq_groups(a, EXACT: tl.constexpr):
    """``a [G, KB]`` float32 -> its per-row fp8 quantise-dequantise (one scale per group row:
    ``s = max|a_g| / 448``), as the grouped path's activation quantisation computes it."""
    s = tl.maximum(tl.max(tl.abs(a), axis=1), 1e-10) / 448.0
    q = tl.minimum(tl.maximum(a / s[:, None], -448.0), 448.0)
    return to_fp8_e4m3(q, EXACT).to(tl.float32) * s[:, None]


@triton.jit
def _moe_gemv1_kernel(
    x_ptr, xq_ptr, xs_ptr, ids_ptr, map_ptr, w_ptr, w_scale_ptr, bias_ptr, h_ptr,
    hidden, inter, num_local, num_global,
    stride_xt, stride_xqt, stride_xst, stride_we, stride_wn, stride_wse, stride_wsn, stride_wsk,
    stride_be, stride_ht, alpha, limit,
    TOPK: tl.constexpr, BLOCK_N: tl.constexpr, KB: tl.constexpr, G: tl.constexpr,
    FP8: tl.constexpr, X_FP8: tl.constexpr, SCALE_BN: tl.constexpr, ROUND: tl.constexpr,
    HAS_MAP: tl.constexpr, HAS_BIAS: tl.constexpr, SWIGLUOAI: tl.constexpr, CLAMP: tl.constexpr,
):
    pair = tl.program_id(0)
    expert, ok = _resolve_expert(ids_ptr, map_ptr, pair, num_local, num_global, HAS_MAP)
    if ok == 0:
        return  # the down GEMV masks this pair out as well
    tok = (pair // TOPK).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = offs_n < inter
    offs_g = tl.arange(0, G)
    kidx = offs_g[:, None] * KB + tl.arange(0, KB)[None, :]  # [G, KB]: G groups of KB columns
    wg_ptrs = w_ptr + expert * stride_we + offs_n.to(tl.int64)[:, None, None] * stride_wn + kidx[None, :, :]
    wu_ptrs = wg_ptrs + inter * stride_wn
    if FP8:
        sg_ptrs = w_scale_ptr + expert * stride_wse + (offs_n // SCALE_BN)[:, None] * stride_wsn
        su_ptrs = w_scale_ptr + expert * stride_wse + ((offs_n + inter) // SCALE_BN)[:, None] * stride_wsn
    acc_g = tl.zeros([BLOCK_N, G, KB], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_N, G, KB], dtype=tl.float32)
    for k0 in range(0, hidden, G * KB):
        kk = k0 + kidx
        kmask = kk < hidden
        if X_FP8:  # quantised by the producer of x: its values and group scales
            a = tl.load(xq_ptr + tok * stride_xqt + kk, mask=kmask, other=0.0).to(tl.float32)
            a_s = tl.load(xs_ptr + tok * stride_xst + k0 // KB + offs_g, mask=k0 + offs_g * KB < hidden,
                          other=0.0)
            a = a * a_s[:, None]
        else:
            a = tl.load(x_ptr + tok * stride_xt + kk, mask=kmask, other=0.0).to(tl.float32)
            if FP8:
                a = _qdq_groups(a, ROUND)
        wmask = nmask[:, None, None] & kmask[None, :, :]
        bg = tl.load(wg_ptrs + k0, mask=wmask, other=0.0).to(tl.float32)
        bu = tl.load(wu_ptrs + k0, mask=wmask, other=0.0).to(tl.float32)
        if FP8:  # KB == block_k: one weight scale per row and group
            smask = nmask[:, None] & (k0 + offs_g * KB < hidden)[None, :]
            scol = (k0 // KB + offs_g)[None, :] * stride_wsk
            bg = bg * tl.load(sg_ptrs + scol, mask=smask, other=0.0)[:, :, None]
            bu = bu * tl.load(su_ptrs + scol, mask=smask, other=0.0)[:, :, None]
        acc_g += bg * a[None, :, :]
        acc_u += bu * a[None, :, :]
    gate = tl.sum(tl.sum(acc_g, axis=2), axis=1)
    up = tl.sum(tl.sum(acc_u, axis=2), axis=1)
    if HAS_BIAS:
        b_ptrs = bias_ptr + expert * stride_be + offs_n
        gate += tl.load(b_ptrs, mask=nmask, other=0.0).to(tl.float32)
        up += tl.load(b_ptrs + inter, mask=nmask, other=0.0).to(tl.float32)
    h = gated_act(gate, up, alpha, limit, SWIGLUOAI, CLAMP)
    tl.store(h_ptr + pair.to(tl.int64) * stride_ht + offs_n, h, mask=nmask)


@triton.jit
def _moe_gemv2_kernel(
    h_ptr, ids_ptr, map_ptr, w_ptr, w_scale_ptr, bias_ptr, topk_w_ptr, out_ptr,
    inter, hidden, num_local, num_global,
    stride_ht, stride_we, stride_wn, stride_wse, stride_wsn, stride_wsk, stride_be, stride_ot,
    BLOCK_N: tl.constexpr, KB: tl.constexpr, G: tl.constexpr, FP8: tl.constexpr,
    SCALE_BN: tl.constexpr, ROUND: tl.constexpr, HAS_MAP: tl.constexpr, HAS_BIAS: tl.constexpr,
):
    """One pair's down-projection rows (bias, routing weight; zero for a pair whose expert is not
    on this rank)."""
    pair = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    expert, ok = _resolve_expert(ids_ptr, map_ptr, pair, num_local, num_global, HAS_MAP)
    offs_g = tl.arange(0, G)
    kidx = offs_g[:, None] * KB + tl.arange(0, KB)[None, :]
    # the scalar test broadcast to vector masks (the interpreter's scalar & vector is not a mask)
    ok_k = (kidx * 0 + ok) != 0
    ok_n = (offs_n * 0 + ok) != 0
    ok_g = (offs_g * 0 + ok) != 0
    nmask = offs_n < hidden
    w_ptrs = w_ptr + expert * stride_we + offs_n.to(tl.int64)[:, None, None] * stride_wn + kidx[None, :, :]
    if FP8:
        s_ptrs = w_scale_ptr + expert * stride_wse + (offs_n // SCALE_BN)[:, None] * stride_wsn
    h_row = h_ptr + pair.to(tl.int64) * stride_ht
    acc = tl.zeros([BLOCK_N, G, KB], dtype=tl.float32)
    for k0 in range(0, inter, G * KB):
        kk = k0 + kidx
        kmask = (kk < inter) & ok_k  # a pair of an absent expert reads nothing and adds zero
        a = tl.load(h_row + kk, mask=kmask, other=0.0)
        b = tl.load(w_ptrs + k0, mask=nmask[:, None, None] & kmask[None, :, :], other=0.0).to(tl.float32)
        if FP8:
            a = _qdq_groups(a, ROUND)
            smask = nmask[:, None] & ((k0 + offs_g * KB < inter) & ok_g)[None, :]
            b = b * tl.load(s_ptrs + (k0 // KB + offs_g)[None, :] * stride_wsk, mask=smask, other=0.0)[:, :, None]
        acc += b * a[None, :, :]
    y = tl.sum(tl.sum(acc, axis=2), axis=1)
    if HAS_BIAS:
        y += tl.load(bias_ptr + expert * stride_be + offs_n, mask=nmask & ok_n, other=0.0).to(tl.float32)
    y = y * tl.load(topk_w_ptr + pair + offs_n * 0, mask=ok_n, other=0.0)
    tl.store(out_ptr + pair.to(tl.int64) * stride_ot + offs_n, y.to(out_ptr.dtype.element_ty), mask=nmask)


@dataclass(frozen=True)
class GemvConfig:
    """Tiles of the small-batch path: rows per program of each GEMV (``block_n1`` per half of
    ``w13``), ``kb`` columns per group (fp8: the quantisation block) and ``g`` groups per K step."""

    block_n1: int
    block_n2: int
    kb: int
    g: int
    num_warps: int


def gemv_config(block_k_quant: Optional[int], dtype: torch.dtype = torch.bfloat16) -> GemvConfig:
    """Tiles of the small-batch path (tiny under the interpreter). The H100 sweep
    (``bench/ops_compute.py --ops moe_tiles``, Qwen3-30B-A3B experts, docs/performance.md) put
    every tile within a few % of each other at T = 1..8 for bf16; for fp8 8-row gate/up tiles
    and 512-column K steps were best at T = 1. A down GEMV that added each token's top-k rows
    itself (no sum kernel) measured no faster, and was dropped."""
    if triton_interpreting():
        return GemvConfig(8, 8, block_k_quant or 16, 2, 4)
    if block_k_quant:
        return GemvConfig(8, 16, block_k_quant, max(1, 512 // block_k_quant), 4)
    if dtype == torch.float32:
        return GemvConfig(16, 16, 128, 1, 4)
    return GemvConfig(16, 32, 128, 2, 4)


#: ``ATOM_MOE_GEMV_MAX_TOKENS=auto``: the largest batch the small-batch path takes, by expert
#: weights. Measured on the H100 (docs/performance.md): bf16 experts 1.02-1.05x the grouped
#: path's speed at T = 1..4, 0.99x at 8. fp8 experts on the H200 against the swapped grouped
#: tiles (bench/NOTES.md 74): Qwen3-30B-A3B's 1.17-1.24x at T = 1, 0.92x at 2.
GEMV_AUTO_MAX_TOKENS = {False: 4, True: 1}

#: fp8 experts larger than this (bytes of one expert's gate, up and down rows on this rank) never
#: take the small-batch path under ``auto``: the GEMV streams them at ~2.5-2.8 TB/s where the
#: swapped grouped tiles reach ~3.1-3.9. H200 (bench/NOTES.md 74), one token: Qwen3-30B-A3B's
#: experts (4.7 MB) 27 us on the GEMV vs 32.5 grouped, DeepSeek-V3's (44 MB) 141 vs 112.5; a line
#: through both shapes' times crosses near 11 MB per expert.
FP8_GEMV_MAX_EXPERT_BYTES = 11 << 20


def gemv_max_tokens(fp8: bool = False, expert_bytes: int = 0) -> int:
    """``ATOM_MOE_GEMV_MAX_TOKENS``: the largest batch the small-batch path takes (0: never);
    ``expert_bytes``: one local expert's weight bytes (auto: fp8 experts past
    ``FP8_GEMV_MAX_EXPERT_BYTES`` never)."""
    limit = envs.ATOM_MOE_GEMV_MAX_TOKENS
    if limit is not None:
        return limit
    if fp8 and expert_bytes > FP8_GEMV_MAX_EXPERT_BYTES:
        return 0
    return GEMV_AUTO_MAX_TOKENS[bool(fp8)]


def takes_gemv(num_tokens: int, top_k: int, num_global: int, fp8: bool = False, expert_bytes: int = 0) -> bool:
    """Whether a batch takes the small-batch (GEMV) path: at most ``gemv_max_tokens(fp8,
    expert_bytes)`` tokens and no more (token, expert) pairs than experts (so that few experts'
    rows are read twice; beyond that the grouped GEMMs share each expert's rows among its
    tokens)."""
    return num_tokens <= gemv_max_tokens(fp8, expert_bytes) and num_tokens * top_k <= num_global


def expert_bytes(w13: torch.Tensor, w2: torch.Tensor) -> int:
    """One local expert's weight bytes (gate, up and down rows), as :func:`takes_gemv` takes them
    (shape arithmetic only: it runs on every call's host path)."""
    return w13.shape[1] * w13.shape[2] * w13.element_size() + w2.shape[1] * w2.shape[2] * w2.element_size()


def _fused_moe_gemv(x, w13, w2, topk_weights, topk_ids, out, expert_map, num_global, w13_scale, w2_scale,
                    block, w13_bias, w2_bias, activation, swiglu_alpha, swiglu_limit, x_fp8, x_fp8_scale,
                    cfg: GemvConfig) -> torch.Tensor:
    """The small-batch path (module docstring): two GEMV launches and the top-k sum, no align."""
    from atom.ops.moe_triton import _moe_sum_kernel  # (that module imports this one)

    num_tokens, hidden = x.shape
    num_local, two_inter, _ = w13.shape
    inter = two_inter // 2
    top_k = topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    dev = x.device
    fp8 = block is not None
    scale_bn, scale_bk = block if fp8 else (1, 1)
    if fp8 and cfg.kb != scale_bk:
        raise ValueError(f"the small-batch fp8 path needs kb == block_k ({scale_bk}), got {cfg.kb}")
    ids_flat = topk_ids.reshape(-1)
    if not ids_flat.is_contiguous():
        ids_flat = ids_flat.contiguous()
    emap = expert_map if expert_map is not None else ids_flat
    has_map = expert_map is not None
    x_q = fp8 and x_fp8 is not None
    xs = x_fp8_scale if not x_q or x_fp8_scale.stride(-1) == 1 else x_fp8_scale.contiguous()
    w13_s = w13_scale if fp8 else x
    ws1 = (w13_scale.stride(0), w13_scale.stride(1), w13_scale.stride(2)) if fp8 else (0, 0, 0)
    h = torch.empty(num_pairs, inter, dtype=torch.float32, device=dev)
    swigluoai = activation == "swigluoai"
    clamp = swigluoai and swiglu_limit is not None
    round_ = exact_fp8_cast()
    _moe_gemv1_kernel[(num_pairs, cdiv(inter, cfg.block_n1))](
        x, x_fp8 if x_q else x, xs if x_q else x, ids_flat, emap, w13, w13_s,
        w13_bias if w13_bias is not None else x, h,
        hidden, inter, num_local, num_global,
        x.stride(0), x_fp8.stride(0) if x_q else 0, xs.stride(0) if x_q else 0,
        w13.stride(0), w13.stride(1), *ws1,
        w13_bias.stride(0) if w13_bias is not None else 0, h.stride(0),
        float(swiglu_alpha) if swigluoai else 1.0, float(swiglu_limit) if clamp else 0.0,
        TOPK=top_k, BLOCK_N=cfg.block_n1, KB=cfg.kb, G=cfg.g, FP8=fp8, X_FP8=x_q, SCALE_BN=scale_bn,
        ROUND=round_, HAS_MAP=has_map, HAS_BIAS=w13_bias is not None, SWIGLUOAI=swigluoai, CLAMP=clamp,
        num_warps=cfg.num_warps, num_stages=1,
    )
    direct = top_k == 1 and not has_map
    dst = out if direct else torch.empty(num_pairs, hidden, dtype=torch.float32, device=dev)
    tw = topk_weights.reshape(-1)
    if tw.dtype != torch.float32 or not tw.is_contiguous():
        tw = tw.float().contiguous()
    w2_s = w2_scale if fp8 else x
    ws2 = (w2_scale.stride(0), w2_scale.stride(1), w2_scale.stride(2)) if fp8 else (0, 0, 0)
    _moe_gemv2_kernel[(num_pairs, cdiv(hidden, cfg.block_n2))](
        h, ids_flat, emap, w2, w2_s, w2_bias if w2_bias is not None else x, tw, dst,
        inter, hidden, num_local, num_global,
        h.stride(0), w2.stride(0), w2.stride(1), *ws2,
        w2_bias.stride(0) if w2_bias is not None else 0, dst.stride(0),
        BLOCK_N=cfg.block_n2, KB=cfg.kb, G=cfg.g, FP8=fp8, SCALE_BN=scale_bn, ROUND=round_,
        HAS_MAP=has_map, HAS_BIAS=w2_bias is not None, num_warps=cfg.num_warps, num_stages=1,
    )
    if not direct:
        block_h = min(1024, next_pow2(hidden))
        _moe_sum_kernel[(num_tokens, cdiv(hidden, block_h))](
            dst, ids_flat, emap, out, hidden, num_global, dst.stride(0), out.stride(0),
            TOPK=top_k, BLOCK_H=block_h, HAS_MAP=has_map, num_warps=4,
        )
    return out
