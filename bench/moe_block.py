#!/usr/bin/env python
"""A DeepSeek-V3 MoE block alone, its shared expert in the fused MoE's slot against a separate MLP
(bench/NOTES.md 87-88): the post-attention RMSNorm with its fp8 quantisation, the router, the routed
and shared experts and their sum, timed as one CUDA graph per batch size with a cold L2.

Three sides: ``fused`` (the slot as the engine runs it: inside the fused kernel up to the layer's
``shared_fused_max_tokens``, ``--limit`` or ATOM_FUSE_SHARED_EXPERTS_MAX_TOKENS, dense above),
``always`` (the slot inside the fused kernel at every size) and ``apart`` (a separate shared MLP).

Both blocks hold the same weights (the separate one's tensors are views of the fused one's slots),
block fp8 128x128, at DeepSeek-V3's dims: ``dsv3`` one GPU holding whole experts (intermediate
2048), ``dsv3-tp8`` one TP-8 rank's shard (256). The sides alternate per round; each row says
how far the two outputs are apart (relative to the max) and each side's median time.

    python bench/moe_block.py --shape dsv3-tp8 --tokens 1,2,4,8,32,128,512 --repeat 3 --json out.json
    python bench/moe_block.py --dry            # CPU: tiny dims, the torch references, two iterations
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

from moe_sweep import block_scales, fp8_normal  # bench/ is on sys.path (a script, or tests/_bench.py)

REPO = Path(__file__).resolve().parent.parent
#: shape -> (routed experts, top-k, hidden, expert intermediate size, groups, top groups)
SHAPES = {"dsv3": (256, 8, 7168, 2048, 8, 4), "dsv3-tp8": (256, 8, 7168, 256, 8, 4)}
DRY_SHAPE = (16, 4, 256, 128, 4, 2)
SIDES = ("fused", "always", "apart")


def hf_config(experts: int, top_k: int, hidden: int, inter: int, groups: int, top_groups: int) -> SimpleNamespace:
    """The DeepSeek-V3 config fields the MoE block reads (sigmoid grouped routing, one shared expert)."""
    return SimpleNamespace(n_routed_experts=experts, num_experts_per_tok=top_k, hidden_size=hidden,
                           moe_intermediate_size=inter, n_shared_experts=1, n_group=groups, topk_group=top_groups,
                           routed_scaling_factor=2.5, norm_topk_prob=True, scoring_func="sigmoid",
                           topk_method="noaux_tc")


def build_pair(torch, hf, dev, seed: int = 0, process: bool = True):
    """(fused block, separate block) with the same fp8 weights: the separate one's routed experts,
    shared MLP and router are views of the fused one's tensors (``process``: then each block's
    post-load step, as after a checkpoint load)."""
    from atom.models._quant import Fp8Spec
    from atom.models.deepseek_v3 import DeepseekV3MoE
    from atom.models.interfaces import ModelParallel

    quant, one = Fp8Spec(block=(128, 128)), ModelParallel()
    e, h, i = hf.n_routed_experts, hf.hidden_size, hf.moe_intermediate_size
    with torch.device(dev):  # allocated where they run (a whole-expert layer is ~11 GB)
        fused = DeepseekV3MoE(hf, one, False, torch.bfloat16, quant=quant, fuse_shared=True)
        apart = DeepseekV3MoE(hf, one, False, torch.bfloat16, quant=quant, fuse_shared=False)
    g = torch.Generator(device=dev).manual_seed(seed)
    ex = fused.experts
    with torch.no_grad():
        for k in range(e + 1):  # per expert: no float32 copy of a whole layer
            ex.w13.data[k] = fp8_normal(torch, (2 * i, h), dev, g)
            ex.w2.data[k] = fp8_normal(torch, (h, i), dev, g)
        s13, s2 = ex.w13_weight_scale_inv, ex.w2_weight_scale_inv
        s13.data.copy_(block_scales(torch, s13.shape, h, dev, g))
        s2.data.copy_(block_scales(torch, s2.shape, i, dev, g))
        fused.gate.weight.data.normal_(0.0, 0.02, generator=g)
        fused.gate.e_score_correction_bias.data.zero_()
        apart.gate.weight.data = fused.gate.weight.data
        apart.gate.e_score_correction_bias.data = fused.gate.e_score_correction_bias.data
        ax, sh = apart.experts, apart.shared_experts
        ax.w13.data, ax.w2.data = ex.w13.data[:e], ex.w2.data[:e]
        ax.w13_weight_scale_inv.data, ax.w2_weight_scale_inv.data = s13.data[:e], s2.data[:e]
        sh.gate_up_proj.weight.data, sh.gate_up_proj.weight_scale_inv.data = ex.w13.data[e], s13.data[e]
        sh.down_proj.weight.data, sh.down_proj.weight_scale_inv.data = ex.w2.data[e], s2.data[e]
    for block in (fused, apart) if process else ():
        for m in block.modules():
            if m is not block and hasattr(m, "process_weights_after_loading"):
                m.process_weights_after_loading()
    return fused, apart


def step(torch, block, norm_w, x):
    """The block's half of a decoder layer: RMSNorm writing the fp8 form its readers take, then the block."""
    from atom import ops
    from atom.ops.fused_quant import QuantizedActivation

    if x.device.type != "cuda":  # the CPU references read the activation-dtype form
        return block(ops.rms_norm(x, norm_w, 1e-6))
    return block(QuantizedActivation(*ops.rms_norm_quant_fp8(x, norm_w, 1e-6, None, 128, False)))


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="dsv3-tp8", choices=sorted(SHAPES))
    ap.add_argument("--tokens", default="1,2,4,8,32,128,512")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--json", default=None)
    ap.add_argument("--dry", action="store_true", help="CPU, tiny dims (tests)")
    ap.add_argument("--no-host-gemms", action="store_true",
                    help="the separate shared MLP on atom's Triton GEMM alone (default on a GPU: vLLM's "
                         "FlashInfer / DeepGEMM block-fp8 kernels where the engine's atom would call them)")
    ap.add_argument("--limit", type=int, default=None,
                    help="the fused side's shared_fused_max_tokens (default: the layer's own, by "
                         "ATOM_FUSE_SHARED_EXPERTS_MAX_TOKENS)")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(REPO))
    sys.path.insert(0, str(REPO / "bench"))
    import torch

    from ops_compute import Timer

    from atom.ops.moe import shared_in_fused_kernel

    if not args.dry and not args.no_host_gemms:
        from atom.plugin.vllm.fp8_gemm import install

        print(f"host GEMMs: {install()}", flush=True)

    dev = torch.device("cpu" if args.dry else "cuda")
    hf = hf_config(*(DRY_SHAPE if args.dry else SHAPES[args.shape]))
    fused, apart = build_pair(torch, hf, dev)
    ex = fused.experts
    if args.limit is not None:
        ex.shared_fused_max_tokens = args.limit
    limit = ex.shared_fused_max_tokens
    print(f"fused side: the shared expert inside the fused kernel up to {limit or 'any number of'} tokens",
          flush=True)

    def run(name: str, x):
        ex.shared_fused_max_tokens = 0 if name == "always" else limit
        try:
            return step(torch, apart if name == "apart" else fused, norm_w, x)
        finally:
            ex.shared_fused_max_tokens = limit
    norm_w = torch.ones(hf.hidden_size, dtype=torch.bfloat16, device=dev)
    timer = Timer(torch, dev, 2 if args.dry else args.iters, not args.dry)
    rows = []
    tokens = [int(t) for t in args.tokens.split(",")]
    for t in tokens:
        x = torch.randn(t, hf.hidden_size, dtype=torch.bfloat16, device=dev,
                        generator=torch.Generator(device=dev).manual_seed(t))
        with torch.inference_mode():
            outs = {name: run(name, x).float() for name in SIDES}
            ref = outs["apart"]
            err = {name: float((outs[name] - ref).abs().max() / ref.abs().max().clamp_min(1e-9))
                   for name in ("fused", "always")}
            times: dict[str, list[float]] = {name: [] for name in SIDES}
            for rnd in range(args.repeat):
                for name in SIDES[rnd % 3:] + SIDES[:rnd % 3]:  # each side first in turn
                    times[name].append(timer(lambda name=name: run(name, x)))
        row = {"shape": "dry" if args.dry else args.shape, "tokens": t, "limit": limit,
               "fused_path": "slot" if shared_in_fused_kernel(t, limit) else "dense", "rel_err": err["fused"],
               "rel_err_always": err["always"], **{f"{n}_us": statistics.median(v) for n, v in times.items()},
               "rounds": times}
        for name in ("fused", "always"):
            row[f"{name}_over_apart"] = row[f"{name}_us"] / row["apart_us"] if row["apart_us"] else None
        rows.append(row)
        print(f"{row['shape']} T={t}: fused ({row['fused_path']}) {row['fused_us']:.1f} us, always "
              f"{row['always_us']:.1f} us, apart {row['apart_us']:.1f} us; fused/apart {row['fused_over_apart']:.3f}, "
              f"always/apart {row['always_over_apart']:.3f}; outputs apart by {err['fused']:.1e} / "
              f"{err['always']:.1e}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
