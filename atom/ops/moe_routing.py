"""Mixture-of-experts routing: softmax top-k (Qwen3-MoE, Mixtral, GPT-OSS) and DeepSeek-V3's
bias-corrected grouped sigmoid top-k. Each returns ``(topk_weights float32 [T, k], topk_ids int32
[T, k])`` for :func:`atom.ops.moe.fused_moe`.
"""

from __future__ import annotations

from typing import Optional

import torch

from atom.ops._common import FLOAT_DTYPES
from atom.ops._dispatch import declare

__all__ = ["topk_softmax", "grouped_topk_sigmoid", "topk_softmax_torch", "grouped_topk_sigmoid_torch"]


@declare("topk_softmax", doc="MoE routing: softmax over experts, top-k, optional renormalisation.")
def topk_softmax(router_logits: torch.Tensor, top_k: int,
                 renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over experts (float32), then the ``top_k`` largest; optionally renormalised to sum 1."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    w, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        w = w / w.sum(dim=-1, keepdim=True)
    return w, ids.to(torch.int32)


topk_softmax_torch = topk_softmax.reference


@declare("grouped_topk_sigmoid", doc="DeepSeek-V3 routing: sigmoid scores, bias-corrected group-limited top-k.")
def grouped_topk_sigmoid(router_logits: torch.Tensor, correction_bias: torch.Tensor,
                         top_k: int, num_groups: int, topk_groups: int,
                         routed_scaling_factor: float,
                         renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 routing.

    ``score = sigmoid(logits)``; groups are ranked by the sum of their two best ``score +
    bias``; within the ``topk_groups`` best groups the ``top_k`` experts with the largest
    ``score + bias`` are chosen; their weights are the scores *without* bias, renormalised to
    sum 1 when ``renormalize``, times ``routed_scaling_factor``.
    """
    num_tokens, num_experts = router_logits.shape
    _check_groups(num_experts, num_groups, topk_groups, top_k)
    score = torch.sigmoid(router_logits.float())
    choice = score + correction_bias.float()[None, :]
    grouped = choice.view(num_tokens, num_groups, num_experts // num_groups)
    group_score = grouped.topk(2, dim=-1).values.sum(dim=-1)
    top_groups = group_score.topk(topk_groups, dim=-1).indices
    group_mask = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, top_groups, True)
    expert_mask = group_mask.repeat_interleave(num_experts // num_groups, dim=1)
    ids = choice.masked_fill(~expert_mask, float("-inf")).topk(top_k, dim=-1).indices
    w = score.gather(1, ids)
    if renormalize:
        w = w / w.sum(dim=-1, keepdim=True)
    return w * routed_scaling_factor, ids.to(torch.int32)


grouped_topk_sigmoid_torch = grouped_topk_sigmoid.reference


def _check_groups(num_experts: int, num_groups: int, topk_groups: int, top_k: int) -> None:
    if num_experts % num_groups:
        raise ValueError(f"num_experts {num_experts} is not a multiple of num_groups {num_groups}")
    if num_experts // num_groups < 2:
        raise ValueError("grouped top-k ranks groups by their two best experts: groups of >= 2")
    if not 1 <= topk_groups <= num_groups:
        raise ValueError(f"topk_groups {topk_groups} not in [1, {num_groups}]")
    if top_k > topk_groups * (num_experts // num_groups):
        raise ValueError(f"top_k {top_k} exceeds the experts of {topk_groups} groups")


def _routing_triton_supports(router_logits: torch.Tensor, *args, **kwargs) -> Optional[str]:
    if router_logits.stride(-1) != 1:
        return "router_logits must have a unit-stride expert dimension"
    if router_logits.shape[-1] > 4096:
        return f"{router_logits.shape[-1]} experts (> 4096) in one tile"
    return None


@topk_softmax.triton(supports=_routing_triton_supports, dtypes=FLOAT_DTYPES)
def _topk_softmax_triton(router_logits: torch.Tensor, top_k: int,
                         renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    from atom.ops.moe_routing_triton import topk_softmax_fwd

    return topk_softmax_fwd(router_logits, top_k, renormalize)


def _grouped_triton_supports(router_logits: torch.Tensor, correction_bias: torch.Tensor,
                             top_k: int, num_groups: int, *args, **kwargs) -> Optional[str]:
    why = _routing_triton_supports(router_logits)
    if why:
        return why
    e = router_logits.shape[-1]
    if e & (e - 1) or num_groups & (num_groups - 1):
        return f"num_experts ({e}) and num_groups ({num_groups}) must be powers of two"
    return None


@grouped_topk_sigmoid.triton(supports=_grouped_triton_supports, dtypes=FLOAT_DTYPES)
def _grouped_topk_sigmoid_triton(router_logits: torch.Tensor, correction_bias: torch.Tensor,
                                 top_k: int, num_groups: int, topk_groups: int,
                                 routed_scaling_factor: float,
                                 renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    _check_groups(router_logits.shape[1], num_groups, topk_groups, top_k)
    from atom.ops.moe_routing_triton import grouped_topk_sigmoid_fwd

    return grouped_topk_sigmoid_fwd(router_logits, correction_bias, top_k, num_groups,
                                    topk_groups, routed_scaling_factor, renormalize)


@topk_softmax.aiter
def _topk_softmax_aiter(router_logits: torch.Tensor, top_k: int,
                        renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    import aiter  # noqa: deferred: ROCm only

    t = router_logits.shape[0]
    w = torch.empty(t, top_k, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(t, top_k, dtype=torch.int32, device=router_logits.device)
    token_expert = torch.empty(t, top_k, dtype=torch.int32, device=router_logits.device)
    aiter.topk_softmax(w, ids, token_expert, router_logits, renormalize)
    return w, ids


@grouped_topk_sigmoid.aiter
def _grouped_topk_sigmoid_aiter(router_logits: torch.Tensor, correction_bias: torch.Tensor,
                                top_k: int, num_groups: int, topk_groups: int,
                                routed_scaling_factor: float,
                                renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    import aiter  # noqa: deferred: ROCm only

    t = router_logits.shape[0]
    w = torch.empty(t, top_k, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(t, top_k, dtype=torch.int32, device=router_logits.device)
    aiter.biased_grouped_topk(router_logits, correction_bias.to(router_logits.dtype), w, ids,
                              num_groups, topk_groups, renormalize, routed_scaling_factor)
    return w, ids


