"""The members the SGLang MHA decorator injects into atom's host-neutral
:class:`~atom.models.attention.mha.PagedAttentionMetadataBuilder` so that SGLang can call it as
an attention backend -- the *source* of the record ``sglang.attention.mha_backend``
(``atom.plugin.sglang.records``, group ``sglang.attention.mha``).

SGLang's backend is one object per model runner that both prepares a step's metadata and runs
every layer: ``init_forward_metadata`` (eager steps), the CUDA-graph hooks
(``init_cuda_graph_state``, ``init_forward_metadata_out_graph``,
``get_cuda_graph_seq_len_fill_value``) and ``forward_extend`` / ``forward_decode``, which
``RadixAttention`` reaches through ``AttentionBackend.forward``. The class SGLang is handed,
``atom.plugin.sglang.attention_mha.ATOMSGLangAttnBackend``, subclasses the atom builder and
SGLang's base and holds only the construction from SGLang's model runner; it inherits these.
Each layer's atom :class:`~atom.models.attention.mha.PagedAttentionImpl` runs the step (one
kernel call for prefill, extend and decode rows).
"""

from __future__ import annotations

from typing import Any

import dataclasses

import torch

from atom.plugin.sglang import compat


def impl_for_layer(layer: Any, *, max_num_seqs: int | None, page_size: int) -> Any:
    """An atom :class:`~atom.models.attention.mha.PagedAttentionImpl` for one of SGLang's
    ``RadixAttention`` layers (atom's models attach theirs at build time as ``layer.atom_impl``;
    a layer of SGLang's own models gets one on first use). What atom's SGLang backend does not
    serve yet is refused here, at the first step, rather than computed differently."""
    from atom.models.attention.mha import PagedAttentionImpl

    unsupported = [what for what, on in (
        ("sliding window", int(getattr(layer, "sliding_window_size", -1) or -1) >= 0),
        ("logit capping", bool(getattr(layer, "logit_cap", 0.0))),
        ("cross attention", bool(getattr(layer, "is_cross_attention", False))),
        (f"{getattr(layer.attn_type, 'value', layer.attn_type)} attention",
         getattr(layer.attn_type, "value", "decoder") != "decoder"),
        ("a value head size different from the query's", layer.qk_head_dim != layer.v_head_dim),
    ) if on]
    if unsupported:
        raise NotImplementedError(f"atom's SGLang attention backend has no {', '.join(unsupported)} "
                                  f"(layer {layer.layer_id}); choose another --attention-backend")
    return PagedAttentionImpl(layer.tp_q_head_num, layer.qk_head_dim, layer.scaling, layer.tp_k_head_num,
                              max_num_seqs=max_num_seqs, block_size=page_size)


def _with_positions(md: Any, forward_batch: Any) -> Any:
    """SGLang hands every step its token positions: the fused QK-norm path reads them (no
    derivation by the builder, and under CUDA graphs the graph runner's own static buffer)."""
    return dataclasses.replace(md, positions=forward_batch.positions)


def _run_layer(backend: Any, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, layer: Any,
               save_kv_cache: bool, extra: dict[str, Any]) -> torch.Tensor:
    """One layer's step on atom's impl: ``q [T, heads * D]`` -> ``[T, heads * D]``."""
    unknown = sorted(name for name, value in extra.items() if value is not None)
    if unknown:
        raise NotImplementedError(f"atom's SGLang attention backend does not take {', '.join(unknown)}")
    impl = getattr(layer, "atom_impl", None)
    if impl is None:
        impl = backend.impls.get(layer.layer_id)
        if impl is None:
            impl = backend.impls[layer.layer_id] = impl_for_layer(
                layer, max_num_seqs=backend.max_num_seqs, page_size=backend.page_size)
    heads, dim = layer.tp_q_head_num, layer.qk_head_dim
    query = q.view(-1, heads, dim)
    key = k.view(-1, layer.tp_k_head_num, dim) if k is not None else None
    value = v.view(-1, layer.tp_v_head_num, dim) if v is not None else None
    out = q.new_empty(query.shape)
    key_cache, value_cache = compat.kv_cache_as_nhd(backend.token_to_kv_pool, layer.layer_id, backend.page_size)
    impl.run(query, key, value, key_cache, value_cache, backend.forward_metadata, out, None, None,
             write_cache=bool(save_kv_cache) and key is not None)
    return out.view(-1, heads * dim)


class SGLangBackendMethods:
    """Source of the SGLang backend decorator (``self`` is an ``ATOMSGLangAttnBackend``)."""

    def init_forward_metadata(self, forward_batch: Any) -> None:
        """Every eager step (SGLang's model runner, before the model's forward)."""
        if forward_batch.forward_mode.is_idle():
            self.forward_metadata = None
            return
        if not (forward_batch.forward_mode.is_decode() or forward_batch.forward_mode.is_extend()):
            raise NotImplementedError(f"atom's SGLang backend has no {forward_batch.forward_mode.name} mode")
        batch = compat.attention_batch(forward_batch, self.req_to_token, self.page_size)
        self.forward_metadata = _with_positions(self.build_metadata(batch), forward_batch)

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        """Once, before decode graphs are captured: the buffers every captured graph reads
        (sequence lengths, query offsets, block table), refilled before each replay."""
        rows = max(int(max_bs), int(max_num_tokens))
        cols = -(-self.req_to_token.shape[1] // self.page_size)
        self.graph_seq_lens = torch.ones(rows, dtype=torch.int32, device=self.device)
        self.graph_query_start_loc = torch.arange(rows + 1, dtype=torch.int32, device=self.device)
        self.graph_block_table = torch.zeros(rows, cols, dtype=torch.int32, device=self.device)
        self.graph_metadata = {}

    def init_forward_metadata_out_graph(self, forward_batch: Any, in_capture: bool = False) -> None:
        """Before a decode graph is captured (``in_capture``) or replayed: refill the graph
        buffers from the (padded) batch; at capture, build the metadata the graph keeps (its
        ``max_seq_len`` at the model's limit, so the decode split count fits every replay)."""
        if not forward_batch.forward_mode.is_decode_or_idle():
            raise NotImplementedError(f"atom's SGLang backend captures decode graphs only, not "
                                      f"{forward_batch.forward_mode.name}")
        bs = int(forward_batch.batch_size)
        self.graph_seq_lens[:bs].copy_(forward_batch.seq_lens[:bs])
        seq_lens_cpu = forward_batch.seq_lens_cpu
        longest = int(seq_lens_cpu[:bs].max()) if seq_lens_cpu is not None else self.req_to_token.shape[1]
        compat.block_table(self.req_to_token, forward_batch.req_pool_indices[:bs], longest, self.page_size,
                           out=self.graph_block_table)
        if in_capture or bs not in self.graph_metadata:
            from atom.models.attention.common import AttentionBatch

            batch = AttentionBatch(
                num_actual_tokens=bs, num_reqs=bs, max_query_len=1, max_seq_len=1,
                query_start_loc=self.graph_query_start_loc[: bs + 1],
                query_start_loc_cpu=torch.arange(bs + 1, dtype=torch.int32),
                seq_lens=self.graph_seq_lens[:bs], seq_lens_cpu=None,
                block_table=self.graph_block_table[:bs], slot_mapping=forward_batch.out_cache_loc[:bs])
            self.graph_metadata[bs] = _with_positions(self.build_metadata(batch, for_capture=True), forward_batch)
        self.forward_metadata = self.graph_metadata[bs]

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        """Padded graph rows attend to one token (slot 0 of request 0: SGLang's padding slot)."""
        return 1

    def forward_extend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: Any,
                       forward_batch: Any, save_kv_cache: bool = True, **kwargs: Any) -> torch.Tensor:
        """Prefill, extend (prefix-cache hits, chunked prefill) and mixed rows of one layer."""
        return _run_layer(self, q, k, v, layer, save_kv_cache, kwargs)

    def forward_decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: Any,
                       forward_batch: Any, save_kv_cache: bool = True, **kwargs: Any) -> torch.Tensor:
        """Single-token decode rows of one layer (the same kernel call as extend)."""
        return _run_layer(self, q, k, v, layer, save_kv_cache, kwargs)
