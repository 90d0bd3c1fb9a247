"""Qwen3-MoE: atom's implementation of HF ``Qwen3MoeForCausalLM``.

Qwen3's decoder (:mod:`atom.models.qwen3`: QK-norm attention, fused norms, vocab-parallel
embedding and head, tied head) except for the feed-forward block of the sparse layers: a router
linear (no bias) -> softmax top-k (renormalised when ``norm_topk_prob``) -> SwiGLU experts
(:class:`atom.models._moe.FusedMoE`). Layer i is sparse unless it is in ``mlp_only_layers`` or
``(i + 1) % decoder_sparse_step != 0``; dense layers use the SwiGLU MLP with ``intermediate_size``.

Parallelism: attention as in Qwen3; experts split per expert across the TP group, or, with the
config's ``enable_expert_parallel``, whole experts split across the EP group.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from atom.config import Config
from atom.models._decoder import STACKED_PARAMS, AttentionOptions, LlamaFamilyForCausalLM
from atom.models._linear import ReplicatedLinear
from atom.models._loading import StackedParams
from atom.models._moe import FusedMoE
from atom.models._quant import Fp8Spec, layer_spec
from atom.models.interfaces import ModelParallel
from atom.models.qwen3 import DEFAULT_ROPE_THETA, qwen3_attention
from atom.ops.fused_quant import Activation, plain


def num_experts(hf_config: Any) -> int:
    # transformers writes the count as ``num_local_experts`` in config.json (aliased to
    # ``num_experts`` on its config object); a plain namespace may carry either.
    return int(getattr(hf_config, "num_experts", None) or getattr(hf_config, "num_local_experts", 0) or 0)


def is_sparse_layer(hf_config: Any, layer_idx: int) -> bool:
    """HF's rule for which decoder layers route through experts."""
    step = int(getattr(hf_config, "decoder_sparse_step", 1) or 1)
    return (
        layer_idx not in (getattr(hf_config, "mlp_only_layers", None) or [])
        and num_experts(hf_config) > 0
        and (layer_idx + 1) % step == 0
    )


class Qwen3MoeSparseMoeBlock(nn.Module):
    """HF names: ``mlp.gate.weight`` (router), ``mlp.experts.{e}.{gate,up,down}_proj.weight``."""

    def __init__(self, hf_config: Any, parallel: ModelParallel, use_expert_parallel: bool,
                 dtype: Optional[torch.dtype], quant: Optional[Fp8Spec] = None, checkpoint_prefix: str = "") -> None:
        super().__init__()
        act = getattr(hf_config, "hidden_act", "silu")
        if act != "silu":
            raise NotImplementedError(f"atom's Qwen3-MoE experts implement hidden_act='silu', not {act!r}")
        n = num_experts(hf_config)
        # Replicated: every rank routes every token itself, so no collective precedes the experts.
        # The router stays unquantised in fp8 checkpoints.
        self.gate = ReplicatedLinear(hf_config.hidden_size, n, dtype=dtype)
        self.experts = FusedMoE(
            n, hf_config.num_experts_per_tok, hf_config.hidden_size, hf_config.moe_intermediate_size, parallel,
            renormalize=bool(getattr(hf_config, "norm_topk_prob", True)),
            use_expert_parallel=use_expert_parallel, dtype=dtype,
            quant=layer_spec(quant, checkpoint_prefix,
                             [f"experts.{e}.{p}" for e in range(n) for p in ("gate_proj", "up_proj", "down_proj")]),
        )

    def fp8_input_readers(self) -> list[Any]:
        return [self.experts]  # the router reads the activation-dtype form

    def forward(self, hidden_states: Activation) -> torch.Tensor:
        return self.experts(hidden_states, self.gate(plain(hidden_states)))


class Qwen3MoeForCausalLM(LlamaFamilyForCausalLM):
    """HF ``Qwen3MoeForCausalLM``; constructor as :class:`atom.models.qwen3.Qwen3ForCausalLM`.
    ``config.enable_expert_parallel`` selects expert parallelism over ``parallel.ep_group``."""

    default_rope_theta = DEFAULT_ROPE_THETA

    def attention_options(self, hf_config: Any) -> AttentionOptions:
        return qwen3_attention(hf_config)

    def build_mlp(self, layer_idx: int, config: Config, parallel: ModelParallel) -> nn.Module:
        if not is_sparse_layer(config.hf_config, layer_idx):
            return super().build_mlp(layer_idx, config, parallel)
        return Qwen3MoeSparseMoeBlock(config.hf_config, parallel, config.enable_expert_parallel, config.dtype,
                                      self.quant, f"model.layers.{layer_idx}.mlp")

    def stacked_params(self) -> StackedParams:
        # Expert entries first: ``experts.3.gate_proj`` would otherwise match the dense
        # ``gate_proj`` -> ``gate_up_proj`` entry.
        return [*FusedMoE.checkpoint_params(num_experts(self.hf_config), quant=self.quant), *STACKED_PARAMS]
