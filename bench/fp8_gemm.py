#!/usr/bin/env python
"""Block-fp8 GEMM kernel table (issue #16): atom's :func:`atom.ops.fp8_block_gemm` (W8A16 and
W8A8, activation quantisation included) vs stock vLLM's block-fp8 GEMMs (its per-token-group
quant + CUTLASS ``cutlass_scaled_mm``; DeepGEMM's ``fp8_gemm_nt`` when it runs here; and, with
FlashInfer staged, the kernel vLLM 0.26 selects then, ``FlashInferFp8DeepGEMMDynamicBlockScaledKernel``:
FlashInfer's swap-AB block-fp8 GEMM on bf16 activations below 32 tokens, DeepGEMM from 32) vs bf16
cuBLAS (``torch.mm``), on real layer shapes at M = 1, 2, 8, 64, 256, 4096.

    python bench/fp8_gemm.py [--json out.json] [--sweep] [--gemv-sweep] [--no-vllm]

Each timing is a CUDA graph of 20 back-to-back calls, replayed for >= 0.1 s, median of 3; the
weights rotate over enough copies that they do not sit in the 50 MB L2 between calls. Every
side's output is checked against the float32 product on the dequantised weights (relative max
error reported; a side above 8 % is marked wrong). % of HBM bandwidth uses the bytes each side
must read (weights, activations, output) over 3.35 TB/s; % of the fp8 / bf16 tensor-core
peaks uses 989 / 495 TFLOP/s (H100 SXM, dense). ``--sweep`` also times W8A16 tile variants at
small M (the numbers behind :func:`atom.ops.fp8_gemm_triton.gemm_config`); ``--gemv-sweep`` the
GEMV kernel's variants at M = 1 (then its best ones at M = 2, against the tensor-core
kernel), fp8 and, against cuBLAS, bf16 weights (the numbers behind
:func:`atom.ops.fp8_gemm_triton.gemv_config` and ``GEMV_MAX_M``). ``--no-vllm``: atom's and
cuBLAS's sides only (no vLLM import).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

#: HBM bandwidth (bytes/s) by GPU name: the H200's; every other GPU is taken as the H100 SXM
HBM_BY_GPU = {"H200": 4.8e12}
HBM_DEFAULT = 3.35e12


@functools.lru_cache(maxsize=None)
def hbm() -> float:
    """The current GPU's HBM bandwidth in bytes/s (:data:`HBM_BY_GPU`), for the tables' % of HBM."""
    name = torch.cuda.get_device_name()
    return next((bw for key, bw in HBM_BY_GPU.items() if key in name), HBM_DEFAULT)


FP8_PEAK = 989e12
BF16_PEAK = 495e12
BLOCK = (128, 128)
#: (label, N, K): the dense projections of the issue's models (one GPU, no TP).
SHAPES = [
    ("qwen3-8b qkv", 6144, 4096), ("qwen3-8b o", 4096, 4096),
    ("qwen3-8b gate_up", 24576, 4096), ("qwen3-8b down", 4096, 12288),
    ("qwen3-32b qkv", 10240, 5120), ("qwen3-32b down", 5120, 25600),
    ("dsv3 q_a+kv_a", 2112, 7168), ("dsv3 q_b", 24576, 1536), ("dsv3 o", 7168, 16384),
    ("qwen3-32b o", 5120, 8192), ("qwen3-32b gate_up", 51200, 5120),
    ("qwen3-235b qkv", 9216, 4096), ("qwen3-235b o", 4096, 8192),
    ("qwen3-30b qkv", 5120, 2048), ("qwen3-30b o", 2048, 4096),
]
MS = [1, 2, 4, 8, 16, 24, 64, 256, 4096]


def rotating(fns: list, *args):
    """A call that runs the next of ``fns`` (with ``args``) each time: one weight copy after
    another, so none sits in L2 between calls."""
    i = [0]

    def call():
        i[0] = (i[0] + 1) % len(fns)
        return fns[i[0]](*args)
    return call


def timed(fn, reps: int = 20, samples: int = 3, min_ms: float = 100) -> float:
    """Seconds per call: a CUDA graph of ``reps`` calls, replayed for ``min_ms``, median of ``samples``."""
    fn()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    try:
        with torch.cuda.stream(stream):
            fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(reps):
                fn()
        run = graph.replay
    except Exception:  # noqa: BLE001 - a side that cannot be captured is timed eagerly
        torch.cuda.synchronize()

        def run():
            for _ in range(reps):
                fn()
    times = []
    for _ in range(samples):
        n, start, end = 0, torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        while True:
            run()
            n += 1
            end.record()
            end.synchronize()
            if start.elapsed_time(end) >= min_ms:
                break
        times.append(start.elapsed_time(end) / 1e3 / (n * reps))
    return statistics.median(times)


def stock_cutlass():
    from vllm import _custom_ops as vops
    from vllm.model_executor.layers.quantization.utils.fp8_utils import per_token_group_quant_fp8

    def make(w, s):
        def call(x):
            xq, xs = per_token_group_quant_fp8(x, BLOCK[1], column_major_scales=True)
            return vops.cutlass_scaled_mm(xq, w.t(), out_dtype=torch.bfloat16, scale_a=xs, scale_b=s.t())
        return call
    return make


def stock_deepgemm():
    from vllm.model_executor.layers.quantization.utils.fp8_utils import per_token_group_quant_fp8
    from vllm.utils import deep_gemm as dg

    if not dg.is_deep_gemm_supported():
        raise RuntimeError("vLLM says DeepGEMM is not supported here")
    from vllm.model_executor.layers.quantization.utils.fp8_utils import deepgemm_post_process_fp8_weight_block

    e8m0 = dg.is_deep_gemm_e8m0_used()

    def make(w, s):
        wq, ws = deepgemm_post_process_fp8_weight_block(wq=w, ws=s, quant_block_shape=BLOCK, use_e8m0=e8m0)

        def call(x):
            xq, xs = per_token_group_quant_fp8(x, BLOCK[1], column_major_scales=True, tma_aligned_scales=True,
                                               use_ue8m0=e8m0)
            out = torch.empty(x.shape[0], w.shape[0], dtype=torch.bfloat16, device=x.device)
            dg.fp8_gemm_nt((xq, xs), (wq, ws), out, is_deep_gemm_e8m0_used=e8m0)
            return out
        return call
    return make


def stock_flashinfer_dynamic():
    """What vLLM 0.26 runs for a block-fp8 linear with FlashInfer staged on the H100: its
    ``dynamic_flashinfer_deepgemm_blockscale_gemm`` op (FlashInfer's swap-AB kernel on the bf16
    activations below 32 tokens, DeepGEMM from 32) on DeepGEMM's post-processed weights."""
    import vllm.model_executor.kernels.linear.scaled_mm.flashinfer  # noqa: F401 - registers the ops
    from vllm.utils import deep_gemm as dg
    from vllm.utils.flashinfer import is_flashinfer_fp8_blockscale_gemm_supported

    if not is_flashinfer_fp8_blockscale_gemm_supported():
        raise RuntimeError("vLLM says FlashInfer's block-scale fp8 GEMM is not available")
    from vllm.model_executor.layers.quantization.utils.fp8_utils import deepgemm_post_process_fp8_weight_block

    e8m0 = dg.is_deep_gemm_e8m0_used()

    def make(w, s):
        wq, ws = deepgemm_post_process_fp8_weight_block(wq=w, ws=s, quant_block_shape=BLOCK, use_e8m0=e8m0)
        return lambda x: torch.ops.vllm.dynamic_flashinfer_deepgemm_blockscale_gemm(x, wq, ws, BLOCK[1], e8m0)
    return make


def atom_default():
    """atom's op as its linears call it under vLLM: the GEMV for one token, FlashInfer's swap-AB
    kernel for 2-16 tokens on weights of at least 4096 rows where vLLM runs it
    (``ATOM_FP8_HOST_GEMM_SMALL``), W8A16 Triton below 17 tokens otherwise, then the host GEMM the
    plugin installs (``ATOM_FP8_HOST_GEMM``, DeepGEMM on the H100), W8A8 Triton where it declines."""
    from atom.ops import fp8_block_gemm
    from atom.ops import fp8_gemm as op
    from atom.ops.fp8_gemm import set_host_gemm
    from atom.plugin.vllm import fp8_gemm as host

    host.install.cache_clear()
    host.install()
    gemms = op._HOST_GEMMS
    set_host_gemm(None)  # installed only inside this side's calls: the other atom sides time atom's kernel
    print("[fp8_gemm] atom default: host GEMMs " + ("; ".join(
        f"{g.name} {g.min_tokens}-{g.max_tokens - 1 if g.max_tokens else 'max'}" for g in gemms) or "-"), flush=True)

    def make(w, s):
        def call(x):
            set_host_gemm(*gemms)
            try:
                return fp8_block_gemm.run("triton", x, w, s, BLOCK, w8a8_from=17)
            finally:
                set_host_gemm(None)
        return call
    return make


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json")
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--gemv-sweep", action="store_true")
    p.add_argument("--gemv-budget", type=float, default=240, help="seconds for --gemv-sweep's M = 1 part")
    p.add_argument("--no-vllm", action="store_true", help="atom's and cuBLAS's sides only")
    p.add_argument("--bf16-gemv-sweep", action="store_true",
                   help="the GEMV kernel's variants (stages included) on bf16 weights against cuBLAS, M = 1, on the dense shapes")
    p.add_argument("--no-table", action="store_true", help="the sweeps only")
    p.add_argument("--ms", default="", help="comma list of M (default %s)" % ",".join(map(str, MS)))
    p.add_argument("--shapes", default="", help="comma list of shape labels (default all)")
    args = p.parse_args(argv)
    from atom.ops import fp8_block_gemm
    from atom.ops.fp8_gemm import dequant_block_fp8

    dev = torch.device("cuda")
    makers = {}
    factories = () if args.no_vllm else (
        ("atom default", atom_default), ("stock cutlass", stock_cutlass), ("stock deepgemm", stock_deepgemm),
        ("stock fi-dynamic", stock_flashinfer_dynamic))
    for name, factory in factories:
        try:
            makers[name] = factory()
        except Exception as e:  # noqa: BLE001
            print(f"[fp8_gemm] {name}: unavailable ({type(e).__name__}: {str(e)[:200]})", flush=True)
    rows = []
    shapes = [s for s in SHAPES if not args.shapes or s[0] in args.shapes.split(",")]
    for label, n, k in [] if args.no_table else shapes:
        copies = max(2, int(200e6 // (n * k)) + 1)
        ws = [(torch.randn(n, k, device=dev) * 100).clamp(-448, 448).to(torch.float8_e4m3fn) for _ in range(copies)]
        ss = [torch.rand(-(-n // 128), -(-k // 128), device=dev) * 1e-3 + 1e-4 for _ in range(copies)]
        wb = [dequant_block_fp8(w, s, BLOCK).to(torch.bfloat16) for w, s in zip(ws[:2], ss[:2])]
        wb += [wb[i % 2].clone() for i in range(max(0, (copies + 1) // 2 - 2))]  # bf16: half as many copies
        calls = {"atom w8a16": [lambda x, w=w, s=s: fp8_block_gemm.run("triton", x, w, s, BLOCK) for w, s in zip(ws, ss)],
                 "atom w8a8": [lambda x, w=w, s=s: fp8_block_gemm.run("triton", x, w, s, BLOCK, w8a8_from=1)
                               for w, s in zip(ws, ss)],
                 "bf16 cublas": [lambda x, w=w: torch.mm(x, w.t()) for w in wb]}
        for name, make in makers.items():
            try:
                calls[name] = [make(w, s) for w, s in zip(ws, ss)]
            except Exception as e:  # noqa: BLE001
                print(f"[fp8_gemm] {label}: {name} failed to prepare ({type(e).__name__}: {str(e)[:200]})", flush=True)
        for m in [int(v) for v in args.ms.split(",")] if args.ms else MS:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            ref = x.float() @ dequant_block_fp8(ws[0], ss[0], BLOCK).t()
            row = {"shape": label, "n": n, "k": k, "m": m, "sides": {}}
            for name, fns in calls.items():
                try:
                    got = fns[0](x).float()
                    err = ((got - ref).abs().max() / ref.abs().max()).item()
                    t = timed(rotating(fns, x))
                except Exception as e:  # noqa: BLE001
                    row["sides"][name] = {"error": f"{type(e).__name__}: {str(e)[:160]}"}
                    continue
                fp8 = not name.startswith("bf16")
                nbytes = n * k * (1 if fp8 else 2) + m * k * 2 + m * n * 2
                flops = 2 * m * n * k
                row["sides"][name] = {"us": t * 1e6, "rel_err": err, "wrong": err > 0.08,
                                      "hbm_pct": 100 * nbytes / t / hbm(),
                                      "peak_pct": 100 * flops / t / (FP8_PEAK if "w8a8" in name or "stock" in name or "default" in name
                                                                    else BF16_PEAK)}
            rows.append(row)
            cells = "  ".join(f"{nm} {v['us']:.1f}us" + (" WRONG" if v.get("wrong") else "") if "us" in v
                              else f"{nm} ERR" for nm, v in row["sides"].items())
            print(f"[fp8_gemm] {label:<18} M={m:<5} {cells}", flush=True)
        del ws, ss, wb, calls
        torch.cuda.empty_cache()
    sweep = run_sweep(dev) if args.sweep else []
    gemv = run_gemv_sweep(dev, args.gemv_budget) if args.gemv_sweep else []
    bf16_gemv = run_bf16_gemv_sweep(dev, args.gemv_budget) if args.bf16_gemv_sweep else []
    if args.json:
        Path(args.json).write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "hbm_bytes_per_s": hbm(), "rows": rows,
                                               "sweep": sweep, "gemv_sweep": gemv, "bf16_gemv_sweep": bf16_gemv}, indent=1))
    print(table(rows))
    return 0


def run_sweep(dev) -> list[dict]:
    """W8A16 tile variants at small M on two shapes."""
    from atom.ops.fp8_gemm_triton import GemmConfig, fp8_block_gemm_fwd, num_sms

    out = []
    for n, k in ((6144, 4096), (4096, 12288)):
        copies = max(2, int(200e6 // (n * k)) + 1)
        ws = [(torch.randn(n, k, device=dev) * 100).clamp(-448, 448).to(torch.float8_e4m3fn) for _ in range(copies)]
        ss = [torch.rand(n // 128, k // 128, device=dev) * 1e-3 for _ in range(copies)]
        for m in (1, 64):
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            for bm in ((16,) if m <= 16 else (16, 64)):
                for bn in (32, 64, 128):
                    for stages in (4,):
                        for swap in (True, False):
                            for split in (1, 2, 4):
                                if (n // bn) * split > 4 * num_sms(dev) or (k // 128) // split < 2:
                                    continue
                                cfg = GemmConfig(bm, bn, 128, 1, 4, stages, swap, split)
                                i = [0]

                                def rot():
                                    i[0] = (i[0] + 1) % copies
                                    return fp8_block_gemm_fwd(x, ws[i[0]], ss[i[0]], BLOCK, x_scale=None, bias=None,
                                                              out_dtype=torch.bfloat16, config=cfg)
                                try:
                                    t = timed(rot, samples=3, min_ms=50)
                                except Exception as e:  # noqa: BLE001
                                    print(f"[sweep] {cfg} failed: {e}", flush=True)
                                    continue
                                out.append({"n": n, "k": k, "m": m, "cfg": cfg.__dict__, "us": t * 1e6,
                                            "hbm_pct": 100 * (n * k) / t / hbm()})
            best = sorted((r for r in out if r["n"] == n and r["k"] == k and r["m"] == m), key=lambda r: r["us"])[:3]
            for r in best:
                print(f"[sweep] N={n} K={k} M={m}: {r['us']:.1f} us ({r['hbm_pct']:.0f}% HBM) {r['cfg']}", flush=True)
    return out


#: (label, N, K) the GEMV sweep runs on: both Qwen3-8B GEMV extremes, the widest and the deepest
#: Qwen3-32B ones, DeepSeek-V3's narrow fused q_a + kv_a, a small 30B-A3B one.
GEMV_SHAPES = [("qwen3-8b qkv", 6144, 4096), ("qwen3-8b down", 4096, 12288), ("qwen3-32b gate_up", 51200, 5120),
               ("qwen3-32b down", 5120, 25600), ("dsv3 q_a+kv_a", 2112, 7168), ("qwen3-30b o", 2048, 4096)]


def _gemv_candidates(n: int, sms: int) -> list:
    """GEMV variants at one activation row: 4 / 8 warps, 4-16 weight rows, a register tile of
    2048 elements up to 2048 per warp, split-K 1 / 2 / 4 where the grid stays within 8 programs
    per SM."""
    from atom.ops.fp8_gemm_triton import GemmConfig

    out = []
    for warps in (4, 8):
        for bn in (4, 8, 16):
            for bk in (128, 256, 512, 1024, 2048, 4096):
                if not 2048 <= bn * bk <= 2048 * warps:
                    continue
                for split in (1, 2, 4):
                    if -(-n // bn) * split <= 8 * sms:
                        out.append(GemmConfig(1, bn, bk, 1, warps, 1, False, split, gemv=True))
    return out


def run_gemv_sweep(dev, budget: float) -> list[dict]:
    """The GEMV kernel's variants (:func:`_gemv_candidates`) at M = 1 on :data:`GEMV_SHAPES`
    (fp8 weights; within ``budget`` s), then per shape its 4 best at M = 2 and on bf16 weights
    (cuBLAS's ``torch.mm`` next to it), each next to what atom's dispatch picks (``default``) and
    the tensor-core kernel's configuration for that M (``mma``)."""
    import dataclasses
    import time as _time

    from atom.ops.fp8_gemm_triton import GemmConfig, _gemv, fp8_block_gemm_fwd, gemm_config, gemv_config, num_sms

    sms, out, t_end = num_sms(dev), [], _time.time() + budget

    def rec(label, n, k, m, kind, cfg, fn, nbytes):
        try:
            t = timed(rotating(fn), samples=2, min_ms=20)
        except Exception as e:  # noqa: BLE001
            print(f"[gemv] {label} M={m} {kind} {cfg} failed: {type(e).__name__}: {str(e)[:160]}", flush=True)
            return None
        r = {"shape": label, "n": n, "k": k, "m": m, "kind": kind, "us": t * 1e6, "hbm_pct": 100 * nbytes / t / hbm(),
             "cfg": dataclasses.asdict(cfg) if cfg is not None else None}
        out.append(r)
        return r

    def show(label, m, kind, others=("gemv default", "mma")):
        rows = [r for r in out if r["shape"] == label and r["m"] == m]
        for r in sorted((r for r in rows if r["kind"] == kind), key=lambda r: r["us"])[:3] + \
                [r for r in rows if r["kind"] in others]:
            c = r["cfg"]
            cs = f"bn {c['block_n']} bk {c['block_k']} w {c['warps']} st {c['stages']} split {c['split_k']}" if c else ""
            print(f"[gemv] {label:<18} M={m} {r['kind']:<14} {r['us']:7.1f} us ({r['hbm_pct']:3.0f}% HBM) {cs}", flush=True)

    for label, n, k in GEMV_SHAPES:
        copies = max(2, int(300e6 // (n * k)) + 1)
        ws = [(torch.randn(n, k, device=dev) * 100).clamp(-448, 448).to(torch.float8_e4m3fn) for _ in range(copies)]
        ss = [torch.rand(-(-n // 128), -(-k // 128), device=dev) * 1e-3 for _ in range(copies)]
        xs = {m: torch.randn(m, k, device=dev, dtype=torch.bfloat16) for m in (1, 2)}
        outs = {m: torch.empty(m, n, device=dev, dtype=torch.bfloat16) for m in (1, 2)}

        def gemv(m, cfg, ws=ws, ss=ss, xs=xs, outs=outs):  # the kernel forced to ``cfg``, weights rotating
            return [lambda w=w, s=s: _gemv(xs[m], w, s, BLOCK, None, outs[m], cfg) for w, s in zip(ws, ss)]

        def op(m, cfg, ws=ws, ss=ss, xs=xs):  # the op's dispatch with ``cfg``
            return [lambda w=w, s=s: fp8_block_gemm_fwd(xs[m], w, s, BLOCK, x_scale=None, bias=None,
                                                        out_dtype=torch.bfloat16, config=cfg) for w, s in zip(ws, ss)]

        for cfg in _gemv_candidates(n, sms):
            if _time.time() > t_end:
                break
            rec(label, n, k, 1, "gemv", cfg, gemv(1, cfg), n * k)
        best = sorted((r for r in out if r["shape"] == label and r["kind"] == "gemv"), key=lambda r: r["us"])[:4]
        for r in best:  # two rows: one program row each, at the best tiles' K and half of it
            for bk in {r["cfg"]["block_k"], max(128, r["cfg"]["block_k"] // 2)}:
                cfg = dataclasses.replace(GemmConfig(**r["cfg"]), block_k=bk)
                rec(label, n, k, 2, "gemv", cfg, gemv(2, cfg), n * k)
        for m in (1, 2):
            for kind, cfg in (("gemv default", gemv_config(m, n, k, 128, sms)),
                              ("mma", gemm_config(m, n, k, 128, False, sms))):
                if cfg is not None:
                    rec(label, n, k, m, kind, cfg, op(m, cfg), n * k)
            show(label, m, "gemv")
        del ws, ss
        # bf16 weights (lever 4: the dense bf16 decode GEMVs) against cuBLAS at M = 1
        wb = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) for _ in range(max(2, int(300e6 // (2 * n * k)) + 1))]
        rec(label, n, k, 1, "bf16 cublas", None, [lambda w=w: torch.mm(xs[1], w.t()) for w in wb], 2 * n * k)
        for r in best:
            for bk in {r["cfg"]["block_k"], max(128, r["cfg"]["block_k"] // 2)}:
                cfg = dataclasses.replace(GemmConfig(**r["cfg"]), block_k=bk)
                rec(label, n, k, 1, "bf16 gemv", cfg, [lambda w=w, cfg=cfg: _gemv(xs[1], w, None, None, None, outs[1], cfg)
                                                       for w in wb], 2 * n * k)
        show(label, 1, "bf16 gemv", ("bf16 cublas",))
        del wb
        torch.cuda.empty_cache()
    return out


#: (label, N, K): Qwen3-8B's four decode GEMVs on bf16 weights (the dense batch-1 step, entry 35)
BF16_GEMV_SHAPES = [("qwen3-8b qkv", 6144, 4096), ("qwen3-8b o", 4096, 4096), ("qwen3-8b gate_up", 24576, 4096),
                    ("qwen3-8b down", 4096, 12288)]


def _bf16_gemv_candidates(n: int, k: int, sms: int) -> list:
    """GEMV variants on bf16 weights: 4 / 8 warps, 4-16 weight rows, 512-2048 elements a step
    (1024-2048 per warp's share of the register tile), 1-3 software-pipeline stages; split-K 2 / 4
    only where the unsplit grid has fewer programs than SMs (and each split keeps >= 2 steps)."""
    from atom.ops.fp8_gemm_triton import GemmConfig

    out = []
    for warps in (4, 8):
        for bn in (4, 8, 16):
            for bk in (512, 1024, 2048):
                if not 2048 <= bn * bk <= 2048 * warps:
                    continue
                for stages in (1, 2, 3):
                    for split in (1, 2, 4):
                        if split == 1 or (-(-n // bn) < sms and -(-k // bk) // split >= 2):
                            out.append(GemmConfig(1, bn, bk, 1, warps, stages, False, split, gemv=True))
    return out


def run_bf16_gemv_sweep(dev, budget: float) -> list[dict]:
    """The GEMV kernel's variants on bf16 weights at M = 1 (:data:`BF16_GEMV_SHAPES`), within
    ``budget`` s split evenly across the shapes, next to cuBLAS and to atom's default
    (:func:`atom.ops.fp8_gemm_triton.gemv_config`), each with its % of :func:`hbm`."""
    import dataclasses
    import time as _time

    from atom.ops.fp8_gemm_triton import _gemv, gemv_config, num_sms

    sms, out = num_sms(dev), []
    for label, n, k in BF16_GEMV_SHAPES:
        t_end = _time.time() + budget / len(BF16_GEMV_SHAPES)
        wb = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) for _ in range(max(2, int(300e6 // (2 * n * k)) + 1))]
        x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
        y = torch.empty(1, n, device=dev, dtype=torch.bfloat16)
        ref = (x.float() @ wb[0].float().t())

        def rec(kind, cfg, fns):
            try:
                got = fns[0]().float()
                err = ((got - ref).abs().max() / ref.abs().max()).item()
                t = timed(rotating(fns), samples=2, min_ms=20)
            except Exception as e:  # noqa: BLE001
                print(f"[bf16 gemv] {label} {kind} {cfg} failed: {type(e).__name__}: {str(e)[:160]}", flush=True)
                return
            out.append({"shape": label, "n": n, "k": k, "m": 1, "kind": kind, "us": t * 1e6, "rel_err": err,
                        "hbm_pct": 100 * 2 * n * k / t / hbm(), "cfg": dataclasses.asdict(cfg) if cfg else None})

        rec("bf16 cublas", None, [lambda w=w: torch.mm(x, w.t()) for w in wb])
        default = gemv_config(1, n, k, None, sms)
        rec("gemv default", default, [lambda w=w: _gemv(x, w, None, None, None, y, default) for w in wb])
        for cfg in _bf16_gemv_candidates(n, k, sms):
            if _time.time() > t_end:
                print(f"[bf16 gemv] {label}: budget spent", flush=True)
                break
            rec("gemv", cfg, [lambda w=w, cfg=cfg: _gemv(x, w, None, None, None, y, cfg) for w in wb])
        rows = [r for r in out if r["shape"] == label]
        for r in sorted((r for r in rows if r["kind"] == "gemv"), key=lambda r: r["us"])[:5] + \
                [r for r in rows if r["kind"] != "gemv"]:
            c = r["cfg"]
            cs = f"bn {c['block_n']} bk {c['block_k']} w {c['warps']} st {c['stages']} split {c['split_k']}" if c else ""
            print(f"[bf16 gemv] {label:<17} {r['kind']:<13} {r['us']:7.1f} us ({r['hbm_pct']:3.0f}% HBM, err {r['rel_err']:.1e}) {cs}",
                  flush=True)
        del wb
        torch.cuda.empty_cache()
    return out


def table(rows: list[dict]) -> str:
    sides = sorted({s for r in rows for s in r["sides"]})
    lines = ["| shape | M | " + " | ".join(sides) + " |", "|---|---|" + "---|" * len(sides)]
    for r in rows:
        cells = []
        for s in sides:
            v = r["sides"].get(s)
            if v is None or "us" not in v:
                cells.append("-" if v is None else "error")
                continue
            pct = f"{v['hbm_pct']:.0f}% HBM" if r["m"] <= 64 else f"{v['peak_pct']:.0f}% peak"
            cells.append(f"{v['us']:.1f} us ({pct})" + (" wrong" if v["wrong"] else ""))
        lines.append(f"| {r['shape']} ({r['n']}x{r['k']}) | {r['m']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
