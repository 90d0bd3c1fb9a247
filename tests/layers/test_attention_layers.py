"""atom's host-neutral attention layers on their own, with no host framework: the metadata
builders from an :class:`AttentionBatch`, the MHA and MLA impls on plain tensors against dense
attention written out here, and the MLA prefill math (chunked context, LSE merge) against its
dense reference. (tests/toolkit/test_import_purity.py checks that these modules import no vLLM;
tests/attention/ runs them bound to vLLM.)"""

from __future__ import annotations

import math

import pytest
import torch

from atom.models.attention.common import AttentionBatch, split_decodes
from atom.models.attention.mha import PagedAttentionImpl, PagedAttentionMetadataBuilder
from atom.models.attention.mla import MLAMetadataBuilder, MLAttentionImpl, mla_geometry_reasons
from atom.ops.mla_prefill import merge_attn_states_, mla_prefill, mla_prefill_reference

BLOCK = 16


def _batch(ctx_new: list[tuple[int, int]], blocks_per_row: int, slots) -> AttentionBatch:
    """A step whose rows have ``(cached context, new tokens)``, block tables of consecutive
    blocks per row (row r owns blocks r*blocks_per_row ...)."""
    q_lens = [n for _, n in ctx_new]
    seq = torch.tensor([c + n for c, n in ctx_new], dtype=torch.int32)
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    table = torch.arange(len(ctx_new) * blocks_per_row, dtype=torch.int32).view(len(ctx_new), blocks_per_row)
    return AttentionBatch(num_actual_tokens=int(qsl[-1]), num_reqs=len(ctx_new), max_query_len=max(q_lens),
                          max_seq_len=int(seq.max()), query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=seq,
                          seq_lens_cpu=seq, block_table=table, slot_mapping=slots)


def _slots(table: torch.Tensor, row: int, positions) -> torch.Tensor:
    return torch.tensor([int(table[row, p // BLOCK]) * BLOCK + p % BLOCK for p in positions])


def test_split_decodes_from_host_tensors():
    b = _batch([(9, 1), (3, 1), (12, 4), (0, 6)], 2, torch.arange(12))
    assert split_decodes(b) == (2, 2, 2, 10)
    only = _batch([(9, 1), (3, 1)], 2, torch.arange(2))
    assert split_decodes(only) == (2, 0, 2, 0)
    none = _batch([(0, 5), (3, 1)], 2, torch.arange(6))
    assert split_decodes(none) == (0, 2, 0, 6)  # a prefill first: no decode rows


def _dense(q, k, v, q_len, scale, window=None, sinks=None):
    """Causal attention of the last ``q_len`` positions over all of ``k`` (GQA by repetition)."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    out = torch.empty_like(q)
    for i in range(q_len):
        p = k.shape[0] - q_len + i
        lo = max(0, p - window + 1) if window else 0
        s = torch.einsum("hd,khd->hk", q[i], k[lo:p + 1]) * scale
        if sinks is not None:
            s = torch.cat([s, sinks[:, None]], 1)
        out[i] = torch.einsum("hk,khd->hd", torch.softmax(s, -1)[:, : p + 1 - lo], v[lo:p + 1])
    return out


@pytest.mark.parametrize("window,sinks", [(None, False), (5, True)])
def test_paged_attention_layer_matches_dense(window, sinks):
    torch.manual_seed(0)
    heads, kv_heads, dim = 4, 2, 32
    rows = [(0, 6), (20, 1), (17, 9)]  # a prefill, a decode, a chunk after cached context
    builder = PagedAttentionMetadataBuilder(max_model_len=64, max_num_batched_tokens=64, with_positions=True,
                                            device=torch.device("cpu"))
    table = torch.arange(3 * 4, dtype=torch.int32).view(3, 4)
    slots = torch.cat([_slots(table, r, range(c, c + n)) for r, (c, n) in enumerate(rows)])
    md = builder.build_metadata(_batch(rows, 4, slots))
    # positions derived for the fused path: each token's place in its request
    assert md.positions.tolist() == [p for c, n in rows for p in range(c, c + n)]
    sink_logits = torch.randn(heads) if sinks else None
    impl = PagedAttentionImpl(heads, dim, dim ** -0.5, kv_heads, window, sinks=sink_logits)
    impl.prepare_weights(torch.float32)
    key_cache = torch.full((12, BLOCK, kv_heads, dim), float("nan"))
    value_cache = torch.full_like(key_cache, float("nan"))
    ks = [torch.randn(c + n, kv_heads, dim) for c, n in rows]
    vs = [torch.randn(c + n, kv_heads, dim) for c, n in rows]
    for r, (c, _) in enumerate(rows):  # earlier steps' tokens
        if c:
            impl.write_cache(ks[r][:c], vs[r][:c], key_cache, value_cache, _slots(table, r, range(c)), None, None)
    q = torch.randn(md.num_actual_tokens, heads, dim)
    new_k = torch.cat([k[c:] for k, (c, _) in zip(ks, rows)])
    new_v = torch.cat([v[c:] for v, (c, _) in zip(vs, rows)])
    out = torch.full_like(q, float("nan"))
    impl.run(q, new_k, new_v, key_cache, value_cache, md, out, None, None, write_cache=True)
    start = 0
    for r, (c, n) in enumerate(rows):
        torch.testing.assert_close(out[start:start + n], _dense(q[start:start + n], ks[r], vs[r], n, impl.scale,
                                                               window, sink_logits), atol=1e-5, rtol=1e-5)
        start += n
    # write_cache=False: the host wrote the step's keys; the layer only attends
    again = torch.full_like(q, float("nan"))
    impl.run(q, new_k * 0, new_v * 0, key_cache, value_cache, md, again, None, None, write_cache=False)
    torch.testing.assert_close(again, out, atol=0, rtol=0)


HEADS, RANK, ROPE, NOPE, VDIM = 4, 64, 64, 32, 48


def _mla_impl(chunk_tokens: int):
    weight = torch.randn(HEADS * (NOPE + VDIM), RANK) / math.sqrt(RANK)
    impl = MLAttentionImpl(HEADS, 1 / math.sqrt(NOPE + ROPE), RANK, NOPE, ROPE, VDIM, lambda x: x @ weight.t(),
                           context_chunk_tokens=chunk_tokens, max_step_tokens=64)
    w = weight.t().reshape(RANK, HEADS, NOPE + VDIM)
    impl.absorb(w[..., :NOPE], w[..., NOPE:], torch.float32)
    return impl


@pytest.mark.parametrize("chunk_tokens", [16, 4096])
def test_mla_layer_matches_dense_mla(chunk_tokens):
    """Decodes (absorbed, latent space), an extend walking its context in chunks, a prefill:
    all equal to dense MLA straight from the weights."""
    torch.manual_seed(1)
    impl = _mla_impl(chunk_tokens)
    rows = [(9, 1), (20, 1), (40, 5), (0, 7)]  # decodes first, as hosts order them
    blocks = 4
    table = torch.arange(len(rows) * blocks, dtype=torch.int32).view(len(rows), blocks)
    cache = torch.full((len(rows) * blocks, BLOCK, RANK + ROPE), float("nan"))
    latents = [torch.randn(c + n, RANK + ROPE) for c, n in rows]
    for r, (c, n) in enumerate(rows):  # context and this step's tokens, written through the layer
        impl.write_latent(latents[r][:, :RANK], latents[r][:, None, RANK:], cache, _slots(table, r, range(c + n)))
    slots = torch.cat([_slots(table, r, range(c, c + n)) for r, (c, n) in enumerate(rows)])
    md = MLAMetadataBuilder(max_model_len=128).build_metadata(_batch(rows, blocks, slots))
    assert (md.num_decodes, md.num_extends, md.num_prefills, md.max_context_len) == (2, 1, 1, 40)
    q = torch.randn(md.num_actual_tokens, HEADS, NOPE + ROPE)
    out = impl.run(q, cache, md, torch.full((md.num_actual_tokens, HEADS * VDIM), float("nan")))
    want = mla_prefill_reference(q, latents, [n for _, n in rows], impl.up_proj, rank=RANK, rope=ROPE,
                                 nope=NOPE, vdim=VDIM, scale=impl.scale)
    torch.testing.assert_close(out, want, atol=2e-4, rtol=2e-4)


def test_mla_prefill_chunks_merge_to_the_dense_result():
    """mla_prefill with 1..many context chunks per row equals its dense reference; rows whose
    context ends before a chunk read nothing."""
    torch.manual_seed(2)
    impl = _mla_impl(4096)
    rows = [(0, 3), (5, 2), (70, 4)]
    table = torch.arange(len(rows) * 6, dtype=torch.int32).view(len(rows), 6)
    cache = torch.randn(len(rows) * 6, BLOCK, RANK + ROPE)
    latents = [cache[table[r, :(c + n + BLOCK - 1) // BLOCK].long()].reshape(-1, RANK + ROPE)[: c + n]
               for r, (c, n) in enumerate(rows)]
    slots = torch.cat([_slots(table, r, range(c, c + n)) for r, (c, n) in enumerate(rows)])
    qsl = torch.tensor([0, 3, 5, 9], dtype=torch.int32)
    q = torch.randn(9, HEADS, NOPE + ROPE)
    want = mla_prefill_reference(q, latents, [n for _, n in rows], impl.up_proj, rank=RANK, rope=ROPE,
                                 nope=NOPE, vdim=VDIM, scale=impl.scale)
    for chunk in (3, 16, 48, 4096):
        out = mla_prefill(q, cache, slots, qsl, torch.tensor([c + n for c, n in rows]), table, 4, 70,
                          impl.up_proj, rank=RANK, rope=ROPE, nope=NOPE, vdim=VDIM, scale=impl.scale,
                          chunk_tokens=chunk, output=torch.empty(9, HEADS * VDIM))
        torch.testing.assert_close(out, want, atol=2e-4, rtol=2e-4, msg=lambda m: f"chunk {chunk}: {m}")


def test_merge_of_two_halves_is_attention_over_both():
    torch.manual_seed(3)
    q, k, v = torch.randn(5, 2, 8), torch.randn(12, 2, 8), torch.randn(12, 2, 8)

    def attend(keys, values):
        s = torch.einsum("qhd,khd->qhk", q, keys)
        return torch.einsum("qhk,khd->qhd", torch.softmax(s, -1), values), torch.logsumexp(s, -1)

    full, _ = attend(k, v)
    acc, acc_lse = attend(k[:7], v[:7])
    part, part_lse = attend(k[7:], v[7:])
    merge_attn_states_(acc, acc_lse, part, part_lse)
    torch.testing.assert_close(acc, full, atol=1e-6, rtol=1e-6)
    empty_lse = torch.full_like(part_lse, float("-inf"))  # a chunk with no keys changes nothing
    before = acc.clone()
    merge_attn_states_(acc, acc_lse, torch.zeros_like(part), empty_lse)
    torch.testing.assert_close(acc, before, atol=0, rtol=0)


def test_layers_refuse_what_their_kernels_do_not_serve():
    assert mla_geometry_reasons(512, 64) == []
    assert mla_geometry_reasons(520, 32) == ["qk_rope_head_dim 32 (atom's MLA needs 64)",
                                             "kv_lora_rank 520 (atom's MLA takes multiples of 16 up to 512)"]
    with pytest.raises(NotImplementedError, match="fp8_e5m2"):
        PagedAttentionImpl(4, 32, 0.1, 2, kv_cache_dtype="fp8_e5m2")
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        PagedAttentionImpl(4, 32, 0.1, 3)
    with pytest.raises(NotImplementedError, match="fp8 latent cache"):
        MLAttentionImpl(4, 0.1, 64, 32, 64, 32, lambda x: x, kv_cache_dtype="fp8")
