"""DeepSeek-V3 (and Kimi-K2, same architecture, other sizes): atom's implementation of HF
``DeepseekV3ForCausalLM``.

Per layer: RMSNorm (fused residual add) -> multi-head latent attention -> RMSNorm (fused residual
add) -> a dense SwiGLU MLP (the first ``first_k_dense_replace`` layers, and layers off the
``moe_layer_freq`` stride) or the MoE block.

Multi-head latent attention (MLA)::

    q      = q_b_proj(q_a_layernorm(q_a_proj(x)))      (or q_proj(x) when q_lora_rank is None)
    kv_c   = kv_a_layernorm(kv_a_proj_with_mqa(x)[:kv_lora_rank])    the cached latent
    k_pe   = kv_a_proj_with_mqa(x)[kv_lora_rank:]                     one rope key for all heads
    q[..., nope:], k_pe = RoPE (GPT-J interleaved pairs; DeepSeek YaRN with mscale)
    out    = o_proj(attention(q, kv_c, k_pe))    keys/values per head from kv_b_proj(kv_c)

``q_a_proj`` and ``kv_a_proj_with_mqa`` are fused into one replicated ``fused_qkv_a_proj``. The
attention itself is the host's (``make_attention.mla``, see
:class:`atom.models.interfaces.MLAAttentionFactory`): in vLLM, vLLM's ``MLAAttention``, which
owns the latent KV cache and absorbs ``kv_b_proj`` into the query and output after loading.
The softmax scale is ``qk_head_dim ** -0.5``, times ``mscale(factor, mscale_all_dim) ** 2`` under
YaRN (as HF and vLLM).

MoE block (HF names ``mlp.gate``, ``mlp.experts.{e}``, ``mlp.shared_experts``): a router linear
(fp32 logits) with ``e_score_correction_bias`` -> DeepSeek's grouped sigmoid top-k
(:func:`atom.ops.grouped_topk_sigmoid`: ``n_group`` / ``topk_group``, ``norm_topk_prob``,
``routed_scaling_factor``) -> :class:`atom.models._moe.FusedMoE`, plus ``n_shared_experts``
always-on experts (one SwiGLU MLP of ``n_shared_experts * moe_intermediate_size``).

Parallelism: heads split across the TP group (q_b_proj / kv_b_proj column-parallel, o_proj
row-parallel; the latent projections are replicated); experts as in Qwen3-MoE (TP-split or, with
``enable_expert_parallel``, whole experts over the EP group); shared experts TP-split.

Checkpoints: HF names. Multi-token-prediction layers (``model.layers.{i}`` with i >=
``num_hidden_layers``, in DeepSeek-V3's release) are skipped.
"""

from __future__ import annotations

import re
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from atom import ops
from atom.config import Config
from atom.models._decoder import DecoderForCausalLM, DecoderLayer, GatedMLP, join_prefix, max_position
from atom.models._layers import RMSNorm, RotaryEmbedding, rope_parameters, yarn_mscale
from atom.models._linear import ColumnParallelLinear, OutputSlice, RowParallelLinear, divide
from atom.models._loading import StackedParams
from atom.models._moe import FusedMoE, GroupedTopkRouter
from atom.models.interfaces import AttentionFactory, ModelParallel

#: DeepSeek's RoPE base when a config omits it.
DEFAULT_ROPE_THETA = 10_000.0

DENSE_STACKED = (
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
)
QKV_A_STACKED = (
    ("fused_qkv_a_proj", "q_a_proj", "q_a"),
    ("fused_qkv_a_proj", "kv_a_proj_with_mqa", "kv_a"),
)

_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def _replicated(input_size: int, sizes: dict[str, int], bias: bool,
                dtype: Optional[torch.dtype]) -> ColumnParallelLinear:
    """Matrices fused along the output and held whole on every rank (no TP split)."""
    slices: dict[Any, OutputSlice] = {}
    dst = 0
    for shard, size in sizes.items():
        slices[shard] = OutputSlice(0, dst, size)
        dst += size
    if len(sizes) == 1:
        slices[None] = next(iter(slices.values()))
    return ColumnParallelLinear(input_size, dst, slices, bias=bias, dtype=dtype)


def attention_scale(hf_config: Any, params: dict[str, Any]) -> float:
    """``qk_head_dim ** -0.5``, times ``mscale(factor, mscale_all_dim) ** 2`` under YaRN (HF's
    ``yarn_apply_mscale``; vLLM applies the same)."""
    scale = (hf_config.qk_nope_head_dim + hf_config.qk_rope_head_dim) ** -0.5
    if params.get("rope_type", "default") != "default":
        mscale_all_dim = params.get("mscale_all_dim") or 0
        if mscale_all_dim:
            m = yarn_mscale(float(params["factor"]), float(mscale_all_dim))
            scale *= m * m
    return scale


class DeepseekV3Attention(nn.Module):
    """Multi-head latent attention; HF names ``self_attn.{q_a_proj, q_a_layernorm, q_b_proj |
    q_proj, kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj}``."""

    def __init__(
        self,
        hf_config: Any,
        rotary_emb: RotaryEmbedding,
        scale: float,
        make_attention: AttentionFactory,
        parallel: ModelParallel,
        dtype: Optional[torch.dtype],
        prefix: str,
    ) -> None:
        super().__init__()
        hidden = hf_config.hidden_size
        eps = hf_config.rms_norm_eps
        bias = bool(getattr(hf_config, "attention_bias", False))
        self.q_lora_rank = getattr(hf_config, "q_lora_rank", None)
        self.kv_lora_rank = int(hf_config.kv_lora_rank)
        self.nope = int(hf_config.qk_nope_head_dim)
        self.rope = int(hf_config.qk_rope_head_dim)
        self.v_head_dim = int(hf_config.v_head_dim)
        self.qk_head_dim = self.nope + self.rope
        num_heads = int(hf_config.num_attention_heads)
        self.num_heads = divide(num_heads, parallel.tp_size, "num_attention_heads")

        kv_a = {"kv_a": self.kv_lora_rank + self.rope}
        if self.q_lora_rank is not None:
            self.fused_qkv_a_proj = _replicated(hidden, {"q_a": self.q_lora_rank, **kv_a}, bias, dtype)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, eps, dtype=dtype)
            self.q_b_proj = ColumnParallelLinear.merged(self.q_lora_rank, [num_heads * self.qk_head_dim],
                                                        parallel, dtype=dtype)
        else:
            self.kv_a_proj_with_mqa = _replicated(hidden, kv_a, bias, dtype)
            self.q_proj = ColumnParallelLinear.merged(hidden, [num_heads * self.qk_head_dim], parallel, dtype=dtype)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, eps, dtype=dtype)
        self.kv_b_proj = ColumnParallelLinear.merged(
            self.kv_lora_rank, [num_heads * (self.nope + self.v_head_dim)], parallel, dtype=dtype)
        self.o_proj = RowParallelLinear(num_heads * self.v_head_dim, hidden, parallel, bias=bias, dtype=dtype)
        self.rotary_emb = rotary_emb  # shared by every layer

        make_mla = getattr(make_attention, "mla", None)
        if make_mla is None:
            raise NotImplementedError(
                f"{type(make_attention).__name__} builds no multi-head latent attention (no 'mla' "
                "method, atom.models.interfaces.MLAAttentionFactory); DeepSeek models need one"
            )
        self.attn = make_mla(
            num_heads=self.num_heads,
            scale=scale,
            qk_nope_head_dim=self.nope,
            qk_rope_head_dim=self.rope,
            v_head_dim=self.v_head_dim,
            q_lora_rank=self.q_lora_rank,
            kv_lora_rank=self.kv_lora_rank,
            kv_b_proj=self.kv_b_proj,
            prefix=join_prefix(prefix, "attn"),
        )

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        t = hidden_states.shape[0]
        if self.q_lora_rank is not None:
            q_c, kv_a = self.fused_qkv_a_proj(hidden_states).split(
                [self.q_lora_rank, self.kv_lora_rank + self.rope], dim=-1)
            q = self.q_b_proj(self.q_a_layernorm(q_c))
        else:
            kv_a = self.kv_a_proj_with_mqa(hidden_states)
            q = self.q_proj(hidden_states)
        kv_c, k_pe = kv_a.split([self.kv_lora_rank, self.rope], dim=-1)
        kv_c_normed = self.kv_a_layernorm(kv_c.contiguous())
        q = q.view(t, self.num_heads, self.qk_head_dim)
        k_pe = k_pe.contiguous().view(t, 1, self.rope)
        # In place on the rope part of every head (a strided view, last dim contiguous).
        self.rotary_emb(positions, q[..., self.nope:], k_pe)
        return self.o_proj(self.attn(q, kv_c_normed, k_pe))


class DeepseekV3Router(GroupedTopkRouter):
    """HF ``mlp.gate``: ``weight`` ``[experts, hidden]`` (and, with sigmoid scoring,
    ``e_score_correction_bias``), both float32 as in :class:`GroupedTopkRouter`; returns the
    routes with their final weights (normalised and scaled by ``routed_scaling_factor``).

    * DeepSeek-V3 / Kimi-K2 (``scoring_func="sigmoid"``, ``topk_method="noaux_tc"``): the grouped
      sigmoid top-k of :class:`GroupedTopkRouter` (:func:`atom.ops.grouped_topk_sigmoid`).
    * DeepSeek-V2-Lite (``scoring_func="softmax"``, ``topk_method="greedy"``): softmax top-k,
      :func:`atom.ops.topk_softmax`, renormalised when ``norm_topk_prob``; no correction bias.
    """

    def __init__(self, hf_config: Any, num_experts: int) -> None:
        sigmoid = routing_of(hf_config)[0] == "sigmoid"
        super().__init__(
            hf_config.hidden_size, num_experts, int(hf_config.num_experts_per_tok),
            num_groups=int(getattr(hf_config, "n_group", None) or 1),
            topk_groups=int(getattr(hf_config, "topk_group", None) or 1),
            routed_scaling_factor=float(getattr(hf_config, "routed_scaling_factor", None) or 1.0),
            renormalize=bool(getattr(hf_config, "norm_topk_prob", sigmoid)),
        )
        self.sigmoid = sigmoid
        if not sigmoid:
            del self.e_score_correction_bias  # softmax routing has none (nor does its checkpoint)

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.sigmoid:
            return super().forward(hidden_states)
        logits = F.linear(hidden_states.float(), self.weight)
        weights, ids = ops.topk_softmax(logits, self.top_k, self.renormalize)
        return weights * self.routed_scaling_factor, ids


class DeepseekV3MoE(nn.Module):
    """Routed experts (sum weighted by the router) plus the shared experts."""

    def __init__(self, hf_config: Any, parallel: ModelParallel, use_expert_parallel: bool,
                 dtype: Optional[torch.dtype]) -> None:
        super().__init__()
        n = num_routed_experts(hf_config)
        self.gate = DeepseekV3Router(hf_config, n)
        # The router returns final weights; FusedMoE's own (softmax) routing is not used.
        self.experts = FusedMoE(
            n, int(hf_config.num_experts_per_tok), hf_config.hidden_size, hf_config.moe_intermediate_size,
            parallel, renormalize=False, use_expert_parallel=use_expert_parallel, dtype=dtype,
        )
        shared = int(getattr(hf_config, "n_shared_experts", None) or 0)
        self.shared_experts = (
            GatedMLP(hf_config.hidden_size, hf_config.moe_intermediate_size * shared, parallel, dtype)
            if shared else None
        )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        topk_weights, topk_ids = self.gate(hidden_states)
        out = self.experts.forward_routed(hidden_states, topk_weights, topk_ids)
        if self.shared_experts is not None:
            out = out + self.shared_experts(hidden_states)
        return out


def num_routed_experts(hf_config: Any) -> int:
    # config.json spells it n_routed_experts; transformers' DeepseekV2Config object num_experts.
    return int(getattr(hf_config, "n_routed_experts", None) or getattr(hf_config, "num_experts", None) or 0)


def is_moe_layer(hf_config: Any, layer_idx: int) -> bool:
    """vLLM's (and DeepSeek's) rule: routed experts from layer ``first_k_dense_replace`` on, on
    every ``moe_layer_freq``-th layer."""
    return (
        num_routed_experts(hf_config) > 0
        and layer_idx >= int(getattr(hf_config, "first_k_dense_replace", 0) or 0)
        and layer_idx % int(getattr(hf_config, "moe_layer_freq", 1) or 1) == 0
    )


def routing_of(hf_config: Any) -> tuple[str, str]:
    """(scoring_func, topk_method); a config without them (transformers 5 drops both from
    DeepseekV3Config) routes as DeepSeek-V3 does."""
    return (getattr(hf_config, "scoring_func", None) or "sigmoid",
            getattr(hf_config, "topk_method", None) or "noaux_tc")


#: The (scoring_func, topk_method) pairs atom's router implements.
SUPPORTED_ROUTING = (("sigmoid", "noaux_tc"), ("softmax", "greedy"))


def check_routing(hf_config: Any) -> None:
    """atom implements DeepSeek-V3's routing (sigmoid scores, bias-corrected group top-k) and
    DeepSeek-V2-Lite's (softmax top-k); not V2's group-limited softmax routing."""
    routing = routing_of(hf_config)
    if routing not in SUPPORTED_ROUTING:
        raise NotImplementedError(
            f"atom's DeepSeek MoE implements (scoring_func, topk_method) in {SUPPORTED_ROUTING}, "
            f"not {routing}; set ATOM_DISABLE_VLLM_PLUGIN=1 to use vLLM's model"
        )
    if getattr(hf_config, "mlp_bias", False):
        raise NotImplementedError("atom's DeepSeek MLPs have no biases (mlp_bias=True); "
                                  "set ATOM_DISABLE_VLLM_PLUGIN=1 to use vLLM's model")
    act = getattr(hf_config, "hidden_act", "silu")
    if act != "silu":
        raise NotImplementedError(f"atom's DeepSeek MLPs implement hidden_act='silu', not {act!r}")


class DeepseekV3ForCausalLM(DecoderForCausalLM):
    """HF ``DeepseekV3ForCausalLM`` (DeepSeek-V3/R1, Kimi-K2): ``model`` + ``lm_head``; constructor
    as :class:`atom.models._decoder.DecoderForCausalLM`, with ``make_attention`` a factory with an
    ``mla`` method (:class:`atom.models.interfaces.MLAAttentionFactory`) and
    ``config.enable_expert_parallel`` selecting expert parallelism over ``parallel.ep_group``.
    """

    def build_layers(self, config: Config, make_attention: AttentionFactory, parallel: ModelParallel,
                     prefix: str) -> list[nn.Module]:
        hf = config.hf_config
        check_routing(hf)
        params = rope_parameters(hf, DEFAULT_ROPE_THETA)
        # DeepSeek rotates interleaved pairs (GPT-J style): HF's rope_interleave, vLLM's
        # is_neox_style=False.
        rotary_emb = RotaryEmbedding(int(hf.qk_rope_head_dim), params, max_position(config),
                                     is_neox_style=not bool(getattr(hf, "rope_interleave", True)))
        scale = attention_scale(hf, params)
        layers = []
        for i in range(hf.num_hidden_layers):
            attn = DeepseekV3Attention(hf, rotary_emb, scale, make_attention, parallel, config.dtype,
                                       join_prefix(prefix, f"layers.{i}.self_attn"))
            if is_moe_layer(hf, i):
                mlp: nn.Module = DeepseekV3MoE(hf, parallel, config.enable_expert_parallel, config.dtype)
            else:
                mlp = GatedMLP(hf.hidden_size, hf.intermediate_size, parallel, config.dtype)
            layers.append(DecoderLayer(attn, mlp, hf.hidden_size, hf.rms_norm_eps, config.dtype))
        return layers

    def stacked_params(self) -> StackedParams:
        """Checkpoint matrices fused at load. Expert entries first (``experts.3.gate_proj`` would
        otherwise match the dense ``gate_proj`` entry)."""
        stacked: list = []
        if any(is_moe_layer(self.hf_config, i) for i in range(self.hf_config.num_hidden_layers)):
            stacked += FusedMoE.checkpoint_params(num_routed_experts(self.hf_config))
        stacked += DENSE_STACKED
        if getattr(self.hf_config, "q_lora_rank", None) is not None:
            stacked += QKV_A_STACKED
        return stacked

    def skip_weight(self, name: str) -> bool:
        """Also the multi-token-prediction layers, which follow the decoder layers in
        DeepSeek-V3's release."""
        m = _LAYER_INDEX.search(name)
        return super().skip_weight(name) or (m is not None and int(m.group(1)) >= int(self.hf_config.num_hidden_layers))


class DeepseekV2ForCausalLM(DeepseekV3ForCausalLM):
    """HF ``DeepseekV2ForCausalLM``: the same layers; the checkpoints atom serves are those with
    softmax top-k routing (DeepSeek-V2-Lite, DeepSeek-Coder-V2-Lite: ``topk_method="greedy"``),
    where :class:`DeepseekV3Router` applies softmax top-k. Constructor as
    :class:`DeepseekV3ForCausalLM`."""
