"""Time atom's block-fp8 Triton GEMM warm-up per weight shape, cold, with nothing else running on
the GPU machine (bench/NOTES.md entry 78: in two overlapped cold starts one shape each time took
~110 s where the others took 7-12 s). Optionally with BURN CPU-bound busy processes beside it,
to see whether CPU contention alone gives such a slowdown.

Usage (GPU machine, the staged site on PYTHONPATH):
    python bench/warm_alone.py [--burn N] [--shapes 7168x2048,24576x1536,...] [--budget S]
Prints one line per shape: its warm-up's launches and seconds, and the Triton cache it used. It times
the call the engine's `warm-up fp8_block_gemm` line times (atom.ops.fp8_gemm.warm_up_fp8_block_gemm's),
without the host GEMMs, and waits for its launches.

``--with-host-gemms``: the engine's whole per-shape warm-up instead. vLLM is imported, its block-fp8
kernels are offered to atom as the plugin does at load (``atom.plugin.vllm.fp8_gemm.install``: DeepGEMM
from 17 tokens, FlashInfer's swap-AB kernel at 2-16 on weights of >= 4096 rows), and
``warm_up_fp8_block_gemm`` runs per shape, in the engine's order of shapes. Each shape's line then
gives every kernel's seconds (``atom.ops._warm.TOTALS``, each warm-up synchronised), with fresh Triton and
DeepGEMM caches (bench/NOTES.md 80: does one shape take ~100 s here, as in an engine's cold start?).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import tempfile
import time


def _burn(stop_at: float) -> None:
    x = 0
    while time.time() < stop_at:
        x = (x * 1103515245 + 12345) % 2147483648


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="2112x7168,3072x1536,7168x2048,24576x1536,4608x7168")
    p.add_argument("--burn", type=int, default=0, help="busy processes beside the compiles")
    p.add_argument("--budget", type=float, default=150.0, help="stop starting shapes after this many seconds")
    p.add_argument("--w8a8-from", type=int, default=None,
                   help="W8A8 from this many tokens (default: ATOM_FP8_W8A8_MIN_TOKENS, as the engine's warm-up)")
    p.add_argument("--with-host-gemms", action="store_true",
                   help="vLLM imported and its DeepGEMM / FlashInfer kernels warmed before atom's Triton GEMM, per "
                        "shape, as an engine's load does")
    args = p.parse_args()

    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="triton-cold-")
    if args.with_host_gemms:
        os.environ["DG_JIT_CACHE_DIR"] = tempfile.mkdtemp(prefix="deep-gemm-cold-")
    import torch

    from atom import envs
    from atom.ops.fp8_gemm_triton import warm_up

    w8a8_from = envs.ATOM_FP8_W8A8_MIN_TOKENS if args.w8a8_from is None else args.w8a8_from
    if args.with_host_gemms:
        from atom.ops import _warm
        from atom.ops.fp8_gemm import warm_up_fp8_block_gemm
        from atom.plugin.vllm.fp8_gemm import install

        print(f"host GEMMs: {install()} (DeepGEMM cache {os.environ['DG_JIT_CACHE_DIR']})", flush=True)

    burners = []
    if args.burn:
        stop_at = time.time() + args.budget + 60
        burners = [mp.Process(target=_burn, args=(stop_at,), daemon=True) for _ in range(args.burn)]
        for proc in burners:
            proc.start()
    start = time.perf_counter()
    for spec in args.shapes.split(","):
        if time.perf_counter() - start > args.budget:
            print(f"budget spent; not started: {spec}", flush=True)
            continue
        n, k = (int(v) for v in spec.split("x"))
        weight = torch.zeros(n, k, device="cuda").to(torch.float8_e4m3fn)
        scale = torch.ones((n + 127) // 128, (k + 127) // 128, device="cuda")
        t0 = time.perf_counter()
        if args.with_host_gemms:
            before = {name: total[2] for name, total in _warm.TOTALS.items()}
            launches = warm_up_fp8_block_gemm(weight, scale, (128, 128), act_dtype=torch.bfloat16, w8a8_from=w8a8_from)
            torch.cuda.synchronize()
            split = ", ".join(f"{name} {total[2] - before.get(name, 0.0):.1f} s" for name, total in _warm.TOTALS.items()
                              if total[2] - before.get(name, 0.0) > 0)
        else:
            launches = warm_up(weight, scale, (128, 128), torch.bfloat16, w8a8_from, False)
            torch.cuda.synchronize()
            split = ""
        print(f"burn={args.burn} shape ({n}, {k}): {launches} launches in {time.perf_counter() - t0:.1f} s "
              f"(cache {os.environ['TRITON_CACHE_DIR']})" + (f": {split}" if split else ""), flush=True)
    for proc in burners:
        proc.terminate()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
