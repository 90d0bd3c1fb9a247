"""atom's Llama end to end: vLLM (CPU, real engine) runs atom's model and agrees with stock vLLM
and with HF transformers on a Llama 3.1-style tiny checkpoint (llama3 RoPE scaling, attention and
MLP biases, tied head); the model alone agrees with HF across RoPE scaling types and with itself
across tensor-parallel ranks. The engine fixtures are in ``tests/models/conftest.py``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

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

NUM_LAYERS = 2  # atom.testing.tiny_models.KINDS["llama"]
# Measured atom vs stock vLLM on the tiny checkpoint, 8 prompts: fp32 tokens identical, max
# |d logprob| 1e-6; bf16: 0.015 (teacher-forced prompt) and 0.016 (sampled), all continuations
# agree, where bf16 itself is 0.012 (stock) / 0.011 (atom) from fp32. ~10x headroom.
FP32_LOGPROB_ATOL = 1e-3
BF16_LOGPROB_ATOL = 0.15


@pytest.fixture(scope="module")
def checkpoint(tiny_model) -> Path:
    return tiny_model("llama")


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return mixed_prompts()


# -- vLLM runs atom's model -------------------------------------------------------------------------
def test_vllm_registry_resolves_llama_to_atom_wrapper(monkeypatch):
    from vllm import ModelRegistry

    from atom.plugin.vllm.model_wrapper import ATOMForCausalLM
    from atom.plugin.vllm.register import register_model

    monkeypatch.delenv("ATOM_DISABLE_VLLM_PLUGIN", raising=False)
    register_model()
    assert ModelRegistry._try_load_model_cls("LlamaForCausalLM") is ATOMForCausalLM


def test_vllm_builds_atom_llama_model(atom_runs):
    facts = atom_runs["float32"]["facts"]
    assert facts["wrapper"] == "atom.plugin.vllm.model_wrapper:ATOMForCausalLM"
    assert facts["atom_model"] == "atom.models.llama:LlamaForCausalLM"
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
    assert_close_greedy_run(atom_runs["bfloat16"], stock_runs["bfloat16"], BF16_LOGPROB_ATOL)


def test_multiprocess_tp2_tokens_equal_stock_vllm(checkpoint, prompts, stock_runs, tmp_path):
    """Two real vLLM worker processes with TP=2 (each rank: 2 of the 4 query heads, 1 of the 2 KV
    heads, half of the MLP, q/k/v and gate/up biases sliced alike, o_proj/down_proj biases added
    once) give stock single-rank vLLM's fp32 tokens and logprobs."""
    ours = run_tp2_engine(checkpoint, prompts, tmp_path, {},
                          "atom.models.llama:LlamaForCausalLM", "ATOMForCausalLM", "LlamaForCausalLM")
    assert_same_greedy_run(ours, stock_runs["float32"], FP32_LOGPROB_ATOL)


# -- atom's model alone (no vLLM) -------------------------------------------------------------------
#: Config overrides on the tiny Llama kind. The prompt (60 tokens) stays within
#: max_position_embeddings, where HF's dynamic NTK scaling and vLLM's static table coincide.
VARIANTS: dict[str, dict[str, Any]] = {
    "llama3_bias_tied": {},
    "default_untied_nobias": {"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
                              "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False},
    "linear": {"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}},
    "dynamic": {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}},
    "mha_no_head_dim": {"num_key_value_heads": 4, "head_dim": None, "attention_bias": False},
}


@pytest.fixture(scope="module")
def hf_llama(tmp_path_factory):
    cache: dict[str, tuple[nn.Module, dict[str, torch.Tensor]]] = {}

    def get(variant: str) -> tuple[nn.Module, dict[str, torch.Tensor]]:
        if variant not in cache:
            overrides = dict(VARIANTS[variant])
            if overrides.get("head_dim", 0) is None:
                overrides.pop("head_dim")
                overrides["hidden_size"] = 128  # head_dim = hidden / heads = 32
            cache[variant] = tiny_hf_model("llama", tmp_path_factory.mktemp(f"llama-{variant}"), **overrides)
        return cache[variant]

    return get


def _atom_model(hf_model: nn.Module, tensors: dict[str, torch.Tensor], parallel: Any = None) -> nn.Module:
    from atom.models.llama import LlamaForCausalLM

    return build_atom_model(LlamaForCausalLM, hf_model.config, tensors.items(), parallel)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_atom_llama_logits_match_hf_transformers(variant, hf_llama):
    hf, tensors = hf_llama(variant)
    atom = _atom_model(hf, tensors)
    attn = atom.model.layers[0].self_attn
    assert attn.q_norm is None
    assert (attn.qkv_proj.bias is not None) == (attn.o_proj.bias is not None) == hf.config.attention_bias
    assert (atom.model.layers[0].mlp.down_proj.bias is not None) == hf.config.mlp_bias
    assert (atom.lm_head.weight is atom.model.embed_tokens.weight) == hf.config.tie_word_embeddings
    ids = torch.tensor(mixed_prompts()[-1])
    with torch.no_grad():
        theirs = hf(ids[None]).logits[0]
    torch.testing.assert_close(full_logits(atom, ids), theirs, atol=1e-4, rtol=1e-4)


def test_llama3_rope_table_matches_vllm():
    """The llama3 frequencies against vLLM's own rotary embedding (the engine test compares
    whole runs; this pins the table itself, positions beyond the original context included)."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    from atom.models._layers import RotaryEmbedding
    from atom.testing.tiny_models import KINDS

    params = dict(KINDS["llama"][1]["rope_parameters"])
    ours = RotaryEmbedding(32, params, 512).cos_sin_cache
    with set_current_vllm_config(VllmConfig()):  # vLLM's CustomOps read it when built
        theirs = get_rope(32, max_position=512, rope_parameters=params, dtype=torch.float32).cos_sin_cache
    # vLLM builds its table in fp32 (angles up to ~500 rad), atom in fp64: ~1e-5 apart.
    torch.testing.assert_close(ours, theirs.float(), atol=1e-4, rtol=0)


@pytest.mark.parametrize("tp", [2, 4])  # 4 ranks > 2 KV heads: each KV head replicated twice
def test_tensor_parallel_ranks_match_single_rank(tp, hf_llama):
    from atom.models.interfaces import ModelParallel

    hf, tensors = hf_llama("llama3_bias_tied")
    ids = torch.tensor(mixed_prompts()[-1])
    expected = full_logits(_atom_model(hf, tensors), ids)
    group = ThreadGroup(tp)
    models = [_atom_model(hf, tensors, ModelParallel(r, tp, group.rank(r))) for r in range(tp)]
    results = run_ranks(group, lambda r: full_logits(models[r], ids))
    for rank, logits in enumerate(results):
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4, msg=f"rank {rank}")
