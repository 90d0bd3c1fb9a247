"""``bench/e2e.py``'s results: greedy agreement of two sides' tokens, the markdown tables and the
results JSON."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Optional

from e2e_common import SIDES, client_versions, fmt, log, ratio


def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    """Exact fraction of positions with the same token, and of positions before the first
    divergence of each sequence (after a divergence the two continuations see different text)."""
    same = total = prefix = 0
    identical = 0
    for x, y in zip(a, b):
        n = min(len(x), len(y))
        total += max(len(x), len(y))
        same += sum(1 for i in range(n) if x[i] == y[i])
        first = next((i for i in range(n) if x[i] != y[i]), n)
        prefix += first
        identical += int(x == y)
    return {"prompts": len(a), "positions": total, "agree_positions": same,
            "agreement": round(same / total, 4) if total else None,
            "prefix_agreement": round(prefix / total, 4) if total else None,
            "identical_sequences": identical}


def summarize(result: dict) -> str:
    lines = ["| model | in/out | conc | stock out tok/s | atom out tok/s | atom/stock | timed runs (stock, atom) | "
             "stock range | atom range |", "|---|---|---|---|---|---|---|---|---|"]
    serve_lines = ["| model | in/out | conc | prompts | stock out tok/s | atom out tok/s | **atom/stock** | "
                   "stock TTFT ms | atom TTFT ms | stock TPOT ms | atom TPOT ms | TPOT atom/stock |",
                   "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    batch_lines = ["| model | in/out | C | stock out tok/s | atom out tok/s | **atom/stock** | stock s | atom s |",
                   "|---|---|---|---|---|---|---|---|"]
    notes, profiles = [], []
    run_args = result.get("args") or {}
    tp = run_args.get("tp") or 1
    par = f" TP{tp}{'+EP' if run_args.get('ep') else ''}" if tp > 1 else ""
    for model, m in result["models"].items():
        name = model + par
        for cell in m.get("cells", []):
            lines.append(f"| {name} | {cell['in']}/{cell['out']} | {cell['conc']} | {fmt(cell.get('stock'))} | "
                         f"{fmt(cell.get('atom'))} | **{fmt(cell.get('ratio'), 2)}x** | "
                         f"{cell.get('stock_runs', '-')}, {cell.get('atom_runs', '-')} | "
                         f"{'-'.join(fmt(v) for v in cell.get('stock_range') or [None])} | "
                         f"{'-'.join(fmt(v) for v in cell.get('atom_range') or [None])} |")
        for cell in m.get("serve", []):
            s, a = cell.get("stock") or {}, cell.get("atom") or {}
            tput = ratio(a.get("output_throughput"), s.get("output_throughput"))
            serve_lines.append(
                f"| {name} | {cell['in']}/{cell['out']} | {cell['conc']} | {s.get('prompts') or a.get('prompts') or '-'} | "
                f"{fmt(s.get('output_throughput'))} | {fmt(a.get('output_throughput'))} | **{fmt(tput, 2)}x** | "
                f"{fmt(s.get('median_ttft_ms'), 2)} | {fmt(a.get('median_ttft_ms'), 2)} | "
                f"{fmt(s.get('median_tpot_ms'), 3)} | {fmt(a.get('median_tpot_ms'), 3)} | "
                f"**{fmt(ratio(a.get('median_tpot_ms'), s.get('median_tpot_ms')), 2)}x** |")
            if s.get("batch_tok_s") or a.get("batch_tok_s"):
                batch_lines.append(
                    f"| {name} | {cell['in']}/{cell['out']} | {cell['conc']} | {fmt(s.get('batch_tok_s'))} | "
                    f"{fmt(a.get('batch_tok_s'))} | **{fmt(ratio(a.get('batch_tok_s'), s.get('batch_tok_s')), 2)}x** | "
                    f"{fmt(s.get('batch_s'), 2)} | {fmt(a.get('batch_s'), 2)} |")
        ag = m.get("agreement")
        if ag:
            notes.append(f"- {name}: greedy agreement atom vs stock ({result['args']['dtype']}"
                         f"{', through the servers' if ag.get('via') == 'server' else ''}): "
                         f"{ag['agree_positions']}/{ag['positions']} positions = **{100 * ag['agreement']:.2f}%** "
                         f"({100 * ag['prefix_agreement']:.2f}% before the first divergence; "
                         f"{ag['identical_sequences']}/{ag['prompts']} sequences identical)")
        for side in SIDES:
            info = (m.get("offline") or {}).get(side) or {}
            if info.get("error"):
                notes.append(f"- {name} {side}: offline run failed: {info['error']}")
        for err in m.get("serve_errors") or []:
            notes.append(f"- {name}: serving cell failed: {str(err.get('error'))[:200]}")
        prof = m.get("profile") or {}
        if prof:
            import profile_e2e

            ok = {side: p for side, p in prof.items() if "categories_us" in p}
            workload = next((p.get("workload") for p in prof.values() if p.get("workload")), "?")
            profiles += ["", f"{name}: kernel time of one profiled serving cell ({workload}), by category:", "",
                         profile_e2e.report(ok, top=8) if ok else "(no profile)"]
            profiles += [f"{name} {side} profile failed: {p['error']}" for side, p in prof.items() if "error" in p]
    out = []
    if len(lines) > 2:
        out += ["Offline throughput (median of timed runs):", "", *lines]
    if len(serve_lines) > 2:
        out += ["", "Serving benchmark (vllm.benchmarks.serve against vllm serve; output tok/s over the cell, "
                    "TTFT/TPOT medians):", "", *serve_lines]
    if len(batch_lines) > 2:
        out += ["", "Batch throughput through the same servers (C prompts in one non-streaming request, "
                    "output tokens over its wall time):", "", *batch_lines]
    if notes:
        out += ["", *notes]
    return "\n".join(out + profiles)


def save(result: dict, t_start: float, out_path: Optional[Path], final: bool) -> None:
    """Write the JSON (with the markdown table); print the table when ``final``."""
    result["elapsed_s"] = round(time.time() - t_start, 1)
    result["complete"] = final
    for m in result["models"].values():
        for side in SIDES:
            o = (m.get("offline") or {}).get(side) or {}
            if "vllm" in o:
                result.setdefault("versions", {"vllm": o["vllm"], "torch": o["torch"], "triton": o.get("triton"),
                                               "gpu": o.get("gpu")})
    if "versions" not in result and any(m.get("serve") for m in result["models"].values()):
        result["versions"] = client_versions()
    result["markdown"] = summarize(result)
    if final:
        print("\n" + result["markdown"] + f"\n\nelapsed {result['elapsed_s']} s; versions {result.get('versions')}",
              flush=True)
    if out_path:
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps(result, indent=1, default=str))
        if final:
            log(f"results -> {out_path}")
