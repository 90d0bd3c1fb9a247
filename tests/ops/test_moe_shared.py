"""fused_moe's always-on shared experts (``num_shared``, ``shared_fused_max_tokens``; bench/NOTES.md
87-88): the last experts of the stacked weights run for every token with weight 1, inside the fused
kernel up to the limit and as dense MLPs above it. Both paths against the torch reference, and the
reference against routed experts plus a hand-written dense MLP."""

from __future__ import annotations

import pytest
import torch

from atom.ops import moe as moe_mod
from atom.ops.moe import fused_moe, per_token_group_quant_fp8_torch

from .test_moe import DEV, make_moe


def shared_case(tokens, n, dtype=torch.bfloat16, fp8_block=None, hidden=256, inter=192, experts=6, top_k=2):
    """(args, kw) with ``experts + n`` stacked experts, routing over the first ``experts`` only."""
    args, kw = make_moe(tokens, hidden, inter, experts + n, top_k, dtype, seed=tokens * 7 + n,
                        fp8_block=fp8_block, global_experts=experts)
    return args, dict(kw, num_shared=n)


def close(out, ref, fp8):
    scale = ref.float().abs().max().item()
    tol = dict(atol=0.03 * scale, rtol=0.05) if fp8 else dict(atol=2e-2 * scale, rtol=2e-2)
    torch.testing.assert_close(out.float(), ref.float(), **tol)


def test_reference_is_the_routed_experts_plus_dense_shared_mlps():
    """bf16 -> fp32 math: the op's reference with two shared experts equals the routed experts alone
    (the weights cut to the routed ones) plus silu(x W_g) * (x W_u) W_d of each shared one."""
    (x, w13, w2, w, ids), kw = shared_case(5, 2, torch.float32)
    got = fused_moe.run("torch", x, w13, w2, w, ids, num_shared=2)
    want = fused_moe.run("torch", x, w13[:6], w2[:6], w, ids)
    for j in (6, 7):
        h = x @ w13[j].t()
        want = want + (torch.nn.functional.silu(h[:, :192]) * h[:, 192:]) @ w2[j].t()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("fp8_block", [None, (128, 128)], ids=["bf16", "fp8"])
@pytest.mark.parametrize("tokens,n,limit", [(3, 1, 0), (3, 1, 4), (7, 1, 4), (9, 2, 1), (1, 2, 1), (13, 1, 12)])
def test_both_paths_match_the_reference(fp8_block, tokens, n, limit, monkeypatch):
    """Odd sizes, partial fp8 tiles (inter 192 of 128-row blocks): at most ``limit`` tokens (or any
    at 0) the shared experts are extra pairs of one fused call over all experts; above it the fused
    call sees the routed experts only and each shared expert runs dense, once."""
    args, kw = shared_case(tokens, n, fp8_block=fp8_block)
    from atom.ops import moe_triton

    calls, dense = [], []
    fwd, dense_expert = moe_triton.fused_moe_fwd, moe_mod._dense_expert

    def spy_fwd(x, w13, w2, tw, ti, **k):  # (experts the fused call sees, pairs per token)
        calls.append((w13.shape[0], ti.shape[1]))
        return fwd(x, w13, w2, tw, ti, **k)

    def spy_dense(*a, **k):  # which expert ran dense
        dense.append(a[3])
        return dense_expert(*a, **k)

    monkeypatch.setattr(moe_triton, "fused_moe_fwd", spy_fwd)
    monkeypatch.setattr(moe_mod, "_dense_expert", spy_dense)
    ref = fused_moe.run("torch", *args, **kw)
    out = torch.full_like(args[0], float("nan"))
    assert fused_moe.run("triton", *args, out=out, shared_fused_max_tokens=limit, **kw) is out
    close(out, ref, fp8_block is not None)
    if limit == 0 or tokens <= limit:
        assert calls == [(6 + n, 2 + n)] and dense == []
    else:
        assert calls == [(6, 2)] and dense == list(range(6, 6 + n))


def test_dense_path_reads_the_producers_fp8_activations():
    """Above the limit, fp8 experts with ``x_fp8`` given (the norm's fused quantisation): the dense
    shared MLP reads it too. With ``x_fp8`` of another tensor both the reference and the op follow
    it, not ``x``."""
    (x, w13, w2, w, ids), kw = shared_case(6, 1, fp8_block=(128, 128))
    other = torch.randn_like(x)
    q, s = per_token_group_quant_fp8_torch(other, 128)
    ref = fused_moe.run("torch", x, w13, w2, w, ids, x_fp8=q, x_fp8_scale=s, **kw)
    out = fused_moe.run("triton", x, w13, w2, w, ids, x_fp8=q, x_fp8_scale=s, shared_fused_max_tokens=2, **kw)
    close(out, ref, True)
    plain = fused_moe.run("torch", x, w13, w2, w, ids, **kw)
    assert (plain.float() - ref.float()).abs().max() > 0.1 * ref.float().abs().max()


def test_the_reference_uses_the_shared_slots_weights():
    """Zeroing the shared expert's fp8 down scale changes the output by its contribution."""
    (x, w13, w2, w, ids), kw = shared_case(4, 1, fp8_block=(128, 128))
    full = fused_moe.run("torch", x, w13, w2, w, ids, **kw)
    s2 = kw["w2_scale"].clone()
    s2[6] = 0
    cut = fused_moe.run("torch", x, w13, w2, w, ids, **dict(kw, w2_scale=s2))
    routed = fused_moe.run("torch", x, w13[:6], w2[:6], w, ids, w13_scale=kw["w13_scale"][:6],
                           w2_scale=kw["w2_scale"][:6], block_shape=[128, 128])
    torch.testing.assert_close(cut, routed)
    assert not torch.equal(full, cut)


@pytest.mark.parametrize("bad,match", [
    (dict(num_shared=6), "num_shared"), (dict(num_shared=-1), "num_shared"),
    (dict(num_shared=1, shared_fused_max_tokens=-2), "shared_fused_max_tokens"),
    (dict(num_shared=1, expert_map=torch.arange(6, dtype=torch.int32)), "expert_map"),
])
def test_bad_shared_arguments_are_refused(bad, match):
    args, _ = make_moe(3, 64, 32, 6, 2, torch.float32, seed=1)
    bad = {k: (v.to(DEV) if isinstance(v, torch.Tensor) else v) for k, v in bad.items()}
    for backend in ("torch", "triton"):
        with pytest.raises(ValueError, match=match):
            fused_moe.run(backend, *args, **bad)


def test_aiter_binding_steps_aside_for_shared_experts():
    args, _ = make_moe(3, 64, 32, 6, 2, torch.bfloat16, seed=2)
    assert "shared experts" in moe_mod._fused_moe_aiter_supports(*args, num_shared=1)
    assert moe_mod._fused_moe_aiter_supports(*args) is None


# -- the layer: its limit, its keywords, its warm-up ------------------------------------------


def shared_layer(inter: int, tp_size: int = 1):
    from atom.models._moe import FusedMoE
    from atom.models.interfaces import ModelParallel

    layer = FusedMoE(6, 2, 64, inter, ModelParallel(tp_size=tp_size, tp_group=object() if tp_size > 1 else None),
                     renormalize=True, dtype=torch.float32, shared_experts=1)
    with torch.no_grad():
        layer.w13.normal_(std=0.2)
        layer.w2.normal_(std=0.2)
    return layer


@pytest.mark.parametrize("inter,tp_size,env,want", [
    (256, 1, None, 128), (512, 1, None, 128), (1024, 1, None, 1), (2048, 8, None, 128), (2048, 2, None, 1),
    (256, 1, "0", 0), (2048, 1, "64", 64), (256, 1, "auto", 128),
])
def test_layer_limit_by_local_expert_size(monkeypatch, inter, tp_size, env, want):
    """auto: 128 tokens for experts of at most 512 intermediate rows on this rank (DeepSeek-V3's TP-8
    shard), 1 for larger ones; the variable overrides; the layer passes it with its slot count."""
    if env is None:
        monkeypatch.delenv("ATOM_FUSE_SHARED_EXPERTS_MAX_TOKENS", raising=False)
    else:
        monkeypatch.setenv("ATOM_FUSE_SHARED_EXPERTS_MAX_TOKENS", env)
    layer = shared_layer(inter, tp_size)
    kw = layer._fused_moe_kwargs()
    assert (kw["num_shared"], kw["shared_fused_max_tokens"]) == (1, want)


def test_layer_without_shared_experts_passes_no_shared_keywords():
    from atom.models._moe import FusedMoE
    from atom.models.interfaces import ModelParallel

    kw = FusedMoE(6, 2, 64, 32, ModelParallel(), renormalize=True, dtype=torch.float32)._fused_moe_kwargs()
    assert "num_shared" not in kw and "shared_fused_max_tokens" not in kw


@pytest.mark.parametrize("limit", ["0", "3"])
def test_layer_warm_up_covers_both_paths_and_keeps_the_output(monkeypatch, limit):
    """The fused call over every slot (top-k + 1 pairs over 7 experts) is warmed at the sizes it
    serves (all, or up to the limit); with a limit the routed-only call (top-k over the 6 routed
    experts' rows) from the limit + 1 on, and the dense expert as well. The output afterwards
    equals the one before, on both sides of the limit."""
    from atom.models._moe import routed_and_shared
    from atom.ops import moe_triton

    monkeypatch.setenv("ATOM_FUSE_SHARED_EXPERTS_MAX_TOKENS", limit)
    layer = shared_layer(32)
    monkeypatch.setattr(moe_mod.fused_moe, "_warmed", set())
    asked, real = [], moe_triton.warm_up
    monkeypatch.setattr(moe_triton, "warm_up", lambda w13, w2, k, e, *a, **kw: asked.append(
        (w13.shape[0], k, e, kw["tokens"])) or real(w13, w2, k, e, *a, **kw))
    launched, real_fwd = [], moe_triton.fused_moe_fwd
    monkeypatch.setattr(moe_triton, "fused_moe_fwd", lambda x, w13, *a, **kw: launched.append(
        (w13.shape[0], x.shape[0])) or real_fwd(x, w13, *a, **kw))
    xs = [torch.randn(t, 64, generator=torch.Generator().manual_seed(t)) for t in (2, 5)]

    def outs():
        res = []
        for x in xs:
            w, ids = torch.softmax(torch.randn(x.shape[0], 6, generator=torch.Generator().manual_seed(9)), -1).topk(2)
            res.append(routed_and_shared(layer, None, x, w, ids.int()))
        return res

    before = outs()
    launched.clear()
    assert layer.warm_up_kernels(force=True) > 0
    assert asked == ([(7, 3, 7, (1, 0))] if limit == "0" else [(7, 3, 7, (1, 3)), (6, 2, 6, (4, 0))])
    fused, routed = ([t for e, t in launched if e == n] for n in (7, 6))
    every = moe_triton.warm_up_token_counts(3, 7, 32, moe_triton.num_sms(layer.w13.device))
    if limit == "0":  # every size the fused layout's buckets meet; the routed layout never runs
        assert fused == every and not routed
    else:  # the fused layout up to 3 tokens, the routed one from 4 (its bucket may begin below 4)
        assert fused == [t for t in every if t <= 3] and max(fused) <= 3 < 4 == routed[0] < routed[1]
        assert routed[1:] == [t for t in moe_triton.warm_up_token_counts(2, 6, 32, moe_triton.num_sms(
            layer.w13.device)) if t > 4]
    for a, b in zip(outs(), before):
        torch.testing.assert_close(a, b)
    # the routed experts plus the slot, by hand: the reference the layer's op follows
    w, ids = torch.softmax(torch.randn(5, 6, generator=torch.Generator().manual_seed(9)), -1).topk(2)
    h = xs[1] @ layer.w13[6].t()
    want = fused_moe.run("torch", xs[1], layer.w13[:6], layer.w2[:6], w, ids.int()) + (
        torch.nn.functional.silu(h[:, :32]) * h[:, 32:]) @ layer.w2[6].t()
    torch.testing.assert_close(before[1], want, atol=1e-5, rtol=1e-5)


# -- GPU: DeepSeek-V3's TP-8 shard (hidden 7168, inter 256; 64 of its routed experts) ------------


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 8, 128, 129, 512])
def test_gpu_shared_slot_both_paths_deepseek_v3_shard(tokens):
    args, kw = shared_case(tokens, 1, fp8_block=(128, 128), hidden=7168, inter=256, experts=64, top_k=8)
    ref = fused_moe.run("torch", *args, **kw)
    for limit in (0, 128):
        close(fused_moe.run("triton", *args, shared_fused_max_tokens=limit, **kw), ref, True)
