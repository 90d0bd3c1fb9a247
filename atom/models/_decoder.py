"""The decoder every atom causal LM is made of, and the Llama-family decoder built from it.

Generic (every architecture): :class:`DecoderLayer` (RMSNorm with the fused residual add ->
attention -> RMSNorm with the fused residual add -> feed-forward), :class:`DecoderModel`
(vocab-parallel embedding, the layers, final norm) and :class:`DecoderForCausalLM` (``model`` +
``lm_head``, a tied head, the host-facing methods, checkpoint loading from the host's iterator).
A model subclasses :class:`DecoderForCausalLM` and says how to build layer ``i``'s attention and
feed-forward block (:meth:`DecoderForCausalLM.build_layers`), which checkpoint matrices it fuses
(``stacked_params``), which tensors it skips (``skip_weight``) and which checkpoint module names
differ from its own (``checkpoint_renames``). GPT-OSS and DeepSeek-V3 do this with their own
attention and MoE blocks.

The Llama family (Qwen3, Qwen3-MoE, Llama, Mixtral, GLM-4-MoE) shares more:
:class:`LlamaFamilyForCausalLM` builds GQA attention (:class:`DecoderAttention`: fused qkv ->
optional per-head QK RMSNorm -> RoPE -> the host's attention -> o_proj) and a SwiGLU
:class:`GatedMLP`, and each model only sets its parameters: ``default_rope_theta``,
:meth:`~LlamaFamilyForCausalLM.attention_options` (biases, QK-norm), ``rope_params`` and
``build_mlp`` (the dense MLP or the MoE block of each layer). Tensor parallel as in
:mod:`atom.models._linear`; fp8 checkpoints as in :mod:`atom.models._quant`. Checkpoint names are
HF's; q/k/v and gate/up are fused at load.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from atom.config import Config
from atom.models._layers import (
    RMSNorm,
    RotaryEmbedding,
    SiluAndMul,
    fp8_input_readers,
    link_fp8_producers,
    rope_parameters,
)
from atom.models._linear import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from atom.models._loading import StackedParams, load_checkpoint_weights
from atom.models._moe import FusedMoE
from atom.models._quant import Fp8Spec, fp8_spec, layer_spec
from atom.models.interfaces import AttentionFactory, ModelParallel
from atom.ops.fused_quant import Activation

#: The dense layers' fused checkpoint matrices (see :func:`load_checkpoint_weights`).
STACKED_PARAMS = (
    ("qkv_proj", "q_proj", "q"),
    ("qkv_proj", "k_proj", "k"),
    ("qkv_proj", "v_proj", "v"),
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
)


def join_prefix(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def max_position(config: Config) -> int:
    """Positions the RoPE table covers: the config's maximum, or the host's longer context."""
    hf = config.hf_config
    return max(int(getattr(hf, "max_position_embeddings", 0) or 0), int(config.max_model_len))


def head_dim_of(hf_config: Any) -> int:
    return getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads


# -- generic --------------------------------------------------------------------------------------
class DecoderLayer(nn.Module):
    """``self_attn(positions, x) -> x`` and ``mlp(x) -> x`` between two RMSNorms; the residual
    stream is carried separately so that each norm fuses the add before it."""

    def __init__(self, self_attn: nn.Module, mlp: nn.Module, hidden_size: int, eps: float,
                 dtype: Optional[torch.dtype]) -> None:
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(hidden_size, eps, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(hidden_size, eps, dtype=dtype)

    def fp8_producer_links(self) -> list[tuple[RMSNorm, Optional[list[Any]]]]:
        """Each norm quantises for the block after it when that block's readers take fp8."""
        return [(self.input_layernorm, fp8_input_readers(self.self_attn)),
                (self.post_attention_layernorm, fp8_input_readers(self.mlp))]

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: Optional[torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class DecoderModel(nn.Module):
    """HF's ``model``: ``embed_tokens``, ``layers`` (``build_layers()``, called once the
    embedding exists), final ``norm``."""

    def __init__(self, hf_config: Any, parallel: ModelParallel, dtype: Optional[torch.dtype],
                 build_layers: Callable[[], Iterable[nn.Module]]) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(hf_config.vocab_size, hf_config.hidden_size, parallel, dtype=dtype)
        self.layers = nn.ModuleList(build_layers())
        self.norm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps, dtype=dtype)

    def forward(self, input_ids: Optional[torch.Tensor], positions: torch.Tensor,
                inputs_embeds: Optional[torch.Tensor] = None) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class DecoderForCausalLM(nn.Module):
    """An HF ``*ForCausalLM``: ``model`` (:class:`DecoderModel`) + ``lm_head``.

    Args:
        config: atom's Config; ``config.hf_config`` is the HF config (or any object with its
            fields), ``config.dtype`` the parameter dtype (None: torch's default).
        make_attention: builds each layer's attention (see :class:`AttentionFactory`); layer i's
            is named ``{prefix}model.layers.{i}.self_attn.attn``.
        parallel: this rank's tensor- (and expert-) parallel position and groups.
        prefix: prepended to the attention layer names (the host's name for this model).
    """

    #: (checkpoint name fragment, atom's) replaced in every checkpoint name before loading, for
    #: HF modules atom names otherwise (Mixtral's ``block_sparse_moe`` is atom's ``mlp``).
    checkpoint_renames: tuple[tuple[str, str], ...] = ()

    def __init__(
        self,
        config: Config,
        *,
        make_attention: AttentionFactory,
        parallel: ModelParallel = ModelParallel(),
        prefix: str = "",
    ) -> None:
        super().__init__()
        hf = config.hf_config
        self.hf_config = hf
        self.model = DecoderModel(hf, parallel, config.dtype, lambda: self.build_layers(
            config, make_attention, parallel, join_prefix(prefix, "model")))
        self.lm_head = ParallelLMHead(hf.vocab_size, hf.hidden_size, parallel, dtype=config.dtype)
        self.tie_word_embeddings = bool(getattr(hf, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head.tie_to(self.model.embed_tokens)
        link_fp8_producers(self)  # block-fp8 checkpoints: norms / activations quantise for their GEMMs

    # -- what a model defines --------------------------------------------------------------------
    def build_layers(self, config: Config, make_attention: AttentionFactory, parallel: ModelParallel,
                     prefix: str) -> Iterable[nn.Module]:
        """The decoder layers (``prefix`` is the model's: layer i is ``{prefix}.layers.{i}``);
        also where a model refuses a config it does not implement."""
        raise NotImplementedError

    def stacked_params(self) -> StackedParams:
        """Checkpoint matrices fused at load (see :func:`load_checkpoint_weights`)."""
        return ()

    def skip_weight(self, name: str) -> bool:
        """Checkpoint tensors that are expected and not loaded."""
        # RoPE tables are recomputed from the config; a tied head has no weight of its own.
        return "rotary_emb.inv_freq" in name or (self.tie_word_embeddings and name == "lm_head.weight")

    # -- what the host calls ---------------------------------------------------------------------
    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def forward(
        self,
        input_ids: Optional[torch.Tensor],
        positions: torch.Tensor,
        inputs_embeds: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """Final hidden states ``[num_tokens, hidden]`` of a flat batch of tokens."""
        return self.model(input_ids, positions, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits on every rank (a host may instead use ``lm_head.local_logits``)."""
        return self.lm_head.logits(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load HF-named tensors; returns the parameter names (of this module) now loaded."""
        if self.checkpoint_renames:
            weights = ((self._rename(name), t) for name, t in weights)
        return load_checkpoint_weights(self, weights, self.stacked_params(), self.skip_weight)

    def process_weights_after_loading(self) -> None:
        """After every tensor is loaded: fp8 layers repack for their compute path (dequantise,
        or keep fp8 for the GPU kernels). The host calls this once (vLLM: its model-level
        post-load hook through the wrapper); a no-op for an unquantised checkpoint."""
        for module in self.modules():
            if isinstance(module, (ColumnParallelLinear, RowParallelLinear, FusedMoE)):
                module.process_weights_after_loading()

    def _rename(self, name: str) -> str:
        for theirs, ours in self.checkpoint_renames:
            name = name.replace(theirs, ours)
        return name


# -- the Llama family -----------------------------------------------------------------------------
@dataclass(frozen=True)
class AttentionOptions:
    """How a model's attention block differs from the defaults (Qwen3's)."""

    qkv_bias: bool = False  # biases on q/k/v_proj
    o_bias: bool = False  # bias on o_proj
    qk_norm: bool = True  # per-head RMSNorm of q and k before RoPE (q_norm / k_norm weights)


class GQAProjections(nn.Module):
    """The fused q/k/v and the output projections of grouped-query attention, split across TP
    ranks by heads (HF names ``{q,k,v,o}_proj``); what an attention block builds first."""

    def __init__(self, hf_config: Any, parallel: ModelParallel, dtype: Optional[torch.dtype], *, qkv_bias: bool,
                 o_bias: bool, quant: Optional[Fp8Spec] = None, checkpoint_prefix: str = "") -> None:
        super().__init__()
        hidden = hf_config.hidden_size
        num_heads = hf_config.num_attention_heads
        num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or num_heads
        self.head_dim = head_dim_of(hf_config)
        self.qkv_proj = ColumnParallelLinear.qkv(
            hidden, self.head_dim, num_heads, num_kv_heads, parallel, bias=qkv_bias, dtype=dtype,
            quant=layer_spec(quant, checkpoint_prefix, ("q_proj", "k_proj", "v_proj")),
        )
        self.num_heads = self.qkv_proj.num_local_heads
        self.num_kv_heads = self.qkv_proj.num_local_kv_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(num_heads * self.head_dim, hidden, parallel, bias=o_bias,
                                        dtype=dtype, quant=layer_spec(quant, checkpoint_prefix, ("o_proj",)))

    def build_attention(self, make_attention: AttentionFactory, prefix: str, **options: Any) -> nn.Module:
        """The host's attention layer ``{prefix}.attn`` for these heads (scale ``head_dim ** -0.5``;
        ``options``: the factory's keywords, e.g. ``sliding_window``, ``sinks``)."""
        return make_attention(num_heads=self.num_heads, head_dim=self.head_dim, scale=self.head_dim**-0.5,
                              num_kv_heads=self.num_kv_heads, prefix=join_prefix(prefix, "attn"), **options)

    def split_qkv(self, hidden_states: Activation) -> list[torch.Tensor]:
        """``[q, k, v]`` of ``hidden_states`` (views of one fused projection)."""
        return self.qkv_proj(hidden_states).split([self.q_size, self.kv_size, self.kv_size], dim=-1)


class DecoderAttention(GQAProjections):
    """GQA attention: fused qkv -> optional per-head RMSNorm of q and k -> RoPE -> the host's
    attention -> o_proj. HF names ``self_attn.{q,k,v,o}_proj``, ``self_attn.{q,k}_norm``."""

    def __init__(
        self,
        hf_config: Any,
        rotary_emb: RotaryEmbedding,
        make_attention: AttentionFactory,
        parallel: ModelParallel,
        dtype: Optional[torch.dtype],
        prefix: str,
        options: AttentionOptions,
        quant: Optional[Fp8Spec] = None,
        checkpoint_prefix: str = "",
    ) -> None:
        super().__init__(hf_config, parallel, dtype, qkv_bias=options.qkv_bias, o_bias=options.o_bias, quant=quant,
                         checkpoint_prefix=checkpoint_prefix)
        if options.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, hf_config.rms_norm_eps, dtype=dtype)
            self.k_norm = RMSNorm(self.head_dim, hf_config.rms_norm_eps, dtype=dtype)
        else:
            self.q_norm = self.k_norm = None
        self.rotary_emb = rotary_emb  # shared by every layer
        self.attn = self.build_attention(make_attention, prefix)
        # The host may fuse QK-norm + RoPE + cache write into its attention (see AttentionFactory).
        fuse = getattr(make_attention, "fuse_qk_norm_rope", None)
        self.qk_norm_rope_fused = bool(
            fuse is not None and self.q_norm is not None
            and fuse(self.attn, self.q_norm, self.k_norm, rotary_emb)
        )

    def fp8_input_readers(self) -> list[Any]:
        return [self.qkv_proj]

    def forward(self, positions: torch.Tensor, hidden_states: Activation) -> torch.Tensor:
        q, k, v = self.split_qkv(hidden_states)
        if self.qk_norm_rope_fused:
            return self.o_proj(self.attn(q, k, v))
        if self.q_norm is not None:
            # Qwen3's QK-norm: RMSNorm of every head separately, before RoPE.
            t = q.shape[0]
            q = self.q_norm(q.view(t, self.num_heads, self.head_dim)).view(t, self.q_size)
            k = self.k_norm(k.view(t, self.num_kv_heads, self.head_dim)).view(t, self.kv_size)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v))


class GatedMLP(nn.Module):
    """SwiGLU MLP ``down_proj(silu(gate_proj(x)) * up_proj(x))``, gate and up fused
    (``gate_up_proj``); HF names ``{gate,up,down}_proj``."""

    def __init__(self, hidden_size: int, intermediate_size: int, parallel: ModelParallel,
                 dtype: Optional[torch.dtype], bias: bool = False, quant: Optional[Fp8Spec] = None,
                 checkpoint_prefix: str = "") -> None:
        super().__init__()
        self.gate_up_proj = ColumnParallelLinear.merged(
            hidden_size, [intermediate_size, intermediate_size], parallel, bias=bias, dtype=dtype,
            quant=layer_spec(quant, checkpoint_prefix, ("gate_proj", "up_proj")))
        self.act_fn = SiluAndMul()
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, parallel, bias=bias, dtype=dtype,
                                           quant=layer_spec(quant, checkpoint_prefix, ("down_proj",)))

    @classmethod
    def of(cls, hf_config: Any, parallel: ModelParallel, dtype: Optional[torch.dtype],
           intermediate_size: Optional[int] = None, bias: bool = False, quant: Optional[Fp8Spec] = None,
           checkpoint_prefix: str = "") -> "GatedMLP":
        """The MLP of an HF config (``intermediate_size`` defaults to the config's; a shared
        expert passes its own); refuses an activation other than SiLU."""
        act = getattr(hf_config, "hidden_act", "silu")
        if act != "silu":
            raise NotImplementedError(f"atom's gated MLP implements hidden_act='silu', not {act!r}")
        return cls(hf_config.hidden_size, intermediate_size or hf_config.intermediate_size, parallel, dtype,
                   bias=bias, quant=quant, checkpoint_prefix=checkpoint_prefix)

    def fp8_input_readers(self) -> list[Any]:
        return [self.gate_up_proj]

    def fp8_producer_links(self) -> list[tuple[SiluAndMul, list[Any]]]:
        return [(self.act_fn, [self.down_proj])]

    @property
    def reduce_group(self) -> Optional[Any]:
        """The group the down projection sums over (None with one rank)."""
        return self.down_proj.reduce_group

    def forward(self, x: Activation, reduce: bool = True) -> torch.Tensor:
        """``reduce=False``: this rank's partial sum (see :meth:`RowParallelLinear.forward`)."""
        return self.down_proj(self.act_fn(self.gate_up_proj(x)), reduce=reduce)


class LlamaFamilyForCausalLM(DecoderForCausalLM):
    """The Llama-family decoder: :class:`DecoderAttention` + :meth:`build_mlp`'s block per layer.

    Models set ``default_rope_theta`` and override :meth:`attention_options`, :meth:`rope_params`,
    :meth:`build_mlp` where they differ. fp8 checkpoints (``quantization_config`` with
    ``quant_method: fp8``, see :mod:`atom.models._quant`): the decoder projections load fp8
    weights and scales (names in ``ignored_layers`` stay unquantised, as do the embedding, head,
    norms and routers); :meth:`process_weights_after_loading` repacks them once loading is done.
    """

    #: RoPE base when a config omits it.
    default_rope_theta: float = 10000.0

    def attention_options(self, hf_config: Any) -> AttentionOptions:
        """Biases and QK-norm of every layer's attention."""
        return AttentionOptions()

    def rope_params(self, hf_config: Any) -> dict[str, Any]:
        """RoPE settings (see :func:`rope_parameters`), with this model's default base."""
        return rope_parameters(hf_config, self.default_rope_theta)

    def build_mlp(self, layer_idx: int, config: Config, parallel: ModelParallel) -> nn.Module:
        """Layer ``layer_idx``'s feed-forward block: the dense :class:`GatedMLP` here; where MoE
        models differ."""
        return GatedMLP.of(config.hf_config, parallel, config.dtype, quant=self.quant,
                           checkpoint_prefix=f"model.layers.{layer_idx}.mlp")

    def stacked_params(self) -> StackedParams:
        return STACKED_PARAMS

    def build_layers(self, config: Config, make_attention: AttentionFactory, parallel: ModelParallel,
                     prefix: str) -> list[nn.Module]:
        hf = config.hf_config
        self.quant = fp8_spec(hf)
        rotary_emb = RotaryEmbedding(head_dim_of(hf), self.rope_params(hf), max_position(config))
        options = self.attention_options(hf)
        layers = []
        for i in range(hf.num_hidden_layers):
            mlp = self.build_mlp(i, config, parallel)  # before the attention, as atom always built them
            attn = DecoderAttention(hf, rotary_emb, make_attention, parallel, config.dtype,
                                    join_prefix(prefix, f"layers.{i}.self_attn"), options, quant=self.quant,
                                    checkpoint_prefix=f"model.layers.{i}.self_attn")
            layers.append(DecoderLayer(attn, mlp, hf.hidden_size, hf.rms_norm_eps, config.dtype))
        return layers

