#!/usr/bin/env python
"""End to end: vLLM with atom vs the same vLLM without it (``ATOM_DISABLE_VLLM_PLUGIN=1``).

For each model (random weights, realistic dims, fewer layers) it runs, in one invocation:

1. offline throughput: one engine per side, each in its own subprocess (plugins load once per
   process), stock first. Per cell (input/output length x concurrency C): C random-token prompts
   submitted together (the engine runs them as one batch of C), greedy, ``ignore_eos``; warm-up
   passes, then timed repetitions with fresh prompts (the prefix cache stays on and would
   otherwise skip prefill). Output tokens/s per cell, atom/stock ratio, seconds per cell.
2. greedy agreement: the same N prompts (fixed seed) on both sides; the exact fraction of output
   positions whose token agrees, and the fraction before each sequence's first divergence.
3. ``--serve``: TTFT / TPOT / ITL and output tokens/s from vLLM's own serving benchmark
   (``vllm.benchmarks.serve``, the code behind ``vllm bench serve``, in 0.26 and 0.32 alike, run
   in this process) against a real OpenAI server on localhost (``atom.testing.server``), one
   server per side, random dataset, ``--max-concurrency`` C, ``ignore_eos``, prompts drawn per
   cell. ``--serve --skip-offline --serve-agreement`` measures everything with one engine per
   side (the greedy agreement then goes through ``/v1/completions``); ``--serve-profile IN/OUT@C``
   adds one cell under vLLM's own torch profiler in each server and a kernel-time table by
   category (bench/profile_e2e.py's categories). ``--serve-batch`` adds, after each serving cell,
   the offline-style throughput of that cell on the same server: C fresh prompts in one
   non-streaming request, so per-token streaming through the API server and the client does
   not enter it (on the H100 at C=256 stock's batch throughput was 1.6-2.3x its streaming
   cell's: there the streaming cells time the serving path, bench/NOTES.md entry 9).

Models (``--models``): ``dense`` (Qwen3-8B dims: hidden 4096, 32 q / 8 kv heads, head 128, ffn
12288), ``moe`` (Qwen3-30B-A3B dims: hidden 2048, 32/4 heads, 128 experts top-8, expert ffn 768),
``mla`` (DeepSeek-V3 dims: hidden 7168, 128-head MLA with q_lora 1536 / kv_lora 512 / rope 64,
experts of ffn 2048 top-8 with one shared expert, sigmoid grouped routing; routed experts cut
from 256 to ``--mla-experts`` so that a layer fits a quick build; first layer dense).
Layers: ``--layers`` (default 4 / 4 / 2). Vocabulary ``--vocab`` (default 32000) with a BPE
tokenizer trained offline. Checkpoints are cached under ``--model-dir``.

    python bench/e2e.py --models dense --lengths 128/128 --concurrency 1,32,256 --cell-seconds 30 --out e2e.json
    python bench/e2e.py --models moe --lengths 1024/1024 --concurrency 32 --skip-agreement
    python bench/e2e.py --models dense --serve --skip-offline --concurrency 1,32
    python bench/e2e.py --models dense --layers dense=16 --serve --skip-offline --serve-agreement \
        --serve-max-out-tokens 65536 --serve-profile 128/128@256     # the H100 table: one engine per side
    python bench/e2e.py --smoke --out /tmp/smoke.json       # CPU: tiny models, fp32, eager

Everything is budgeted for a 10-minute GPU call: cells are selectable and each prints its
elapsed time; ``--budget`` (seconds) stops starting new work when it runs out (reported as
skipped). Results: ``--out`` JSON and a markdown table on stdout (for docs/performance.md).

This file is the CLI; the steps live next to it: ``e2e_models.py`` (checkpoints),
``e2e_offline.py`` (the offline engines; also their subprocess), ``e2e_serve.py`` (the servers),
``e2e_report.py`` (agreement, tables, the JSON), ``e2e_common.py`` (what they share).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any, Optional

from e2e_common import REPO, base_env, log, parse_pairs
from e2e_models import MODELS, prepare_model
from e2e_offline import run_offline
from e2e_report import save
from e2e_serve import run_serving

SMOKE_DEFAULTS = dict(lengths="16/8", concurrency="1,4", agree_prompts=8, reps=1, warmup=1,
                      serve_concurrency="2", dtype="float32")


# ------------------------------------------------------------------------------------- CLI
def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--smoke", action="store_true", help="CPU smoke run: tiny models, fp32, eager, tiny lengths")
    ap.add_argument("--models", default="dense,moe,mla", help="comma list of: " + ", ".join(MODELS))
    ap.add_argument("--layers", default="", help="decoder layers: N for all, or name=N,... (default 4/4/2)")
    ap.add_argument("--lengths", default=None, help="input/output lengths, comma list (default 128/128,1024/1024)")
    ap.add_argument("--concurrency", default=None, help="batch sizes / concurrencies (default 1,32,256)")
    ap.add_argument("--serve", action="store_true", help="also run the serving benchmark (TTFT/TPOT)")
    ap.add_argument("--serve-concurrency", default=None, help="concurrencies for --serve (default: --concurrency)")
    ap.add_argument("--serve-prompts-per-conc", type=int, default=4, help="prompts per serving cell = this x C")
    ap.add_argument("--serve-max-out-tokens", type=int, default=0,
                    help="cap a serving cell's prompts at this many output tokens (never below C prompts); 0: no cap")
    ap.add_argument("--serve-agreement", action="store_true",
                    help="greedy agreement through the servers (no offline engine is started for it)")
    ap.add_argument("--serve-profile", default="",
                    help="IN/OUT@C: after the serving cells, profile one such cell in each server with vLLM's "
                         "torch profiler (--profiler-config) and report kernel time by category")
    ap.add_argument("--profile-dir", default="/tmp/atom-e2e-profile", help="where the servers write traces")
    ap.add_argument("--serve-batch", action="store_true",
                    help="after each serving cell, its throughput as an offline run measures it: C fresh "
                         "prompts in one non-streaming request to the same server (no per-token streaming)")
    ap.add_argument("--no-serve-warmup", dest="serve_warmup", action="store_false")
    ap.add_argument("--skip-serve", action="store_true", help="no serving benchmark (overrides --serve)")
    ap.add_argument("--skip-offline", action="store_true", help="no offline throughput cells")
    ap.add_argument("--skip-agreement", action="store_true")
    ap.add_argument("--agree-prompts", type=int, default=None, help="prompts for greedy agreement (default 256)")
    ap.add_argument("--agree-lengths", default=None, help="in/out of the agreement run (default the first --lengths)")
    ap.add_argument("--sides", default="stock,atom")
    ap.add_argument("--reps", type=int, default=None, help="timed runs per cell (default 2)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed runs per cell (default 1)")
    ap.add_argument("--cell-seconds", type=float, default=0.0,
                    help="keep adding timed runs until a cell has this many seconds of them (GPU: 30)")
    ap.add_argument("--dtype", default=None, help="default bfloat16 (--smoke: float32)")
    ap.add_argument("--eager", action="store_true", help="enforce_eager (no CUDA graphs, no compile)")
    ap.add_argument("--llm-kwargs", default="", help="JSON dict added to LLM(...) on both sides")
    ap.add_argument("--gpu-memory-utilization", type=float, default=None)
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size (GPUs) on both sides")
    ap.add_argument("--ep", action="store_true", help="expert parallelism for the MoE layers (with --tp)")
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--mla-experts", type=int, default=64)
    ap.add_argument("--init-std", type=float, default=0.02)
    ap.add_argument("--model-dir", default="/tmp/atom-e2e-models")
    ap.add_argument("--workdir", default=None, help="logs and per-side results (default: next to --out)")
    ap.add_argument("--out", default=None, help="results JSON")
    ap.add_argument("--budget", type=float, default=3600, help="seconds for the whole invocation")
    args = ap.parse_args(argv)
    smoke = SMOKE_DEFAULTS if args.smoke else {}
    args.lengths = parse_pairs(args.lengths or smoke.get("lengths", "128/128,1024/1024"))
    args.concurrency = [int(c) for c in (args.concurrency or smoke.get("concurrency", "1,32,256")).split(",")]
    sc = args.serve_concurrency or smoke.get("serve_concurrency")
    args.serve_conc = [int(c) for c in sc.split(",")] if sc else args.concurrency
    args.agree_prompts = 0 if args.skip_agreement else (
        args.agree_prompts if args.agree_prompts is not None else smoke.get("agree_prompts", 256))
    args.agree_lengths = parse_pairs(args.agree_lengths)[0] if args.agree_lengths else args.lengths[0]
    args.reps = args.reps or smoke.get("reps", 2)
    args.warmup = args.warmup if args.warmup is not None else smoke.get("warmup", 1)
    args.dtype = args.dtype or smoke.get("dtype", "bfloat16")
    args.eager = args.eager or args.smoke
    args.do_serve = args.serve and not args.skip_serve
    if (args.serve_agreement or args.serve_profile or args.serve_batch) and not args.do_serve:
        ap.error("--serve-agreement / --serve-profile / --serve-batch need --serve")
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    for m in args.models:
        if m not in MODELS:
            ap.error(f"unknown model {m!r}; choose from {', '.join(MODELS)}")
    args.sides = [s for s in args.sides.split(",") if s]
    layers = {}
    for part in filter(None, args.layers.split(",")):
        k, sep, v = part.partition("=")
        if sep:
            layers[k] = int(v)
        else:
            layers.update({m: int(k) for m in MODELS})
    args.layers_by_model = {m: layers.get(m, MODELS[m][2]) for m in MODELS}
    args.max_model_len = max(i + o for i, o in args.lengths + [args.agree_lengths]) + 16
    return args


# ------------------------------------------------------------------------------------- steps
def engine_env(args: argparse.Namespace) -> tuple[dict[str, str], dict[str, str]]:
    """(the servers' environment, the offline engines') for this invocation."""
    env = base_env()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
    if args.smoke:
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        env.setdefault("TRITON_INTERPRET", "1")
    # --smoke: offline engines keep their engine core in-process (one vLLM import less each)
    offline_env = {**env, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"} if args.smoke else env
    return env, offline_env


def output_paths(args: argparse.Namespace) -> tuple[Optional[Path], Path]:
    """(the results JSON or None, the work folder for logs and per-side results)."""
    out_path = Path(args.out) if args.out else None
    workdir = Path(args.workdir) if args.workdir else (
        out_path.parent / (out_path.stem + "_work") if out_path else Path("/tmp/atom-e2e-work"))
    workdir.mkdir(parents=True, exist_ok=True)
    return out_path, workdir


def llm_kwargs_for(args: argparse.Namespace, model_path: str) -> dict[str, Any]:
    """``LLM(...)``'s arguments on both sides."""
    kwargs = dict(model=model_path, dtype=args.dtype, enforce_eager=args.eager, seed=0,
                  max_model_len=args.max_model_len,
                  max_num_seqs=max(args.concurrency + [min(args.agree_prompts, 256) or 1]))
    if args.gpu_memory_utilization:
        kwargs["gpu_memory_utilization"] = args.gpu_memory_utilization
    if args.tp > 1:
        kwargs["tensor_parallel_size"] = args.tp
    if args.ep:
        kwargs["enable_expert_parallel"] = True
    if args.llm_kwargs:
        kwargs.update(json.loads(args.llm_kwargs))
    return kwargs


def bench_model(name: str, m: dict, args: argparse.Namespace, envs: tuple[dict[str, str], dict[str, str]],
                workdir: Path, deadline: float, save_partial: Any) -> None:
    """Every requested measurement of model ``name``, into ``m``: its checkpoint, the offline
    side (throughput cells, agreement), the serving side."""
    env, offline_env = envs
    tm = time.time()
    if time.time() > deadline:
        m["skipped"] = "budget"
        log(f"{name}: skipped (budget)")
        return
    info, model_path = prepare_model(name, args)
    m["model"] = {**info, "path": model_path}
    log(f"{name}: checkpoint ready ({info.get('params', 0) / 1e9:.2f} B params) after {time.time() - tm:.0f} s")
    mdir = workdir / name
    mdir.mkdir(parents=True, exist_ok=True)
    if not args.skip_offline or (args.agree_prompts and not args.serve_agreement):
        run_offline(name, m, args, info, llm_kwargs_for(args, model_path), offline_env, mdir, deadline)
    if args.do_serve:
        run_serving(name, m, args, model_path, info["vocab"], env, mdir, deadline, progress=save_partial)
    m["model_s"] = round(time.time() - tm, 1)
    log(f"{name}: done in {m['model_s']} s")
    save_partial()  # partial results survive a killed call


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    t_start = time.time()
    deadline = t_start + args.budget
    sys.path.insert(0, str(REPO))  # atom.testing (tiny models, server) from this checkout
    envs = engine_env(args)
    out_path, workdir = output_paths(args)
    result: dict[str, Any] = {"command": "python bench/e2e.py " + " ".join(argv), "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                              "host": platform.node(), "args": {k: v for k, v in vars(args).items()}, "models": {}}
    for name in args.models:
        result["models"][name] = {}
        bench_model(name, result["models"][name], args, envs, workdir, deadline,
                    save_partial=lambda: save(result, t_start, out_path, final=False))
    save(result, t_start, out_path, final=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
