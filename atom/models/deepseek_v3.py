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
``num_hidden_layers``, in DeepSeek-V3's release) are skipped, their fp8 scales included.

fp8 checkpoints (``quantization_config.quant_method == "fp8"``, :mod:`atom.models._quant`):
DeepSeek-V3's and Kimi-K2's release format (``weight_block_size: [128, 128]``, dynamic
activations, ``weight_scale_inv`` per 128 x 128 tile) and per-tensor scales (dynamic or static
activations) load into every projection: ``q_a_proj`` + ``kv_a_proj_with_mqa`` (fused; the
576-row ``kv_a`` ends in a partial tile, see :func:`fuses_qkv_a`), ``q_b_proj`` / ``q_proj``,
``kv_b_proj``, ``o_proj``, the dense and shared-expert MLPs and the routed experts. The router,
norms, embedding and lm_head are never quantised; ``ignored_layers`` /
``modules_to_not_convert`` stay in the checkpoint's dtype. After loading, each layer repacks for
its compute path (:meth:`DecoderForCausalLM.process_weights_after_loading`).

``kv_b_proj`` is the exception: the host's MLA reads it as a plain matrix after loading (vLLM
splits it per head into the absorbed decode weights; atom's prefill up-projects the latent with
it), so it is loaded fp8 and dequantised once, at load, to the activation dtype
(``Fp8Spec.dequantize``), and stays there (bf16 when serving bf16). Its cost at DeepSeek-V3's
dims (``kv_lora_rank`` 512 x 128 heads x (128 nope + 128 v) = 16,777,216 parameters per layer):
33.6 MB in bf16 vs 16.8 MB in fp8 (+ 4 KiB of scales), i.e. 16.8 MB more per layer and 1.02 GB
(61 layers) more for the whole model, divided over the TP ranks (heads are split: 128 MB per
rank at TP=8). The absorbed ``W_UK`` / ``W_UV`` copies are in the activation dtype for stock
vLLM and atom alike.
"""

from __future__ import annotations

import dataclasses
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
from atom.models._moe import FusedMoE, GroupedTopkRouter, fuses_shared_experts, routed_and_shared
from atom.models._quant import Fp8Spec, fp8_spec, layer_spec
from atom.models.interfaces import AttentionFactory, ModelParallel
from atom.ops.fused_quant import Activation, plain

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


def _replicated(input_size: int, sizes: dict[str, int], bias: bool, dtype: Optional[torch.dtype],
                quant: Optional[Fp8Spec] = None) -> ColumnParallelLinear:
    """Matrices fused along the output and held whole on every rank (no TP split); ``quant``:
    their fp8 format (None: unquantised)."""
    slices: dict[Any, OutputSlice] = {}
    dst = 0
    for shard, size in sizes.items():
        slices[shard] = OutputSlice(0, dst, size)
        dst += size
    if len(sizes) == 1:
        slices[None] = next(iter(slices.values()))
    return ColumnParallelLinear(input_size, dst, slices, bias=bias, dtype=dtype, quant=quant)


def fuses_qkv_a(hf_config: Any, quant: Optional[Fp8Spec]) -> bool:
    """Whether ``q_a_proj`` and ``kv_a_proj_with_mqa`` load into one fused ``fused_qkv_a_proj``.

    Always, except where block-scaled fp8 tiles would straddle the seam: the fused weight has one
    grid of ``bn``-row scale tiles, so the first matrix (``q_a_proj``, ``q_lora_rank`` rows) must
    be whole tiles, while the last (``kv_a_proj_with_mqa``) may end in a partial one
    (DeepSeek-V3: 1536 = 12 tiles, then 576 = 4.5). A ``q_lora_rank`` that is not a multiple of
    ``bn`` keeps the two projections separate (two GEMMs), each with its own scale grid."""
    q_lora_rank = getattr(hf_config, "q_lora_rank", None)
    if q_lora_rank is None:
        return False
    return quant is None or quant.block is None or int(q_lora_rank) % quant.block[0] == 0


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
        quant: Optional[Fp8Spec] = None,
        checkpoint_prefix: str = "",
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

        def spec(*names: str) -> Optional[Fp8Spec]:
            return layer_spec(quant, checkpoint_prefix, names)

        kv_a = {"kv_a": self.kv_lora_rank + self.rope}
        self.fused_qkv_a = fuses_qkv_a(hf_config, quant)
        if self.fused_qkv_a:
            self.fused_qkv_a_proj = _replicated(hidden, {"q_a": self.q_lora_rank, **kv_a}, bias, dtype,
                                                spec("q_a_proj", "kv_a_proj_with_mqa"))
        else:
            self.kv_a_proj_with_mqa = _replicated(hidden, kv_a, bias, dtype, spec("kv_a_proj_with_mqa"))
        if self.q_lora_rank is not None:
            if not self.fused_qkv_a:
                self.q_a_proj = _replicated(hidden, {"q_a": self.q_lora_rank}, bias, dtype, spec("q_a_proj"))
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, eps, dtype=dtype)
            self.q_b_proj = ColumnParallelLinear.merged(self.q_lora_rank, [num_heads * self.qk_head_dim],
                                                        parallel, dtype=dtype, quant=spec("q_b_proj"))
        else:
            self.q_proj = ColumnParallelLinear.merged(hidden, [num_heads * self.qk_head_dim], parallel, dtype=dtype,
                                                      quant=spec("q_proj"))
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, eps, dtype=dtype)
        # Read as a plain matrix after loading (the host's MLA splits it per head): loaded fp8,
        # dequantised once by its own post-load hook (see the module docstring for the cost).
        kv_b_quant = spec("kv_b_proj")
        self.kv_b_proj = ColumnParallelLinear.merged(
            self.kv_lora_rank, [num_heads * (self.nope + self.v_head_dim)], parallel, dtype=dtype,
            quant=None if kv_b_quant is None else dataclasses.replace(kv_b_quant, dequantize=True))
        self.o_proj = RowParallelLinear(num_heads * self.v_head_dim, hidden, parallel, bias=bias, dtype=dtype,
                                        quant=spec("o_proj"))
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

    def fp8_input_readers(self) -> list[Any]:
        if self.fused_qkv_a:
            return [self.fused_qkv_a_proj]
        return [self.kv_a_proj_with_mqa, self.q_a_proj if self.q_lora_rank is not None else self.q_proj]

    def fp8_producer_links(self) -> list[tuple[Any, list[Any]]]:
        return [(self.q_a_layernorm, [self.q_b_proj])] if self.q_lora_rank is not None else []

    def forward(self, positions: torch.Tensor, hidden_states: Activation) -> torch.Tensor:
        t = plain(hidden_states).shape[0]
        if self.fused_qkv_a:
            q_c, kv_a = self.fused_qkv_a_proj(hidden_states).split(
                [self.q_lora_rank, self.kv_lora_rank + self.rope], dim=-1)
            q = self.q_b_proj(self.q_a_layernorm(q_c))
        elif self.q_lora_rank is not None:
            kv_a = self.kv_a_proj_with_mqa(hidden_states)
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
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
                 dtype: Optional[torch.dtype], quant: Optional[Fp8Spec] = None, checkpoint_prefix: str = "",
                 fuse_shared: bool = False) -> None:
        super().__init__()
        n = num_routed_experts(hf_config)
        shared = int(getattr(hf_config, "n_shared_experts", None) or 0)
        # The router (``gate``) stays unquantised in fp8 checkpoints.
        self.gate = DeepseekV3Router(hf_config, n)
        # The router returns final weights; FusedMoE's own (softmax) routing is not used. With
        # ``fuse_shared`` the shared experts are its extra slots (see shares_expert_slots).
        self.experts = FusedMoE(
            n, int(hf_config.num_experts_per_tok), hf_config.hidden_size, hf_config.moe_intermediate_size,
            parallel, renormalize=False, use_expert_parallel=use_expert_parallel, dtype=dtype,
            quant=layer_spec(quant, checkpoint_prefix, [f"experts.{e}.{p}" for e in range(n) for p in _MATS]),
            shared_experts=shared if fuse_shared else 0,
        )
        self.shared_experts = (
            GatedMLP(hf_config.hidden_size, hf_config.moe_intermediate_size * shared, parallel, dtype, quant=quant,
                     checkpoint_prefix=join_prefix(checkpoint_prefix, "shared_experts"))
            if shared and not fuse_shared else None
        )

    def fp8_input_readers(self) -> list[Any]:
        # the router reads the activation-dtype form
        shared = [] if self.shared_experts is None else self.shared_experts.fp8_input_readers()
        return [self.experts, *shared]

    def forward(self, hidden_states: Activation) -> torch.Tensor:
        topk_weights, topk_ids = self.gate(plain(hidden_states))
        return routed_and_shared(self.experts, self.shared_experts, hidden_states, topk_weights, topk_ids)


_MATS = ("gate_proj", "up_proj", "down_proj")


def shares_expert_slots(hf_config: Any, quant: Optional[Fp8Spec], use_expert_parallel: bool) -> bool:
    """Whether every MoE layer's shared experts ride in its fused MoE's slots
    (:func:`atom.models._moe.fuses_shared_experts`), which also needs them quantised as the routed
    experts in every layer (an ``ignored_layers`` entry for one and not the other keeps the
    separate MLP). One answer for the model: the checkpoint names map to one layout."""
    shared = int(getattr(hf_config, "n_shared_experts", None) or 0)
    if not fuses_shared_experts(shared, use_expert_parallel, int(hf_config.moe_intermediate_size),
                                None if quant is None else quant.block):
        return False
    if quant is None or not quant.ignored:
        return True
    n = num_routed_experts(hf_config)
    for i in range(int(hf_config.num_hidden_layers)):
        if is_moe_layer(hf_config, i):
            p = f"model.layers.{i}.mlp"
            names = [f"{p}.experts.{e}.{m}" for e in range(n) for m in _MATS]
            names += [f"{p}.shared_experts.{m}" for m in _MATS]
            if len({name in quant.ignored for name in names}) > 1:
                return False
    return True


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
        self.quant = fp8_spec(hf)
        self.fuse_shared = shares_expert_slots(hf, self.quant, config.enable_expert_parallel)
        layers = []
        for i in range(hf.num_hidden_layers):
            ckpt = f"model.layers.{i}"
            attn = DeepseekV3Attention(hf, rotary_emb, scale, make_attention, parallel, config.dtype,
                                       join_prefix(prefix, f"layers.{i}.self_attn"), quant=self.quant,
                                       checkpoint_prefix=f"{ckpt}.self_attn")
            if is_moe_layer(hf, i):
                mlp: nn.Module = DeepseekV3MoE(hf, parallel, config.enable_expert_parallel, config.dtype,
                                               quant=self.quant, checkpoint_prefix=f"{ckpt}.mlp",
                                               fuse_shared=self.fuse_shared)
            else:
                mlp = GatedMLP(hf.hidden_size, hf.intermediate_size, parallel, config.dtype, quant=self.quant,
                               checkpoint_prefix=f"{ckpt}.mlp")
            layers.append(DecoderLayer(attn, mlp, hf.hidden_size, hf.rms_norm_eps, config.dtype))
        return layers

    def stacked_params(self) -> StackedParams:
        """Checkpoint matrices fused at load. Expert entries first (``experts.3.gate_proj`` would
        otherwise match the dense ``gate_proj`` entry)."""
        stacked: list = []
        if any(is_moe_layer(self.hf_config, i) for i in range(self.hf_config.num_hidden_layers)):
            shared = "shared_experts" if self.fuse_shared else None
            stacked += FusedMoE.checkpoint_params(num_routed_experts(self.hf_config), quant=self.quant, shared=shared)
        stacked += DENSE_STACKED
        if fuses_qkv_a(self.hf_config, self.quant):
            stacked += QKV_A_STACKED
        return stacked

    def skip_weight(self, name: str) -> bool:
        """Also the multi-token-prediction layers, which follow the decoder layers in
        DeepSeek-V3's release (every tensor of theirs, fp8 scales included)."""
        m = _LAYER_INDEX.search(name)
        return super().skip_weight(name) or (m is not None and int(m.group(1)) >= int(self.hf_config.num_hidden_layers))


class DeepseekV2ForCausalLM(DeepseekV3ForCausalLM):
    """HF ``DeepseekV2ForCausalLM``: the same layers; the checkpoints atom serves are those with
    softmax top-k routing (DeepSeek-V2-Lite, DeepSeek-Coder-V2-Lite: ``topk_method="greedy"``),
    where :class:`DeepseekV3Router` applies softmax top-k. Constructor as
    :class:`DeepseekV3ForCausalLM`."""
