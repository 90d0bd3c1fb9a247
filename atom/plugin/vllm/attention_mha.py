"""atom's paged attention (``atom.models.attention.mha``) as a vLLM attention backend.

The **MHA decorators** are three registered records (``atom.plugin.vllm.records``, group
``vllm.attention.mha``) that inject what vLLM calls into atom's host-neutral classes:

* ``vllm.attention.mha_backend`` -> ``PagedAttentionBackend`` (``attention.VLLMBackendMethods``);
* ``vllm.attention.mha_builder`` -> ``PagedAttentionMetadataBuilder`` (``attention.VLLMBuilderMethods``);
* ``vllm.attention.mha_impl`` -> ``PagedAttentionImpl`` (``attention.MHAImplMethods``:
  ``process_weights_after_loading``, ``do_kv_cache_update``, ``forward``).

What vLLM is handed are the classes below: each subclasses an atom layer and vLLM's base, and
writes in its body only vLLM's construction and declarations (never an injected member). How
vLLM reaches each piece (0.32; 0.26 differs where marked):

* ``ATOMPlatform.get_attn_backend_cls`` -> ``atom.plugin.vllm.selection.attention_backend``
  applies the decorators, claims ``AttentionBackendEnum.CUSTOM`` and returns
  :data:`BACKEND_QUALNAME`; vLLM imports it by name.
* ``Attention.__init__`` builds ``ATOMAttentionImpl(num_heads, head_size, scale, num_kv_heads,
  alibi_slopes, sliding_window, kv_cache_dtype, logits_soft_cap, attn_type,
  kv_sharing_target_layer_name, **extra_impl_args)``.
* The KV-cache manager asks ``supported_kv_cache_layouts()`` (>= 0.29) or
  ``get_kv_cache_shape(...)`` (<= 0.28) and ``get_supported_kernel_block_sizes()``.
* The model runner builds one ``ATOMAttentionMetadataBuilder`` per KV-cache group and calls
  ``build(...)`` every step (``build_for_cudagraph_capture`` while capturing full graphs).
* Per layer and step: ``unified_kv_cache_update`` -> ``impl.do_kv_cache_update`` (the backend
  sets ``forward_includes_kv_cache_update = False``), then ``unified_attention_with_output`` ->
  ``impl.forward``. Layers on atom's fused QK-norm + RoPE + cache path write the cache inside
  ``forward`` instead (their ``do_kv_cache_update`` is a no-op).
* After weight loading: ``Attention.process_weights_after_loading(act_dtype)`` ->
  ``impl.process_weights_after_loading(act_dtype)``.
"""

from __future__ import annotations

from typing import Any, ClassVar, Optional

import torch

from atom.models.attention.common import graph_safe
from atom.models.attention.mha import PagedAttentionBackend, PagedAttentionImpl, PagedAttentionMetadataBuilder
from atom.plugin.vllm import compat
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
)

#: What vLLM resolves by name (``resolve_obj_by_qualname``: dots only).
BACKEND_QUALNAME = "atom.plugin.vllm.attention_mha.ATOMAttentionBackend"


class ATOMAttentionMetadataBuilder(PagedAttentionMetadataBuilder, AttentionMetadataBuilder):
    """vLLM's metadata builder for atom's paged attention (``build`` & co. injected into
    :class:`PagedAttentionMetadataBuilder`). No batch reordering: one kernel call serves
    prefill, chunked-prefill and decode rows in any order."""

    # Full CUDA graphs for single-token decode batches only: there the Triton launches depend on
    # the (padded) batch shape and the split count fixed at capture, never on device values.
    # Mixed batches launch the prefill kernel with a grid sized by max_query_len, which changes
    # per step. The torch reference (CPU) and the aiter adapter read device values on the host,
    # so they get no graphs (see get_cudagraph_support).
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    reorder_batch_threshold: ClassVar[Optional[int]] = None

    def __init__(self, kv_cache_spec: Any, layer_names: list[str], vllm_config: Any,
                 device: torch.device) -> None:
        AttentionMetadataBuilder.__init__(self, kv_cache_spec, layer_names, vllm_config, device)
        ctx = vllm_config.compilation_config.static_forward_context
        #: the group's layers on atom's fused QK-norm path (they need each token's position)
        self.fused_layers = [n for n in layer_names
                             if getattr(getattr(ctx.get(n), "impl", None), "fused", None) is not None]
        PagedAttentionMetadataBuilder.__init__(
            self, max_model_len=vllm_config.model_config.max_model_len,
            max_num_batched_tokens=vllm_config.scheduler_config.max_num_batched_tokens,
            with_positions=bool(self.fused_layers), device=device)

    @classmethod
    def get_cudagraph_support(cls, vllm_config: Any, kv_cache_spec: Any) -> AttentionCGSupport:
        return cls._cudagraph_support if graph_safe(PagedAttentionBackend.kernel_ops) else AttentionCGSupport.NEVER


class ATOMAttentionImpl(PagedAttentionImpl, AttentionImpl):
    """vLLM's impl for atom's paged attention (``forward`` & co. injected into
    :class:`PagedAttentionImpl`); here: construction from what vLLM's ``Attention`` passes."""

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
        from atom.plugin.vllm import mha_prefill

        # vLLM's FlashAttention for steps with multi-token rows where asked for and it runs (each
        # layer decides when its weights are processed); its version choice reads the config.
        mha_prefill.install()
        # vLLM builds the impl inside its config context (Attention.__init__); forward may run
        # outside it (compiled graphs, CUDA-graph capture), so the limits are read now.
        super().__init__(num_heads, head_size, scale, num_kv_heads, sliding_window, kv_cache_dtype, sinks,
                         kv_sharing_target_layer_name=kv_sharing_target_layer_name,
                         max_num_seqs=compat.current_config_int("scheduler_config", "max_num_seqs"),
                         block_size=compat.current_config_int("cache_config", "block_size") or 16)
        self.logits_soft_cap = logits_soft_cap
        self.attn_type = attn_type


class ATOMAttentionBackend(PagedAttentionBackend, AttentionBackend):
    """Paged MHA over vLLM's KV cache, for decoder self-attention (GQA, sliding window, sinks,
    fp8 caches); vLLM's classmethods come from the backend decorator."""

    backend_name: ClassVar[str] = "CUSTOM"
    impl_cls: ClassVar[type] = ATOMAttentionImpl
    builder_cls: ClassVar[type] = ATOMAttentionMetadataBuilder
    # vLLM writes the cache through impl.do_kv_cache_update before impl.forward, as its own
    # backends do; keeping the write a separate op lets torch.compile order it explicitly.
    forward_includes_kv_cache_update: bool = not compat.layer_calls_kv_cache_update()
