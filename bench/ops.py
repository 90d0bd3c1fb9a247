#!/usr/bin/env python
"""atom's kernel benchmark in one run: the memory-bound ops, then the compute ops.

Runs ``bench/ops_memory.py`` (RMSNorm(+add, +fp8), rotary, cache write, fused QK-norm + RoPE +
cache, SiLU-and-mul, fp8 quantisation; copy bandwidth measured in the same process) and
``bench/ops_compute.py`` (paged decode / prefill attention, MLA decode incl. vLLM's FlashMLA,
fused MoE; copy bandwidth and bf16 GEMM rate measured in the same process) one after the other
in this interpreter, so both tables come from the same GPU, versions and call. Each table has
atom's time, the torch reference's, vLLM's kernel for the same work (when vLLM imports), the
atom/vLLM ratio and the fraction of the roofline.

    python bench/ops.py [--json-dir DIR] [--memory-args "..."] [--compute-args "..."]
    python bench/ops.py --dry-run        # compute cases at tiny sizes on CPU (Triton interpreter)
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(HERE.parent))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json-dir", type=Path, help="write ops_memory.json and ops_compute.json here")
    p.add_argument("--memory-args", default="", help="extra arguments for ops_memory.py")
    p.add_argument("--compute-args", default="", help="extra arguments for ops_compute.py")
    p.add_argument("--dry-run", action="store_true",
                   help="no GPU: run only ops_compute.py --dry-run (ops_memory.py needs CUDA)")
    args = p.parse_args(argv)
    memory_argv, compute_argv = shlex.split(args.memory_args), shlex.split(args.compute_args)
    if args.json_dir:
        args.json_dir.mkdir(parents=True, exist_ok=True)
        memory_argv += ["--json", str(args.json_dir / "ops_memory.json")]
        compute_argv += ["--json", str(args.json_dir / "ops_compute.json")]
    import ops_compute

    if args.dry_run:
        return ops_compute.main(compute_argv + ["--dry-run"])
    import ops_memory

    print("== memory-bound ops ==", flush=True)
    rc = ops_memory.main(memory_argv)
    print("\n== compute ops ==", flush=True)
    return rc or ops_compute.main(compute_argv)


if __name__ == "__main__":
    sys.exit(main())
