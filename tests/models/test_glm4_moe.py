"""atom's GLM-4-MoE end to end: vLLM (CPU, real engine) runs atom's model and agrees with stock
vLLM and with HF transformers on a tiny checkpoint (one dense + one MoE layer, sigmoid grouped
top-k routing with correction bias and routed scaling, a shared expert, partial rotary, QK-norm,
q/k/v biases, and one MTP layer's tensors that must be skipped); the model alone agrees with HF
across config variants and with itself across tensor-parallel and expert-parallel ranks. The
engine fixtures are in ``tests/models/conftest.py``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import pytest
import torch
from torch import nn

from tests.models._harness import (
    ThreadGroup,
    assert_close_greedy_run,
    assert_same_greedy_run,
    build_atom_model,
    full_logits,
    greedy_run_stats,
    mixed_prompts,
    run_ranks,
    run_tp2_engine,
    tiny_hf_model,
)

NUM_LAYERS = 2  # atom.testing.tiny_models.KINDS["glm4_moe"]
FP32_LOGPROB_ATOL = 1e-3
# Measured atom vs stock vLLM on the tiny checkpoint, 8 prompts: fp32 tokens identical, max
# |d logprob| 1e-6. bf16: teacher-forced mean 0.005, max 0.089 (stock bf16 is itself 0.088 from
# fp32 there); sampled, while continuations agree: 0.017; 78% of tokens before divergence
# (stock bf16 vs fp32: 78%). Bounds as for Qwen3-MoE (tests/models/test_qwen3_moe.py), where a
# router near-tie flipping an expert makes the per-position maximum looser than the mean.
BF16_LOGPROB_ATOL = 0.15
BF16_PROMPT_MAX_ATOL = 0.5
BF16_PROMPT_MEAN_ATOL = 0.03
BF16_MIN_AGREEING = 0.5


@pytest.fixture(scope="module")
def checkpoint(tiny_model) -> Path:
    return tiny_model("glm4_moe")


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return mixed_prompts()


# -- vLLM runs atom's model -------------------------------------------------------------------------
def test_vllm_registry_resolves_glm4_moe_to_atom_moe_wrapper(monkeypatch):
    from vllm import ModelRegistry

    from atom.plugin.vllm.model_wrapper import ATOMMoEForCausalLM
    from atom.plugin.vllm.register import register_model

    monkeypatch.delenv("ATOM_DISABLE_VLLM_PLUGIN", raising=False)
    register_model()
    assert ModelRegistry._try_load_model_cls("Glm4MoeForCausalLM") is ATOMMoEForCausalLM


def test_checkpoint_has_an_mtp_layer(checkpoint):
    from safetensors import safe_open

    with safe_open(str(checkpoint / "model.safetensors"), "pt") as f:
        assert "model.layers.2.eh_proj.weight" in f.keys()


def test_vllm_builds_atom_glm4_moe_model(atom_runs):
    facts = atom_runs["float32"]["facts"]
    assert facts["wrapper"] == "atom.plugin.vllm.model_wrapper:ATOMMoEForCausalLM"
    assert facts["atom_model"] == "atom.models.glm4_moe:Glm4MoeForCausalLM"
    assert {"atom.models._moe:FusedMoE", "atom.models._moe:GroupedTopkRouter"} <= set(facts["modules"])
    vllm_layers = [m for m in facts["modules"] if m.startswith("vllm.model_executor.layers")]
    assert vllm_layers == sorted([*facts["attention"], "vllm.model_executor.layers.logits_processor:LogitsProcessor"])
    assert facts["registered"] == [f"model.layers.{i}.self_attn.attn" for i in range(NUM_LAYERS)]


def test_fp32_greedy_tokens_equal_stock_vllm(atom_runs, stock_runs):
    print("fp32 atom vs stock:", greedy_run_stats(atom_runs["float32"], stock_runs["float32"]))
    assert_same_greedy_run(atom_runs["float32"], stock_runs["float32"], FP32_LOGPROB_ATOL)


def test_fp32_greedy_tokens_equal_hf_transformers(atom_runs, hf_fp32_tokens):
    assert [r["tokens"] for r in atom_runs["float32"]["rows"]] == hf_fp32_tokens


def test_bf16_logprobs_close_to_stock_vllm(atom_runs, stock_runs):
    print("bf16 atom vs stock:", greedy_run_stats(atom_runs["bfloat16"], stock_runs["bfloat16"]))
    print("bf16 vs fp32, stock:", greedy_run_stats(stock_runs["bfloat16"], stock_runs["float32"]),
          "atom:", greedy_run_stats(atom_runs["bfloat16"], atom_runs["float32"]))
    assert_close_greedy_run(atom_runs["bfloat16"], stock_runs["bfloat16"], BF16_LOGPROB_ATOL,
                            prompt_atol=BF16_PROMPT_MAX_ATOL, prompt_mean_atol=BF16_PROMPT_MEAN_ATOL,
                            min_agreeing=BF16_MIN_AGREEING)


def test_multiprocess_tp2_expert_parallel_tokens_equal_stock_vllm(checkpoint, prompts, stock_runs, tmp_path):
    """Two real vLLM worker processes with TP=2 and enable_expert_parallel (the dense layer and the
    shared expert split by TP, 4 of the 8 routed experts per rank, grouped routing over all 8) give
    stock single-rank vLLM's fp32 tokens and logprobs."""
    ours = run_tp2_engine(checkpoint, prompts, tmp_path, {"enable_expert_parallel": True},
                          "atom.models.glm4_moe:Glm4MoeForCausalLM", "ATOMMoEForCausalLM", "Glm4MoeForCausalLM")
    assert_same_greedy_run(ours, stock_runs["float32"], FP32_LOGPROB_ATOL)


# -- atom's model alone (no vLLM) -------------------------------------------------------------------
VARIANTS: dict[str, dict[str, Any]] = {
    "tiny": {},
    # no QK-norm / biases, one group, unnormalised top-k, full rotary
    "plain": {"use_qk_norm": False, "attention_bias": False, "n_group": 1, "topk_group": 1, "norm_topk_prob": False,
              "routed_scaling_factor": 1.0,
              "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0}},
    # 2 dense layers then 2 sparse; 4 groups of 2 experts, top-3 within the 2 best groups; 2 shared
    "deeper": {"num_hidden_layers": 4, "first_k_dense_replace": 2, "n_group": 4, "topk_group": 2,
               "num_experts_per_tok": 3, "n_shared_experts": 2},
}


@pytest.fixture(scope="module")
def hf_glm(tmp_path_factory):
    cache: dict[str, tuple[nn.Module, dict[str, torch.Tensor]]] = {}

    def get(variant: str) -> tuple[nn.Module, dict[str, torch.Tensor]]:
        if variant not in cache:
            cache[variant] = tiny_hf_model("glm4_moe", tmp_path_factory.mktemp(f"glm-{variant}"), **VARIANTS[variant])
        return cache[variant]

    return get


def _atom_model(hf_model: nn.Module, tensors: Any, parallel: Any = None, expert_parallel: bool = False) -> nn.Module:
    from atom.models.glm4_moe import Glm4MoeForCausalLM

    items = tensors.items() if isinstance(tensors, dict) else tensors
    return build_atom_model(Glm4MoeForCausalLM, hf_model.config, items, parallel,
                            enable_expert_parallel=expert_parallel)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_atom_glm4_moe_logits_match_hf_transformers(variant, hf_glm):
    from atom.models._moe import FusedMoE

    hf, tensors = hf_glm(variant)
    atom = _atom_model(hf, tensors)
    cfg = hf.config
    sparse = [isinstance(getattr(layer.mlp, "experts", None), FusedMoE) for layer in atom.model.layers]
    assert sparse == [i >= cfg.first_k_dense_replace for i in range(cfg.num_hidden_layers)]
    attn = atom.model.layers[0].self_attn
    assert (attn.q_norm is not None) == cfg.use_qk_norm and attn.o_proj.bias is None
    assert attn.rotary_emb.rotary_dim == int(attn.head_dim * cfg.rope_parameters["partial_rotary_factor"])
    ids = torch.tensor(mixed_prompts()[-1])
    with torch.no_grad():
        theirs = hf(ids[None]).logits[0]
    torch.testing.assert_close(full_logits(atom, ids), theirs, atol=1e-4, rtol=1e-4)


def test_mtp_layer_tensors_are_skipped_and_others_are_errors(hf_glm):
    hf, tensors = hf_glm("tiny")
    first = hf.config.num_hidden_layers
    assert hf.config.num_nextn_predict_layers == 1
    mtp = {f"model.layers.{first}.eh_proj.weight": torch.zeros(64, 128),
           f"model.layers.{first}.mlp.experts.0.gate_proj.weight": torch.zeros(32, 64)}
    atom = _atom_model(hf, [*tensors.items(), *mtp.items()])  # every parameter loaded, MTP skipped
    ids = torch.tensor(mixed_prompts()[-2])
    torch.testing.assert_close(full_logits(atom, ids), full_logits(_atom_model(hf, tensors), ids))
    with pytest.raises(ValueError, match="no matching parameter"):
        atom.load_weights([(f"model.layers.{first + 1}.eh_proj.weight", torch.zeros(64, 128))])


@pytest.mark.parametrize("tp,ep", [(2, None), (2, 2)], ids=["tp2", "tp2-ep2"])
def test_parallel_ranks_match_single_rank(tp: int, ep: Optional[int], hf_glm):
    """Attention, dense MLP and shared expert split over TP; routed experts over TP or EP."""
    from atom.models.interfaces import ModelParallel

    hf, tensors = hf_glm("deeper")
    ids = torch.tensor(mixed_prompts()[-1])
    expected = full_logits(_atom_model(hf, tensors), ids)
    tp_group, ep_group = ThreadGroup(tp), ThreadGroup(ep or tp)
    models = [
        _atom_model(hf, tensors, ModelParallel(tp_rank=r, tp_size=tp, tp_group=tp_group.rank(r),
                                               ep_rank=r if ep else 0, ep_size=ep or 1,
                                               ep_group=ep_group.rank(r) if ep else None),
                    expert_parallel=ep is not None)
        for r in range(tp)
    ]
    experts = models[-1].model.layers[-1].mlp.experts
    n = hf.config.n_routed_experts
    assert experts.num_local_experts == (n // ep if ep else n)
    # TP: the two shared experts in the fused MoE's slots, each chunk TP-split (ATOM_FUSE_SHARED_EXPERTS);
    # EP: a separate TP-split MLP
    assert experts.num_shared == (0 if ep else 2) and (models[-1].model.layers[-1].mlp.shared_experts is None) == (not ep)
    results = run_ranks(tp_group, lambda r: full_logits(models[r], ids))
    for rank, logits in enumerate(results):
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4, msg=f"rank {rank}")
