"""Qwen3 (dense): atom's implementation of HF ``Qwen3ForCausalLM``.

The Llama-family decoder (:mod:`atom.models._decoder`) with Qwen3's attention: per layer, RMSNorm
(fused residual add) -> fused qkv projection (biases per ``attention_bias``) -> per-head RMSNorm
of q and k -> NeoX RoPE -> attention (the host's layer, from the injected factory) -> o_proj ->
RMSNorm (fused residual add) -> fused gate_up -> SiLU-and-mul -> down_proj. fp8 checkpoints
(per-tensor or block scales) load as described in :mod:`atom.models._quant`.
"""

from __future__ import annotations

from typing import Any

from atom.models._decoder import AttentionOptions, LlamaFamilyForCausalLM

#: Qwen3's RoPE base when a config omits it (what Qwen3 checkpoints and vLLM assume).
DEFAULT_ROPE_THETA = 1_000_000.0


def qwen3_attention(hf_config: Any) -> AttentionOptions:
    """QK-norm, q/k/v biases per ``attention_bias``, none on o_proj (Qwen3 and Qwen3-MoE)."""
    return AttentionOptions(qkv_bias=bool(getattr(hf_config, "attention_bias", False)))


class Qwen3ForCausalLM(LlamaFamilyForCausalLM):
    """HF ``Qwen3ForCausalLM``; constructor ``(config, *, make_attention, parallel, prefix)``
    (see :class:`atom.models._decoder.DecoderForCausalLM`)."""

    default_rope_theta = DEFAULT_ROPE_THETA

    def attention_options(self, hf_config: Any) -> AttentionOptions:
        return qwen3_attention(hf_config)
