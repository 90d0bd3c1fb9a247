"""Llama: atom's implementation of HF ``LlamaForCausalLM`` (Llama 2/3/3.x and the many
checkpoints that reuse the architecture).

The Llama-family decoder of :mod:`atom.models.qwen3` without QK-norm: RMSNorm -> fused qkv
(GQA) -> NeoX RoPE -> attention -> o_proj -> RMSNorm -> SwiGLU MLP. Per the HF config:

* ``attention_bias`` (or ``bias``): biases on q/k/v_proj and o_proj;
* ``mlp_bias``: biases on gate/up/down_proj;
* RoPE scaling (``rope_parameters`` / ``rope_scaling``): default, ``linear``, ``dynamic``
  (vLLM's static table), ``llama3``, ``yarn`` (see :func:`atom.models._layers.rope_inv_freq`);
* ``tie_word_embeddings``: the head shares the embedding's weight.
"""

from __future__ import annotations

from typing import Any, Optional

from torch import nn

from atom.config import Config
from atom.models._layers import rope_parameters
from atom.models.interfaces import ModelParallel
from atom.models.qwen3 import AttentionOptions, Qwen3ForCausalLM, Qwen3MLP

#: RoPE base when a config omits it (HF LlamaConfig's default).
DEFAULT_ROPE_THETA = 10000.0


class LlamaForCausalLM(Qwen3ForCausalLM):
    """HF ``LlamaForCausalLM``; constructor arguments as :class:`Qwen3ForCausalLM`."""

    def attention_options(self, hf_config: Any) -> AttentionOptions:
        # vLLM also reads ``bias`` (Smaug-72B); HF Llama puts ``attention_bias`` on o_proj too.
        bias = bool(getattr(hf_config, "attention_bias", False) or getattr(hf_config, "bias", False))
        return AttentionOptions(qkv_bias=bias, o_bias=bias, qk_norm=False)

    def rope_params(self, hf_config: Any) -> dict[str, Any]:
        return rope_parameters(hf_config, DEFAULT_ROPE_THETA)

    def build_mlp(self, layer_idx: int, config: Config, parallel: ModelParallel) -> Optional[nn.Module]:
        return Qwen3MLP(config.hf_config, parallel, config.dtype,
                        bias=bool(getattr(config.hf_config, "mlp_bias", False)))
