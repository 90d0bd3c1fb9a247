"""The SGLang model classes that ``register`` puts in SGLang's ``ModelRegistry``: one per
architecture of atom's table (``atom.plugin.models``), each *named* after its HF architecture
(SGLang keys models by class name) and defined here, not generated.

SGLang builds, loads and runs them through (0.5.17):

* ``__init__(config, quant_config=None, prefix="")`` -- inside SGLang's dtype / device
  contexts. Translates the configuration (:func:`atom_config_from_sglang`), takes the atom model
  class from the one table and constructs it with an attention factory that builds SGLang's own
  ``RadixAttention`` layers (SGLang's KV pool and attention backend, atom's ``atom`` backend
  included, own the cache) and SGLang's tensor-parallel group. No process globals.
* ``load_weights(weights)`` -- SGLang's weight iterator (HF names; atom never reads the files);
  then atom's post-load repack and each attention impl's ``prepare_weights``.
* ``forward(input_ids, positions, forward_batch, ...)`` -- per step; returns SGLang's
  ``LogitsProcessor`` output over atom's vocab-parallel head.

Only ``atom.plugin.sglang`` knows SGLang; atom's models never import it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import nn

from atom import envs
from atom._logging import get_logger, info_once
from atom.config import Config
from atom.models.interfaces import ModelParallel, missing_causal_lm_members
from atom.plugin import Decision
from atom.plugin.models import BY_ARCH
from atom.plugin.sglang.attention import impl_for_layer
from atom.plugin.sglang.compat import BACKEND_NAME
from sglang.srt.layers.logits_processor import LogitsProcessor
from sglang.srt.layers.radix_attention import RadixAttention

logger = get_logger("atom.plugin")

_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass
class StepContext:
    """The step an atom model is running: SGLang passes its ``ForwardBatch`` to the model's
    ``forward`` only, and atom's layers (host-neutral: ``attn(q, k, v)``) find it here. One per
    model, shared by its attention layers; set by :meth:`ATOMSGLangModelBase.forward`."""

    forward_batch: Any = None


class ATOMRadixAttention(RadixAttention):
    """SGLang's ``RadixAttention``, called with atom's arguments: ``forward(q, k, v)`` takes the
    step's ``ForwardBatch`` from the model's :class:`StepContext`. A subclass, so every SGLang
    check still sees its layer; SGLang's class is untouched. ``atom_impl``: the impl atom's
    ``atom`` backend runs for this layer (SGLang's own backends never read it)."""

    def __init__(self, *args: Any, step: StepContext, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._step = step  # a plain object, not a submodule
        self.atom_impl: Any = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return super().forward(q, k, v, self._step.forward_batch, *args, **kwargs)


@dataclass
class SGLangAttentionFactory:
    """Builds SGLang's attention layer for an atom model (``atom.models.interfaces``)."""

    step: StepContext
    page_size: int
    max_num_seqs: Optional[int]
    #: atom's backend serves the layers (``--attention-backend atom`` and atom's attention on)
    atom_backend: bool
    qk_norm_rope_fusion: bool = False
    layers: list = field(default_factory=list)

    def __call__(self, *, num_heads: int, head_dim: int, scale: float, num_kv_heads: int, prefix: str,
                 sliding_window: Optional[int] = None, sinks: Optional[torch.Tensor] = None) -> nn.Module:
        if sinks is not None or sliding_window is not None:
            raise NotImplementedError("atom's models under SGLang have no attention sinks or per-layer "
                                      "sliding window yet; set ATOM_DISABLE_SGLANG_PLUGIN=1 for SGLang's model")
        match = _LAYER_INDEX.search(prefix + ".")
        if match is None:
            raise ValueError(f"cannot tell the layer index of attention layer {prefix!r} (SGLang's KV pool is per layer)")
        layer = ATOMRadixAttention(num_heads, head_dim, scale, num_kv_heads, int(match.group(1)), prefix=prefix,
                                   step=self.step)
        if self.atom_backend:
            layer.atom_impl = impl_for_layer(layer, max_num_seqs=self.max_num_seqs, page_size=self.page_size)
        self.layers.append(layer)
        return layer

    def fuse_qk_norm_rope(self, layer: nn.Module, q_norm: nn.Module, k_norm: nn.Module, rotary: nn.Module) -> bool:
        """As vLLM's factory: True when atom's impl of ``layer`` now applies QK-norm and RoPE and
        writes the cache in one op (only on atom's backend, with the fusion switched on)."""
        if not self.qk_norm_rope_fusion:
            return False
        if layer.atom_impl is None:
            info_once("sglang-qk-fusion-backend", "ATOM_ENABLE_QK_NORM_ROPE_CACHE_QUANT_FUSION=1 ignored: "
                      f"SGLang's attention backend is not atom's (--attention-backend {BACKEND_NAME})", logger)
            return False
        from atom.models.attention.mha import FusedQKNormRope

        layer.atom_impl.enable_fused_qk_norm_rope(FusedQKNormRope(q_norm=q_norm, k_norm=k_norm, rotary=rotary))
        return True


class _SGLangHeadMethod:
    """What SGLang's ``LogitsProcessor`` applies as ``lm_head.quant_method.apply(head, x, bias)``:
    atom's local logits (SGLang then gathers across TP ranks and cuts the vocabulary padding)."""

    def apply(self, layer: Any, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        return layer.local_logits(x, bias)


class _SGLangHeadView:
    """What ``LogitsProcessor`` reads of an lm_head (``weight``, ``quant_method``), over atom's
    vocab-parallel head. A plain object, not a submodule: the weight stays atom's."""

    quant_method = _SGLangHeadMethod()

    def __init__(self, head: Any) -> None:
        self.head = head

    @property
    def weight(self) -> torch.Tensor:
        return self.head.weight

    def local_logits(self, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        return self.head.local_logits(x, bias)


def sglang_parallel() -> ModelParallel:
    """SGLang's own tensor-parallel group for this rank (its ``GroupCoordinator`` has the
    collectives of ``atom.models.interfaces.TPGroup``)."""
    from sglang.srt.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size, get_tp_group

    size = get_tensor_model_parallel_world_size()
    return ModelParallel(tp_rank=get_tensor_model_parallel_rank(), tp_size=size,
                         tp_group=get_tp_group() if size > 1 else None)


def atom_config_from_sglang(hf_config: Any, server_args: Any) -> Config:
    """SGLang's server arguments -> atom's Config (what atom's models read); the dtype is the one
    SGLang builds the model under."""
    max_model_len = int(server_args.context_length or getattr(hf_config, "max_position_embeddings", 0) or 0)
    return Config(hf_config=hf_config, dtype=torch.get_default_dtype(), max_model_len=max_model_len,
                  enable_expert_parallel=int(getattr(server_args, "ep_size", 1) or 1) > 1)


#: What SGLang reads of the registry's class before it builds one (its loader's quantization
#: config: module mappings, prefix remap, weight-name mapper; the expert-location metadata of MoE
#: models). atom's wrapper presents the class it replaces (:func:`adopt_stock`), so SGLang
#: prepares exactly what that class needs where atom steps aside for it (:func:`builds`); atom's
#: own models load unquantized checkpoints on one rank, where none of these is used.
STOCK_CLASS_ATTRIBUTES = ("packed_modules_mapping", "remap_prefix", "hf_to_sglang_mapper",
                          "get_model_config_for_expert_location")


def adopt_stock(wrapper: type, stock: type) -> None:
    """Remember SGLang's own class ``stock`` on atom's ``wrapper`` (which replaces it in the
    registry) and present its :data:`STOCK_CLASS_ATTRIBUTES`."""
    wrapper.stock_class = stock
    for name in STOCK_CLASS_ATTRIBUTES:
        if hasattr(stock, name):
            setattr(wrapper, name, getattr(stock, name))


_PARALLEL_SIZES = ("tp_size", "pp_size", "ep_size", "dp_size", "moe_dp_size", "attn_cp_size")


def builds(quant_config: Any, server_args: Any) -> Decision:
    """Decision(True/False, reason): does atom's model serve this SGLang engine? Asked when SGLang
    constructs the registry's class, the first point that sees the checkpoint's quantization
    (SGLang resolves the class from the architecture name alone). Not: a quantized checkpoint
    (atom's models under SGLang load unquantized weights), or more than one rank (SGLang's TP
    group is wired, :func:`sglang_parallel`, but no multi-rank SGLang run has checked atom's
    models yet; pipeline, expert and data parallelism are not implemented), LoRA adapters or
    speculative decoding (atom's wrappers implement neither SGLang's LoRA nor its draft hooks)."""
    if quant_config is not None:
        name = quant_config.get_name() if hasattr(quant_config, "get_name") else type(quant_config).__name__
        return Decision(False, f"a {name!r} checkpoint: atom's models under SGLang load unquantized checkpoints only")
    sizes = {f: int(getattr(server_args, f, 1) or 1) for f in _PARALLEL_SIZES}
    many = ", ".join(f"{f}={n}" for f, n in sizes.items() if n > 1)
    if many:
        return Decision(False, f"{many}: atom's models under SGLang run on one rank for now")
    if getattr(server_args, "enable_lora", None) or getattr(server_args, "lora_paths", None):
        return Decision(False, "LoRA adapters enabled: atom's models under SGLang take none")
    algorithm = getattr(server_args, "speculative_algorithm", None)
    if algorithm:
        return Decision(False, f"speculative decoding ({algorithm}): atom's models under SGLang have no draft hooks")
    return Decision(True, "an unquantized checkpoint on one rank")


class ATOMSGLangModelBase(nn.Module):
    """An SGLang model that runs an atom model (chosen by HF architecture from the table).

    Constructed where atom's model does not serve the engine (:func:`builds`: a quantized
    checkpoint, more than one rank, LoRA adapters, speculative decoding), it builds SGLang's own
    class it replaced instead
    (``stock_class``, :func:`adopt_stock`), with one INFO line: stock SGLang serves these. Where
    that class is unknown (atom's override not registered in this process), it refuses with the
    reason."""

    #: SGLang's own class for this architecture, set when atom's override replaces it.
    stock_class: Optional[type] = None

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        from sglang.srt.server_args import get_global_server_args

        quant_config = kwargs.get("quant_config", args[1] if len(args) > 1 else None)
        decision = builds(quant_config, get_global_server_args())
        if decision.value:
            return super().__new__(cls)
        if cls.stock_class is None:
            raise NotImplementedError(f"atom's {cls.__name__} does not serve this SGLang engine ({decision.reason}) "
                                      "and SGLang's own class is not registered in this process; set "
                                      "ATOM_DISABLE_SGLANG_PLUGIN=1 to use SGLang's model")
        info_once(f"sglang-step-aside:{cls.__name__}:{decision.reason}",
                  f"atom steps aside for {cls.__name__} ({decision.reason}): SGLang's own model serves it", logger)
        return cls.stock_class(*args, **kwargs)  # not an instance of cls: Python skips cls.__init__

    def __init__(self, config: Any, quant_config: Any = None, prefix: str = "") -> None:
        super().__init__()
        from sglang.srt.server_args import get_global_server_args

        arch = (getattr(config, "architectures", None) or [type(self).__name__])[0]
        entry = BY_ARCH.get(arch)
        if entry is None or entry.sglang_wrapper != type(self).__name__:
            raise ValueError(f"atom's {type(self).__name__} does not serve architecture {arch!r}")
        args = get_global_server_args()
        from atom.plugin.sglang.attention_mha import attention_backend

        decision = attention_backend()
        on_atom = args.attention_backend == BACKEND_NAME and bool(decision.value) and \
            args.prefill_attention_backend in (None, BACKEND_NAME) and args.decode_attention_backend in (None, BACKEND_NAME)
        if on_atom:
            where = "atom's backend"
        elif args.attention_backend == BACKEND_NAME:
            where = f"SGLang's own backend ({decision.reason})"
        else:
            where = f"SGLang's {args.attention_backend}"
        self.config = config
        self.step = StepContext()
        self.atom_config = atom_config_from_sglang(config, args)
        parallel = sglang_parallel()
        model_cls = _resolve(entry.model)
        self.factory = SGLangAttentionFactory(
            self.step, page_size=int(args.page_size or 1), max_num_seqs=args.max_running_requests,
            atom_backend=on_atom, qk_norm_rope_fusion=envs.ATOM_ENABLE_QK_NORM_ROPE_CACHE_QUANT_FUSION)
        self.model = model_cls(self.atom_config, make_attention=self.factory, parallel=parallel, prefix=prefix)
        missing = missing_causal_lm_members(self.model)
        if missing:
            raise TypeError(f"{entry.model} does not implement atom.models.interfaces.CausalLM: missing {', '.join(missing)}")
        self.logits_processor = LogitsProcessor(config)
        self._head = _SGLangHeadView(self.model.lm_head)
        logger.info("built %s (%s) for %s under SGLang, tp rank %d of %d, attention on %s", entry.model,
                    type(self).__name__, arch, parallel.tp_rank, parallel.tp_size, where)

    @property
    def lm_head(self) -> Any:
        """SGLang's view of atom's head (speculative decoding and tooling read ``lm_head``)."""
        return self._head

    def get_input_embeddings(self) -> nn.Module:
        return self.model.model.embed_tokens

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: Any,
                input_embeds: Optional[torch.Tensor] = None, get_embedding: bool = False,
                pp_proxy_tensors: Any = None) -> Any:
        if get_embedding or pp_proxy_tensors is not None:
            raise NotImplementedError("atom's models under SGLang serve generation without pipeline parallelism")
        self.step.forward_batch = forward_batch
        try:
            hidden_states = self.model(input_ids, positions, inputs_embeds=input_embeds)
        finally:
            self.step.forward_batch = None
        return self.logits_processor(input_ids, hidden_states, self._head, forward_batch)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded = self.model.load_weights(weights)
        self.model.process_weights_after_loading()
        dtype = torch.get_default_dtype() if self.atom_config.dtype is None else self.atom_config.dtype
        for layer in self.factory.layers:
            if layer.atom_impl is not None:
                layer.atom_impl.prepare_weights(dtype)
        return {f"model.{name}" for name in loaded}


def _resolve(qualname: str) -> type[nn.Module]:
    import importlib

    module_name, _, class_name = qualname.partition(":")
    return getattr(importlib.import_module(module_name), class_name)


class Qwen3ForCausalLM(ATOMSGLangModelBase):
    """atom's Qwen3 (``atom.models.qwen3``) under SGLang."""


class Qwen3MoeForCausalLM(ATOMSGLangModelBase):
    """atom's Qwen3-MoE (``atom.models.qwen3_moe``) under SGLang (experts over the TP group)."""


class LlamaForCausalLM(ATOMSGLangModelBase):
    """atom's Llama (``atom.models.llama``) under SGLang."""
