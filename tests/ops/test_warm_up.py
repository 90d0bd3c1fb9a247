"""Kernel warm-up at load (``warm_up_paged_attention``, ``warm_up_fused_moe``,
``warm_up_mla_decode``): the launches cover
every constexpr variant a serving step can meet, size-like integer arguments are not
specialised (so no later batch size needs a new compile), and on a GPU no realistic call after
the warm-up compiles anything (the first H100 tables timed 0.5-1.6 s stalls in the first batch
of a new shape)."""

from __future__ import annotations

import importlib

import pytest
import torch

from atom.ops import attention as attention_op
from atom.ops import attention_triton, moe_triton
from atom.ops import mla as mla_op
from atom.ops import moe as moe_op

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def test_attention_warm_up_covers_every_reduce_bucket():
    from atom.ops import attention_triton as at

    want = {1} | {at.next_pow2(s) for s in range(2, 65)}  # 1: the direct path (no reduce)
    assert {1 if s == 1 else at.next_pow2(s) for s in at.WARM_UP_SPLITS} == want


@pytest.mark.parametrize("name,args", [
    # stride_bt: the block table's width (max_model_len / block size) differs between the
    # warm-up and the server; specialised, a width divisible by 16 is a new variant (the
    # first H100 run of the GPU test below failed, its output cut off; 2048/16 = 128 was the
    # one such width in it).
    ("_decode_kernel", {"window", "num_splits", "stride_bt", "stride_pl_s", "stride_pl_h"}),
    ("_split_kv_reduce_kernel", {"num_splits", "stride_pl_r", "stride_pl_h"}),
    ("_prefill_kernel", {"window", "stride_bt"}),
])
def test_attention_size_arguments_are_not_specialised(name, args):
    from atom.ops import attention_triton as at

    assert args <= set(_not_specialised(getattr(at, name)))


@pytest.mark.parametrize("module,name,args", [
    ("moe_triton", "_moe_align_kernel", {"num_pairs"}), ("moe_triton", "_moe_gemm1_kernel", {"num_pairs", "num_pid_m"}),
    ("moe_triton", "_moe_gemm2_kernel", {"num_pairs", "num_pid_m"}),
    ("moe_routing_triton", "_topk_softmax_kernel", {"num_tokens"}),
    ("moe_routing_triton", "_grouped_topk_sigmoid_kernel", {"num_tokens"}),
    ("moe_triton", "_group_quant_kernel", {"num_rows"}),
])
def test_moe_size_arguments_are_not_specialised(module, name, args):
    kernels = importlib.import_module(f"atom.ops.{module}")
    assert args <= set(_not_specialised(getattr(kernels, name)))


@pytest.mark.parametrize("module,name,args", [
    # column-major activation scales have the batch size as a stride
    ("fp8_gemm_triton", "_fp8_gemm_kernel", {"M", "split_k", "stride_xsm", "stride_xsk"}),
    ("fp8_gemm_triton", "_gemv_kernel", {"M", "split_k", "stride_ys"}),
    ("fused_quant_triton", "_rms_norm_quant_kernel", {"stride_sm", "stride_sg"}),
    ("fused_quant_triton", "_silu_and_mul_quant_kernel", {"stride_sm", "stride_sg"}),
])
def test_fp8_linear_size_arguments_are_not_specialised(module, name, args):
    kernels = importlib.import_module(f"atom.ops.{module}")
    assert args <= set(_not_specialised(getattr(kernels, name)))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (Triton's compile caches)")
def test_gpu_no_compile_after_fp8_linear_warm_up():
    """A block-fp8 linear after its load-time warm-up, fed by the producers that quantise for it
    (each run once, as vLLM's profile run does): no batch size, scale layout or GEMM bucket
    compiles anything new."""
    from atom import ops
    from atom.ops import fp8_gemm_triton as gt
    from atom.ops import fused_quant_triton as ft

    k, n = 4096, 6144
    w = (torch.randn(n, k, device="cuda") * 50).clamp(-448, 448).to(torch.float8_e4m3fn)
    ws = torch.rand(n // 128, k // 128, device="cuda") * 1e-3
    nw = torch.rand(k, device="cuda", dtype=torch.bfloat16) + 0.5
    ops.warm_up_fp8_block_gemm(w, ws, (128, 128), act_dtype=torch.bfloat16, w8a8_from=17)
    x1 = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    ops.rms_norm_quant_fp8(x1, nw, 1e-6, None, 128, True)
    ops.rms_norm_quant_fp8(x1, nw, 1e-6, x1, 128, True)
    ops.silu_and_mul_quant_fp8(torch.cat([x1, x1], 1), 128, True)
    kernels = (gt._fp8_gemm_kernel, gt._gemv_kernel, gt._split_k_sum_kernel, ft._rms_norm_quant_kernel,
               ft._silu_and_mul_quant_kernel)
    before = [_compiled(kern) for kern in kernels]
    for m in (1, 2, 5, 16, 17, 33, 64, 65, 100, 128, 256, 257, 1000, 4096):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        for column in (False, True):
            y, r, q, s = ops.rms_norm_quant_fp8(x, nw, 1e-6, x, 128, column)
            ops.fp8_block_gemm(y, w, ws, (128, 128), w8a8_from=17, x_fp8=q, x_fp8_scale=s)
            y, q, s = ops.silu_and_mul_quant_fp8(torch.cat([x, x], 1), 128, column)
            ops.fp8_block_gemm(y, w, ws, (128, 128), w8a8_from=17, x_fp8=q, x_fp8_scale=s)
    torch.cuda.synchronize()
    assert [_compiled(kern) for kern in kernels] == before


def _not_specialised(kernel) -> list[str]:
    """``do_not_specialize`` of a JIT function (GPU) or of the interpreter's wrapper (CPU)."""
    dns = kernel.kwargs.get("do_not_specialize") if hasattr(kernel, "kwargs") else kernel.do_not_specialize
    names = list(kernel.arg_names)
    return [n if isinstance(n, str) else names[n] for n in dns or []]


@pytest.mark.parametrize("top_k,experts", [(8, 128), (8, 64), (2, 8), (8, 256), (1, 16), (4, 32)])
@pytest.mark.parametrize("fp8,expert_bytes", [(False, 0), (True, 0), (True, 44 << 20)])
@pytest.mark.parametrize("inter,sms", [(None, None), (256, 132), (256, 100), (128, 132), (2048, 132)])
def test_moe_warm_up_counts_meet_every_tile_config(monkeypatch, top_k, experts, fp8, expert_bytes, inter, sms):
    """The warm-up sizes meet every (tile config, align CHUNK) pair, and the small-batch path,
    that any batch of up to 8,192 tokens would (H100 configs: the interpreter's tiny tiles are
    switched off here); also for fp8 experts too large for the small-batch path (DeepSeek-V3's
    44 MB: one token goes to the grouped tiles), and with the experts' intermediate size and the SM
    count known (the fp8 small-grid bucket: one TP-8 rank's DeepSeek-V3 experts, inter 256)."""
    from atom.ops import moe_tiles
    from atom.ops import moe_triton as mt

    monkeypatch.setattr(moe_tiles, "triton_interpreting", lambda: False)
    quant = 128 if fp8 else None

    def variant(t: int):
        if mt.takes_gemv(t, top_k, experts, fp8, expert_bytes):  # the small-batch path: one variant per layer
            return mt.gemv_config(quant, torch.bfloat16)
        return mt.moe_config(t, top_k, experts, quant, torch.bfloat16, inter, sms), mt.align_chunk(t * top_k)

    every = {t: variant(t) for t in range(1, 8193)}
    assert {every[t] for t in mt.warm_up_token_counts(top_k, experts, inter, sms)} == set(every.values())
    # a layout that serves only some sizes (the shared-expert slot's two layouts, bench/NOTES.md 90):
    # what those sizes meet, launched only inside them
    for lo, hi in ((1, 1), (1, 3), (1, 128), (2, 0), (4, 0), (129, 0), (5, 40)):
        counts = mt.warm_up_token_counts(top_k, experts, inter, sms, (lo, hi))
        assert counts[0] == lo and all(lo <= t <= (hi or 8192) for t in counts)
        assert {every[t] for t in counts} == {every[t] for t in range(lo, (hi or 8192) + 1)}, (lo, hi)


def test_attention_warm_up_runs_once_per_shape():
    key = dict(num_heads=4, num_kv_heads=2, head_dim=16, dtype=torch.float32, page=16, device=DEV)
    n = attention_op.warm_up_paged_attention(**key, force=True)
    assert n == 2 * len(attention_triton.WARM_UP_SPLITS)
    assert attention_op.warm_up_paged_attention(**key, force=True) == 0  # done for this shape


def test_attention_warm_up_is_a_no_op_where_triton_does_not_run():
    # CPU tensors run the torch reference unless Triton is forced, on any machine
    assert attention_op.warm_up_paged_attention(8, 2, 16, torch.float32, 16, "cpu", sliding_window=7) == 0


def test_mla_decode_size_arguments_are_not_specialised():
    from atom.ops import mla_triton

    want = {"num_splits", "stride_bt", "stride_pl_t", "stride_pl_h"}
    assert want <= set(_not_specialised(mla_triton._mla_decode_kernel))


def test_mla_decode_warm_up_runs_once_per_shape(monkeypatch):
    monkeypatch.setattr(mla_op.mla_decode, "_warmed", set())
    key = dict(num_heads=4, kv_lora_rank=32, rope_dim=16, dtype=torch.float32, page=16, device=DEV)
    assert mla_op.warm_up_mla_decode(**key, force=True) == len(attention_triton.WARM_UP_SPLITS)
    assert mla_op.warm_up_mla_decode(**key, force=True) == 0  # done for this shape
    # CPU tensors run the torch reference unless Triton is forced
    assert mla_op.warm_up_mla_decode(4, 32, 16, torch.float32, 32, "cpu") == 0


def test_moe_layer_warm_up_keeps_its_output(monkeypatch):
    """An EP-sharded layer (expert_map) warms up through its own keywords, at the batch sizes of
    its local expert count (the tile buckets divide the pairs by the local experts), and computes
    the same afterwards."""
    from atom.models._moe import FusedMoE
    from atom.models.interfaces import ModelParallel

    torch.manual_seed(0)
    layer = FusedMoE(8, 2, 32, 16, ModelParallel(ep_rank=1, ep_size=2, ep_group=object()),
                     renormalize=True, dtype=torch.float32, use_expert_parallel=True)
    with torch.no_grad():
        layer.w13.normal_(std=0.2)
        layer.w2.normal_(std=0.2)
    layer.reduce_group = None  # this rank's partial sum only
    x, logits = torch.randn(5, 32), torch.randn(5, 8)
    before = layer(x, logits)
    assert layer.warm_up_kernels() == 0  # CPU: nothing to compile unless forced
    asked, real = [], moe_triton.warm_up_token_counts
    monkeypatch.setattr(moe_triton, "warm_up_token_counts",
                        lambda k, e, *a: asked.append((k, e, *a)) or real(k, e, *a))
    n = layer.warm_up_kernels(force=True)
    # the local expert count, not the global 8; the local intermediate size; the SM count; every size
    assert asked == [(2, 4, 16, moe_triton.num_sms(layer.w13.device), (1, 0))] and n == len(real(2, 4))
    assert layer.warm_up_kernels(force=True) == 0
    torch.testing.assert_close(layer(x, logits), before)


def test_moe_warm_up_with_fp8_block_scales():
    """The fp8 layer's keywords (scale tensors, a block_shape list) go through the warm-up."""
    g = torch.Generator().manual_seed(0)
    w13 = torch.randn(4, 256, 128, generator=g).to(torch.float8_e4m3fn).to(DEV)
    w2 = torch.randn(4, 128, 128, generator=g).to(torch.float8_e4m3fn).to(DEV)
    kw = dict(w13_scale=torch.full((4, 2, 1), 0.01, device=DEV), w2_scale=torch.full((4, 1, 1), 0.01, device=DEV),
              block_shape=[128, 128])
    n = moe_op.warm_up_fused_moe(w13, w2, 2, 4, act_dtype=torch.bfloat16, force=True, **kw)
    assert n > 0 and moe_op.warm_up_fused_moe(w13, w2, 2, 4, act_dtype=torch.bfloat16, force=True, **kw) == 0


# -- GPU: nothing compiles after the warm-up ---------------------------------------------------


def _compiled(kernel) -> int:
    caches = getattr(kernel, "device_caches", None)
    if caches is not None:  # Triton >= 3.2: {device: (kernel_cache, ...)}
        return sum(len(c[0]) for c in caches.values())
    return sum(len(c) for c in kernel.cache.values())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (Triton's compile caches)")
def test_gpu_no_compile_after_attention_warm_up():
    from atom.ops import attention_triton as at

    hq, hkv, d, page = 32, 8, 128, 16
    attention_op.warm_up_paged_attention(hq, hkv, d, torch.bfloat16, page, "cuda")
    kernels = (at._prefill_kernel, at._decode_kernel, at._split_kv_reduce_kernel)
    before = [_compiled(k) for k in kernels]
    g = torch.Generator(device="cuda").manual_seed(0)
    for seqs, ctx, q_len in [(1, 100, 1), (3, 37, 1), (32, 700, 1), (7, 2048, 1), (256, 1500, 1),
                             (5, 300, 17), (40, 129, 3), (2, 4000, 1)]:
        blocks = -(-ctx // page)
        kv = torch.randn(2, seqs * blocks + 1, page, hkv, d, device="cuda", dtype=torch.bfloat16)
        table = torch.randperm(seqs * blocks, device="cuda", generator=g)[: seqs * blocks].view(seqs, blocks).int()
        lens = torch.randint(max(1, ctx // 2), ctx + 1, (seqs,), device="cuda", generator=g).int()
        q_lens = torch.ones(seqs, dtype=torch.int32, device="cuda")
        q_lens[: max(1, seqs // 3)] = q_len  # a mixed batch when q_len > 1
        lens = torch.maximum(lens, q_lens)
        qsl = torch.zeros(seqs + 1, dtype=torch.int32, device="cuda")
        qsl[1:] = q_lens.cumsum(0)
        q = torch.randn(int(qsl[-1]), hq, d, device="cuda", dtype=torch.bfloat16)
        attention_op.paged_attention(q, kv[0], kv[1], table, lens, qsl, int(q_lens.max()), int(lens.max()), d ** -0.5)
    torch.cuda.synchronize()
    assert [_compiled(k) for k in kernels] == before


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (Triton's compile caches)")
def test_gpu_no_compile_after_mla_decode_warm_up():
    """DeepSeek-V3 latent sizes (128 heads, rank 512, rope 64), batches and contexts that choose
    every split count from 1 to 64."""
    from atom.ops import attention_triton as at
    from atom.ops import mla_triton as mt

    heads, rank, rope, page = 128, 512, 64, 16
    mla_op.warm_up_mla_decode(heads, rank, rope, torch.bfloat16, page, "cuda")
    kernels = (mt._mla_decode_kernel, at._split_kv_reduce_kernel)
    before = [_compiled(k) for k in kernels]
    g = torch.Generator(device="cuda").manual_seed(0)
    for seqs, ctx in [(1, 100), (1, 4000), (3, 37), (8, 700), (32, 2048), (64, 1500), (256, 1100), (2, 130)]:
        blocks = -(-ctx // page)
        cache = torch.randn(seqs * blocks + 1, page, rank + rope, device="cuda", dtype=torch.bfloat16)
        table = torch.randperm(seqs * blocks, device="cuda", generator=g).view(seqs, blocks).int()
        lens = torch.randint(max(1, ctx // 2), ctx + 1, (seqs,), device="cuda", generator=g).int()
        q = torch.randn(seqs, heads, rank + rope, device="cuda", dtype=torch.bfloat16)
        q_nope, q_pe = q.split([rank, rope], -1)
        mla_op.mla_decode(q_nope, q_pe, cache, table, lens, 0.1, max_seq_len=int(lens.max()))
    torch.cuda.synchronize()
    assert [_compiled(k) for k in kernels] == before


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (Triton's compile caches)")
@pytest.mark.parametrize("ep", [False, True])
def test_gpu_no_compile_after_moe_warm_up(ep):
    from atom.ops import moe_triton as mt

    experts, top_k, hidden, inter = 128, 8, 2048, 768
    local = experts // 2 if ep else experts
    w13 = torch.randn(local, 2 * inter, hidden, device="cuda", dtype=torch.bfloat16) * 0.02
    w2 = torch.randn(local, hidden, inter, device="cuda", dtype=torch.bfloat16) * 0.02
    em = None
    if ep:
        em = torch.full((experts,), -1, dtype=torch.int32, device="cuda")
        em[local:] = torch.arange(local, dtype=torch.int32, device="cuda")
    moe_op.warm_up_fused_moe(w13, w2, top_k, experts, act_dtype=torch.bfloat16, expert_map=em)
    kernels = (mt._moe_align_kernel, mt._moe_gemm1_kernel, mt._moe_gemm2_kernel, mt._moe_sum_kernel,
               mt._moe_gemv1_kernel, mt._moe_gemv2_kernel)
    before = [_compiled(k) for k in kernels]
    assert all(before), "the warm-up compiled every kernel of both paths"
    for t in (1, 2, 3, 7, 8, 9, 24, 111, 128, 136, 512, 777, 1500, 2047, 3001, 8192):
        x = torch.randn(t, hidden, device="cuda", dtype=torch.bfloat16)
        ids = torch.randint(0, experts, (t, top_k), device="cuda", dtype=torch.int32)
        w = torch.rand(t, top_k, device="cuda")
        moe_op.fused_moe(x, w13, w2, w, ids, expert_map=em)
    torch.cuda.synchronize()
    assert [_compiled(k) for k in kernels] == before


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_ep_moe_in_cuda_graphs_at_capture_sizes():
    """Half the experts on this rank (TP2+EP's layout for Qwen3-30B-A3B dims), captured in a CUDA
    graph at vLLM's capture sizes around the tile-config edges (128 = 16 tokens per local
    expert): replays equal the eager result. TP2+EP serving died at the 128-token piecewise
    capture on an H200 host; this checks the expert kernels' part of that alone."""
    experts, top_k, hidden, inter, local = 128, 8, 2048, 768, 64
    torch.manual_seed(0)
    w13 = torch.randn(local, 2 * inter, hidden, device="cuda", dtype=torch.bfloat16) * 0.02
    w2 = torch.randn(local, hidden, inter, device="cuda", dtype=torch.bfloat16) * 0.02
    em = torch.full((experts,), -1, dtype=torch.int32, device="cuda")
    em[local:] = torch.arange(local, dtype=torch.int32, device="cuda")
    moe_op.warm_up_fused_moe(w13, w2, top_k, experts, act_dtype=torch.bfloat16, expert_map=em)
    for t in (512, 256, 136, 128, 120, 64, 8, 1):
        x = torch.randn(t, hidden, device="cuda", dtype=torch.bfloat16)
        ids = torch.stack([torch.randperm(experts, device="cuda")[:top_k] for _ in range(t)]).int()
        w = torch.rand(t, top_k, device="cuda")
        eager = moe_op.fused_moe(x, w13, w2, w, ids, expert_map=em)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = moe_op.fused_moe(x, w13, w2, w, ids, expert_map=em)
        g.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, eager, atol=0, rtol=0)


def test_a_warm_up_line_times_its_own_gpu_work_not_the_queue_before_it(monkeypatch):
    """On a GPU ``timed`` waits for the device before starting its clock and after the warm-up:
    a warm-up line is its own compiles and launches, not a wait on work queued before it (one
    engine's cold start logged ~100 s for a shape that takes ~5 s alone: bench/NOTES.md 79).
    The sync is faked here (the toolkit's own mechanics); on a CPU device nothing syncs."""
    from atom.ops import _warm

    events = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: events.append(("sync", str(device))))
    monkeypatch.setattr(_warm, "TOTALS", {})

    def warm_up():
        events.append(("warm_up", None))
        return 3

    assert _warm.timed("k", "(1, 2)", warm_up, torch.device("cuda", 1)) == 3
    assert events == [("sync", "cuda:1"), ("warm_up", None), ("sync", "cuda:1")]
    assert _warm.TOTALS["k"][:2] == [1, 3]
    events.clear()
    assert _warm.timed("k", "(1, 2)", warm_up, torch.device("cpu")) == 3
    assert _warm.timed("k", "(1, 2)", warm_up) == 3
    assert events == [("warm_up", None), ("warm_up", None)]
