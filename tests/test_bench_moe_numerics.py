"""bench/moe_numerics.py: its ``atom`` recipe is atom's own fp8 MoE reference, its ``vllm`` recipe
rounds the activation scales to powers of two (vLLM's ``use_ue8m0``) and keeps gemm1's and the
activation's outputs in bf16, and those two steps are what separates vLLM's output from atom's."""

from __future__ import annotations

import json

import torch

from tests._bench import load_bench


def _fp8_experts(experts, hidden, inter, seed=0):
    """fp8 experts with 128x128 block scales, as atom's kernels take them, and the same dequantised."""
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=g).to(torch.float8_e4m3fn)
    w2 = torch.randn(experts, hidden, inter, generator=g).to(torch.float8_e4m3fn)
    s13 = torch.rand(experts, 2 * inter // 128, hidden // 128, generator=g) / hidden ** 0.5 + 1e-3
    s2 = torch.rand(experts, hidden // 128, inter // 128, generator=g) / inter ** 0.5 + 1e-3

    def deq(w, s):
        return w.float() * s.repeat_interleave(128, 1).repeat_interleave(128, 2)
    dense = {e: (deq(w13, s13)[e], deq(w2, s2)[e]) for e in range(experts)}
    return w13, w2, s13, s2, dense


def test_the_atom_recipe_is_atoms_fp8_moe_reference():
    """Same weights, tokens and routing: the emulation's ``atom`` recipe (pairs summed in float32) is
    atom.ops.moe's fp8 reference to float32 rounding, and its ``vllm`` recipe is not."""
    from atom.ops.moe import fused_moe_torch

    mn = load_bench("moe_numerics")
    w13, w2, s13, s2, dense = _fp8_experts(6, 256, 128)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 256, generator=g)
    tw, ti = torch.softmax(torch.randn(5, 6, generator=g), -1).topk(3, -1)
    ref = fused_moe_torch(x, w13, w2, tw, ti.int(), w13_scale=s13, w2_scale=s2, block_shape=[128, 128])
    atom = mn.expert_mlp(torch, x, tw, ti, dense, "atom", round_pairs=False)
    assert mn.rel(atom, ref.double()) < 1e-5
    assert mn.rel(mn.expert_mlp(torch, x, tw, ti, dense, "vllm", round_pairs=False), ref.double()) > 1e-2


def test_power_of_two_scales_and_what_separates_vllm_from_atom(tmp_path):
    """``qdq`` with ue8m0: every value is an e4m3 value times the power of two at or above max/448.
    At moe_sweep's dry shapes vLLM's recipe lands >= 2x further from atom's than the same recipe with
    float32 scales: the power-of-two scales, not the bf16 intermediates, make most of the difference
    (bench/NOTES.md 84). The script's JSON rows carry every recipe's errors."""
    mn = load_bench("moe_numerics")
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(2)) * 7
    v = mn.qdq(torch, x, 128, ue8m0=True).view(3, 2, 128)
    amax = x.view(3, 2, 128).abs().amax(-1, keepdim=True)
    s = torch.exp2(torch.ceil(torch.log2(amax / 448)))
    assert torch.equal((v / s).to(torch.float8_e4m3fn).float(), v / s)
    assert not torch.equal(v, mn.qdq(torch, x, 128, ue8m0=False).view(3, 2, 128))
    out = tmp_path / "n.json"
    assert mn.main(["--only", "dsv3-tp8", "--tokens", "1,2", "--json", str(out), "--dry"]) == 0
    rows = json.loads(out.read_text())
    assert [r["tokens"] for r in rows] == [1, 2]
    for r in rows:
        assert r["vllm_vs_atom"] > 2 * r["vllm-no-e8m0_vs_atom"], r
        assert all(0.0 < r[f"{n}_vs_exact"] < 0.1 for n in mn.RECIPES), r
