"""atom's MHA (paged) attention backend for vLLM: backend, metadata builder and impl, plus the
**MHA decorator** (:class:`VLLMMHAImplMethods`) that injects the plugin-mode ``forward``,
``do_kv_cache_update`` and ``process_weights_after_loading`` into :class:`ATOMAttentionImpl`.

The classes here hold atom's declarations and math; what vLLM calls is injected by the records
``vllm.attention.mha_backend`` / ``mha_builder`` / ``mha_impl`` (``atom.plugin.vllm.patches``),
applied when vLLM is the framework (see ``atom.plugin.attention``). How vLLM reaches each piece
(0.32; 0.26 differs where marked):

* ``ATOMPlatform.get_attn_backend_cls`` -> ``atom.plugin.register.select_attention_backend``
  applies the decorators and returns :data:`BACKEND_QUALNAME`; vLLM imports it by name.
* ``Attention.__init__`` calls ``get_impl_cls()`` and builds ``ATOMAttentionImpl(num_heads,
  head_size, scale, num_kv_heads, alibi_slopes, sliding_window, kv_cache_dtype, logits_soft_cap,
  attn_type, kv_sharing_target_layer_name, **extra_impl_args)`` and looks ``get_name()`` up in
  ``AttentionBackendEnum`` (hence ``"CUSTOM"``, registered to this class by :func:`register`).
* The KV-cache manager asks ``supported_kv_cache_layouts()`` (>= 0.29) or
  ``get_kv_cache_shape(...)`` (<= 0.28) and ``get_supported_kernel_block_sizes()``.
* The model runner builds one ``ATOMAttentionMetadataBuilder`` per KV-cache group and calls
  ``build(...)`` every step (``build_for_cudagraph_capture`` while capturing full graphs).
* Per layer and step: ``unified_kv_cache_update`` -> ``impl.do_kv_cache_update`` (we set
  ``forward_includes_kv_cache_update = False``), then ``unified_attention_with_output`` ->
  ``impl.forward``. Layers built with atom's fused QK-norm + RoPE + cache arguments write the
  cache inside ``forward`` instead (their ``do_kv_cache_update`` is a no-op).
* After weight loading: ``Attention.process_weights_after_loading(act_dtype)`` ->
  ``impl.process_weights_after_loading(act_dtype)``.

The math is ``atom.ops.reshape_and_cache``, ``atom.ops.paged_attention`` and
``atom.ops.fused_qk_norm_rope_cache`` (Triton on GPUs, the torch reference on CPU). fp8 KV caches
(``kv_cache_dtype="fp8"`` / ``"fp8_e4m3"``) store ``x / scale`` as float8_e4m3fn with the layer's
per-tensor ``_k_scale`` / ``_v_scale``; attention dequantises with the same scales.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Optional

import torch

from atom._logging import get_logger
from atom.plugin.attention import graph_safe
from atom.plugin.vllm import compat
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
)

logger = get_logger("atom.plugin")

#: What vLLM resolves by name (``resolve_obj_by_qualname``: dots only).
BACKEND_QUALNAME = "atom.plugin.attention_mha.ATOMAttentionBackend"

#: The Triton kernels size one tile per head (``next_pow2(head_size)``) and stop at 256; above
#: that atom's dispatcher would silently run the torch reference on a GPU.
MAX_HEAD_SIZE = 256

#: vLLM's fp8 cache names that mean float8_e4m3fn (what atom's kernels read).
FP8_KV_CACHE_DTYPES = ("fp8", "fp8_e4m3")


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


def _current_config_int(section: str, name: str) -> Optional[int]:
    """``vllm_config.<section>.<name>`` of the vLLM config being built, or None outside vLLM's
    config context (an impl built by hand, e.g. in tests) or while it is unset."""
    from vllm.config import get_current_vllm_config

    try:
        value = getattr(getattr(get_current_vllm_config(), section), name)
    except Exception:  # AssertionError on 0.26+ when no config is set; older releases return a default
        return None
    return None if value is None else int(value)


def split_kv_workspace_bytes(max_num_seqs: int, num_heads: int, num_kv_heads: int, head_size: int,
                             device: torch.device) -> int:
    """Upper bound of the Triton split-KV decode partials for one call (``part_o`` fp32
    ``[seqs, heads, splits, D]`` + ``part_lse`` fp32 ``[seqs, heads, splits]``) at any batch size
    up to ``max_num_seqs``. ``choose_num_splits`` takes ``ceil(T / rows)`` splits (at most 64) for
    ``rows = seqs * kv_heads`` and a program target ``T`` (~4 per SM), and allocates partials
    only when that is more than one split (``rows < T``): so ``rows * splits < T + min(rows, T)``."""
    if device.type != "cuda":
        return 0
    from atom.ops.attention_triton import num_programs_target

    rows, target = max_num_seqs * num_kv_heads, num_programs_target(device)
    cells = min(rows * 64, target + min(rows, target)) * (num_heads // num_kv_heads)
    return cells * (head_size + 1) * 4


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
    positions: Optional[torch.Tensor] = None  # [num_actual_tokens] int64, only for fused QK-norm layers


class ATOMAttentionMetadataBuilder(AttentionMetadataBuilder[ATOMAttentionMetadata]):
    """Turns vLLM's ``CommonAttentionMetadata`` into :class:`ATOMAttentionMetadata`
    (``build`` / ``build_for_cudagraph_capture`` / ``build_for_drafting`` are injected by the
    builder decorator and call :meth:`build_metadata`).

    No batch reordering (``reorder_batch_threshold = None``): one kernel call serves prefill,
    chunked-prefill and decode rows in any order.

    Workspace: none of its own. The Triton decode kernel's split-KV partials are allocated per
    call; vLLM profiles memory before any builder exists, so the impl's profiling-run branch
    allocates their upper bound once (:func:`split_kv_workspace_bytes`), which vLLM's peak
    measurement then counts.
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
        self.max_model_len = int(vllm_config.model_config.max_model_len)
        # Layers on the fused QK-norm path need each token's position; vLLM's metadata has none,
        # so the builder derives them (persistent buffer: full CUDA graphs read it at replay).
        ctx = vllm_config.compilation_config.static_forward_context
        self.fused_layers = [n for n in layer_names
                             if getattr(getattr(ctx.get(n), "impl", None), "fused", None) is not None]
        self._positions = None
        if self.fused_layers:
            size = int(vllm_config.scheduler_config.max_num_batched_tokens)
            self._positions = torch.zeros(size, dtype=torch.int64, device=device)

    @classmethod
    def get_cudagraph_support(cls, vllm_config: Any, kv_cache_spec: Any) -> AttentionCGSupport:
        return cls._cudagraph_support if graph_safe(("paged_attention", "reshape_and_cache")) else AttentionCGSupport.NEVER

    def build_metadata(self, m: Any, for_capture: bool = False, fast: bool = False) -> ATOMAttentionMetadata:
        """atom's metadata from vLLM's ``CommonAttentionMetadata`` (host ints, device tensors).

        ``for_capture``: ``max_seq_len`` is raised to ``max_model_len``: the decode kernel fixes
        its KV split count from it at capture, and the graph is replayed for every context
        length up to the model's limit."""
        max_seq_len = int(m.max_seq_len)
        if for_capture:
            max_seq_len = max(max_seq_len, self.max_model_len)
        positions = None if self._positions is None else self._token_positions(m)
        return ATOMAttentionMetadata(
            num_actual_tokens=m.num_actual_tokens,
            num_reqs=m.num_reqs,
            max_query_len=m.max_query_len,
            max_seq_len=max_seq_len,
            query_start_loc=m.query_start_loc,
            seq_lens=m.seq_lens,
            block_table=m.block_table_tensor,
            slot_mapping=m.slot_mapping,
            causal=bool(m.causal),
            positions=positions,
        )

    def _token_positions(self, m: Any) -> torch.Tensor:
        """Position of every query token: its request's context length plus its offset in the
        request's new tokens. Device ops only (``output_size`` given: no host sync)."""
        n, r = int(m.num_actual_tokens), int(m.num_reqs)
        qsl = m.query_start_loc[: r + 1].long()
        q_lens = qsl[1:] - qsl[:-1]
        req = torch.repeat_interleave(torch.arange(r, device=qsl.device), q_lens, output_size=n)
        token = torch.arange(n, device=qsl.device)
        out = self._positions[:n]
        torch.add((m.seq_lens[:r].long() - q_lens)[req], token - qsl[:-1][req], out=out)
        return out


@dataclass(frozen=True)
class FusedQKNormRope:
    """What a layer hands its impl for atom's fused QK-RMSNorm + RoPE + KV-cache write (through
    ``VllmAttentionFactory.fuse_qk_norm_rope``, when ATOM_ENABLE_QK_NORM_ROPE_CACHE_QUANT_FUSION=1).

    ``q_norm`` / ``k_norm``: the model's per-head RMSNorm modules (``.weight``, ``.eps``), read at
    every call (so loaded weights are seen); ``rotary``: a module with ``cos_sin_cache``
    ``[max_pos, rotary_dim]``, ``rotary_dim`` and ``is_neox_style``. Positions come from the
    metadata builder (``ATOMAttentionMetadata.positions``).
    """

    q_norm: Any
    k_norm: Any
    rotary: Any


class ATOMAttentionImpl(AttentionImpl[ATOMAttentionMetadata]):
    """One layer's attention: cache write and paged attention through atom's ops.

    ``forward`` / ``do_kv_cache_update`` / ``process_weights_after_loading`` are injected by the
    MHA decorator; here: construction (vLLM's arguments), :meth:`write_cache` and :meth:`attend`.
    """

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
        self.fp8_cache = kv_cache_dtype in FP8_KV_CACHE_DTYPES
        self.logits_soft_cap = logits_soft_cap
        self.attn_type = attn_type
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        if sinks is not None and sinks.shape != (num_heads,):
            raise ValueError(f"sinks must have one value per query head ({num_heads}), got {tuple(sinks.shape)}")
        self.sinks = sinks
        self.fused: Optional[FusedQKNormRope] = None  # see enable_fused_qk_norm_rope
        # Where vLLM does not call do_kv_cache_update itself (or the fused path owns the write),
        # forward writes the cache.
        self._write_cache_in_forward = ATOMAttentionBackend.forward_includes_kv_cache_update
        # vLLM builds the impl inside its config context (Attention.__init__); forward may run
        # outside it (compiled graphs, CUDA-graph capture), so the batch bound is read now.
        self._workspace_seqs = _current_config_int("scheduler_config", "max_num_seqs")
        self._block_size = _current_config_int("cache_config", "block_size") or 16  # vLLM's CUDA default

    def enable_fused_qk_norm_rope(self, fused: FusedQKNormRope) -> None:
        """From now on the layer passes q/k before QK-norm and RoPE; ``forward`` applies both and
        writes the cache in one op (``do_kv_cache_update`` becomes a no-op)."""
        if self.kv_sharing_target_layer_name is not None:
            raise NotImplementedError("the fused QK-norm path cannot serve a KV-sharing layer")
        if float(fused.q_norm.eps) != float(fused.k_norm.eps):
            raise ValueError(f"q_norm eps {fused.q_norm.eps} differs from k_norm eps {fused.k_norm.eps}")
        self.fused = fused

    # -- atom's math (framework-neutral) ------------------------------------------------------
    def warm_up_kernels(self, act_dtype: torch.dtype) -> int:
        """Compile the attention kernels' variants now, at load, rather than in the first served
        batch that needs each (a stall of up to a second per variant: a split count the
        warm-up and graph capture did not meet). Once per process and layer shape; GPU only.
        Returns the kernel launches made."""
        if not torch.cuda.is_available():
            return 0
        from atom.ops.attention import warm_up_paged_attention

        kv_dtype = torch.float8_e4m3fn if self.fp8_cache else act_dtype
        return warm_up_paged_attention(self.num_heads, self.num_kv_heads, self.head_size, act_dtype,
                                       self._block_size, torch.device("cuda", torch.cuda.current_device()),
                                       kv_dtype=kv_dtype, sliding_window=self.sliding_window,
                                       sinks=self.sinks is not None)

    def cache_views(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """NHD key/value views of the layer's cache, as float8_e4m3fn for an fp8 cache (vLLM
        allocates fp8 caches as uint8)."""
        key_cache, value_cache = compat.kv_cache_as_nhd(kv_cache, self.head_size)
        if self.fp8_cache and key_cache.dtype == torch.uint8:
            key_cache, value_cache = key_cache.view(torch.float8_e4m3fn), value_cache.view(torch.float8_e4m3fn)
        return key_cache, value_cache

    def write_cache(self, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                    value_cache: torch.Tensor, slot_mapping: torch.Tensor,
                    k_scale: Optional[torch.Tensor], v_scale: Optional[torch.Tensor]) -> None:
        from atom.ops import reshape_and_cache

        # key/value may carry padding rows beyond the real tokens; slot_mapping never does.
        n = slot_mapping.shape[0]
        if self.fp8_cache:
            reshape_and_cache(key[:n], value[:n], key_cache, value_cache, slot_mapping, "fp8_e4m3",
                              k_scale.reshape(1), v_scale.reshape(1))
        else:
            reshape_and_cache(key[:n], value[:n], key_cache, value_cache, slot_mapping, "auto")

    def attend(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
               md: ATOMAttentionMetadata, out: torch.Tensor,
               k_scale: Optional[torch.Tensor], v_scale: Optional[torch.Tensor]) -> torch.Tensor:
        from atom.ops import paged_attention

        scales = dict(k_scale=k_scale, v_scale=v_scale) if self.fp8_cache else {}
        return paged_attention(
            query, key_cache, value_cache, md.block_table, md.seq_lens, md.query_start_loc,
            md.max_query_len, md.max_seq_len, self.scale,
            causal=md.causal, sliding_window=self.sliding_window, sinks=self.sinks, out=out, **scales,
        )

    def fused_qk_norm_rope_write(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                 key_cache: torch.Tensor, value_cache: torch.Tensor,
                                 slot_mapping: torch.Tensor, positions: torch.Tensor,
                                 k_scale: Optional[torch.Tensor], v_scale: Optional[torch.Tensor]) -> torch.Tensor:
        """RMSNorm q/k per head, RoPE, and the cache write in one op (q and k in place); returns
        the normed, rotated queries ``[n, num_heads, head_size]``."""
        from atom.ops import fused_qk_norm_rope_cache

        f = self.fused
        n = slot_mapping.shape[0]
        q, _ = fused_qk_norm_rope_cache(
            query[:n], key[:n], value[:n], f.q_norm.weight, f.k_norm.weight, float(f.q_norm.eps),
            positions[:n], f.rotary.cos_sin_cache, bool(f.rotary.is_neox_style), key_cache, value_cache,
            slot_mapping, "fp8_e4m3" if self.fp8_cache else "auto",
            k_scale.reshape(1) if self.fp8_cache else None, v_scale.reshape(1) if self.fp8_cache else None,
            int(f.rotary.rotary_dim),
        )
        return q


class VLLMMHAImplMethods:
    """Source of the MHA decorator: vLLM's per-layer entry points onto :class:`ATOMAttentionImpl`."""

    def process_weights_after_loading(self, act_dtype: torch.dtype) -> None:
        """Called by ``Attention.process_weights_after_loading`` once the loader is done."""
        # Sinks are loaded into the model's parameter after __init__; the kernels add them to
        # float32 softmax statistics, so keep a float32 copy once the real values are in.
        if self.sinks is not None:
            self.sinks = self.sinks.detach().to(torch.float32)
        self.weights_processed_dtype = act_dtype  # what vLLM passed (the engine tests read it)
        self.warm_up_kernels(act_dtype)

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
        key_cache, value_cache = self.cache_views(kv_cache)
        self.write_cache(key, value, key_cache, value_cache, slot_mapping,
                         getattr(layer, "_k_scale", None), getattr(layer, "_v_scale", None))

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
            # vLLM's profiling run: no cache or metadata yet. Allocate the decode workspace's
            # upper bound once here so vLLM's peak-memory measurement counts it; return zeros.
            if output.is_cuda and self._workspace_seqs:
                nbytes = split_kv_workspace_bytes(self._workspace_seqs, self.num_heads, self.num_kv_heads,
                                                  self.head_size, output.device)
                torch.empty(nbytes, dtype=torch.uint8, device=output.device)
            return output.fill_(0)
        md = attn_metadata
        n = md.num_actual_tokens
        k_scale, v_scale = getattr(layer, "_k_scale", None), getattr(layer, "_v_scale", None)
        key_cache, value_cache = self.cache_views(kv_cache)
        writes = self.kv_sharing_target_layer_name is None
        if self.fused is not None:
            if md.positions is None:
                raise RuntimeError("fused QK-norm layer without positions in its metadata (builder "
                                   "did not see the layer as fused)")
            query = self.fused_qk_norm_rope_write(
                query, key, value, key_cache, value_cache, md.slot_mapping[:n], md.positions, k_scale, v_scale)
        elif self._write_cache_in_forward and writes:
            self.write_cache(key, value, key_cache, value_cache, md.slot_mapping[:n], k_scale, v_scale)
        self.attend(query[:n], key_cache, value_cache, md, output[:n], k_scale, v_scale)
        return output


class ATOMAttentionBackend(AttentionBackend):
    """Paged MHA over vLLM's KV cache, for decoder self-attention (GQA, sliding window, sinks,
    fp8 caches). vLLM's classmethods are injected by the backend decorator from these
    declarations."""

    backend_name: ClassVar[str] = "CUSTOM"
    impl_cls: ClassVar[type] = ATOMAttentionImpl
    builder_cls: ClassVar[type] = ATOMAttentionMetadataBuilder
    # The kernels take any page size; 16 keeps vLLM's usual sizes (16 GPU, 128 CPU) and whole
    # Triton key tiles per page.
    block_size_multiple: ClassVar[int] = 16
    max_head_size: ClassVar[int] = MAX_HEAD_SIZE
    has_sinks: ClassVar[bool] = True
    has_sliding_window: ClassVar[bool] = True
    # Every layout works (atom's kernels take block, token and head strides separately);
    # token-major blocks (NHD) first, because each key tile then reads rows of
    # ``num_kv_heads * 2 * head_size`` contiguous elements.
    kv_cache_layouts: ClassVar[tuple[str, ...]] = ("LBNHC", "BLNHC")
    any_kv_cache_layout: ClassVar[bool] = True

    # fp32 too: the CPU reference and the Triton kernels both run it (vLLM-CPU tests use it).
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto", "float16", "bfloat16", *FP8_KV_CACHE_DTYPES]

    # vLLM writes the cache through impl.do_kv_cache_update before impl.forward, as its own
    # backends do; keeping the write a separate op lets torch.compile order it explicitly.
    forward_includes_kv_cache_update: bool = not compat.layer_calls_kv_cache_update()

    @staticmethod
    def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple[int, ...]:
        """Key and value halves, each NHD ``[num_blocks, block_size, num_kv_heads, head_size]``
        as atom's kernels read them (vLLM <= 0.28 allocates this)."""
        return (2, num_blocks, block_size, num_kv_heads, head_size)
