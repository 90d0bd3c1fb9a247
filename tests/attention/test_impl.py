"""``ATOMAttentionImpl`` called the way vLLM's layer calls it (``do_kv_cache_update`` then
``forward``) on a KV cache laid out the way vLLM allocates it, against a dense attention written
out in the test: GQA, sliding window, sinks, mixed prefill / chunked prefill / decode rows."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from atom.models.attention.mha import PagedAttentionMetadata
from atom.plugin.vllm.attention_mha import ATOMAttentionBackend, ATOMAttentionImpl
from atom.plugin.vllm import compat

NUM_HEADS, NUM_KV_HEADS, HEAD = 4, 2, 32
BLOCK, NUM_BLOCKS = 16, 12
LAYER = SimpleNamespace()  # the impl reads nothing from the layer without an fp8 cache
# vLLM's layer holds per-tensor float32 scales (_k_scale / _v_scale buffers of shape ())
FP8_LAYER = SimpleNamespace(_k_scale=torch.tensor(0.011), _v_scale=torch.tensor(0.007))


def _fp8_round_trip(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """What an fp8 cache holds, dequantised (the reference attends over these values)."""
    return (x / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale


def _vllm_cache(layout_name: str, kv_dtype: str = "auto") -> torch.Tensor:
    """vLLM >= 0.29: a logical [B, H, N, 2D] view whose physical order is the layout's."""
    from vllm.v1.kv_cache_layout import KVCacheLayout

    order = KVCacheLayout[layout_name].layer_view_order  # physical order of the [B, H, N, C] axes
    logical = (NUM_BLOCKS, NUM_KV_HEADS, BLOCK, 2 * HEAD)
    if kv_dtype == "fp8":  # vLLM allocates fp8 caches as uint8 (0x7f = nan in e4m3)
        physical = torch.full([logical[i] for i in order], 0x7F, dtype=torch.uint8)
    else:
        physical = torch.full([logical[i] for i in order], float("nan"))
    inverse = [order.index(i) for i in range(4)]
    view = physical.permute(*inverse)
    assert view.shape == logical
    return view


def _dense(q, k, v, q_len, scale, window, sinks):
    """Plain attention of the last q_len positions over all len(k) positions."""
    seq_len = k.shape[0]
    group = NUM_HEADS // NUM_KV_HEADS
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    out = torch.empty_like(q)
    for i in range(q_len):
        p = seq_len - q_len + i
        lo = max(0, p - window + 1) if window else 0
        s = torch.einsum("hd,khd->hk", q[i], k[lo:p + 1]) * scale
        if sinks is not None:
            s = torch.cat([s, sinks[:, None]], 1)
        w = torch.softmax(s, -1)[:, : p + 1 - lo]
        out[i] = torch.einsum("hk,khd->hd", w, v[lo:p + 1])
    return out


def write_context(impl, layer, kv_cache, shapes, block_table):
    """Random keys / values for ``shapes`` ((cached context, new tokens) per request), the cached
    context written through the hook vLLM calls (earlier steps): (full keys, full values per
    request, the new tokens' keys, values and slots, packed)."""
    full_k = [torch.randn(c + n, NUM_KV_HEADS, HEAD) for c, n in shapes]
    full_v = [torch.randn(c + n, NUM_KV_HEADS, HEAD) for c, n in shapes]

    def slots(s, positions):
        return torch.tensor([int(block_table[s, p // BLOCK]) * BLOCK + p % BLOCK for p in positions])

    for s, (c, _) in enumerate(shapes):
        if c:
            impl.do_kv_cache_update(layer, full_k[s][:c], full_v[s][:c], kv_cache, slots(s, range(c)))
    new_k = torch.cat([full_k[s][c:] for s, (c, _) in enumerate(shapes)])
    new_v = torch.cat([full_v[s][c:] for s, (c, _) in enumerate(shapes)])
    slot_mapping = torch.cat([slots(s, range(c, c + n)) for s, (c, n) in enumerate(shapes)])
    return full_k, full_v, new_k, new_v, slot_mapping


_CASES = [
    pytest.param(layout, window, sinks, "auto", "auto", id=f"{layout}-w{window}-sinks{int(sinks)}")
    for layout in ("LBNHC", "LBHNC", "BLNHC")
    for window, sinks in ((None, False), (7, False), (None, True), (5, True))
] + [
    # atom's Triton kernels through the impl (interpreted on CPU): the GPU code path's indexing
    # of vLLM's strided cache views, on a token-major and a head-major layout.
    pytest.param(layout, 5, True, "triton", "auto", id=f"{layout}-w5-sinks1-triton") for layout in ("LBNHC", "LBHNC")
] + [
    # vLLM <= 0.28 allocates get_kv_cache_shape's tensor (the release is simulated here)
    pytest.param("get_kv_cache_shape", 5, True, "auto", "auto", id="0.26-shape-w5-sinks1"),
] + [
    # fp8 KV cache (kv_cache_dtype="fp8"): quantised writes with the layer's scales, dequantised reads
    pytest.param(layout, window, True, backend, "fp8", id=f"{layout}-w{window}-fp8-{backend}")
    for layout, window, backend in (("LBNHC", None, "auto"), ("LBHNC", 5, "auto"), ("LBNHC", 5, "triton"))
]


@pytest.mark.parametrize("layout,window,with_sinks,ops_backend,kv_dtype", _CASES)
def test_impl_matches_dense_attention(layout, window, with_sinks, ops_backend, kv_dtype, monkeypatch):
    if layout == "get_kv_cache_shape":
        from packaging.version import Version

        monkeypatch.setattr(compat, "vllm_version", lambda: Version("0.26.0"))
    elif compat.has_get_kv_cache_shape():
        pytest.skip("vLLM <= 0.28 hands the backend its own get_kv_cache_shape tensor")
    if ops_backend == "triton":
        import os

        from atom.ops._dispatch import triton_available

        if not torch.cuda.is_available() and (not triton_available() or os.environ.get("TRITON_INTERPRET") != "1"):
            pytest.skip("needs a GPU or Triton's interpreter")
        monkeypatch.setenv("ATOM_OPS_BACKEND", "paged_attention=triton,reshape_and_cache=triton")
    torch.manual_seed(0)
    sinks = torch.randn(NUM_HEADS) if with_sinks else None
    impl = ATOMAttentionImpl(NUM_HEADS, HEAD, 1 / math.sqrt(HEAD), NUM_KV_HEADS, None, window, kv_dtype,
                             None, "decoder", None, sinks=sinks)
    layer = FP8_LAYER if kv_dtype == "fp8" else LAYER
    impl.process_weights_after_loading(torch.float32)
    if layout == "get_kv_cache_shape":
        kv_cache = torch.full(ATOMAttentionBackend.get_kv_cache_shape(NUM_BLOCKS, BLOCK, NUM_KV_HEADS, HEAD), float("nan"))
    else:
        kv_cache = _vllm_cache(layout, kv_dtype)

    # (context already cached, new tokens): a prefill, a decode, a chunk after cached context
    shapes = [(0, 6), (20, 1), (17, 9)]
    blocks = torch.randperm(NUM_BLOCKS, dtype=torch.int32)
    block_table = torch.stack([blocks[0:4], blocks[4:8], blocks[8:12]])
    full_k, full_v, new_k, new_v, slot_mapping = write_context(impl, layer, kv_cache, shapes, block_table)
    num_tokens = new_k.shape[0]
    q = torch.randn(num_tokens + 3, NUM_HEADS, HEAD)  # +3 padding rows, as vLLM may pass
    pad = torch.zeros(3, NUM_KV_HEADS, HEAD)
    impl.do_kv_cache_update(layer, torch.cat([new_k, pad]), torch.cat([new_v, pad]), kv_cache, slot_mapping)

    q_lens = [n for _, n in shapes]
    md = PagedAttentionMetadata(
        num_actual_tokens=num_tokens, num_reqs=3, max_query_len=max(q_lens),
        max_seq_len=max(c + n for c, n in shapes),
        query_start_loc=torch.tensor([0, 6, 7, 16], dtype=torch.int32),
        seq_lens=torch.tensor([c + n for c, n in shapes], dtype=torch.int32),
        block_table=block_table, slot_mapping=slot_mapping,
    )
    output = torch.full_like(q, float("nan"))
    assert impl.forward(layer, q, new_k, new_v, kv_cache, md, output) is output

    if kv_dtype == "fp8":
        full_k = [_fp8_round_trip(k, layer._k_scale) for k in full_k]
        full_v = [_fp8_round_trip(v, layer._v_scale) for v in full_v]
    start = 0
    for s, (c, n) in enumerate(shapes):
        want = _dense(q[start:start + n], full_k[s], full_v[s], n, impl.scale, window, sinks)
        torch.testing.assert_close(output[start:start + n], want, atol=1e-5, rtol=1e-5)
        start += n


def test_cache_split_for_the_0_26_shape(monkeypatch):
    """vLLM <= 0.28 allocates ``get_kv_cache_shape``'s tensor; the impl reads key/value halves."""
    from packaging.version import Version

    monkeypatch.setattr(compat, "vllm_version", lambda: Version("0.26.0"))
    cache = torch.zeros(ATOMAttentionBackend.get_kv_cache_shape(NUM_BLOCKS, BLOCK, NUM_KV_HEADS, HEAD))
    k, v = compat.kv_cache_as_nhd(cache, HEAD)
    assert k.shape == v.shape == (NUM_BLOCKS, BLOCK, NUM_KV_HEADS, HEAD)
    assert k.data_ptr() == cache[0].data_ptr() and v.data_ptr() == cache[1].data_ptr()


def test_profiling_run_without_metadata_returns_zeros():
    impl = ATOMAttentionImpl(NUM_HEADS, HEAD, 0.1, NUM_KV_HEADS)
    out = torch.full((2, NUM_HEADS, HEAD), float("nan"))
    assert torch.equal(impl.forward(LAYER, out, None, None, torch.empty(0), None, out), torch.zeros_like(out))


@pytest.mark.parametrize("kw,match", [
    ({"alibi_slopes": [1.0] * NUM_HEADS}, "ALiBi"),
    ({"logits_soft_cap": 30.0}, "soft-cap"),
    ({"attn_type": "encoder"}, "decoder attention"),
    ({"kv_cache_dtype": "fp8_e5m2"}, "fp8_e5m2 KV cache"),
])
def test_impl_refuses_what_the_selector_cannot_see(kw, match):
    with pytest.raises(NotImplementedError, match=match):
        ATOMAttentionImpl(NUM_HEADS, HEAD, 0.1, NUM_KV_HEADS, **kw)


@pytest.mark.parametrize("kv_dtype", ["auto", "fp8"])
def test_fused_qk_norm_rope_path_equals_norm_rope_then_attention(kv_dtype, tiny_model):
    """A layer on the fused path (q/k handed over before QK-norm and RoPE, positions from the
    builder) computes what norm -> RoPE -> do_kv_cache_update -> forward computes."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.attention.backend import CommonAttentionMetadata
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from atom.models._layers import RMSNorm, RotaryEmbedding
    from atom.models.attention.mha import FusedQKNormRope
    from atom.plugin.vllm.attention_mha import ATOMAttentionMetadataBuilder

    torch.manual_seed(0)
    q_norm, k_norm = RMSNorm(HEAD, 1e-6), RMSNorm(HEAD, 1e-6)
    with torch.no_grad():
        q_norm.weight.normal_(1.0, 0.3), k_norm.weight.normal_(1.0, 0.3)
    rope = RotaryEmbedding(HEAD, {"rope_type": "default", "rope_theta": 10000.0}, 128)
    layer = FP8_LAYER if kv_dtype == "fp8" else LAYER
    plain = ATOMAttentionImpl(NUM_HEADS, HEAD, HEAD ** -0.5, NUM_KV_HEADS, kv_cache_dtype=kv_dtype)
    fused = ATOMAttentionImpl(NUM_HEADS, HEAD, HEAD ** -0.5, NUM_KV_HEADS, kv_cache_dtype=kv_dtype)
    fused.enable_fused_qk_norm_rope(FusedQKNormRope(q_norm, k_norm, rope))

    # a prefill of 6, a decode at 20, a chunk of 9 after 17 (earlier tokens written by the plain path)
    q_lens, seq_lens = [6, 1, 9], [6, 21, 26]
    block_table = torch.arange(12, dtype=torch.int32).reshape(3, 4)
    qsl = torch.tensor([0, 6, 7, 16], dtype=torch.int32)
    positions = torch.cat([torch.arange(s - q, s) for q, s in zip(q_lens, seq_lens)])
    slot_mapping = torch.tensor([int(block_table[r, p // BLOCK]) * BLOCK + p % BLOCK
                                 for r, (q, s) in enumerate(zip(q_lens, seq_lens)) for p in range(s - q, s)])
    common = CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        num_reqs=3, num_actual_tokens=16, max_query_len=9, max_seq_len=26,
        block_table_tensor=block_table, slot_mapping=slot_mapping,
    )
    config = EngineArgs(model=str(tiny_model("qwen3", "float32")), max_model_len=128,
                        dtype="float32").create_engine_config()
    config.compilation_config.static_forward_context["l.attn"] = SimpleNamespace(impl=fused)
    try:
        spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=NUM_KV_HEADS, head_size=HEAD, dtype=torch.float32)
        builder = ATOMAttentionMetadataBuilder(spec, ["l.attn"], config, torch.device("cpu"))
        md = builder.build(0, common)
    finally:
        del config.compilation_config.static_forward_context["l.attn"]
    assert builder.fused_layers == ["l.attn"]
    assert torch.equal(md.positions, positions)

    def cache():
        if kv_dtype == "fp8":
            return torch.zeros(NUM_BLOCKS, NUM_KV_HEADS, BLOCK, 2 * HEAD, dtype=torch.uint8)
        return torch.zeros(NUM_BLOCKS, NUM_KV_HEADS, BLOCK, 2 * HEAD)

    q, k, v = torch.randn(16, NUM_HEADS, HEAD), torch.randn(16, NUM_KV_HEADS, HEAD), torch.randn(16, NUM_KV_HEADS, HEAD)
    cache_plain, cache_fused = cache(), cache()
    old_k, old_v = torch.randn(20, NUM_KV_HEADS, HEAD), torch.randn(20, NUM_KV_HEADS, HEAD)
    old_slots = torch.tensor([int(block_table[r, p // BLOCK]) * BLOCK + p % BLOCK
                              for r, c in ((1, 20),) for p in range(c)])
    for c in (cache_plain, cache_fused):  # context of the decode request, already cached
        plain.do_kv_cache_update(layer, old_k, old_v, c, old_slots)
    c_slots = torch.tensor([int(block_table[2, p // BLOCK]) * BLOCK + p % BLOCK for p in range(17)])
    ck, cv = torch.randn(17, NUM_KV_HEADS, HEAD), torch.randn(17, NUM_KV_HEADS, HEAD)
    for c in (cache_plain, cache_fused):
        plain.do_kv_cache_update(layer, ck, cv, c, c_slots)

    # unfused: what the model does itself, then vLLM's two calls
    qn = q_norm(q.clone()).reshape(16, NUM_HEADS * HEAD)
    kn = k_norm(k.clone()).reshape(16, NUM_KV_HEADS * HEAD)
    qn, kn = rope(positions, qn, kn)
    qn, kn = qn.view(16, NUM_HEADS, HEAD), kn.view(16, NUM_KV_HEADS, HEAD)
    plain.do_kv_cache_update(layer, kn, v, cache_plain, slot_mapping)
    want = plain.forward(layer, qn, kn, v, cache_plain, md, torch.empty_like(q))
    # fused: vLLM's do_kv_cache_update is a no-op, forward does everything
    before = cache_fused.clone()
    fused.do_kv_cache_update(layer, k.clone(), v, cache_fused, slot_mapping)
    assert torch.equal(cache_fused, before)
    got = fused.forward(layer, q.clone(), k.clone(), v, cache_fused, md, torch.empty_like(q))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(cache_fused.float(), cache_plain.float(), atol=0, rtol=0)


def test_split_kv_workspace_bound():
    from atom.models.attention.mha import split_kv_workspace_bytes

    assert split_kv_workspace_bytes(256, 32, 8, 128, torch.device("cpu")) == 0  # torch reference: none


@pytest.mark.gpu
def test_profiling_run_allocates_the_decode_workspace_bound():
    """vLLM measures the peak during its profiling run (no metadata): the impl's branch must
    reach the split-KV partials' upper bound there, and a real decode must stay under it."""
    from vllm.config import VllmConfig, set_current_vllm_config

    from atom.models.attention.mha import split_kv_workspace_bytes

    dev = torch.device("cuda")
    config = VllmConfig()
    seqs = config.scheduler_config.max_num_seqs
    with set_current_vllm_config(config):  # as vLLM builds its Attention layers
        impl = ATOMAttentionImpl(32, 128, 128 ** -0.5, 8)
    impl.process_weights_after_loading(torch.bfloat16)
    bound = split_kv_workspace_bytes(seqs, 32, 8, 128, dev)
    assert bound > 0
    out = torch.empty(4, 32, 128, dtype=torch.bfloat16, device=dev)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    # outside the config context, as in vLLM's compiled graphs and CUDA-graph capture
    impl.forward(LAYER, out, None, None, torch.empty(0, device=dev), None, out)
    assert torch.cuda.max_memory_allocated() - base >= bound
    # a real split-KV decode of 1..seqs sequences allocates no more than the bound
    from atom.ops.attention_triton import paged_attention_fwd

    cache = torch.randn(64, 16, 8, 128, dtype=torch.bfloat16, device=dev)
    for n in (1, 7, 66, seqs):
        q = torch.randn(n, 32, 128, dtype=torch.bfloat16, device=dev)
        bt = torch.randint(0, 64, (n, 8), dtype=torch.int32, device=dev)
        lens = torch.full((n,), 128, dtype=torch.int32, device=dev)
        qsl = torch.arange(n + 1, dtype=torch.int32, device=dev)
        o = torch.empty_like(q)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        paged_attention_fwd(q, cache, cache, bt, lens, qsl, 1, 128, 0.1, out=o)
        assert torch.cuda.max_memory_allocated() - base <= bound, n


@pytest.mark.parametrize("kv_cache_dtype,kv_dtype", [("auto", torch.bfloat16), ("fp8", torch.float8_e4m3fn)])
def test_post_load_hook_warms_up_the_kernels_for_this_layer(monkeypatch, kv_cache_dtype, kv_dtype):
    """The injected ``process_weights_after_loading`` compiles the attention kernels' variants for
    the layer's own dims, dtype and KV-cache block size (read from the config vLLM builds the
    layer in), on the current GPU; nothing on a machine without one."""
    from vllm.config import CacheConfig, VllmConfig, set_current_vllm_config

    import atom.ops.attention as attention_op

    calls = []
    monkeypatch.setattr(attention_op, "warm_up_paged_attention", lambda *a, **k: calls.append((a, k)) or 14)
    config = VllmConfig(cache_config=CacheConfig(block_size=32))
    with set_current_vllm_config(config):
        impl = ATOMAttentionImpl(16, 64, 0.125, 4, sliding_window=128, kv_cache_dtype=kv_cache_dtype,
                                 sinks=torch.zeros(16))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    impl.process_weights_after_loading(torch.bfloat16)
    assert calls == []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    impl.process_weights_after_loading(torch.bfloat16)
    assert calls == [((16, 4, 64, torch.bfloat16, 32, torch.device("cuda", 0)),
                      dict(kv_dtype=kv_dtype, sliding_window=128, sinks=True))]


def test_cache_views_are_kept_per_cache_tensor():
    """The NHD views are made once per cache tensor (outside CUDA graphs they are host time per
    layer and step), and anything else gets its own: another tensor, the same tensor re-pointed at
    new memory, another head size. The write lands in the memory of this call, never in a kept
    view of an earlier one; and the kept views do not keep a cache alive that vLLM lets go."""
    import gc
    import weakref

    from atom.plugin.vllm.attention import _cache_views

    def make_impl(head):
        impl = ATOMAttentionImpl(NUM_HEADS, head, 1 / math.sqrt(head), NUM_KV_HEADS, None, None, "auto",
                                 None, "decoder", None)
        impl.process_weights_after_loading(torch.float32)
        return impl

    impl = make_impl(HEAD)
    layout = "get_kv_cache_shape" if compat.has_get_kv_cache_shape() else "LBNHC"

    def cache(root=False):  # root: a tensor that is not a view (vLLM's CPU caches are such)
        if layout == "get_kv_cache_shape":
            return torch.zeros(ATOMAttentionBackend.get_kv_cache_shape(NUM_BLOCKS, BLOCK, NUM_KV_HEADS, HEAD))
        if root:
            return torch.zeros(NUM_BLOCKS, NUM_KV_HEADS, BLOCK, 2 * HEAD)
        return _vllm_cache(layout).zero_()

    def written(kv, key, value):
        k, v = compat.kv_cache_as_nhd(kv, HEAD)
        return torch.equal(k[0, 3], key[0]) and torch.equal(v[1, 1], value[1])

    key, value = torch.randn(2, NUM_KV_HEADS, HEAD), torch.randn(2, NUM_KV_HEADS, HEAD)
    slots = torch.tensor([3, 17])
    first, second = cache(root=True), cache()
    assert not first._is_view()
    views = _cache_views(impl, first)
    assert all(a is b for a, b in zip(_cache_views(impl, first), views))  # kept
    impl.do_kv_cache_update(LAYER, key, value, second, slots)
    assert written(second, key, value) and not compat.kv_cache_as_nhd(first, HEAD)[0].any()
    # the same tensor object re-pointed at other memory: the write follows it
    if layout != "get_kv_cache_shape":
        moved = torch.zeros(second.shape[0], second.shape[2], second.shape[1], second.shape[3]).permute(0, 2, 1, 3)
        second.set_(moved.untyped_storage(), 0, moved.shape, moved.stride())
        impl.do_kv_cache_update(LAYER, key, value, second, slots)
        assert written(moved, key, value)
        # a layer of another head size reading the same tensor gets views of its own size
        assert _cache_views(make_impl(HEAD // 2), second)[0].shape[-1] == HEAD // 2
    # nothing keeps the caches, or their memory, alive: not the views kept on them
    from torch.multiprocessing.reductions import StorageWeakRef

    assert hasattr(first, "_atom_nhd_views") and hasattr(second, "_atom_nhd_views")
    gone = [weakref.ref(first), weakref.ref(second)]
    memory = [StorageWeakRef(first.untyped_storage()), StorageWeakRef(second.untyped_storage())]
    del first, second, views
    moved = None  # (second's memory, where it was re-pointed)
    gc.collect()
    assert [ref() for ref in gone] == [None, None]
    assert [ref.expired() for ref in memory] == [True, True]
