"""The framework-facing attention decorators shared by atom's MHA and MLA backends.

atom's backend / metadata-builder / impl classes (``attention_mha.py``, ``attention_mla.py``)
hold atom's own declarations and math; what vLLM calls on them is *injected* by three
:class:`atom.patches.Injection` records per backend, declared in ``atom.plugin.vllm.patches``:

* the **backend decorator** (:class:`VLLMBackendMethods`, :data:`BACKEND_MEMBERS`): the
  classmethods vLLM's selector, ``Attention.__init__`` and KV-cache manager call -- ``get_name``,
  ``get_impl_cls``, ``get_builder_cls``, the KV-cache geometry (``get_kv_cache_shape`` <= 0.28,
  ``supported_kv_cache_layouts`` >= 0.29, kernel block sizes) and the ``supports_*`` /
  ``validate_configuration`` answers. They read plain declarations of the atom class
  (``backend_name``, ``impl_cls``, ``builder_cls``, ``kv_cache_shape``, ``kv_cache_layouts``,
  ``block_size_multiple``, ``max_head_size``, ``has_sinks``, ``has_sliding_window``), so the MLA
  backend gets them by declaring its own values; what only MLA answers (``is_mla``, its head
  sizes and layouts) comes from a subclass of the shared source
  (``attention_mla.VLLMMLABackendMethods``), injected by the same record factory.
* the **builder decorator** (:class:`VLLMBuilderMethods`, :data:`BUILDER_MEMBERS`): ``build``,
  ``build_for_cudagraph_capture`` and ``build_for_drafting`` (spec-decode drafts), each turning
  vLLM's ``CommonAttentionMetadata`` into atom's metadata through the atom builder's
  ``build_metadata(common, for_capture=..., fast=...)``.
* the impl decorator, per backend kind (``attention_mha.VLLMMHAImplMethods``; MLA:
  ``attention_mla.MLA_IMPL_INJECTION``): the plugin-mode ``forward`` / ``do_kv_cache_update`` /
  ``process_weights_after_loading``.

The records are applied when vLLM is the chosen framework: armed by ``register_model`` in every
vLLM process (they land when vLLM imports the backend module by qualname) and applied before
``select_attention_backend`` hands a backend to vLLM (:func:`apply_decorators`). Reverting them
leaves atom's classes as declared (abstract for vLLM: the builder cannot be instantiated).
"""

from __future__ import annotations

import inspect
from typing import Any, Optional

import torch

from vllm.v1.attention.backend import AttentionBackend, AttentionType, MultipleOf

#: Members the backend decorator injects (exactly these; the record lists them).
BACKEND_MEMBERS = (
    "get_name", "get_impl_cls", "get_builder_cls", "get_supported_kernel_block_sizes",
    "get_kv_cache_shape", "supported_kv_cache_layouts", "get_supported_head_sizes",
    "supports_head_size", "supports_sink", "supports_sliding_window", "supports_kv_connector",
    "supports_device_cpu_query_lens_mismatch", "supports_combination", "validate_configuration",
)

#: Members the builder decorator injects.
BUILDER_MEMBERS = ("build", "build_for_cudagraph_capture", "build_for_drafting")

# Every AttentionSelectorConfig field either release passes to validate_configuration
# (0.26: through use_pcp; 0.29+ adds use_adaptive_verification, use_dcp, use_rswa).
_FLAG_FIELDS = (
    "use_mla", "has_sink", "use_sparse", "use_mm_prefix", "use_per_head_quant_scales",
    "has_sliding_window", "use_non_causal", "use_batch_invariant", "use_kv_connector",
    "use_pcp", "use_adaptive_verification", "use_dcp", "use_rswa",
)


class VLLMBackendMethods:
    """Source of the backend decorator. Every member is a classmethod reading the atom backend's
    declarations (vLLM's base declares some as staticmethods; both are called on the class)."""

    @classmethod
    def get_name(cls) -> str:
        """The ``AttentionBackendEnum`` member name (``Attention.__init__`` looks it up)."""
        return cls.backend_name

    @classmethod
    def get_impl_cls(cls) -> type:
        return cls.impl_cls

    @classmethod
    def get_builder_cls(cls) -> type:
        return cls.builder_cls

    @classmethod
    def get_supported_kernel_block_sizes(cls, kv_cache_spec: Any = None) -> list[Any]:
        return [MultipleOf(cls.block_size_multiple)]

    @classmethod
    def get_kv_cache_shape(
        cls,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        cache_dtype_str: str = "auto",
    ) -> tuple[int, ...]:
        """vLLM <= 0.28 allocates this shape per layer (atom's ``kv_cache_shape``)."""
        if block_size % cls.block_size_multiple != 0:
            raise ValueError(
                f"{cls.__name__} needs a block size that is a multiple of {cls.block_size_multiple}, "
                f"got {block_size}"
            )
        return tuple(cls.kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size))

    @classmethod
    def supported_kv_cache_layouts(cls) -> Any:
        """vLLM >= 0.29: atom's preferred layouts first, then (when the kernels take any strides)
        every other layout vLLM knows."""
        from vllm.v1.kv_cache_layout import KVCacheLayout

        preferred = tuple(KVCacheLayout[name] for name in cls.kv_cache_layouts)
        if not cls.any_kv_cache_layout:
            return preferred
        return preferred + tuple(layout for layout in KVCacheLayout if layout not in preferred)

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return []  # any size up to max_head_size, see supports_head_size

    @classmethod
    def supports_head_size(cls, head_size: int) -> bool:
        return 0 < head_size <= cls.max_head_size

    @classmethod
    def supports_sink(cls) -> bool:
        return bool(cls.has_sinks)

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return bool(cls.has_sliding_window)

    @classmethod
    def supports_kv_connector(cls) -> bool:
        return False  # never exercised with a KV connector

    @classmethod
    def supports_device_cpu_query_lens_mismatch(cls) -> bool:
        return False  # adaptive verification (spec decode) is not exercised with atom's backends

    @classmethod
    def supports_combination(
        cls,
        head_size: int,
        dtype: torch.dtype,
        kv_cache_dtype: Optional[str],
        block_size: Optional[int],
        use_mla: bool,
        has_sink: bool,
        use_sparse: bool,
        use_mm_prefix: bool,
        device_capability: Any,
    ) -> Optional[str]:
        # A 16-bit cache under another activation dtype would make the kernels mix dtypes.
        if kv_cache_dtype in ("float16", "bfloat16") and getattr(torch, kv_cache_dtype) != dtype:
            return f"kv_cache_dtype {kv_cache_dtype} differs from the model dtype {dtype}"
        return None

    @classmethod
    def validate_configuration(
        cls,
        head_size: int,
        dtype: torch.dtype,
        kv_cache_dtype: Optional[str],
        block_size: Optional[int],
        use_mla: bool,
        has_sink: bool,
        use_sparse: bool,
        use_mm_prefix: bool,
        use_per_head_quant_scales: bool,
        device_capability: Any,
        attn_type: str,
        has_sliding_window: bool = False,
        use_non_causal: bool = False,
        use_batch_invariant: bool = False,
        use_kv_connector: bool = False,
        use_pcp: bool = False,
        use_adaptive_verification: bool = False,
        use_dcp: bool = False,
        use_rswa: bool = False,
        **newer_fields: Any,
    ) -> list[str]:
        """vLLM's checks (its base method, given the fields it knows) plus a refusal of any
        selector field newer than atom: a feature atom has never seen is not assumed to work."""
        given = dict(locals())
        base = AttentionBackend.validate_configuration.__func__
        accepted = inspect.signature(base).parameters
        reasons = base(cls, **{k: given[k] for k in accepted if k in given and k != "cls"})
        # Fields the installed base method does not check (0.26's lacks the last three).
        if use_adaptive_verification and "use_adaptive_verification" not in accepted:
            reasons.append("adaptive verification not supported")
        if use_dcp and "use_dcp" not in accepted:
            reasons.append("DCP not supported")
        if use_rswa and "use_rswa" not in accepted:
            reasons.append("R-SWA not supported")
        reasons += [f"{k}={v!r} is unknown to atom" for k, v in newer_fields.items() if v]
        return reasons


class VLLMBuilderMethods:
    """Source of the builder decorator: vLLM's three entry points onto the atom builder's
    ``build_metadata(common_attn_metadata, for_capture=False, fast=False)``."""

    def build(self, common_prefix_len: int, common_attn_metadata: Any, fast_build: bool = False) -> Any:
        """Every step (model runner). ``common_prefix_len``: cascade attention is not
        implemented (0.32 always passes 0)."""
        if isinstance(common_attn_metadata.causal, torch.Tensor):
            # Per-request causality (prefix-LM); the selector refuses use_non_causal.
            raise NotImplementedError(f"{type(self).__name__} has no per-request causal mask")
        return self.build_metadata(common_attn_metadata, for_capture=False, fast=fast_build)

    def build_for_cudagraph_capture(self, common_attn_metadata: Any) -> Any:
        """While vLLM captures a full CUDA graph (the graph is then replayed for every batch of
        the captured shape)."""
        if isinstance(common_attn_metadata.causal, torch.Tensor):
            raise NotImplementedError(f"{type(self).__name__} has no per-request causal mask")
        return self.build_metadata(common_attn_metadata, for_capture=True, fast=False)

    def build_for_drafting(self, common_attn_metadata: Any, draft_index: int) -> Any:
        """Speculative-decoding drafts (each draft step); as ``build`` with ``fast_build``."""
        return self.build(0, common_attn_metadata, fast_build=True)


def graph_safe(op_names: tuple[str, ...]) -> bool:
    """True when every op in ``op_names`` dispatches to its Triton kernel on this machine's
    device: those are the kernels a builder's CUDA-graph support level is declared for (the
    torch reference paths sync with the host and must not be captured)."""
    import atom.ops as ops

    device = "cuda" if torch.cuda.is_available() else "cpu"
    return all(ops.OPS[name].backend_on(device)[0] == "triton" for name in op_names)


def unsupported_reasons(backend: type, attn_selector_config: Any, device_capability: Any = None) -> list[str]:
    """``validate_configuration`` of ``backend`` for one ``AttentionSelectorConfig`` (NamedTuple),
    plus the backend's ``layer_reasons()`` when it declares them."""
    fields = dict(attn_selector_config._asdict())
    for name in _FLAG_FIELDS:
        fields.setdefault(name, False)
    fields.setdefault("attn_type", AttentionType.DECODER)
    reasons = backend.validate_configuration(device_capability=device_capability, **fields)
    # What a backend can only check against the model (e.g. MLA's rope split), if it has any.
    layer_reasons = getattr(backend, "layer_reasons", None)
    return reasons + (layer_reasons() if layer_reasons is not None else [])


def apply_decorators(kind: str) -> Optional[str]:
    """Apply (environment permitting) the decorator records of atom's ``kind`` backend; None
    when all are applied, else the reason one is not (disabled, refused by a guard)."""
    from atom.patches import State, apply
    from atom.plugin.vllm.patches import ATTENTION_DECORATORS

    for record in ATTENTION_DECORATORS.get(kind, ()):
        st = apply(record)
        if st.state is not State.APPLIED:
            return f"attention decorator {record.id} is {st}"
    return None
