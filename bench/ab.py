#!/usr/bin/env python
"""A/B(/C) of vLLM sides on one GPU, interleaved, repeated, with intervals (the speed protocol).

    python bench/ab.py --model DIR --side stock:ATOM_DISABLE_VLLM_PLUGIN=1 --side atom: \\
        [--side old:PYTHONPATH=/tmp/atom-old:/tmp/site] --in 128 --out 128 --conc 32 \\
        --rounds 5 --window 20 --gpu-util 0.28 --json cell.json

Every side is one offline vLLM engine in its own process (``bench/ab_worker.py``; plugins read
the environment once per process), all alive at once on the same GPU (``--gpu-util`` each), so
that the sides see the same thermal and power state. The sides then take turns: round r runs a
measurement window (``--window`` seconds of back-to-back batches of ``--conc`` fresh random
prompts, ``--in`` tokens in, ``--out`` out, greedy; with ``--arrivals continuous``, ``--conc``
requests kept in flight, so that new prompts arrive while others decode, as in online serving)
on each side, starting with a different side each round. ``--launches N`` repeats this N times
with freshly started engines (the protocol's >= 3 launches per side in one command; seeds differ
per launch, every window counts in the interval); launch L starts the sides in an order rotated by
L - 1, so that no side is always the first engine on the GPU (the record's ``start_orders``). A
side's ``KEY=VALUE,KEY=VALUE`` sets its environment (``NAME:`` for none).

Reported per side: the median output tok/s over the rounds and its range; per non-reference
side the ratio of medians to the first side (the reference) with a bootstrap 95 % interval over
the rounds (a win only when the interval's low end is above 1.0, a loss only when its high end
is below 1.0); greedy agreement of the first tokens with the reference on identical prompts; the
model class and attention impls each side built, and the kernel-selection lines of its log; GPU
clocks, power, clock-event reasons, utilization and the power limit sampled every 500 ms during each
window (windows with the software power cap or a thermal reason active are flagged; a window that drew a
small share of the limit at full clocks kept the GPU waiting on the host); and what each side's MoE
routers hold (``ab_worker.router_facts``). A cell whose sides' routers differ (one quantised, one
missing, other values) is recorded ``not_counted``. On dummy weights (``"load_format": "dummy"``
in ``--engine``) each side draws its routers itself, the same values everywhere
(``ab_worker.draw_routers``): vLLM's own dummy routers send every DeepSeek-V3 token to the same
experts.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Optional

from ab_worker import ROUTER_FLOAT_DTYPES
from e2e_models import dummy_load_peak

HERE = Path(__file__).resolve().parent
#: nvidia-smi clocks_event_reasons bits that mean the clocks were held down (SW power cap,
#: HW slowdown, SW/HW thermal, power brake).
THROTTLE_BITS = 0x4 | 0x8 | 0x20 | 0x40 | 0x80
#: vLLM log lines that say which kernels a side runs (attention, MoE, linear methods).
KERNEL_LINE = re.compile(r"Using \S+ (attention )?backend|Selected .* for |[Uu]sing .*(MoE|Experts|GEMM|[Kk]ernel)"
                         r"|atom attention backend .* selected|atom attention not used"
                         r"|MLA decode rows .* on |MHA steps with multi-token rows|block-fp8 linears: "
                         r"|kv cache block size")


def parse_side(text: str) -> tuple[str, dict[str, str]]:
    """``NAME:KEY=VALUE,KEY=VALUE``; a comma inside a value is written ``\\,`` (e.g. a list of patch
    ids for ATOM_DISABLED_PATCHES)."""
    name, _, rest = text.partition(":")
    env = dict(kv.replace("\\,", ",").split("=", 1) for kv in re.split(r"(?<!\\),", rest) if kv)
    return name, env


class Clocks:
    """nvidia-smi samples (time, sm MHz, power W, event-reason bits, temperature, % of the sample
    period a kernel ran, power limit W) in a thread. The last two say whether a window kept the GPU
    busy: a window that draws a small share of the limit at full clocks timed the host, not kernels."""

    QUERY = ("clocks.sm,power.draw,clocks_event_reasons.active,temperature.gpu,utilization.gpu,"
             "power.limit")

    def __init__(self) -> None:
        self.samples: list[tuple[float, float, float, int, float, Optional[float], Optional[float]]] = []
        self._proc: Optional[subprocess.Popen] = None

    def start(self) -> None:
        try:
            self._proc = subprocess.Popen(
                ["nvidia-smi", f"--query-gpu={self.QUERY}", "--format=csv,noheader,nounits", "-lms", "500"],
                stdout=subprocess.PIPE, text=True)
        except FileNotFoundError:
            return
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self._proc.stdout:
            self.add(line)

    def add(self, line: str, now: Optional[float] = None) -> None:
        """One nvidia-smi line; utilization and limit may read "[N/A]" (kept as None)."""
        parts = [p.strip() for p in line.split(",")]

        def optional(i: int) -> Optional[float]:
            try:
                return float(parts[i])
            except (ValueError, IndexError):
                return None
        try:
            self.samples.append((time.time() if now is None else now, float(parts[0]), float(parts[1]),
                                 int(parts[2], 16), float(parts[3]), optional(4), optional(5)))
        except (ValueError, IndexError):
            return

    def window(self, t0: float, t1: float) -> dict[str, Any]:
        s = [x for x in self.samples if t0 <= x[0] <= t1]
        if not s:
            return {"samples": 0}
        throttled = sum(1 for x in s if x[3] & THROTTLE_BITS)
        out = {"samples": len(s), "sm_mhz_median": statistics.median(x[1] for x in s),
               "power_w_median": statistics.median(x[2] for x in s), "temp_c_max": max(x[4] for x in s),
               "throttled_samples": throttled, "reasons": sorted({hex(x[3]) for x in s})}
        util = [x[5] for x in s if x[5] is not None]
        limit = [x[6] for x in s if x[6] is not None]
        if util:
            out["gpu_util_median"] = statistics.median(util)
        if limit:
            out["power_limit_w"] = max(limit)
        return out

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.terminate()


def gpu_name() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30).stdout.strip().splitlines()
    except (FileNotFoundError, subprocess.TimeoutExpired):
        return "unknown"
    return out[0] if out else "unknown"


def bootstrap_ratio(a: list[float], b: list[float], n: int = 4000, seed: int = 0) -> tuple[float, float, float]:
    """(ratio of medians a/b, 2.5th and 97.5th percentiles over bootstrap resamples of each)."""
    rng = random.Random(seed)
    point = statistics.median(a) / statistics.median(b)
    ratios = sorted(statistics.median(rng.choices(a, k=len(a))) / statistics.median(rng.choices(b, k=len(b)))
                    for _ in range(n))
    return point, ratios[int(0.025 * n)], ratios[min(int(0.975 * n), n - 1)]


def verdict(low: float, high: float) -> str:
    return "win" if low > 1.0 else "loss" if high < 1.0 else "tie"


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Fraction of the token positions that come before each row's first divergence."""
    total = same = 0
    for x, y in zip(a, b):
        total += len(y)
        same += next((i for i, (s, t) in enumerate(zip(x, y)) if s != t), min(len(x), len(y)))
    return same / max(total, 1)


#: vLLM's model runner: "Model loading took 8.1 GiB memory and 5.2 seconds" (0.26; newer: "... GiB and").
_LOADED = re.compile(r"Model loading took ([0-9.]+) GiB")


def weight_gib(log: str) -> Optional[float]:
    """The weight memory vLLM reported after loading (GiB), or None when its log has no such line."""
    found = _LOADED.findall(log)
    return float(found[-1]) if found else None


#: GiB a later side's dummy load held beyond its weights and the dummy loader's fp8 copy, observed once
#: (DeepSeek-V3 dims, 5 layers of 256 experts, block fp8: 77.65 GiB = 44.5 + 21.0 + 12.2; bench/NOTES.md 75):
#: CUDA context, warm-up buffers, the allocator's fragmentation.
DUMMY_LOAD_EXTRA_GIB = 12.0


def dummy_load_fits(model: str, gpu_util: float, total_gib: Optional[float]) -> Optional[str]:
    """None when a later side's dummy load of ``model`` fits beside an earlier side that holds
    ``gpu_util`` of the GPU's ``total_gib``; else why not (``e2e_models.dummy_load_peak``: a cold
    fill that runs out of memory there costs a full command)."""
    if total_gib is None:
        return None
    peak = dummy_load_peak(Path(model))
    need = peak["weights"] + peak["dummy_copy"] + DUMMY_LOAD_EXTRA_GIB
    room = total_gib * (1 - gpu_util)
    if need <= room:
        return None
    return (f"a later side's dummy load needs ~{need:.1f} GiB (weights {peak['weights']:.1f} + the dummy loader's "
            f"fp8 copy {peak['dummy_copy']:.1f} + {DUMMY_LOAD_EXTRA_GIB:.0f} observed) where the earlier side leaves "
            f"{room:.1f} of {total_gib:.1f} GiB (--gpu-util {gpu_util}): fewer layers or a lower --gpu-util "
            "(bench/NOTES.md 75), or --no-memory-check")


def _gpu_memory_mib(field: str) -> Optional[int]:
    """nvidia-smi's ``memory.<field>`` of the first GPU in MiB (None without nvidia-smi)."""
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu=memory.{field}", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30).stdout.split()
        return int(out[0]) if out else None
    except (FileNotFoundError, subprocess.TimeoutExpired, ValueError):
        return None


def _gpu_total_gib() -> Optional[float]:
    total = _gpu_memory_mib("total")
    return None if total is None else total / 1024


def _gpu_used_mib() -> Optional[int]:
    return _gpu_memory_mib("used")


#: GPU memory in use (MiB) at or below which the GPU counts as free of other engines (an idle H200: 0).
IDLE_GPU_MIB = 2048


def wait_for_idle_gpu(limit_s: float = 120.0, poll_s: float = 2.0) -> Optional[str]:
    """Before any side starts: wait (up to ``limit_s``) until the GPU's memory in use is back to at most
    :data:`IDLE_GPU_MIB`. An engine another command left behind (2026-12-03: one killed at a command's
    time limit during its JIT warm-up) still held memory when the next command's side started, which then
    failed in ``cublasCreate`` (``CUBLAS_STATUS_ALLOC_FAILED``). Returns None when the GPU was idle at
    once (or there is no nvidia-smi), else what was waited for, with the processes still on the GPU."""
    used = _gpu_used_mib()
    if used is None or used <= IDLE_GPU_MIB:
        return None
    first, start = used, time.time()
    while used is not None and used > IDLE_GPU_MIB and time.time() - start < limit_s:
        time.sleep(poll_s)
        used = _gpu_used_mib()
    try:
        apps = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,process_name,used_memory",
                               "--format=csv,noheader"], capture_output=True, text=True, timeout=30).stdout.strip()
    except (FileNotFoundError, subprocess.TimeoutExpired):
        apps = ""
    return (f"the GPU held {first} MiB before any side started; after {time.time() - start:.0f} s: {used} MiB"
            + (f" (processes: {'; '.join(apps.splitlines())})" if apps else ""))


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)  # the side and its engine-core process (its own session)
    except (ProcessLookupError, PermissionError):
        pass


def _stop(procs: dict, gpu_floor_mib: Optional[int] = None, timeout: float = 180.0, hurry: bool = False) -> None:
    """Stop every side and wait until it is gone. Closing its stdin ends the worker, which shuts
    its engine down; a side still running after 60 s gets SIGTERM, then SIGKILL, sent to its whole
    process group (a killed driver would leave its engine-core process holding the GPU). Then,
    given the GPU memory in use before the launch (``gpu_floor_mib``), wait until the engines'
    memory is back within 2 GiB of it: the next launch needs it. ``hurry`` (the command's time is
    up): SIGTERM at once, SIGKILL after 5 s."""
    for proc in procs.values():
        try:
            proc.stdin.close()
        except (BrokenPipeError, OSError):
            pass
    deadline = time.time() + timeout
    waits = ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)) if hurry else \
        ((None, 60.0), (signal.SIGTERM, 30.0), (signal.SIGKILL, 30.0))
    for proc in procs.values():
        for sig, wait in waits:
            if sig is not None:
                _signal_group(proc, sig)
            try:
                proc.wait(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                continue
        _signal_group(proc, signal.SIGKILL)  # what the side left behind in its group
    while gpu_floor_mib is not None and time.time() < deadline:
        used = _gpu_used_mib()
        if used is None or used <= gpu_floor_mib + 2048:
            return
        time.sleep(2)


def clear_compile_caches(sides: list[tuple[str, dict[str, str]]]) -> list[str]:
    """Remove each side's ``VLLM_CACHE_ROOT/torch_compile_cache`` (sides without their own
    VLLM_CACHE_ROOT are left alone: their cache may be the user's); the paths removed."""
    removed = []
    for _, env in sides:
        root = env.get("VLLM_CACHE_ROOT")
        cache = Path(root) / "torch_compile_cache" if root else None
        if cache is not None and cache.is_dir():
            shutil.rmtree(cache)
            removed.append(str(cache))
    return removed


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--side", action="append", required=True, help="NAME:KEY=VALUE,... (the first is the reference)")
    p.add_argument("--in", dest="in_len", type=int, default=128)
    p.add_argument("--out", dest="out_len", type=int, default=128)
    p.add_argument("--conc", default="32", help="concurrency, or a comma list: one cell each, the same "
                   "engines, interleaved within every round; --json then gets a _c<C> suffix per cell")
    p.add_argument("--rounds", type=int, default=5,
                   help="0: start every side, report start-up time and weight memory, stop (fills the caches)")
    p.add_argument("--window", type=float, default=20.0)
    p.add_argument("--warmup", type=float, default=5.0,
                   help="seconds of unmeasured load per side and cell after each launch (0: none)")
    p.add_argument("--launches", type=int, default=1,
                   help="engine launches per side in this run, each with --rounds rounds (the protocol asks for >= 3)")
    p.add_argument("--first-shift", type=int, default=0,
                   help="rotate the start order of the first launch by this many sides (a run that continues "
                        "another run's launches in a later command)")
    p.add_argument("--fresh-compile", action="store_true",
                   help="before each launch, remove every side's torch.compile cache (VLLM_CACHE_ROOT/"
                        "torch_compile_cache, where vLLM also keeps Inductor's and Triton's caches and "
                        "autotune results), so each launch compiles and autotunes anew: launches are then "
                        "independent draws of the compile too. JIT caches of kernels that do not tune "
                        "(DeepGEMM, FlashInfer) stay")
    p.add_argument("--overlap-starts", action="store_true",
                   help="start each side once the one before has sized its KV cache, so their starts "
                        "overlap (a cache fill of two slow-starting sides in one command with --rounds 0; "
                        "with rounds, every launch starts so and the windows begin once all are ready)")
    p.add_argument("--gpu-util", type=float, default=0.28)
    p.add_argument("--no-memory-check", action="store_true",
                   help="start the sides even where a later side's dummy load looks too large to fit "
                        "beside the earlier ones (dummy_load_fits)")
    p.add_argument("--max-model-len", type=int, default=0)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--engine", default="{}", help="JSON engine arguments for every side")
    p.add_argument("--arrivals", choices=("batch", "continuous"), default="batch",
                   help="batch: each window submits batches of C requests together (they finish together: "
                        "nearly every step is pure decode); continuous: C requests always in flight, a "
                        "finished one replaced at once (most steps mix a prefill into the decodes, as "
                        "online serving does; bench/ab_worker.py continuous_window)")
    p.add_argument("--label", default="", help="model/cell label for the record")
    p.add_argument("--logdir", default="/tmp/ab-logs")
    p.add_argument("--json")
    args = p.parse_args(argv)
    sides = [parse_side(s) for s in args.side]
    concs = [int(c) for c in str(args.conc).split(",")]
    spec = {"model": args.model, "gpu_util": args.gpu_util, "conc": max(concs), "in_len": args.in_len,
            "out_len": args.out_len, "vocab": args.vocab, "engine": json.loads(args.engine),
            "max_model_len": args.max_model_len or args.in_len + args.out_len + 16, "arrivals": args.arrivals}
    # vLLM's dummy routers route every DeepSeek-V3 token to the same experts, and differ by dtype
    # across sides: each side's worker redraws them, the same values everywhere (ab_worker.draw_routers)
    spec["draw_routers"] = spec["engine"].get("load_format") == "dummy"
    logdir = Path(args.logdir)
    logdir.mkdir(parents=True, exist_ok=True)
    order = [name for name, _ in sides]
    if spec["engine"].get("load_format") == "dummy" and len(sides) > 1 and not args.no_memory_check:
        why = dummy_load_fits(args.model, args.gpu_util, _gpu_total_gib())
        if why:
            print(f"[ab] not started: {why}", flush=True)
            return 2
    waited = wait_for_idle_gpu()
    if waited:
        print(f"[ab] {waited}", flush=True)
    if args.rounds == 0:  # start-up only: fills the JIT / compile caches for a later run
        procs, facts, logs = _start(sides, spec, logdir, "", overlap=args.overlap_starts)
        _stop(procs)
        if args.json:
            Path(args.json).with_suffix(".startup.json").write_text(json.dumps(
                {"label": args.label, "model": args.model, "gpu": gpu_name(), "sides": facts,
                 "date": datetime.now(timezone.utc).isoformat(timespec="seconds")}, indent=2))
        return 0
    results: dict[int, dict[str, list[dict]]] = {c: {name: [] for name, _ in sides} for c in concs}
    warm: dict[int, dict[str, list[float]]] = {c: {name: [] for name, _ in sides} for c in concs}
    launch_facts: list[dict[str, dict]] = []
    all_logs: dict[str, list[Path]] = {name: [] for name in order}

    def write_records(partial: Optional[str] = None) -> None:
        """Each cell's record (--json); ``partial``: why the run stopped early (a cell is written
        only where every side has at least one measured window)."""
        if not launch_facts:
            return
        facts = {name: {**launch_facts[-1][name],
                        "ready_s_per_launch": [f[name]["ready_s"] for f in launch_facts]} for name in order}
        start_orders = [list(f) for f in launch_facts]  # the order the engines came up in, per launch
        for conc in concs:
            if partial and not all(results[conc][name] for name in order):
                continue
            record = _record(args, sides, order, conc, results[conc], facts, all_logs, warm[conc])
            record["start_orders"] = start_orders
            record["fresh_compile"] = bool(args.fresh_compile)
            if partial:
                record["partial"] = partial
            if args.json:
                path = Path(args.json)
                if len(concs) > 1:
                    path = path.with_name(f"{path.stem}_c{conc}{path.suffix}")
                path.write_text(json.dumps(record, indent=2))

    # A time limit (``timeout`` sends SIGTERM) keeps the windows measured so far: they are written
    # before the engines are stopped, marked partial (a run of 3 windows x 20 s per side after a
    # cold start of several minutes would otherwise leave nothing).
    def on_term(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # once: the clean-up must not be interrupted
        raise _TimeUp()

    def time_up(why: str) -> str:
        print(f"[ab] {why}: recording the windows measured so far", flush=True)
        write_records(why)
        return why

    signal.signal(signal.SIGTERM, on_term)
    stopped: Optional[str] = None
    for launch in range(args.launches):
        # each launch: fresh engines (their start-up is part of the spread being measured), then
        # the interleaved rounds; the sides start in turn, the first one rotating from launch to launch
        gpu_floor = _gpu_used_mib()
        procs: dict = {}
        if args.fresh_compile:
            print(f"[ab] launch {launch + 1}: compile caches removed: {clear_compile_caches(sides)}", flush=True)
        shift = (launch + args.first_shift) % len(sides)
        try:
            procs, facts, logs = _start(sides[shift:] + sides[:shift], spec, logdir,
                                        f".launch{launch + 1}" if args.launches > 1 else "", procs,
                                        overlap=args.overlap_starts)
        except _TimeUp:
            stopped = time_up(f"SIGTERM while launch {launch + 1} started")
            _stop(procs, None, hurry=True)
            break
        launch_facts.append(facts)
        for name in order:
            all_logs[name].append(logs[name])
        clocks = Clocks()
        clocks.start()
        try:
            # an unmeasured window per side and cell first: a fresh engine's first batches ran at
            # ~60 % of its later ones (docs/performance.md), which one round per launch would count
            for conc in concs if args.warmup > 0 else []:
                for name in order:
                    res = _window(procs[name], logs[name], 999_999 + launch, args.warmup, conc)
                    warm[conc][name].append(round(res["tok_s"], 1))
            for r in range(args.rounds):
                # the side measured first in a round rotates per round and continues across launches
                # (and commands: --first-shift), so one round per launch does not always open with
                # the reference
                first = (r + launch + args.first_shift) % len(order)
                for conc in concs:
                    for position, name in enumerate(order[first:] + order[:first]):
                        t0 = time.time()
                        res = _window(procs[name], logs[name], 1000 * r + 100000 * launch, args.window, conc)
                        res["clocks"] = clocks.window(t0, time.time())
                        res["launch"] = launch + 1
                        res["position"] = position  # 0: the first side measured in its round
                        results[conc][name].append(res)
                        unit = (f"{res['steps']} steps, {res['mixed_steps']} mixed" if "steps" in res
                                else f"{res['batches']} batches")
                        print(f"[ab] launch {launch + 1} round {r + 1} C={conc} {name:<10} {res['tok_s']:9.0f} tok/s "
                              f"over {res['seconds']:5.1f} s ({unit}) sm "
                              f"{res['clocks'].get('sm_mhz_median')} MHz {res['clocks'].get('power_w_median')} W throttled "
                              f"{res['clocks'].get('throttled_samples')}/{res['clocks'].get('samples')}", flush=True)
        except _TimeUp:
            stopped = time_up(f"SIGTERM in launch {launch + 1}")
        finally:
            clocks.stop()
            _stop(procs, None if stopped else gpu_floor, hurry=bool(stopped))
        if stopped:
            break
    if stopped is None:
        write_records()
    return 0


class _TimeUp(Exception):
    """SIGTERM (the command's time limit) arrived."""


#: The engine process each side runs (a module attribute: tests swap in a stand-in).
WORKER = HERE / "ab_worker.py"
#: vLLM's log line once an engine has sized its KV cache from its own memory profile.
KV_SIZED = "GPU KV cache size"


def _start(sides: list, spec: dict, logdir: Path, suffix: str,
           procs: Optional[dict] = None, overlap: bool = False) -> tuple[dict, dict, dict]:
    """Start every side's engine, one after another (vLLM sizes its KV cache from a memory
    profile of its own start-up, which another engine starting on the same GPU at the same time
    corrupts: "No available memory for the cache blocks"). ``overlap``: start the next side as soon
    as the one before has logged :data:`KV_SIZED` (its JIT warm-ups and graph capture then overlap
    the next start; a cold fill of two full-depth fp8 sides fits one command), and read the READY
    lines after all have started (a later side's ``ready_s`` may then include waiting for an earlier
    one). Returns (processes, facts, log paths); ``procs``, when given, is filled as the sides start
    (the caller can stop a partial start)."""
    procs = {} if procs is None else procs
    facts, logs, t_side = {}, {}, {}
    t_start = time.time()

    def ready(name: str) -> None:
        for line in procs[name].stdout:
            if line.startswith("READY "):
                facts[name] = json.loads(line[6:])
                facts[name]["ready_s"] = round(time.time() - t_side[name], 1)
                facts[name]["weight_gib"] = weight_gib(logs[name].read_text())
                return
        for other in procs.values():  # no engine left holding the GPU
            other.kill()
        raise SystemExit(f"side {name} died while starting: {logs[name].read_text()[-3000:]}")

    for name, env in sides:
        logs[name] = logdir / f"{name}{suffix}.log"
        t_side[name] = time.time()
        procs[name] = proc = subprocess.Popen([sys.executable, str(WORKER), json.dumps(spec)],
                                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                              start_new_session=True,  # its process group: _stop
                                              stderr=logs[name].open("w"),
                                              # vLLM's log (kernel choices, weight memory) into the side's log file
                                              env={**os.environ, "VLLM_LOGGING_STREAM": "ext://sys.stderr", **env})
        if not overlap:
            ready(name)
            continue
        while proc.poll() is None and KV_SIZED not in logs[name].read_text():
            time.sleep(1)
    for name in procs if overlap else ():
        ready(name)
    print(f"[ab] {len(sides)} sides ready after {time.time() - t_start:.0f} s: {facts}", flush=True)
    return procs, facts, logs


def _window(proc: subprocess.Popen, log: Path, seed: int, seconds: float, conc: int) -> dict:
    """One window of load on a side: its worker's RESULT (prompts drawn from ``seed``)."""
    proc.stdin.write(json.dumps({"seed": seed, "seconds": seconds, "conc": conc}) + "\n")
    proc.stdin.flush()
    line = next((ln for ln in proc.stdout if ln.startswith("RESULT ")), None)
    if line is None:
        raise SystemExit(f"side {log.stem} died: {log.read_text()[-3000:]}")
    return json.loads(line[7:])


def router_mismatch(facts: dict[str, dict]) -> str:
    """Why the sides did not serve the same model, as far as their MoE routers show (bench/ab_worker.py
    ``router_facts``), or "" when they agree: one side's routers quantised and another's not, a side
    without the routers the others have, or routers that hold other values (their checksums, float64
    sums that agree whenever the values do: a bf16 checkpoint's router held in float32 by one
    side and bf16 by the other is the same router). Records written before the checksum existed are
    compared by quantisation alone."""
    seen = {name: f.get("routers") or None for name, f in facts.items()}

    def quantised(r: dict) -> bool:
        return r.get("quantised", any(d not in ROUTER_FLOAT_DTYPES for d in r.get("dtypes") or ()))

    if len({None if r is None else quantised(r) for r in seen.values()}) > 1:
        return "the sides' MoE routers differ: " + ", ".join(
            f"{n} {'/'.join(r['dtypes']) if r else 'none'}" for n, r in seen.items())
    sums = {n: r.get("checksum") for n, r in seen.items() if r is not None}
    if None not in sums.values() and len(set(sums.values())) > 1:
        return "the sides' MoE routers hold other values: " + ", ".join(
            f"{n} {'/'.join(seen[n]['dtypes'])} checksum {c}" for n, c in sums.items())
    return ""


def _record(args: Any, sides: list, order: list[str], conc: int, results: dict[str, list[dict]],
            facts: dict, logs: dict, warm: Optional[dict[str, list[float]]] = None) -> dict[str, Any]:
    """One cell's record (and its lines on stdout)."""
    ref = order[0]
    record: dict[str, Any] = {"gpu": gpu_name(),
        "label": args.label, "model": args.model, "in": args.in_len, "out": args.out_len, "conc": conc,
        "rounds": args.rounds, "window_s": args.window, "launches_per_side": args.launches, "reference": ref,
        "warmup_s": args.warmup, "arrivals": args.arrivals, "engine": json.loads(args.engine),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "sides": {},
    }
    mismatch = router_mismatch(facts)
    if mismatch:  # shown, never deciding (bench/latest.py reads it as the record's not_counted)
        record["not_counted"] = mismatch
        print(f"[ab] WARNING: {mismatch}: this cell compares different models and counts for nothing", flush=True)
    print(f"\n{args.label or args.model}: {args.in_len}/{args.out_len} at C={conc}, {args.launches} launch(es) x "
          f"{args.rounds} interleaved rounds of >= {args.window:.0f} s per side")
    for name, _ in sides:
        tok = [x["tok_s"] for x in results[name]]
        kernels = sorted({line.split("] ", 1)[-1][:200] for log in logs[name]
                          for line in log.read_text().splitlines() if KERNEL_LINE.search(line)})
        side = {"env": dict(sides[order.index(name)][1]), "tok_s": tok, "median": statistics.median(tok),
                "min": min(tok), "max": max(tok), "facts": facts[name], "kernel_log_lines": kernels,
                "throttled_windows": sum(1 for x in results[name] if x["clocks"].get("throttled_samples")),
                "clocks": [x["clocks"] for x in results[name]],
                "positions": [x.get("position") for x in results[name]],  # per window: its place in its round
                # per window (batch arrivals): the median over output positions of how many different tokens
                # the first batch's sequences emitted there (bench/ab_worker.py distinct_per_step)
                "distinct_tokens": [x.get("distinct_tokens_median") for x in results[name]],
                "warmup_tok_s": (warm or {}).get(name, [])}  # the unmeasured windows, one per launch
        line = f"  {name:<10} median {side['median']:9.0f} tok/s [{side['min']:.0f}, {side['max']:.0f}]"
        if name != ref:
            point, low, high = bootstrap_ratio(tok, [x["tok_s"] for x in results[ref]])
            side.update(ratio=point, ratio_ci_low=low, ratio_ci_high=high, verdict=verdict(low, high),
                        agreement=statistics.mean(agreement(x["first"], y["first"])
                                                  for x, y in zip(results[name], results[ref])))
            line += (f"  x{point:.3f} [{low:.3f}, {high:.3f}] {side['verdict']}, "
                     f"first-token agreement {side['agreement']:.1%}")
        print(line + f"  throttled windows {side['throttled_windows']}/{len(tok)}  {facts[name]}")
        record["sides"][name] = side
    return record


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
