"""paged_attention: Triton (interpreter on CPU, tiny shapes) and GPU (real sizes) vs the torch
reference, and the reference itself vs dense SDPA.

Every case builds a fresh seeded paged cache: K and V are views ``kv[0]``/``kv[1]`` of one
``[2, blocks, block_size, kv_heads, head]`` tensor (non-contiguous), block tables are shuffled
and padded with unused block ids, every cache slot not holding a real token is NaN (a read
past a sequence's end poisons the output), and outputs are NaN-filled before the call.
"""

from __future__ import annotations

import math
import pytest
import torch

from atom.ops import BackendUnavailable
from atom.ops.attention import paged_attention

FP8 = torch.float8_e4m3fn
DEV = "cuda" if torch.cuda.is_available() else "cpu"

# (dtype, atol, rtol). bf16: the interpreter truncates fp32 -> bf16 (1 ulp); fp8 caches are
# compared against the reference on the same dequantised values, so only q/P rounding differs.
FP32 = (torch.float32, 2e-5, 1e-4)
BF16 = (torch.bfloat16, 2e-2, 2e-2)
TOLS = [pytest.param(*FP32, id="fp32"), pytest.param(*BF16, id="bf16")]


def make_case(q_lens, ctx_lens, num_heads, num_kv_heads, head_size, block_size, dtype,
              cache_dtype=None, seed=0, device=DEV):
    """Random paged inputs; returns a dict of paged_attention's positional args + scales."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    cache_dtype = cache_dtype or dtype
    n_blocks = [-(-c // block_size) for c in ctx_lens]
    total_blocks = sum(n_blocks) + 5  # a few blocks nobody owns
    kv = torch.randn(2, total_blocks, block_size, num_kv_heads, head_size, generator=g)
    k_scale = v_scale = None
    if cache_dtype == FP8:
        k_scale = torch.tensor([0.7])
        v_scale = torch.tensor([1.3])
        kv[0] /= k_scale
        kv[1] /= v_scale
    perm = torch.randperm(total_blocks, generator=g)
    width = max(n_blocks) + 2
    # padding columns point at real blocks: a kernel that ignores seq_lens would read them
    block_table = perm[torch.randint(0, total_blocks, (len(ctx_lens), width), generator=g)].int()
    real = torch.zeros(total_blocks, block_size, dtype=torch.bool)  # slots holding a token
    used = 0
    for s, (nb, ctx) in enumerate(zip(n_blocks, ctx_lens)):
        blocks = perm[used:used + nb]
        used += nb
        block_table[s, :nb] = blocks.int()
        j = torch.arange(ctx)
        real[blocks[j // block_size], j % block_size] = True
    kv = torch.where(real[None, :, :, None, None], kv, float("nan")).to(cache_dtype).to(device)
    q = torch.randn(sum(q_lens), num_heads, head_size, generator=g).to(dtype).to(device)
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=device)
    return dict(
        args=(q, kv[0], kv[1], block_table.to(device), torch.tensor(ctx_lens, dtype=torch.int32, device=device),
              qsl, max(q_lens), max(ctx_lens), 1.0 / math.sqrt(head_size)),
        k_scale=None if k_scale is None else k_scale.to(device),
        v_scale=None if v_scale is None else v_scale.to(device),
    )


def run_both(case, backend="triton", **kw):
    q = case["args"][0]
    extra = dict(k_scale=case["k_scale"], v_scale=case["v_scale"], **kw)
    ref = paged_attention.run("torch", *case["args"], **extra)
    out = torch.full_like(q, float("nan"))
    res = paged_attention.run(backend, *case["args"], out=out, **extra)
    assert res is out
    assert torch.isfinite(out.float()).all(), "unwritten or NaN-contaminated output rows"
    return out, ref


def check(out, ref, atol, rtol):
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol)


# prefill (no cache), extend (cached prefix + several new tokens), decode (q_len 1), and a
# sequence that contributes no new token, in one batch
MIXED = dict(q_lens=[19, 1, 6, 1, 0, 3], ctx_lens=[19, 37, 30, 5, 9, 50])


@pytest.mark.parametrize("dtype,atol,rtol", TOLS)
@pytest.mark.parametrize("group", [1, 2, 4, 8])
def test_mixed_batch_gqa(dtype, atol, rtol, group):
    case = make_case(**MIXED, num_heads=2 * group, num_kv_heads=2, head_size=64, block_size=16,
                     dtype=dtype, seed=group)
    check(*run_both(case), atol, rtol)


@pytest.mark.parametrize("head_size,block_size", [(64, 8), (128, 16), (256, 4), (80, 16)])
def test_head_sizes(head_size, block_size):
    case = make_case(q_lens=[5, 1, 17], ctx_lens=[12, 21, 17], num_heads=4, num_kv_heads=2,
                     head_size=head_size, block_size=block_size, dtype=torch.bfloat16, seed=head_size)
    check(*run_both(case), *BF16[1:])


@pytest.mark.parametrize("window,sinks", [(None, True), (7, False), (7, True), (1, False), (100, True)])
@pytest.mark.parametrize("dtype,atol,rtol", TOLS)
def test_sliding_window_and_sinks(window, sinks, dtype, atol, rtol):
    case = make_case(**MIXED, num_heads=4, num_kv_heads=2, head_size=64, block_size=16,
                     dtype=dtype, seed=11)
    s = torch.randn(4, generator=torch.Generator().manual_seed(3)).to(DEV) * 2 if sinks else None
    check(*run_both(case, sliding_window=window, sinks=s), atol, rtol)


@pytest.mark.parametrize("dtype,atol,rtol", TOLS)
def test_non_causal(dtype, atol, rtol):
    case = make_case(q_lens=[9, 4, 1], ctx_lens=[9, 20, 7], num_heads=4, num_kv_heads=1,
                     head_size=64, block_size=16, dtype=dtype, seed=5)
    check(*run_both(case, causal=False), atol, rtol)


@pytest.mark.parametrize("window,sinks", [(None, False), (None, True), (45, True)])
def test_long_decode_splits(window, sinks):
    """Decode-only batch whose heuristic picks several KV splits (one sequence x one KV head)."""
    from atom.ops.attention_triton import _decode_config, choose_num_splits

    case = make_case(q_lens=[1], ctx_lens=[300], num_heads=4, num_kv_heads=1, head_size=64,
                     block_size=16, dtype=torch.float32, seed=21)
    if DEV == "cpu":
        assert choose_num_splits(1, 300, _decode_config(64)["BLOCK_N"], torch.device("cpu")) >= 4
    s = torch.linspace(-1, 2, 4).to(DEV) if sinks else None
    check(*run_both(case, sliding_window=window, sinks=s), *FP32[1:])


@pytest.mark.parametrize("num_splits", [1, 3, 8, 16])
def test_explicit_splits_with_empty_partitions(num_splits):
    """Forced split counts, including more splits than key tiles (empty partitions)."""
    from atom.ops.attention_triton import paged_attention_fwd

    case = make_case(q_lens=[1, 1, 1], ctx_lens=[40, 1, 97], num_heads=8, num_kv_heads=2,
                     head_size=64, block_size=8, dtype=torch.float32, seed=num_splits)
    sinks = torch.randn(8, generator=torch.Generator().manual_seed(1)).to(DEV)
    ref = paged_attention.run("torch", *case["args"], sinks=sinks)
    out = torch.full_like(case["args"][0], float("nan"))
    paged_attention_fwd(*case["args"], sinks=sinks, out=out, num_splits=num_splits)
    check(out, ref, *FP32[1:])


@pytest.mark.parametrize("q_lens,ctx_lens", [([1, 1, 1], [33, 70, 2]), (MIXED["q_lens"], MIXED["ctx_lens"])])
def test_fp8_cache(q_lens, ctx_lens):
    case = make_case(q_lens, ctx_lens, num_heads=4, num_kv_heads=2, head_size=64, block_size=16,
                     dtype=torch.bfloat16, cache_dtype=FP8, seed=7)
    check(*run_both(case), 3e-2, 3e-2)


def test_fp8_cache_float_scales_match_tensor_scales():
    case = make_case([1, 4], [20, 9], num_heads=2, num_kv_heads=1, head_size=64, block_size=16,
                     dtype=torch.float32, cache_dtype=FP8, seed=8)
    a = paged_attention.run("triton", *case["args"], k_scale=case["k_scale"], v_scale=case["v_scale"])
    b = paged_attention.run("triton", *case["args"], k_scale=float(case["k_scale"]),
                            v_scale=float(case["v_scale"]))
    torch.testing.assert_close(a, b)


@pytest.mark.parametrize("window,sinks", [(None, False), (5, False), (None, True)])
def test_reference_matches_dense_sdpa(window, sinks):
    """The paged reference equals plain attention on the contiguous keys (independent check)."""
    case = make_case(q_lens=[6, 13], ctx_lens=[10, 13], num_heads=4, num_kv_heads=2, head_size=32,
                     block_size=4, dtype=torch.float32, seed=9, device="cpu")
    q, kc, vc, bt, sl, qsl = case["args"][:6]
    s_h = torch.randn(4) if sinks else None
    ref = paged_attention_torch_call(case, window, s_h)
    for s in range(2):
        L, ql = int(sl[s]), int(qsl[s + 1] - qsl[s])
        k = torch.stack([kc[bt[s, j // 4], j % 4] for j in range(L)]).repeat_interleave(2, 1)
        v = torch.stack([vc[bt[s, j // 4], j % 4] for j in range(L)]).repeat_interleave(2, 1)
        qpos = torch.arange(L - ql, L)[:, None]
        kpos = torch.arange(L)[None, :]
        mask = kpos <= qpos
        if window:
            mask &= kpos > qpos - window
        qs = q[qsl[s]:qsl[s + 1]].transpose(0, 1)
        if sinks:
            # a sink is one extra key with logit `sink` and a zero value
            zk = torch.zeros(1, 4, 32)
            scores = (qs @ k.transpose(0, 1).transpose(1, 2)) / math.sqrt(32)
            scores = scores.masked_fill(~mask, float("-inf"))
            scores = torch.cat([scores, s_h.view(4, 1, 1).expand(4, ql, 1)], -1)
            vv = torch.cat([v, zk], 0).transpose(0, 1)
            dense = (torch.softmax(scores, -1) @ vv).transpose(0, 1)
        else:
            dense = torch.nn.functional.scaled_dot_product_attention(
                qs, k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask).transpose(0, 1)
        torch.testing.assert_close(ref[qsl[s]:qsl[s + 1]], dense, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("dtype,atol,rtol", TOLS)
def test_lse_output(causal, dtype, atol, rtol):
    """``lse``: Triton (every row through the prefill kernel, decode rows included) vs the
    reference; a non-causal row with no keys gives output 0 and LSE -inf."""
    q_lens, ctx_lens = [19, 1, 6, 1, 3], [19, 37, 30, 5, 0 if not causal else 3]
    case = make_case(q_lens, ctx_lens, num_heads=4, num_kv_heads=2, head_size=64, block_size=16,
                     dtype=dtype, seed=21)
    t = sum(q_lens)
    ref_lse = torch.full((t, 4), float("nan"), device=DEV)
    lse = torch.full((t, 4), float("nan"), device=DEV)
    out, ref = run_both(case, causal=causal, lse=lse)
    paged_attention.run("torch", *case["args"], causal=causal, lse=ref_lse)
    check(out, ref, atol, rtol)
    torch.testing.assert_close(lse, ref_lse, atol=1e-3, rtol=1e-4)
    if not causal:
        assert (ref_lse[-3:] == float("-inf")).all() and (ref[-3:] == 0).all()


def test_lse_merges_disjoint_key_sets():
    """Attention over all keys == the LSE-weighted merge of attention over a split of the keys
    (the identity MLA's chunked context relies on); independent of any kernel."""
    case = make_case([5, 3], [20, 11], num_heads=2, num_kv_heads=2, head_size=32, block_size=4,
                     dtype=torch.float32, seed=4, device="cpu")
    q, kc, vc, bt, sl, qsl, mq, ms, scale = case["args"]
    full = paged_attention.run("torch", *case["args"], causal=False)
    cut = torch.tensor([8, 4])  # first part: keys [0, cut), second: [cut, seq_len)
    parts = []
    for lens, table in ((cut, bt), (sl - cut, None)):
        if table is None:  # the second part: shift the keys to the front of a gathered cache
            keys = [torch.stack([kc[bt[s, j // 4], j % 4] for j in range(int(cut[s]), int(sl[s]))])
                    for s in range(2)]
            vals = [torch.stack([vc[bt[s, j // 4], j % 4] for j in range(int(cut[s]), int(sl[s]))])
                    for s in range(2)]
            width = max(k.shape[0] for k in keys)
            kcache = torch.zeros(2, width, 2, 32)
            vcache = torch.zeros(2, width, 2, 32)
            for s in range(2):
                kcache[s, :keys[s].shape[0]], vcache[s, :vals[s].shape[0]] = keys[s], vals[s]
            args = (q, kcache, vcache, torch.arange(2, dtype=torch.int32).view(2, 1), lens.int())
        else:
            args = (q, kc, vc, table, lens.int())
        lse = torch.empty(q.shape[0], 2)
        o = paged_attention.run("torch", *args, qsl, mq, ms, scale, causal=False, lse=lse)
        parts.append((o, lse))
    (o1, l1), (o2, l2) = parts
    total = torch.logaddexp(l1, l2)
    merged = o1 * torch.exp(l1 - total)[..., None] + o2 * torch.exp(l2 - total)[..., None]
    torch.testing.assert_close(merged, full, atol=1e-5, rtol=1e-5)


def paged_attention_torch_call(case, window, sinks):
    return paged_attention.run("torch", *case["args"], sliding_window=window, sinks=sinks)


def test_dispatch_and_forced_backend(monkeypatch):
    """ATOM_OPS_BACKEND forces a backend per op; aiter is refused off ROCm (no silent fallback)."""
    case = make_case([2], [5], num_heads=2, num_kv_heads=1, head_size=64, block_size=16,
                     dtype=torch.float32, seed=2)
    ref = paged_attention.run("torch", *case["args"])
    for backend in ("torch", "triton"):
        monkeypatch.setenv("ATOM_OPS_BACKEND", f"paged_attention={backend}")
        assert paged_attention.backend_for(*case["args"])[0] == backend
        check(paged_attention(*case["args"]), ref, *FP32[1:])
    if getattr(torch.version, "hip", None) is None:
        monkeypatch.setenv("ATOM_OPS_BACKEND", "paged_attention=aiter")
        with pytest.raises(BackendUnavailable):
            paged_attention(*case["args"])


def test_rejects_bad_shapes():
    case = make_case([2], [5], num_heads=3, num_kv_heads=1, head_size=64, block_size=16,
                     dtype=torch.float32, seed=2)
    q, kc, vc = case["args"][:3]
    bad = (q, kc[..., :32], vc[..., :32]) + case["args"][3:]
    for backend in ("torch", "triton"):
        with pytest.raises(ValueError):
            paged_attention.run(backend, *bad)


# -- GPU, real sizes ---------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("batch,ctx", [(1, 2048), (32, 2048), (8, 8192)])
@pytest.mark.parametrize("cache", ["bf16", "fp8"])
def test_gpu_decode_qwen3_8b(batch, ctx, cache):
    case = make_case([1] * batch, [ctx - 17 * i for i in range(batch)], num_heads=32,
                     num_kv_heads=8, head_size=128, block_size=16, dtype=torch.bfloat16,
                     cache_dtype=FP8 if cache == "fp8" else None, seed=batch, device="cuda")
    check(*run_both(case), 2e-2, 2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("head_size", [64, 128, 256])
@pytest.mark.parametrize("window,sinks", [(None, False), (128, True)])
def test_gpu_mixed_prefill_extend_decode(head_size, window, sinks):
    case = make_case([1024, 1, 300, 1, 77], [1024, 3000, 1500, 17, 77], num_heads=16,
                     num_kv_heads=4, head_size=head_size, block_size=16, dtype=torch.bfloat16,
                     seed=head_size, device="cuda")
    s = torch.randn(16, device="cuda") if sinks else None
    check(*run_both(case, sliding_window=window, sinks=s), 2e-2, 2e-2)
