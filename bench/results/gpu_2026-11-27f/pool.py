#!/usr/bin/env python
"""Pool the 2026-11-27f GPT-OSS A/B (three fresh launches per side, two bench/ab.py records).

    python3 bench/results/gpu_2026-11-27f/pool.py

Every measured window of every launch counts. The ratio is the ratio of pooled medians (atom/stock)
with a bootstrap 95% interval: windows resampled within each side, 10,000 resamples, seed 0
(bench/ab.py's bootstrap_ratio and verdict; bench/latest.py pools records the same way, with 4,000
resamples). Also printed: each launch's windows, median ratio and its own interval.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))  # bench/
from ab import bootstrap_ratio, verdict  # noqa: E402

#: the records, in launch order (launch1: call 4, 1 launch x 5 rounds; launch2-3: call 5, 2 launches x 2 rounds)
RECORDS = ["ab_gptoss_launch1.json", "ab_gptoss_launch2-3.json"]
N, SEED = 10_000, 0


def launches() -> list[dict]:
    """One dict per launch: windows per side (round order), ready_s per side, throttled windows."""
    out = []
    for name in RECORDS:
        rec = json.loads((HERE / name).read_text())
        per = rec["rounds"]
        for i in range(rec["launches_per_side"]):
            out.append({
                "source": name, "gpu": rec["gpu"], "date": rec["date"], "window_s": rec["window_s"],
                "tok_s": {s: v["tok_s"][i * per:(i + 1) * per] for s, v in rec["sides"].items()},
                "throttled": {s: sum(1 for c in v["clocks"][i * per:(i + 1) * per] if c.get("throttled_samples"))
                              for s, v in rec["sides"].items()},
                "ready_s": {s: v["facts"]["ready_s_per_launch"][i] for s, v in rec["sides"].items()},
                "model_class": {s: v["facts"]["model_class"] for s, v in rec["sides"].items()},
                "atom_from": {s: v["facts"]["versions"].get("atom_from") for s, v in rec["sides"].items()},
            })
    return out


def main() -> int:
    ls = launches()
    result = {"launches": [], "n_resamples": N, "seed": SEED}
    for k, l in enumerate(ls, 1):
        a, s = l["tok_s"]["atom"], l["tok_s"]["stock"]
        point, low, high = bootstrap_ratio(a, s, n=N, seed=SEED)
        entry = {"launch": k, **l, "stock_median": statistics.median(s), "atom_median": statistics.median(a),
                 "ratio": point, "ci": [low, high], "verdict": verdict(low, high)}
        result["launches"].append(entry)
        print(f"launch {k} ({l['source']}): stock {[round(x) for x in s]} atom {[round(x) for x in a]}  "
              f"medians {statistics.median(s):.0f} / {statistics.median(a):.0f}  x{point:.3f} [{low:.3f}, {high:.3f}] "
              f"{verdict(low, high)}  ready stock {l['ready_s']['stock']} s atom {l['ready_s']['atom']} s  "
              f"throttled {l['throttled']}")
    a = [x for l in ls for x in l["tok_s"]["atom"]]
    s = [x for l in ls for x in l["tok_s"]["stock"]]
    point, low, high = bootstrap_ratio(a, s, n=N, seed=SEED)
    result["pooled"] = {"windows_per_side": len(a), "stock_median": statistics.median(s),
                        "atom_median": statistics.median(a), "ratio": point, "ci": [low, high],
                        "verdict": verdict(low, high)}
    print(f"pooled ({len(a)} windows per side, {len(ls)} launches): stock median {statistics.median(s):.0f}, "
          f"atom median {statistics.median(a):.0f} tok/s, atom/stock x{point:.3f} [{low:.3f}, {high:.3f}] "
          f"{verdict(low, high)}")
    # the same pooling with bench/latest.py's resample count (4,000), for comparison with latest.json
    p4, l4, h4 = bootstrap_ratio(a, s)
    result["pooled_n4000"] = {"ratio": p4, "ci": [l4, h4], "verdict": verdict(l4, h4)}
    print(f"  (bench/latest.py's 4,000 resamples: x{p4:.3f} [{l4:.3f}, {h4:.3f}] {verdict(l4, h4)})")
    # the launches as the unit: each launch's median ratio
    lr = [e["ratio"] for e in result["launches"]]
    result["per_launch_ratios"] = lr
    print(f"per-launch median ratios: {', '.join(f'{r:.3f}' for r in lr)} (min {min(lr):.3f}, max {max(lr):.3f})")
    # within-round pairs (each round's atom window / stock window; the sides alternate who goes first)
    pairs = [x / y for l in ls for x, y in zip(l["tok_s"]["atom"], l["tok_s"]["stock"])]
    result["round_pair_ratios"] = pairs
    print(f"per-round atom/stock: {', '.join(f'{r:.3f}' for r in pairs)}; median {statistics.median(pairs):.3f}, "
          f"{sum(r > 1 for r in pairs)}/{len(pairs)} above 1")
    (HERE / "pooled.json").write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
