"""Qwen3 (dense): atom's implementation of HF ``Qwen3ForCausalLM``, and the Llama-family
decoder that atom's Llama, Mixtral and GLM-4-MoE models share.

Per layer: RMSNorm (fused residual add) -> fused qkv projection -> per-head RMSNorm of q and k
-> NeoX RoPE -> attention (the host's layer, from the injected factory) -> o_proj -> RMSNorm
(fused residual add) -> fused gate_up -> SiLU-and-mul -> down_proj. Tensor parallel as in
:mod:`atom.models._linear`. Checkpoint names are HF's; q/k/v and gate/up are fused at load.

Variants differ only through the hooks of :class:`Qwen3ForCausalLM` (``attention_options``:
QK-norm and biases; ``rope_params``; ``build_mlp``: the feed-forward block of each layer;
``stacked_params``; ``skip_weight``), so the decoder itself is written once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from atom.config import Config
from atom.models._layers import RMSNorm, RotaryEmbedding, SiluAndMul, rope_parameters
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

#: Qwen3's RoPE base when a config omits it (what Qwen3 checkpoints and vLLM assume).
DEFAULT_ROPE_THETA = 1_000_000.0

STACKED_PARAMS = (
    ("qkv_proj", "q_proj", "q"),
    ("qkv_proj", "k_proj", "k"),
    ("qkv_proj", "v_proj", "v"),
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
)


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


@dataclass(frozen=True)
class AttentionOptions:
    """How a variant's attention block differs from Qwen3's (the defaults)."""

    qkv_bias: bool = False  # biases on q/k/v_proj
    o_bias: bool = False  # bias on o_proj
    qk_norm: bool = True  # per-head RMSNorm of q and k before RoPE (q_norm / k_norm weights)


class Qwen3Attention(nn.Module):
    def __init__(
        self,
        hf_config: Any,
        rotary_emb: RotaryEmbedding,
        make_attention: AttentionFactory,
        parallel: ModelParallel,
        dtype: Optional[torch.dtype],
        prefix: str,
        options: Optional[AttentionOptions] = None,
        quant: Optional[Fp8Spec] = None,
        checkpoint_prefix: str = "",
    ) -> None:
        super().__init__()
        if options is None:
            options = AttentionOptions(qkv_bias=bool(getattr(hf_config, "attention_bias", False)))
        hidden = hf_config.hidden_size
        num_heads = hf_config.num_attention_heads
        num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or num_heads
        self.head_dim = getattr(hf_config, "head_dim", None) or hidden // num_heads
        self.qkv_proj = ColumnParallelLinear.qkv(
            hidden, self.head_dim, num_heads, num_kv_heads, parallel, bias=options.qkv_bias, dtype=dtype,
            quant=layer_spec(quant, checkpoint_prefix, ("q_proj", "k_proj", "v_proj")),
        )
        self.num_heads = self.qkv_proj.num_local_heads
        self.num_kv_heads = self.qkv_proj.num_local_kv_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(num_heads * self.head_dim, hidden, parallel, bias=options.o_bias,
                                        dtype=dtype, quant=layer_spec(quant, checkpoint_prefix, ("o_proj",)))
        if options.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, hf_config.rms_norm_eps, dtype=dtype)
            self.k_norm = RMSNorm(self.head_dim, hf_config.rms_norm_eps, dtype=dtype)
        else:
            self.q_norm = self.k_norm = None
        self.rotary_emb = rotary_emb  # shared by every layer
        self.attn = make_attention(
            num_heads=self.num_heads,
            head_dim=self.head_dim,
            scale=self.head_dim**-0.5,
            num_kv_heads=self.num_kv_heads,
            prefix=_join(prefix, "attn"),
        )
        # The host may fuse QK-norm + RoPE + cache write into its attention (see AttentionFactory).
        fuse = getattr(make_attention, "fuse_qk_norm_rope", None)
        self.qk_norm_rope_fused = bool(
            fuse is not None and self.q_norm is not None
            and fuse(self.attn, self.q_norm, self.k_norm, rotary_emb)
        )

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.qk_norm_rope_fused:
            return self.o_proj(self.attn(q, k, v))
        if self.q_norm is not None:
            # Qwen3's QK-norm: RMSNorm of every head separately, before RoPE.
            t = qkv.shape[0]
            q = self.q_norm(q.view(t, self.num_heads, self.head_dim)).view(t, self.q_size)
            k = self.k_norm(k.view(t, self.num_kv_heads, self.head_dim)).view(t, self.kv_size)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v))


class Qwen3MLP(nn.Module):
    """SwiGLU MLP; ``intermediate_size`` defaults to the config's (a shared expert passes its own)."""

    def __init__(self, hf_config: Any, parallel: ModelParallel, dtype: Optional[torch.dtype],
                 intermediate_size: Optional[int] = None, bias: bool = False,
                 quant: Optional[Fp8Spec] = None, checkpoint_prefix: str = "") -> None:
        super().__init__()
        act = getattr(hf_config, "hidden_act", "silu")
        if act != "silu":
            raise NotImplementedError(f"atom's gated MLP implements hidden_act='silu', not {act!r}")
        inter = intermediate_size or hf_config.intermediate_size
        self.gate_up_proj = ColumnParallelLinear.merged(
            hf_config.hidden_size, [inter, inter], parallel, bias=bias, dtype=dtype,
            quant=layer_spec(quant, checkpoint_prefix, ("gate_proj", "up_proj")))
        self.act_fn = SiluAndMul()
        self.down_proj = RowParallelLinear(inter, hf_config.hidden_size, parallel, bias=bias, dtype=dtype,
                                           quant=layer_spec(quant, checkpoint_prefix, ("down_proj",)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class Qwen3DecoderLayer(nn.Module):
    def __init__(
        self,
        hf_config: Any,
        rotary_emb: RotaryEmbedding,
        make_attention: AttentionFactory,
        parallel: ModelParallel,
        dtype: Optional[torch.dtype],
        prefix: str,
        mlp: Optional[nn.Module] = None,
        attention_options: Optional[AttentionOptions] = None,
        quant: Optional[Fp8Spec] = None,
        checkpoint_prefix: str = "",
    ) -> None:
        super().__init__()
        self.self_attn = Qwen3Attention(
            hf_config, rotary_emb, make_attention, parallel, dtype, _join(prefix, "self_attn"), attention_options,
            quant=quant, checkpoint_prefix=_join(checkpoint_prefix, "self_attn"),
        )
        # MoE variants (Qwen3-MoE, Mixtral, GLM-4-MoE) differ from the dense model in this block.
        self.mlp = mlp if mlp is not None else Qwen3MLP(hf_config, parallel, dtype, quant=quant,
                                                        checkpoint_prefix=_join(checkpoint_prefix, "mlp"))
        self.input_layernorm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps, dtype=dtype)

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: Optional[torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # The residual stream is carried separately so that each norm fuses the add before it.
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class Qwen3Model(nn.Module):
    def __init__(
        self,
        hf_config: Any,
        make_attention: AttentionFactory,
        parallel: ModelParallel,
        dtype: Optional[torch.dtype],
        max_position: int,
        prefix: str,
        make_mlp: Optional[Callable[[int], Optional[nn.Module]]] = None,
        rope_params: Optional[dict[str, Any]] = None,
        attention_options: Optional[AttentionOptions] = None,
        quant: Optional[Fp8Spec] = None,
    ) -> None:
        super().__init__()
        hidden = hf_config.hidden_size
        self.embed_tokens = VocabParallelEmbedding(hf_config.vocab_size, hidden, parallel, dtype=dtype)
        head_dim = getattr(hf_config, "head_dim", None) or hidden // hf_config.num_attention_heads
        if rope_params is None:
            rope_params = rope_parameters(hf_config, DEFAULT_ROPE_THETA)
        rotary_emb = RotaryEmbedding(head_dim, rope_params, max_position)
        self.layers = nn.ModuleList(
            Qwen3DecoderLayer(hf_config, rotary_emb, make_attention, parallel, dtype, _join(prefix, f"layers.{i}"),
                              mlp=make_mlp(i) if make_mlp is not None else None,
                              attention_options=attention_options, quant=quant,
                              checkpoint_prefix=f"model.layers.{i}")
            for i in range(hf_config.num_hidden_layers)
        )
        self.norm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps, dtype=dtype)

    def forward(
        self,
        input_ids: Optional[torch.Tensor],
        positions: torch.Tensor,
        inputs_embeds: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class Qwen3ForCausalLM(nn.Module):
    """HF ``Qwen3ForCausalLM``: ``model`` (embedding, decoder layers, final norm) + ``lm_head``.

    Args:
        config: atom's Config; ``config.hf_config`` is the HF ``Qwen3Config`` (or any object with
            its fields), ``config.dtype`` the parameter dtype (None: torch's default).
        make_attention: builds each layer's attention (see :class:`AttentionFactory`); layer i's
            is named ``{prefix}model.layers.{i}.self_attn.attn``.
        parallel: this rank's tensor-parallel position and group.
        prefix: prepended to the attention layer names (the host's name for this model).

    fp8 checkpoints (``quantization_config`` with ``quant_method: fp8``, see
    :mod:`atom.models._quant`): the decoder projections load fp8 weights and scales (names in
    ``ignored_layers`` stay unquantised, as do the embedding, head, norms and routers);
    :meth:`process_weights_after_loading` repacks them once loading is done.
    """

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
        self.quant = fp8_spec(hf)
        max_position = max(int(getattr(hf, "max_position_embeddings", 0) or 0), int(config.max_model_len))
        self.model = Qwen3Model(hf, make_attention, parallel, config.dtype, max_position, _join(prefix, "model"),
                                make_mlp=lambda i: self.build_mlp(i, config, parallel),
                                rope_params=self.rope_params(hf), attention_options=self.attention_options(hf),
                                quant=self.quant)
        self.lm_head = ParallelLMHead(hf.vocab_size, hf.hidden_size, parallel, dtype=config.dtype)
        self.tie_word_embeddings = bool(getattr(hf, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head.tie_to(self.model.embed_tokens)

    # -- what variants override ----------------------------------------------------------------
    def attention_options(self, hf_config: Any) -> AttentionOptions:
        """Qwen3: QK-norm, q/k/v biases per ``attention_bias``, none on o_proj."""
        return AttentionOptions(qkv_bias=bool(getattr(hf_config, "attention_bias", False)))

    def rope_params(self, hf_config: Any) -> dict[str, Any]:
        """RoPE settings (see :func:`rope_parameters`), with this family's default base."""
        return rope_parameters(hf_config, DEFAULT_ROPE_THETA)

    def build_mlp(self, layer_idx: int, config: Config, parallel: ModelParallel) -> Optional[nn.Module]:
        """Layer ``layer_idx``'s feed-forward block; None = the dense :class:`Qwen3MLP`. Where MoE
        variants (Qwen3-MoE, Mixtral, GLM-4-MoE) differ, so everything else is shared."""
        return None

    def skip_weight(self, name: str) -> bool:
        """Checkpoint tensors that are expected and not loaded (e.g. MTP layers of GLM-4-MoE)."""
        # RoPE tables are recomputed from the config; a tied head has no weight of its own.
        return "rotary_emb.inv_freq" in name or (self.tie_word_embeddings and name == "lm_head.weight")

    def stacked_params(self) -> StackedParams:
        """Checkpoint matrices fused at load (see :func:`load_checkpoint_weights`)."""
        return STACKED_PARAMS

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
        return load_checkpoint_weights(self, weights, self.stacked_params(), self.skip_weight)

    def process_weights_after_loading(self) -> None:
        """After every tensor is loaded: fp8 layers repack for their compute path (dequantise,
        or keep fp8 for the GPU kernels). The host calls this once (vLLM: its model-level
        post-load hook through the wrapper); a no-op for an unquantised checkpoint."""
        for module in self.modules():
            if isinstance(module, (ColumnParallelLinear, RowParallelLinear, FusedMoE)):
                module.process_weights_after_loading()
