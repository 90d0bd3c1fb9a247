"""atom's Qwen3 end to end: vLLM (CPU, real engine) runs atom's model and agrees with stock vLLM
and with HF transformers; the model alone agrees with HF (rope variants, tied head) and with
itself across tensor-parallel ranks. The engine fixtures are in ``tests/models/conftest.py``.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any, Optional

import pytest
import torch
from torch import nn

from tests.conftest import run_python
from tests.models._harness import (
    ThreadGroup,
    assert_close_greedy_run,
    assert_same_greedy_run,
    build_atom_model,
    full_logits,
    mixed_prompts,
    run_ranks,
    run_tp2_engine,
    run_two_worker_engine,
    widen_init,
)

NUM_LAYERS = 2  # atom.testing.tiny_models.KINDS["qwen3"]
# Measured atom vs stock vLLM on the tiny checkpoint: fp32 max |d logprob| 1e-6; bf16 0.045
# (teacher-forced prompt) and 0.036 (sampled, agreeing prefix), where bf16 itself is 0.015
# (stock) / 0.034 (atom) away from fp32. The bounds leave ~3x headroom.
FP32_LOGPROB_ATOL = 1e-3
BF16_LOGPROB_ATOL = 0.15


@pytest.fixture(scope="module")
def checkpoint(tiny_model) -> Path:
    return tiny_model("qwen3")


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return mixed_prompts()


# -- the wrapper as vLLM sees it --------------------------------------------------------------------
def test_wrapper_takes_keyword_vllm_config_and_is_a_vllm_text_generation_model():
    from vllm.model_executor.models.interfaces_base import is_text_generation_model

    from atom.plugin.vllm.model_wrapper import ATOMForCausalLM, ATOMModelBase, ATOMMoEForCausalLM

    param = inspect.signature(ATOMModelBase.__init__).parameters["vllm_config"]
    assert param.kind is inspect.Parameter.KEYWORD_ONLY
    for cls in (ATOMForCausalLM, ATOMMoEForCausalLM):
        assert is_text_generation_model(cls), cls  # vLLM's own check of the model interface


def test_vllm_registry_resolves_qwen3_to_atom_wrapper(monkeypatch):
    from vllm import ModelRegistry

    from atom.plugin.vllm.model_wrapper import ATOMForCausalLM
    from atom.plugin.vllm.register import register_model

    monkeypatch.delenv("ATOM_DISABLE_VLLM_PLUGIN", raising=False)
    register_model()
    entry = ModelRegistry.models["Qwen3ForCausalLM"]
    assert (entry.module_name, entry.class_name) == ("atom.plugin.vllm.model_wrapper", "ATOMForCausalLM")
    assert ModelRegistry._try_load_model_cls("Qwen3ForCausalLM") is ATOMForCausalLM


def test_atom_models_never_import_vllm():
    proc = run_python("""
        import sys
        import atom.models.qwen3, atom.models.qwen3_moe, atom.models._moe, atom.models.interfaces
        import atom.models.llama, atom.models.mixtral, atom.models.glm4_moe
        print("VLLM", sorted(m for m in sys.modules if m == "vllm" or m.startswith("vllm.")))
    """)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "VLLM []" in proc.stdout


# -- vLLM runs atom's model -------------------------------------------------------------------------
def test_vllm_builds_atom_model_with_vllm_attention_layers(atom_runs):
    facts = atom_runs["float32"]["facts"]
    assert facts["wrapper"] == "atom.plugin.vllm.model_wrapper:ATOMForCausalLM"
    assert facts["atom_model"] == "atom.models.qwen3:Qwen3ForCausalLM"
    assert facts["attention"] == ["vllm.model_executor.layers.attention.attention:Attention"]
    # Registered in vLLM's forward context under the same names as vLLM's own Qwen3 uses.
    assert facts["registered"] == [f"model.layers.{i}.self_attn.attn" for i in range(NUM_LAYERS)]


def test_fp32_greedy_tokens_equal_stock_vllm(atom_runs, stock_runs):
    assert_same_greedy_run(atom_runs["float32"], stock_runs["float32"], FP32_LOGPROB_ATOL)


def test_multiprocess_tp2_tokens_equal_stock_vllm(checkpoint, prompts, stock_runs, tmp_path):
    """Two real vLLM worker processes with TP=2 (each rank: half the query and KV heads, half of
    the MLP, per-head QK-norm on its own heads) give stock single-rank vLLM's fp32 tokens."""
    ours = run_tp2_engine(checkpoint, prompts, tmp_path, {},
                          "atom.models.qwen3:Qwen3ForCausalLM", "ATOMForCausalLM", "Qwen3ForCausalLM")
    assert_same_greedy_run(ours, stock_runs["float32"], FP32_LOGPROB_ATOL)


def test_pipeline_parallel_is_served_by_vllms_model(checkpoint, prompts, stock_runs, tmp_path):
    """atom's models do not run pipeline parallelism, stock vLLM's Qwen3 does: with atom active,
    two real vLLM worker processes with PP=2 pass vLLM's config check (which asks the registry
    whether the model runs PP), each rank builds vLLM's own Qwen3 in place of atom's, with one
    line saying so, and the tokens are stock single-rank vLLM's. (Not eager: vLLM's CPU runner
    allocates the tensors a later PP rank receives in its warm-up, which eager mode skips; stock
    vLLM needs the same.)"""
    ours, log = run_two_worker_engine(checkpoint, prompts, tmp_path,
                                      {"pipeline_parallel_size": 2, "enforce_eager": False})
    aside = ("atom steps aside for Qwen3ForCausalLM (pipeline_parallel_size=2: atom's models do not run pipeline "
             "parallelism): vLLM's own model serves it")
    assert log.count(aside) == 2, log[-4000:]  # once per worker process
    assert "built atom.models" not in log
    assert_same_greedy_run(ours, stock_runs["float32"], FP32_LOGPROB_ATOL)


def test_fp32_greedy_tokens_equal_hf_transformers(atom_runs, hf_fp32_tokens):
    assert [r["tokens"] for r in atom_runs["float32"]["rows"]] == hf_fp32_tokens


def test_bf16_logprobs_close_to_stock_vllm(atom_runs, stock_runs):
    assert_close_greedy_run(atom_runs["bfloat16"], stock_runs["bfloat16"], BF16_LOGPROB_ATOL)


# -- atom's model alone (no vLLM): against HF, and across tensor-parallel ranks ---------------------
ROPE_VARIANTS = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
             "rope_theta": 10000.0},
}


def _hf_model(tied: bool, rope: Optional[dict]) -> nn.Module:
    import transformers

    from atom.testing.tiny_models import KINDS, VOCAB_SIZE

    kwargs = dict(KINDS["qwen3"][1], tie_word_embeddings=tied, vocab_size=VOCAB_SIZE)
    if rope is not None:
        kwargs.pop("rope_theta")
        kwargs["rope_parameters"] = rope
    torch.manual_seed(0)
    return widen_init(transformers.AutoModelForCausalLM.from_config(transformers.Qwen3Config(**kwargs),
                                                                    dtype=torch.float32))


def _atom_model(hf_model: nn.Module, parallel: Any = None) -> nn.Module:
    from atom.models.qwen3 import Qwen3ForCausalLM

    tensors = ((n, t.clone()) for n, t in hf_model.state_dict().items())
    return build_atom_model(Qwen3ForCausalLM, hf_model.config, tensors, parallel)


@pytest.mark.parametrize("tied,rope", [(False, "default"), (True, "default"), (False, "linear"),
                                       (False, "yarn")])
def test_atom_qwen3_logits_match_hf_transformers(tied, rope):
    hf = _hf_model(tied, ROPE_VARIANTS[rope])
    atom = _atom_model(hf)
    assert (atom.lm_head.weight is atom.model.embed_tokens.weight) == tied
    ids = torch.tensor(mixed_prompts()[-1])
    with torch.no_grad():
        theirs = hf(ids[None]).logits[0]
    torch.testing.assert_close(full_logits(atom, ids), theirs, atol=1e-4, rtol=1e-4)


def test_unknown_checkpoint_tensor_is_an_error():
    hf = _hf_model(False, None)
    atom = _atom_model(hf)
    with pytest.raises(ValueError, match="no matching parameter"):
        atom.load_weights([("model.layers.0.self_attn.not_a_proj.weight", torch.zeros(1))])


@pytest.mark.parametrize("tp", [2, 4])  # 4 ranks > 2 KV heads: each KV head replicated twice
def test_tensor_parallel_ranks_match_single_rank(tp):
    from atom.models.interfaces import ModelParallel

    hf = _hf_model(False, None)
    ids = torch.tensor(mixed_prompts()[-1])
    expected = full_logits(_atom_model(hf), ids)
    group = ThreadGroup(tp)
    models = [_atom_model(hf, ModelParallel(r, tp, group.rank(r))) for r in range(tp)]
    heads = hf.config.num_attention_heads // tp
    kv_heads = max(1, hf.config.num_key_value_heads // tp)
    assert models[0].model.layers[0].self_attn.qkv_proj.weight.shape[0] == (heads + 2 * kv_heads) * hf.config.head_dim
    assert models[0].lm_head.weight.shape[0] == hf.config.vocab_size // tp

    results = run_ranks(group, lambda r: full_logits(models[r], ids))
    for rank, logits in enumerate(results):
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4, msg=f"rank {rank}")


def test_causal_lm_check_sees_submodules():
    """The wrapper's interface check must find nn.Module submodules (Python 3.12's protocol
    isinstance uses getattr_static and missed ``lm_head`` on the GPU image)."""
    import torch.nn as nn

    from atom.models.interfaces import missing_causal_lm_members

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.lm_head = nn.Linear(2, 2)

        def embed_input_ids(self, input_ids): ...

        def compute_logits(self, hidden_states): ...

        def load_weights(self, weights): ...

    assert missing_causal_lm_members(Model()) == []
    assert missing_causal_lm_members(nn.Module()) == ["lm_head", "embed_input_ids", "compute_logits", "load_weights"]
