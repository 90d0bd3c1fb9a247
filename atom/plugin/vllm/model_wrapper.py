"""The vLLM model classes that ``register_model`` puts in vLLM's ``ModelRegistry``.

vLLM builds, loads and runs an atom model through these methods (vLLM 0.26 - 0.33):

* ``__init__(*, vllm_config, prefix)`` -- called by vLLM's model loader (``initialize_model``)
  inside its config / device / dtype contexts. Translates the config
  (:func:`atom.plugin.vllm.config.atom_config_from_vllm`), picks the atom model class from the one
  architecture table (:data:`atom.plugin.models.BY_ARCH`) and constructs it with everything it
  needs passed explicitly: atom's Config, an attention factory that builds vLLM's own
  ``Attention`` layers, and vLLM's tensor-parallel group. No process globals.
* ``load_weights(weights)`` -- called by vLLM's loader with vLLM's weight iterator; atom never
  reads checkpoint files itself. Returns the names loaded (vLLM checks that none is missing).
  fp8 checkpoints (vLLM's ``fp8`` quantization) load fp8 weights and scales into atom's layers.
* ``process_weights_after_loading()`` -- vLLM's model-level post-load hook (vLLM 0.32 calls it, 0.26 does not): atom's
  fp8 layers repack (dequantise on CPU, keep fp8 for the GPU kernels). vLLM's per-layer loop has
  already done so through the ``quant_method`` injected by ``atom.plugin.vllm.moe`` (the only
  post-load call older vLLM makes); the layers' repack is idempotent.
* ``forward(input_ids, positions, ...)`` -- called by the model runner each step, inside vLLM's
  forward context (attention metadata, KV caches).
* ``compute_logits(hidden_states)`` -- vLLM's ``LogitsProcessor`` over atom's vocab-parallel
  head (gather across TP ranks, vocabulary padding removed).
* ``embed_input_ids(input_ids)`` -- token embeddings (prompt embeddings, spec decode).

Only this module (and the rest of ``atom.plugin``) knows vLLM; atom's models never import it.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Iterable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Optional

import torch
from torch import nn
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

from atom import envs
from atom._logging import get_logger, info_once
from atom.models.interfaces import CausalLM, ModelParallel, missing_causal_lm_members
from atom.plugin.models import BY_ARCH
from atom.plugin.vllm import compat, overrides
from atom.plugin.vllm.compile import compiled_model_class
from atom.plugin.vllm.config import atom_config_from_vllm

#: vLLM's MLA layer class (its module moved between releases).
MLAAttention = importlib.import_module(compat.mla_attention_layer_module()).MLAAttention

logger = get_logger("atom.plugin")

#: Attribute under which the wrapper holds atom's model (its parameters are ``model.<name>``).
ATOM_MODEL_ATTR = "model"

#: Every vLLM ``--quantization`` method some atom model loads itself (per model:
#: ``atom.plugin.models.ModelEntry.quantization``).
SUPPORTED_QUANTIZATION = ("fp8",)


@dataclass(frozen=True)
class VllmAttentionFactory:
    """Builds vLLM's ``Attention`` layer for an atom model (see ``atom.models.interfaces``), and
    with :meth:`mla` vLLM's ``MLAAttention`` for multi-head latent attention models.

    vLLM's layer registers itself under ``prefix`` in the static forward context, where vLLM's
    KV-cache manager binds its cache and its attention backend (vLLM's, or atom's through the
    platform) finds its metadata; the cache and quantisation configs are vLLM's own.
    """

    cache_config: Any  # vllm.config.CacheConfig
    quant_config: Any = None  # vllm QuantizationConfig or None
    #: ATOM_ENABLE_QK_NORM_ROPE_CACHE_QUANT_FUSION, read when the wrapper builds the model.
    qk_norm_rope_fusion: bool = False

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
    ) -> nn.Module:
        attention_cls = importlib.import_module(compat.attention_layer_module()).Attention
        # vLLM hands ``sinks`` to the backend's impl (atom's: float32 copy after loading); only
        # passed when set, so models without sinks build the layer exactly as before.
        extra = {"sinks": sinks} if sinks is not None else {}
        return attention_cls(
            num_heads,
            head_dim,
            scale,
            num_kv_heads=num_kv_heads,
            cache_config=self.cache_config,
            quant_config=self.quant_config,
            per_layer_sliding_window=sliding_window,
            prefix=prefix,
            **extra,
        )

    def mla(
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
    ) -> nn.Module:
        """vLLM's ``MLAAttention`` (``atom.models.interfaces.MLAAttentionFactory``): vLLM's MLA
        backend (CPU_MLA, FlashMLA, Triton MLA, ... or atom's through the platform) owns the
        latent cache; after loading, the layer absorbs atom's ``kv_b_proj`` weight (read through
        :class:`_VllmLinearView`) into its query/output projections."""
        return AtomMLAAttention(
            num_heads=num_heads,
            scale=scale,
            qk_nope_head_dim=qk_nope_head_dim,
            qk_rope_head_dim=qk_rope_head_dim,
            v_head_dim=v_head_dim,
            q_lora_rank=q_lora_rank,
            kv_lora_rank=kv_lora_rank,
            kv_b_proj=_VllmLinearView(kv_b_proj),
            cache_config=self.cache_config,
            quant_config=self.quant_config,
            prefix=prefix,
        )

    def fuse_qk_norm_rope(self, layer: nn.Module, q_norm: nn.Module, k_norm: nn.Module,
                          rotary: nn.Module) -> bool:
        """Hand ``layer``'s impl the model's QK-norm and RoPE (see ``atom.models.interfaces``):
        True when the impl now applies them and writes the cache in one op inside ``forward``,
        so the model must pass q/k un-normed and un-rotated. False (the model does both itself)
        when the fusion is off or the layer's backend is not atom's (e.g.
        ATOM_DISABLE_VLLM_PLUGIN_ATTENTION=1)."""
        if not self.qk_norm_rope_fusion:
            return False
        enable = getattr(layer.impl, "enable_fused_qk_norm_rope", None)
        if enable is None:
            info_once("qk-fusion-backend", f"ATOM_ENABLE_QK_NORM_ROPE_CACHE_QUANT_FUSION=1 ignored: attention "
                      f"impl {type(layer.impl).__name__} is not atom's", logger)
            return False
        from atom.models.attention.mha import FusedQKNormRope

        enable(FusedQKNormRope(q_norm=q_norm, k_norm=k_norm, rotary=rotary))
        return True


class _VllmLinearView:
    """What vLLM's MLA layer and backends read of ``kv_b_proj`` (a vLLM ``LinearBase``:
    ``weight``, ``quant_method``, ``params_dtype``, ``parameters()``, and calls returning
    ``(output, bias)``), over atom's linear layer. A plain object, not a submodule, so the
    weight stays atom's parameter (loaded by atom's model, named once).

    ``weight`` is the linear's current parameter, read at every access: an fp8 checkpoint's
    ``kv_b_proj`` replaces its fp8 parameter by the dequantised one in its post-load hook
    (``Fp8Spec.dequantize``), and vLLM's split after loading must see that one, not the fp8
    tensor the layer held when this view was made."""

    quant_method = None  # unquantized: vLLM reads ``weight`` as is

    def __init__(self, linear: nn.Module) -> None:
        self.linear = linear
        self._rebound: Optional[torch.Tensor] = None

    @property
    def weight(self) -> torch.Tensor:
        return self.linear.weight if self._rebound is None else self._rebound

    @weight.setter
    def weight(self, value: torch.Tensor) -> None:
        # vLLM's CPU AMX path rebinds the weight (to an empty tensor, once it has packed its
        # own copy): this view's only, never atom's layer.
        self._rebound = value

    def process_weights_after_loading(self) -> None:
        """atom's layer's own post-load hook (idempotent): the fp8 ``kv_b_proj`` dequantises."""
        hook = getattr(self.linear, "process_weights_after_loading", None)
        if hook is not None:
            hook()

    @property
    def params_dtype(self) -> torch.dtype:
        return self.linear.weight.dtype

    def parameters(self) -> Iterable[torch.Tensor]:
        return iter([self.linear.weight])

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        return self.linear(x), None


class AtomMLAAttention(MLAAttention):
    """vLLM's ``MLAAttention``, called with atom's MLA arguments: ``forward(q, kv_c_normed,
    k_pe)`` derives the output shape vLLM's layer needs from ``q`` (vLLM's own models pass it).
    A subclass, so every isinstance check of vLLM's still sees its layer; vLLM's class itself is
    untouched."""

    def forward(self, q: torch.Tensor, kv_c_normed: torch.Tensor, k_pe: torch.Tensor,
                output_shape: Any = None, **kwargs: Any) -> torch.Tensor:
        if output_shape is None:
            output_shape = (q.shape[0], self.num_heads * self.v_head_dim)
        return super().forward(q, kv_c_normed, k_pe, output_shape=output_shape, **kwargs)


class _HeadMethod(UnquantizedEmbeddingMethod):
    """vLLM's ``LogitsProcessor`` projects through ``lm_head.quant_method.apply``; this one runs
    atom's head (and is an unquantized method, so vLLM's fp32 ``head_dtype`` path accepts it)."""

    def apply(self, layer: Any, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        return layer.local_logits(x, bias)


class _VllmHeadView:
    """What ``LogitsProcessor`` reads of an lm_head (``quant_method``, ``tp_size``, ``weight``),
    over atom's vocab-parallel head. A plain object, not a submodule: the weight stays atom's."""

    quant_method = _HeadMethod()

    def __init__(self, head: Any) -> None:
        self.head = head

    @property
    def weight(self) -> torch.Tensor:
        return self.head.weight

    @property
    def tp_size(self) -> int:
        return self.head.tp_size

    def local_logits(self, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        return self.head.local_logits(x, bias)


def resolve_model_class(qualname: str) -> type[nn.Module]:
    """``"atom.models.qwen3:Qwen3ForCausalLM"`` -> the class."""
    module_name, _, class_name = qualname.partition(":")
    return getattr(importlib.import_module(module_name), class_name)


def vllm_groups() -> Any:
    """vLLM's own process groups for this worker (never a second group): ``tp_rank``,
    ``tp_size``, ``tp_group`` and ``ep_group`` (vLLM creates it for MoE models only)."""
    from vllm.distributed import parallel_state as ps

    tp = ps.get_tp_group()
    ep = ps.get_ep_group() if getattr(ps, "_EP", None) is not None else None
    return SimpleNamespace(tp_rank=tp.rank_in_group, tp_size=tp.world_size, tp_group=tp, ep_group=ep)


def model_parallel(groups: Any) -> ModelParallel:
    """atom's view of vLLM's groups (:func:`vllm_groups`): TP position and group, plus vLLM's
    EP group (a ``GroupCoordinator``).

    When the EP group holds the same ranks as the TP group (data_parallel_size == 1, the only
    EP layout atom's models accept), the experts' all-reduce goes over the TP group, as vLLM's
    own FusedMoE does: vLLM puts only the TP (and PP) group into CUDA-graph capture mode, and
    its EP group has no custom all-reduce. (Tried first as the cause of a TP2 + EP crash at graph
    capture; that crash was NaN routing, bench/NOTES.md entries 11-12.)"""
    tp = ModelParallel.of(groups)
    ep = getattr(groups, "ep_group", None)
    if ep is None:
        return tp
    ranks = getattr(ep, "ranks", None)
    if ranks is not None and list(ranks) == list(getattr(groups.tp_group, "ranks", None) or []):
        ep = groups.tp_group
    return dataclasses.replace(tp, ep_rank=int(ep.rank_in_group), ep_size=int(ep.world_size), ep_group=ep)


@compiled_model_class  # vLLM torch.compiles forward as for its own models (atom.plugin.vllm.compile)
class ATOMModelBase(nn.Module):
    """A vLLM model that runs an atom model (chosen by HF architecture from the arch table).

    Constructing it where atom's model does not run the engine's layout or checkpoint
    (:func:`atom.plugin.vllm.overrides.builds`: pipeline parallelism, expert parallelism across
    data-parallel ranks, LoRA adapters, speculative decoding with a draft, a quantization format
    atom does not load) builds vLLM's own class for the architecture instead, with one INFO line:
    vLLM resolves the class before it knows these, and stock vLLM serves them. Where this process
    holds no vLLM entry to fall back on (atom's overrides not registered here), it refuses with
    the reason."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        vllm_config = kwargs.get("vllm_config")  # None: not vLLM's call, which __init__ refuses
        decision = overrides.builds(vllm_config) if vllm_config is not None else None
        if decision is None or decision.value:
            return super().__new__(cls)
        arch = (getattr(vllm_config.model_config.hf_config, "architectures", None) or ["?"])[0]
        stock = overrides.stock_class(arch)
        if stock is None:
            raise NotImplementedError(f"atom's {arch} does not serve this engine ({decision.reason}) and vLLM's own "
                                      "class is not registered in this process; set ATOM_DISABLE_VLLM_PLUGIN=1 to "
                                      "use vLLM's model")
        overrides.step_aside_once(arch, decision.reason)
        if getattr(vllm_config, "quant_config", None) is not None:
            # vLLM passed atom's class, which has no module mappings, to its quant config
            from vllm.model_executor.model_loader.utils import configure_quant_config

            configure_quant_config(vllm_config.quant_config, stock)
        return stock(*args, **kwargs)  # not an instance of cls: Python skips cls.__init__

    def __init__(self, *, vllm_config: Any, prefix: str = "") -> None:
        super().__init__()
        hf_config = vllm_config.model_config.hf_config
        arch = (getattr(hf_config, "architectures", None) or ["?"])[0]
        entry = BY_ARCH.get(arch)
        if entry is None:
            raise ValueError(f"atom has no model for architecture {arch!r} (atom.plugin.models.MODEL_TABLE)")

        groups = vllm_groups()
        self.atom_config = atom_config_from_vllm(vllm_config)
        model_cls = resolve_model_class(entry.model)
        model = model_cls(
            self.atom_config,
            make_attention=VllmAttentionFactory(vllm_config.cache_config, vllm_config.quant_config,
                                                qk_norm_rope_fusion=envs.ATOM_ENABLE_QK_NORM_ROPE_CACHE_QUANT_FUSION),
            parallel=model_parallel(groups),
            prefix=prefix,
        )
        missing = missing_causal_lm_members(model)
        if missing:
            raise TypeError(f"{entry.model} does not implement atom.models.interfaces.CausalLM: "
                            f"missing {', '.join(missing)}")
        setattr(self, ATOM_MODEL_ATTR, model)
        self.atom_model_class = entry.model
        self.logits_processor = LogitsProcessor(hf_config.vocab_size)
        self._head = _VllmHeadView(model.lm_head)
        logger.info("built %s (%s) for %s, tp rank %d of %d", entry.model, type(self).__name__, arch,
                    groups.tp_rank, groups.tp_size)

    @property
    def atom_model(self) -> CausalLM:
        return getattr(self, ATOM_MODEL_ATTR)

    # -- what vLLM calls ------------------------------------------------------------------------
    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.atom_model.embed_input_ids(input_ids)

    def get_input_embeddings(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The name older vLLM releases call ``embed_input_ids`` by."""
        return self.embed_input_ids(input_ids)

    def forward(
        self,
        input_ids: Optional[torch.Tensor],
        positions: torch.Tensor,
        intermediate_tensors: Any = None,
        inputs_embeds: Optional[torch.Tensor] = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        if intermediate_tensors is not None:
            raise NotImplementedError("atom models do not support pipeline parallelism yet")
        return self.atom_model(input_ids, positions, inputs_embeds=inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> Optional[torch.Tensor]:
        """Full-vocabulary logits (None on TP ranks > 0 where vLLM gathers to rank 0 only)."""
        return self.logits_processor(self._head, hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded = self.atom_model.load_weights(weights)
        return {f"{ATOM_MODEL_ATTR}.{name}" for name in loaded}

    def process_weights_after_loading(self) -> None:
        """vLLM's model-level post-load hook (after its per-layer ones, vLLM's ``Attention``
        included): where an atom model repacks its weights for its kernels, if it needs to."""
        hook = getattr(self.atom_model, "process_weights_after_loading", None)
        if hook is not None:
            hook()


class ATOMForCausalLM(ATOMModelBase):
    """Dense decoder-only models (Qwen3, Llama, ...)."""


class ATOMMoEForCausalLM(ATOMModelBase):
    """Mixture-of-experts models (Qwen3-MoE, ...). Expert parallelism follows vLLM's
    ``enable_expert_parallel`` (atom Config field of the same name, vLLM's EP group); vLLM's
    expert-load balancing (EPLB, the ``MixtureOfExperts`` interface) is not implemented."""
