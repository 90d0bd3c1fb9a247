"""atom's paged attention (MHA / GQA), host-neutral: backend declarations, metadata builder and
impl over ``atom.ops.reshape_and_cache``, ``atom.ops.paged_attention`` and
``atom.ops.fused_qk_norm_rope_cache`` (Triton on GPUs, the torch reference on CPU).

One kernel call serves prefill, chunked-prefill and decode rows in any order (no batch
reordering); a host may offer its own kernel for the steps with multi-token rows
(:class:`HostPrefill`; vLLM: FlashAttention, ``ATOM_MHA_HOST_PREFILL``). Decoder self-attention
with GQA, sliding window, sinks and fp8 caches (``fp8`` / ``fp8_e4m3``: ``x / scale`` stored as
float8_e4m3fn with per-tensor scales, which the kernels dequantise with). A host binds these
classes to its attention interface: vLLM through ``atom.plugin.vllm.attention_mha``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ClassVar, NamedTuple, Optional

import torch

from atom.models.attention.common import AttentionBatch

#: The Triton kernels size one tile per head (``next_pow2(head_size)``) and stop at 256; above
#: that atom's dispatcher would silently run the torch reference on a GPU.
MAX_HEAD_SIZE = 256

#: Cache dtype names that mean float8_e4m3fn (what atom's kernels read).
FP8_KV_CACHE_DTYPES = ("fp8", "fp8_e4m3")


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


class HostPrefill(NamedTuple):
    """An attention kernel the host framework ships (vLLM: FlashAttention's paged varlen
    kernel), offered by its plugin (:func:`set_host_prefill`) for the steps that hold a
    multi-token row (prefill, chunked prefill, prefill rows next to decodes): one call then serves
    every row of the step. Decode-only steps (the ones full CUDA graphs capture) keep atom's
    kernels.

    * ``declines(num_heads, num_kv_heads, head_size, dtype, kv_cache_dtype, has_sinks)``: why it
      cannot serve a layer of this shape (None: it can); asked once per layer, when its weights
      are processed.
    * ``run(q, key_cache, value_cache, out, md, scale, sliding_window, sinks)``: attention as
      :func:`atom.ops.paged_attention` computes it (``q [T, H, D]``, the NHD caches, ``md`` a
      :class:`PagedAttentionMetadata`, ``sliding_window`` atom's ``W`` or None, ``sinks`` ``[H]``
      in ``sinks_dtype`` or None), written into ``out [T, H, D]``, which it returns.
    * ``sinks_dtype``: the dtype ``run`` takes the sinks in (the layer keeps that copy once, at
      load); float32 by default, as atom's kernels take them."""

    name: str
    declines: Callable[[int, int, int, torch.dtype, str, bool], Optional[str]]
    run: Callable[..., torch.Tensor]
    sinks_dtype: torch.dtype = torch.float32


_HOST_PREFILL: Optional[HostPrefill] = None


def set_host_prefill(prefill: Optional[HostPrefill]) -> None:
    """Offer (or, with None, withdraw) the host's kernel for steps with multi-token rows. Layers
    decide when their weights are processed (:meth:`PagedAttentionImpl.choose_host_prefill`)."""
    global _HOST_PREFILL
    _HOST_PREFILL = prefill


def host_prefill() -> Optional[HostPrefill]:
    """The host's kernel for steps with multi-token rows, or None (atom's kernels serve them)."""
    return _HOST_PREFILL


@dataclass
class PagedAttentionMetadata:
    """Per-step metadata of one KV-cache group, in the shape ``atom.ops.paged_attention`` takes
    (the host's own device tensors, no copies)."""

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


@dataclass(frozen=True)
class FusedQKNormRope:
    """What a layer hands its impl for atom's fused QK-RMSNorm + RoPE + KV-cache write
    (``ATOM_ENABLE_QK_NORM_ROPE_CACHE_QUANT_FUSION=1``).

    ``q_norm`` / ``k_norm``: the model's per-head RMSNorm modules (``.weight``, ``.eps``), read at
    every call (so loaded weights are seen); ``rotary``: a module with ``cos_sin_cache``
    ``[max_pos, rotary_dim]``, ``rotary_dim`` and ``is_neox_style``. Positions come from the
    metadata builder (:attr:`PagedAttentionMetadata.positions`).
    """

    q_norm: Any
    k_norm: Any
    rotary: Any


class PagedAttentionBackend:
    """What atom's paged attention supports, declared once for every host."""

    # The kernels take any page size; 16 keeps the usual sizes (16 GPU, 128 CPU) and whole
    # Triton key tiles per page.
    block_size_multiple: ClassVar[int] = 16
    max_head_size: ClassVar[int] = MAX_HEAD_SIZE
    has_sinks: ClassVar[bool] = True
    has_sliding_window: ClassVar[bool] = True
    # Every layout works (the kernels take block, token and head strides separately);
    # token-major blocks (vLLM's names; NHD) first, because each key tile then reads rows of
    # ``num_kv_heads * 2 * head_size`` contiguous elements.
    kv_cache_layouts: ClassVar[tuple[str, ...]] = ("LBNHC", "BLNHC")
    any_kv_cache_layout: ClassVar[bool] = True
    # fp32 too: the CPU reference and the Triton kernels both run it.
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto", "float16", "bfloat16", *FP8_KV_CACHE_DTYPES]
    #: The ops a step runs: CUDA graphs only where all of them run Triton (``graph_safe``).
    kernel_ops: ClassVar[tuple[str, ...]] = ("paged_attention", "reshape_and_cache")

    @staticmethod
    def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple[int, ...]:
        """Key and value halves, each NHD ``[num_blocks, block_size, num_kv_heads, head_size]``."""
        return (2, num_blocks, block_size, num_kv_heads, head_size)


class PagedAttentionMetadataBuilder:
    """Turns an :class:`AttentionBatch` into :class:`PagedAttentionMetadata`.

    Layers on the fused QK-norm path need each token's position, which hosts do not put in
    attention metadata: with ``with_positions`` the builder derives them into a persistent
    buffer (full CUDA graphs read it at replay).
    """

    def __init__(self, *, max_model_len: int, max_num_batched_tokens: int, with_positions: bool,
                 device: torch.device) -> None:
        self.max_model_len = int(max_model_len)
        self._positions = (torch.zeros(int(max_num_batched_tokens), dtype=torch.int64, device=device)
                           if with_positions else None)

    def build_metadata(self, b: AttentionBatch, for_capture: bool = False,
                       fast: bool = False) -> PagedAttentionMetadata:
        """``for_capture``: ``max_seq_len`` is raised to ``max_model_len``: the decode kernel fixes
        its KV split count from it at capture, and the graph is replayed for every context
        length up to the model's limit."""
        max_seq_len = int(b.max_seq_len)
        if for_capture:
            max_seq_len = max(max_seq_len, self.max_model_len)
        return PagedAttentionMetadata(
            num_actual_tokens=b.num_actual_tokens,
            num_reqs=b.num_reqs,
            max_query_len=b.max_query_len,
            max_seq_len=max_seq_len,
            query_start_loc=b.query_start_loc,
            seq_lens=b.seq_lens,
            block_table=b.block_table,
            slot_mapping=b.slot_mapping,
            causal=bool(b.causal),
            positions=None if self._positions is None else self._token_positions(b),
        )

    def _token_positions(self, b: AttentionBatch) -> torch.Tensor:
        """Position of every query token: its request's context length plus its offset in the
        request's new tokens. Device ops only (``output_size`` given: no host sync)."""
        n, r = int(b.num_actual_tokens), int(b.num_reqs)
        qsl = b.query_start_loc[: r + 1].long()
        q_lens = qsl[1:] - qsl[:-1]
        req = torch.repeat_interleave(torch.arange(r, device=qsl.device), q_lens, output_size=n)
        token = torch.arange(n, device=qsl.device)
        out = self._positions[:n]
        torch.add((b.seq_lens[:r].long() - q_lens)[req], token - qsl[:-1][req], out=out)
        return out


class PagedAttentionImpl:
    """One layer's paged attention: cache write (:meth:`write_cache`), attention
    (:meth:`attend`), the fused QK-norm + RoPE + cache path, and :meth:`run`, the whole step.

    ``max_num_seqs`` bounds the decode workspace the profiling run allocates
    (:meth:`profile_run`); ``block_size`` is the host's page size, for the kernel warm-up.
    """

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: Optional[int] = None,
        sliding_window: Optional[int] = None,
        kv_cache_dtype: str = "auto",
        sinks: Optional[torch.Tensor] = None,
        *,
        kv_sharing_target_layer_name: Optional[str] = None,
        max_num_seqs: Optional[int] = None,
        block_size: int = 16,
    ) -> None:
        if kv_cache_dtype not in PagedAttentionBackend.supported_kv_cache_dtypes:
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
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        if sinks is not None and sinks.shape != (num_heads,):
            raise ValueError(f"sinks must have one value per query head ({num_heads}), got {tuple(sinks.shape)}")
        self.sinks = sinks
        self.fused: Optional[FusedQKNormRope] = None  # see enable_fused_qk_norm_rope
        #: the host's kernel for steps with multi-token rows, where it serves this layer
        #: (:meth:`choose_host_prefill`); why not, in ``host_prefill_declined``
        self.host_prefill: Optional[HostPrefill] = None
        self.host_prefill_declined: Optional[str] = None
        #: the sinks in the dtype the host's kernel takes them (``HostPrefill.sinks_dtype``)
        self.host_prefill_sinks: Optional[torch.Tensor] = None
        self._workspace_seqs = max_num_seqs
        self._block_size = block_size

    def enable_fused_qk_norm_rope(self, fused: FusedQKNormRope) -> None:
        """From now on the layer passes q/k before QK-norm and RoPE; :meth:`run` applies both and
        writes the cache in one op (:meth:`write_cache` is then not called)."""
        if self.kv_sharing_target_layer_name is not None:
            raise NotImplementedError("the fused QK-norm path cannot serve a KV-sharing layer")
        if float(fused.q_norm.eps) != float(fused.k_norm.eps):
            raise ValueError(f"q_norm eps {fused.q_norm.eps} differs from k_norm eps {fused.k_norm.eps}")
        self.fused = fused

    def prepare_weights(self, act_dtype: torch.dtype) -> None:
        """Once the host has loaded the weights: sinks are loaded into the model's parameter after
        ``__init__`` and the kernels add them to float32 softmax statistics, so keep a float32
        copy; then compile the kernels' variants (:meth:`warm_up_kernels`)."""
        if self.sinks is not None:
            self.sinks = self.sinks.detach().to(torch.float32)
        self.choose_host_prefill(act_dtype)
        self.warm_up_kernels(act_dtype)

    def choose_host_prefill(self, act_dtype: torch.dtype) -> Optional[HostPrefill]:
        """The host's kernel for this layer's steps with multi-token rows where one is offered and
        takes the layer (:attr:`host_prefill`), else None and the reason in
        :attr:`host_prefill_declined`."""
        host = host_prefill()
        why = None if host is None else host.declines(self.num_heads, self.num_kv_heads, self.head_size,
                                                      act_dtype, self.kv_cache_dtype, self.sinks is not None)
        self.host_prefill = host if host is not None and why is None else None
        self.host_prefill_declined = why
        self.host_prefill_sinks = (self.sinks.to(self.host_prefill.sinks_dtype)
                                   if self.host_prefill is not None and self.sinks is not None else None)
        return self.host_prefill

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

    def fp8_views(self, key_cache: torch.Tensor, value_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The caches as float8_e4m3fn for an fp8 cache allocated as bytes (hosts allocate fp8
        caches as uint8)."""
        if self.fp8_cache and key_cache.dtype == torch.uint8:
            return key_cache.view(torch.float8_e4m3fn), value_cache.view(torch.float8_e4m3fn)
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
               md: PagedAttentionMetadata, out: torch.Tensor,
               k_scale: Optional[torch.Tensor], v_scale: Optional[torch.Tensor]) -> torch.Tensor:
        if self.host_prefill is not None and md.max_query_len > 1:
            return self.host_prefill.run(query, key_cache, value_cache, out, md, self.scale, self.sliding_window,
                                         self.host_prefill_sinks)
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

    def run(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
            value_cache: torch.Tensor, md: PagedAttentionMetadata, output: torch.Tensor,
            k_scale: Optional[torch.Tensor], v_scale: Optional[torch.Tensor], *, write_cache: bool) -> torch.Tensor:
        """One step of this layer: ``query [T, num_heads, head_size]`` -> ``output`` (same shape,
        written in place). ``write_cache``: this call writes the step's keys/values (the host
        has not); the fused path always writes them itself; a KV-sharing layer never does."""
        n = md.num_actual_tokens
        if self.fused is not None:
            if md.positions is None:
                raise RuntimeError("fused QK-norm layer without positions in its metadata (builder "
                                   "did not see the layer as fused)")
            query = self.fused_qk_norm_rope_write(
                query, key, value, key_cache, value_cache, md.slot_mapping[:n], md.positions, k_scale, v_scale)
        elif write_cache and self.kv_sharing_target_layer_name is None:
            self.write_cache(key, value, key_cache, value_cache, md.slot_mapping[:n], k_scale, v_scale)
        self.attend(query[:n], key_cache, value_cache, md, output[:n], k_scale, v_scale)
        return output

    def profile_run(self, output: torch.Tensor) -> torch.Tensor:
        """A host's memory-profiling step (no cache or metadata yet): allocate the decode
        workspace's upper bound once so the host's peak-memory measurement counts it; zeros."""
        if output.is_cuda and self._workspace_seqs:
            nbytes = split_kv_workspace_bytes(self._workspace_seqs, self.num_heads, self.num_kv_heads,
                                              self.head_size, output.device)
            torch.empty(nbytes, dtype=torch.uint8, device=output.device)
        return output.fill_(0)
