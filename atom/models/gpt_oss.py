"""GPT-OSS: atom's implementation of HF ``GptOssForCausalLM`` (bf16/fp32 checkpoints).

Per layer: RMSNorm (fused residual add) -> fused qkv projection (with bias) -> NeoX RoPE (YaRN
in the released configs) -> attention with one learned sink logit per head, sliding over the
last ``sliding_window`` tokens on ``"sliding_attention"`` layers (``config.layer_types``), full
on the others -> o_proj (with bias) -> RMSNorm (fused residual add) -> MoE: a router linear with
bias, top-k of the router logits with a softmax over just those k, and experts with biases and
the clamped SwiGLU ``(clamp(up) + 1) * g * sigmoid(alpha * g)``, ``g = min(gate, limit)``
(:func:`atom.ops.fused_moe` with ``activation="swigluoai"``).

Checkpoint layout (HF's dequantized bf16 one): the experts of a layer are stacked tensors,
``mlp.experts.gate_up_proj [E, hidden, 2 * inter]`` with gate and up *interleaved* along the
last dim (gate = ``[..., ::2]``), ``gate_up_proj_bias [E, 2 * inter]`` likewise,
``down_proj [E, inter, hidden]`` and ``down_proj_bias [E, hidden]``; they are transposed and
de-interleaved at load into atom's ``w13 = [gate; up]`` layout. MXFP4 checkpoints (the released
``openai/gpt-oss-*`` weights) are refused here (atom has no MXFP4 MoE kernel); under vLLM atom
steps aside for them before this model is built, and vLLM's own model serves them
(:mod:`atom.plugin.vllm.overrides`).

Parallelism: attention heads and sinks split across TP ranks; experts split per expert across
the TP group (intermediate dim) or, with ``enable_expert_parallel``, whole experts across the EP
group.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from atom.config import Config
from atom.models._decoder import (DecoderForCausalLM, DecoderLayer, GQAProjections, head_dim_of, join_prefix,
                                  max_position)
from atom.models._layers import RotaryEmbedding, rope_parameters
from atom.models._linear import ReplicatedLinear
from atom.models._loading import StackedParams
from atom.models._moe import FusedMoE
from atom.models.interfaces import AttentionFactory, ModelParallel

#: GPT-OSS's RoPE base when a config omits it (transformers' GptOssConfig default).
DEFAULT_ROPE_THETA = 150_000.0

ATTENTION_PARAMS = (
    ("qkv_proj", "q_proj", "q"),
    ("qkv_proj", "k_proj", "k"),
    ("qkv_proj", "v_proj", "v"),
)
#: HF's stacked expert tensors -> FusedMoE parameters (one checkpoint tensor each).
EXPERT_PARAMS = (
    ("experts.w13", "experts.gate_up_proj", "w13"),
    ("experts.w13_bias", "experts.gate_up_proj_bias", "w13_bias"),
    ("experts.w2", "experts.down_proj", "w2"),
    ("experts.w2_bias", "experts.down_proj_bias", "w2_bias"),
)


def refuse_quantized(hf_config: Any) -> None:
    """GPT-OSS's released checkpoints are MXFP4 (``quantization_config.quant_method``); atom
    implements the bf16 layout only."""
    quant = getattr(hf_config, "quantization_config", None)
    if quant is None:
        return
    method = quant.get("quant_method") if isinstance(quant, dict) else getattr(quant, "quant_method", quant)
    raise NotImplementedError(
        f"atom's GPT-OSS runs bf16/fp32 checkpoints only; this one is quantized ({method!r}, e.g. the "
        "MXFP4 experts of openai/gpt-oss-*). Use a dequantized bf16 checkpoint, or set "
        "ATOM_DISABLE_VLLM_PLUGIN=1 to use vLLM's model"
    )


class GptOssAttention(GQAProjections):
    """HF names: ``self_attn.{q,k,v,o}_proj.{weight,bias}``, ``self_attn.sinks [num_heads]``."""

    def __init__(
        self,
        hf_config: Any,
        layer_idx: int,
        rotary_emb: RotaryEmbedding,
        make_attention: AttentionFactory,
        parallel: ModelParallel,
        dtype: Optional[torch.dtype],
        prefix: str,
    ) -> None:
        bias = bool(getattr(hf_config, "attention_bias", True))
        super().__init__(hf_config, parallel, dtype, qkv_bias=bias, o_bias=bias)
        self.head_start = parallel.tp_rank * self.num_heads
        self.sinks = nn.Parameter(torch.empty(self.num_heads, dtype=dtype), requires_grad=False)
        self.rotary_emb = rotary_emb  # shared by every layer
        self.sliding_window = sliding_window_of(hf_config, layer_idx)
        self.attn = self.build_attention(make_attention, prefix, sliding_window=self.sliding_window, sinks=self.sinks)

    def load_weight(self, param_name: str, loaded: torch.Tensor, shard_id: Optional[Hashable] = None) -> None:
        """This rank's heads' sinks (the projections are submodules with their own loaders).
        Copied in place: the attention layer holds this very tensor."""
        if param_name != "sinks":
            raise ValueError(f"GptOssAttention has no checkpoint tensor {param_name!r}")
        src = loaded.narrow(0, self.head_start, self.num_heads)
        if src.shape != self.sinks.shape:
            raise ValueError(f"sinks: checkpoint slice {tuple(src.shape)} != expected {tuple(self.sinks.shape)}")
        self.sinks.data.copy_(src)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        q, k, v = self.split_qkv(hidden_states)
        q, k = self.rotary_emb(positions, q.contiguous(), k.contiguous())
        return self.o_proj(self.attn(q, k, v))


def sliding_window_of(hf_config: Any, layer_idx: int) -> Optional[int]:
    """Layer ``layer_idx``'s window: ``config.sliding_window`` on ``"sliding_attention"`` layers
    (HF's default ``layer_types`` alternate, starting with a sliding layer), else None."""
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types is None:
        layer_types = ["sliding_attention" if i % 2 == 0 else "full_attention"
                       for i in range(hf_config.num_hidden_layers)]
    kind = layer_types[layer_idx]
    if kind not in ("sliding_attention", "full_attention"):
        raise NotImplementedError(f"atom's GPT-OSS does not implement layer type {kind!r}")
    window = getattr(hf_config, "sliding_window", None)
    return int(window) if kind == "sliding_attention" and window else None


class GptOssRouter(ReplicatedLinear):
    """``mlp.router.{weight,bias}``: logits ``x @ W.T + b`` over all experts, on every rank."""

    def __init__(self, hidden_size: int, num_experts: int, dtype: Optional[torch.dtype] = None) -> None:
        super().__init__(hidden_size, num_experts, dtype=dtype)
        self.bias = nn.Parameter(torch.empty(num_experts, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class GptOssExperts(FusedMoE):
    """:class:`FusedMoE` with biases and ``swigluoai``, loaded from HF's stacked expert tensors."""

    def load_weight(self, param_name: str, loaded: torch.Tensor, shard_id: Optional[Hashable] = None) -> None:
        """This rank's experts and intermediate slice of one stacked tensor (``param_name`` is
        the FusedMoE parameter: w13, w13_bias, w2, w2_bias)."""
        e0, n, i, start = self.expert_start, self.num_local_experts, self.local_inter, self.inter_start
        mine = loaded.narrow(0, e0, n)
        if param_name in ("w13", "w13_bias"):
            # gate/up interleaved along the last dim: gate = [..., 0::2], up = [..., 1::2]
            gate, up = mine[..., 0::2], mine[..., 1::2]
            gate, up = gate.narrow(-1, start, i), up.narrow(-1, start, i)
            src = torch.cat([gate, up], dim=-1)
            if param_name == "w13":
                src = src.transpose(1, 2)  # [E, hidden, 2i] -> [E, 2i, hidden]
        elif param_name == "w2":
            src = mine.narrow(1, start, i).transpose(1, 2)  # [E, inter, hidden] -> [E, hidden, i]
        elif param_name == "w2_bias":
            src = mine
        else:
            raise ValueError(f"GptOssExperts has no checkpoint tensor for {param_name!r}")
        dst = getattr(self, param_name)
        if dst.shape != src.shape:
            raise ValueError(f"experts.{param_name}: checkpoint slice {tuple(src.shape)} != expected "
                             f"{tuple(dst.shape)} (a [E, hidden, 2 * inter] gate_up_proj is expected)")
        dst.data.copy_(src)


class GptOssMLP(nn.Module):
    def __init__(self, hf_config: Any, parallel: ModelParallel, use_expert_parallel: bool,
                 dtype: Optional[torch.dtype]) -> None:
        super().__init__()
        n = int(hf_config.num_local_experts)
        self.router = GptOssRouter(hf_config.hidden_size, n, dtype=dtype)
        # HF: softmax over the top-k router logits == softmax over all, top-k, renormalised.
        self.experts = GptOssExperts(
            n, hf_config.num_experts_per_tok, hf_config.hidden_size, hf_config.intermediate_size, parallel,
            renormalize=True, use_expert_parallel=use_expert_parallel, dtype=dtype, activation="swigluoai",
            swiglu_alpha=float(getattr(hf_config, "swiglu_alpha", 1.702)),
            swiglu_limit=float(getattr(hf_config, "swiglu_limit", 7.0)), bias=True,
        )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.experts(hidden_states, self.router(hidden_states))


class GptOssForCausalLM(DecoderForCausalLM):
    """HF ``GptOssForCausalLM``; constructor as :class:`atom.models._decoder.DecoderForCausalLM`.
    ``config.enable_expert_parallel`` selects expert parallelism over ``parallel.ep_group``."""

    def build_layers(self, config: Config, make_attention: AttentionFactory, parallel: ModelParallel,
                     prefix: str) -> list[nn.Module]:
        hf = config.hf_config
        refuse_quantized(hf)
        # HF GPT-OSS rotates the two halves of each head (NeoX style).
        rotary_emb = RotaryEmbedding(head_dim_of(hf), rope_parameters(hf, DEFAULT_ROPE_THETA), max_position(config),
                                     is_neox_style=True)
        ep = bool(config.enable_expert_parallel)
        return [
            DecoderLayer(GptOssAttention(hf, i, rotary_emb, make_attention, parallel, config.dtype,
                                         join_prefix(prefix, f"layers.{i}.self_attn")),
                         GptOssMLP(hf, parallel, ep, config.dtype), hf.hidden_size, hf.rms_norm_eps, config.dtype)
            for i in range(hf.num_hidden_layers)
        ]

    def stacked_params(self) -> StackedParams:
        # Expert entries first (``experts.gate_up_proj_bias`` is one dotted component, so no
        # entry is a prefix of another).
        return [*EXPERT_PARAMS, *ATTENTION_PARAMS]
