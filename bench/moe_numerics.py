#!/usr/bin/env python
"""atom's and vLLM's block-fp8 fused-MoE numerics, emulated in torch on a CPU: how far each lands from
the exact expert MLP, and from each other, at bench/moe_sweep.py's shapes and weight draw.

bench/moe_sweep.py --vs-vllm measured vLLM's output 0.04-0.08 of its max away from atom's (bench/NOTES.md
81). vLLM 0.26's ``fused_experts`` quantises its activations through ``per_token_group_quant_fp8``, whose
scales are rounded up to powers of two once DeepGEMM is present (``VLLM_USE_DEEP_GEMM_E8M0=1``, the
default), and keeps gemm1's output and the SiLU-and-mul output in bf16. This script computes both
recipes on the same weights and tokens, without a GPU and without vLLM, and says which of those
steps makes the difference:

- ``atom``: activations quantised per token and 128 channels with float32 scales ``max|x| / 448``;
  gemm1, SiLU-and-mul and gemm2 in float32 (the quantisation of gemm1's output reads float32);
- ``vllm``: the same with power-of-two scales (``2^ceil(log2(max|x| / 448))``), gemm1's output and the
  SiLU-and-mul output rounded to bf16;
- ``vllm-no-e8m0``: ``vllm`` with float32 scales (``VLLM_USE_DEEP_GEMM_E8M0=0``);
- ``exact``: float64 on the dequantised weights, no activation quantisation.

Every recipe rounds each (token, expert) output to bf16 before the sum over the top-k, as both kernels
store it. The error is moe_sweep's: ``max |a - b| / max |b|``.

    python bench/moe_numerics.py                       # dsv3-tp8 and dsv3 at 1, 2, 8 tokens
    python bench/moe_numerics.py --only dsv3-tp8 --tokens 1,2,3,4 --json /tmp/n.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional

from moe_sweep import block_scales, fp8_normal  # bench/ is on sys.path (a script, or tests/_bench.py)

REPO = Path(__file__).resolve().parent.parent
#: the recipes (see the module docstring): power-of-two scales, gemm1 output in bf16, SiLU-and-mul output in bf16
RECIPES = {"atom": (False, False, False), "vllm": (True, True, True), "vllm-no-e8m0": (False, True, True)}
FP8_MAX = 448.0


def qdq(torch, x, group: int, ue8m0: bool):
    """``x [rows, cols]`` (float32) quantised to e4m3 per row and ``group`` columns and back."""
    rows, cols = x.shape
    g = x.view(rows, cols // group, group)
    s = g.abs().amax(-1, keepdim=True).clamp_min(1e-10) * (1.0 / FP8_MAX)
    if ue8m0:
        s = torch.exp2(torch.ceil(torch.log2(s)))
    q = (g / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()
    return (q * s).view(rows, cols)


def expert_mlp(torch, x, tw, ti, weights: dict, recipe: Optional[str], group: int = 128, round_pairs: bool = True):
    """The MoE output of ``x [T, hidden]`` (float32) under ``recipe`` (None: ``exact``, float64);
    ``round_pairs``: each (token, expert) output rounded to bf16 before the sum."""
    ue8m0, bf16_h, bf16_a = RECIPES[recipe] if recipe else (False, False, False)
    dt = torch.float64 if recipe is None else torch.float32
    bf16 = lambda t: t.to(torch.bfloat16).to(dt)  # noqa: E731
    out = torch.zeros(x.shape, dtype=dt)
    for t in range(x.shape[0]):
        for j in range(ti.shape[1]):
            w13, w2 = (w.to(dt) for w in weights[int(ti[t, j])])
            xi = x[t:t + 1].to(dt)
            if recipe:
                xi = qdq(torch, xi, group, ue8m0)
            h = xi @ w13.T
            if bf16_h:
                h = bf16(h)
            inter = h.shape[1] // 2
            a = torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]
            if bf16_a:
                a = bf16(a)
            if recipe:
                a = qdq(torch, a, group, ue8m0)
            y = float(tw[t, j]) * (a @ w2.T)
            out[t] += (bf16(y) if round_pairs else y)[0]
    return out


def draw(torch, experts: int, hidden: int, inter: int, top_k: int, tokens: int, seed: int):
    """moe_sweep's draw (its ``make_weights`` distribution, its routing) on a CPU, only the experts
    the tokens reach: ``(x, topk weights, topk ids, {expert: (w13, w2) dequantised float32})``."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, experts, generator=g)
    tw, ti = torch.softmax(logits, -1).topk(top_k, -1)
    tw = tw / tw.sum(-1, keepdim=True)
    weights = {}
    for e in sorted(set(ti.flatten().tolist())):
        w13 = fp8_normal(torch, (2 * inter, hidden), "cpu", g).float()
        w2 = fp8_normal(torch, (hidden, inter), "cpu", g).float()
        s13 = block_scales(torch, (2 * inter // 128, hidden // 128), hidden, "cpu", g)
        s2 = block_scales(torch, (hidden // 128, inter // 128), inter, "cpu", g)
        weights[e] = (w13 * s13.repeat_interleave(128, 0).repeat_interleave(128, 1),
                      w2 * s2.repeat_interleave(128, 0).repeat_interleave(128, 1))
    x = torch.randn(tokens, hidden, generator=g, dtype=torch.bfloat16).float()
    return x, tw, ti, weights


def rel(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max())


def measure(torch, shape: str, experts: int, top_k: int, hidden: int, inter: int, tokens: int) -> dict:
    x, tw, ti, weights = draw(torch, experts, hidden, inter, top_k, tokens, seed=tokens)
    exact = expert_mlp(torch, x, tw, ti, weights, None)
    outs = {name: expert_mlp(torch, x, tw, ti, weights, name) for name in RECIPES}
    row = {"shape": shape, "tokens": tokens, "experts_used": len(weights)}
    row.update({f"{name}_vs_exact": rel(o, exact) for name, o in outs.items()})
    row.update({f"{name}_vs_atom": rel(o, outs["atom"]) for name, o in outs.items() if name != "atom"})
    return row


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default="dsv3-tp8,dsv3", help="moe_sweep shape names (comma list)")
    ap.add_argument("--tokens", default="1,2,8")
    ap.add_argument("--json", default=None)
    ap.add_argument("--dry", action="store_true", help="moe_sweep's small dry-run shapes (tests)")
    args = ap.parse_args(argv)
    import torch

    sys.path.insert(0, str(REPO / "bench"))
    from moe_sweep import DRY_SHAPES, SHAPES

    rows = []
    for shape in args.only.split(","):
        experts, top_k, hidden, inter = (DRY_SHAPES if args.dry else SHAPES)[shape]
        for tokens in (int(t) for t in args.tokens.split(",")):
            row = measure(torch, shape, experts, top_k, hidden, inter, tokens)
            rows.append(row)
            print(f"{shape} T={tokens}: vs exact " + ", ".join(f"{n} {row[n + '_vs_exact']:.4f}" for n in RECIPES)
                  + "; vs atom " + ", ".join(f"{n} {row[n + '_vs_atom']:.4f}" for n in RECIPES if n != "atom"),
                  flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
