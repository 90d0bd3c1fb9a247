"""Mixtral: atom's implementation of HF ``MixtralForCausalLM``.

Llama's attention (:mod:`atom.models.llama`, no biases) with a sparse MoE block in every layer:
a router linear (no bias) -> softmax over all experts -> top-k, renormalised to sum 1 -> SwiGLU
experts (:class:`atom.models._moe.FusedMoE`). Checkpoint names: ``block_sparse_moe.gate.weight``
and ``block_sparse_moe.experts.{e}.{w1,w3,w2}.weight`` (gate, up, down); the ``gate_proj`` /
``up_proj`` / ``down_proj`` spelling some quantized exports use is accepted too.

``sliding_window`` in the config is not passed per layer: the host applies its model-level
default (vLLM: the cache config's sliding window, taken from the same field), as for vLLM's Mixtral.
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
from atom.models.interfaces import ModelParallel
from atom.models.llama import DEFAULT_ROPE_THETA, llama_attention

#: HF's name of the feed-forward block, which atom's decoder layer holds as ``mlp``.
CHECKPOINT_BLOCK = ".block_sparse_moe."


class MixtralSparseMoeBlock(nn.Module):
    """Router ``gate`` (replicated: every rank routes every token) + ``experts``."""

    def __init__(self, hf_config: Any, parallel: ModelParallel, use_expert_parallel: bool,
                 dtype: Optional[torch.dtype]) -> None:
        super().__init__()
        act = getattr(hf_config, "hidden_act", "silu")
        if act != "silu":
            raise NotImplementedError(f"atom's Mixtral experts implement hidden_act='silu', not {act!r}")
        n = hf_config.num_local_experts
        self.gate = ReplicatedLinear(hf_config.hidden_size, n, dtype=dtype)
        self.experts = FusedMoE(
            n, hf_config.num_experts_per_tok, hf_config.hidden_size, hf_config.intermediate_size, parallel,
            renormalize=True, use_expert_parallel=use_expert_parallel, dtype=dtype,
        )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.experts(hidden_states, self.gate(hidden_states))


class MixtralForCausalLM(LlamaFamilyForCausalLM):
    """HF ``MixtralForCausalLM``; constructor as :class:`atom.models.qwen3.Qwen3ForCausalLM`.
    ``config.enable_expert_parallel`` selects expert parallelism over ``parallel.ep_group``."""

    default_rope_theta = DEFAULT_ROPE_THETA
    checkpoint_renames = ((CHECKPOINT_BLOCK, ".mlp."),)

    def attention_options(self, hf_config: Any) -> AttentionOptions:
        return llama_attention(hf_config)

    def build_mlp(self, layer_idx: int, config: Config, parallel: ModelParallel) -> nn.Module:
        return MixtralSparseMoeBlock(config.hf_config, parallel, config.enable_expert_parallel, config.dtype)

    def stacked_params(self) -> StackedParams:
        # Expert entries before the dense ones (``experts.3.gate_proj`` is not ``gate_proj``).
        n = self.hf_config.num_local_experts
        return [*FusedMoE.checkpoint_params(n, names=("w1", "w3", "w2")), *FusedMoE.checkpoint_params(n),
                *STACKED_PARAMS]
