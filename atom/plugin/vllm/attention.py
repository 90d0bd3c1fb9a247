"""The members atom's attention decorators inject into its host-neutral attention classes
(``atom.models.attention``) so that vLLM can call them -- the *sources* of the records in
``atom.plugin.vllm.records`` (groups ``vllm.attention.mha`` / ``mla``):

* :class:`VLLMBackendMethods` (both backends) and :class:`VLLMMLABackendMethods` (MLA): the
  classmethods vLLM's selector, ``Attention.__init__`` and KV-cache manager call (``get_name``,
  ``get_impl_cls``, ``get_builder_cls``, the KV-cache geometry, the ``supports_*`` /
  ``validate_configuration`` answers), read from the declarations of atom's backend
  (``block_size_multiple``, ``kv_cache_shape``, ...) and of the vLLM class vLLM is handed
  (``backend_name``, ``impl_cls``, ``builder_cls``);
* :class:`VLLMBuilderMethods` (both builders): ``build``, ``build_for_cudagraph_capture`` and
  ``build_for_drafting``, each translating vLLM's ``CommonAttentionMetadata`` into atom's
  :class:`~atom.models.attention.common.AttentionBatch` for the builder's ``build_metadata``;
* :class:`MHAImplMethods` / :class:`MLAImplMethods`: each impl's vLLM entry points (the
  post-load hook, the cache write, ``forward``; MLA's ``forward_mqa`` / ``forward_mha``).

The classes vLLM is handed (``attention_mha`` / ``attention_mla``) subclass an atom layer and
vLLM's base and inherit these once injected. This module never imports ``atom.models.attention``
at import time: the records resolve their sources here while those modules are being imported.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from atom._logging import get_logger, info_once
from atom.plugin.vllm import compat
from vllm.v1.attention.backend import AttentionType, MultipleOf

logger = get_logger("atom.plugin")

# Every AttentionSelectorConfig field either release passes to validate_configuration
# (0.26: through use_pcp; 0.29+ adds use_adaptive_verification, use_dcp, use_rswa).
_FLAG_FIELDS = (
    "use_mla", "has_sink", "use_sparse", "use_mm_prefix", "use_per_head_quant_scales",
    "has_sliding_window", "use_non_causal", "use_batch_invariant", "use_kv_connector",
    "use_pcp", "use_adaptive_verification", "use_dcp", "use_rswa",
)


class VLLMBackendMethods:
    """Source of the backend decorator. Every member is a classmethod reading declarations
    (vLLM's base declares some as staticmethods; both are called on the class)."""

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
        given = {k: v for k, v in locals().items() if k not in ("cls", "newer_fields")}
        reasons = compat.validate_with_base(cls, given)
        return reasons + [f"{k}={v!r} is unknown to atom" for k, v in newer_fields.items() if v]


class VLLMMLABackendMethods(VLLMBackendMethods):
    """Source of the MLA backend decorator: the shared backend members plus what only an MLA
    backend answers."""

    @classmethod
    def is_mla(cls) -> bool:
        """vLLM's layers and KV-cache manager take the latent (MLA) path for this backend."""
        return True

    @classmethod
    def supports_head_size(cls, head_size: int) -> bool:
        """``kv_lora_rank + 64`` for every rank atom's MLA kernels take."""
        from atom.models.attention.mla import ROPE_DIM, mla_geometry_reasons

        return not mla_geometry_reasons(head_size - ROPE_DIM, ROPE_DIM)

    @classmethod
    def get_preferred_block_size(cls, default_block_size: int) -> int:
        """64 where vLLM's FlashMLA serves atom's decode rows (its only page size,
        ``atom.plugin.vllm.mla_decode``), else vLLM's default. vLLM asks after the model is
        built, under its config, unless ``--block-size`` was given."""
        from atom.plugin.vllm import mla_decode

        return mla_decode.preferred_block_size(default_block_size)

    @classmethod
    def supported_kv_cache_layouts(cls) -> Any:
        """None (any layout, no preference), as vLLM's base answers: from 0.29 vLLM allocates
        the latent cache ``[B, 1, N, C]`` itself and ``MLAAttention`` squeezes the head axis;
        atom's MLA kernels take any block and token strides."""
        return None


class VLLMBuilderMethods:
    """Source of the builder decorator: vLLM's three entry points onto the atom builder's
    ``build_metadata(batch, for_capture=False, fast=False)``."""

    def build(self, common_prefix_len: int, common_attn_metadata: Any, fast_build: bool = False) -> Any:
        """Every step (model runner). ``common_prefix_len``: cascade attention is not
        implemented (0.32 always passes 0)."""
        if isinstance(common_attn_metadata.causal, torch.Tensor):
            # Per-request causality (prefix-LM); the selector refuses use_non_causal.
            raise NotImplementedError(f"{type(self).__name__} has no per-request causal mask")
        return self.build_metadata(compat.attention_batch(common_attn_metadata), for_capture=False, fast=fast_build)

    def build_for_cudagraph_capture(self, common_attn_metadata: Any) -> Any:
        """While vLLM captures a full CUDA graph (the graph is then replayed for every batch of
        the captured shape)."""
        if isinstance(common_attn_metadata.causal, torch.Tensor):
            raise NotImplementedError(f"{type(self).__name__} has no per-request causal mask")
        return self.build_metadata(compat.attention_batch(common_attn_metadata), for_capture=True, fast=False)

    def build_for_drafting(self, common_attn_metadata: Any, draft_index: int) -> Any:
        """Speculative-decoding drafts (each draft step); as ``build`` with ``fast_build``."""
        return self.build(0, common_attn_metadata, fast_build=True)


#: vLLM releases whose layer calls ``impl.do_kv_cache_update`` before ``forward`` (every supported
#: one): then atom's ``forward`` leaves the cache write to it.
WRITE_CACHE_IN_FORWARD = not compat.layer_calls_kv_cache_update()


def _cache_views(impl: Any, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """NHD key/value views of the tensor vLLM binds to the layer (fp8 caches as float8_e4m3fn).

    vLLM hands a layer the same cache tensor at every step, so the views are made once and kept
    on that tensor (with the layer's head size and cache dtype, and the tensor's address: a
    re-bound or re-allocated cache gets new ones). Kept on the tensor rather than on the impl, they
    never outlive it: a cache vLLM drops is freed as before. Outside CUDA graphs (mixed prefill +
    decode steps run attention eagerly) this runs twice per layer and step, and building the views
    (release check, transpose, two slices) costs ~8 us of host time each time.

    The views are taken of a detached alias (same memory), never of the tensor itself: a view
    holds its base's C++ tensor, which keeps the base's Python object, and with it this
    attribute, alive; a cache tensor that is not itself a view (vLLM's CPU caches) would then
    hold itself forever, and every engine torn down in a process would leak its whole cache."""
    key = (impl.head_size, impl.fp8_cache, kv_cache.data_ptr())
    memo = getattr(kv_cache, "_atom_nhd_views", None)
    if memo is not None and memo[0] == key:
        return memo[1]
    views = impl.fp8_views(*compat.kv_cache_as_nhd(kv_cache.detach(), impl.head_size))
    kv_cache._atom_nhd_views = (key, views)
    return views


class MHAImplMethods:
    """Source of the MHA impl decorator: vLLM's per-layer entry points onto atom's
    :class:`~atom.models.attention.mha.PagedAttentionImpl`."""

    def process_weights_after_loading(self, act_dtype: torch.dtype) -> None:
        """Called by ``Attention.process_weights_after_loading`` once the loader is done."""
        self.prepare_weights(act_dtype)
        self.weights_processed_dtype = act_dtype  # what vLLM passed (the engine tests read it)
        if self.host_prefill is not None:
            info_once("mha-prefill-choice", f"MHA steps with multi-token rows ({self.num_heads} heads, head size "
                                            f"{self.head_size}) on {self.host_prefill.name}", logger)
        elif self.host_prefill_declined is not None:
            info_once("mha-prefill-choice", "MHA steps with multi-token rows on atom's Triton kernels: "
                                            f"{self.host_prefill_declined}", logger)

    def do_kv_cache_update(
        self,
        layer: torch.nn.Module,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Write this step's keys/values (vLLM calls this before ``forward``). A no-op for layers
        on the fused QK-norm path: their ``forward`` writes the normed, rotated keys."""
        if self.fused is not None:
            return
        key_cache, value_cache = _cache_views(self, kv_cache)
        self.write_cache(key, value, key_cache, value_cache, slot_mapping,
                         getattr(layer, "_k_scale", None), getattr(layer, "_v_scale", None))

    def forward(
        self,
        layer: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: Any,
        output: torch.Tensor,
        output_scale: Optional[torch.Tensor] = None,
        output_block_scale: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """``query`` ``[T, num_heads, head_size]``; ``output`` the same shape, written in place."""
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("atom's attention backend has no fused output quantization")
        if attn_metadata is None:  # vLLM's profiling run: no cache or metadata yet
            return self.profile_run(output)
        key_cache, value_cache = _cache_views(self, kv_cache)
        return self.run(query, key, value, key_cache, value_cache, attn_metadata, output,
                        getattr(layer, "_k_scale", None), getattr(layer, "_v_scale", None),
                        write_cache=WRITE_CACHE_IN_FORWARD)


class MLAImplMethods:
    """Source of the MLA impl decorator: vLLM's entry points onto atom's
    :class:`~atom.models.attention.mla.MLAttentionImpl`."""

    def process_weights_after_loading(self, act_dtype: torch.dtype) -> None:
        """Split ``kv_b_proj`` (dequantised to ``act_dtype`` by vLLM's helper) into the absorbed
        decode weights and compile the kernels' variants on a GPU.

        atom's ``kv_b_proj`` (``model_wrapper._VllmLinearView``) of an fp8 checkpoint is
        dequantised by its own post-load hook. vLLM's loader runs that hook first (its
        ``quant_method`` loop precedes the attention loop, 0.26 and 0.32 alike); it is run here
        too, idempotently, so the split never depends on that order. An fp8 weight left without
        a ``quant_method`` would be read by vLLM's helper as plain numbers, scales ignored:
        refused."""
        prepare = getattr(self.kv_b_proj, "process_weights_after_loading", None)
        if prepare is not None:
            prepare()
        weight = getattr(self.kv_b_proj, "weight", None)
        if (weight is not None and weight.dtype == torch.float8_e4m3fn
                and getattr(self.kv_b_proj, "quant_method", None) is None):
            raise RuntimeError("MLA kv_b_proj is still float8_e4m3fn after its post-load hook: its scales would "
                               "be ignored (an fp8 kv_b_proj must be dequantised, Fp8Spec.dequantize)")
        w_uk, w_uv = compat.split_kv_b_proj(self.kv_b_proj, act_dtype, self.kv_lora_rank, self.num_heads,
                                            self.qk_nope_head_dim, self.v_head_dim)
        self.absorb(w_uk, w_uv, act_dtype)
        if self.host_decode is not None:
            info_once("mla-decode-choice", f"MLA decode rows ({self.num_heads} heads, kv_lora_rank {self.kv_lora_rank}) "
                                           f"on {self.host_decode.name} in {self.host_decode.page_size}-token pages",
                      logger)
        elif self.host_decode_declined is not None:
            info_once("mla-decode-choice", f"MLA decode rows on atom's Triton kernel: {self.host_decode_declined}",
                      logger)

    def do_kv_cache_update(
        self,
        kv_c_normed: torch.Tensor,
        k_pe: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        kv_cache_dtype: str,
        k_scale: torch.Tensor,
        skip_scale: bool = False,
    ) -> None:
        """Write ``[kv_c_normed | k_pe]`` (``k_pe`` rotated by vLLM's layer) into the latent cache.
        ``skip_scale`` (vLLM 0.33's layer passes it: an fp8 cache whose ``k_scale`` is 1.0) never
        applies: atom's latent cache is not fp8 (``MLABackend.supported_kv_cache_dtypes``)."""
        self.write_latent(kv_c_normed, k_pe, kv_cache, slot_mapping)

    def forward_mqa(
        self,
        q: Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]],
        kv_c_and_k_pe_cache: torch.Tensor,
        attn_metadata: Any,
        layer: Any,
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Absorbed decode of the decode rows: ``q`` is ``(q_nope @ W_UK, q_pe)`` or their
        concatenation ``[Td, H, rank + rope]``; returns the latent output ``[Td, H, rank]``."""
        if not isinstance(q, tuple):
            q = q.split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        return self.decode(q[0], q[1], kv_c_and_k_pe_cache, attn_metadata), None

    def forward_mha(
        self,
        q: torch.Tensor,
        kv_c_normed: torch.Tensor,
        k_pe: torch.Tensor,
        kv_c_and_k_pe_cache: torch.Tensor,
        attn_metadata: Any,
        k_scale: torch.Tensor,
        output: torch.Tensor,
        output_scale: Optional[torch.Tensor] = None,
    ) -> None:
        """Prefill and extend rows (their latents already in the cache)."""
        if output_scale is not None:
            raise NotImplementedError("atom's MLA backend has no fused output quantization")
        self.prefill(q, kv_c_and_k_pe_cache, attn_metadata, output)

    def forward(
        self,
        layer: Any,
        q: torch.Tensor,
        kv_c_normed: torch.Tensor,
        k_pe: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: Any,
        output: torch.Tensor,
        output_scale: Optional[torch.Tensor] = None,
        output_block_scale: Optional[torch.Tensor] = None,
        **rest: Any,
    ) -> torch.Tensor:
        """The whole attention of one MLA layer and step (what vLLM's ``MLAAttention.
        forward_impl`` is for atom's layers, routed by mla_patch): ``q [T, H, qk_head_dim]`` ->
        ``output [T, H * v_head_dim]``, in place. ``rest``: vLLM's fused-quant and DCP arguments
        (``quant_group_size``, ``q_dcp_replicated``, ...), which atom's impl declines, so vLLM
        passes them as None."""
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("atom's MLA backend has no fused output quantization")
        if rest and any(v is not None for v in rest.values()):
            given = sorted(k for k, v in rest.items() if v is not None)
            raise NotImplementedError(f"atom's MLA backend does not take {', '.join(given)}")
        if attn_metadata is None:  # vLLM's profiling run: no cache or metadata yet
            return self.profile_run(q, output)
        return self.run(q, kv_cache, attn_metadata, output)


def unsupported_reasons(backend: type, attn_selector_config: Any, device_capability: Any = None) -> list[str]:
    """``validate_configuration`` of ``backend`` for one ``AttentionSelectorConfig``."""
    fields = dict(attn_selector_config._asdict())
    for name in _FLAG_FIELDS:
        fields.setdefault(name, False)
    fields.setdefault("attn_type", AttentionType.DECODER)
    return backend.validate_configuration(device_capability=device_capability, **fields)


def claim_backend_name(name: str, qualname: str) -> Optional[str]:
    """Point ``AttentionBackendEnum.<name>`` at ``qualname`` (idempotent): vLLM looks a backend
    up by ``get_name()``. ``CUSTOM`` is vLLM's slot for out-of-tree backends (atom's MHA); any
    other name becomes a new member (atom's MLA: ``ATOM_MLA``, a slot no other plugin could
    own). Never taken from another owner: the reason when the name belongs to someone else or
    this vLLM cannot add names. Where vLLM adds no names at all (0.26,
    ``compat.backend_names_extensible``) a new name is left unclaimed: the platform hands vLLM
    the qualname, and 0.26's MLA layer never looks its backend up by name."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    member = AttentionBackendEnum.__members__.get(name)
    if member is None and not compat.backend_names_extensible():
        return None
    taken = member is not None and (name != "CUSTOM" or member.is_overridden())
    if taken:
        current = member.get_path()
        return None if current == qualname else f"AttentionBackendEnum.{name} is already registered to {current}"
    try:
        register_backend(member if member is not None else name, qualname)
    except (TypeError, ValueError, AttributeError) as exc:
        return f"vLLM cannot register the attention backend name {name} ({exc})"
    return None
