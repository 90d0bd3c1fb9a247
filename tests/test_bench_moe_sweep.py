"""bench/moe_sweep.py's pieces that decide what it measures: the candidate tiles per bucket (atom's
default always timed, the old and new fp8 defaults among the finalists), Zipf routing (distinct experts
per token, skewed popularity) and the labels that tell tiles apart."""

from __future__ import annotations

import torch

from tests._bench import load_bench

sweep = load_bench("moe_sweep")


def test_every_case_times_atoms_default_tiles_and_the_finalists(monkeypatch):
    from atom.ops import moe_gemv_triton, moe_triton
    from atom.ops.moe_triton import MoeConfig, moe_config

    # the GPU's tiles (under the interpreter atom picks tiny ones)
    monkeypatch.setattr(moe_triton, "triton_interpreting", lambda: False)
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
