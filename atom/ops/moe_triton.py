"""Triton kernels for the fused expert MLP (imported lazily by :mod:`atom.ops.moe`).

fused_moe pipeline (one launch each, no host synchronisation):

1. ``_moe_align_kernel`` (one program per local expert): every program histograms the routed
   (token, slot) pairs, prefix-sums the per-expert counts padded to BLOCK_M, and scatters the
   indices of its own expert's pairs into ``sorted_ids`` (pad entries hold ``num_pairs``). Pairs
   routed to experts that are not on this rank (``expert_map`` = -1) are dropped here.
2. (fp8) ``_group_quant_kernel``: activations -> fp8 with one scale per token and group of
   ``block_k`` channels.
3. ``_moe_gemm1_kernel``: per BLOCK_M block of sorted pairs (one expert), the gate and up
   halves of ``w13`` are multiplied in the same K loop; the epilogue adds the expert's bias
   (GPT-OSS) and applies ``silu(gate) * up`` or the clamped ``swigluoai``; with fp8 and
   BLOCK_N == block_k the epilogue also quantises the result per
   token-group, so the second GEMM reads fp8 directly.
4. ``_moe_gemm2_kernel``: the down projection; the epilogue adds the expert's bias,
   multiplies by the routing weight
   and writes one row per (token, slot) pair (or straight into the output when top_k == 1).
5. ``_moe_sum_kernel``: sums the top_k rows of each token (skipping pairs of absent experts).

With ``MoeConfig.swap_ab`` (fp8 up to 16 pairs per expert) both GEMMs compute the transposed tile,
``w_tile^T @ a_tile^T``: the expert's weight rows fill the MMA's M side and the few tokens of a
BLOCK_M block its N side, so Hopper's warpgroup MMA runs where a 16-row token tile could not use it.

Small batches (at most ``ATOM_MOE_GEMV_MAX_TOKENS`` tokens: by default 4; with fp8 experts 1,
and none past ``FP8_GEMV_MAX_EXPERT_BYTES`` per expert; and no more (token, expert) pairs than
experts) take a weight-streaming path instead, with no align kernel: every (pair, row tile)
program reads its own expert's rows and multiplies them with the one token's activations in
registers (a GEMV: no tensor cores, no 16-row M tile of which one row is used).

1. ``_moe_gemv1_kernel``: gate and up rows of ``w13`` for one pair (fp8: tile scales applied
   in registers, the activations quantised per 1 x block_k group as the grouped path does),
   bias, activation; one float32 row of the intermediate per pair.
2. ``_moe_gemv2_kernel``: the down projection of that row (fp8: the row quantised per group
   first), bias, routing weight; one float32 row per pair (or the output when top_k == 1).
3. ``_moe_sum_kernel`` as above.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from atom.ops._common import cdiv, next_pow2
from atom.ops.common_triton import dot_flags, exact_fp8_cast, to_fp8_e4m3
from atom.ops.fp8_gemm_triton import num_sms
# the small-batch path (module docstring), its own module
from atom.ops.moe_gemv_triton import (FP8_GEMV_MAX_EXPERT_BYTES, GEMV_AUTO_MAX_TOKENS, GemvConfig,  # noqa: F401
                                      _fused_moe_gemv, expert_bytes,
                                      _moe_gemv1_kernel, _moe_gemv2_kernel, gated_act, gemv_config,
                                      gemv_max_tokens, takes_gemv)
# the grouped path's tile choice and the warm-up's batch sizes, their own module
from atom.ops.moe_tiles import (MOE_CONFIG_EDGES, SMALL_GRID_PROGRAMS_PER_SM, MoeConfig, align_chunk,  # noqa: F401
                                moe_config, small_grid, warm_up_token_counts)

FP8_MAX = 448.0


# --------------------------------------------------------------------------------------------
# fused MoE
# --------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["num_pairs"])
def _moe_align_kernel(ids_ptr, map_ptr, sorted_ptr, expert_ids_ptr, num_post_ptr, num_pairs,
                      num_local, num_global, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr,
                      CHUNK: tl.constexpr, HAS_MAP: tl.constexpr):
    e = tl.program_id(0)
    offs = tl.arange(0, CHUNK)
    offs_e = tl.arange(0, BLOCK_E)
    # pass 1: counts of every local expert (bin num_local collects dropped pairs)
    counts = tl.zeros([BLOCK_E], dtype=tl.int32)
    for c0 in range(0, num_pairs, CHUNK):
        i = c0 + offs
        valid = i < num_pairs
        loc = tl.load(ids_ptr + i, mask=valid, other=-1).to(tl.int32)
        if HAS_MAP:
            # ids outside the map (garbage routing in a warm-up pass) count as absent experts
            loc = tl.load(map_ptr + loc, mask=valid & (loc >= 0) & (loc < num_global), other=-1).to(tl.int32)
        loc = tl.where(valid & (loc >= 0) & (loc < num_local), loc, num_local)
        counts += tl.histogram(loc, BLOCK_E)
    counts = tl.where(offs_e < num_local, counts, 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    start = tl.cumsum(padded, axis=0) - padded
    mine = offs_e == e
    my_start = tl.sum(tl.where(mine, start, 0), axis=0)
    my_count = tl.sum(tl.where(mine, counts, 0), axis=0)
    my_padded = tl.sum(tl.where(mine, padded, 0), axis=0)
    if e == 0:
        tl.store(num_post_ptr, tl.sum(padded, axis=0))
    for b0 in range(my_start, my_start + my_padded, BLOCK_M):
        tl.store(expert_ids_ptr + b0 // BLOCK_M, e)
    # pass 2: my pairs, in pair order, at my_start + rank
    seen = my_count * 0  # an int32 tensor: loop-carried values keep one type
    for c0 in range(0, num_pairs, CHUNK):
        i = c0 + offs
        valid = i < num_pairs
        loc = tl.load(ids_ptr + i, mask=valid, other=-1).to(tl.int32)
        if HAS_MAP:
            loc = tl.load(map_ptr + loc, mask=valid & (loc >= 0) & (loc < num_global), other=-1).to(tl.int32)
        me = (valid & (loc == e)).to(tl.int32)
        rank = tl.cumsum(me, axis=0) - me + seen
        tl.store(sorted_ptr + my_start + rank, i, mask=me != 0)
        seen += tl.sum(me, axis=0)
    # padding entries point past the last pair (rows the GEMMs mask out)
    for p0 in range(my_count, my_padded, CHUNK):
        p = p0 + offs
        tl.store(sorted_ptr + my_start + p, num_pairs + tl.zeros([CHUNK], dtype=tl.int32),
                 mask=p < my_padded)


@triton.jit(do_not_specialize=["num_rows"])
def _group_quant_kernel(x_ptr, q_ptr, s_ptr, num_rows, num_cols, stride_xt, stride_qt, stride_st,
                        GROUP: tl.constexpr, BLOCK_R: tl.constexpr, ROUND: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    g = tl.program_id(1)
    offs = g * GROUP + tl.arange(0, GROUP)
    mask = (rows < num_rows)[:, None] & (offs < num_cols)[None, :]
    r64 = rows.to(tl.int64)[:, None]
    x = tl.load(x_ptr + r64 * stride_xt + offs[None, :], mask=mask, other=0.0).to(tl.float32)
    s = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-10) / 448.0
    q = tl.minimum(tl.maximum(x / s[:, None], -448.0), 448.0)
    tl.store(q_ptr + r64 * stride_qt + offs[None, :], to_fp8_e4m3(q, ROUND), mask=mask)
    tl.store(s_ptr + rows.to(tl.int64) * stride_st + g, s, mask=rows < num_rows)


@triton.jit
def _pid_to_tile(pid, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Grouped ordering: GROUP_M row blocks share their weight tiles while hot in L2."""
    in_group = GROUP_M * num_pid_n
    first_m = (pid // in_group) * GROUP_M
    size_m = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % size_m
    pid_n = (pid % in_group) // size_m
    return pid_m, pid_n


@triton.jit
def _tile_dot(a, b, acc, SWAP_AB: tl.constexpr, PREC: tl.constexpr):
    """``a [M, K] @ b [K, N]`` (+ ``acc``), or with A and B swapped, ``b^T @ a^T`` (+ ``acc [N, M]``): the
    weight tile ``b`` on the MMA's M side (``MoeConfig.swap_ab``). ``acc`` None: the product alone."""
    if SWAP_AB:  # (one return: Triton checks every return's shape, pruned branches too)
        out = tl.dot(tl.trans(b), tl.trans(a), acc, input_precision=PREC)
    else:
        out = tl.dot(a, b, acc, input_precision=PREC)
    return out


@triton.jit
def _tile_scales(a_s, b_s, SWAP_AB: tl.constexpr):
    """The fp8 scales of a :func:`_tile_dot` product: per row of ``a`` times per column of ``b``, in
    the product's orientation."""
    if SWAP_AB:
        out = b_s[:, None] * a_s[None, :]
    else:
        out = a_s[:, None] * b_s[None, :]
    return out


@triton.jit(do_not_specialize=["num_pairs", "num_pid_m"])
def _moe_gemm1_kernel(
    a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, out_ptr, out_scale_ptr, bias_ptr,
    sorted_ptr, expert_ids_ptr, num_post_ptr, num_pairs, hidden, inter, num_pid_m,
    stride_at, stride_ast, stride_we, stride_wn, stride_wse, stride_wsn, stride_wsk,
    stride_ot, stride_ost, stride_be, alpha, limit,
    TOPK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, FP8: tl.constexpr, SCALE_BN: tl.constexpr, QUANT_OUT: tl.constexpr,
    ROUND: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr,
    HAS_BIAS: tl.constexpr, SWIGLUOAI: tl.constexpr, CLAMP: tl.constexpr, SWAP_AB: tl.constexpr,
):
    num_pid_n = tl.cdiv(inter, BLOCK_N)
    pid_m, pid_n = _pid_to_tile(tl.program_id(0), num_pid_m, num_pid_n, GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_post_ptr):
        return
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ptr + offs_m)
    valid = pair < num_pairs
    tok = (pair // TOPK).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = offs_n < inter
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + tok[:, None] * stride_at + offs_k[None, :]
    wg_ptrs = w_ptr + expert * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
    wu_ptrs = wg_ptrs + inter * stride_wn
    if FP8:
        as_ptrs = a_scale_ptr + tok * stride_ast
        sg_ptrs = w_scale_ptr + expert * stride_wse + (offs_n // SCALE_BN) * stride_wsn
        su_ptrs = w_scale_ptr + expert * stride_wse + ((offs_n + inter) // SCALE_BN) * stride_wsn
    # SWAP_AB: the accumulators are transposed, [BLOCK_N, BLOCK_M] = w_tile^T @ a_tile^T, so the
    # weight rows fill the MMA's M side (64/128 rows: Hopper's warpgroup MMA) and the few tokens
    # per expert its N side; one transpose after the K loop restores [BLOCK_M, BLOCK_N]
    if SWAP_AB:
        acc_g = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        kmask = offs_k < hidden - k0
        a = tl.load(a_ptrs, mask=valid[:, None] & kmask[None, :], other=0.0)
        bg = tl.load(wg_ptrs, mask=kmask[:, None] & nmask[None, :], other=0.0)
        bu = tl.load(wu_ptrs, mask=kmask[:, None] & nmask[None, :], other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            bg = bg.to(tl.float32)
            bu = bu.to(tl.float32)
        if FP8:
            kb = k0 // BLOCK_K  # BLOCK_K == block_k: one weight/activation scale per K step
            a_s = tl.load(as_ptrs + kb, mask=valid, other=0.0)
            s_g = tl.load(sg_ptrs + kb * stride_wsk, mask=nmask, other=0.0)
            s_u = tl.load(su_ptrs + kb * stride_wsk, mask=nmask, other=0.0)
            acc_g += _tile_dot(a, bg, None, SWAP_AB, None) * _tile_scales(a_s, s_g, SWAP_AB)
            acc_u += _tile_dot(a, bu, None, SWAP_AB, None) * _tile_scales(a_s, s_u, SWAP_AB)
        else:
            acc_g = _tile_dot(a, bg, acc_g, SWAP_AB, PREC)
            acc_u = _tile_dot(a, bu, acc_u, SWAP_AB, PREC)
        a_ptrs += BLOCK_K
        wg_ptrs += BLOCK_K
        wu_ptrs += BLOCK_K
    if SWAP_AB:
        acc_g = tl.trans(acc_g)
        acc_u = tl.trans(acc_u)
    if HAS_BIAS:
        b_ptrs = bias_ptr + expert * stride_be + offs_n
        acc_g += tl.load(b_ptrs, mask=nmask, other=0.0).to(tl.float32)[None, :]
        acc_u += tl.load(b_ptrs + inter, mask=nmask, other=0.0).to(tl.float32)[None, :]
    h = gated_act(acc_g, acc_u, alpha, limit, SWIGLUOAI, CLAMP)
    o_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_ot + offs_n[None, :]
    if QUANT_OUT:
        # this tile is exactly one activation group of the second GEMM: quantise it here
        s = tl.maximum(tl.max(tl.abs(tl.where(nmask[None, :], h, 0.0)), axis=1), 1e-10) / 448.0
        q = tl.minimum(tl.maximum(h / s[:, None], -448.0), 448.0)
        tl.store(o_ptrs, to_fp8_e4m3(q, ROUND), mask=nmask[None, :])
        tl.store(out_scale_ptr + offs_m.to(tl.int64) * stride_ost + pid_n, s)
    else:
        tl.store(o_ptrs, h.to(out_ptr.dtype.element_ty), mask=nmask[None, :])


@triton.jit(do_not_specialize=["num_pairs", "num_pid_m"])
def _moe_gemm2_kernel(
    a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, out_ptr, topk_w_ptr, bias_ptr,
    sorted_ptr, expert_ids_ptr, num_post_ptr, num_pairs, inter, hidden, num_pid_m,
    stride_at, stride_ast, stride_we, stride_wn, stride_wse, stride_wsn, stride_wsk, stride_ot,
    stride_be,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, FP8: tl.constexpr, SCALE_BN: tl.constexpr,
    UPCAST: tl.constexpr, PREC: tl.constexpr, HAS_BIAS: tl.constexpr, SWAP_AB: tl.constexpr,
):
    num_pid_n = tl.cdiv(hidden, BLOCK_N)
    pid_m, pid_n = _pid_to_tile(tl.program_id(0), num_pid_m, num_pid_n, GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_post_ptr):
        return
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ptr + offs_m)
    valid = pair < num_pairs
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = offs_n < hidden
    offs_k = tl.arange(0, BLOCK_K)
    # the intermediate rows are in sorted order already: a contiguous [BLOCK_M, inter] slab
    a_ptrs = a_ptr + offs_m[:, None].to(tl.int64) * stride_at + offs_k[None, :]
    w_ptrs = w_ptr + expert * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
    if FP8:
        as_ptrs = a_scale_ptr + offs_m.to(tl.int64) * stride_ast
        s_ptrs = w_scale_ptr + expert * stride_wse + (offs_n // SCALE_BN) * stride_wsn
    if SWAP_AB:  # as in GEMM1: a transposed accumulator, weight rows on the MMA's M side
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        kmask = offs_k < inter - k0
        a = tl.load(a_ptrs, mask=kmask[None, :], other=0.0)
        b = tl.load(w_ptrs, mask=kmask[:, None] & nmask[None, :], other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        if FP8:
            kb = k0 // BLOCK_K
            a_s = tl.load(as_ptrs + kb)
            b_s = tl.load(s_ptrs + kb * stride_wsk, mask=nmask, other=0.0)
            acc += _tile_dot(a, b, None, SWAP_AB, None) * _tile_scales(a_s, b_s, SWAP_AB)
        else:
            acc = _tile_dot(a, b, acc, SWAP_AB, PREC)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if SWAP_AB:
        acc = tl.trans(acc)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + expert * stride_be + offs_n, mask=nmask, other=0.0).to(tl.float32)[None, :]
    acc = acc * tl.load(topk_w_ptr + pair, mask=valid, other=0.0)[:, None]
    tl.store(out_ptr + pair[:, None].to(tl.int64) * stride_ot + offs_n[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & nmask[None, :])


@triton.jit
def _moe_sum_kernel(src_ptr, ids_ptr, map_ptr, out_ptr, hidden, num_global, stride_st, stride_ot,
                    TOPK: tl.constexpr, BLOCK_H: tl.constexpr, HAS_MAP: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = offs < hidden
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for j in tl.static_range(TOPK):
        pair = t * TOPK + j
        m = mask
        if HAS_MAP:
            g = tl.load(ids_ptr + pair)
            loc = tl.load(map_ptr + g, mask=(g >= 0) & (g < num_global), other=-1)
            m = m & ((offs * 0 + loc) >= 0)  # broadcast the scalar test to a vector mask
        acc += tl.load(src_ptr + pair * stride_st + offs, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_ot + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def warm_up(w13: torch.Tensor, w2: torch.Tensor, top_k: int, num_experts: int, act_dtype: torch.dtype,
            *, tokens: tuple[int, int] = (1, 0), **kwargs) -> int:
    """Launch :func:`fused_moe_fwd` with these weights at every :func:`warm_up_token_counts`
    size, so that Triton compiles each tile configuration's kernels now and not inside the first
    served batch of that size (batches above vLLM's largest CUDA-graph size are never captured,
    and a 1,024-2,048-token prefill chunk otherwise stalls on the JIT). ``tokens``: the batch
    sizes ``(lo, hi)`` this layout serves (``hi`` 0: no upper end; see
    :func:`~atom.ops.moe_tiles.warm_up_token_counts`). ``kwargs``: the layer's
    :func:`fused_moe_fwd` keywords (expert_map, fp8 scales, biases, activation); the tokens are
    ``act_dtype`` zeros routed over ``num_experts`` (the global count under EP), while the tile
    buckets count ``w13``'s local experts, as :func:`fused_moe_fwd` does. Returns the number of
    launches."""
    hidden, dev = w13.shape[2], w13.device
    counts = warm_up_token_counts(top_k, w13.shape[0], w13.shape[1] // 2, num_sms(dev), tokens)
    for t in counts:
        x = torch.zeros(t, hidden, dtype=act_dtype, device=dev)
        ids = (torch.arange(t * top_k, device=dev, dtype=torch.int32) % num_experts).view(t, top_k)
        weights = torch.full((t, top_k), 1.0 / top_k, dtype=torch.float32, device=dev)
        fused_moe_fwd(x, w13, w2, weights, ids, **kwargs)
    return len(counts)


def group_quant_fp8(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-(row, group of ``group`` columns) fp8 e4m3 quantisation: (q, scales [rows, groups])."""
    rows, cols = x.shape
    groups = cdiv(cols, group)
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(rows, groups, dtype=torch.float32, device=x.device)
    if rows:
        block_r = max(1, min(16, 2048 // group))  # ~2K elements per program
        _group_quant_kernel[(cdiv(rows, block_r), groups)](
            x, q, s, rows, cols, x.stride(0), q.stride(0), s.stride(0),
            GROUP=group, BLOCK_R=block_r, ROUND=exact_fp8_cast(), num_warps=4)
    return q, s


def fused_moe_fwd(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
                  expert_map: Optional[torch.Tensor] = None,
                  w13_scale: Optional[torch.Tensor] = None,
                  w2_scale: Optional[torch.Tensor] = None,
                  block_shape: Optional[list] = None,
                  out: Optional[torch.Tensor] = None,
                  w13_bias: Optional[torch.Tensor] = None,
                  w2_bias: Optional[torch.Tensor] = None,
                  activation: str = "silu",
                  swiglu_alpha: float = 1.702,
                  swiglu_limit: Optional[float] = 7.0,
                  x_fp8: Optional[torch.Tensor] = None,
                  x_fp8_scale: Optional[torch.Tensor] = None,
                  config: "MoeConfig | GemvConfig | None" = None) -> torch.Tensor:
    """Triton :func:`atom.ops.moe.fused_moe`; ``config`` overrides the path and tile choice
    (a :class:`GemvConfig` takes the small-batch path)."""
    num_tokens, hidden = x.shape
    num_local, two_inter, _ = w13.shape
    inter = two_inter // 2
    top_k = topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    num_global = expert_map.numel() if expert_map is not None else num_local  # ids past it: no expert
    if out is None:
        out = torch.empty(num_tokens, hidden, dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return out
    fp8 = block_shape is not None
    scale_bn, scale_bk = (int(block_shape[0]), int(block_shape[1])) if fp8 else (1, 1)
    if isinstance(config, GemvConfig) or (config is None and takes_gemv(num_tokens, top_k, num_global, fp8,
                                                                               expert_bytes(w13, w2))):
        return _fused_moe_gemv(
            x, w13, w2, topk_weights, topk_ids, out, expert_map, num_global,
            w13_scale, w2_scale, (scale_bn, scale_bk) if fp8 else None, w13_bias, w2_bias,
            activation, swiglu_alpha, swiglu_limit, x_fp8, x_fp8_scale,
            config or gemv_config(scale_bk if fp8 else None, x.dtype))
    # Tiles by pairs / *local* experts, also under EP, where that is EP times the true tokens per
    # expert: dividing by the global count instead was measured on an EP=2 rank (H100, bench/NOTES.md
    # entry 22) as a tie or a few % at most batch sizes and 1.46x slower for fp8 at 1,024 tokens
    # (the table's 64-tokens-per-expert fp8 tile is the slow one there, not the count).
    dev = x.device
    cfg = config or moe_config(num_tokens, top_k, num_local, scale_bk if fp8 else None, x.dtype, inter, num_sms(dev))
    bm = cfg.block_m
    upcast, prec = dot_flags(x.dtype)

    # 1. sort pairs by expert, blocks of bm rows
    max_padded = (cdiv(num_pairs, bm) + min(num_local, num_pairs)) * bm
    num_pid_m = max_padded // bm
    sorted_ids = torch.empty(max_padded, dtype=torch.int32, device=dev)
    expert_ids = torch.empty(num_pid_m, dtype=torch.int32, device=dev)
    num_post = torch.empty(1, dtype=torch.int32, device=dev)
    ids_flat = topk_ids.reshape(-1)
    if not ids_flat.is_contiguous():
        ids_flat = ids_flat.contiguous()
    _moe_align_kernel[(num_local,)](
        ids_flat, expert_map if expert_map is not None else ids_flat, sorted_ids, expert_ids,
        num_post, num_pairs, num_local, num_global,
        BLOCK_M=bm, BLOCK_E=next_pow2(num_local + 1), CHUNK=align_chunk(num_pairs),
        HAS_MAP=expert_map is not None, num_warps=4,
    )

    # 2. activations (fp8: per token-group quantisation)
    if fp8 and x_fp8 is not None:  # quantised by the producer of x (atom.ops.fused_quant)
        a1, a1_s = x_fp8, x_fp8_scale if x_fp8_scale.stride(-1) == 1 else x_fp8_scale.contiguous()
        w13_s = w13_scale
        ws1 = (w13_s.stride(0), w13_s.stride(1), w13_s.stride(2))
    elif fp8:
        a1, a1_s = group_quant_fp8(x, scale_bk)
        w13_s = w13_scale
        ws1 = (w13_s.stride(0), w13_s.stride(1), w13_s.stride(2))
    else:
        a1, a1_s, w13_s, ws1 = x, x, x, (0, 0, 0)

    # 3. gate/up GEMM + silu-and-mul (+ fp8 quantisation of its output)
    quant_in_gemm1 = fp8 and cfg.block_n1 == scale_bk
    if quant_in_gemm1:
        inter_buf = torch.empty(max_padded, inter, dtype=torch.float8_e4m3fn, device=dev)
        inter_s = torch.empty(max_padded, cdiv(inter, scale_bk), dtype=torch.float32, device=dev)
    elif fp8:
        inter_buf = torch.empty(max_padded, inter, dtype=torch.float32, device=dev)
        inter_s = inter_buf
    else:
        inter_buf = torch.empty(max_padded, inter, dtype=x.dtype, device=dev)
        inter_s = inter_buf
    grid1 = (num_pid_m * cdiv(inter, cfg.block_n1),)
    swigluoai = activation == "swigluoai"
    clamp = swigluoai and swiglu_limit is not None
    _moe_gemm1_kernel[grid1](
        a1, a1_s, w13, w13_s, inter_buf, inter_s, w13_bias if w13_bias is not None else x,
        sorted_ids, expert_ids, num_post, num_pairs,
        hidden, inter, num_pid_m,
        a1.stride(0), a1_s.stride(0) if fp8 else 0, w13.stride(0), w13.stride(1), *ws1,
        inter_buf.stride(0), inter_s.stride(0) if quant_in_gemm1 else 0,
        w13_bias.stride(0) if w13_bias is not None else 0,
        float(swiglu_alpha) if swigluoai else 1.0, float(swiglu_limit) if clamp else 0.0,
        TOPK=top_k, BLOCK_M=bm, BLOCK_N=cfg.block_n1, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        FP8=fp8, SCALE_BN=scale_bn, QUANT_OUT=quant_in_gemm1, ROUND=exact_fp8_cast(),
        UPCAST=upcast, PREC=prec, HAS_BIAS=w13_bias is not None, SWIGLUOAI=swigluoai, CLAMP=clamp,
        SWAP_AB=cfg.swap_ab, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if fp8 and not quant_in_gemm1:
        inter_buf, inter_s = group_quant_fp8(inter_buf, scale_bk)

    # 4. down GEMM, routing weight in the epilogue, one row per pair
    direct = top_k == 1 and expert_map is None
    dst = out if direct else torch.empty(num_pairs, hidden, dtype=x.dtype, device=dev)
    if fp8:
        ws2 = (w2_scale.stride(0), w2_scale.stride(1), w2_scale.stride(2))
        w2_s = w2_scale
    else:
        ws2, w2_s = (0, 0, 0), x
    tw = topk_weights.reshape(-1)
    if tw.dtype != torch.float32 or not tw.is_contiguous():
        tw = tw.float().contiguous()
    grid2 = (num_pid_m * cdiv(hidden, cfg.block_n2),)
    _moe_gemm2_kernel[grid2](
        inter_buf, inter_s, w2, w2_s, dst, tw, w2_bias if w2_bias is not None else x,
        sorted_ids, expert_ids, num_post, num_pairs,
        inter, hidden, num_pid_m,
        inter_buf.stride(0), inter_s.stride(0) if fp8 else 0, w2.stride(0), w2.stride(1), *ws2,
        dst.stride(0), w2_bias.stride(0) if w2_bias is not None else 0,
        BLOCK_M=bm, BLOCK_N=cfg.block_n2, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, FP8=fp8,
        SCALE_BN=scale_bn, UPCAST=upcast, PREC=prec, HAS_BIAS=w2_bias is not None, SWAP_AB=cfg.swap_ab,
        num_warps=cfg.num_warps2 or cfg.num_warps, num_stages=cfg.num_stages2 or cfg.num_stages,
    )

    # 5. sum the top_k rows of each token
    if not direct:
        block_h = min(1024, next_pow2(hidden))
        _moe_sum_kernel[(num_tokens, cdiv(hidden, block_h))](
            dst, ids_flat, expert_map if expert_map is not None else ids_flat, out, hidden,
            num_global,
            dst.stride(0), out.stride(0), TOPK=top_k, BLOCK_H=block_h,
            HAS_MAP=expert_map is not None, num_warps=4,
        )
    return out

