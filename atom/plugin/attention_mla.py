"""atom's MLA (multi-head latent attention) backend for vLLM: backend, metadata builder, impl.

For DeepSeek-V2/V3 and Kimi-K2 shaped layers (``kv_lora_rank`` up to 512, ``qk_rope_head_dim``
64). How vLLM reaches each piece (0.32; 0.26 differs where marked):

* ``ATOMPlatform.get_attn_backend_cls`` -> ``atom.plugin.register.select_attention_backend``
  applies the MLA backend and builder decorators (``atom.plugin.attention.apply_decorators``)
  and returns :data:`BACKEND_QUALNAME` for a ``use_mla`` layer it supports. Before answering it calls
  :func:`register` (the dynamic ``AttentionBackendEnum`` member ``ATOM_MLA``: vLLM looks backends
  up by ``get_name()``; ``CUSTOM`` belongs to atom's MHA backend, and a name of our own takes no
  slot another plugin could own) and :func:`enable_plugin_mode` (the injections below and
  ``atom.plugin.vllm.mla_patch``).
* ``MLAAttention.__init__`` builds ``ATOMMLAImpl(num_heads, head_size, scale, num_kv_heads, ...,
  q_lora_rank, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, qk_head_dim, v_head_dim,
  kv_b_proj, indexer)``.
* The KV-cache manager asks ``MLAAttention.get_kv_cache_spec`` (routed by mla_patch to
  :meth:`ATOMMLAImpl.get_kv_cache_spec` for our layers) for the latent cache: one
  ``[kv_lora_rank | rope]`` row per token, ``[num_blocks, block_size, kv_lora_rank + rope]``
  after ``MLAAttention.bind_kv_cache`` squeezes the head axis.
* The model runner builds one :class:`ATOMMLAMetadataBuilder` per KV-cache group, reorders the
  batch so decodes come first (``reorder_batch_threshold = 1``) and calls ``build`` every step
  (``build_for_cudagraph_capture`` while capturing full graphs).
* Per layer and step, ``MLAAttention.forward`` (or vLLM's ``unified_mla_*`` custom ops) calls
  ``impl.do_kv_cache_update`` (latent write, ``atom.ops.mla_write_latent_cache``) and then
  ``MLAAttention.forward_impl``, which mla_patch routes to the plugin-mode ``impl.forward``:
  decode rows by weight absorption over the latent cache (``atom.ops.mla_decode``), prefill and
  extend rows by up-projecting latents through ``kv_b_proj`` and paged attention
  (``atom.ops.paged_attention`` with its LSE output): the new tokens causally, the cached context
  in chunks of a bounded workspace (:func:`context_chunk_tokens`), merged by log-sum-exp.
  vLLM's profiling run (no metadata) allocates that workspace's bound
  (:func:`forward_mha_workspace_bytes`) so the KV-cache sizing leaves room for it.
* After weight loading, vLLM's loader calls ``MLAAttention.process_weights_after_loading
  (act_dtype)``; mla_patch routes it to the plugin-mode ``impl.process_weights_after_loading``,
  which splits ``kv_b_proj`` into the absorbed ``W_UK_T`` / ``W_UV`` atom's decode uses and,
  on a GPU, compiles the MLA kernels' variants (``warm_up_kernels``).

What vLLM calls is injected, not declared, on atom's classes (:class:`atom.patches.Injection`
records, applied when the backend is chosen; ``revert`` restores the classes as declared):

* ``vllm.attention.mla_backend`` (``atom.plugin.vllm.patches``): the shared backend decorator
  (``atom.plugin.attention.VLLMBackendMethods``, reading :class:`ATOMMLABackend`'s declarations)
  through :class:`VLLMMLABackendMethods`, which adds ``is_mla`` and MLA's head-size and layout
  answers;
* ``vllm.attention.mla_builder``: the shared builder decorator (``build``,
  ``build_for_cudagraph_capture``, ``build_for_drafting``) onto
  :meth:`ATOMMLAMetadataBuilder.build_metadata`;
* :data:`MLA_IMPL_INJECTION`: the plugin-mode ``forward`` and ``process_weights_after_loading``
  of :class:`ATOMMLAImpl` (applied by :func:`enable_plugin_mode`, with mla_patch).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, ClassVar, Optional, Union

import torch

from atom._logging import get_logger
from atom.patches import Injection, PatchError, apply, is_applied, status
from atom.plugin.attention import VLLMBackendMethods, graph_safe
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MLAAttentionImpl,
)

logger = get_logger("atom.plugin")

#: The ``AttentionBackendEnum`` member atom registers for this backend (a name of its own).
BACKEND_NAME = "ATOM_MLA"
#: What vLLM resolves by name (``resolve_obj_by_qualname``: dots only).
BACKEND_QUALNAME = "atom.plugin.attention_mla.ATOMMLABackend"

#: The rope part of the latent row; the write kernel rotates it in pairs of a power-of-two size.
ROPE_DIM = 64
#: The decode kernel keeps a ``next_pow2(kv_lora_rank)`` tile of the latent in registers.
MAX_KV_LORA_RANK = 512

def register() -> Optional[str]:
    """Register ``AttentionBackendEnum.ATOM_MLA`` -> this backend (idempotent); the reason when
    the name is already taken by someone else or this vLLM cannot add names."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    member = AttentionBackendEnum.__members__.get(BACKEND_NAME)
    if member is not None:
        current = member.get_path()
        if current == BACKEND_QUALNAME:
            return None
        return f"AttentionBackendEnum.{BACKEND_NAME} is already registered to {current}"
    try:
        register_backend(BACKEND_NAME, BACKEND_QUALNAME)
    except (TypeError, ValueError, AttributeError) as exc:
        return f"vLLM cannot register the attention backend name {BACKEND_NAME} ({exc})"
    return None


# -- backend ----------------------------------------------------------------------------------


def _mla_geometry_reasons(kv_lora_rank: int, qk_rope_head_dim: int) -> list[str]:
    reasons = []
    if qk_rope_head_dim != ROPE_DIM:
        reasons.append(f"qk_rope_head_dim {qk_rope_head_dim} (atom's MLA needs {ROPE_DIM})")
    if not (0 < kv_lora_rank <= MAX_KV_LORA_RANK and kv_lora_rank % 16 == 0):
        reasons.append(f"kv_lora_rank {kv_lora_rank} (atom's MLA takes multiples of 16 up to "
                       f"{MAX_KV_LORA_RANK})")
    return reasons


def _model_mla_dims() -> Optional[tuple[int, int]]:
    """(kv_lora_rank, qk_rope_head_dim) of the model being built, or None when unknown."""
    try:
        from vllm.config import get_current_vllm_config

        hf = get_current_vllm_config().model_config.hf_text_config
    except Exception:  # no current config (unit tests of the selector): head_size decides
        return None
    rank, rope = getattr(hf, "kv_lora_rank", None), getattr(hf, "qk_rope_head_dim", None)
    if rank is None or rope is None:
        return None
    return int(rank), int(rope)


# -- metadata ---------------------------------------------------------------------------------


@dataclass
class ATOMMLAMetadata:
    """One step of one KV-cache group, split for MLA: decode rows first (one token each, read in
    the latent space), then extend rows (new tokens over cached context) and prefill rows (no
    context), both served by the up-projected path.

    Tensors are vLLM's own device tensors (slices, no copies); every int comes from vLLM's
    host-side bookkeeping, so building this never reads a device value.
    """

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
    #: number of context chunks ``forward_mha`` walks
    max_context_len: int = 0


class ATOMMLAMetadataBuilder(AttentionMetadataBuilder[ATOMMLAMetadata]):
    """Turns vLLM's ``CommonAttentionMetadata`` into :class:`ATOMMLAMetadata`
    (``build`` / ``build_for_cudagraph_capture`` / ``build_for_drafting`` are injected by the
    shared builder decorator, record ``vllm.attention.mla_builder``, and call
    :meth:`build_metadata`).

    ``reorder_batch_threshold = 1``: vLLM's runner puts single-token decode rows first, so the
    split is two boundaries read from host tensors.
    """

    # Full CUDA graphs for uniform single-token decode batches only: the decode path is two
    # bmm's and the split-KV Triton kernel whose split count is fixed from max_seq_len at
    # capture (see build_for_cudagraph_capture); the prefill path sizes its gather by the
    # step's max_seq_len. The torch reference (CPU) reads device values on the host: no graphs.
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    reorder_batch_threshold: ClassVar[Optional[int]] = 1

    def __init__(self, kv_cache_spec: Any, layer_names: list[str], vllm_config: Any,
                 device: torch.device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)

    @classmethod
    def get_cudagraph_support(cls, vllm_config: Any, kv_cache_spec: Any) -> AttentionCGSupport:
        return cls._cudagraph_support if graph_safe(("mla_decode", "mla_write_latent_cache")) else AttentionCGSupport.NEVER

    def build_metadata(self, m: CommonAttentionMetadata, for_capture: bool = False,
                       fast: bool = False) -> ATOMMLAMetadata:
        """atom's split metadata from vLLM's ``CommonAttentionMetadata`` (host ints, device
        tensors).

        ``for_capture`` (``build_for_cudagraph_capture``): decode-only batches, with
        ``max_seq_len`` raised to ``max_model_len``: the decode kernel fixes its KV split count
        from it at capture, and the graph is replayed for every context length up to the
        model's limit."""
        from vllm.v1.attention.backends.utils import split_decodes_and_prefills

        if for_capture and m.max_query_len > 1:
            raise ValueError("atom's MLA captures full CUDA graphs of single-token decode batches only "
                             f"(max_query_len {m.max_query_len})")
        if isinstance(m.causal, torch.Tensor) or not m.causal:
            raise NotImplementedError("atom's MLA backend serves causal decoder attention only")
        num_decodes, num_rest, num_decode_tokens, num_rest_tokens = split_decodes_and_prefills(
            m, decode_threshold=1)
        num_extends = num_rest - _count_fresh_prefills(m, num_decodes) if num_rest else 0
        prefill_qsl = None
        if num_rest:
            prefill_qsl = m.query_start_loc[num_decodes:] - num_decode_tokens
        max_context_len = _max_context_len(m, num_decodes) if num_extends else 0
        max_seq_len = int(m.max_seq_len)
        if for_capture:
            max_seq_len = max(max_seq_len, int(self.vllm_config.model_config.max_model_len))
        return ATOMMLAMetadata(
            num_actual_tokens=m.num_actual_tokens,
            num_reqs=m.num_reqs,
            max_query_len=m.max_query_len,
            max_seq_len=max_seq_len,
            query_start_loc=m.query_start_loc,
            seq_lens=m.seq_lens,
            block_table=m.block_table_tensor,
            slot_mapping=m.slot_mapping,
            num_decodes=num_decodes,
            num_decode_tokens=num_decode_tokens,
            num_extends=num_extends,
            num_prefills=num_rest - num_extends,
            num_prefill_tokens=num_rest_tokens,
            prefill_query_start_loc=prefill_qsl,
            max_context_len=max_context_len,
        )


def _host_seq_lens(m: CommonAttentionMetadata) -> Optional[torch.Tensor]:
    """Host seq_lens (0.26: ``seq_lens_cpu``; >= 0.29: the upper bound, exact for prefills)."""
    seq_lens = getattr(m, "seq_lens_cpu_upper_bound", None)
    if seq_lens is None:
        seq_lens = getattr(m, "_seq_lens_cpu", None)
    return seq_lens


def _max_context_len(m: CommonAttentionMetadata, num_decodes: int) -> int:
    """Host upper bound of the cached context of the non-decode rows (``seq_len - query_len``);
    ``max_seq_len - 1`` when the release gives no host seq_lens. Never reads a device value."""
    seq_lens = _host_seq_lens(m)
    if seq_lens is None:
        return max(int(m.max_seq_len) - 1, 0)
    qsl = m.query_start_loc_cpu
    query_lens = qsl[num_decodes + 1: m.num_reqs + 1] - qsl[num_decodes: m.num_reqs]
    ctx = seq_lens[num_decodes: m.num_reqs] - query_lens
    return int(ctx.max()) if ctx.numel() else 0


def _count_fresh_prefills(m: CommonAttentionMetadata, num_decodes: int) -> int:
    """Rows after the decodes with no cached context (seq_len == query_len), from host tensors
    only; vLLM orders them last. 0.26 has ``seq_lens_cpu``, >= 0.29 an exact-for-prefills
    ``seq_lens_cpu_upper_bound``; without either every non-decode row counts as an extend."""
    seq_lens = _host_seq_lens(m)
    if seq_lens is None:
        return 0
    qsl = m.query_start_loc_cpu
    query_lens = qsl[num_decodes + 1: m.num_reqs + 1] - qsl[num_decodes: m.num_reqs]
    return int((seq_lens[num_decodes: m.num_reqs] == query_lens).sum())


# -- context chunking and its workspace -------------------------------------------------------

#: Cap of the automatic context chunk: 16k tokens up-project to ~2.45 GB for DeepSeek-V3
#: (128 heads x (128 + 64 + 128) + kv_b_proj's 128 x 256 values per token, bf16).
MAX_CONTEXT_CHUNK_TOKENS = 16 * 1024


def context_chunk_tokens(vllm_config: Any) -> int:
    """Tokens of cached context ``forward_mha`` up-projects at a time (``W``).

    ``ATOM_MLA_CONTEXT_CHUNK_TOKENS`` when set (> 0); else vLLM's own rule for its MLA
    backends' chunked-prefill workspace (``max(8 * max_model_len, 4 * max_num_seqs *
    block_size)``) capped at :data:`MAX_CONTEXT_CHUNK_TOKENS`. Never below ``max_num_seqs``
    (every extend row gets at least one context token per chunk). None of vLLM's config (an impl
    built by hand): the cap."""
    from atom import envs

    forced = envs.ATOM_MLA_CONTEXT_CHUNK_TOKENS
    if vllm_config is None:
        return forced or MAX_CONTEXT_CHUNK_TOKENS
    max_num_seqs = int(vllm_config.scheduler_config.max_num_seqs)
    if forced:
        return max(forced, max_num_seqs)
    block_size = int(getattr(vllm_config.cache_config, "block_size", None) or 16)
    auto = max(8 * int(vllm_config.model_config.max_model_len), 4 * max_num_seqs * block_size)
    return max(min(auto, MAX_CONTEXT_CHUNK_TOKENS), max_num_seqs)


def forward_mha_workspace_bytes(chunk_tokens: int, max_tokens: int, heads: int, rank: int,
                                rope: int, nope: int, vdim: int, dtype: torch.dtype) -> int:
    """Upper bound of what :meth:`ATOMMLAImpl.forward_mha` holds at once for a step of at most
    ``max_tokens`` prefill/extend tokens: the up-projection of ``max(chunk_tokens, max_tokens)``
    latent rows (gathered latents, ``kv_b_proj``'s input and output, the ``[N, H, nope + rope +
    v]`` key/value buffer, int64 gather indices) plus the query-side tensors (padded queries,
    one partial output, the float32 running output, and per head the float32 LSEs and merge
    weights). vLLM's profiling run allocates this once (see ``forward``), so its peak counts it.

    DeepSeek-V3 (128 heads, bf16), W = 16k, 8192 tokens per step: 2.45 GB + 1.37 GB."""
    elt = torch.empty((), dtype=dtype).element_size()
    width = max(nope + rope, vdim)
    rows = max(chunk_tokens, max_tokens)
    per_row = (rank + rope) * elt + rank * elt + heads * (nope + vdim) * elt \
        + heads * (nope + rope + vdim) * elt + 4 * 8
    per_query = heads * (2 * width * elt + vdim * 4 + 6 * 4)
    return rows * per_row + max_tokens * per_query


def _current_vllm_config() -> Any:
    """vLLM's config being built, or None outside its config context (an impl built by hand)."""
    from vllm.config import get_current_vllm_config

    try:
        config = get_current_vllm_config()
        config.scheduler_config.max_num_seqs  # noqa: B018 (0.26+: an empty default config asserts here)
        return config
    except Exception:
        return None


def _merge_partial(acc: torch.Tensor, acc_lse: torch.Tensor, part: torch.Tensor,
                   part_lse: torch.Tensor) -> None:
    """``acc, acc_lse <- merge(acc, acc_lse; part, part_lse)`` in place: two attentions of the
    same queries over disjoint key sets, weighted by their log-sum-exps (exact). ``acc_lse`` is
    finite (the new tokens see themselves); a ``part`` row without keys has LSE -inf and 0."""
    total = torch.logaddexp(acc_lse, part_lse)
    acc.mul_(torch.exp(acc_lse - total).unsqueeze(-1))
    acc.addcmul_(part, torch.exp(part_lse - total).unsqueeze(-1))  # part read in its own dtype
    acc_lse.copy_(total)


# -- impl -------------------------------------------------------------------------------------


class ATOMMLAImpl(MLAAttentionImpl[ATOMMLAMetadata]):
    """One MLA layer: latent-cache write (``do_kv_cache_update``), absorbed decode
    (``forward_mqa``), up-projected prefill/extend (``forward_mha``). The plugin-mode
    ``forward`` (called by the patched ``MLAAttention.forward_impl``) and
    ``process_weights_after_loading`` are injected from :class:`_PluginModeMembers`."""

    supports_dcp: bool = False
    supports_pcp: bool = False
    can_return_lse_for_decode: bool = False
    supports_quant_query_input: bool = False

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        alibi_slopes: Optional[list[float]],
        sliding_window: Optional[int],
        kv_cache_dtype: str,
        logits_soft_cap: Optional[float],
        attn_type: str,
        kv_sharing_target_layer_name: Optional[str],
        q_lora_rank: Optional[int],
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        qk_head_dim: int,
        v_head_dim: int,
        kv_b_proj: Any,
        indexer: Optional[object] = None,
        q_pad_num_heads: Optional[int] = None,
        **unsupported: Any,
    ) -> None:
        # The selector cannot see these, so the layer that asks for them fails at model build.
        if alibi_slopes is not None or logits_soft_cap or sliding_window is not None:
            raise NotImplementedError("atom's MLA backend has no ALiBi, soft-cap or sliding window")
        if attn_type != AttentionType.DECODER:
            raise NotImplementedError(f"atom's MLA backend serves decoder attention, not {attn_type}")
        if kv_sharing_target_layer_name is not None:
            raise NotImplementedError("atom's MLA backend has no KV sharing")
        if indexer is not None or unsupported.get("topk_indices_buffer") is not None:
            raise NotImplementedError("atom's MLA backend has no sparse (indexer) attention")
        if kv_cache_dtype not in ATOMMLABackend.supported_kv_cache_dtypes:
            raise NotImplementedError(f"atom's MLA backend has no {kv_cache_dtype} latent cache")
        reasons = _mla_geometry_reasons(kv_lora_rank, qk_rope_head_dim)
        if reasons or head_size != kv_lora_rank + qk_rope_head_dim:
            raise NotImplementedError(f"atom's MLA backend does not support {', '.join(reasons) or head_size}")
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.q_lora_rank = q_lora_rank
        self.kv_lora_rank = kv_lora_rank
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.qk_head_dim = qk_head_dim
        self.v_head_dim = v_head_dim
        self.kv_b_proj = kv_b_proj
        self.indexer = None
        self.q_pad_num_heads = None
        from atom.plugin.attention_mha import _current_config_int

        self._block_size = _current_config_int("cache_config", "block_size") or 16  # vLLM's CUDA default
        # Set by process_weights_after_loading: W_UK^T [H, nope, rank], W_UV [H, rank, v].
        self.W_UK_T: Optional[torch.Tensor] = None
        self.W_UV: Optional[torch.Tensor] = None
        self._identity_rope: Optional[torch.Tensor] = None
        # vLLM builds the impl inside its config context (MLAAttention.__init__); forward runs
        # outside it, so the chunk size and the step's token bound are read now.
        config = _current_vllm_config()
        #: W: cached-context tokens up-projected at a time (see context_chunk_tokens)
        self.context_chunk_tokens = context_chunk_tokens(config)
        self._max_step_tokens = (int(config.scheduler_config.max_num_batched_tokens)
                                 if config is not None else None)

    def workspace_bytes(self, dtype: torch.dtype) -> int:
        """:func:`forward_mha_workspace_bytes` for this layer (0 without vLLM's config)."""
        if self._max_step_tokens is None:
            return 0
        return forward_mha_workspace_bytes(self.context_chunk_tokens, self._max_step_tokens,
                                           self.num_heads, self.kv_lora_rank, self.qk_rope_head_dim,
                                           self.qk_nope_head_dim, self.v_head_dim, dtype)

    def fused_output_quant_supported(self, quant_key: Any) -> bool:
        return False  # no fused output quantization: vLLM's fusion pass leaves our output alone

    def get_kv_cache_spec(self, layer: Any, stock_spec: Any) -> Any:
        """The latent-cache spec for ``layer`` (what mla_patch returns for our layers): vLLM's
        own ``MLAAttentionSpec`` (one ``kv_lora_rank + rope`` row per token, one KV head),
        checked against what atom's kernels read."""
        if type(stock_spec).__name__ != "MLAAttentionSpec":
            raise NotImplementedError(f"atom's MLA backend has no {type(stock_spec).__name__} latent cache")
        if stock_spec.head_size != self.kv_lora_rank + self.qk_rope_head_dim or stock_spec.num_kv_heads != 1:
            raise ValueError(f"latent cache spec {stock_spec} does not match the layer "
                             f"({self.kv_lora_rank} + {self.qk_rope_head_dim}, 1 head)")
        return stock_spec

    def do_kv_cache_update(
        self,
        kv_c_normed: torch.Tensor,
        k_pe: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        kv_cache_dtype: str,
        k_scale: torch.Tensor,
    ) -> None:
        """Write ``[kv_c_normed | k_pe]`` of this step's tokens into the latent cache.

        vLLM's MLA wrapper has already applied RoPE to ``k_pe``; the op's RoPE is run with the
        identity table (cos 1, sin 0: exact), so the row is stored as given.
        """
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

    def forward_mqa(
        self,
        q: Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]],
        kv_c_and_k_pe_cache: torch.Tensor,
        attn_metadata: ATOMMLAMetadata,
        layer: Any,
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Absorbed decode of the decode rows: ``q`` is ``(q_nope @ W_UK, q_pe)`` or their
        concatenation ``[Td, H, rank + rope]``; returns the latent output ``[Td, H, rank]``."""
        from atom.ops import mla_decode

        if not isinstance(q, tuple):
            q = q.split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        ql_nope, q_pe = q
        md = attn_metadata
        nd = md.num_decodes
        out = mla_decode(ql_nope, q_pe, kv_c_and_k_pe_cache, md.block_table[:nd], md.seq_lens[:nd],
                         self.scale, max_seq_len=md.max_seq_len)
        return out, None

    def forward_mha(
        self,
        q: torch.Tensor,
        kv_c_normed: torch.Tensor,
        k_pe: torch.Tensor,
        kv_c_and_k_pe_cache: torch.Tensor,
        attn_metadata: ATOMMLAMetadata,
        k_scale: torch.Tensor,
        output: torch.Tensor,
        output_scale: Optional[torch.Tensor] = None,
    ) -> None:
        """Prefill and extend rows (``q [Tp, H, qk_head_dim]``; ``output [Tp, H * v_head_dim]``),
        as vLLM's own MLA backends do it, with a bounded workspace:

        1. the new tokens attend to themselves (causal): their latents are read back from the
           cache (``do_kv_cache_update`` wrote them), up-projected through ``kv_b_proj``;
        2. the cached context is walked in chunks: each chunk gathers up to ``c = W // rows``
           context tokens of every row (``W = context_chunk_tokens``, a multiple of 16 when it
           can be), up-projects them and attends non-causally;
        3. the partial outputs are merged exactly by their log-sum-exps.

        Every size is a host int (``max_seq_len``, ``max_query_len``, ``max_context_len``, the
        row count), never a device value; rows whose context ends before a chunk read nothing.
        """
        if output_scale is not None:
            raise NotImplementedError("atom's MLA backend has no fused output quantization")
        from atom.ops import paged_attention

        md = attn_metadata
        heads, vdim = self.num_heads, self.v_head_dim
        rows = slice(md.num_decodes, md.num_reqs)
        num_rows = md.num_reqs - md.num_decodes
        cache = kv_c_and_k_pe_cache
        block_size = cache.shape[1]
        tokens = q.shape[0]
        dev = q.device
        width = max(self.qk_nope_head_dim + self.qk_rope_head_dim, vdim)
        if width > q.shape[-1]:  # zero columns leave the scores unchanged
            q = torch.nn.functional.pad(q, (0, width - q.shape[-1]))
        q = q.contiguous()
        qsl = md.prefill_query_start_loc
        q_lens = qsl[1:] - qsl[:-1]

        # 1. new tokens over themselves, causal (their keys are one-token pages, row r's at
        #    qsl[r] + j)
        slots = md.slot_mapping[md.num_decode_tokens: md.num_decode_tokens + tokens].long()
        key, value = self._up_project(cache[slots // block_size, slots % block_size], q.dtype)
        table = (qsl[:-1, None] + torch.arange(md.max_query_len, device=dev, dtype=qsl.dtype))
        table = table.clamp(max=tokens - 1)
        part = torch.empty_like(q)
        lse = torch.empty(tokens, heads, dtype=torch.float32, device=dev)
        paged_attention(q, key.unsqueeze(1), value.unsqueeze(1), table, q_lens, qsl,
                        md.max_query_len, md.max_query_len, self.scale, causal=True, out=part, lse=lse)
        del key, value
        acc = part[..., width - vdim:].to(torch.float32, copy=True)  # never a view of part
        acc_lse = lse.clone()

        # 2. cached context in chunks of c tokens per row
        if md.max_context_len > 0:
            ctx_lens = md.seq_lens[rows] - q_lens
            per_row = max(self.context_chunk_tokens // max(num_rows, 1), 1)
            per_row = per_row // 16 * 16 if per_row >= 16 else per_row
            per_row = min(per_row, -(-md.max_context_len // 16) * 16)
            page = 16 if per_row % 16 == 0 else per_row
            block_table = md.block_table[rows]
            last = block_table.shape[1] * block_size - 1
            offsets = torch.arange(per_row, device=dev)
            chunk_table = torch.arange(num_rows * per_row // page, dtype=torch.int32,
                                       device=dev).view(num_rows, per_row // page)
            for start in range(0, md.max_context_len, per_row):
                pos = (start + offsets).clamp(max=last)  # [c]
                # unused block-table entries may hold anything; clamp keeps the gather in bounds
                blocks = block_table[:, pos // block_size].clamp(min=0).long()  # [R, c]
                latent = cache[blocks, (pos % block_size).expand_as(blocks)].view(-1, cache.shape[-1])
                key, value = self._up_project(latent, q.dtype)
                del latent, blocks
                shape = (num_rows * per_row // page, page, heads, width)
                kv_lens = (ctx_lens - start).clamp(min=0, max=per_row).to(torch.int32)
                paged_attention(q, key.view(shape), value.view(shape), chunk_table, kv_lens, qsl,
                                md.max_query_len, per_row, self.scale, causal=False, out=part, lse=lse)
                del key, value
                _merge_partial(acc, acc_lse, part[..., width - vdim:], lse)

        # 3. the merged output
        output.view(-1, heads, vdim).copy_(acc)

    def _up_project(self, latent: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-head keys and values of latent rows ``[N, rank + rope]``: one buffer ``[N, H,
        nope + rope + v]`` holding ``[k_nope | k_pe | v]``; returns two ``[N, H, width]`` views
        of it (``width = max(nope + rope, v)``): keys = its first ``width`` columns (columns past
        ``nope + rope`` meet zero-padded queries), values = its last ``width`` columns (the
        attention output's last ``v`` columns are the real ones)."""
        rank, rope, nope, vdim = self.kv_lora_rank, self.qk_rope_head_dim, self.qk_nope_head_dim, self.v_head_dim
        heads = self.num_heads
        n = latent.shape[0]
        kv = self.kv_b_proj(latent[:, :rank].to(dtype))[0].view(n, heads, nope + vdim)
        buf = kv.new_empty(n, heads, nope + rope + vdim)
        buf[..., :nope] = kv[..., :nope]
        buf[..., nope + rope:] = kv[..., nope:]
        del kv
        buf[..., nope:nope + rope] = latent[:, None, rank:].to(dtype)
        width = max(nope + rope, vdim)
        return buf[..., :width], buf[..., nope + rope + vdim - width:]

    def warm_up_kernels(self, act_dtype: torch.dtype, *, force: bool = False) -> int:
        """Compile the MLA kernels' variants now, at load, rather than in the first served batch
        that needs each (the H100 MLA table timed a 1.45 s one-off TTFT without it): the
        absorbed decode with every split-reduce bucket (:func:`atom.ops.warm_up_mla_decode`),
        and the two prefill launches of :meth:`forward_mha`, both storing LSEs: new tokens over
        themselves (causal, one-token pages) and a context chunk (16-token pages). Keys and
        values come from :meth:`_up_project`, so their layout is the served one. Once per
        process and layer shape; only on a GPU unless ``force`` (tests, under the Triton
        interpreter). Returns the kernel launches made."""
        from atom.ops import paged_attention, warm_up_mla_decode

        device = self.W_UK_T.device if self.W_UK_T is not None else torch.device("cpu")
        if device.type != "cuda" and not force:
            return 0
        heads, rank, rope = self.num_heads, self.kv_lora_rank, self.qk_rope_head_dim
        launches = warm_up_mla_decode(heads, rank, rope, act_dtype, self._block_size, device, force=force)
        width = max(self.qk_nope_head_dim + rope, self.v_head_dim)
        key = ("mla_prefill", heads, rank, rope, self.qk_nope_head_dim, self.v_head_dim, act_dtype, str(device))
        if not paged_attention.claim_warm_up(key, device.type, force):
            return launches
        tokens, page = 2, 16
        q = torch.zeros(tokens, heads, width, dtype=act_dtype, device=device)
        part = torch.empty_like(q)
        lse = torch.empty(tokens, heads, dtype=torch.float32, device=device)
        qsl = torch.tensor([0, tokens], dtype=torch.int32, device=device)
        q_lens = qsl[1:] - qsl[:-1]
        k, v = self._up_project(torch.zeros(page, rank + rope, dtype=act_dtype, device=device), act_dtype)
        table = torch.arange(tokens, dtype=torch.int32, device=device).view(1, tokens)
        paged_attention(q, k[:tokens].unsqueeze(1), v[:tokens].unsqueeze(1), table, q_lens, qsl, tokens, tokens,
                        self.scale, causal=True, out=part, lse=lse)
        shape = (1, page, heads, width)
        chunk_table = torch.zeros(1, 1, dtype=torch.int32, device=device)
        kv_lens = torch.full((1,), page, dtype=torch.int32, device=device)
        paged_attention(q, k.view(shape), v.view(shape), chunk_table, kv_lens, qsl, tokens, page, self.scale,
                        causal=False, out=part, lse=lse)
        return launches + 2


class VLLMMLABackendMethods(VLLMBackendMethods):
    """Source of the MLA backend decorator (record ``vllm.attention.mla_backend``): the shared
    backend members of :class:`atom.plugin.attention.VLLMBackendMethods` (reading
    :class:`ATOMMLABackend`'s declarations) plus what only an MLA backend answers."""

    @classmethod
    def is_mla(cls) -> bool:
        """vLLM's layers and KV-cache manager take the latent (MLA) path for this backend."""
        return True

    @classmethod
    def supports_head_size(cls, head_size: int) -> bool:
        """``kv_lora_rank + 64`` for every rank atom's MLA kernels take."""
        return not _mla_geometry_reasons(head_size - ROPE_DIM, ROPE_DIM)

    @classmethod
    def supported_kv_cache_layouts(cls) -> Any:
        """None (any layout, no preference), as vLLM's base answers: from 0.29 vLLM allocates
        the latent cache ``[B, 1, N, C]`` itself and ``MLAAttention`` squeezes the head axis;
        atom's MLA kernels take any block and token strides."""
        return None


class ATOMMLABackend(AttentionBackend):
    """Latent-cache MLA for dense (non-sparse) DeepSeek-style decoder layers. vLLM's
    classmethods are injected by the MLA backend decorator (:class:`VLLMMLABackendMethods`)
    from these declarations."""

    backend_name: ClassVar[str] = BACKEND_NAME
    impl_cls: ClassVar[type] = ATOMMLAImpl
    builder_cls: ClassVar[type] = ATOMMLAMetadataBuilder
    # The kernels take any page size; vLLM-CPU forces 16 for MLA, GPUs use 16 or more.
    block_size_multiple: ClassVar[int] = 16
    max_head_size: ClassVar[int] = MAX_KV_LORA_RANK + ROPE_DIM
    has_sinks: ClassVar[bool] = False
    has_sliding_window: ClassVar[bool] = False

    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    # No fp8 latent cache yet: the kernels take a kv_scale, but vLLM's _k_scale plumbing
    # (calibration, checkpoint scales) is not wired or tested.
    supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto", "float16", "bfloat16"]

    @staticmethod
    def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple[int, ...]:
        """One latent row per token (``num_kv_heads`` is 1 for MLA); vLLM <= 0.28 allocates
        this per layer. From 0.29 vLLM allocates ``[B, 1, N, C]`` itself and the layer squeezes it."""
        return (num_blocks, block_size, head_size)

    @classmethod
    def layer_reasons(cls) -> list[str]:
        """The layer geometry the selector does not carry (rank and rope split, read from the
        model config); ``atom.plugin.attention.unsupported_reasons`` adds these."""
        dims = _model_mla_dims()
        return _mla_geometry_reasons(*dims) if dims is not None else []


def _split_kv_b_proj(kv_b_proj: Any, dtype: torch.dtype, rank: int, heads: int, nope: int,
                     vdim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``W_UK [rank, H, nope]``, ``W_UV [rank, H, v]`` from ``kv_b_proj``, dequantized:
    vLLM's ``split_kv_b_proj`` where the installed release has it, else the same steps
    through ``get_and_maybe_dequant_weights``."""
    try:
        from vllm.model_executor.layers.attention.mla_attention import split_kv_b_proj
    except ImportError:
        from vllm.model_executor.layers.quantization.utils.quant_utils import get_and_maybe_dequant_weights

        weight = get_and_maybe_dequant_weights(kv_b_proj).to(dtype).T
        return weight.reshape(rank, heads, nope + vdim).split([nope, vdim], dim=-1)
    return split_kv_b_proj(kv_b_proj, dtype, rank, heads, nope, vdim)


def _rows(t: Optional[torch.Tensor], rows: slice) -> Optional[torch.Tensor]:
    return None if t is None else t[rows]


class _PluginModeMembers:
    """What the MLA decorator injects into :class:`ATOMMLAImpl` (see MLA_IMPL_INJECTION)."""

    def process_weights_after_loading(self, act_dtype: torch.dtype) -> None:
        """Split ``kv_b_proj`` (dequantized to ``act_dtype`` by vLLM's helper) into the absorbed
        decode weights: ``W_UK_T [H, nope, rank]`` and ``W_UV [H, rank, v]``; then compile the
        kernels' variants on a GPU (:meth:`ATOMMLAImpl.warm_up_kernels`)."""
        w_uk, w_uv = _split_kv_b_proj(self.kv_b_proj, act_dtype, self.kv_lora_rank, self.num_heads,
                                      self.qk_nope_head_dim, self.v_head_dim)
        self.W_UK_T = w_uk.permute(1, 2, 0).contiguous()  # [L, H, P] -> [H, P, L]
        self.W_UV = w_uv.transpose(0, 1).contiguous()  # [L, H, V] -> [H, L, V]
        self.warm_up_kernels(act_dtype)

    def forward(
        self,
        layer: Any,
        q: torch.Tensor,
        kv_c_normed: torch.Tensor,
        k_pe: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: Optional[ATOMMLAMetadata],
        output: torch.Tensor,
        output_scale: Optional[torch.Tensor] = None,
        output_block_scale: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """The whole attention of one MLA layer and step (the cache is already written):
        ``q [T, H, qk_head_dim]`` -> ``output [T, H * v_head_dim]`` (written in place; padding
        rows beyond ``num_actual_tokens`` are left alone)."""
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("atom's MLA backend has no fused output quantization")
        if attn_metadata is None:
            # vLLM's profiling run: no cache or metadata yet. Allocate forward_mha's workspace
            # bound once so vLLM's peak-memory measurement counts it; return zeros.
            if output.is_cuda:
                torch.empty(self.workspace_bytes(q.dtype), dtype=torch.uint8, device=output.device)
            return output.fill_(0)
        md = attn_metadata
        n, nd = md.num_actual_tokens, md.num_decode_tokens
        heads = self.num_heads
        q = q[:n].view(n, heads, self.qk_head_dim)
        out = output[:n].view(n, heads, self.v_head_dim)
        if n > nd:
            # the rows' new latents are read back from the cache, with their context
            rows = slice(nd, n)
            self.forward_mha(q[rows], _rows(kv_c_normed, rows), _rows(k_pe, rows), kv_cache, md, None,
                             out[rows].view(n - nd, heads * self.v_head_dim))
        if nd:
            q_nope, q_pe = q[:nd].split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
            # [Td, H, P] x [H, P, L] -> [Td, H, L], written token-major (unit-stride last dim).
            ql_nope = q_nope.new_empty(nd, heads, self.kv_lora_rank)
            torch.bmm(q_nope.transpose(0, 1), self.W_UK_T, out=ql_nope.transpose(0, 1))
            latent, _ = self.forward_mqa((ql_nope, q_pe), kv_cache, md, layer)
            # [H, Td, L] x [H, L, V] -> [H, Td, V], into the token-major output.
            torch.bmm(latent.transpose(0, 1), self.W_UV, out=out[:nd].transpose(0, 1))
        return output


#: The MLA decorator: plugin-mode members injected into atom's MLA impl when the backend is
#: chosen (``enable_plugin_mode``); ``atom.patches.revert`` restores the class.
MLA_IMPL_INJECTION = Injection(
    id="atom.mla.impl_plugin_mode",
    target="atom.plugin.attention_mla:ATOMMLAImpl",
    source="atom.plugin.attention_mla:_PluginModeMembers",
    members=("process_weights_after_loading", "forward"),
    base="vllm.v1.attention.backend:MLAAttentionImpl",
    signatures=(("process_weights_after_loading", "(self, act_dtype)"),),
    reason="vLLM-mode weight split and forward of atom's MLA impl, reached through mla_patch",
    upstream="vllm MLAAttentionImpl.process_weights_after_loading; MLAAttention.forward_impl",
    removal="never while atom serves vLLM's MLAAttention layers",
)

INJECTIONS = (MLA_IMPL_INJECTION,)


def enable_plugin_mode() -> Optional[str]:
    """Apply the MLA decorator and check that mla_patch routes vLLM's MLA layer to atom's impl;
    the reason when it cannot (then the platform keeps vLLM's MLA backend)."""
    from atom.plugin.vllm import mla_patch

    for record in INJECTIONS:
        try:
            apply(record, enabled=True)
        except PatchError as exc:
            return str(exc)
    for record in mla_patch.REQUIRED:
        if not is_applied(record):
            # armed records land when vLLM's MLA module is imported (it is, whenever a layer asks)
            importlib.import_module(record.module)
            apply(record)
        if not is_applied(record):
            return f"patch {record.id} is not applied ({status(record)})"
    return None


def serves_model(vllm_config: Any) -> Optional[str]:
    """None when atom's MLA backend will serve this model's MLA layers, else why not; decided
    from the config alone (what the selector will see), before vLLM builds the model.

    vLLM-CPU turns chunked prefill and prefix caching off for MLA models because its own CPU
    MLA backend cannot attend over cached context; atom's can (the extend path), so the platform
    asks this to keep the user's scheduling settings (``ATOMPlatform.check_and_update_config``).
    """
    from atom import envs
    from atom.patches import disabled_by
    from atom.plugin.vllm import mla_patch

    model = vllm_config.model_config
    if model is None or not getattr(model, "use_mla", False):
        return "not an MLA model"
    if envs.ATOM_DISABLE_VLLM_PLUGIN_ATTENTION:
        return "disabled by ATOM_DISABLE_VLLM_PLUGIN_ATTENTION=1"
    requested = getattr(vllm_config.attention_config, "backend", None)
    if requested is not None and getattr(requested, "name", None) not in ("CUSTOM", BACKEND_NAME):
        return f"attention backend {requested.name} requested"
    for record in mla_patch.REQUIRED:
        why = disabled_by(record)
        if why is not None:
            return f"patch {record.id} disabled by {why}"
    hf = model.hf_text_config
    if getattr(hf, "index_topk", None):
        return "sparse (indexer) MLA"
    reasons = _mla_geometry_reasons(int(getattr(hf, "kv_lora_rank", 0) or 0),
                                    int(getattr(hf, "qk_rope_head_dim", 0) or 0))
    if model.dtype not in ATOMMLABackend.supported_dtypes:
        reasons.append(f"dtype {model.dtype}")
    if vllm_config.cache_config.cache_dtype not in ATOMMLABackend.supported_kv_cache_dtypes:
        reasons.append(f"kv_cache_dtype {vllm_config.cache_config.cache_dtype}")
    return ", ".join(reasons) or None
