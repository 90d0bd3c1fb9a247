"""Rebuild ab_dense_L36_launch2-3_c64.json, which the device tool did not return (it returns at most
8 files per call), from what did come back for the same command: the C=64 window lines of
ab_dense_L36_launch2-3.txt (tok/s to the unit, SM clock, throttled samples) and the launches'
facts and kernel lines from ab_dense_L36_launch2-3_c1.json (the same engines). Power,
temperature, warm-up windows and the agreement check of the C=64 cell are not in the text and
are left out. Run from this folder: python rebuild_c64.py"""

import json
import re
import statistics
from pathlib import Path

HERE = Path(__file__).resolve().parent
LINE = re.compile(r"\[ab\] launch (\d+) round (\d+) C=64 (\w+)\s+(\d+) tok/s over\s+([\d.]+) s .* sm ([\d.]+) MHz "
                  r"throttled (\d+)/(\d+)")


def main() -> None:
    rec = json.loads((HERE / "ab_dense_L36_launch2-3_c1.json").read_text())
    windows: dict[str, list[tuple]] = {}
    for m in LINE.finditer((HERE / "ab_dense_L36_launch2-3.txt").read_text()):
        launch, rnd, side, tok_s, secs, mhz, thr, samples = m.groups()
        windows.setdefault(side, []).append((float(tok_s), float(mhz), int(thr), int(samples)))
    rec["conc"] = 64
    rec["reconstructed"] = ("C=64 windows from ab_dense_L36_launch2-3.txt (whole tok/s, clock, throttled samples); "
                            "facts and kernel lines from ab_dense_L36_launch2-3_c1.json; see rebuild_c64.py")
    for side, s in rec["sides"].items():
        w = windows[side]
        assert len(w) == 4, (side, w)
        s["tok_s"] = [t for t, *_ in w]
        s["median"], s["min"], s["max"] = statistics.median(s["tok_s"]), min(s["tok_s"]), max(s["tok_s"])
        s["throttled_windows"] = sum(thr > 0 for _, _, thr, _ in w)
        s["clocks"] = [{"samples": n, "sm_mhz_median": mhz, "throttled_samples": thr} for _, mhz, thr, n in w]
        for k in ("warmup_tok_s", "agreement", "ratio", "ratio_ci_low", "ratio_ci_high", "verdict"):
            s.pop(k, None)
    (HERE / "ab_dense_L36_launch2-3_c64.json").write_text(json.dumps(rec, indent=1))


if __name__ == "__main__":
    main()
