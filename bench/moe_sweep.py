#!/usr/bin/env python
"""Tile sweep of atom's grouped fused-MoE path on one GPU (no vLLM needed): per batch size,
routing and expert shape, every candidate :class:`atom.ops.moe_triton.MoeConfig` forced through
``config=``, timed whole (CUDA graph, cold L2: ``bench/ops_compute.py``'s timer) and split by
kernel (torch.profiler over eager calls, L2 flushed between them), against the device's
measured read and copy bandwidth. bench/NOTES.md entry 73 is the question it answers: how close
the expert GEMMs at 8-32 tokens per expert stream to the HBM peak, and whether swapping A and B
(weight rows on the MMA's M side) or deeper pipelines get closer.

    python bench/moe_sweep.py --json out.json            # H100 / H200: ~4 minutes
    python bench/moe_sweep.py --dry-run                  # tiny shapes on CPU (Triton interpreter)

Shapes: Qwen3-30B-A3B's experts (128, top-8, hidden 2048, inter 768) and DeepSeek-V3's (256,
top-8, hidden 7168, inter 2048). Routing: ``uniform`` (random logits) and ``zipf`` (expert
popularity ~ 1 / rank^1.1, top-k drawn without replacement). Every config's output is compared
with the default config's (and the default with the torch reference on the Qwen3 shape).
Kernels compile first in ``--compile-workers`` processes (Triton's disk cache), so the timing
process only loads them.

``--vs-vllm``: atom's default path only, against vLLM's own fp8 fused MoE
(``torch.ops.vllm.fused_experts``, block fp8, dynamic 1x128 activations: what stock's TRITON fp8
MoE backend runs) on the same weights and routing, timed the same way, with vLLM's tile config
as its engine picks it (its tuned file for ``E``, ``N`` = the expert intermediate size on this
GPU, else its default). Shapes: DeepSeek-V3's whole experts and one TP-8 rank's shard of them
(``dsv3-tp8``: intermediate 256, where vLLM ships a tuned H200 file), 1-512 tokens (bench/NOTES.md 80).

    PYTHONPATH=.:/tmp/site python3 bench/moe_sweep.py --vs-vllm --repeat 3 --json out.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parent.parent

#: (name, experts, top_k, hidden, inter)
SHAPES = {"qwen3-30b": (128, 8, 2048, 768), "dsv3": (256, 8, 7168, 2048), "dsv3-tp8": (256, 8, 7168, 256)}
DRY_SHAPES = {"qwen3-30b": (16, 4, 256, 128), "dsv3": (16, 4, 256, 256), "dsv3-tp8": (16, 4, 256, 128)}
#: --vs-vllm: the token counts per shape (decode batches up to a prefill chunk's share)
VS_VLLM_TOKENS = (1, 2, 8, 32, 64, 128, 256, 512)


def candidates(per_expert: float, fp8: bool, tokens: int = 0, short: bool = False):
    """Candidate tiles for a batch with ``per_expert`` pairs per expert (the default first);
    up to 4 tokens also the small-batch (GEMV) path's default tile, and with ``short`` fp8 up to
    2 tokens six more GEMV tiles."""
    from atom.ops.moe_triton import GemvConfig, MoeConfig, gemv_config

    bk = 128
    out = []
    if 0 < tokens <= 4:
        out.append(gemv_config(bk if fp8 else None, __import__("torch").bfloat16))
    if short and fp8 and 0 < tokens <= 2:  # the fp8 GEMV's own tiles (bench/NOTES.md 76): fewer registers per
        # thread than the default's ~250 (more programs per SM), or more rows per program; none spills (sm_90 offline)
        out += [GemvConfig(n1, n2, bk, g, w) for n1, n2, g, w in
                ((8, 16, 2, 4), (8, 16, 1, 4), (8, 16, 4, 8), (16, 32, 2, 8), (32, 32, 1, 8), (16, 32, 2, 4))]
    if short and fp8:  # entry 73's finalists: the old and the new default, two runners-up
        if per_expert <= 16:
            out += [MoeConfig(16, 64, 128, bk, 1, 4, 3), MoeConfig(16, bk, 128, bk, 1, 4, 3, swap_ab=True),
                    MoeConfig(16, bk, 64, bk, 1, 4, 3, swap_ab=True), MoeConfig(32, bk, 128, bk, 1, 4, 4, swap_ab=True)]
        return out
    if fp8:
        if per_expert <= 16:
            for n1 in (64, 128):
                for w, s in ((4, 3), (4, 5), (8, 4)):
                    out.append(MoeConfig(16, n1, 128, bk, 1, w, s))
            for n1 in (64, 128):
                for n2 in (64, 128):
                    for w, s in ((4, 3), (4, 4), (4, 5), (4, 6), (8, 4)):
                        out.append(MoeConfig(16, n1, n2, bk, 1, w, s, swap_ab=True))
            for w in (4, 8):
                out.append(MoeConfig(32, 128, 128, bk, 1, w, 4, swap_ab=True))
        else:
            for bm, w, s in ((64, 8, 4), (64, 8, 3), (64, 8, 5), (32, 8, 4), (64, 4, 4)):
                out.append(MoeConfig(bm, 128, 128, bk, 8, w, s))
            for bm, w, s in ((32, 4, 4), (32, 8, 4), (64, 4, 4), (64, 8, 4), (16, 4, 4)):
                out.append(MoeConfig(bm, 128, 128, bk, 8, w, s, swap_ab=True))
    else:
        for n1, n2, k, w, s, swap in ((64, 128, 128, 4, 3, False), (64, 128, 128, 4, 5, False),
                                      (64, 128, 128, 4, 3, True), (64, 128, 128, 4, 4, True),
                                      (128, 128, 64, 4, 4, True), (64, 64, 128, 4, 5, True),
                                      (128, 128, 128, 8, 3, True), (64, 128, 64, 4, 6, True)):
            out.append(MoeConfig(16, n1, n2, k, 1, w, s, swap_ab=swap))
    return out


def cases(dry: bool, vs_vllm: bool = False, tp8: bool = False, tokens: tuple = (), shapes: tuple = ()):
    """(shape, fp8, tokens, routing) in the sweep's order. ``tp8``: the tile sweep at one TP-8 rank's
    DeepSeek-V3 experts only (bench/NOTES.md 81). ``tokens``: fp8, uniform routing, these batch sizes
    on each of ``shapes`` (default all three) instead of the default list (entry 82)."""
    if tp8:
        shapes, tokens = ("dsv3-tp8",), tokens or ((1, 8) if dry else VS_VLLM_TOKENS)
    if tokens:
        return [(shape, True, t, "uniform") for shape in (shapes or tuple(SHAPES)) for t in tokens]
    if vs_vllm:
        return [(shape, True, t, "uniform") for shape in ("dsv3", "dsv3-tp8")
                for t in ((1, 8) if dry else VS_VLLM_TOKENS)]
    if dry:
        return [("qwen3-30b", True, 8, "uniform"), ("qwen3-30b", True, 8, "zipf"),
                ("qwen3-30b", False, 8, "uniform"), ("dsv3", True, 1, "uniform")]
    out = []
    for t in (1, 2, 3, 4, 8, 16):  # 1-2: the fp8 GEMV path's batches (atom's default there)
        out.append(("qwen3-30b", True, t, "uniform"))
    for t in (32, 64, 128, 256, 512):
        for routing in ("uniform", "zipf"):
            out.append(("qwen3-30b", True, t, routing))
    for t in (1, 2, 8, 32, 128):
        out.append(("dsv3", True, t, "uniform"))
    for t in (128, 256):
        out.append(("qwen3-30b", False, t, "uniform"))
    return out


def fp8_normal(torch, shape, dev, g):
    """The benches' fp8 expert weights (this script's, moe_block's, moe_numerics'): N(0, 1) drawn in
    bf16, cast to e4m3."""
    return torch.randn(*shape, device=dev, generator=g, dtype=torch.bfloat16).to(torch.float8_e4m3fn)


def block_scales(torch, shape, fan_in: int, dev, g):
    """Their 128 x 128 block scales: U(0, 1) / sqrt(fan_in) + 1e-3 (outputs of order 1)."""
    return torch.rand(*shape, device=dev, generator=g) / fan_in ** 0.5 + 1e-3


def make_weights(torch, dev, experts, hidden, inter, fp8, dtype):
    g = torch.Generator(device=dev).manual_seed(0)
    if fp8:
        f8 = torch.float8_e4m3fn
        w13 = torch.empty(experts, 2 * inter, hidden, dtype=f8, device=dev)
        w2 = torch.empty(experts, hidden, inter, dtype=f8, device=dev)
        for e in range(experts):  # per expert: no float32 copy of a DeepSeek-V3 layer
            w13[e] = fp8_normal(torch, (2 * inter, hidden), dev, g)
            w2[e] = fp8_normal(torch, (hidden, inter), dev, g)
        s13 = block_scales(torch, (experts, 2 * inter // 128, hidden // 128), hidden, dev, g)
        s2 = block_scales(torch, (experts, hidden // 128, inter // 128), inter, dev, g)
        return w13, w2, dict(w13_scale=s13, w2_scale=s2, block_shape=[128, 128])
    w13 = (torch.randn(experts, 2 * inter, hidden, device=dev, generator=g) / hidden ** 0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, device=dev, generator=g) / inter ** 0.5).to(dtype)
    return w13, w2, {}


def route(torch, dev, tokens, experts, top_k, routing, seed):
    from atom.ops.moe_routing import topk_softmax

    g = torch.Generator(device=dev).manual_seed(seed)
    logits = torch.randn(tokens, experts, device=dev, generator=g)
    if routing == "zipf":
        # Gumbel top-k over log-popularity: top_k distinct experts drawn without replacement,
        # expert r (random order) chosen with probability ~ 1 / (r + 1)^1.1
        perm = torch.randperm(experts, device=dev, generator=g)
        logp = -1.1 * torch.log(torch.arange(1, experts + 1, device=dev, dtype=torch.float32))[perm]
        u = torch.rand(tokens, experts, device=dev, generator=g).clamp_(1e-9, 1 - 1e-9)
        logits = logp[None, :] - torch.log(-torch.log(u))
    return topk_softmax(logits, top_k, True)


def kernel_split(torch, fn, flush, reps: int = 10) -> dict:
    """Device microseconds per call by kernel family (torch.profiler, eager, L2 flushed)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            flush()
            fn()
        torch.cuda.synchronize()
    split: dict = {}
    for ev in prof.key_averages():
        name = ev.key
        if "zero" in name.lower() or "fill" in name.lower():
            continue  # the flush
        fam = next((f for f in ("gemm1", "gemm2", "align", "group_quant", "sum") if f in name), "other")
        us = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0.0)
        split[fam] = split.get(fam, 0.0) + us / reps
    return split


def vllm_fused_experts(torch, x, w13, w2, tw, ti, kw):
    """vLLM's fp8 fused MoE on atom's weight layout (w13 = [gate; up] rows, as vLLM's w1), or the
    reason it cannot run here (no vLLM, a CPU build): ``(fn, None)`` or ``(None, reason)``."""
    try:
        import vllm.model_executor.layers.fused_moe.fused_moe  # noqa: F401  (registers the op)

        op = torch.ops.vllm.fused_experts
    except Exception as e:  # vLLM absent or its CUDA kernels missing
        return None, f"{type(e).__name__}: {e}"[:200]

    def fn():
        return op(hidden_states=x, w1=w13, w2=w2, topk_weights=tw, topk_ids=ti, activation="silu",
                  use_fp8_w8a8=True, w1_scale=kw["w13_scale"], w2_scale=kw["w2_scale"],
                  block_shape=list(kw["block_shape"]))
    return fn, None


def vllm_config_name(e: int, inter: int) -> str:
    """The tuned-config file vLLM's fp8 fused MoE looks for at these experts ("" when it has none,
    so its default tiles run)."""
    try:
        from vllm.model_executor.layers.fused_moe import fused_moe as vf

        name = vf.get_config_file_name(e, inter, "fp8_w8a8", [128, 128])
        return name if (Path(vf.__file__).parent / "configs" / name).exists() else ""
    except Exception:
        return ""


def cfg_label(c) -> str:
    if not hasattr(c, "block_m"):  # a GemvConfig
        return "gemv " + ",".join(str(v) for v in dataclasses.astuple(c))
    s = f"m{c.block_m} n{c.block_n1}/{c.block_n2} k{c.block_k} w{c.num_warps} s{c.num_stages}"
    if c.num_warps2 or c.num_stages2:
        s += f" (2: w{c.num_warps2 or c.num_warps} s{c.num_stages2 or c.num_stages})"
    return s + (" swap" if c.swap_ab else "")


def compile_worker(shard: int, nshards: int, dry: bool, short: bool = False, tp8: bool = False,
                   tokens: tuple = (), only: tuple = ()) -> int:
    """Compile (by running once) this shard's share of every (shape, dtype, config): small
    expert counts, since the compiled kernels do not depend on them."""
    import torch

    from atom.ops.moe_triton import fused_moe_fwd

    dev = torch.device("cpu" if dry else "cuda")
    shapes = DRY_SHAPES if dry else SHAPES
    jobs = []
    for shape, fp8, t, _ in cases(dry, tp8=tp8, tokens=tokens, shapes=only):
        e, k, h, i = shapes[shape]
        for cfg in candidates(t * k / e, fp8, t, short):
            jobs.append((shape, fp8, cfg))
    jobs = list(dict.fromkeys(jobs))[shard::nshards]
    cache: dict = {}
    for shape, fp8, cfg in jobs:
        e, k, h, i = shapes[shape]
        key = (shape, fp8)
        if key not in cache:
            cache[key] = make_weights(torch, dev, 8, h, i, fp8, torch.bfloat16)
        w13, w2, kw = cache[key]
        x = torch.randn(64, h, device=dev, dtype=torch.bfloat16)
        tw, ti = route(torch, dev, 64, 8, k, "uniform", 0)
        fused_moe_fwd(x, w13, w2, tw, ti, config=cfg, **kw)
    if not dry:
        torch.cuda.synchronize()
    return 0


def vs_vllm(torch, timer, x, w13, w2, tw, ti, kw, ref, experts: int, inter: int, dry: bool) -> dict:
    """vLLM's fp8 fused MoE on the case: its time, its output's max error relative to atom's
    (``ref``), and the tuned tile file it used ("" for its default tiles)."""
    fn, why = vllm_fused_experts(torch, x, w13, w2, tw, ti, kw)
    if fn is None or dry:
        return {"vllm_skipped": why or "dry run"}
    try:
        out = fn()
        err = (out.float() - ref.float()).abs().max().item() / max(ref.float().abs().max().item(), 1e-9)
        us = timer(fn)
    except Exception as e:  # a vLLM that cannot run this shape: say so, keep the sweep going
        return {"vllm_skipped": f"{type(e).__name__}: {e}"[:200]}
    return {"vllm_us": us, "vllm_rel_err_vs_atom": err, "vllm_config": vllm_config_name(experts, inter)}


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--compile-workers", type=int, default=12)
    p.add_argument("--only", default="", help="comma-separated shape names (default: all)")
    p.add_argument("--no-bf16", action="store_true", help="leave out the bf16 cases")
    p.add_argument("--short", action="store_true", help="fp8: only entry 73's finalist tiles")
    p.add_argument("--no-split", action="store_true", help="no per-kernel split (profiler)")
    p.add_argument("--repeat", type=int, default=1, help="time every case this many times (rounds)")
    p.add_argument("--vs-vllm", action="store_true",
                   help="atom's default against vLLM's fp8 fused MoE on DeepSeek-V3's whole and TP-8 experts")
    p.add_argument("--tp8-sweep", action="store_true",
                   help="every candidate tile at one TP-8 rank's DeepSeek-V3 experts (dsv3-tp8) only")
    p.add_argument("--tokens", default="", help="comma-separated batch sizes: fp8, uniform routing, on the "
                   "--only shapes (default all), every candidate tile")
    p.add_argument("--compile-shard", default="", help=argparse.SUPPRESS)  # "i/n": a worker
    args = p.parse_args(argv)
    tokens = tuple(int(v) for v in args.tokens.split(",") if v)
    only_shapes = tuple(s for s in args.only.split(",") if s)
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"
    sys.path.insert(0, str(REPO))
    sys.path.insert(0, str(REPO / "bench"))
    if args.compile_shard:
        i, n = (int(v) for v in args.compile_shard.split("/"))
        return compile_worker(i, n, args.dry_run, args.short, args.tp8_sweep, tokens, only_shapes)

    t0 = time.time()
    if not args.dry_run and args.compile_workers > 0 and not args.vs_vllm:  # --vs-vllm: one tile per case, its
        # first call (outside the timer) compiles it
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        procs = [subprocess.Popen([sys.executable, __file__, f"--compile-shard={i}/{args.compile_workers}"]
                                  + (["--short"] if args.short else [])
                                  + (["--tp8-sweep"] if args.tp8_sweep else [])
                                  + [f"--tokens={args.tokens}", f"--only={args.only}"], env=env)
                 for i in range(args.compile_workers)]
        bad = [p.wait() for p in procs]
        print(f"compiled in {time.time() - t0:.0f} s (workers' exit codes {sorted(set(bad))})", flush=True)

    import torch

    from ops_compute import Timer, measure_peaks
    from atom.ops.moe import fused_moe
    from atom.ops.fp8_gemm_triton import num_sms
    from atom.ops.moe_triton import expert_bytes, fused_moe_fwd, gemv_config, moe_config, takes_gemv

    dev = torch.device("cpu" if args.dry_run else "cuda")
    timer = Timer(torch, dev, 2 if args.dry_run else args.iters, True)
    peaks = measure_peaks(torch, dev, timer, args.dry_run)
    name = "cpu (dry run)" if args.dry_run else torch.cuda.get_device_name()
    print(f"{name}: {json.dumps({k: round(v) for k, v in peaks.items()})}", flush=True)
    shapes = DRY_SHAPES if args.dry_run else SHAPES
    rows = []
    weights: dict = {}
    for rnd, (shape, fp8, t, routing) in [(r, c) for r in range(args.repeat)
                                          for c in cases(args.dry_run, args.vs_vllm, args.tp8_sweep, tokens,
                                                         only_shapes)]:
        if (only_shapes and shape not in only_shapes) or (args.no_bf16 and not fp8):
            continue
        e, k, h, i = shapes[shape]
        key = (shape, fp8)
        if key not in weights:
            weights.clear()
            if not args.dry_run:
                torch.cuda.empty_cache()
            weights[key] = make_weights(torch, dev, e, h, i, fp8, torch.bfloat16)
        w13, w2, kw = weights[key]
        x = torch.randn(t, h, device=dev, dtype=torch.bfloat16)
        tw, ti = route(torch, dev, t, e, k, routing, seed=t)
        used = int(torch.unique(ti).numel())
        nbytes = used * 3 * h * i * (1 if fp8 else 2) + 2 * t * h * 2
        out = torch.empty_like(x)
        default = (gemv_config(128 if fp8 else None, torch.bfloat16) if takes_gemv(t, k, e, fp8, expert_bytes(w13, w2))
                   else moe_config(t, k, e, 128 if fp8 else None, torch.bfloat16, i,
                                   num_sms(dev)))  # what atom runs (fused_moe_fwd's choice)
        cands = [default] if args.vs_vllm else candidates(t * k / e, fp8, t, args.short)
        if default not in cands:
            cands = [default] + cands
        ref = fused_moe_fwd(x, w13, w2, tw, ti, config=default, **kw).clone()
        if shape == "qwen3-30b":
            oracle = fused_moe.run("torch", x, w13, w2, tw, ti, **kw)
            ref_err = (ref.float() - oracle.float()).abs().max().item() / max(oracle.float().abs().max().item(), 1e-9)
        else:
            ref_err = None
        for cfg in cands:
            def fn(cfg=cfg):
                return fused_moe_fwd(x, w13, w2, tw, ti, out=out, config=cfg, **kw)
            fn()
            err = (out.float() - ref.float()).abs().max().item() / max(ref.float().abs().max().item(), 1e-9)
            us = timer(fn)
            split = {} if args.dry_run or args.no_split else kernel_split(torch, fn, timer._flush)
            row = dict(round=rnd, shape=shape, fp8=fp8, tokens=t, routing=routing, experts_used=used,
                       per_expert=t * k / e, config=cfg_label(cfg), default=cfg == default, us=us,
                       split_us=split, bytes=nbytes, GBps=nbytes / us / 1e3 if us else None,
                       rel_err_vs_default=err, default_rel_err_vs_torch=ref_err)
            if args.vs_vllm:
                row.update(vs_vllm(torch, timer, x, w13, w2, tw, ti, kw, ref, e, i, args.dry_run))
                if row.get("vllm_us"):
                    row["atom_over_vllm"] = us / row["vllm_us"]
            rows.append(row)
            print(f"{shape:9s} {'fp8' if fp8 else 'bf16'} T={t:<4d} {routing:7s} {row['config']:40s} "
                  f"{us:8.1f} us {row['GBps'] or 0:6.0f} GB/s "
                  + " ".join(f"{k_}={v:.0f}" for k_, v in sorted(split.items()))
                  + f" err={err:.1e}" + (" DEFAULT" if row["default"] else "")
                  + (f" | vLLM {row['vllm_us']:.1f} us, atom/vLLM time {row['atom_over_vllm']:.3f}, "
                     f"err {row['vllm_rel_err_vs_atom']:.1e}, {row['vllm_config'] or 'default tiles'}"
                     if row.get("vllm_us") else f" | vLLM: {row['vllm_skipped']}" if "vllm_skipped" in row else ""),
                  flush=True)
    if args.vs_vllm:
        print("\natom / vLLM time per case (median over rounds; < 1: atom faster):")
        by_case: dict = {}
        for r in rows:
            if r.get("vllm_us"):
                by_case.setdefault((r["shape"], r["tokens"]), []).append(r)
        for (shape, t), rs in by_case.items():
            a = statistics.median(r["us"] for r in rs)
            v = statistics.median(r["vllm_us"] for r in rs)
            print(f"  {shape:8s} T={t:<4d} atom {a:8.1f} us  vLLM {v:8.1f} us  {a / v:.3f}  "
                  f"({rs[0]['vllm_config'] or 'vLLM default tiles'}; {len(rs)} round(s), atom per round "
                  + ", ".join(f"{r['us']:.1f}" for r in rs) + "; vLLM " + ", ".join(f"{r['vllm_us']:.1f}" for r in rs)
                  + ")")
    # the best per case
    print("\nbest per case (vs the default):")
    by: dict = {}
    for r in rows:
        by.setdefault((r["shape"], r["fp8"], r["tokens"], r["routing"]), []).append(r)
    for key, rs in by.items():  # per config the median over rounds
        med: dict = {}
        for r in rs:
            med.setdefault(r["config"], []).append(r)
        agg = {c: dict(rr[0], us=statistics.median(x["us"] for x in rr),
                       GBps=statistics.median(x["GBps"] or 0 for x in rr)) for c, rr in med.items()}
        d = next(r for r in agg.values() if r["default"])
        b = min(agg.values(), key=lambda r: r["us"])
        print(f"  {key[0]} {'fp8' if key[1] else 'bf16'} T={key[2]} {key[3]}: default {d['us']:.1f} us "
              f"({d['GBps'] or 0:.0f} GB/s) {d['config']}, best {b['us']:.1f} us ({b['GBps'] or 0:.0f} GB/s) "
              f"{b['config']}: {d['us'] / b['us']:.3f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(device=name, peaks=peaks, versions=dict(
            torch=torch.__version__, triton=__import__("triton").__version__), rows=rows), indent=1))
        print(f"wrote {args.json}")
    print(f"total {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
