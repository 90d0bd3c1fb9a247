#!/usr/bin/env python
"""Where a cold engine start goes, atom vs stock vLLM (issue #17 lever 5): one fresh process per
side, each with empty vLLM / Inductor / Triton caches, builds an offline ``LLM`` (vLLM's defaults:
torch.compile, CUDA graphs) on MODEL and generates once; the phases vLLM logs (weights, Dynamo,
Inductor, graph capture, engine init) and vLLM's compilation counters (piecewise graphs seen,
Inductor compiles started, artifacts saved: one per graph Inductor really compiled, a piece
isomorphic to an earlier one is reused instead) per side.

    python3 bench/startup_phases.py --model /tmp/atom-e2e-models/moe-L4-v32000 --json out.json

The engine runs in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so the counters are the
worker's. Stock is ``ATOM_DISABLE_VLLM_PLUGIN=1``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time

#: phase name -> pattern of vLLM's log line (the first group is seconds).
PHASES = {
    "weights_s": r"Loading weights took ([\d.]+) seconds",
    "model_loading_s": r"Model loading took [\d.]+ GiB(?: memory)? and ([\d.]+) seconds",
    "dynamo_s": r"Dynamo bytecode transform time: ([\d.]+) s",
    "inductor_s": r"Compiling a graph for compile range .* takes ([\d.]+) s",
    "torch_compile_s": r"torch\.compile takes ([\d.]+) s in total",
    "graph_capture_s": r"Graph capturing finished in ([\d.]+) secs",
    "init_engine_s": r"init engine \(.*?\) took ([\d.]+) s",
    "init_compilation_s": r"init engine \(.*?\) took [\d.]+ s(?:econds)? \(compilation: ([\d.]+) s\)",
}


def phases(log: str) -> dict:
    """Seconds per phase (summed over repeated lines; None where vLLM logged none) of one engine log."""
    out = {}
    for name, pattern in PHASES.items():
        found = [float(x) for x in re.findall(pattern, log)]
        out[name] = round(sum(found), 2) if found else None
    return out
COUNTERS = ("num_graphs_seen", "num_piecewise_graphs_seen", "num_piecewise_capturable_graphs_seen",
            "num_backend_compilations", "num_inductor_compiles", "num_compiled_artifacts_saved",
            "num_cache_entries_updated")


def child(model: str, out: str) -> None:
    from vllm import LLM, SamplingParams
    from vllm.compilation.counter import compilation_counter

    t0 = time.perf_counter()
    llm = LLM(model=model, dtype="bfloat16", max_model_len=512, max_num_seqs=64, gpu_memory_utilization=0.45, seed=0)
    ready = time.perf_counter() - t0
    llm.generate([{"prompt_token_ids": list(range(3, 35))}], SamplingParams(temperature=0.0, max_tokens=8))
    cls = llm.apply_model(lambda m: f"{type(m).__module__}.{type(m).__qualname__}")[0]
    with open(out, "w") as f:
        json.dump({"ready_s": round(ready, 1), "model_class": cls,
                   "counters": {k: getattr(compilation_counter, k, None) for k in COUNTERS}}, f)


def run_side(side: str, model: str, work: str, timeout: float) -> dict:
    caches = {k: os.path.join(work, side, k) for k in ("vllm", "inductor", "triton")}
    for path in caches.values():
        shutil.rmtree(path, ignore_errors=True)
        os.makedirs(path)
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CACHE_ROOT": caches["vllm"],
           "TORCHINDUCTOR_CACHE_DIR": caches["inductor"], "TRITON_CACHE_DIR": caches["triton"]}
    env.pop("ATOM_DISABLE_VLLM_PLUGIN", None)
    if side == "stock":
        env["ATOM_DISABLE_VLLM_PLUGIN"] = "1"
    out = os.path.join(work, side, "child.json")
    log_path = os.path.join(work, side, "engine.log")
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.run([sys.executable, __file__, "--_child", model, out], env=env, stdout=log,
                              stderr=subprocess.STDOUT, timeout=timeout)
    text = open(log_path).read()
    result = {"side": side, "rc": proc.returncode, "wall_s": round(time.perf_counter() - t0, 1)}
    result.update(phases(text))
    if proc.returncode == 0:
        result.update(json.load(open(out)))
    else:
        result["tail"] = text[-3000:]
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model")
    ap.add_argument("--sides", default="stock,atom")
    ap.add_argument("--workdir", default="/tmp/startup-phases")
    ap.add_argument("--timeout", type=float, default=280)
    ap.add_argument("--json")
    ap.add_argument("--_child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._child:
        child(*args._child)
        return 0
    results = [run_side(side, args.model, args.workdir, args.timeout) for side in args.sides.split(",")]
    keys = ["rc", "wall_s", "ready_s", *PHASES, "model_class"]
    for r in results:
        print(r["side"], {k: r.get(k) for k in keys}, r.get("counters"), flush=True)
        if r["rc"]:
            print(r.get("tail", ""))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0 if all(r["rc"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
