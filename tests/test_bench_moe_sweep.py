"""bench/moe_sweep.py's pieces that decide what it measures: the candidate tiles per bucket (atom's
default always timed, the old and new fp8 defaults among the finalists), Zipf routing (distinct experts
per token, skewed popularity) and the labels that tell tiles apart."""

from __future__ import annotations

import torch

from tests._bench import load_bench

sweep = load_bench("moe_sweep")


def test_every_case_times_atoms_default_tiles_and_the_finalists(monkeypatch):
    from atom.ops import moe_gemv_triton, moe_tiles
    from atom.ops.moe_triton import MoeConfig, moe_config

    # the GPU's tiles (under the interpreter atom picks tiny ones)
    monkeypatch.setattr(moe_tiles, "triton_interpreting", lambda: False)
    monkeypatch.setattr(moe_gemv_triton, "triton_interpreting", lambda: False)

    for shape, fp8, t, _ in sweep.cases(False):
        e, k, _, _ = sweep.SHAPES[shape]
        default = moe_config(t, k, e, 128 if fp8 else None, torch.bfloat16)
        cands = sweep.candidates(t * k / e, fp8, t)
        assert cands and len(set(cands)) == len(cands)
        short = sweep.candidates(t * k / e, fp8, t, short=True)
        if fp8 and t * k / e <= 16:
            # entry 73: the tiles before and after the change are both finalists
            assert MoeConfig(16, 64, 128, 128, 1, 4, 3) in short and default in short
            assert default.swap_ab
    # up to 2 tokens the short fp8 list also sweeps the GEMV's own tiles (bench/NOTES.md 76)
    from atom.ops.moe_triton import GemvConfig, gemv_config

    for t in (1, 2):
        gemvs = [c for c in sweep.candidates(t * 8 / 256, True, t, short=True) if isinstance(c, GemvConfig)]
        assert len(gemvs) == 7 and gemv_config(128) in gemvs
    assert not any(isinstance(c, GemvConfig) for c in sweep.candidates(3 * 8 / 256, True, 3, short=True)[1:])
    labels = {sweep.cfg_label(c) for c in sweep.candidates(8, True, 4)}
    assert any(lb.startswith("gemv ") for lb in labels) and any(lb.endswith(" swap") for lb in labels)
    assert len(labels) == len(sweep.candidates(8, True, 4))


def test_zipf_routing_draws_distinct_experts_with_skewed_popularity():
    w, ids = sweep.route(torch, torch.device("cpu"), 512, 64, 8, "zipf", seed=1)
    assert ids.shape == (512, 8)
    assert all(row.unique().numel() == 8 for row in ids)
    torch.testing.assert_close(w.sum(-1), torch.ones(512))
    counts = torch.bincount(ids.flatten().long(), minlength=64).float()
    _, uids = sweep.route(torch, torch.device("cpu"), 512, 64, 8, "uniform", seed=1)
    ucounts = torch.bincount(uids.flatten().long(), minlength=64).float()
    # the most popular expert: ~0.16 of the pairs under 1/rank^1.1 (without replacement), 1/64 uniform
    assert counts.max() > 3 * ucounts.max()


def test_vs_vllm_cases_are_deepseek_v3s_whole_and_tp8_experts_at_decode_and_prefill_sizes():
    cases = sweep.cases(False, vs_vllm=True)
    assert {c[0] for c in cases} == {"dsv3", "dsv3-tp8"} and all(c[1] and c[3] == "uniform" for c in cases)
    assert {c[2] for c in cases} >= {1, 64, 512}
    e, k, h, i = sweep.SHAPES["dsv3-tp8"]
    assert (e, k, h, i) == (256, 8, 7168, 2048 // 8)  # one TP-8 rank's shard of DeepSeek-V3's experts


def test_vs_vllm_row_times_vllm_on_the_same_inputs_and_says_why_when_it_cannot(monkeypatch):
    """The row's vLLM fields come from one call on the case's own inputs (timed by the sweep's
    timer) and its error against atom's output; without a runnable vLLM the row says why."""
    from atom.ops.moe import fused_moe

    w13, w2, kw = sweep.make_weights(torch, torch.device("cpu"), 4, 256, 128, True, torch.bfloat16)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    tw, ti = sweep.route(torch, torch.device("cpu"), 3, 4, 2, "uniform", seed=0)
    ref = fused_moe.run("torch", x, w13, w2, tw, ti, **kw)
    seen = []

    def fake(torch_, x_, w13_, w2_, tw_, ti_, kw_):  # stands in for torch.ops.vllm.fused_experts
        seen.append((x_ is x, w13_ is w13, ti_ is ti, kw_ is kw))
        return (lambda: fused_moe.run("torch", x_, w13_, w2_, tw_, ti_, **kw_).float() * 1.01), None  # no bf16 rounding

    monkeypatch.setattr(sweep, "vllm_fused_experts", fake)
    monkeypatch.setattr(sweep, "vllm_config_name", lambda e, i: f"E={e},N={i}.json")
    row = sweep.vs_vllm(torch, lambda fn: 7.0, x, w13, w2, tw, ti, kw, ref, 4, 128, dry=False)
    assert seen == [(True, True, True, True)]
    assert row["vllm_us"] == 7.0 and row["vllm_config"] == "E=4,N=128.json"
    assert abs(row["vllm_rel_err_vs_atom"] - 0.01) < 2e-3
    monkeypatch.setattr(sweep, "vllm_fused_experts", lambda *a: (None, "ImportError: no vllm"))
    assert sweep.vs_vllm(torch, None, x, w13, w2, tw, ti, kw, ref, 4, 128, dry=False) == {
        "vllm_skipped": "ImportError: no vllm"}


def test_tp8_sweep_times_every_candidate_tile_at_one_tp8_ranks_experts_only():
    cases = sweep.cases(False, tp8=True)
    assert {c[0] for c in cases} == {"dsv3-tp8"} and all(c[1] and c[3] == "uniform" for c in cases)
    assert {c[2] for c in cases} == set(sweep.VS_VLLM_TOKENS)
    e, k, _, i = sweep.SHAPES["dsv3-tp8"]
    assert (e, k, i) == (256, 8, 256)
    # the sweep proper (many tiles per case), not the one default tile of --vs-vllm
    assert all(len(sweep.candidates(t * k / e, True, t)) > 1 for _, _, t, _ in cases)


def test_tokens_sweeps_every_tile_at_the_given_batch_sizes_on_the_given_shapes():
    cases = sweep.cases(False, tokens=(2, 3), shapes=("qwen3-30b", "dsv3-tp8"))
    assert cases == [("qwen3-30b", True, 2, "uniform"), ("qwen3-30b", True, 3, "uniform"),
                     ("dsv3-tp8", True, 2, "uniform"), ("dsv3-tp8", True, 3, "uniform")]
    assert {c[0] for c in sweep.cases(False, tokens=(4,))} == set(sweep.SHAPES)
