"""The mixture-of-experts layer shared by atom's MoE models: stacked expert weights, softmax
top-k routing and the fused expert MLP (:func:`atom.ops.topk_softmax`, :func:`atom.ops.fused_moe`).

Weights are stacked per layer, the layout :func:`atom.ops.fused_moe` takes: ``w13`` is
``[local_experts, 2 * local_inter, hidden]`` (each expert's gate rows, then its up rows) and
``w2`` is ``[local_experts, hidden, local_inter]``. They are filled at load from the
checkpoint's per-expert matrices (:meth:`FusedMoE.checkpoint_params` names them).

Parallelism (the MoE output is a sum of partial results, reduced once per layer):

* tensor parallel (default): every rank holds every expert, with its intermediate dim split
  like a column-parallel gate/up and a row-parallel down; the partial outputs are summed over
  the TP group.
* expert parallel (``use_expert_parallel``): rank r holds a contiguous block of whole experts;
  ``expert_map`` (global id -> local id, -1 elsewhere) makes the others contribute zero, and the
  partial outputs are summed over the EP group. Every rank sees every token (the all-reduce
  scheme, not all-to-all dispatch), so the EP group must hold the same tokens on every rank.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Optional

import torch
from torch import nn

from atom import ops
from atom.models._linear import divide
from atom.models._loading import StackedParams
from atom.models.interfaces import ModelParallel

#: Position of each checkpoint matrix in an expert's stacked weights (shard id = (expert, this)).
GATE, UP, DOWN = 0, 1, 2


class FusedMoE(nn.Module):
    """Routed experts with SwiGLU: ``out = sum_k w_k * down_e(silu(gate_e x) * up_e x)``.

    Args:
        num_experts: global expert count.
        top_k: experts per token.
        hidden_size, intermediate_size: the model dim and one expert's intermediate dim.
        parallel: this rank's TP/EP position and groups.
        renormalize: rescale the top-k softmax weights to sum 1 (Qwen3's ``norm_topk_prob``).
        use_expert_parallel: split experts across the EP group instead of splitting each expert
            across the TP group.
    """

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        parallel: ModelParallel,
        *,
        renormalize: bool,
        use_expert_parallel: bool = False,
        dtype: Optional[torch.dtype] = None,
    ) -> None:
        super().__init__()
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        if use_expert_parallel:
            self.num_local_experts = divide(num_experts, parallel.ep_size, "num_experts (over the EP size)")
            self.expert_start = parallel.ep_rank * self.num_local_experts
            self.local_inter, self.inter_start = intermediate_size, 0
            self.reduce_group = parallel.ep_group if parallel.ep_size > 1 else None
        else:
            self.num_local_experts, self.expert_start = num_experts, 0
            self.local_inter = divide(intermediate_size, parallel.tp_size, "moe intermediate size")
            self.inter_start = parallel.tp_rank * self.local_inter
            self.reduce_group = parallel.tp_group if parallel.tp_size > 1 else None
        e, i = self.num_local_experts, self.local_inter
        self.w13 = nn.Parameter(torch.empty(e, 2 * i, hidden_size, dtype=dtype), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(e, hidden_size, i, dtype=dtype), requires_grad=False)
        if e < num_experts:
            # A buffer, not a parameter: derived from the layout, never in a checkpoint.
            expert_map = torch.full((num_experts,), -1, dtype=torch.int32)
            expert_map[self.expert_start:self.expert_start + e] = torch.arange(e, dtype=torch.int32)
            self.register_buffer("expert_map", expert_map, persistent=False)
        else:
            self.expert_map = None

    @staticmethod
    def checkpoint_params(num_experts: int, module: str = "experts") -> StackedParams:
        """How HF's ``{module}.{e}.{gate,up,down}_proj.weight`` land in ``{module}.w13/w2``."""
        params = []
        for e in range(num_experts):
            params += [
                (f"{module}.w13", f"{module}.{e}.gate_proj.weight", (e, GATE)),
                (f"{module}.w13", f"{module}.{e}.up_proj.weight", (e, UP)),
                (f"{module}.w2", f"{module}.{e}.down_proj.weight", (e, DOWN)),
            ]
        return params

    def load_weight(self, param_name: str, loaded: torch.Tensor, shard_id: Optional[Hashable] = None) -> None:
        """Copy this rank's part of one expert's checkpoint matrix (others' experts: nothing)."""
        expert, which = shard_id
        local = expert - self.expert_start
        if not 0 <= local < self.num_local_experts:
            return
        i, start = self.local_inter, self.inter_start
        if which == DOWN:
            src, dst = loaded.narrow(1, start, i), self.w2.data[local]
        else:
            src, dst = loaded.narrow(0, start, i), self.w13.data[local].narrow(0, which * i, i)
        if dst.shape != src.shape:
            raise ValueError(f"expert {expert} {param_name}[{which}]: checkpoint slice {tuple(src.shape)} "
                             f"!= expected {tuple(dst.shape)}")
        dst.copy_(src)

    def forward(self, hidden_states: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """Softmax top-k routing of ``router_logits``, then the experts."""
        topk_weights, topk_ids = ops.topk_softmax(router_logits, self.top_k, self.renormalize)
        return self.forward_routed(hidden_states, topk_weights, topk_ids)

    def forward_routed(self, hidden_states: torch.Tensor, topk_weights: torch.Tensor,
                       topk_ids: torch.Tensor) -> torch.Tensor:
        """The experts for routes chosen by the caller (``[T, top_k]`` weights and global expert
        ids; models with their own routing, e.g. DeepSeek's grouped sigmoid top-k)."""
        out = ops.fused_moe(hidden_states, self.w13, self.w2, topk_weights, topk_ids, expert_map=self.expert_map)
        if self.reduce_group is not None:
            out = self.reduce_group.all_reduce(out)
        return out

    def extra_repr(self) -> str:
        return (f"experts={self.num_local_experts}/{self.num_experts} from {self.expert_start}, "
                f"top_k={self.top_k}, local_inter={self.local_inter}")
