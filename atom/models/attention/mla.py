"""atom's multi-head latent attention (MLA: DeepSeek-V2/V3, Kimi-K2), host-neutral: backend
declarations, metadata builder and impl over ``atom.ops.mla_write_latent_cache``,
``atom.ops.mla_decode`` and ``atom.ops.mla_prefill``.

The cache holds one ``[kv_lora_rank | rope]`` latent row per token. Decode rows attend in the
latent space by weight absorption (``q_nope @ W_UK``, :func:`atom.ops.mla_decode`, ``@ W_UV``);
prefill and extend rows up-project latents through the layer's ``kv_b_proj`` and attend with
paged attention, the cached context in chunks of a bounded workspace
(:func:`atom.ops.mla_prefill.mla_prefill`). A host binds these classes to its MLA interface:
vLLM through ``atom.plugin.vllm.attention_mla``.

A host may also offer a decode kernel of its own (:class:`HostDecode`, :func:`set_host_decode`;
vLLM's plugin offers FlashMLA on Hopper): layers whose geometry, dtype and cache page size it
takes run their decode rows on it, everything else on atom's kernel.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ClassVar, NamedTuple, Optional

import torch

from atom.models.attention.common import AttentionBatch, split_decodes
from atom.ops.mla_prefill import UpProj, mla_prefill, mla_prefill_workspace_bytes, up_project

#: The rope part of the latent row; the write kernel rotates it in pairs of a power-of-two size.
ROPE_DIM = 64
#: The decode kernel keeps a ``next_pow2(kv_lora_rank)`` tile of the latent in registers.
MAX_KV_LORA_RANK = 512
#: Cap of the automatic context chunk: 16k tokens up-project to ~2.45 GB for DeepSeek-V3
#: (128 heads x (128 + 64 + 128) + kv_b_proj's 128 x 256 values per token, bf16).
MAX_CONTEXT_CHUNK_TOKENS = 16 * 1024


class HostDecode(NamedTuple):
    """A decode kernel the host framework ships (vLLM: FlashMLA), offered by its plugin
    (:func:`set_host_decode`).

    * ``declines(num_heads, kv_lora_rank, rope_dim, dtype, kv_cache_dtype)``: why it cannot serve
      a layer of this shape (None: it can); asked once per layer, when its weights are absorbed.
    * ``page_size``: the only cache page size it reads; a step whose cache has another page size
      runs atom's kernel.
    * ``new_step()``: the per-step state the kernel's launches share (FlashMLA: its tile
      scheduler, computed by the step's first layer and reused by the others); made by the
      metadata builder for each built step, never reused across steps or graph captures.
    * ``run(q, cache, block_table, seq_lens, scale, state)``: ``q [Td, H, rank + rope]``
      (``[q_nope @ W_UK | q_pe]``, contiguous), ``cache [blocks, page_size, rank + rope]``,
      ``block_table [Td, max_blocks]`` int32, ``seq_lens [Td]`` int32 -> the latent output
      ``[Td, H, rank]``."""

    name: str
    declines: Callable[[int, int, int, torch.dtype, str], Optional[str]]
    page_size: int
    new_step: Callable[[], Any]
    run: Callable[..., torch.Tensor]


_HOST_DECODE: Optional[HostDecode] = None


def set_host_decode(decode: Optional[HostDecode]) -> None:
    """Offer (or, with None, withdraw) the host's MLA decode kernel. Layers decide at
    :meth:`MLAttentionImpl.absorb`; builders make its per-step state from the next build."""
    global _HOST_DECODE
    _HOST_DECODE = decode


def host_decode() -> Optional[HostDecode]:
    """The host's MLA decode kernel, or None (atom's kernel serves every decode row)."""
    return _HOST_DECODE


def mla_geometry_reasons(kv_lora_rank: int, qk_rope_head_dim: int) -> list[str]:
    """Why atom's MLA kernels cannot serve a layer of this latent geometry ([] = they can)."""
    reasons = []
    if qk_rope_head_dim != ROPE_DIM:
        reasons.append(f"qk_rope_head_dim {qk_rope_head_dim} (atom's MLA needs {ROPE_DIM})")
    if not (0 < kv_lora_rank <= MAX_KV_LORA_RANK and kv_lora_rank % 16 == 0):
        reasons.append(f"kv_lora_rank {kv_lora_rank} (atom's MLA takes multiples of 16 up to "
                       f"{MAX_KV_LORA_RANK})")
    return reasons


def context_chunk_tokens(max_model_len: Optional[int], max_num_seqs: Optional[int], block_size: int,
                         forced: int = 0) -> int:
    """Tokens of cached context the prefill path up-projects at a time (``W``).

    ``forced`` (> 0, ``ATOM_MLA_CONTEXT_CHUNK_TOKENS``) when given; else vLLM's own rule for its
    MLA backends' chunked-prefill workspace (``max(8 * max_model_len, 4 * max_num_seqs *
    block_size)``) capped at :data:`MAX_CONTEXT_CHUNK_TOKENS`. Never below ``max_num_seqs``
    (every extend row gets at least one context token per chunk). Without the host's limits
    (``None``): ``forced`` or the cap."""
    if max_model_len is None or max_num_seqs is None:
        return forced or MAX_CONTEXT_CHUNK_TOKENS
    if forced:
        return max(forced, max_num_seqs)
    auto = max(8 * max_model_len, 4 * max_num_seqs * block_size)
    return max(min(auto, MAX_CONTEXT_CHUNK_TOKENS), max_num_seqs)


@dataclass
class MLAMetadata:
    """One step of one KV-cache group, split for MLA: decode rows first (one token each, read in
    the latent space), then extend rows (new tokens over cached context) and prefill rows (no
    context), both served by the up-projected path. Tensors are the host's own (slices, no
    copies); every int comes from host-side bookkeeping."""

    num_actual_tokens: int
    num_reqs: int
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32
    seq_lens: torch.Tensor  # [num_reqs] int32, new tokens included
    block_table: torch.Tensor  # [num_reqs, max_blocks] int32
    slot_mapping: torch.Tensor  # [num_actual_tokens] int64, -1 = padding
    num_decodes: int
    num_decode_tokens: int
    num_extends: int
    num_prefills: int  # prefill rows, extends excluded
    num_prefill_tokens: int  # tokens of extend and prefill rows
    #: query_start_loc of the extend+prefill rows, rebased to their first token
    prefill_query_start_loc: Optional[torch.Tensor] = None
    causal: bool = True
    #: host upper bound of the cached context of the extend rows (0: no extend row); sizes the
    #: number of context chunks the prefill path walks
    max_context_len: int = 0
    #: the host decode kernel's state for this step (:attr:`HostDecode.new_step`), shared by the
    #: step's layers; None without a host decode kernel or decode rows
    host_decode_state: Any = None


class MLABackend:
    """What atom's MLA supports, declared once for every host."""

    # The kernels take any page size; vLLM-CPU forces 16 for MLA, GPUs use 16 or more.
    block_size_multiple: ClassVar[int] = 16
    max_head_size: ClassVar[int] = MAX_KV_LORA_RANK + ROPE_DIM
    has_sinks: ClassVar[bool] = False
    has_sliding_window: ClassVar[bool] = False
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    # No fp8 latent cache yet: the kernels take a kv_scale, but a host's scale plumbing
    # (calibration, checkpoint scales) is not wired or tested.
    supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto", "float16", "bfloat16"]
    #: The ops a decode step runs: CUDA graphs only where both run Triton (``graph_safe``).
    kernel_ops: ClassVar[tuple[str, ...]] = ("mla_decode", "mla_write_latent_cache")

    @staticmethod
    def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple[int, ...]:
        """One latent row per token (``num_kv_heads`` is 1 for MLA)."""
        return (num_blocks, block_size, head_size)


class MLAMetadataBuilder:
    """Turns an :class:`AttentionBatch` whose single-token rows come first into
    :class:`MLAMetadata`, from host tensors only."""

    def __init__(self, *, max_model_len: int) -> None:
        self.max_model_len = int(max_model_len)

    def build_metadata(self, b: AttentionBatch, for_capture: bool = False, fast: bool = False) -> MLAMetadata:
        """``for_capture``: decode-only batches, with ``max_seq_len`` raised to ``max_model_len``:
        the decode kernel fixes its KV split count from it at capture, and the graph is replayed
        for every context length up to the model's limit."""
        if for_capture and b.max_query_len > 1:
            raise ValueError("atom's MLA captures full CUDA graphs of single-token decode batches only "
                             f"(max_query_len {b.max_query_len})")
        if isinstance(b.causal, torch.Tensor) or not b.causal:
            raise NotImplementedError("atom's MLA backend serves causal decoder attention only")
        num_decodes, num_rest, num_decode_tokens, num_rest_tokens = split_decodes(b, 1)
        num_extends = num_rest - _count_fresh_prefills(b, num_decodes) if num_rest else 0
        prefill_qsl = b.query_start_loc[num_decodes:] - num_decode_tokens if num_rest else None
        max_seq_len = int(b.max_seq_len)
        if for_capture:
            max_seq_len = max(max_seq_len, self.max_model_len)
        host = _HOST_DECODE
        return MLAMetadata(
            num_actual_tokens=b.num_actual_tokens,
            num_reqs=b.num_reqs,
            max_query_len=b.max_query_len,
            max_seq_len=max_seq_len,
            query_start_loc=b.query_start_loc,
            seq_lens=b.seq_lens,
            block_table=b.block_table,
            slot_mapping=b.slot_mapping,
            num_decodes=num_decodes,
            num_decode_tokens=num_decode_tokens,
            num_extends=num_extends,
            num_prefills=num_rest - num_extends,
            num_prefill_tokens=num_rest_tokens,
            prefill_query_start_loc=prefill_qsl,
            max_context_len=_max_context_len(b, num_decodes) if num_extends else 0,
            host_decode_state=host.new_step() if host is not None and num_decodes else None,
        )


def _rest_query_lens(b: AttentionBatch, num_decodes: int) -> torch.Tensor:
    qsl = b.query_start_loc_cpu
    return qsl[num_decodes + 1: b.num_reqs + 1] - qsl[num_decodes: b.num_reqs]


def _max_context_len(b: AttentionBatch, num_decodes: int) -> int:
    """Host upper bound of the cached context of the non-decode rows (``seq_len - query_len``);
    ``max_seq_len - 1`` without host seq_lens. Never reads a device value."""
    if b.seq_lens_cpu is None:
        return max(int(b.max_seq_len) - 1, 0)
    ctx = b.seq_lens_cpu[num_decodes: b.num_reqs] - _rest_query_lens(b, num_decodes)
    return int(ctx.max()) if ctx.numel() else 0


def _count_fresh_prefills(b: AttentionBatch, num_decodes: int) -> int:
    """Rows after the decodes with no cached context (seq_len == query_len), from host tensors
    only (hosts order them last); without host seq_lens every non-decode row counts as an
    extend."""
    if b.seq_lens_cpu is None:
        return 0
    return int((b.seq_lens_cpu[num_decodes: b.num_reqs] == _rest_query_lens(b, num_decodes)).sum())


def _rows(t: Optional[torch.Tensor], rows: slice) -> Optional[torch.Tensor]:
    return None if t is None else t[rows]


class MLAttentionImpl:
    """One MLA layer: latent-cache write (:meth:`write_latent`), absorbed decode (:meth:`decode`),
    up-projected prefill/extend (:meth:`prefill`) and :meth:`run`, the whole step.

    ``up_proj`` is the layer's ``kv_b_proj`` as a function (``[N, rank] -> [N, H * (nope +
    v)]``); :meth:`absorb` takes its dequantised weight split per head once loaded.
    ``context_chunk_tokens`` (:func:`context_chunk_tokens`) and ``max_step_tokens`` (the host's
    token budget per step) size the prefill workspace; ``block_size`` the kernel warm-up.
    """

    def __init__(
        self,
        num_heads: int,
        scale: float,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        up_proj: UpProj,
        kv_cache_dtype: str = "auto",
        *,
        context_chunk_tokens: int = MAX_CONTEXT_CHUNK_TOKENS,
        max_step_tokens: Optional[int] = None,
        block_size: int = 16,
    ) -> None:
        if kv_cache_dtype not in MLABackend.supported_kv_cache_dtypes:
            raise NotImplementedError(f"atom's MLA backend has no {kv_cache_dtype} latent cache")
        reasons = mla_geometry_reasons(kv_lora_rank, qk_rope_head_dim)
        if reasons:
            raise NotImplementedError(f"atom's MLA backend does not support {', '.join(reasons)}")
        self.num_heads = num_heads
        self.scale = float(scale)
        self.kv_lora_rank = kv_lora_rank
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.qk_head_dim = qk_nope_head_dim + qk_rope_head_dim
        self.v_head_dim = v_head_dim
        self.head_size = kv_lora_rank + qk_rope_head_dim
        self.kv_cache_dtype = kv_cache_dtype
        self.up_proj = up_proj
        #: W: cached-context tokens up-projected at a time (see context_chunk_tokens)
        self.context_chunk_tokens = context_chunk_tokens
        self._max_step_tokens = max_step_tokens
        self._block_size = block_size
        # Set by absorb: W_UK^T [H, nope, rank], W_UV [H, rank, v].
        self.W_UK_T: Optional[torch.Tensor] = None
        self.W_UV: Optional[torch.Tensor] = None
        self._identity_rope: Optional[torch.Tensor] = None
        #: the host decode kernel this layer's decode rows run on (chosen at absorb), or None
        self.host_decode: Optional[HostDecode] = None
        #: why the host decode kernel declined this layer (None: it serves it, or there is none)
        self.host_decode_declined: Optional[str] = None

    def workspace_bytes(self, dtype: torch.dtype) -> int:
        """What the prefill path holds at once at most (0 without the host's token budget)."""
        if self._max_step_tokens is None:
            return 0
        return mla_prefill_workspace_bytes(self.context_chunk_tokens, self._max_step_tokens, self.num_heads,
                                           self.kv_lora_rank, self.qk_rope_head_dim, self.qk_nope_head_dim,
                                           self.v_head_dim, dtype)

    def check_latent_cache(self, head_size: int, num_kv_heads: int) -> None:
        """A host's latent-cache layout must be what the kernels read: one ``rank + rope`` row per
        token, one KV head."""
        if head_size != self.head_size or num_kv_heads != 1:
            raise ValueError(f"latent cache of head size {head_size} x {num_kv_heads} heads does not "
                             f"match the layer ({self.kv_lora_rank} + {self.qk_rope_head_dim}, 1 head)")

    def absorb(self, w_uk: torch.Tensor, w_uv: torch.Tensor, act_dtype: torch.dtype) -> None:
        """Once the weights are loaded: ``w_uk [rank, H, nope]``, ``w_uv [rank, H, v]`` (the
        dequantised ``kv_b_proj`` split per head) become the absorbed decode weights ``W_UK_T
        [H, nope, rank]`` and ``W_UV [H, rank, v]``; then the kernels' variants are compiled on
        a GPU (:meth:`warm_up_kernels`)."""
        self.W_UK_T = w_uk.permute(1, 2, 0).contiguous()
        self.W_UV = w_uv.transpose(0, 1).contiguous()
        self.choose_host_decode(act_dtype)
        self.warm_up_kernels(act_dtype)

    def choose_host_decode(self, act_dtype: torch.dtype) -> Optional[HostDecode]:
        """The host's decode kernel for this layer where it takes the layer's shape and dtype
        (:attr:`host_decode`), else None and the reason in :attr:`host_decode_declined`."""
        host = _HOST_DECODE
        why = None if host is None else host.declines(self.num_heads, self.kv_lora_rank, self.qk_rope_head_dim,
                                                       act_dtype, self.kv_cache_dtype)
        self.host_decode = host if host is not None and why is None else None
        self.host_decode_declined = why
        return self.host_decode

    def write_latent(self, kv_c_normed: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor,
                     slot_mapping: torch.Tensor) -> None:
        """Write ``[kv_c_normed | k_pe]`` of this step's tokens into the latent cache. ``k_pe`` is
        already rotated; the op's RoPE runs with the identity table (cos 1, sin 0: exact), so the
        row is stored as given."""
        if kv_cache.numel() == 0:
            return
        from atom.ops import mla_write_latent_cache

        slots = slot_mapping.flatten()
        n = slots.shape[0]
        rope = self.qk_rope_head_dim
        table = self._identity_rope
        if table is None or table.device != kv_c_normed.device or table.dtype != kv_c_normed.dtype:
            table = torch.cat([torch.ones(rope // 2), torch.zeros(rope // 2)]).view(1, rope)
            table = self._identity_rope = table.to(device=kv_c_normed.device, dtype=kv_c_normed.dtype)
        positions = torch.zeros(n, dtype=torch.long, device=kv_c_normed.device)
        mla_write_latent_cache(kv_c_normed[:n], k_pe[:n].reshape(n, rope), positions, table,
                               kv_cache, slots, True)

    def decode(self, ql_nope: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor,
               md: MLAMetadata) -> torch.Tensor:
        """Absorbed decode of the decode rows: ``ql_nope = q_nope @ W_UK [Td, H, rank]`` and ``q_pe
        [Td, H, rope]`` -> the latent output ``[Td, H, rank]``."""
        from atom.ops import mla_decode

        nd = md.num_decodes
        return mla_decode(ql_nope, q_pe, cache, md.block_table[:nd], md.seq_lens[:nd], self.scale,
                          max_seq_len=md.max_seq_len)

    def _host_decode_for(self, cache: torch.Tensor, md: MLAMetadata) -> Optional[HostDecode]:
        host = self.host_decode
        if host is None or md.host_decode_state is None or cache.shape[1] != host.page_size:
            return None
        return host

    def prefill(self, q: torch.Tensor, cache: torch.Tensor, md: MLAMetadata, output: torch.Tensor) -> None:
        """Prefill and extend rows (``q [Tp, H, qk_head_dim]``, ``output [Tp, H * v_head_dim]``),
        their new latents already in the cache (:func:`atom.ops.mla_prefill.mla_prefill`)."""
        rows = slice(md.num_decodes, md.num_reqs)
        first = md.num_decode_tokens
        mla_prefill(q, cache, md.slot_mapping[first: first + q.shape[0]], md.prefill_query_start_loc,
                    md.seq_lens[rows], md.block_table[rows], md.max_query_len, md.max_context_len,
                    self.up_proj, rank=self.kv_lora_rank, rope=self.qk_rope_head_dim,
                    nope=self.qk_nope_head_dim, vdim=self.v_head_dim, scale=self.scale,
                    chunk_tokens=self.context_chunk_tokens, output=output)

    def run(self, q: torch.Tensor, cache: torch.Tensor, md: MLAMetadata, output: torch.Tensor) -> torch.Tensor:
        """The whole attention of one step (the cache already written): ``q [T, H, qk_head_dim]``
        -> ``output [T, H * v_head_dim]`` (written in place; padding rows beyond
        ``num_actual_tokens`` are left alone)."""
        n, nd = md.num_actual_tokens, md.num_decode_tokens
        heads = self.num_heads
        q = q[:n].view(n, heads, self.qk_head_dim)
        out = output[:n].view(n, heads, self.v_head_dim)
        if n > nd:
            self.prefill(q[nd:], cache, md, out[nd:].view(n - nd, heads * self.v_head_dim))
        if nd:
            q_nope, q_pe = q[:nd].split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
            rank = self.kv_lora_rank
            host = self._host_decode_for(cache, md)
            # [Td, H, P] x [H, P, L] -> [Td, H, L], written token-major (unit-stride last dim);
            # for a host kernel straight into its [q_nope @ W_UK | q_pe] query rows.
            q_lat = q_nope.new_empty(nd, heads, rank + (self.qk_rope_head_dim if host is not None else 0))
            ql_nope = q_lat[..., :rank]
            torch.bmm(q_nope.transpose(0, 1), self.W_UK_T, out=ql_nope.transpose(0, 1))
            if host is not None:
                q_lat[..., rank:].copy_(q_pe)
                latent = host.run(q_lat, cache, md.block_table[:nd], md.seq_lens[:nd], self.scale,
                                  md.host_decode_state)
            else:
                latent = self.decode(ql_nope, q_pe, cache, md)
            # [H, Td, L] x [H, L, V] -> [H, Td, V], into the token-major output.
            torch.bmm(latent.transpose(0, 1), self.W_UV, out=out[:nd].transpose(0, 1))
        return output

    def profile_run(self, q: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
        """A host's memory-profiling step (no cache or metadata yet): allocate the prefill
        workspace's bound once so the host's peak-memory measurement counts it; zeros."""
        if output.is_cuda:
            torch.empty(self.workspace_bytes(q.dtype), dtype=torch.uint8, device=output.device)
        return output.fill_(0)

    def warm_up_kernels(self, act_dtype: torch.dtype, *, force: bool = False) -> int:
        """Compile the MLA kernels' variants now, at load, rather than in the first served batch
        that needs each (the H100 MLA table timed a 1.45 s one-off TTFT without it): the
        absorbed decode with every split-reduce bucket (:func:`atom.ops.warm_up_mla_decode`;
        not where the host's decode kernel serves the layer at its page size),
        and the two prefill launches of :func:`atom.ops.mla_prefill.mla_prefill`, both storing
        LSEs: new tokens over themselves (causal, one-token pages) and a context chunk (16-token
        pages), on keys and values up-projected the served way. Once per process and layer
        shape; only on a GPU unless ``force`` (tests, under the Triton interpreter). Returns
        the kernel launches made."""
        from atom.ops import paged_attention, warm_up_mla_decode
        from atom.ops._warm import timed

        device = self.W_UK_T.device if self.W_UK_T is not None else torch.device("cpu")
        if device.type != "cuda" and not force:
            return 0
        heads, rank, rope = self.num_heads, self.kv_lora_rank, self.qk_rope_head_dim
        launches = 0
        if self.host_decode is None or self.host_decode.page_size != self._block_size:
            # atom's decode kernel serves this layer's decode rows (a host kernel's own
            # variants are the host's business)
            launches = warm_up_mla_decode(heads, rank, rope, act_dtype, self._block_size, device, force=force)
        width = max(self.qk_nope_head_dim + rope, self.v_head_dim)
        key = ("mla_prefill", heads, rank, rope, self.qk_nope_head_dim, self.v_head_dim, act_dtype, str(device))
        if not paged_attention.claim_warm_up(key, device.type, force):
            return launches

        def prefill() -> int:
            tokens, page = 2, 16
            q = torch.zeros(tokens, heads, width, dtype=act_dtype, device=device)
            part = torch.empty_like(q)
            lse = torch.empty(tokens, heads, dtype=torch.float32, device=device)
            qsl = torch.tensor([0, tokens], dtype=torch.int32, device=device)
            q_lens = qsl[1:] - qsl[:-1]
            k, v = up_project(torch.zeros(page, rank + rope, dtype=act_dtype, device=device), self.up_proj,
                              heads, rank, rope, self.qk_nope_head_dim, self.v_head_dim, act_dtype)
            table = torch.arange(tokens, dtype=torch.int32, device=device).view(1, tokens)
            paged_attention(q, k[:tokens].unsqueeze(1), v[:tokens].unsqueeze(1), table, q_lens, qsl, tokens, tokens,
                            self.scale, causal=True, out=part, lse=lse)
            shape = (1, page, heads, width)
            chunk_table = torch.zeros(1, 1, dtype=torch.int32, device=device)
            kv_lens = torch.full((1,), page, dtype=torch.int32, device=device)
            paged_attention(q, k.view(shape), v.view(shape), chunk_table, kv_lens, qsl, tokens, page, self.scale,
                            causal=False, out=part, lse=lse)
            return 2

        return launches + timed("mla_prefill", f"{heads} heads, rank {rank} + {rope}", prefill, device)
