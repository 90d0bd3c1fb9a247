#!/usr/bin/env python3
"""SGLang with atom vs stock SGLang on one GPU, both engines up at once, cells interleaved.

Per model (random weights, realistic dims, few layers; checkpoints from ``bench/e2e_models.py``'s
builder, cached under ``--model-dir``):

* two engine subprocesses on the same GPU, each with ``--mem-fraction-static`` (default 0.38):
  **stock** (``ATOM_DISABLE_SGLANG_PLUGIN=1``, SGLang's own model, ``--attention-backend``
  ``--stock-backend``, default ``triton``: the staged kernel package has no FlashAttention 3)
  and **atom** (atom's model on atom's ``atom`` backend). Both bf16, page size 16, CUDA graphs
  for decode up to ``--max-bs`` (prefill graphs off on both), ``--sampling-backend pytorch``,
  radix cache off (fresh prompts);
* greedy agreement: the same ``--agree-prompts`` prompts on both, the exact fraction of output
  positions that agree and the fraction before each sequence's first divergence (bf16 kernels
  differ: not 100%; bench/agreement.py's fp32 reference is the vLLM-side yardstick);
* throughput: per cell IN/OUT@C (C random-token prompts submitted together, ``ignore_eos``),
  ``--reps`` timed repetitions per side after one warm-up, the sides alternating A B B A ... so
  both see the same power and clock state (../shared/gpu/README.md section 5); output tokens/s
  per side (median), the atom/stock ratio per repetition pair and its range.

    python bench/sglang_bench.py --models dense --out sglang_dense.json
    python bench/sglang_bench.py --check          # import SGLang's CUDA engine path, list what is missing
    python bench/sglang_bench.py --smoke          # CPU: tiny Qwen3, fp32, no graphs (the SGLang test env)

Results: ``--out`` JSON and a markdown table on stdout. Budget (``--budget`` seconds) stops
starting new cells.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "bench")]  # atom, and bench/e2e_*'s modules (imported as scripts)

SIDES = ("stock", "atom")


def log(msg: str) -> None:
    print(f"[sglang-bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------ engine child
def child(args: argparse.Namespace) -> None:
    """One engine; reads JSON commands on stdin, answers ``RESULT {...}`` lines on stdout."""
    import sglang

    kwargs = json.loads(args.engine_kwargs)
    engine = sglang.Engine(model_path=args.model, **kwargs)
    print("READY", flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            break
        params = {"temperature": 0.0, "max_new_tokens": cmd["out_len"], "ignore_eos": True}
        t0 = time.perf_counter()
        outs = engine.generate(input_ids=cmd["prompts"], sampling_params=params)
        seconds = time.perf_counter() - t0
        tokens = [o["output_ids"] for o in outs]
        print("RESULT " + json.dumps({"seconds": seconds, "out_tokens": sum(map(len, tokens)),
                                      "tokens": tokens if cmd.get("return_tokens") else None}), flush=True)
    engine.shutdown()


class Side:
    """A running engine subprocess of one side."""

    def __init__(self, side: str, model: str, engine_kwargs: dict, workdir: Path, smoke: bool) -> None:
        env = dict(os.environ)
        env.pop("ATOM_DISABLE_SGLANG_PLUGIN", None)
        if side == "stock":
            env["ATOM_DISABLE_SGLANG_PLUGIN"] = "1"
        self.side, self.log_path = side, workdir / f"{side}.log"
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--child", "--model", model, "--engine-kwargs", json.dumps(engine_kwargs)]
            + (["--smoke"] if smoke else []),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log_path.open("w"), text=True, env=env,
            cwd=REPO)
        self.started = time.time()

    def wait_ready(self, timeout: float) -> float:
        for line in self.proc.stdout:
            if line.startswith("READY"):
                return time.time() - self.started
        raise RuntimeError(f"{self.side} engine exited before it was ready: see {self.log_path}\n"
                           + self.log_path.read_text()[-4000:])

    def run(self, prompts: list[list[int]], out_len: int, return_tokens: bool = False) -> dict:
        self.proc.stdin.write(json.dumps({"op": "gen", "prompts": prompts, "out_len": out_len,
                                          "return_tokens": return_tokens}) + "\n")
        self.proc.stdin.flush()
        for line in self.proc.stdout:
            if line.startswith("RESULT "):
                return json.loads(line[len("RESULT "):])
        raise RuntimeError(f"{self.side} engine died: {self.log_path.read_text()[-4000:]}")

    def close(self) -> None:
        try:
            self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
            self.proc.stdin.flush()
            self.proc.wait(timeout=60)
        except Exception:
            self.proc.kill()


# ------------------------------------------------------------------------------------------ driver
def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    from e2e_report import agreement as e2e_agreement

    return e2e_agreement(a, b)


def prompts(rng: random.Random, n: int, length: int, vocab: int) -> list[list[int]]:
    return [[rng.randrange(10, vocab - 10) for _ in range(length)] for _ in range(n)]


def bench_model(name: str, args: argparse.Namespace, deadline: float) -> dict:
    workdir = Path(args.workdir) / name
    workdir.mkdir(parents=True, exist_ok=True)
    if args.smoke:
        from atom.testing.tiny_models import build

        model, vocab = str(build("qwen3" if name == "dense" else "qwen3_moe", Path(args.model_dir) / f"smoke-{name}",
                                 dtype="float32")), 1000
    else:
        from e2e_models import build_model

        out = Path(args.model_dir) / f"{name}-L{args.layers}-v{args.vocab}"
        info = build_model(name, args.layers, out, args.vocab, 64, 0.02)
        model, vocab = str(out), info["vocab"]
    common = dict(dtype="float32" if args.smoke else "bfloat16", page_size=16, sampling_backend="pytorch",
                  disable_radix_cache=True, log_level="info", skip_server_warmup=True,
                  mem_fraction_static=args.mem_fraction, cuda_graph_max_bs_decode=args.max_bs,
                  max_running_requests=args.max_bs,
                  # decode graphs on both sides; SGLang's prefill graphs (torch.compile pieces)
                  # are off on both: atom's backend does not serve that path yet
                  disable_prefill_cuda_graph=True)
    if args.smoke:
        common.update(device="cpu", disable_cuda_graph=True, max_total_tokens=4096)
        common.pop("mem_fraction_static")
    kwargs = {"stock": dict(common, attention_backend=args.stock_backend),
              "atom": dict(common, attention_backend="atom")}
    result: dict[str, Any] = {"model": name, "checkpoint": model, "engine_kwargs": kwargs, "cells": []}
    sides = {}
    try:
        for side in SIDES:  # one at a time: two concurrent starts would contend for the GPU and CPU
            sides[side] = Side(side, model, kwargs[side], workdir, args.smoke)
            result[f"{side}_start_s"] = round(sides[side].wait_ready(600), 1)
            log(f"{name}: {side} engine ready in {result[f'{side}_start_s']} s")
        rng = random.Random(1234)
        agree_prompts = prompts(rng, args.agree_prompts, args.agree_in, vocab)
        toks = {s: sides[s].run(agree_prompts, args.agree_out, return_tokens=True)["tokens"] for s in SIDES}
        result["agreement"] = agreement(toks["stock"], toks["atom"])
        log(f"{name}: agreement {result['agreement']}")
        for cell in args.cells.split(","):
            lens, conc = cell.split("@")
            in_len, out_len = map(int, lens.split("/"))
            conc = int(conc)
            if time.time() > deadline:
                result["cells"].append({"cell": cell, "skipped": "budget"})
                continue
            per_side: dict[str, list[float]] = {s: [] for s in SIDES}
            for s in SIDES:  # warm-up
                sides[s].run(prompts(rng, conc, in_len, vocab), out_len)
            for rep in range(args.reps):
                order = SIDES if rep % 2 == 0 else SIDES[::-1]
                for s in order:
                    r = sides[s].run(prompts(rng, conc, in_len, vocab), out_len)
                    per_side[s].append(r["out_tokens"] / r["seconds"])
            ratios = [a / b for a, b in zip(per_side["atom"], per_side["stock"])]
            row = {"cell": cell, "stock_tok_s": round(statistics.median(per_side["stock"]), 1),
                   "atom_tok_s": round(statistics.median(per_side["atom"]), 1),
                   "ratio_median": round(statistics.median(ratios), 3),
                   "ratio_min": round(min(ratios), 3), "ratio_max": round(max(ratios), 3),
                   "reps": {s: [round(x, 1) for x in v] for s, v in per_side.items()}}
            result["cells"].append(row)
            log(f"{name}: {row}")
    finally:
        for s in sides.values():
            s.close()
    for s in SIDES:  # what each side ran (backend and graph lines), for the record
        text = (workdir / f"{s}.log").read_text(errors="replace") if (workdir / f"{s}.log").exists() else ""
        result[f"{s}_log"] = [ln for ln in text.splitlines()
                              if "atom" in ln or "Capture" in ln or "attention backend" in ln.lower()][-20:]
    return result


def table(results: list[dict]) -> str:
    lines = ["| model | cell IN/OUT@C | stock tok/s | atom tok/s | atom/stock (median, range) |",
             "|---|---|---|---|---|"]
    for r in results:
        for c in r["cells"]:
            if "skipped" in c:
                lines.append(f"| {r['model']} | {c['cell']} | skipped ({c['skipped']}) | | |")
                continue
            lines.append(f"| {r['model']} | {c['cell']} | {c['stock_tok_s']} | {c['atom_tok_s']} | "
                         f"{c['ratio_median']} ({c['ratio_min']}-{c['ratio_max']}) |")
        a = r.get("agreement", {})
        lines.append(f"| {r['model']} | greedy agreement, {a.get('prompts')} prompts | positions "
                     f"{a.get('agreement')} | before first divergence {a.get('prefix_agreement')} | "
                     f"identical {a.get('identical_sequences')} |")
    return "\n".join(lines)


def check() -> int:
    """Import what SGLang's CUDA engine path imports (and atom's plugin); print what is missing."""
    missing = []
    for mod in ("sglang", "sglang.srt.entrypoints.engine", "sglang.srt.managers.scheduler",
                "sglang.srt.model_executor.model_runner", "sglang.srt.layers.sampler",
                "sglang.srt.layers.attention.triton_backend", "sglang.srt.models.qwen3", "sglang.srt.models.qwen3_moe",
                "atom.plugin.sglang.attention_mha", "atom.plugin.sglang.model_wrapper"):
        try:
            __import__(mod)
            print(f"ok {mod}")
        except Exception as exc:  # noqa: BLE001 - the point is to list every failure
            missing.append(f"{mod}: {type(exc).__name__}: {exc}")
            print(f"MISSING {missing[-1]}")
    import importlib.metadata as md

    print("entry points:", [e.value for e in md.entry_points(group="sglang.srt.plugins")])
    return 1 if missing else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="dense")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--cells", default="128/128@1,128/128@32,128/128@256")
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--agree-prompts", type=int, default=64)
    ap.add_argument("--agree-in", type=int, default=128)
    ap.add_argument("--agree-out", type=int, default=64)
    ap.add_argument("--stock-backend", default="triton")
    ap.add_argument("--max-bs", type=int, default=256)
    ap.add_argument("--mem-fraction", type=float, default=0.38)
    ap.add_argument("--model-dir", default="/tmp/atom-e2e-models")
    ap.add_argument("--workdir", default="/tmp/sglang-bench")
    ap.add_argument("--budget", type=float, default=500)
    ap.add_argument("--out")
    ap.add_argument("--smoke", action="store_true", help="CPU: tiny fp32 models, no graphs, small cells")
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--engine-kwargs", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return 0
    if args.check:
        return check()
    if args.smoke:
        args.cells, args.reps, args.agree_prompts, args.agree_in, args.agree_out, args.max_bs = "16/8@1,16/8@4", 2, 4, 16, 8, 8
        args.stock_backend = "torch_native"
    t0 = time.time()
    results = []
    for name in args.models.split(","):
        results.append(bench_model(name, args, t0 + args.budget))
        if args.out:
            Path(args.out).write_text(json.dumps({"results": results, "elapsed_s": round(time.time() - t0, 1)}, indent=1))
    print(table(results))
    print(f"elapsed {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
