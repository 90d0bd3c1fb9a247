"""Every version fact about SGLang in one place: the supported range and the translation of
SGLang's per-step ``ForwardBatch`` into atom's host-neutral
:class:`~atom.models.attention.common.AttentionBatch`. Importing this module imports neither
SGLang nor torch.

SGLang owns token-indexed KV pools: per layer ``[tokens + page, kv_heads, head_dim]``, slot ``s``
of a request's token ``i`` being ``req_to_token[req, i]``. With a page size ``P`` its paged
allocator keeps the ``P`` tokens of a page in the slots ``page * P .. page * P + P - 1``, so the
pool viewed as ``[pages, P, kv_heads, head_dim]`` is atom's NHD cache, a request's block table
is ``req_to_token[req, ::P] // P`` and the slot mapping is ``out_cache_loc``.
"""

from __future__ import annotations

from typing import Any

#: The SGLang releases atom is written and tested for: 0.5.17 is the last one pinned to torch
#: 2.11 (the GPU machine's); the attention backends' CUDA-graph hooks changed in 0.5.11-0.5.16
#: and again in 0.5.23, so the range is one release until another is tested.
SUPPORTED_SGLANG = ">=0.5.17,<0.5.18"

#: atom's attention backend name in SGLang (``--attention-backend atom``); a new name, never
#: one of SGLang's own.
BACKEND_NAME = "atom"


def attention_batch(forward_batch: Any, req_to_token: Any, page_size: int) -> Any:
    """atom's view of one eager step (extend, mixed or decode): host ints and host tensors from
    SGLang's ``*_cpu`` fields, device tensors SGLang's own or derived on the device (the block
    table: one gather of every ``page_size``-th slot of each request's ``req_to_token`` row)."""
    import torch

    from atom.models.attention.common import AttentionBatch

    bs = int(forward_batch.batch_size)
    if forward_batch.forward_mode.is_decode_or_idle():
        q_lens = torch.ones(bs, dtype=torch.int32)
    else:
        q_lens = torch.as_tensor(forward_batch.extend_seq_lens_cpu, dtype=torch.int32)
    qsl_cpu = torch.zeros(bs + 1, dtype=torch.int32)
    torch.cumsum(q_lens, 0, out=qsl_cpu[1:])
    seq_lens_cpu = forward_batch.seq_lens_cpu
    if seq_lens_cpu is None:
        seq_lens_cpu = forward_batch.seq_lens.cpu()
    max_seq_len = int(seq_lens_cpu.max()) if bs else 0
    device = forward_batch.seq_lens.device
    return AttentionBatch(
        num_actual_tokens=int(qsl_cpu[-1]),
        num_reqs=bs,
        max_query_len=int(q_lens.max()) if bs else 0,
        max_seq_len=max_seq_len,
        query_start_loc=qsl_cpu.to(device, non_blocking=True),
        query_start_loc_cpu=qsl_cpu,
        seq_lens=forward_batch.seq_lens.to(torch.int32),
        seq_lens_cpu=seq_lens_cpu.to(torch.int32),
        block_table=block_table(req_to_token, forward_batch.req_pool_indices, max_seq_len, page_size),
        slot_mapping=forward_batch.out_cache_loc,
    )


def block_table(req_to_token: Any, req_pool_indices: Any, max_seq_len: int, page_size: int,
                out: Any = None) -> Any:
    """``[reqs, ceil(max_seq_len / page_size)]`` int32 page ids of the requests' tokens (into
    ``out[:, :cols]`` when given, for the CUDA-graph buffers)."""
    import torch

    cols = -(-int(max_seq_len) // page_size)
    pages = torch.div(req_to_token[req_pool_indices, : cols * page_size : page_size], page_size,
                      rounding_mode="floor")
    if out is None:
        return pages.to(torch.int32)
    out[: pages.shape[0], :cols].copy_(pages)
    return out


def kv_cache_as_nhd(pool: Any, layer_id: int, page_size: int) -> tuple[Any, Any]:
    """Layer ``layer_id``'s key and value buffers of SGLang's MHA pool as atom's NHD caches
    ``[pages, page_size, kv_heads, head_dim]`` (views, no copies)."""
    key, value = pool.get_key_buffer(layer_id), pool.get_value_buffer(layer_id)
    return (key.view(-1, page_size, *key.shape[1:]), value.view(-1, page_size, *value.shape[1:]))
