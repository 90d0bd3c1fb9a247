"""bench/latest.py: bench/results/latest.json and the generated table in docs/performance.md stay in
sync with the records they are built from; runs of one cell pool their windows."""

from __future__ import annotations

import json

import pytest

from tests._bench import load_bench

latest = load_bench("latest")


def test_latest_json_and_the_docs_table_are_in_sync_with_the_records():
    built = latest.build()
    assert latest.LATEST.read_text() == latest.dumps(built), "run: python bench/latest.py --write"
    doc = latest.DOC.read_text()
    assert latest.generated_doc(doc, built) == doc, "run: python bench/latest.py --write"


def test_every_cell_says_what_the_protocol_asks_for():
    for cell in json.loads(latest.LATEST.read_text())["cells"]:
        assert cell["gpu"] and cell["versions"].get("vllm") and cell["dates"] and cell["launches_per_side"] >= 1
        ref = cell["sides"][cell["reference"]]
        assert "ratio" not in ref
        for name, side in cell["sides"].items():
            assert side["model_class"] and side["attention_impls"] and "throttled_windows" in side
            if name != cell["reference"]:
                assert side["ratio_ci_low"] <= side["ratio"] <= side["ratio_ci_high"]
                assert side["verdict"] == ("not counted" if "not_counted" in cell else latest.cell_verdict(
                    side["ratio"], side["ratio_ci_low"], side["ratio_ci_high"], side["launches"]))
                assert side["launches"] <= cell["launches_per_side"]


def _record(tok_stock, tok_atom, date, **extra):
    def side(tok, cls):
        return {"tok_s": tok, "throttled_windows": 0, "kernel_log_lines": [],
                "facts": {"model_class": cls, "attention_impls": ["X"], **extra}}
    return {"label": "m", "model": "/m", "in": 8, "out": 8, "conc": 2, "rounds": len(tok_stock), "window_s": 1.0,
            "launches_per_side": 1, "reference": "stock", "date": date,
            "sides": {"stock": side(tok_stock, "a.Stock"), "atom": side(tok_atom, "b.Atom")}}


def test_runs_of_one_cell_pool_their_windows_and_missing_facts_come_from_the_entry(tmp_path):
    (tmp_path / "r1.json").write_text(json.dumps(_record([100, 101, 99], [110, 111, 112], "2026-01-01")))
    (tmp_path / "r2.json").write_text(json.dumps(_record([100, 100, 102], [112, 109, 111], "2026-01-02")))
    assumed = {"gpu": "G", "versions": {"vllm": "0.26.0"}}
    out = latest.build([{"path": "r1.json", "assumed": assumed}, {"path": "r2.json", "assumed": assumed}],
                       root=tmp_path)
    (cell,) = out["cells"]
    assert cell["launches_per_side"] == 2 and cell["sides"]["atom"]["windows"] == 6
    assert cell["sides"]["stock"]["median_tok_s"] == 100.0 and cell["sides"]["atom"]["median_tok_s"] == 111.0
    assert cell["sides"]["atom"]["ratio"] == pytest.approx(1.11)
    assert cell["sides"]["atom"]["verdict"] == "win (< 3 launches)"
    assert cell["gpu"] == "G" and cell["assumed_fields"] == ["gpu", "versions"]
    assert "| m | 8/8@2 | atom | 111 | 1.11x [" in latest.render(out)


def test_a_side_that_ran_other_classes_is_not_pooled(tmp_path):
    """The same side name with another attention impl (atom's MHA stepping aside on NVIDIA) is
    another configuration: its own row, never pooled with the name's earlier records."""
    assumed = {"gpu": "G", "versions": {"vllm": "0.26.0"}}
    before, after = _record([100, 101], [70, 71], "d1"), _record([100, 101], [98, 99], "d2")
    after["sides"]["atom"]["facts"]["attention_impls"] = ["FlashAttentionImpl"]
    (tmp_path / "a.json").write_text(json.dumps(before))
    (tmp_path / "b.json").write_text(json.dumps(after))
    out = latest.build([{"path": "a.json", "assumed": assumed}, {"path": "b.json", "assumed": assumed}], root=tmp_path)
    assert sorted((c["sides"]["atom"]["attention_impls"][0], c["sides"]["atom"]["median_tok_s"]) for c in out["cells"]) == [
        ("FlashAttentionImpl", 98.5), ("X", 70.5)]


def test_records_of_different_versions_are_not_pooled(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps({**_record([1, 1], [1, 1], "d", versions={"vllm": "0.26.0"}), "gpu": "G"}))
    (tmp_path / "b.json").write_text(json.dumps({**_record([1, 1], [1, 1], "d", versions={"vllm": "0.32.0"}), "gpu": "G"}))
    with pytest.raises(ValueError, match="cannot be pooled"):
        latest.build([{"path": "a.json"}, {"path": "b.json"}], root=tmp_path)


def test_continuous_arrival_cells_are_never_pooled_with_batch_cells(tmp_path):
    """ab.py --arrivals continuous measures another load (mixed steps): its own cell."""
    assumed = {"gpu": "G", "versions": {"vllm": "0.26.0"}}
    (tmp_path / "b.json").write_text(json.dumps(_record([100, 101], [110, 111], "d")))
    (tmp_path / "c.json").write_text(json.dumps({**_record([100, 101], [90, 91], "d"), "arrivals": "continuous"}))
    out = latest.build([{"path": "b.json", "assumed": assumed}, {"path": "c.json", "assumed": assumed}], root=tmp_path)
    assert sorted(c["cell"] for c in out["cells"]) == ["8/8@2", "8/8@2 continuous"]
    assert {c["cell"]: c["sides"]["atom"]["windows"] for c in out["cells"]} == {"8/8@2": 2, "8/8@2 continuous": 2}


def test_engine_arguments_make_a_cell_of_their_own(tmp_path):
    """bench/ab.py --engine (vLLM serve's capture sizes) measures another configuration: its own cell;
    dummy weights (load_format) are the label's business; a record older than the field takes its
    engine arguments from the entry, which latest.json then lists as supplied."""
    assumed = {"gpu": "G", "versions": {"vllm": "0.26.0"}}
    capture = {"compilation_config": {"max_cudagraph_capture_size": 512}}
    (tmp_path / "a.json").write_text(json.dumps({**_record([100, 101], [110, 111], "d"), "engine": {"load_format": "dummy"}}))
    (tmp_path / "b.json").write_text(json.dumps({**_record([100, 101], [50, 51], "d"), "engine": capture}))
    (tmp_path / "c.json").write_text(json.dumps(_record([100, 102], [52, 53], "d")))
    (tmp_path / "e.json").write_text(json.dumps({**_record([100, 101], [90, 91], "d"), "engine": {"max_num_seqs": 8}}))
    out = latest.build([{"path": "a.json", "assumed": assumed}, {"path": "b.json", "assumed": assumed},
                        {"path": "c.json", "assumed": {**assumed, "engine": capture}},
                        {"path": "e.json", "assumed": assumed}], root=tmp_path)
    cells = {c["cell"]: c for c in out["cells"]}
    assert sorted(cells) == ["8/8@2", "8/8@2 capture 512", '8/8@2 {"max_num_seqs":8}']
    assert cells["8/8@2 capture 512"]["sides"]["atom"]["windows"] == 4  # b and c pooled
    assert cells["8/8@2 capture 512"]["assumed_fields"] == ["engine", "gpu", "versions"]
    assert cells["8/8@2"]["assumed_fields"] == ["gpu", "versions"]  # its record has the field
    assert cells["8/8@2"]["sides"]["atom"]["median_tok_s"] == 110.5


@pytest.mark.parametrize("point,low,high,launches,want", [
    (1.04, 1.03, 1.05, 3, "win"), (1.04, 1.03, 1.05, 1, "tie (< 3 launches)"),
    (1.15, 1.14, 1.16, 1, "win (< 3 launches)"), (0.85, 0.84, 0.86, 2, "loss (< 3 launches)"),
    (1.15, 0.95, 1.30, 2, "tie (< 3 launches)"), (0.95, 0.90, 0.99, 4, "loss"), (1.2, 0.9, 1.4, 3, "tie"),
])
def test_a_verdict_from_fewer_than_3_launches_says_so_and_ties_within_10_percent(point, low, high, launches, want):
    """The protocol counts a verdict from 3 launches per side; the interval of one or two launches
    holds no launch-to-launch spread, so such a cell's verdict says so, and within +-10 % it is a tie."""
    assert latest.cell_verdict(point, low, high, launches) == want


def test_every_target_that_is_not_met_says_why():
    """The issues' "every target met or its miss explained": a target that is missed or not decided
    without a WHY line fails here; WHY names only targets that exist."""
    built = latest.build()
    ids = [t[0] for t in latest.TARGETS]
    assert [r["id"] for r in built["targets"]] == ids and set(latest.WHY) <= set(ids)
    for row in built["targets"]:
        assert row["status"] in ("met", "missed", "not decided")
        assert row["status"] == "met" or row["why"], row["id"]


def _write_moe_fp8_pair(tmp_path, first=None) -> dict:
    """Two records of one 3-launch MoE fp8 cell at C=128 (atom losing), a.json (plus ``first``'s fields)
    and b.json; returns the fields both assume."""
    for name, date in (("a.json", "2026-01-01"), ("b.json", "2026-01-02")):
        rec = _record([100, 101, 99], [60, 61, 59], date)
        rec["label"], rec["conc"], rec["launches_per_side"] = "moe-fp8-L48", 128, 3
        if name == "a.json":
            rec.update(first or {})
        (tmp_path / name).write_text(json.dumps(rec))
    return {"gpu": "G", "versions": {"vllm": "0.26.0"}}


def test_a_record_marked_not_counted_is_shown_apart_and_decides_nothing(tmp_path):
    """A RECORDS entry's ``not_counted`` (a reason: stock's side did not run what the comparison needs):
    its cell never pools with counted records of the same cell, its verdict is "not counted" (the
    interval is still shown), the reason follows the table, and the targets list it without deciding."""
    assumed = _write_moe_fp8_pair(tmp_path)
    out = latest.build([{"path": "a.json", "assumed": assumed, "not_counted": "stock ran another router"},
                        {"path": "b.json", "assumed": assumed}], root=tmp_path)
    apart, counted = out["cells"]
    assert apart["not_counted"] == "stock ran another router" and "not_counted" not in counted
    assert apart["sides"]["atom"]["verdict"] == "not counted" and counted["sides"]["atom"]["verdict"] == "loss"
    assert apart["sides"]["atom"]["ratio_ci_high"] < 1.0
    table = latest.render(out)
    assert "| not counted |" in table and "\nNot counted (moe-fp8-L48 8/8@128): stock ran another router." in table
    (row,) = [r for r in latest.targets({"cells": [apart]}) if r["id"] == "moe-fp8-throughput"]
    assert row["status"] == "not decided" and not row["evidence"][0]["deciding"]
    assert ", not counted" in latest.render_targets([row])
    (row,) = [r for r in latest.targets({"cells": [apart, counted]}) if r["id"] == "moe-fp8-throughput"]
    assert row["status"] == "missed"  # the counted cell decides


def test_a_record_that_says_its_sides_differ_is_not_counted(tmp_path):
    """A record's own ``not_counted`` (bench/ab.py writes one when the sides' MoE routers differ) sets
    its cell apart as a RECORDS entry's does."""
    assumed = _write_moe_fp8_pair(
        tmp_path, first={"not_counted": "the sides' MoE routers differ: stock float8_e4m3fn, atom bfloat16"})
    out = latest.build([{"path": "a.json", "assumed": assumed}, {"path": "b.json", "assumed": assumed}], root=tmp_path)
    apart, counted = out["cells"]
    assert apart["not_counted"].startswith("the sides' MoE routers differ") and "not_counted" not in counted
    assert apart["sides"]["atom"]["verdict"] == "not counted" and counted["sides"]["atom"]["verdict"] == "loss"


def _cell(model, conc, ratio, low, high, launches, atom_gib=None, stock_gib=None):
    atom = {"ratio": ratio, "ratio_ci_low": low, "ratio_ci_high": high, "model_class": "x.ATOM",
            "attention_impls": ["A"], "launches": launches}
    stock = {"model_class": "x.Stock", "attention_impls": ["F"]}
    if atom_gib:
        atom["weight_gib"], stock["weight_gib"] = atom_gib, stock_gib
    return {"model": model, "cell": f"128/128@{conc}", "conc": conc, "reference": "stock", "launches_per_side": launches,
            "dates": ["2026-01-01T00:00"], "sides": {"stock": stock, "atom": atom}}


def _status(cells):
    return {r["id"]: r["status"] for r in latest.targets({"cells": cells})}


def test_targets_are_judged_on_the_low_end_of_cells_with_three_launches():
    dense = [_cell("dense-L36", 64, 1.15, 1.11, 1.2, 3)]
    assert _status(dense)["dense-throughput"] == "met"  # 1.11 >= 1.10
    # one deciding cell below the bound misses the target, whatever the others
    assert _status(dense + [_cell("dense-dummy-L36", 128, 1.12, 1.09, 1.2, 4)])["dense-throughput"] == "missed"
    # a cell of fewer launches does not decide, nor does one outside C 32-256
    assert _status([_cell("dense-L36", 64, 1.3, 1.2, 1.4, 2), _cell("dense-L36", 512, 1.3, 1.2, 1.4, 3)])[
        "dense-throughput"] == "not decided"
    # batch 1: TPOT <= 0.90x is tok/s >= 1/0.90 on the low end; only C=1 cells
    assert _status([_cell("moe-dummy-L48", 1, 1.15, 1.112, 1.2, 3)])["moe-batch1"] == "met"
    assert _status([_cell("moe-dummy-L48", 1, 1.15, 1.10, 1.2, 3)])["moe-batch1"] == "missed"
    # fp8 cells judge only the fp8 targets, and the families stay apart
    fp8 = _status([_cell("moe235-fp8-L4", 64, 1.3, 1.2, 1.4, 3, 9.8, 9.79)])
    assert fp8["moe-fp8-throughput"] == "met" and fp8["moe-throughput"] == "not decided"
    assert fp8["dense-fp8-throughput"] == "not decided"
    # weight memory: atom's GiB over stock's from any record, launches aside
    assert fp8["moe-fp8-memory"] == "met"
    assert _status([_cell("mla-fp8-L4", 1, 1, 1, 1, 1, 10.4, 10.09)])["mla-fp8-memory"] == "missed"
    # a cell whose reference is not stock (an atom-vs-atom switch) bears on no target
    other = _cell("dense-L36", 64, 1.15, 1.11, 1.2, 3)
    other["reference"] = "atom"
    assert _status([other])["dense-throughput"] == "not decided"


def test_a_side_pools_across_records_whatever_third_side_ran_next_to_it(tmp_path):
    """An A/B/C and an A/B/D of one cell pool B (the same classes): B's ratio uses the reference's
    windows of the records B ran in, and its launch count is its own; C and D each keep theirs.
    A side name that ran other classes (atom's model stepping aside) opens a cell of its own."""
    assumed = {"gpu": "G", "versions": {"vllm": "0.26.0"}}
    first = _record([100, 100], [90, 91], "d1")
    first["sides"]["old"] = {**first["sides"]["atom"], "tok_s": [50, 51]}
    second = _record([200, 200], [180, 181], "d2")
    second["sides"]["stock2"] = {**second["sides"]["stock"], "tok_s": [199, 201]}
    third = _record([100, 100], [100, 100], "d3")
    third["sides"]["atom"]["facts"] = {"model_class": "c.Other", "attention_impls": ["X"]}
    for name, rec in (("a", first), ("b", second), ("c", third)):
        (tmp_path / f"{name}.json").write_text(json.dumps(rec))
    out = latest.build([{"path": f"{n}.json", "assumed": assumed} for n in "abc"], root=tmp_path)
    pooled, other = out["cells"]
    assert list(pooled["sides"]) == ["stock", "atom", "old", "stock2"] and pooled["launches_per_side"] == 2
    atom = pooled["sides"]["atom"]
    assert atom["windows"] == 4 and atom["launches"] == 2 and atom["ratio"] == pytest.approx(135.5 / 150, abs=1e-4)
    # old ran only next to the first record's stock windows (100), stock2 only next to the second's (200)
    assert pooled["sides"]["old"]["ratio"] == pytest.approx(0.505) and pooled["sides"]["old"]["launches"] == 1
    assert pooled["sides"]["stock2"]["ratio"] == pytest.approx(1.0) and pooled["sides"]["stock2"]["launches"] == 1
    assert other["sides"]["atom"]["model_class"] == "c.Other" and other["sources"] == ["c.json"]
    assert "| m | 8/8@2 | old | 50 | 0.51x [" in latest.render(out) and "| 1 x 2 |" in latest.render(out)


def test_a_side_reports_its_gpu_power_and_a_low_share_says_host_bound(tmp_path):
    """The median of the windows' power, its share of the sampled limit (or the GPU's known one for
    older records), and "host-bound" below latest.HOST_BOUND_POWER_SHARE of it."""
    def clocks(watts, limit=None):
        return [{"samples": 40, "power_w_median": w, **({"power_limit_w": limit} if limit else {})} for w in watts]
    rec = _record([100, 101, 99], [110, 111, 112], "2026-01-01")
    rec["sides"]["stock"]["clocks"] = clocks([140.0, 160.0, 150.0])      # no limit sampled: H200's 700 W
    rec["sides"]["atom"]["clocks"] = clocks([300.0, 290.0, 310.0], 600.0) + [{"samples": 0}]
    (tmp_path / "r.json").write_text(json.dumps(rec))
    out = latest.build([{"path": "r.json", "assumed": {"gpu": "NVIDIA H200, 580", "versions": {"vllm": "0.26.0"}}}],
                       root=tmp_path)
    stock, atom = out["cells"][0]["sides"]["stock"], out["cells"][0]["sides"]["atom"]
    assert (stock["power_w_median"], stock["power_of_limit"]) == (150.0, round(150 / 700, 3))
    assert (atom["power_w_median"], atom["power_of_limit"]) == (300.0, 0.5)
    table = latest.render(out)
    assert "| 150 W (21%) host-bound |" in table and "| 300 W (50%) |" in table
    assert latest.HOST_BOUND_POWER_SHARE == 0.4
    # an unknown GPU and no sampled limit: the watts alone; no clocks at all: a dash
    rec["sides"]["atom"]["clocks"] = clocks([300.0])
    del rec["sides"]["stock"]["clocks"]
    (tmp_path / "r.json").write_text(json.dumps(rec))
    out = latest.build([{"path": "r.json", "assumed": {"gpu": "G", "versions": {"vllm": "0.26.0"}}}], root=tmp_path)
    atom = out["cells"][0]["sides"]["atom"]
    assert atom["power_w_median"] == 300.0 and "power_of_limit" not in atom
    assert "| 300 W |" in latest.render(out) and "| 0 | - |" in latest.render(out)


def test_low_power_with_the_gpu_busy_is_latency_bound_not_host_bound(tmp_path):
    """Where utilization.gpu was sampled: under the power share and busy >= latest.BUSY_UTILIZATION % of
    the time is "latency-bound" (kernels ran throughout, too small to draw power); under the share and
    idle part of the time stays "host-bound"; the column shows the utilization."""
    def clocks(watts, util):
        return [{"samples": 40, "power_w_median": w, "power_limit_w": 700.0, "gpu_util_median": u}
                for w, u in zip(watts, util)]
    rec = _record([100, 101, 99], [110, 111, 112], "2026-01-01")
    rec["sides"]["stock"]["clocks"] = clocks([210.0, 209.0, 211.0], [100.0, 100.0, 99.0])
    rec["sides"]["atom"]["clocks"] = clocks([150.0, 151.0, 149.0], [70.0, 75.0, 80.0])
    (tmp_path / "r.json").write_text(json.dumps(rec))
    out = latest.build([{"path": "r.json", "assumed": {"gpu": "NVIDIA H200, 580", "versions": {"vllm": "0.26.0"}}}],
                       root=tmp_path)
    table = latest.render(out)
    assert "| 210 W (30%), busy 100% latency-bound |" in table and "| 150 W (21%), busy 75% host-bound |" in table
    assert latest.BUSY_UTILIZATION == 90.0
    cell = _cell("moe-fp8-L48", 1, 1.0, 0.99, 1.02, 3)
    for side, share, util in (("stock", 0.30, 100.0), ("atom", 0.36, 100.0)):
        cell["sides"][side].update(power_of_limit=share, gpu_util_median=util)
    (row,) = [r for r in latest.targets({"cells": [cell]}) if r["id"] == "moe-fp8-batch1"]
    assert row["evidence"][0]["latency_bound"] and not row["evidence"][0]["host_bound"]
    assert ", latency-bound**" in latest.render_targets([row])
    assert "host-bound" not in latest.render_targets([{**row, "why": ""}])  # (the WHY line may name either)


def test_target_evidence_says_when_a_side_of_its_cell_was_host_bound():
    cell = _cell("moe-fp8-L4", 1, 1.09, 0.97, 1.16, 4)
    cell["sides"]["stock"]["power_of_limit"] = 0.21  # either side below the share marks the cell
    cell["sides"]["atom"]["power_of_limit"] = 0.45
    (row,) = [r for r in latest.targets({"cells": [cell]}) if r["id"] == "moe-fp8-batch1"]
    assert row["evidence"][0]["host_bound"] and ", host-bound**" in latest.render_targets([row])
    cell["sides"]["stock"]["power_of_limit"] = 0.41
    (row,) = [r for r in latest.targets({"cells": [cell]}) if r["id"] == "moe-fp8-batch1"]
    assert not row["evidence"][0]["host_bound"] and "host-bound" not in latest.render_targets([{**row, "why": ""}])
