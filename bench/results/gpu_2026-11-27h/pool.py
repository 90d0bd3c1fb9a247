#!/usr/bin/env python
"""Pool the 2026-11-27h dense-L36 A/B (three fresh launches per side, cells C=1 and C=64).

    python3 bench/results/gpu_2026-11-27h/pool.py

Every measured window of every launch counts. Per cell, the ratio is the ratio of pooled medians
(atom/stock) with a bootstrap 95% interval: windows resampled within each side, 10,000 resamples,
seed 0 (bench/ab.py's bootstrap_ratio and verdict, as in gpu_2026-11-27f/pool.py). Also printed:
each launch's windows, median ratio and its own interval, clocks and throttled samples per window.

One record is missing: call 6's ``ab_dense_c64.json`` did not come back from the device (the
device tool returns at most 8 files per call and left it out as "(count)"). For that cell the
windows are read from call 6's text log ``ab_dense_L36_launch2-3.txt`` instead (``[ab] launch N
round R C=64 <side> <tok/s> tok/s ... sm <MHz> MHz throttled <a>/<b>`` lines). Those tok/s are
printed rounded to whole numbers, so that cell's windows carry integer values (at ~8,600 tok/s the
rounding is below 0.01 %). The C=1 cell of the same call has both; the script checks they agree.
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))  # bench/
from ab import bootstrap_ratio, verdict  # noqa: E402

#: (record prefix, launch number of its first launch), in launch order: launch1 = call 5 (1 launch
#: x 2 rounds, cold compile caches), launch2-3 = call 6 (2 launches x 2 rounds)
RECORDS = [("ab_dense_L36_launch1", 1), ("ab_dense_L36_launch2-3", 2)]
CELLS = [1, 64]
SIDES = ["stock", "atom"]
N, SEED = 10_000, 0
_ROW = re.compile(r"^\[ab\] launch (\d+) round (\d+) C=(\d+) (\w+)\s+([0-9.]+) tok/s over\s+([0-9.]+) s "
                  r"\((\d+) batches\) sm ([0-9.]+) MHz throttled (\d+)/(\d+)")


def _txt_rows(prefix: str, conc: int) -> dict[str, list[dict]]:
    """The per-window lines of a record's text log for one cell: {side: [{launch, round, tok_s, ...}]}."""
    out: dict[str, list[dict]] = {s: [] for s in SIDES}
    for line in (HERE / f"{prefix}.txt").read_text().splitlines():
        m = _ROW.match(line)
        if m and int(m[3]) == conc and m[4] in out:
            out[m[4]].append({"launch": int(m[1]), "round": int(m[2]), "tok_s": float(m[5]),
                              "sm_mhz_median": float(m[8]), "throttled_samples": int(m[9]), "samples": int(m[10])})
    for rows in out.values():
        rows.sort(key=lambda r: (r["launch"], r["round"]))
    return out


def launches(conc: int) -> list[dict]:
    """One dict per launch of this cell: windows per side (round order), clocks, ready_s, kernel lines."""
    out = []
    for prefix, first in RECORDS:
        path = HERE / f"{prefix}_c{conc}.json"
        rows = _txt_rows(prefix, conc)
        rec = json.loads(path.read_text()) if path.exists() else None
        if rec is not None and "reconstructed" not in rec:  # rebuild_c64.py's record comes from the same text
            per, n_l = rec["rounds"], rec["launches_per_side"]
            for s in SIDES:  # the text log's (rounded) windows are the JSON's
                assert [round(x) for x in rec["sides"][s]["tok_s"]] == [round(r["tok_s"]) for r in rows[s]], (prefix, conc, s)
            for i in range(n_l):
                sl = slice(i * per, (i + 1) * per)
                out.append({
                    "launch": first + i, "source": path.name, "from": "json", "gpu": rec["gpu"], "date": rec["date"],
                    "window_s": rec["window_s"],
                    "tok_s": {s: rec["sides"][s]["tok_s"][sl] for s in SIDES},
                    "clocks": {s: [{k: c[k] for k in ("sm_mhz_median", "power_w_median", "temp_c_max",
                                                       "throttled_samples", "samples", "reasons")}
                                   for c in rec["sides"][s]["clocks"][sl]] for s in SIDES},
                    "throttled_windows": {s: sum(1 for c in rec["sides"][s]["clocks"][sl] if c.get("throttled_samples"))
                                          for s in SIDES},
                    "warmup_tok_s": {s: rec["sides"][s]["warmup_tok_s"][i] for s in SIDES},
                    "ready_s": {s: rec["sides"][s]["facts"]["ready_s_per_launch"][i] for s in SIDES},
                    "model_class": {s: rec["sides"][s]["facts"]["model_class"] for s in SIDES},
                    "attention_impls": {s: rec["sides"][s]["facts"]["attention_impls"] for s in SIDES},
                    "kernel_log_lines": {s: rec["sides"][s]["kernel_log_lines"] for s in SIDES},
                    "versions": rec["sides"]["atom"]["facts"]["versions"],
                    "agreement_record": rec["sides"]["atom"].get("agreement"),
                })
        else:
            for li in sorted({r["launch"] for r in rows["stock"]}):
                sel = {s: [r for r in rows[s] if r["launch"] == li] for s in SIDES}
                out.append({
                    "launch": first + li - 1, "source": f"{prefix}.txt", "from": "txt (JSON not returned)",
                    "tok_s": {s: [r["tok_s"] for r in sel[s]] for s in SIDES},
                    "clocks": {s: [{k: r[k] for k in ("sm_mhz_median", "throttled_samples", "samples")} for r in sel[s]]
                               for s in SIDES},
                    "throttled_windows": {s: sum(1 for r in sel[s] if r["throttled_samples"]) for s in SIDES},
                })
    return out


def main() -> int:
    result: dict = {"n_resamples": N, "seed": SEED, "cells": {}}
    for conc in CELLS:
        ls = launches(conc)
        cell: dict = {"launches": []}
        print(f"== dense-L36, 128/128, C={conc}")
        for l in ls:
            a, s = l["tok_s"]["atom"], l["tok_s"]["stock"]
            point, low, high = bootstrap_ratio(a, s, n=N, seed=SEED)
            cell["launches"].append({**l, "stock_median": statistics.median(s), "atom_median": statistics.median(a),
                                     "ratio": point, "ci": [low, high], "verdict": verdict(low, high)})
            clk = {side: [f"{c['sm_mhz_median']:.0f}MHz thr {c['throttled_samples']}/{c['samples']}"
                          for c in l["clocks"][side]] for side in SIDES}
            print(f"launch {l['launch']} ({l['source']}, {l['from']}): stock {[round(x, 1) for x in s]} "
                  f"atom {[round(x, 1) for x in a]}  x{point:.3f} [{low:.3f}, {high:.3f}] {verdict(low, high)}  "
                  f"ready {l.get('ready_s', '-')}  clocks {clk}")
        a = [x for l in ls for x in l["tok_s"]["atom"]]
        s = [x for l in ls for x in l["tok_s"]["stock"]]
        point, low, high = bootstrap_ratio(a, s, n=N, seed=SEED)
        cell["pooled"] = {"windows_per_side": len(a), "launches": len(ls), "stock_median": statistics.median(s),
                          "atom_median": statistics.median(a), "ratio": point, "ci": [low, high],
                          "verdict": verdict(low, high),
                          "throttled_windows": {side: sum(l["throttled_windows"][side] for l in ls) for side in SIDES}}
        print(f"pooled ({len(a)} windows per side, {len(ls)} launches): stock median {statistics.median(s):.1f}, "
              f"atom median {statistics.median(a):.1f} tok/s, atom/stock x{point:.3f} [{low:.3f}, {high:.3f}] "
              f"{verdict(low, high)}; throttled windows {cell['pooled']['throttled_windows']}")
        p4, l4, h4 = bootstrap_ratio(a, s)  # bench/latest.py's 4,000 resamples, for comparison
        cell["pooled_n4000"] = {"ratio": p4, "ci": [l4, h4], "verdict": verdict(l4, h4)}
        print(f"  (4,000 resamples: x{p4:.3f} [{l4:.3f}, {h4:.3f}] {verdict(l4, h4)})")
        lr = [e["ratio"] for e in cell["launches"]]
        cell["per_launch_ratios"] = lr
        print(f"per-launch median ratios: {', '.join(f'{r:.3f}' for r in lr)} (min {min(lr):.3f}, max {max(lr):.3f})")
        pairs = [x / y for l in ls for x, y in zip(l["tok_s"]["atom"], l["tok_s"]["stock"])]
        cell["round_pair_ratios"] = pairs
        print(f"per-round atom/stock: {', '.join(f'{r:.3f}' for r in pairs)}; median {statistics.median(pairs):.3f}, "
              f"{sum(r > 1 for r in pairs)}/{len(pairs)} above 1\n")
        result["cells"][f"C={conc}"] = cell
    (HERE / "pooled.json").write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
