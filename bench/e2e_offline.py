"""``bench/e2e.py``'s offline side: one ``LLM`` engine per side, each in its own subprocess
(plugins load once per process), stock first; the throughput cells, then the greedy agreement
prompts. Run as ``python bench/e2e_offline.py SPEC.json OUT.json`` it is that subprocess."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from e2e_common import REPO, SIDES, client_versions, fmt, log, prompts_for, ratio, side_env
from e2e_report import agreement


def run_offline(name: str, m: dict, args: Any, info: dict, llm_kwargs: dict, env: dict[str, str], mdir: Path,
                deadline: float) -> None:
    """Both sides' offline engines for one model; fills ``m`` with ``offline`` (per side),
    ``cells`` (stock vs atom per cell) and ``agreement``."""
    spec = {"llm_kwargs": llm_kwargs, "vocab": info["vocab"],
            "lengths": [] if args.skip_offline else args.lengths,
            "concurrency": args.concurrency, "reps": args.reps, "warmup": args.warmup,
            "cell_s": args.cell_seconds,
            "agree_prompts": args.agree_prompts, "agree_lengths": args.agree_lengths}
    m["offline"] = {}
    for side in args.sides:
        left = deadline - time.time()
        if left < 30:
            m["offline"][side] = {"side": side, "error": "skipped (budget)"}
            continue
        # The child stops starting cells once its share of the budget is spent.
        share = left if side == args.sides[-1] else left / 2
        spec_side = dict(spec, budget_s=max(10.0, share - 20))
        m["offline"][side] = run_offline_side(side, spec_side, env, mdir, timeout=left)
    off = m["offline"]
    m["cells"] = cells = compare_cells(off, [] if args.skip_offline else args.lengths, args.concurrency)
    toks = {s: (off.get(s) or {}).get("agreement_tokens") for s in SIDES}
    if toks["stock"] and toks["atom"]:
        m["agreement"] = {**agreement(toks["atom"], toks["stock"]), "lengths": list(args.agree_lengths)}
        log(f"{name}: agreement {m['agreement']}")
    for s in SIDES:  # keep the JSON small: agreement tokens live in the per-side files
        if off.get(s):
            off[s].pop("agreement_tokens", None)
    for c in cells:
        log(f"{name}: {c['in']}/{c['out']} c={c['conc']}: stock {fmt(c['stock'])} atom {fmt(c['atom'])} "
            f"tok/s -> {fmt(c['ratio'], 3)}x")


def compare_cells(off: dict, lengths: list[tuple[int, int]], concurrency: list[int]) -> list[dict]:
    """One row per (lengths, concurrency) cell: both sides' median throughput and their ratio."""
    cells = []
    by_side = {s: {(c["in"], c["out"], c["conc"]): c for c in (off.get(s) or {}).get("cells", [])} for s in SIDES}
    for in_len, out_len in lengths:
        for conc in concurrency:
            key = (in_len, out_len, conc)
            s, a = by_side["stock"].get(key, {}), by_side["atom"].get(key, {})
            cells.append({"in": in_len, "out": out_len, "conc": conc, "stock": s.get("out_tok_s"),
                          "atom": a.get("out_tok_s"), "ratio": ratio(a.get("out_tok_s"), s.get("out_tok_s")),
                          "stock_s": s.get("cell_s"), "atom_s": a.get("cell_s"),
                          "stock_runs": len(s.get("runs", [])), "atom_runs": len(a.get("runs", [])),
                          "stock_range": [s.get("min_tok_s"), s.get("max_tok_s")],
                          "atom_range": [a.get("min_tok_s"), a.get("max_tok_s")]})
    return cells


def offline_child(spec: dict) -> dict:
    """One side's engine: every requested cell, then the agreement run. Runs in its own process."""
    t_start = time.perf_counter()
    from vllm import LLM, SamplingParams

    res: dict[str, Any] = {"side": spec["side"]}
    res["import_s"] = round(time.perf_counter() - t_start, 1)
    t0 = time.perf_counter()
    llm = LLM(**spec["llm_kwargs"])
    res["llm_init_s"] = round(time.perf_counter() - t0, 1)
    log(f"{spec['side']}: LLM() ready in {res['llm_init_s']} s")
    try:
        res["model_class"] = llm.apply_model(lambda m: f"{type(m).__module__}.{type(m).__qualname__}")[0]
        res["compiled"] = llm.apply_model(lambda m: bool(getattr(m, "compiled", False)
                                                         or any(getattr(s, "compiled", False) for s in m.modules())))[0]
    except Exception as exc:  # informational only (apply_model needs in-process workers on some builds)
        res["model_class"] = f"? ({type(exc).__name__})"
    vocab, rng = spec["vocab"], random.Random(1234)
    cells = []
    for in_len, out_len in spec["lengths"]:
        sp = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
        for conc in spec["concurrency"]:
            if time.perf_counter() - t_start > spec["budget_s"]:
                cells.append({"in": in_len, "out": out_len, "conc": conc, "skipped": "budget"})
                log(f"{spec['side']}: {in_len}/{out_len} c={conc}: skipped (budget)")
                continue
            tc = time.perf_counter()
            warm = []
            for _ in range(spec["warmup"]):
                t1 = time.perf_counter()
                llm.generate(prompts_for(rng, conc, in_len, vocab), sp, use_tqdm=False)
                warm.append(round(time.perf_counter() - t1, 3))
            runs = []
            timed = 0.0
            # At least ``reps`` timed runs, and more until they add up to ``cell_s`` seconds, so
            # a short cell is not one noisy sample (capped at 200 runs).
            while len(runs) < spec["reps"] or (timed < spec.get("cell_s", 0) and len(runs) < 200):
                batch = prompts_for(rng, conc, in_len, vocab)
                t1 = time.perf_counter()
                outs = llm.generate(batch, sp, use_tqdm=False)
                dt = time.perf_counter() - t1
                n_out = sum(len(o.outputs[0].token_ids) for o in outs)
                timed += dt
                runs.append({"wall_s": round(dt, 4), "out_tokens": n_out, "out_tok_s": round(n_out / dt, 1)})
            tps = sorted(r["out_tok_s"] for r in runs)
            cell = {"in": in_len, "out": out_len, "conc": conc, "warmup_s": warm, "runs": runs,
                    "out_tok_s": tps[len(tps) // 2], "min_tok_s": tps[0], "max_tok_s": tps[-1],
                    "timed_s": round(timed, 1), "cell_s": round(time.perf_counter() - tc, 1)}
            cells.append(cell)
            log(f"{spec['side']}: {in_len}/{out_len} c={conc}: {cell['out_tok_s']:.1f} out tok/s (median of "
                f"{len(tps)} runs, {tps[0]:.1f}-{tps[-1]:.1f}) in {cell['cell_s']} s")
    res["cells"] = cells
    n_agree = spec["agree_prompts"]
    if n_agree and time.perf_counter() - t_start < spec["budget_s"]:
        in_len, out_len = spec["agree_lengths"]
        t1 = time.perf_counter()
        prompts = prompts_for(random.Random(0), n_agree, in_len, vocab)  # same on both sides
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True),
                            use_tqdm=False)
        res["agreement_tokens"] = [list(o.outputs[0].token_ids) for o in outs]
        res["agreement_s"] = round(time.perf_counter() - t1, 1)
        log(f"{spec['side']}: agreement run, {n_agree} prompts {in_len}/{out_len}, {res['agreement_s']} s")
    res.update(client_versions())  # after LLM(): CUDA is not touched before the engine starts
    res["process_s"] = round(time.perf_counter() - t_start, 1)
    return res


def run_offline_side(side: str, spec: dict, env: dict[str, str], workdir: Path, timeout: float) -> dict:
    spec = dict(spec, side=side)
    spec_path, out_path = workdir / f"{side}_spec.json", workdir / f"{side}_offline.json"
    log_path = workdir / f"{side}_offline.log"
    spec_path.write_text(json.dumps(spec))
    cmd = [sys.executable, str(Path(__file__).resolve()), str(spec_path), str(out_path)]
    log(f"{side}: offline engine (log {log_path}, timeout {timeout:.0f} s)")
    t0 = time.time()
    with open(log_path, "w") as f:
        try:
            proc = subprocess.Popen(cmd, env=side_env(side, env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True, cwd=REPO)
            killer = threading.Timer(timeout, proc.kill)  # a hung engine must not eat the call
            killer.start()
            for line in proc.stdout:  # echo our own progress lines, keep everything in the log
                f.write(line)
                if line.startswith("[e2e") or "[atom]" in line or "Traceback" in line or "Error" in line:
                    print("    " + line.rstrip()[:300], flush=True)
            rc = proc.wait()
            killer.cancel()
        except Exception as exc:  # pragma: no cover - reported in the results
            return {"side": side, "error": repr(exc)}
    if rc != 0 or not out_path.exists():
        tail = log_path.read_text(errors="replace").splitlines()[-30:]
        return {"side": side, "error": f"rc={rc} after {time.time() - t0:.0f} s", "log_tail": tail}
    res = json.loads(out_path.read_text())
    res["log"] = str(log_path)
    return res


if __name__ == "__main__":
    # The child: one side's engine, its spec and results as JSON files.
    result = offline_child(json.loads(Path(sys.argv[1]).read_text()))
    Path(sys.argv[2]).write_text(json.dumps(result))
