"""bench/moe_block.py's mechanics on a CPU (the timing is a GPU benchmark): its two DeepSeek-V3 MoE
blocks, the shared expert in the fused MoE's slot and as a separate MLP, hold the same weights and
give the same output, and every row carries the three sides' rounds."""

from __future__ import annotations

import json

from tests._bench import load_bench


def test_the_fused_and_separate_blocks_compute_the_same_moe(tmp_path):
    mb = load_bench("moe_block")
    out = tmp_path / "mb.json"
    assert mb.main(["--dry", "--tokens", "1,5", "--repeat", "2", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [r["tokens"] for r in rows] == [1, 5]
    for r in rows:
        # bf16 outputs: the separate block rounds its two sums before adding them
        assert r["rel_err"] < 2e-2 and r["rel_err_always"] < 2e-2, r
        assert {k: len(v) for k, v in r["rounds"].items()} == {"fused": 2, "always": 2, "apart": 2}
        assert r["fused_us"] > 0 < r["apart_us"] and r["always_us"] > 0
        # the fused side's path by the layer's limit (dry dims: 128 rows per expert, so auto = 128)
        assert r["limit"] == 128 and r["fused_path"] == "slot"


def test_the_separate_blocks_tensors_are_the_fused_blocks_slots():
    """Before either is processed, the separate block's experts, shared MLP and router are views of
    the fused block's tensors (one copy of a layer's weights on the GPU), the shared MLP the slot
    after the routed experts."""
    import torch

    mb = load_bench("moe_block")
    hf = mb.hf_config(*mb.DRY_SHAPE)
    fused, apart = mb.build_pair(torch, hf, torch.device("cpu"), process=False)
    e, ex = hf.n_routed_experts, fused.experts
    assert ex.num_shared == 1 and ex.w13.shape[0] == e + 1 and fused.shared_experts is None
    assert apart.experts.num_shared == 0 and apart.experts.w13.shape[0] == e
    same = [(apart.experts.w13, ex.w13[:e]), (apart.experts.w2_weight_scale_inv, ex.w2_weight_scale_inv[:e]),
            (apart.shared_experts.gate_up_proj.weight, ex.w13[e]), (apart.shared_experts.down_proj.weight, ex.w2[e]),
            (apart.shared_experts.down_proj.weight_scale_inv, ex.w2_weight_scale_inv[e]), (apart.gate.weight, fused.gate.weight)]
    for a, b in same:
        assert a.data_ptr() == b.data_ptr() and a.shape == b.shape
