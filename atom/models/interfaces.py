"""The contract between a host wrapper (``atom.plugin``) and atom's models.

A model receives, explicitly in its constructor:

* atom's :class:`atom.config.Config` (``config.hf_config`` holds the architecture dims);
* an :class:`AttentionFactory`, which builds the host's attention layer (in vLLM: vLLM's own
  ``Attention``, so vLLM's KV-cache manager and attention backend own the cache); models with
  multi-head latent attention (DeepSeek) call its ``mla`` method (:class:`MLAAttentionFactory`);
* a :class:`ModelParallel` describing this rank's tensor-parallel position and the host's
  process group (reused, never a second group).

and provides the :class:`CausalLM` methods. Nothing here imports a host framework.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Optional, Protocol, runtime_checkable

import torch
from torch import nn


@runtime_checkable
class TPGroup(Protocol):
    """The collectives atom's layers use. vLLM's ``GroupCoordinator`` satisfies it as is."""

    def all_reduce(self, input_: torch.Tensor) -> torch.Tensor: ...

    def all_gather(self, input_: torch.Tensor, dim: int = -1) -> torch.Tensor: ...


@dataclass(frozen=True)
class ModelParallel:
    """This rank's place in the tensor-parallel group (and in the expert-parallel group, which
    MoE layers use instead of the TP group when the config enables expert parallelism).

    ``tp_group`` is required when ``tp_size > 1``, ``ep_group`` when ``ep_size > 1``; with one
    rank no collective is ever called. ``atom.plugin.vllm.model_wrapper.vllm_groups()`` (vLLM's groups)
    has the TP fields.
    """

    tp_rank: int = 0
    tp_size: int = 1
    tp_group: Optional[TPGroup] = None
    ep_rank: int = 0
    ep_size: int = 1
    ep_group: Optional[TPGroup] = None

    def __post_init__(self) -> None:
        if self.tp_size < 1 or not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"invalid tensor-parallel position: rank {self.tp_rank} of {self.tp_size}")
        if self.tp_size > 1 and self.tp_group is None:
            raise ValueError(f"tp_size={self.tp_size} needs a tp_group for the collectives")
        if self.ep_size < 1 or not 0 <= self.ep_rank < self.ep_size:
            raise ValueError(f"invalid expert-parallel position: rank {self.ep_rank} of {self.ep_size}")
        if self.ep_size > 1 and self.ep_group is None:
            raise ValueError(f"ep_size={self.ep_size} needs an ep_group for the collectives")

    @classmethod
    def of(cls, groups: Any) -> "ModelParallel":
        """From any object with ``tp_rank``, ``tp_size`` and ``tp_group`` (e.g. vLLM's groups)."""
        return cls(tp_rank=int(groups.tp_rank), tp_size=int(groups.tp_size), tp_group=groups.tp_group)


class AttentionFactory(Protocol):
    """Builds one attention layer; the returned module's ``forward(q, k, v)`` returns
    ``[num_tokens, num_heads * head_dim]``.

    ``q`` is ``[num_tokens, num_heads * head_dim]`` and ``k``/``v`` are
    ``[num_tokens, num_kv_heads * head_dim]``, already normalised and rotated; head counts are
    this rank's (after tensor-parallel splitting). The layer finds its sequence boundaries and KV
    cache itself (vLLM: through its forward context, keyed by ``prefix``, which therefore must be
    unique per layer, e.g. ``model.layers.0.self_attn.attn``). ``sliding_window=None`` means the
    host's model-level default. ``sinks`` (GPT-OSS): this rank's ``[num_heads]`` attention-sink
    logits, a parameter of the model that the layer reads after the weights are loaded (each
    adds ``exp(sink)`` to its head's softmax denominator).
    """

    def __call__(
        self,
        *,
        num_heads: int,
        head_dim: int,
        scale: float,
        num_kv_heads: int,
        prefix: str,
        sliding_window: Optional[int] = None,
        sinks: Optional[torch.Tensor] = None,
    ) -> nn.Module: ...

    # Optional: ``fuse_qk_norm_rope(layer, q_norm, k_norm, rotary) -> bool``. A factory that has
    # it may take over a layer's per-head QK RMSNorm and RoPE (modules with ``weight``/``eps`` and
    # ``cos_sin_cache``/``rotary_dim``/``is_neox_style``); when it returns True the model passes
    # that layer q/k before norm and rotation. Models look it up with ``getattr``.


class MLAAttentionFactory(Protocol):
    """Builds one multi-head latent attention (MLA, DeepSeek-V2/V3) layer; a host offers it as the
    ``mla`` method of its :class:`AttentionFactory` (a host without one cannot run MLA models).

    The returned module's ``forward(q, kv_c_normed, k_pe)`` returns ``[num_tokens, num_heads *
    v_head_dim]``, the per-head attention output before ``o_proj``:

    * ``q``: ``[num_tokens, num_heads, qk_nope_head_dim + qk_rope_head_dim]``, the rope part
      already rotated;
    * ``kv_c_normed``: ``[num_tokens, kv_lora_rank]``, the normalised latent (what the cache keeps);
    * ``k_pe``: ``[num_tokens, 1, qk_rope_head_dim]``, the shared rotated key part (cached too).

    ``kv_b_proj`` is the model's own up-projection from the latent to per-head ``[k_nope; v]``
    (``weight``: ``[num_heads * (qk_nope_head_dim + v_head_dim), kv_lora_rank]``, this rank's
    heads; calling it maps ``[T, kv_lora_rank]`` to ``[T, num_heads * (nope + v)]``). The host
    may absorb it into the query/output side (vLLM does, after loading), so the model never calls
    it itself; it stays the model's parameter and is loaded by the model. Head counts are this
    rank's; ``prefix`` names the layer as for :class:`AttentionFactory`.
    """

    def __call__(
        self,
        *,
        num_heads: int,
        scale: float,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        q_lora_rank: Optional[int],
        kv_lora_rank: int,
        kv_b_proj: nn.Module,
        prefix: str,
    ) -> nn.Module: ...


class LMHead(Protocol):
    """What a host needs of a model's vocab-parallel output projection."""

    weight: torch.Tensor  # [padded_vocab // tp_size, hidden]: this rank's rows
    tp_size: int
    vocab_size: int  # the real vocabulary (logits past it are padding)

    def local_logits(self, hidden_states: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor: ...


@runtime_checkable
class CausalLM(Protocol):
    """What every atom causal LM provides to its host wrapper."""

    lm_head: Any  # an LMHead

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor: ...

    def forward(
        self,
        input_ids: Optional[torch.Tensor],
        positions: torch.Tensor,
        inputs_embeds: Optional[torch.Tensor] = None,
    ) -> torch.Tensor: ...

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor: ...

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]: ...


#: The members of :class:`CausalLM`, checked by :func:`missing_causal_lm_members`.
CAUSAL_LM_MEMBERS = ("lm_head", "embed_input_ids", "forward", "compute_logits", "load_weights")


def missing_causal_lm_members(model: Any) -> list[str]:
    """The :class:`CausalLM` members ``model`` lacks.

    Not ``isinstance(model, CausalLM)``: from Python 3.12 a runtime-checkable protocol looks
    members up with ``inspect.getattr_static``, which does not see an ``nn.Module``'s submodules
    (they live in ``_modules``), so a model whose ``lm_head`` is a submodule would be rejected.
    """
    return [name for name in CAUSAL_LM_MEMBERS if getattr(model, name, None) is None]
