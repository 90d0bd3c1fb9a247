#!/usr/bin/env python
"""Where the time goes: one engine config under the torch profiler, atom vs stock vLLM, by category.

Each side (atom; stock = ``ATOM_DISABLE_VLLM_PLUGIN=1``) runs in its own subprocess with the
engine in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, so the profiler sees the model's
kernels), does one untimed pass of the workload, then profiles one more pass. Kernel (device)
time is summed per category by kernel-name pattern (first match wins, see CATEGORIES):
attention (incl. KV-cache writes), MoE (routing + experts), GEMM, norms/rope (+ activation and
Inductor's fused elementwise/reduction kernels), other. On a CPU build there are no kernels:
operator self-CPU time is used instead (``--smoke``).

    python bench/profile_e2e.py --model /tmp/atom-e2e-models/moe-L4-v32000 --in 128 --out 128 --conc 256
    python bench/profile_e2e.py --model DIR --eager            # without CUDA graphs / compile
    python bench/profile_e2e.py --model DIR --load-format dummy --conc 1,64  # config-only DIR; one engine per side for both
    python bench/profile_e2e.py --smoke                        # CPU: tiny Qwen3, fp32, eager
    python bench/profile_e2e.py --model DIR --load-format dummy --conc 64 --arrivals continuous --seconds 3 \
        --engine '{"compilation_config": {"max_cudagraph_capture_size": 512}}'   # online serving's mixed steps

With ``--load-format dummy`` each side draws its MoE routers as bench/ab.py's sides do
(``ab_worker.draw_routers``; vLLM's dummy routers send every DeepSeek-V3 token to the same 8 experts),
and every cell records what they hold; sides whose routers differ are flagged (``not_counted``).
``--cache-root '/tmp/vcache-{side}'`` gives each side the caches bench/gpu_run.sh's ab step filled,
``--side-env atom:K=V,...`` one side's variables (e.g. ``ATOM_ENABLE_FP8_BLOCK_ON_NVIDIA=1``). A GPU cell
also says how many kernels an engine step launches (``kernels_per_step``: what a latency-bound step
pays for).

``--arrivals continuous`` profiles bench/ab.py's online cell instead of one batch: C requests always
in flight, a finished one replaced at once (bench/ab_worker.py ``continuous_window``), so most steps
carry a new prompt next to the running decodes; the result adds the window's steps, mixed steps and
output tokens per second. ``--engine`` takes the same JSON engine arguments as bench/ab.py.

Each side's child writes its output (engine log, ``[profile child N s]`` progress lines) to
``profile_<side>.log`` next to ``--json`` (else in /tmp) as it runs, so a run that ``--timeout`` or
the command's limit ends still shows how far it got. Reading the profile takes long on large
models (``key_averages``: ~20 s for a 2-s pass of a 2-layer model on a CPU); keep ``--seconds``
short (0.5) for a full-depth model.

Kernels replayed inside CUDA graphs are attributed by CUPTI like any other launch; when a build
reports graph replays as one opaque entry, use ``--eager`` for the breakdown.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parent.parent

#: category -> kernel/op name pattern (case-insensitive), tried in this order.
CATEGORIES = (
    ("attention", r"flash|fmha|attn|attention|mla|paged|reshape_and_cache|kv_cache|concat_and_cache|"
                  r"decode_.*kernel|prefill|split_kv|latent|_fwd_kernel|unified_attention|sdpa|softmax_lse|combine"),
    ("moe", r"moe|expert|topk|top_k|align_block|grouped|permute|route|atom::fused_moe"),
    ("gemm", r"gemm|gemv|matmul|cutlass|cublas|nvjet|sm90_|sm80_|wgmma|splitk|onednn_mm|aten::mm|aten::addmm|aten::bmm|"
             r"aten::linear|aten::matmul|xmma|ampere_|hopper_"),
    ("norms/rope", r"rms|norm|rope|rotary|silu|act_and_mul|gelu|rsqrt|mean|triton_poi|triton_red|triton_per|"
                   r"elementwise|vectorized|quant"),
)
_COMPILED = [(name, re.compile(pat, re.I)) for name, pat in CATEGORIES]
#: host calls that wait for the GPU (or may): where they run inside a step, the host cannot run ahead
HOST_SYNC = re.compile(r"Synchronize|cudaMemcpy$|cudaMemcpy[^A]|_local_scalar_dense|aten::item|cudaHostAlloc|cudaFreeHost|"
                       r"pin_memory|cudaStreamWaitEvent|cudaEventQuery")
#: the engine log lines that name the kernels a side chose (kept with its results)
KERNEL_LOG = re.compile(r"Selected|Using .*(backend|kernel|Attention)|\[atom\]|atom .*selected|block-fp8 linears")


def category(name: str) -> str:
    for cat, pat in _COMPILED:
        if pat.search(name):
            return cat
    return "other"


def concurrencies(args: argparse.Namespace) -> list[int]:
    """``--conc`` as a list: one engine per side serves every listed concurrency in turn."""
    return [max(int(c), 1) for c in str(args.conc).split(",")]


def engine_kwargs(args: argparse.Namespace) -> dict:
    """The ``vllm.LLM`` arguments of one side (the same for both)."""
    kw = dict(model=args.model, dtype=args.dtype, enforce_eager=args.eager, seed=0,
              max_model_len=args.in_len + args.out_len + 16, max_num_seqs=max(concurrencies(args)))
    if args.load_format:  # "dummy": a config-only model directory, vLLM draws the weights
        kw["load_format"] = args.load_format
    if args.gpu_util:
        kw["gpu_memory_utilization"] = args.gpu_util
    kw.update(json.loads(getattr(args, "engine", None) or "{}"))  # --engine: bench/ab.py's JSON, last
    return kw


_T0 = time.time()


def progress(msg: str) -> None:
    """A child's progress line (seconds since it started), written at once: the parent keeps the
    child's output in a log, so a run the timeout ends still shows how far it got."""
    print(f"[profile child {time.time() - _T0:.0f} s] {msg}", file=sys.stderr, flush=True)


def profile_side(args: argparse.Namespace) -> dict:
    """One engine; per concurrency one untimed pass, then one profiled pass -> ``{conc: result}``."""
    import torch

    from vllm import LLM, SamplingParams

    llm = LLM(**engine_kwargs(args))
    progress("engine ready")
    routers = engine_routers(args, llm)
    rng = random.Random(0)
    vocab = llm.llm_engine.model_config.get_vocab_size()
    # No detokenization: with the engine in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0) it would
    # run on the host timeline between steps, where a served engine runs it in the front-end
    # process; and its cost depends on the tokens, which differ between sides on dummy weights.
    sp = SamplingParams(temperature=0.0, max_tokens=args.out_len, ignore_eos=True, detokenize=False)
    gpu = torch.cuda.is_available()
    cells = {}
    if getattr(args, "arrivals", "batch") == "continuous":
        return {str(conc): {**profile_continuous(args, llm, conc, vocab, gpu),
                            **({"routers": routers} if routers is not None else {})} for conc in concurrencies(args)}
    for conc in concurrencies(args):
        def batch():
            return [{"prompt_token_ids": [rng.randrange(10, vocab - 32) for _ in range(args.in_len)]}
                    for _ in range(conc)]

        llm.generate(batch(), sp, use_tqdm=False)  # warm-up: JIT, autotuning, graph capture
        progress(f"C={conc}: warm-up pass done")
        outputs = []
        cells[str(conc)] = profile_pass(args, lambda: outputs.extend(llm.generate(batch(), sp, use_tqdm=False)),
                                        gpu, f"{args.side}_c{conc}")
        # the first request's first tokens: whether both sides generate alike (dummy weights do not)
        cells[str(conc)]["first_tokens"] = list(outputs[0].outputs[0].token_ids[:8]) if outputs else []
        cells[str(conc)]["out_tokens"] = conc * args.out_len
    for cell in cells.values():
        if routers is not None:
            cell["routers"] = routers
    return cells


def engine_routers(args: argparse.Namespace, llm) -> Optional[dict]:
    """What the engine's MoE routers hold (bench/ab_worker.py ``router_facts``; None without any),
    after drawing them when the weights are vLLM's dummy ones (``ab_worker.draw_routers``, as
    bench/ab.py's sides do: vLLM's dummy routers send every DeepSeek-V3 token to the same 8 experts,
    bench/NOTES.md entry 75), so a profile of a dummy cell routes as its A/B cell does, the same on
    both sides (``drawn``: how many were drawn)."""
    if str(REPO / "bench") not in sys.path:
        sys.path.insert(0, str(REPO / "bench"))
    from ab_worker import draw_routers, router_facts

    drawn = llm.apply_model(draw_routers)[0] if args.load_format == "dummy" else None
    facts = llm.apply_model(router_facts)[0]
    if facts is not None and drawn is not None:
        facts["drawn"] = drawn
    if facts is not None:
        progress(f"routers: {facts}")
    return facts


def profile_continuous(args: argparse.Namespace, llm, conc: int, vocab: int, gpu: bool) -> dict:
    """bench/ab.py's online cell on this engine: an untimed window (JIT, autotuning, the first
    mixed steps), then one profiled window of ``--seconds`` with ``conc`` requests in flight."""
    if str(REPO / "bench") not in sys.path:
        sys.path.insert(0, str(REPO / "bench"))
    from ab_worker import continuous_window

    spec = {"in_len": args.in_len, "out_len": args.out_len}
    engine = llm.llm_engine
    continuous_window(engine, spec, conc, 1, max(1.0, args.seconds / 2), vocab, detokenize=False)
    progress(f"C={conc}: untimed window done")
    window: dict = {}
    cell = profile_pass(args, lambda: window.update(continuous_window(engine, spec, conc, 2, args.seconds,
                                                                      vocab, detokenize=False)),
                        gpu, f"{args.side}_c{conc}_cont")
    cell.update(arrivals="continuous", out_tokens=window["tokens"], window_s=round(window["seconds"], 3),
                tok_s=round(window["tok_s"], 1), steps=window["steps"], mixed_steps=window["mixed_steps"],
                first_tokens=(window["first"] or [[]])[0][:8])
    return cell


def profile_pass(args: argparse.Namespace, run, gpu: bool, name: str) -> dict:
    """``run()`` under the torch profiler: kernel (or, on a CPU, operator) time by name and category."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
    t0 = time.perf_counter()
    # with_stack: Python function events in the trace, so idle_report names the Python code
    # running while the GPU waits (large traces: use a short --out)
    with profile(activities=activities, with_stack=bool(getattr(args, "with_stack", False))) as prof:
        run()
        if gpu:
            torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    progress(f"{name}: profiled pass done in {wall:.1f} s")
    busy = span = idle = None
    if args.trace_dir or gpu:  # on a GPU the trace also gives how busy the GPU was (busy_and_span_us)
        import tempfile

        trace_dir = Path(args.trace_dir or tempfile.mkdtemp(prefix="atom-profile-"))
        trace_dir.mkdir(parents=True, exist_ok=True)
        trace = trace_dir / f"{name}.json"
        prof.export_chrome_trace(str(trace))
        progress(f"{name}: trace written ({trace.stat().st_size >> 20} MiB)")
        if gpu:  # the timeline only: the kernel totals come from key_averages below
            events = trace_events(trace)
            busy, span = busy_and_span_us([e for e in events if e.get("ph") == "X" and e.get("cat") == "kernel"])
            idle = idle_report(events)
        if not args.trace_dir:
            trace.unlink()
    kernels: dict[str, dict] = {}
    host: dict[str, dict] = {}
    for evt in prof.key_averages():
        if gpu and "CUDA" not in str(getattr(evt, "device_type", "")) and evt.self_cpu_time_total:
            # host side: operators and CUDA runtime calls (launches, copies, synchronisations)
            host[evt.key] = {"self_us": float(evt.self_cpu_time_total), "calls": int(evt.count)}
        if gpu:
            us = getattr(evt, "self_device_time_total", None)
            if us is None:
                us = getattr(evt, "self_cuda_time_total", 0)
            # device kernels only: CPU-side ops have no self device time of their own
            if not us or getattr(evt, "device_type", None) is not None and "CUDA" not in str(evt.device_type):
                continue
        else:
            us = evt.self_cpu_time_total
            if not us or evt.key.startswith(("ProfilerStep", "[memory]")) or not (
                    "::" in evt.key):  # operators only (aten::, atom::, vllm::, _C::)
                continue
        kernels[evt.key] = {"us": float(us), "calls": int(evt.count), "category": category(evt.key)}
    progress(f"{name}: profile read")
    # kernel launches per engine step (idle_report's steps): what a latency-bound step pays for
    per_step = round(sum(k["calls"] for k in kernels.values()) / idle["steps"], 1) if idle and idle.get("steps") else None
    return {"side": args.side, "kernels_per_step": per_step, "time_kind": "device" if gpu else "self-cpu", "wall_s": round(wall, 3),
            "categories_us": by_category(kernels), "kernels": kernels, "busy_us": busy, "span_us": span,
            "idle": idle, "host_ops": dict(sorted(host.items(), key=lambda kv: -kv[1]["self_us"])[:60]),
            "host_syncs": {k: v for k, v in host.items() if HOST_SYNC.search(k)}}


def by_category(kernels: dict[str, dict]) -> dict[str, float]:
    """Summed time per category of ``{name: {"us", "category", ...}}``."""
    cats: dict[str, float] = {}
    for k in kernels.values():
        cats[k["category"]] = cats.get(k["category"], 0.0) + k["us"]
    return cats


def trace_events(path: Path) -> list[dict]:
    """The events of a torch-profiler chrome trace (``.json`` or ``.json.gz``)."""
    import gzip

    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f).get("traceEvents", [])


def summarize_trace(path: Path) -> dict:
    """Kernel time by name and category from a chrome trace written by the torch profiler (e.g.
    by vLLM's worker under ``--profiler-config``; ``.json`` or ``.json.gz``). GPU kernels
    (``cat == "kernel"``) when there are any; else (a CPU build) the CPU operators
    (``cat == "cpu_op"``, inclusive time, so nested operators count twice)."""
    events = trace_events(path)
    kernels = [e for e in events if e.get("ph") == "X" and e.get("cat") == "kernel"]
    kind = "device"
    if not kernels:
        kernels = [e for e in events if e.get("ph") == "X" and e.get("cat") == "cpu_op" and "::" in e.get("name", "")]
        kind = "inclusive-cpu"
    by_name: dict[str, dict] = {}
    for e in kernels:
        k = by_name.setdefault(e["name"], {"us": 0.0, "calls": 0, "category": category(e["name"])})
        k["us"] += float(e.get("dur", 0.0))
        k["calls"] += 1
    busy, span = busy_and_span_us(kernels) if kind == "device" else (None, None)
    return {"time_kind": kind, "categories_us": by_category(by_name), "kernels": by_name, "events": len(kernels),
            "busy_us": busy, "span_us": span, "idle": idle_report(events) if kind == "device" else None}


#: a kernel vLLM's model runner launches once per step, first: it splits a trace into steps
STEP_MARKER = "_compute_slot_mappings_kernel"
#: GPU activity in a torch-profiler trace
_GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def _overlap_counter(gaps: list):
    """``f(a, b)``: the time of the sorted, disjoint ``(start, end, ...)`` intervals inside ``[a, b)``."""
    import bisect

    ends = [g[1] for g in gaps]

    def inside(a: float, b: float) -> float:
        total = 0.0
        for g in gaps[bisect.bisect_right(ends, a):]:
            if g[0] >= b:
                break
            total += min(g[1], b) - max(g[0], a)
        return total
    return inside


def idle_report(events: list[dict], marker: str = STEP_MARKER, min_gap_us: float = 20.0, top: int = 8) -> dict:
    """Where the GPU waited, from a chrome trace's events: per engine step (a step starts at each
    ``marker`` kernel) its span and GPU idle time; the first step (the prefill of a fresh batch)
    apart from the median of the others; the gaps of at least ``min_gap_us`` grouped by the kernels
    on either side (``before -> after``, names cut at 40 characters); and the host operators running
    during those gaps (``cpu_op`` / ``python_function`` / ``cuda_runtime`` events, their overlap
    with the gaps summed per name)."""
    gpu = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") in _GPU_CATS),
                 key=lambda e: float(e.get("ts", 0.0)))
    if not gpu:
        return {}
    merged = _merged_intervals(gpu)
    gaps = [(merged[i][1], merged[i + 1][0], merged[i][2], merged[i + 1][3]) for i in range(len(merged) - 1)]
    starts = [float(e["ts"]) for e in gpu if e["name"] == marker]
    steps = []
    bounds = starts + [merged[-1][1]]
    in_gaps = _overlap_counter(gaps)
    for a, b in zip(bounds, bounds[1:]):
        steps.append({"span_us": b - a, "idle_us": in_gaps(a, b)})
    big = [g for g in gaps if g[1] - g[0] >= min_gap_us]
    in_big = _overlap_counter(big)
    pairs: dict[str, list] = {}
    for g0, g1, before, after in big:
        p = pairs.setdefault(f"{before[:40]} -> {after[:40]}", [0.0, 0])
        p[0] += g1 - g0
        p[1] += 1
    host: dict[str, float] = {}
    cpu = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "python_function", "cuda_runtime")]
    for e in cpu:
        a, b = float(e.get("ts", 0.0)), float(e.get("ts", 0.0)) + float(e.get("dur", 0.0))
        ov = in_big(a, b)
        if ov:
            host[e["name"][:80]] = host.get(e["name"][:80], 0.0) + ov

    def median(xs):
        xs = sorted(xs)
        return xs[len(xs) // 2] if xs else None

    rest = steps[1:]
    return {
        "steps": len(steps),
        "first_step": steps[0] if steps else None,
        "other_steps_median": {"span_us": median([x["span_us"] for x in rest]),
                               "idle_us": median([x["idle_us"] for x in rest])} if rest else None,
        "before_first_step_idle_us": sum(g1 - g0 for g0, g1, _, _ in gaps if starts and g1 <= starts[0]),
        "idle_us": sum(g1 - g0 for g0, g1, _, _ in gaps),
        "gaps": {"min_us": min_gap_us, "count": len(big), "total_us": sum(g1 - g0 for g0, g1, _, _ in big),
                 "by_neighbours": sorted(([k, round(v[0], 1), v[1]] for k, v in pairs.items()), key=lambda x: -x[1])[:top],
                 "host_during": sorted(([k, round(v, 1)] for k, v in host.items()), key=lambda x: -x[1])[:top]},
    }


def format_idle(side: str, r: dict) -> list[str]:
    """Text lines of :func:`idle_report`'s record of one side."""
    if not r:
        return []
    first, rest, g = r["first_step"] or {}, r["other_steps_median"] or {}, r["gaps"]
    lines = [f"{side}: GPU idle {r['idle_us'] / 1000:.1f} ms over {r['steps']} steps"
             f" ({r['before_first_step_idle_us'] / 1000:.1f} ms before the first step);"
             f" first step {first.get('span_us', 0) / 1000:.2f} ms, idle {first.get('idle_us', 0) / 1000:.2f} ms;"
             f" other steps (median) {(rest.get('span_us') or 0) / 1000:.3f} ms, idle {(rest.get('idle_us') or 0) / 1000:.3f} ms",
             f"  gaps >= {g['min_us']:.0f} us: {g['count']}, {g['total_us'] / 1000:.1f} ms; by the kernels either side:"]
    lines += [f"    {us / 1000:8.2f} ms {n:6d}x  {k}" for k, us, n in g["by_neighbours"]]
    lines += ["  host work during those gaps:"] + [f"    {us / 1000:8.2f} ms  {k}" for k, us in g["host_during"]]
    return lines


def _merged_intervals(events: list[dict]) -> list[list]:
    """The union of the events' ``[ts, ts + dur)`` intervals (overlapping streams count once), in
    order: ``[start, end, name of the event that ends it, name of the event that opens it]``."""
    merged: list[list] = []
    for e in sorted(events, key=lambda e: float(e.get("ts", 0.0))):
        a = float(e.get("ts", 0.0))
        b = a + float(e.get("dur", 0.0))
        if merged and a <= merged[-1][1]:
            if b > merged[-1][1]:
                merged[-1][1], merged[-1][2] = b, e["name"]
        else:
            merged.append([a, b, e["name"], e["name"]])
    return merged


def busy_and_span_us(events: list[dict]) -> tuple[float, float]:
    """GPU busy time (the union of the kernels' intervals, so overlapping streams count once) and
    the span from the first kernel's start to the last one's end. busy / span well below 1 means
    the GPU waited on the host (launches, scheduling, sampling) for the rest."""
    merged = _merged_intervals(events)
    if not merged:
        return 0.0, 0.0
    return sum(b - a for a, b, _, _ in merged), merged[-1][1] - merged[0][0]


def report(results: dict[str, dict], top: int) -> str:
    sides = [s for s in ("stock", "atom") if s in results and "categories_us" in results[s]]
    lines = []
    kind = results[sides[0]]["time_kind"] if sides else "?"
    head = "| category | " + " | ".join(f"{s} ms | {s} %" for s in sides) + (" | atom/stock |" if len(sides) == 2 else " |")
    lines += [f"Kernel time by category ({kind} time of one profiled pass):", "", head,
              "|" + "---|" * (1 + 2 * len(sides) + (1 if len(sides) == 2 else 0))]
    totals = {s: sum(results[s]["categories_us"].values()) for s in sides}
    for cat in [c for c, _ in CATEGORIES] + ["other", "total"]:
        row = [cat]
        vals = {}
        for s in sides:
            us = totals[s] if cat == "total" else results[s]["categories_us"].get(cat, 0.0)
            vals[s] = us
            row += [f"{us / 1000:.2f}", f"{100 * us / totals[s]:.0f}%" if totals[s] else "-"]
        if len(sides) == 2:
            row.append(f"{vals['atom'] / vals['stock']:.2f}x" if vals["stock"] else "-")
        lines.append("| " + " | ".join(row) + " |")
    for s in sides:
        r = results[s]
        head = f"{s}: wall {r.get('wall_s') or 0:.2f} s" if r.get("wall_s") else f"{s}:"
        if r.get("out_tokens"):
            head += f" for {r['out_tokens']} output tokens"
        if r.get("arrivals") == "continuous":  # the window's own rate and how many steps mixed in a prompt
            head += f" ({r['tok_s']} tok/s; {r['steps']} steps, {r['mixed_steps']} mixed)"
        if r.get("kernels_per_step"):
            head += f"; {r['kernels_per_step']:.0f} kernels a step"
        if r.get("span_us"):
            head += f"; GPU busy {r['busy_us'] / 1000:.1f} ms of a {r['span_us'] / 1000:.1f} ms span ({100 * r['busy_us'] / r['span_us']:.0f}%)"
        lines += [""] + format_idle(s, r.get("idle") or {})
        if r.get("routers"):
            ro = r["routers"]
            lines.append(f"{s}: {ro['count']} MoE routers, {'/'.join(ro['dtypes'])}"
                         + (f", {ro['drawn']} drawn" if "drawn" in ro else "") + f", checksum {ro.get('checksum')}")
        if r.get("host_ops"):
            lines += [f"{s}: host self time (top 15), then the calls that can wait for the GPU:"]
            lines += [f"    {v['self_us'] / 1000:8.2f} ms {v['calls']:7d}x  {k[:90]}" for k, v in list(r["host_ops"].items())[:15]]
            lines += [f"    {v['self_us'] / 1000:8.2f} ms {v['calls']:7d}x  {k[:90]}  (sync?)"
                      for k, v in sorted(r.get("host_syncs", {}).items(), key=lambda kv: -kv[1]["self_us"])]
        lines += ["", head + "; top kernels:"]
        ks = sorted(results[s]["kernels"].items(), key=lambda kv: -kv[1]["us"])[:top]
        for name, k in ks:
            lines.append(f"  {k['us'] / 1000:9.2f} ms {k['calls']:7d}x  [{k['category']:10s}] {name[:110]}")
    for s, r in results.items():
        if "error" in r:
            lines.append(f"{s}: FAILED {r['error']}")
    return "\n".join(lines)


def side_envs(specs: list[str]) -> dict[str, dict[str, str]]:
    """``--side-env``'s variables per side (``SIDE:K=V,K=V``; ``\\,`` is a comma in a value),
    all checked before any side starts."""
    envs: dict[str, dict[str, str]] = {"stock": {}, "atom": {}}
    for spec in specs:
        name, sep, rest = spec.partition(":")
        if not sep or name not in envs:
            raise SystemExit(f"--side-env {spec!r}: expected stock:K=V[,K=V] or atom:K=V[,K=V]")
        for item in re.split(r"(?<!\\),", rest):
            key, eq, value = item.partition("=")
            if not eq or not key:
                raise SystemExit(f"--side-env {spec!r}: {item!r} is not K=V")
            envs[name][key] = value.replace("\\,", ",")
    return envs


def run_child(cmd: list[str], env: dict, log: Path, timeout: float) -> tuple[Optional[int], str]:
    """Run one side's child with its output going to ``log`` as it is written (not held in a pipe),
    so that a child the timeout ends still leaves its progress lines and engine log: ``(returncode,
    log text)``, returncode None when the timeout killed it."""
    rc: Optional[int] = None
    with open(log, "w") as f:
        try:  # subprocess.run kills the child when the timeout expires
            rc = subprocess.run(cmd, env=env, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            pass
    return rc, log.read_text(errors="replace")


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--side", default="both", choices=("both", "atom", "stock"))
    ap.add_argument("--in", dest="in_len", type=int, default=128)
    ap.add_argument("--out", dest="out_len", type=int, default=128)
    ap.add_argument("--conc", default="32", help="concurrency, or a comma list served by the same engines")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--eager", action="store_true")
    ap.add_argument("--load-format", default=None,
                    help="vLLM load_format for both sides, e.g. dummy for a config-only full-depth model")
    ap.add_argument("--gpu-util", type=float, default=None, help="gpu_memory_utilization (vLLM's default if unset)")
    ap.add_argument("--smoke", action="store_true", help="CPU: tiny Qwen3 (built if needed), fp32, eager, tiny run")
    ap.add_argument("--json", default=None)
    ap.add_argument("--trace-dir", default=None, help="also write chrome traces here")
    ap.add_argument("--with-stack", action="store_true",
                    help="record Python function events: the idle report then names the Python code the host "
                         "runs while the GPU waits (a large trace: pair with a short --out)")
    ap.add_argument("--arrivals", default="batch", choices=("batch", "continuous"),
                    help="batch: one batch of C prompts per pass; continuous: C requests always in flight "
                         "for --seconds (bench/ab.py's online cell: most steps mix a prompt into the decodes)")
    ap.add_argument("--seconds", type=float, default=3.0, help="--arrivals continuous: the profiled window")
    ap.add_argument("--engine", default="{}", help="JSON engine arguments for both sides (as bench/ab.py's)")
    ap.add_argument("--cache-root", default=None,
                    help="each side's VLLM_CACHE_ROOT, {side} replaced by its name (e.g. /tmp/vcache-{side}: "
                         "the caches bench/gpu_run.sh's ab step filled)")
    ap.add_argument("--side-env", action="append", default=[], metavar="SIDE:K=V[,K=V]",
                    help="variables for one side's child (repeatable; a comma inside a value: \\,), e.g. "
                         "atom:ATOM_ENABLE_FP8_BLOCK_ON_NVIDIA=1")
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--timeout", type=float, default=500)
    ap.add_argument("--_child-out", dest="child_out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.smoke:
        sys.path.insert(0, str(REPO))
        from atom.testing.tiny_models import build

        args.model = args.model or str(build("qwen3", "/tmp/atom-e2e-models/tiny-qwen3-fp32", dtype="float32"))
        args.dtype, args.eager = "float32", True
        args.in_len, args.out_len = min(args.in_len, 16), min(args.out_len, 8)
        args.conc = ",".join(str(min(c, 4)) for c in concurrencies(args))
    if not args.model:
        ap.error("--model is required (or --smoke)")
    if args.child_out:
        res = profile_side(args)
        Path(args.child_out).write_text(json.dumps(res))
        return 0
    sides = ["stock", "atom"] if args.side == "both" else [args.side]
    envs = side_envs(args.side_env)
    results = {}
    work = Path(args.json).parent if args.json else Path("/tmp")
    work.mkdir(parents=True, exist_ok=True)
    for side in sides:
        out = work / f"profile_{side}.json"
        env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1",
               "ATOM_DISABLE_VLLM_PLUGIN": "1" if side == "stock" else "0",
               "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH", "")]))}
        if args.cache_root:  # each side's own compile / JIT caches, e.g. bench/ab.py's warm ones
            env["VLLM_CACHE_ROOT"] = args.cache_root.format(side=side)
        env.update(envs[side])
        if args.smoke:
            env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        cmd = [sys.executable, str(Path(__file__).resolve()), *argv, "--side", side, "--_child-out", str(out)]
        if args.smoke and "--model" not in argv:
            cmd += ["--model", args.model]
        t0 = time.time()
        rc, text = run_child(cmd, env, work / f"profile_{side}.log", args.timeout)
        print(f"[profile] {side}: rc={rc} in {time.time() - t0:.0f} s", flush=True)
        if rc != 0 or not out.exists():
            results[side] = {"error": "timeout after %.0f s" % args.timeout if rc is None else f"rc={rc}",
                             "tail": text[-3000:]}
            print(results[side]["tail"])
            continue
        results[side] = json.loads(out.read_text())
        log = [ln for ln in text.splitlines() if KERNEL_LOG.search(ln)]
        for cell in results[side].values():
            cell["kernel_log_lines"] = log[-40:]
    cells: dict[str, dict] = {}
    for side, r in results.items():
        for conc in ([c for c in r if c.isdigit()] if "error" not in r else []):
            cells.setdefault(conc, {})[side] = r[conc]
    mismatch = ""
    if len(results) == 2 and not any("error" in r for r in results.values()):
        if str(REPO / "bench") not in sys.path:
            sys.path.insert(0, str(REPO / "bench"))
        from ab import router_mismatch

        mismatch = router_mismatch({s: next(iter(r.values()), {}) for s, r in results.items()})
        if mismatch:
            print(f"[profile] WARNING: {mismatch}: the two profiles ran different models", flush=True)
    for conc, per_side in cells.items():
        cont = ", continuous arrivals" if args.arrivals == "continuous" else ""
        print(f"\n## {args.in_len}/{args.out_len} at C={conc}{cont}\n", flush=True)
        print(report(per_side, args.top), flush=True)
    for side, r in results.items():
        if "error" in r:
            print(f"{side}: FAILED {r['error']}")
        else:
            print(f"\n{side}'s kernel choices (engine log):", *next(iter(r.values()))["kernel_log_lines"], sep="\n  ")
    if args.json:
        Path(args.json).write_text(json.dumps({"cells": cells, "errors": {s: r for s, r in results.items() if "error" in r},
                                               **({"not_counted": mismatch} if mismatch else {})}, indent=1))
    return 0 if all("error" not in r for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
