"""GLM-4-MoE (GLM-4.5 / 4.6): atom's implementation of HF ``Glm4MoeForCausalLM``.

The Llama-family decoder of :mod:`atom.models._decoder` with, per the HF config:

* attention: biases on q/k/v_proj when ``attention_bias`` (never on o_proj); per-head RMSNorm of
  q and k when ``use_qk_norm``; NeoX RoPE on the first ``partial_rotary_factor`` (default 0.5,
  as HF and vLLM assume) of each head's dims;
* feed-forward: layers ``< first_k_dense_replace`` a dense SwiGLU MLP (``intermediate_size``);
  the others a sparse block: ``n_routed_experts`` SwiGLU experts (``moe_intermediate_size``)
  chosen by sigmoid grouped top-k routing with ``e_score_correction_bias`` (``n_group``,
  ``topk_group``, ``norm_topk_prob``, weights times ``routed_scaling_factor``:
  :class:`atom.models._moe.GroupedTopkRouter`), plus a shared expert of
  ``n_shared_experts * moe_intermediate_size`` that every token goes through.

Checkpoints may carry ``num_nextn_predict_layers`` multi-token-prediction layers after the last
decoder layer (``model.layers.{num_hidden_layers + i}.*``); as in vLLM's model they are skipped
(speculative decoding with them is not implemented).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from atom.config import Config
from atom.models._decoder import STACKED_PARAMS, AttentionOptions, GatedMLP, LlamaFamilyForCausalLM
from atom.models._loading import StackedParams
from atom.models._moe import FusedMoE, GroupedTopkRouter, fuses_shared_experts, routed_and_shared
from atom.models.interfaces import AttentionFactory, ModelParallel

#: RoPE base and rotated fraction of each head when a config omits them (HF Glm4MoeConfig's).
DEFAULT_ROPE_THETA = 10000.0
DEFAULT_PARTIAL_ROTARY_FACTOR = 0.5


class Glm4MoeSparseMoeBlock(nn.Module):
    """HF names: ``mlp.gate.{weight,e_score_correction_bias}``,
    ``mlp.experts.{e}.{gate,up,down}_proj.weight``, ``mlp.shared_experts.{gate,up,down}_proj.weight``."""

    def __init__(self, hf_config: Any, parallel: ModelParallel, use_expert_parallel: bool,
                 dtype: Optional[torch.dtype], fuse_shared: bool = False) -> None:
        super().__init__()
        act = getattr(hf_config, "hidden_act", "silu")
        if act != "silu":
            raise NotImplementedError(f"atom's GLM-4-MoE experts implement hidden_act='silu', not {act!r}")
        n, top_k, hidden = hf_config.n_routed_experts, hf_config.num_experts_per_tok, hf_config.hidden_size
        renormalize = bool(getattr(hf_config, "norm_topk_prob", True))
        self.gate = GroupedTopkRouter(
            hidden, n, top_k, num_groups=int(getattr(hf_config, "n_group", 1) or 1),
            topk_groups=int(getattr(hf_config, "topk_group", 1) or 1),
            routed_scaling_factor=float(getattr(hf_config, "routed_scaling_factor", 1.0)), renormalize=renormalize,
        )
        n_shared = int(getattr(hf_config, "n_shared_experts", 0) or 0)
        # ``fuse_shared``: the shared experts are the fused MoE's extra slots (fuses_shared_experts)
        self.experts = FusedMoE(n, top_k, hidden, hf_config.moe_intermediate_size, parallel,
                                renormalize=renormalize, use_expert_parallel=use_expert_parallel, dtype=dtype,
                                shared_experts=n_shared if fuse_shared else 0)
        # Tensor parallel like any dense MLP (also under expert parallelism: vLLM's EP group is
        # the TP group, so both sums cover the same ranks).
        self.shared_experts = (GatedMLP.of(hf_config, parallel, dtype,
                                           intermediate_size=hf_config.moe_intermediate_size * n_shared)
                               if n_shared and not fuse_shared else None)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        topk_weights, topk_ids = self.gate(hidden_states)
        return routed_and_shared(self.experts, self.shared_experts, hidden_states, topk_weights, topk_ids)


class Glm4MoeForCausalLM(LlamaFamilyForCausalLM):
    """HF ``Glm4MoeForCausalLM``; constructor as :class:`atom.models.qwen3.Qwen3ForCausalLM`.
    ``config.enable_expert_parallel`` selects expert parallelism for the routed experts."""

    default_rope_theta = DEFAULT_ROPE_THETA

    def attention_options(self, hf_config: Any) -> AttentionOptions:
        return AttentionOptions(qkv_bias=bool(getattr(hf_config, "attention_bias", False)), o_bias=False,
                                qk_norm=bool(getattr(hf_config, "use_qk_norm", False)))

    def rope_params(self, hf_config: Any) -> dict[str, Any]:
        params = super().rope_params(hf_config)
        params.setdefault("partial_rotary_factor", DEFAULT_PARTIAL_ROTARY_FACTOR)
        return params

    def build_layers(self, config: Config, make_attention: AttentionFactory, parallel: ModelParallel,
                     prefix: str) -> list[nn.Module]:
        # one answer for every layer: the checkpoint names map to one layout (stacked_params)
        self.fuse_shared = fuses_shared_experts(int(getattr(config.hf_config, "n_shared_experts", 0) or 0),
                                                config.enable_expert_parallel)
        return super().build_layers(config, make_attention, parallel, prefix)

    def build_mlp(self, layer_idx: int, config: Config, parallel: ModelParallel) -> nn.Module:
        hf = config.hf_config
        if layer_idx < int(getattr(hf, "first_k_dense_replace", 0) or 0):
            return GatedMLP.of(hf, parallel, config.dtype)
        return Glm4MoeSparseMoeBlock(hf, parallel, config.enable_expert_parallel, config.dtype,
                                     fuse_shared=self.fuse_shared)

    def stacked_params(self) -> StackedParams:
        # Expert entries first: ``experts.3.gate_proj`` is not the dense ``gate_proj``.
        shared = "shared_experts" if self.fuse_shared else None
        return [*FusedMoE.checkpoint_params(self.hf_config.n_routed_experts, shared=shared), *STACKED_PARAMS]

    def skip_weight(self, name: str) -> bool:
        """Also the MTP layers ``model.layers.{num_hidden_layers + i}.*`` (vLLM's
        ``skip_spec_layers``)."""
        hf = self.hf_config
        first = int(hf.num_hidden_layers)
        mtp = int(getattr(hf, "num_nextn_predict_layers", 0) or 0)
        return super().skip_weight(name) or any(name.startswith(f"model.layers.{first + i}.") for i in range(mtp))
