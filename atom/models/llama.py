"""Llama: atom's implementation of HF ``LlamaForCausalLM`` (Llama 2/3/3.x and the many
checkpoints that reuse the architecture).

The Llama-family decoder of :mod:`atom.models._decoder` without QK-norm: RMSNorm -> fused qkv
(GQA) -> NeoX RoPE -> attention -> o_proj -> RMSNorm -> SwiGLU MLP. Per the HF config:

* ``attention_bias`` (or ``bias``): biases on q/k/v_proj and o_proj;
* ``mlp_bias``: biases on gate/up/down_proj;
* RoPE scaling (``rope_parameters`` / ``rope_scaling``): default, ``linear``, ``dynamic``
  (vLLM's static table), ``llama3``, ``yarn`` (see :func:`atom.models._layers.rope_inv_freq`);
* ``tie_word_embeddings``: the head shares the embedding's weight.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from atom.config import Config
from atom.models._decoder import AttentionOptions, GatedMLP, LlamaFamilyForCausalLM
from atom.models.interfaces import ModelParallel

#: RoPE base when a config omits it (HF LlamaConfig's default).
DEFAULT_ROPE_THETA = 10000.0


def llama_attention(hf_config: Any) -> AttentionOptions:
    """No QK-norm; ``attention_bias`` on q/k/v and o_proj alike."""
    # vLLM also reads ``bias`` (Smaug-72B); HF Llama puts ``attention_bias`` on o_proj too.
    bias = bool(getattr(hf_config, "attention_bias", False) or getattr(hf_config, "bias", False))
    return AttentionOptions(qkv_bias=bias, o_bias=bias, qk_norm=False)


class LlamaForCausalLM(LlamaFamilyForCausalLM):
    """HF ``LlamaForCausalLM``; constructor as :class:`atom.models.qwen3.Qwen3ForCausalLM`."""

    default_rope_theta = DEFAULT_ROPE_THETA

    def attention_options(self, hf_config: Any) -> AttentionOptions:
        return llama_attention(hf_config)

    def build_mlp(self, layer_idx: int, config: Config, parallel: ModelParallel) -> nn.Module:
        return GatedMLP.of(config.hf_config, parallel, config.dtype,
                           bias=bool(getattr(config.hf_config, "mlp_bias", False)))
