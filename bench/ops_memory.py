#!/usr/bin/env python
"""Benchmark atom's memory-bound ops on one CUDA GPU: atom Triton vs torch reference vs vLLM.

For each op at decode and prefill token counts (Qwen3-8B and Qwen3-30B-A3B shapes) it prints
one table row with:

* the time of atom's Triton kernel, of the plain-torch reference, and of vLLM's own kernel(s)
  for the same work when ``import vllm`` works (for the fused QK-norm + RoPE + cache op:
  vLLM's unfused sequence -- two RMSNorms, rotary_embedding, reshape_and_cache_flash -- and
  vLLM's ``fused_qk_norm_rope`` + ``reshape_and_cache_flash``);
* the bytes the op must move (every input read once, every output written once);
* achieved GB/s and the fraction of the copy bandwidth measured in the same run
  (a large ``Tensor.copy_``; copy bytes = read + write);
* ``x vllm`` = vLLM time / atom time (> 1: atom is faster), against the first vLLM variant
  listed in the row; ``max|diff|`` = max abs difference between atom's Triton output and the
  torch reference (fp8 outputs: in quantised units).

Times are medians over CUDA-graph replays of several back-to-back calls (no launch or Python
overhead; ``--no-graph`` times eager calls with ``triton.testing.do_bench`` instead, which is
also the fallback for callables that cannot be captured, e.g. the torch cache reference with
its data-dependent indexing). Small token counts are L2-resident and latency-bound: their
GB/s is not a DRAM figure. Each row also checks atom's output against the torch reference.

    python bench/ops_memory.py [--models Qwen3-8B] [--tokens 32 4096] [--ops rms_norm]
                               [--json out.json] [--no-graph] [--skip-torch]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch

_REPO = Path(__file__).resolve().parents[1]
if str(_REPO) not in sys.path:  # run from a checkout without installing atom
    sys.path.insert(0, str(_REPO))


@dataclass(frozen=True)
class Model:
    hidden: int
    q_heads: int
    kv_heads: int
    head_dim: int
    ffn_rows_per_token: int  # rows fed to silu_and_mul per token (MoE: top-k experts)
    ffn_dim: int  # d of silu_and_mul's [rows, 2d] input (dense intermediate / MoE expert dim)


MODELS = {
    "Qwen3-8B": Model(hidden=4096, q_heads=32, kv_heads=8, head_dim=128, ffn_rows_per_token=1, ffn_dim=12288),
    "Qwen3-30B-A3B": Model(hidden=2048, q_heads=32, kv_heads=4, head_dim=128, ffn_rows_per_token=8, ffn_dim=768),
}
TOKENS = [32, 256, 4096, 16384]
OP_NAMES = [
    "rms_norm", "fused_add_rms_norm", "rms_norm_fp8", "rotary_embedding", "reshape_and_cache",
    "reshape_and_cache_fp8", "fused_qk_norm_rope_cache", "fused_qk_norm_rope_cache_fp8",
    "silu_and_mul", "per_token_quant_fp8", "per_block_quant_fp8",
]
EPS = 1e-6
BLOCK_SIZE = 16
MAX_POSITION = 40960


@dataclass
class Case:
    op: str
    model: str
    tokens: int
    shape: str
    bytes: int
    atom: Callable[[], object]
    torch_ref: Callable[[], object]
    vllm: dict[str, Callable[[], object]] = field(default_factory=dict)
    check: Optional[Callable[[], float]] = None  # max |atom - torch| (0 when equal)


# -- timing --------------------------------------------------------------------------------------
def _time_graph(fn: Callable[[], object], calls: int, replays: int) -> float:
    """Median ms per call over replays of a CUDA graph holding ``calls`` back-to-back calls."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up (Triton compiles, allocator pools) off-graph
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)


def _time_eager(fn: Callable[[], object]) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def measure(fn: Callable[[], object], use_graph: bool, calls: int, replays: int) -> tuple[float, str]:
    """(median ms per call, method)."""
    if use_graph:
        try:
            return _time_graph(fn, calls, replays), "graph"
        except Exception:  # not capturable (host syncs): fall back to eager timing
            torch.cuda.synchronize()
    return _time_eager(fn), "eager"


def copy_bandwidth_gbps(use_graph: bool, calls: int, replays: int, nbytes: int = 1 << 30) -> float:
    """Device copy bandwidth (read + write bytes per second) of a large ``copy_``."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    ms, _ = measure(lambda: dst.copy_(src), use_graph, max(1, calls // 4), replays)
    return 2 * nbytes / (ms * 1e-3) / 1e9


# -- vLLM ----------------------------------------------------------------------------------------
def load_vllm() -> tuple[Optional[object], str]:
    """``(vllm._custom_ops, version)`` or ``(None, why not)``; never required."""
    try:
        import vllm
        import vllm._custom_ops as vops

        return vops, getattr(vllm, "__version__", "?")
    except Exception as exc:  # no vLLM, or a build without CUDA kernels
        return None, f"unavailable ({type(exc).__name__}: {exc})"[:200]


def _vllm_group_quant():
    try:
        from vllm.model_executor.layers.quantization.utils.fp8_utils import per_token_group_quant_fp8

        return per_token_group_quant_fp8
    except Exception:
        return None


# -- cases ---------------------------------------------------------------------------------------
def _slot_mapping(tokens: int, num_blocks: int, device: str) -> torch.Tensor:
    """Prefill-like: tokens fill shuffled physical blocks in order (as a block table would)."""
    table = torch.randperm(num_blocks, device=device)
    t = torch.arange(tokens, device=device)
    return table[t // BLOCK_SIZE] * BLOCK_SIZE + t % BLOCK_SIZE


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item() if a.numel() else 0.0


def build_cases(name: str, m: Model, tokens: int, dtype: torch.dtype, vops, ops_filter: set[str],
                device: str = "cuda") -> list[Case]:
    """The cases for one model and token count (``device`` is "cuda" except in CPU smoke tests)."""
    from atom.ops import OPS, split_qkv

    dev = device
    e = torch.empty((), dtype=dtype).element_size()
    fp8 = torch.float8_e4m3fn
    cases: list[Case] = []
    # The callables close over the tensors below, which live as long as the returned cases
    # (a few GB at 16384 tokens); the driver drops them before the next token count.

    def want(op: str) -> bool:
        return not ops_filter or op in ops_filter

    T, H = tokens, m.hidden
    x = torch.randn(T, H, device=dev, dtype=dtype)
    res = torch.randn(T, H, device=dev, dtype=dtype)
    w = torch.rand(H, device=dev, dtype=dtype) + 0.5
    rn = OPS["rms_norm"]
    out_n = torch.empty_like(x)
    if want("rms_norm"):
        v = {}
        if vops is not None:
            v["vllm rms_norm"] = lambda: vops.rms_norm(out_n, x, w, EPS)
        cases.append(Case("rms_norm", name, T, f"[{T},{H}]", 2 * T * H * e + H * e,
                          lambda: rn.run("triton", x, w, EPS, out=out_n), lambda: rn.run("torch", x, w, EPS), v,
                          lambda: _max_diff(rn.run("triton", x, w, EPS), rn.run("torch", x, w, EPS))))
    if want("fused_add_rms_norm"):
        out_r = torch.empty_like(x)
        xv, rv = x.clone(), res.clone()
        v = {}
        if vops is not None:  # in place on (x, residual): same bytes as out of place
            v["vllm fused_add_rms_norm"] = lambda: vops.fused_add_rms_norm(xv, rv, w, EPS)
        cases.append(Case("fused_add_rms_norm", name, T, f"[{T},{H}]", 4 * T * H * e + H * e,
                          lambda: rn.run("triton", x, w, EPS, res, out=out_n, residual_out=out_r),
                          lambda: rn.run("torch", x, w, EPS, res), v,
                          lambda: _max_diff(rn.run("triton", x, w, EPS, res)[0], rn.run("torch", x, w, EPS, res)[0])))
    if want("rms_norm_fp8"):
        scale = torch.tensor([0.02], device=dev)
        out8 = torch.empty(T, H, device=dev, dtype=fp8)
        v = {}
        if vops is not None and hasattr(getattr(torch.ops, "_C", None), "rms_norm_static_fp8_quant"):
            v["vllm rms_norm_static_fp8_quant"] = lambda: torch.ops._C.rms_norm_static_fp8_quant(out8, x, w, scale, EPS)
        cases.append(Case("rms_norm_fp8", name, T, f"[{T},{H}]->fp8", T * H * (e + 1) + H * e,
                          lambda: rn.run("triton", x, w, EPS, None, fp8, scale, out=out8),
                          lambda: rn.run("torch", x, w, EPS, None, fp8, scale), v,
                          lambda: _max_diff(rn.run("triton", x, w, EPS, None, fp8, scale),
                                            rn.run("torch", x, w, EPS, None, fp8, scale))))

    # Attention prologue tensors: qkv projection output, positions, RoPE table, paged cache.
    hq, hk, d = m.q_heads, m.kv_heads, m.head_dim
    qkv = torch.randn(T, (hq + 2 * hk) * d, device=dev, dtype=dtype)
    q, k, v_ = split_qkv(qkv, hq, hk, d)
    pos = torch.randint(0, MAX_POSITION, (T,), device=dev)
    inv = 1.0 / (1e6 ** (torch.arange(0, d, 2, device=dev, dtype=torch.float32) / d))
    ang = torch.arange(MAX_POSITION, device=dev, dtype=torch.float32)[:, None] * inv[None, :]
    cs = torch.cat((ang.cos(), ang.sin()), dim=-1).to(dtype)  # vLLM keeps it in the model dtype
    num_blocks = math.ceil(T / BLOCK_SIZE) + 64
    slots = _slot_mapping(T, num_blocks, dev)
    qw = torch.rand(d, device=dev, dtype=dtype) + 0.5
    kw = torch.rand(d, device=dev, dtype=dtype) + 0.5
    one = torch.ones(1, device=dev)
    ks, vs = torch.tensor([0.05], device=dev), torch.tensor([0.05], device=dev)

    if want("rotary_embedding"):
        rope = OPS["rotary_embedding"]
        qa, ka, qb, kb = q.clone(), k.clone(), q.clone(), k.clone()
        qv = qkv.clone()
        qv_q, qv_k, _ = split_qkv(qv, hq, hk, d)
        vd = {}
        if vops is not None:
            vd["vllm rotary_embedding"] = lambda: vops.rotary_embedding(
                pos, qv_q.view(T, -1), qv_k.view(T, -1), d, cs, True)
        rope_bytes = 2 * T * (hq + hk) * d * e + T * d * e + T * 8

        def rope_check() -> float:
            a1, a2, b1, b2 = q.clone(), k.clone(), q.clone(), k.clone()
            rope.run("triton", pos, a1, a2, cs, d, d, True)
            rope.run("torch", pos, b1, b2, cs, d, d, True)
            return max(_max_diff(a1, b1), _max_diff(a2, b2))

        cases.append(Case("rotary_embedding", name, T, f"q[{T},{hq},{d}] k[{T},{hk},{d}] neox", rope_bytes,
                          lambda: rope.run("triton", pos, qa, ka, cs, d, d, True),
                          lambda: rope.run("torch", pos, qb, kb, cs, d, d, True), vd, rope_check))

    for cache_kind in ("auto", "fp8"):
        cache_dtype = dtype if cache_kind == "auto" else fp8
        ce = 1 if cache_kind == "fp8" else e
        suffix = "" if cache_kind == "auto" else "_fp8"
        if want("reshape_and_cache" + suffix):
            cache_op = OPS["reshape_and_cache"]
            kv_a = torch.zeros(2, num_blocks, BLOCK_SIZE, hk, d, device=dev, dtype=cache_dtype)
            kv_b, kv_v = kv_a.clone(), kv_a.clone()
            sc = (ks, vs) if cache_kind == "fp8" else (None, None)
            vd = {}
            if vops is not None:
                def vllm_cache(kv_v=kv_v, ck=cache_kind, sc=sc):
                    vops.reshape_and_cache_flash(k, v_, kv_v[0], kv_v[1], slots, ck,
                                                 one if sc[0] is None else sc[0], one if sc[1] is None else sc[1])

                vd["vllm reshape_and_cache_flash"] = vllm_cache

            def cache_check(kv_a=kv_a, kv_b=kv_b, ck=cache_kind, sc=sc) -> float:
                cache_op.run("triton", k, v_, kv_a[0], kv_a[1], slots, ck, *sc)
                cache_op.run("torch", k, v_, kv_b[0], kv_b[1], slots, ck, *sc)
                return _max_diff(kv_a, kv_b)

            cases.append(Case("reshape_and_cache" + suffix, name, T, f"k,v[{T},{hk},{d}] -> {cache_kind}",
                              2 * T * hk * d * (e + ce) + T * 8,
                              lambda kv_a=kv_a, ck=cache_kind, sc=sc: cache_op.run(
                                  "triton", k, v_, kv_a[0], kv_a[1], slots, ck, *sc),
                              lambda kv_b=kv_b, ck=cache_kind, sc=sc: cache_op.run(
                                  "torch", k, v_, kv_b[0], kv_b[1], slots, ck, *sc),
                              vd, cache_check))
        if want("fused_qk_norm_rope_cache" + suffix):
            fused = OPS["fused_qk_norm_rope_cache"]
            kv_a = torch.zeros(2, num_blocks, BLOCK_SIZE, hk, d, device=dev, dtype=cache_dtype)
            kv_b, kv_u, kv_f = kv_a.clone(), kv_a.clone(), kv_a.clone()
            sc = (ks, vs) if cache_kind == "fp8" else (None, None)
            # Each implementation works on its own copy (they update q/k in place; repeating
            # the op on already-normed data costs the same). Closures bind loop variables as
            # defaults: the loop runs twice (auto, fp8).
            qkv_a, qkv_b, qkv_u, qkv_f = qkv.clone(), qkv.clone(), qkv.clone(), qkv.clone()
            qa, ka, va = split_qkv(qkv_a, hq, hk, d)
            qb, kb, vb = split_qkv(qkv_b, hq, hk, d)
            vd = {}
            if vops is not None:
                qu, ku, vu = split_qkv(qkv_u, hq, hk, d)
                q_out = torch.empty(T, hq, d, device=dev, dtype=dtype)
                k_out = torch.empty(T, hk, d, device=dev, dtype=dtype)
                s0 = sc[0] if sc[0] is not None else one
                s1 = sc[1] if sc[1] is not None else one

                def vllm_unfused(qu=qu, ku=ku, vu=vu, q_out=q_out, k_out=k_out, kv_u=kv_u, ck=cache_kind, s0=s0, s1=s1):
                    # What vLLM's Qwen3Attention + attention backend run: per-head RMSNorm of the
                    # strided q/k views into new tensors, RoPE on those, then the cache write.
                    vops.rms_norm(q_out, qu, qw, EPS)
                    vops.rms_norm(k_out, ku, kw, EPS)
                    vops.rotary_embedding(pos, q_out.view(T, -1), k_out.view(T, -1), d, cs, True)
                    vops.reshape_and_cache_flash(k_out, vu, kv_u[0], kv_u[1], slots, ck, s0, s1)

                vd["vllm unfused (2x rms_norm+rope+cache)"] = vllm_unfused
                if hasattr(vops, "fused_qk_norm_rope"):
                    _, kf, vf = split_qkv(qkv_f, hq, hk, d)

                    def vllm_fused(qkv_f=qkv_f, kf=kf, vf=vf, kv_f=kv_f, ck=cache_kind, s0=s0, s1=s1):
                        vops.fused_qk_norm_rope(qkv_f, hq, hk, hk, d, EPS, qw, kw, cs, True, pos)
                        vops.reshape_and_cache_flash(kf, vf, kv_f[0], kv_f[1], slots, ck, s0, s1)

                    vd["vllm fused_qk_norm_rope+cache"] = vllm_fused
            # read q,k,v; write q,k; write cache k,v; cos/sin rows, positions, slots.
            nbytes = (T * (hq + 2 * hk) * d * e + T * (hq + hk) * d * e + 2 * T * hk * d * ce
                      + T * d * e + 2 * T * 8)

            def fused_check(kv_a=kv_a, ck=cache_kind, sc=sc) -> float:
                c1, c2 = qkv.clone(), qkv.clone()
                k1 = torch.zeros_like(kv_a)
                k2 = torch.zeros_like(kv_a)
                fused.run("triton", *split_qkv(c1, hq, hk, d), qw, kw, EPS, pos, cs, True, k1[0], k1[1], slots, ck, *sc)
                fused.run("torch", *split_qkv(c2, hq, hk, d), qw, kw, EPS, pos, cs, True, k2[0], k2[1], slots, ck, *sc)
                return max(_max_diff(c1, c2), _max_diff(k1, k2))

            cases.append(Case(
                "fused_qk_norm_rope_cache" + suffix, name, T, f"q{hq} k{hk} v{hk} x{d} -> {cache_kind}", nbytes,
                lambda qa=qa, ka=ka, va=va, kv_a=kv_a, ck=cache_kind, sc=sc: fused.run(
                    "triton", qa, ka, va, qw, kw, EPS, pos, cs, True, kv_a[0], kv_a[1], slots, ck, *sc),
                lambda qb=qb, kb=kb, vb=vb, kv_b=kv_b, ck=cache_kind, sc=sc: fused.run(
                    "torch", qb, kb, vb, qw, kw, EPS, pos, cs, True, kv_b[0], kv_b[1], slots, ck, *sc),
                vd, fused_check))

    rows, fd = T * m.ffn_rows_per_token, m.ffn_dim
    if want("silu_and_mul"):
        silu = OPS["silu_and_mul"]
        xs = torch.randn(rows, 2 * fd, device=dev, dtype=dtype)
        out_s = torch.empty(rows, fd, device=dev, dtype=dtype)
        vd = {}
        if vops is not None:
            vd["vllm silu_and_mul"] = lambda: torch.ops._C.silu_and_mul(out_s, xs)
        cases.append(Case("silu_and_mul", name, T, f"[{rows},{2 * fd}]", 3 * rows * fd * e,
                          lambda: silu.run("triton", xs, out=out_s), lambda: silu.run("torch", xs), vd,
                          lambda: _max_diff(silu.run("triton", xs), silu.run("torch", xs))))
    xq = torch.randn(T, H, device=dev, dtype=dtype)
    if want("per_token_quant_fp8"):
        ptq = OPS["per_token_quant_fp8"]
        vd = {}
        if vops is not None:
            vd["vllm scaled_fp8_quant(per-token)"] = lambda: vops.scaled_fp8_quant(xq, use_per_token_if_dynamic=True)
        cases.append(Case("per_token_quant_fp8", name, T, f"[{T},{H}]", T * H * (e + 1) + 4 * T,
                          lambda: ptq.run("triton", xq), lambda: ptq.run("torch", xq), vd,
                          lambda: _max_diff(ptq.run("triton", xq)[0], ptq.run("torch", xq)[0])))
    if want("per_block_quant_fp8"):
        pbq = OPS["per_block_quant_fp8"]
        vd = {}
        group_quant = _vllm_group_quant() if vops is not None else None
        if group_quant is not None:
            vd["vllm per_token_group_quant_fp8"] = lambda: group_quant(xq, 128)
        cases.append(Case("per_block_quant_fp8", name, T, f"[{T},{H}] 1x128", T * H * (e + 1) + 4 * T * H // 128,
                          lambda: pbq.run("triton", xq, 128), lambda: pbq.run("torch", xq, 128), vd,
                          lambda: _max_diff(pbq.run("triton", xq, 128)[0], pbq.run("torch", xq, 128)[0])))
    return cases


# -- driver --------------------------------------------------------------------------------------
def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", choices=sorted(MODELS), default=list(MODELS))
    p.add_argument("--tokens", nargs="+", type=int, default=TOKENS, help="token counts (default %(default)s)")
    p.add_argument("--ops", nargs="+", choices=OP_NAMES, default=[], help="subset of ops (default: all)")
    p.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    p.add_argument("--json", type=Path, help="also write the results (and environment) as JSON here")
    p.add_argument("--no-graph", action="store_true", help="time eager calls (do_bench) instead of CUDA graphs")
    p.add_argument("--calls-per-graph", type=int, default=20)
    p.add_argument("--replays", type=int, default=30)
    p.add_argument("--skip-torch", action="store_true", help="do not time the torch reference")
    p.add_argument("--skip-check", action="store_true", help="do not compare atom with the torch reference")
    p.add_argument("--no-vllm", action="store_true", help="do not time vLLM's kernels even if vLLM imports")
    return p.parse_args(argv)


def _fmt_us(ms: Optional[float]) -> str:
    return f"{'-':>9}" if ms is None else f"{ms * 1e3:9.1f}"


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("ops_memory.py needs a CUDA GPU (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    import triton

    torch.manual_seed(0)
    use_graph = not args.no_graph
    dtype = getattr(torch, args.dtype)
    vops, vllm_version = (None, "disabled (--no-vllm)") if args.no_vllm else load_vllm()
    copy_bw = copy_bandwidth_gbps(use_graph, args.calls_per_graph, args.replays)
    env = {
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
        "vllm": vllm_version, "dtype": args.dtype, "timing": "cuda-graph" if use_graph else "eager do_bench",
        "copy_bandwidth_GBps": round(copy_bw, 1),
    }
    print(" | ".join(f"{k}: {v}" for k, v in env.items()))
    header = (f"{'op':<30}{'model':<15}{'T':>6} {'MB':>8} {'atom us':>9} {'GB/s':>7} {'%copy':>6} "
              f"{'torch us':>9} {'vllm us':>9} {'x vllm':>7}  {'max|diff|':>9}  vllm kernel(s)")
    print(header)
    print("-" * len(header))
    rows = []
    for model_name in args.models:
        for tokens in args.tokens:
            cases = build_cases(model_name, MODELS[model_name], tokens, dtype, vops, set(args.ops))
            cases.sort(key=lambda c: OP_NAMES.index(c.op))
            for case in cases:
                row = {"op": case.op, "model": case.model, "tokens": case.tokens, "shape": case.shape,
                       "bytes": case.bytes}
                atom_ms, row["atom_timing"] = measure(case.atom, use_graph, args.calls_per_graph, args.replays)
                row["atom_us"] = atom_ms * 1e3
                row["atom_GBps"] = case.bytes / (atom_ms * 1e-3) / 1e9
                row["atom_frac_copy"] = row["atom_GBps"] / copy_bw
                torch_ms = None
                if not args.skip_torch:
                    torch_ms, row["torch_timing"] = measure(case.torch_ref, use_graph, args.calls_per_graph,
                                                            args.replays)
                    row["torch_us"] = torch_ms * 1e3
                row["vllm"] = {}
                for label, fn in case.vllm.items():
                    try:
                        ms, how = measure(fn, use_graph, args.calls_per_graph, args.replays)
                        row["vllm"][label] = {"us": ms * 1e3, "GBps": case.bytes / (ms * 1e-3) / 1e9, "timing": how}
                    except Exception as exc:  # a vLLM build without this kernel, or another signature
                        row["vllm"][label] = {"error": f"{type(exc).__name__}: {exc}"[:200]}
                if not args.skip_check and case.check is not None:
                    row["max_abs_diff_vs_torch"] = case.check()
                rows.append(row)
                timed = [(lbl, r["us"]) for lbl, r in row["vllm"].items() if "us" in r]
                # Compare with vLLM's first listed way of doing this work (the unfused
                # sequence for the fused op); every variant is in the JSON.
                vllm_label, vllm_us = timed[0] if timed else ("", None)
                speed = f"{vllm_us / row['atom_us']:6.2f}x" if vllm_us else "      -"
                check = f"{row['max_abs_diff_vs_torch']:.2e}" if "max_abs_diff_vs_torch" in row else "-"
                others = "; ".join([f"{lbl} {us:.1f}us" for lbl, us in timed[1:]]
                                   + [f"{lbl}: error (see JSON)" for lbl, r in row["vllm"].items() if "error" in r])
                sep = " | " if vllm_label and others else ""
                print(f"{case.op:<30}{case.model:<15}{case.tokens:>6} {case.bytes / 1e6:8.2f} "
                      f"{_fmt_us(atom_ms)} {row['atom_GBps']:7.0f} {100 * row['atom_frac_copy']:5.0f}% "
                      f"{_fmt_us(torch_ms)} {_fmt_us(None if vllm_us is None else vllm_us / 1e3)} {speed}  "
                      f"{check:>9}  {vllm_label}{sep}{others}", flush=True)
            del cases
            torch.cuda.empty_cache()
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"env": env, "results": rows,
                                         "created": time.strftime("%Y-%m-%dT%H:%M:%S")}, indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
