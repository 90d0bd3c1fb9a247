"""Triton kernels for MoE routing (imported lazily by :mod:`atom.ops.moe_routing`): one program
per block of tokens computes their scores over every expert and the top-k in registers."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atom.ops._common import cdiv, next_pow2



@triton.jit(do_not_specialize=["num_tokens"])
def _topk_softmax_kernel(logits_ptr, w_ptr, ids_ptr, num_tokens, num_experts,
                         stride_lt, stride_wt, stride_it,
                         TOPK: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr,
                         BLOCK_E: tl.constexpr, RENORM: tl.constexpr):
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_e = tl.arange(0, BLOCK_E)
    offs_k = tl.arange(0, BLOCK_K)
    tmask = offs_t < num_tokens
    emask = offs_e < num_experts
    x = tl.load(logits_ptr + offs_t[:, None].to(tl.int64) * stride_lt + offs_e[None, :],
                mask=tmask[:, None] & emask[None, :], other=0.0).to(tl.float32)
    x = tl.where(emask[None, :], x, float("-inf"))
    p = tl.exp(x - tl.max(x, axis=1)[:, None])
    p = p / tl.sum(p, axis=1)[:, None]
    # NaN scores (garbage hidden states: vLLM's warm-up passes before CUDA-graph capture get
    # uninitialised all-reduce outputs) rank lowest, so the chosen ids stay valid expert ids
    sel = tl.where(emask[None, :], tl.where(p == p, p, -1.0), -3.0)
    w = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.float32)
    ids = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.int32)
    for k in tl.static_range(TOPK):
        best = tl.max(sel, axis=1)
        # lowest expert index among equal maxima: deterministic tie-break
        idx = tl.min(tl.where(sel == best[:, None], offs_e[None, :], BLOCK_E), axis=1)
        idx = tl.minimum(idx, num_experts - 1)
        w = tl.where(offs_k[None, :] == k, best[:, None], w)
        ids = tl.where(offs_k[None, :] == k, idx[:, None], ids)
        sel = tl.where(offs_e[None, :] == idx[:, None], -2.0, sel)
    if RENORM:
        w = w / tl.sum(w, axis=1)[:, None]
    kmask = tmask[:, None] & (offs_k[None, :] < TOPK)
    tl.store(w_ptr + offs_t[:, None].to(tl.int64) * stride_wt + offs_k[None, :], w, mask=kmask)
    tl.store(ids_ptr + offs_t[:, None].to(tl.int64) * stride_it + offs_k[None, :], ids, mask=kmask)


@triton.jit(do_not_specialize=["num_tokens"])
def _grouped_topk_sigmoid_kernel(logits_ptr, bias_ptr, w_ptr, ids_ptr, num_tokens, scaling,
                                 stride_lt, stride_wt, stride_it,
                                 TOPK: tl.constexpr, BLOCK_K: tl.constexpr,
                                 NUM_EXPERTS: tl.constexpr, GROUPS: tl.constexpr,
                                 GROUP_SIZE: tl.constexpr, TOPK_GROUPS: tl.constexpr,
                                 BLOCK_T: tl.constexpr, RENORM: tl.constexpr):
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_e = tl.arange(0, NUM_EXPERTS)
    offs_k = tl.arange(0, BLOCK_K)
    tmask = offs_t < num_tokens
    x = tl.load(logits_ptr + offs_t[:, None].to(tl.int64) * stride_lt + offs_e[None, :],
                mask=tmask[:, None], other=0.0).to(tl.float32)
    score = tl.sigmoid(x)
    choice = score + tl.load(bias_ptr + offs_e).to(tl.float32)[None, :]

    # group score = sum of the two best (score + bias) of the group
    g = tl.reshape(choice, (BLOCK_T, GROUPS, GROUP_SIZE))
    j = tl.arange(0, GROUP_SIZE)[None, None, :]
    top1 = tl.max(g, axis=2)
    first = tl.min(tl.where(g == top1[:, :, None], j, GROUP_SIZE), axis=2)
    top2 = tl.max(tl.where(j == first[:, :, None], float("-inf"), g), axis=2)
    gscore = top1 + top2
    offs_g = tl.arange(0, GROUPS)
    gsel = tl.zeros([BLOCK_T, GROUPS], dtype=tl.int32)
    for _ in tl.static_range(TOPK_GROUPS):
        best = tl.max(gscore, axis=1)
        gi = tl.min(tl.where(gscore == best[:, None], offs_g[None, :], GROUPS), axis=1)
        hit = offs_g[None, :] == gi[:, None]
        gsel = tl.where(hit, 1, gsel)
        gscore = tl.where(hit, float("-inf"), gscore)
    allowed = tl.reshape(tl.broadcast_to(gsel[:, :, None], (BLOCK_T, GROUPS, GROUP_SIZE)),
                         (BLOCK_T, NUM_EXPERTS))
    sel = tl.where(allowed != 0, choice, float("-inf"))

    w = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.float32)
    ids = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.int32)
    for k in tl.static_range(TOPK):
        best = tl.max(sel, axis=1)
        idx = tl.min(tl.where(sel == best[:, None], offs_e[None, :], NUM_EXPERTS), axis=1)
        # NaN scores (garbage hidden states in vLLM's pre-capture warm-up) match no maximum:
        # keep the id a valid expert
        idx = tl.minimum(idx, NUM_EXPERTS - 1)
        hit = offs_e[None, :] == idx[:, None]
        wk = tl.sum(tl.where(hit, score, 0.0), axis=1)  # weight: the score without bias
        w = tl.where(offs_k[None, :] == k, wk[:, None], w)
        ids = tl.where(offs_k[None, :] == k, idx[:, None], ids)
        sel = tl.where(hit, float("-inf"), sel)
    if RENORM:
        w = w / tl.sum(w, axis=1)[:, None]
    w = w * scaling
    kmask = tmask[:, None] & (offs_k[None, :] < TOPK)
    tl.store(w_ptr + offs_t[:, None].to(tl.int64) * stride_wt + offs_k[None, :], w, mask=kmask)
    tl.store(ids_ptr + offs_t[:, None].to(tl.int64) * stride_it + offs_k[None, :], ids, mask=kmask)


def _routes(router_logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor, tuple[int], int]:
    """The outputs ``(weights float32 [T, k], ids int32 [T, k])`` of a routing launch, its grid
    and its tokens per program (about 4K logits per program)."""
    num_tokens, num_experts = router_logits.shape
    w = torch.empty(num_tokens, top_k, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=router_logits.device)
    block_t = max(1, min(64, 4096 // next_pow2(num_experts)))
    return w, ids, (cdiv(num_tokens, block_t),), block_t


def topk_softmax_fwd(router_logits: torch.Tensor, top_k: int,
                     renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton :func:`atom.ops.moe_routing.topk_softmax`."""
    num_tokens, num_experts = router_logits.shape
    w, ids, grid, block_t = _routes(router_logits, top_k)
    if num_tokens == 0:
        return w, ids
    _topk_softmax_kernel[grid](
        router_logits, w, ids, num_tokens, num_experts,
        router_logits.stride(0), w.stride(0), ids.stride(0),
        TOPK=top_k, BLOCK_K=next_pow2(top_k), BLOCK_T=block_t, BLOCK_E=next_pow2(num_experts),
        RENORM=bool(renormalize), num_warps=4,
    )
    return w, ids


def grouped_topk_sigmoid_fwd(router_logits: torch.Tensor, correction_bias: torch.Tensor,
                             top_k: int, num_groups: int, topk_groups: int,
                             routed_scaling_factor: float,
                             renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton :func:`atom.ops.moe_routing.grouped_topk_sigmoid`."""
    num_tokens, num_experts = router_logits.shape
    w, ids, grid, block_t = _routes(router_logits, top_k)
    if num_tokens == 0:
        return w, ids
    _grouped_topk_sigmoid_kernel[grid](
        router_logits, correction_bias, w, ids, num_tokens, float(routed_scaling_factor),
        router_logits.stride(0), w.stride(0), ids.stride(0),
        TOPK=top_k, BLOCK_K=next_pow2(top_k), NUM_EXPERTS=num_experts, GROUPS=num_groups,
        GROUP_SIZE=num_experts // num_groups, TOPK_GROUPS=topk_groups, BLOCK_T=block_t,
        RENORM=bool(renormalize), num_warps=4,
    )
    return w, ids
