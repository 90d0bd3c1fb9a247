#!/usr/bin/env python
"""Which tile should atom's Triton MLA decode kernel use? A sweep over ``ATOM_MLA_DECODE_TILE``.

For each tile (heads per program BLOCK_H, KV tokens per step BLOCK_N, warps, pipeline stages) and
each decode shape (DeepSeek-V3 dims: 128 heads, latent 512 + rope 64, bf16, page 16), the time
per call of ``atom.ops.mla.mla_decode`` on Triton (CUDA-graph replays, cold L2: bench/ops_compute.py's
timer), its max |difference| from the default tile's output, and its speed-up over the default
(``auto``) tile. Tiles that do not compile (shared memory, registers) are listed as such. Needs
only torch + Triton + atom (no vLLM), so it can run before vLLM is staged.

    python bench/mla_tiles.py --json mla_tiles.json
    python bench/mla_tiles.py --tiles 32,32,8,2 64,32,8,2 --shapes 128x2048

The best tile by geometric-mean speed-up is printed last as ``best ATOM_MLA_DECODE_TILE=...``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

DEFAULT_TILES = [",".join(map(str, t)) for t in itertools.product((32, 64), (16, 32, 64), (4, 8), (1, 2))]
DEFAULT_SHAPES = ("32x2048", "128x2048", "256x1024")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiles", nargs="*", default=DEFAULT_TILES, help="BLOCK_H,BLOCK_N,warps,stages")
    ap.add_argument("--shapes", nargs="*", default=list(DEFAULT_SHAPES), help="BATCHxCONTEXT")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    import torch

    from atom.ops.mla import mla_decode
    from ops_compute import Timer

    dev = torch.device("cuda")
    timer = Timer(torch, dev, args.iters, use_graphs=True)
    heads, rank, rope, bs = 128, 512, 64, 16
    cases = []
    for shape in args.shapes:
        batch, ctx = (int(x) for x in shape.split("x"))
        blocks = -(-ctx // bs)
        nb = batch * blocks + 1
        cache = torch.randn(nb, bs, rank + rope, device=dev, dtype=torch.bfloat16)
        table = torch.randperm(nb - 1, device=dev)[: batch * blocks].view(batch, blocks).int()
        sl = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
        qn = torch.randn(batch, heads, rank, device=dev, dtype=torch.bfloat16)
        qp = torch.randn(batch, heads, rope, device=dev, dtype=torch.bfloat16)
        cases.append((shape, (qn, qp, cache, table, sl, (rank + rope) ** -0.5), ctx, torch.empty_like(qn)))

    def run_tile(tile: str) -> dict:
        os.environ["ATOM_MLA_DECODE_TILE"] = tile
        row = {"tile": tile, "us": {}, "err": 0.0}
        for shape, call, ctx, out in cases:
            try:
                res = mla_decode.run("triton", *call, max_seq_len=ctx, out=out).clone()
                row["us"][shape] = timer(lambda: mla_decode.run("triton", *call, max_seq_len=ctx, out=out))
            except Exception as exc:  # out of shared memory / registers: not a usable tile
                row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}"
                torch.cuda.synchronize()
                return row
            ref = refs.setdefault(shape, res)
            row["err"] = max(row["err"], (res.float() - ref.float()).abs().max().item())
        return row

    refs: dict = {}
    rows = [run_tile("auto")]
    base = rows[0]["us"]
    for tile in args.tiles:
        rows.append(run_tile(tile))
        r = rows[-1]
        print(f"  {tile:12s} " + ("  ".join(f"{s} {r['us'][s]:8.1f} us" for s in r["us"])
                                   if "error" not in r else r["error"]), flush=True)
    os.environ.pop("ATOM_MLA_DECODE_TILE", None)
    for r in rows:
        if "error" not in r:
            r["speedup"] = math.exp(sum(math.log(base[s] / r["us"][s]) for s in base) / len(base))
    print(f"\nMLA decode (128 heads, latent 512 + rope 64, bf16), {torch.cuda.get_device_name(0)}, "
          f"torch {torch.__version__}:")
    print("| tile (H,N,warps,stages) | " + " | ".join(f"{s} us" for s in args.shapes) + " | vs auto | max diff |")
    print("|---|" + "---|" * (len(args.shapes) + 2))
    for r in sorted(rows, key=lambda r: -r.get("speedup", 0.0)):
        if "error" in r:
            print(f"| {r['tile']} | " + " | ".join("-" for _ in args.shapes) + f" | {r['error']} | - |")
        else:
            print(f"| {r['tile']} | " + " | ".join(f"{r['us'][s]:.1f}" for s in args.shapes)
                  + f" | {r['speedup']:.2f}x | {r['err']:.1e} |")
    best = max((r for r in rows if "error" not in r), key=lambda r: r["speedup"])
    print(f"\nbest ATOM_MLA_DECODE_TILE={best['tile']} ({best['speedup']:.2f}x the default tile)")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "best": best["tile"],
                                               "gpu": torch.cuda.get_device_name(0)}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
