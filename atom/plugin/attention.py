"""atom's MHA (paged) attention backend for vLLM: backend, metadata builder and impl.

How vLLM reaches each piece (0.32; 0.26 differs where marked):

* ``ATOMPlatform.get_attn_backend_cls`` -> ``atom.plugin.register.select_attention_backend``
  returns this backend's qualname for a decoder layer it supports; vLLM imports it by name.
* ``Attention.__init__`` calls ``get_impl_cls()`` and builds ``ATOMAttentionImpl(num_heads,
  head_size, scale, num_kv_heads, alibi_slopes, sliding_window, kv_cache_dtype, logits_soft_cap,
  attn_type, kv_sharing_target_layer_name, **extra_impl_args)`` and looks ``get_name()`` up in
  ``AttentionBackendEnum`` (hence ``"CUSTOM"``, registered to this class).
* The KV-cache manager asks ``supported_kv_cache_layouts()`` (>= 0.29) or
  ``get_kv_cache_shape(...)`` (<= 0.28) and ``get_supported_kernel_block_sizes()``.
* The model runner builds one ``ATOMAttentionMetadataBuilder`` per KV-cache group and calls
  ``build(...)`` every step (``build_for_cudagraph_capture`` while capturing full graphs).
* Per layer and step: ``unified_kv_cache_update`` -> ``impl.do_kv_cache_update`` (we set
  ``forward_includes_kv_cache_update = False``), then ``unified_attention_with_output`` ->
  ``impl.forward``.
* After weight loading: ``Attention.process_weights_after_loading(act_dtype)`` ->
  ``impl.process_weights_after_loading(act_dtype)``.

The math is ``atom.ops.reshape_and_cache`` and ``atom.ops.paged_attention`` (Triton on GPUs, the
torch reference on CPU).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, ClassVar, Optional, Union

import torch

from atom._logging import get_logger
from atom.plugin.vllm import compat
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)

logger = get_logger("atom.plugin")

#: What vLLM resolves by name (``resolve_obj_by_qualname``: dots only).
BACKEND_QUALNAME = "atom.plugin.attention.ATOMAttentionBackend"

#: The Triton kernels size one tile per head (``next_pow2(head_size)``) and stop at 256; above
#: that atom's dispatcher would silently run the torch reference on a GPU.
MAX_HEAD_SIZE = 256


def register() -> Optional[str]:
    """Point ``AttentionBackendEnum.CUSTOM`` at this backend (idempotent); the reason when it
    cannot be because another plugin already owns CUSTOM (we never take it from them)."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    custom = AttentionBackendEnum.CUSTOM
    if custom.is_overridden():
        current = custom.get_path()
        if current == BACKEND_QUALNAME:
            return None
        return f"AttentionBackendEnum.CUSTOM is already registered to {current}"
    register_backend(custom, BACKEND_QUALNAME)
    return None


# Every AttentionSelectorConfig field either release passes to validate_configuration
# (0.26: through use_pcp; 0.29+ adds use_adaptive_verification, use_dcp, use_rswa).
_FLAG_FIELDS = (
    "use_mla", "has_sink", "use_sparse", "use_mm_prefix", "use_per_head_quant_scales",
    "has_sliding_window", "use_non_causal", "use_batch_invariant", "use_kv_connector",
    "use_pcp", "use_adaptive_verification", "use_dcp", "use_rswa",
)


class ATOMAttentionBackend(AttentionBackend):
    """Paged MHA over vLLM's KV cache, for decoder self-attention (GQA, sliding window, sinks)."""

    # fp32 too: the CPU reference and the Triton kernels both run it (vLLM-CPU tests use it).
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    # No fp8 yet: the kernels can read fp8 caches, but the scale plumbing from vLLM's layer
    # (_k_scale/_v_scale, calibration) is not wired or tested.
    supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto", "float16", "bfloat16"]

    # vLLM writes the cache through impl.do_kv_cache_update before impl.forward, as its own
    # backends do; keeping the write a separate op lets torch.compile order it explicitly.
    forward_includes_kv_cache_update: bool = not compat.layer_calls_kv_cache_update()

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @staticmethod
    def get_impl_cls() -> type["ATOMAttentionImpl"]:
        return ATOMAttentionImpl

    @staticmethod
    def get_builder_cls() -> type["ATOMAttentionMetadataBuilder"]:
        return ATOMAttentionMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec: Any = None) -> list[Union[int, MultipleOf]]:
        # The kernels take any page size; 16 keeps vLLM's usual sizes (16 GPU, 128 CPU) and
        # whole Triton key tiles per page.
        return [MultipleOf(16)]

    # -- KV-cache geometry (one of the two is used, by vLLM release) ----------------------------
    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        cache_dtype_str: str = "auto",
    ) -> tuple[int, ...]:
        """vLLM <= 0.28 allocates this shape per layer: key and value halves, each NHD
        ``[num_blocks, block_size, num_kv_heads, head_size]`` as atom's kernels read them."""
        if block_size % 16 != 0:
            raise ValueError(f"atom's attention needs a block size that is a multiple of 16, got {block_size}")
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    @classmethod
    def supported_kv_cache_layouts(cls) -> Any:
        """vLLM >= 0.29: every layout works (atom's kernels take block, token and head strides
        separately); token-major blocks (NHD) first, because each key tile then reads rows of
        ``num_kv_heads * 2 * head_size`` contiguous elements."""
        from vllm.v1.kv_cache_layout import KVCacheLayout

        preferred = (KVCacheLayout.LBNHC, KVCacheLayout.BLNHC)
        return preferred + tuple(layout for layout in KVCacheLayout if layout not in preferred)

    # -- what the backend supports ----------------------------------------------------------------
    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return []  # any size up to MAX_HEAD_SIZE, see supports_head_size

    @classmethod
    def supports_head_size(cls, head_size: int) -> bool:
        return 0 < head_size <= MAX_HEAD_SIZE

    @classmethod
    def supports_sink(cls) -> bool:
        return True

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return True

    @classmethod
    def supports_kv_connector(cls) -> bool:
        return False  # never exercised with a KV connector

    @classmethod
    def supports_device_cpu_query_lens_mismatch(cls) -> bool:
        return False  # adaptive verification (spec decode) is not exercised with atom's backend

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
        base = super().validate_configuration
        accepted = inspect.signature(base).parameters
        reasons = base(**{k: given[k] for k in accepted if k in given})
        # Fields the installed base method does not check (0.26's lacks the last three).
        if use_adaptive_verification and "use_adaptive_verification" not in accepted:
            reasons.append("adaptive verification not supported")
        if use_dcp and "use_dcp" not in accepted:
            reasons.append("DCP not supported")
        if use_rswa and "use_rswa" not in accepted:
            reasons.append("R-SWA not supported")
        reasons += [f"{k}={v!r} is unknown to atom" for k, v in newer_fields.items() if v]
        return reasons

    @classmethod
    def unsupported_reasons(cls, attn_selector_config: Any, device_capability: Any = None) -> list[str]:
        """``validate_configuration`` for one ``AttentionSelectorConfig`` (a NamedTuple)."""
        fields = dict(attn_selector_config._asdict())
        for name in _FLAG_FIELDS:
            fields.setdefault(name, False)
        fields.setdefault("attn_type", AttentionType.DECODER)
        return cls.validate_configuration(device_capability=device_capability, **fields)


@dataclass
class ATOMAttentionMetadata:
    """Per-step metadata of one KV-cache group, in the shape ``atom.ops.paged_attention`` takes.

    The tensors are vLLM's own device tensors (no copies); the ints come from vLLM's host-side
    bookkeeping, so building this never reads a device value.
    """

    num_actual_tokens: int
    num_reqs: int
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32
    seq_lens: torch.Tensor  # [num_reqs] int32, new tokens included
    block_table: torch.Tensor  # [num_reqs, max_blocks] int32
    slot_mapping: torch.Tensor  # [num_actual_tokens] int64, -1 = padding
    causal: bool = True


class ATOMAttentionMetadataBuilder(AttentionMetadataBuilder[ATOMAttentionMetadata]):
    """Turns vLLM's ``CommonAttentionMetadata`` into :class:`ATOMAttentionMetadata`.

    No batch reordering (``reorder_batch_threshold = None``): one kernel call serves prefill,
    chunked-prefill and decode rows in any order.
    """

    # Full CUDA graphs for single-token decode batches only: there the Triton launches depend on
    # the (padded) batch shape and the split count fixed at capture, never on device values.
    # Mixed batches launch the prefill kernel with a grid sized by max_query_len, which changes
    # per step. The torch reference (CPU) and the aiter adapter read device values on the host,
    # so they get no graphs (see get_cudagraph_support).
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    reorder_batch_threshold: ClassVar[Optional[int]] = None

    def __init__(self, kv_cache_spec: Any, layer_names: list[str], vllm_config: Any,
                 device: torch.device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)

    @classmethod
    def get_cudagraph_support(cls, vllm_config: Any, kv_cache_spec: Any) -> AttentionCGSupport:
        import atom.ops as ops

        device = "cuda" if torch.cuda.is_available() else "cpu"
        graph_safe = all(
            ops.OPS[name].backend_on(device)[0] == "triton"
            for name in ("paged_attention", "reshape_and_cache")
        )
        return cls._cudagraph_support if graph_safe else AttentionCGSupport.NEVER

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> ATOMAttentionMetadata:
        # common_prefix_len: cascade attention is not implemented (0.32 always passes 0).
        m = common_attn_metadata
        if isinstance(m.causal, torch.Tensor):
            # Per-request causality (prefix-LM); the selector refuses use_non_causal.
            raise NotImplementedError("atom's attention backend has no per-request causal mask")
        return ATOMAttentionMetadata(
            num_actual_tokens=m.num_actual_tokens,
            num_reqs=m.num_reqs,
            max_query_len=m.max_query_len,
            max_seq_len=m.max_seq_len,
            query_start_loc=m.query_start_loc,
            seq_lens=m.seq_lens,
            block_table=m.block_table_tensor,
            slot_mapping=m.slot_mapping,
            causal=bool(m.causal),
        )

    def build_for_cudagraph_capture(self, common_attn_metadata: CommonAttentionMetadata) -> ATOMAttentionMetadata:
        """As ``build``, with ``max_seq_len`` raised to ``max_model_len``: the decode kernel
        fixes its KV split count from it at capture, and the graph is replayed for every
        context length up to the model's limit."""
        md = self.build(0, common_attn_metadata)
        md.max_seq_len = max(md.max_seq_len, int(self.vllm_config.model_config.max_model_len))
        return md


class ATOMAttentionImpl(AttentionImpl[ATOMAttentionMetadata]):
    """One layer's attention: cache write (``do_kv_cache_update``) and paged attention
    (``forward``) through atom's ops."""

    # Explicit because the bases differ by release (0.26 defaults supports_dcp to True).
    supports_dcp: bool = False
    supports_pcp: bool = False

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: Optional[int] = None,
        alibi_slopes: Optional[list[float]] = None,
        sliding_window: Optional[int] = None,
        kv_cache_dtype: str = "auto",
        logits_soft_cap: Optional[float] = None,
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name: Optional[str] = None,
        sinks: Optional[torch.Tensor] = None,
    ) -> None:
        # The selector cannot see these (they are not in AttentionSelectorConfig), so the layer
        # that asks for them fails here, at model build, rather than computing something else.
        if alibi_slopes is not None:
            raise NotImplementedError("atom's attention backend has no ALiBi")
        if logits_soft_cap:
            raise NotImplementedError("atom's attention backend has no logits soft-cap")
        if attn_type != AttentionType.DECODER:
            raise NotImplementedError(f"atom's attention backend serves decoder attention, not {attn_type}")
        if kv_cache_dtype not in ATOMAttentionBackend.supported_kv_cache_dtypes:
            raise NotImplementedError(f"atom's attention backend has no {kv_cache_dtype} KV cache")
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads if num_kv_heads is not None else num_heads
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        self.sliding_window = sliding_window
        self.kv_cache_dtype = kv_cache_dtype
        self.logits_soft_cap = logits_soft_cap
        self.attn_type = attn_type
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        if sinks is not None and sinks.shape != (num_heads,):
            raise ValueError(f"sinks must have one value per query head ({num_heads}), got {tuple(sinks.shape)}")
        self.sinks = sinks
        # Where vLLM does not call do_kv_cache_update itself, forward writes the cache.
        self._write_cache_in_forward = ATOMAttentionBackend.forward_includes_kv_cache_update

    def process_weights_after_loading(self, act_dtype: torch.dtype) -> None:
        # Sinks are loaded into the model's parameter after __init__; the kernels add them to
        # float32 softmax statistics, so keep a float32 copy once the real values are in.
        if self.sinks is not None:
            self.sinks = self.sinks.detach().to(torch.float32)

    def do_kv_cache_update(
        self,
        layer: torch.nn.Module,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Write this step's keys/values (vLLM calls this before ``forward``)."""
        from atom.ops import reshape_and_cache

        key_cache, value_cache = compat.kv_cache_as_nhd(kv_cache, self.head_size)
        # key/value may carry padding rows beyond the real tokens; slot_mapping never does.
        n = slot_mapping.shape[0]
        reshape_and_cache(key[:n], value[:n], key_cache, value_cache, slot_mapping, "auto")

    def forward(
        self,
        layer: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: Optional[ATOMAttentionMetadata],
        output: torch.Tensor,
        output_scale: Optional[torch.Tensor] = None,
        output_block_scale: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """``query`` ``[T, num_heads, head_size]``; ``output`` the same shape, written in place."""
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("atom's attention backend has no fused output quantization")
        if attn_metadata is None:
            # vLLM's profiling run: no cache or metadata yet; return something defined.
            return output.fill_(0)
        from atom.ops import paged_attention

        md = attn_metadata
        n = md.num_actual_tokens
        if self._write_cache_in_forward and self.kv_sharing_target_layer_name is None:
            self.do_kv_cache_update(layer, key, value, kv_cache, md.slot_mapping[:n])
        key_cache, value_cache = compat.kv_cache_as_nhd(kv_cache, self.head_size)
        paged_attention(
            query[:n], key_cache, value_cache, md.block_table, md.seq_lens, md.query_start_loc,
            md.max_query_len, md.max_seq_len, self.scale,
            causal=md.causal, sliding_window=self.sliding_window, sinks=self.sinks,
            out=output[:n],
        )
        return output
