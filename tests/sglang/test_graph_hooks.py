"""atom's SGLang backend through its CUDA-graph hooks, on CPU, against its eager path and a plain
torch reference: SGLang's own request and KV pools (real classes, page size 16) hold scattered
pages of random history; a decode batch runs eagerly; then the graph path as SGLang's decode
graph runner drives it -- ``init_cuda_graph_state``, a padded capture batch
(``init_forward_metadata_out_graph(..., in_capture=True)``, padding rows on request 0 with the
fill value), and a "replay": new requests and longer sequences copied into the capture's static
tensors, ``init_forward_metadata_out_graph`` refilling the graph buffers, and the layer run on the
metadata kept from capture (what the captured kernels read). No CUDA here: this checks what the
graph reads, not the capture itself (the GPU bench does).

The model runner handed to the backend is a namespace with the attributes the backend reads
(device, page size, the two pools, the context length); the engine tests build it from SGLang's
real model runner.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

PAGE, HEADS, KV_HEADS, DIM, CTX, PAGES = 16, 4, 2, 32, 128, 40


@pytest.fixture()
def setup():
    import torch
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool

    from atom.patches import REGISTRY, apply
    from atom.plugin import catalog
    from atom.plugin.sglang.attention_mha import ATOMSGLangAttnBackend

    catalog.load()
    apply(REGISTRY.get("sglang.attention.mha_backend"), enabled=True)
    torch.manual_seed(0)
    req = ReqToTokenPool(size=4, max_context_len=CTX, device="cpu", enable_memory_saver=False)
    kv = MHATokenToKVPool(size=PAGES * PAGE, page_size=PAGE, dtype=torch.float32, head_num=KV_HEADS, head_dim=DIM,
                          layer_num=1, device="cpu", enable_memory_saver=False)
    # requests 1..3 own scattered pages (page 0 is the padding page); random history everywhere
    pages = torch.randperm(PAGES - 1)[: 3 * (CTX // PAGE)].add(1).view(3, -1)
    for r in range(3):
        slots = (pages[r].repeat_interleave(PAGE) * PAGE + torch.arange(PAGE).repeat(CTX // PAGE))
        req.req_to_token[r + 1] = slots.to(torch.int32)
    kv.k_buffer[0].copy_(torch.randn_like(kv.k_buffer[0]))
    kv.v_buffer[0].copy_(torch.randn_like(kv.v_buffer[0]))
    runner = SimpleNamespace(device="cpu", page_size=PAGE, req_to_token_pool=req, token_to_kv_pool=kv,
                             model_config=SimpleNamespace(context_len=CTX))
    layer = RadixAttention(HEADS, DIM, DIM ** -0.5, KV_HEADS, layer_id=0)
    return runner, layer, lambda: ATOMSGLangAttnBackend(runner)


def _batch(runner, reqs, seq_lens, tensors=None):
    """A decode ForwardBatch (SGLang's class); ``tensors``: static tensors to copy into (replay)."""
    import torch
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

    reqs_t, lens_t = torch.tensor(reqs), torch.tensor(seq_lens)
    loc = runner.req_to_token_pool.req_to_token[reqs_t, lens_t - 1].long()
    fields = dict(req_pool_indices=reqs_t, seq_lens=lens_t, out_cache_loc=loc, positions=lens_t - 1)
    if tensors is not None:
        for name, value in fields.items():
            tensors[name].copy_(value)
        fields = tensors
    return ForwardBatch(forward_mode=ForwardMode.DECODE, batch_size=len(reqs), input_ids=torch.zeros(len(reqs)),
                        seq_lens_sum=int(sum(seq_lens)), seq_lens_cpu=torch.tensor(seq_lens), **fields)


def _reference(runner, q, k, v, reqs, seq_lens):
    """Plain torch: the new token's k/v at its slot, softmax over each request's cached tokens."""
    import torch

    kb, vb = runner.token_to_kv_pool.k_buffer[0].clone(), runner.token_to_kv_pool.v_buffer[0].clone()
    out = []
    for i, (r, n) in enumerate(zip(reqs, seq_lens)):
        slots = runner.req_to_token_pool.req_to_token[r, :n].long()
        kb[slots[-1]], vb[slots[-1]] = k[i].view(KV_HEADS, DIM), v[i].view(KV_HEADS, DIM)
        keys = kb[slots].repeat_interleave(HEADS // KV_HEADS, 1)  # [n, heads, D]
        vals = vb[slots].repeat_interleave(HEADS // KV_HEADS, 1)
        w = torch.einsum("hd,nhd->hn", q[i].view(HEADS, DIM), keys) * DIM ** -0.5
        out.append(torch.einsum("hn,nhd->hd", w.softmax(-1), vals).reshape(-1))
    return torch.stack(out)


def _qkv(n):
    import torch

    return torch.randn(n, HEADS * DIM), torch.randn(n, KV_HEADS * DIM), torch.randn(n, KV_HEADS * DIM)


def test_eager_decode_matches_reference(setup):
    import torch

    runner, layer, make = setup
    reqs, lens = [1, 2, 3], [20, 33, 7]
    q, k, v = _qkv(3)
    expected = _reference(runner, q, k, v, reqs, lens)
    backend = make()
    fb = _batch(runner, reqs, lens)
    backend.init_forward_metadata(fb)
    torch.testing.assert_close(backend.forward_decode(q, k, v, layer, fb), expected, atol=1e-5, rtol=1e-5)


def test_graph_hooks_capture_then_replay_a_longer_batch(setup):
    import torch

    runner, layer, make = setup
    backend = make()
    backend.init_cuda_graph_state(4, 4)
    assert backend.get_cuda_graph_seq_len_fill_value() == 1

    # capture: 3 requests padded to 4 (request 0, one token)
    reqs, lens = [1, 2, 3, 0], [20, 33, 7, 1]
    q, k, v = _qkv(4)
    expected = _reference(runner, q[:3], k[:3], v[:3], reqs[:3], lens[:3])
    static = {name: t.clone() for name, t in vars(_batch(runner, reqs, lens)).items()
              if name in ("req_pool_indices", "seq_lens", "out_cache_loc", "positions")}
    captured = _batch(runner, reqs, lens, tensors=static)
    backend.init_forward_metadata_out_graph(captured, in_capture=True)
    graph_md = backend.forward_metadata
    assert graph_md.max_seq_len == CTX  # the split count fixed for every replay
    assert graph_md.slot_mapping.data_ptr() == static["out_cache_loc"].data_ptr()
    torch.testing.assert_close(backend.forward_decode(q, k, v, layer, captured)[:3], expected, atol=1e-5, rtol=1e-5)

    # replay: other requests, longer sequences (more block-table columns than at capture)
    reqs, lens = [3, 1, 2, 0], [70, 21, 100, 1]
    q, k, v = _qkv(4)
    expected = _reference(runner, q[:3], k[:3], v[:3], reqs[:3], lens[:3])
    replay = _batch(runner, reqs, lens, tensors=static)
    backend.init_forward_metadata_out_graph(replay)
    assert backend.forward_metadata is graph_md  # the captured graph's own metadata
    torch.testing.assert_close(backend.forward_decode(q, k, v, layer, replay)[:3], expected, atol=1e-5, rtol=1e-5)

    # the same batch eagerly, on a fresh backend: the same numbers
    eager = make()
    fb = _batch(runner, reqs, lens)
    eager.init_forward_metadata(fb)
    torch.testing.assert_close(eager.forward_decode(q, k, v, layer, fb)[:3], expected, atol=1e-5, rtol=1e-5)
