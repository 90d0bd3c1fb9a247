"""MLA prefill and extend over a latent cache, with a bounded workspace, and its torch reference.

Rows with new tokens (prefill, or extend over cached context) are served the way vLLM's own MLA
backends serve them: latents are up-projected to per-head keys and values through the layer's
``kv_b_proj`` and attended with :func:`atom.ops.paged_attention` (which returns float32
log-sum-exps):

1. the new tokens attend to themselves (causal); their latents are read back from the cache;
2. the cached context is walked in chunks of at most ``chunk_tokens`` latents in all (``c =
   chunk_tokens // rows`` per row, a multiple of 16 when it can be), each attended non-causally;
3. the partial outputs are merged exactly by their log-sum-exps (:func:`merge_attn_states_`).

Every size is a host int; a row whose context ends before a chunk reads nothing (output 0, LSE
-inf). What one call holds at once is bounded by :func:`mla_prefill_workspace_bytes`.
:func:`mla_prefill_reference` computes the same output densely, without chunks (tests).
This module imports only torch.
"""

from __future__ import annotations

from typing import Callable

import torch

#: ``up_proj(latent [N, kv_lora_rank]) -> [N, heads * (nope + v)]``: the layer's ``kv_b_proj``.
UpProj = Callable[[torch.Tensor], torch.Tensor]


def merge_attn_states_(acc: torch.Tensor, acc_lse: torch.Tensor, part: torch.Tensor,
                       part_lse: torch.Tensor) -> None:
    """``acc, acc_lse <- merge(acc, acc_lse; part, part_lse)`` in place: two attentions of the
    same queries over disjoint key sets, weighted by their log-sum-exps (exact). ``acc_lse``
    must be finite (e.g. the new tokens see themselves); a ``part`` row without keys has LSE
    -inf and contributes 0. ``acc`` float32 ``[T, H, D]``, LSEs float32 ``[T, H]``."""
    total = torch.logaddexp(acc_lse, part_lse)
    acc.mul_(torch.exp(acc_lse - total).unsqueeze(-1))
    acc.addcmul_(part, torch.exp(part_lse - total).unsqueeze(-1))  # part read in its own dtype
    acc_lse.copy_(total)


def up_project(latent: torch.Tensor, up_proj: UpProj, heads: int, rank: int, rope: int, nope: int,
               vdim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head keys and values of latent rows ``[N, rank + rope]``: one buffer ``[N, H, nope +
    rope + v]`` holding ``[k_nope | k_pe | v]``; returns two ``[N, H, width]`` views of it
    (``width = max(nope + rope, v)``): keys = its first ``width`` columns (columns past ``nope +
    rope`` meet zero-padded queries), values = its last ``width`` columns (the attention
    output's last ``v`` columns are the real ones)."""
    n = latent.shape[0]
    kv = up_proj(latent[:, :rank].to(dtype)).view(n, heads, nope + vdim)
    buf = kv.new_empty(n, heads, nope + rope + vdim)
    buf[..., :nope] = kv[..., :nope]
    buf[..., nope + rope:] = kv[..., nope:]
    del kv
    buf[..., nope:nope + rope] = latent[:, None, rank:].to(dtype)
    width = max(nope + rope, vdim)
    return buf[..., :width], buf[..., nope + rope + vdim - width:]


def mla_prefill(
    q: torch.Tensor,
    cache: torch.Tensor,
    new_slots: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    max_query_len: int,
    max_context_len: int,
    up_proj: UpProj,
    *,
    rank: int,
    rope: int,
    nope: int,
    vdim: int,
    scale: float,
    chunk_tokens: int,
    output: torch.Tensor,
) -> torch.Tensor:
    """Attention of the prefill/extend rows of one step.

    ``q [T, H, nope + rope]`` (rope part rotated); ``cache [blocks, block_size, rank + rope]``
    (any strides) already holding the new tokens at ``new_slots [T]``; ``query_start_loc [R+1]``
    rebased to these rows' first token; ``seq_lens [R]`` and ``block_table [R, max_blocks]`` of
    these rows; ``max_context_len`` a host upper bound of ``seq_len - query_len`` (0: no extend
    row); ``output [T, H * v]`` written in place and returned."""
    from atom.ops import paged_attention

    heads = q.shape[1]
    num_rows = block_table.shape[0]
    block_size = cache.shape[1]
    tokens = q.shape[0]
    dev = q.device
    width = max(nope + rope, vdim)
    if width > q.shape[-1]:  # zero columns leave the scores unchanged
        q = torch.nn.functional.pad(q, (0, width - q.shape[-1]))
    q = q.contiguous()
    qsl = query_start_loc
    q_lens = qsl[1:] - qsl[:-1]

    def keys_values(latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return up_project(latent, up_proj, heads, rank, rope, nope, vdim, q.dtype)

    # 1. new tokens over themselves, causal (their keys are one-token pages, row r's at qsl[r] + j)
    slots = new_slots.long()
    key, value = keys_values(cache[slots // block_size, slots % block_size])
    table = (qsl[:-1, None] + torch.arange(max_query_len, device=dev, dtype=qsl.dtype)).clamp(max=tokens - 1)
    part = torch.empty_like(q)
    lse = torch.empty(tokens, heads, dtype=torch.float32, device=dev)
    paged_attention(q, key.unsqueeze(1), value.unsqueeze(1), table, q_lens, qsl,
                    max_query_len, max_query_len, scale, causal=True, out=part, lse=lse)
    del key, value
    acc = part[..., width - vdim:].to(torch.float32, copy=True)  # never a view of part
    acc_lse = lse.clone()

    # 2. cached context in chunks of c tokens per row
    if max_context_len > 0:
        ctx_lens = seq_lens - q_lens
        per_row = max(chunk_tokens // max(num_rows, 1), 1)
        per_row = per_row // 16 * 16 if per_row >= 16 else per_row
        per_row = min(per_row, -(-max_context_len // 16) * 16)
        page = 16 if per_row % 16 == 0 else per_row
        last = block_table.shape[1] * block_size - 1
        offsets = torch.arange(per_row, device=dev)
        chunk_table = torch.arange(num_rows * per_row // page, dtype=torch.int32,
                                   device=dev).view(num_rows, per_row // page)
        for start in range(0, max_context_len, per_row):
            pos = (start + offsets).clamp(max=last)  # [c]
            # unused block-table entries may hold anything; clamp keeps the gather in bounds
            blocks = block_table[:, pos // block_size].clamp(min=0).long()  # [R, c]
            latent = cache[blocks, (pos % block_size).expand_as(blocks)].view(-1, cache.shape[-1])
            key, value = keys_values(latent)
            del latent, blocks
            shape = (num_rows * per_row // page, page, heads, width)
            kv_lens = (ctx_lens - start).clamp(min=0, max=per_row).to(torch.int32)
            paged_attention(q, key.view(shape), value.view(shape), chunk_table, kv_lens, qsl,
                            max_query_len, per_row, scale, causal=False, out=part, lse=lse)
            del key, value
            merge_attn_states_(acc, acc_lse, part[..., width - vdim:], lse)

    # 3. the merged output
    output.view(-1, heads, vdim).copy_(acc)
    return output


def mla_prefill_reference(q: torch.Tensor, latents: list[torch.Tensor], query_lens: list[int],
                          up_proj: UpProj, *, rank: int, rope: int, nope: int, vdim: int,
                          scale: float) -> torch.Tensor:
    """Dense MLA for the same rows, in float32, no chunks and no cache: row r's ``latents[r]``
    ``[seq_len_r, rank + rope]`` hold its context then its ``query_lens[r]`` new tokens; its
    queries are the matching rows of ``q``. Returns ``[T, H * v]``."""
    heads = q.shape[1]
    out, start = [], 0
    for latent, n in zip(latents, query_lens):
        kv = up_proj(latent[:, :rank].to(q.dtype)).float().view(-1, heads, nope + vdim)
        k_nope, v = kv.split([nope, vdim], dim=-1)
        k = torch.cat([k_nope, latent[:, None, rank:].float().expand(-1, heads, rope)], dim=-1)
        qr = q[start:start + n, :, : nope + rope].float()
        s = torch.einsum("qhd,khd->hqk", qr, k) * scale
        context = latent.shape[0] - n
        mask = torch.arange(latent.shape[0], device=q.device)[None, :] > \
            (context + torch.arange(n, device=q.device))[:, None]
        s = s.masked_fill(mask, float("-inf"))
        out.append(torch.einsum("hqk,khd->qhd", torch.softmax(s, dim=-1), v).reshape(n, heads * vdim))
        start += n
    return torch.cat(out)


def mla_prefill_workspace_bytes(chunk_tokens: int, max_tokens: int, heads: int, rank: int,
                                rope: int, nope: int, vdim: int, dtype: torch.dtype) -> int:
    """Upper bound of what :func:`mla_prefill` holds at once for a step of at most ``max_tokens``
    prefill/extend tokens: the up-projection of ``max(chunk_tokens, max_tokens)`` latent rows
    (gathered latents, ``kv_b_proj``'s input and output, the ``[N, H, nope + rope + v]``
    key/value buffer, int64 gather indices) plus the query-side tensors (padded queries, one
    partial output, the float32 running output, and per head the float32 LSEs and merge
    weights).

    DeepSeek-V3 (128 heads, bf16), 16k-token chunks, 8192 tokens per step: 2.45 GB + 1.37 GB."""
    elt = torch.empty((), dtype=dtype).element_size()
    width = max(nope + rope, vdim)
    rows = max(chunk_tokens, max_tokens)
    per_row = (rank + rope) * elt + rank * elt + heads * (nope + vdim) * elt \
        + heads * (nope + rope + vdim) * elt + 4 * 8
    per_query = heads * (2 * width * elt + vdim * 4 + 6 * 4)
    return rows * per_row + max_tokens * per_query
