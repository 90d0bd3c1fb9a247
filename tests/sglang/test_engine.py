"""atom's models and ``atom`` attention backend served by real SGLang (CPU, fp32), against stock
SGLang (its own models on torch_native, atom switched off) and HF transformers: greedy tokens
identical on tiny Qwen3, Qwen3-MoE and Llama checkpoints, in batches of different prompt lengths
(two longer than a 16-token page), decodes that cross pages and an extend over a radix-cached
prefix (tests/sglang/_engine_runner.py has the prompts).

The three-way Llama has no MLP biases: stock SGLang 0.5.17's own Llama has none (its LlamaMLP is
built with ``bias=False`` and its loader skips the checkpoint's ``mlp.*.bias`` tensors as "extra
bias"), so on atom's tiny Llama (``mlp_bias=True``) stock SGLang departs from HF transformers
while atom's Llama matches HF; that checkpoint (``llama_mlp_bias``) runs on atom's backend only
and is held to HF."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.sglang._engine_runner import FOLLOW_UP, MAX_NEW_TOKENS, PROMPTS
from tests.sglang.conftest import run_engines

KINDS = ("qwen3", "qwen3_moe", "llama")
FUSED_KINDS = ("qwen3", "qwen3_moe")  # the models with QK-norm


def _without_mlp_bias(src, dst):
    """A copy of a Llama checkpoint without MLP biases (the other weights the same)."""
    if not dst.exists():
        from safetensors.torch import load_file, save_file

        shutil.copytree(src, dst)
        for path in dst.glob("*.safetensors"):
            tensors = load_file(path)
            save_file({k: v for k, v in tensors.items() if not (".mlp." in k and k.endswith(".bias"))}, path,
                      metadata={"format": "pt"})
        config = json.loads((dst / "config.json").read_text())
        config["mlp_bias"] = False
        (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst


@pytest.fixture(scope="module")
def llama_mlp_bias(tiny_model):
    return tiny_model("llama", "float32")


@pytest.fixture(scope="module")
def models(tiny_model, llama_mlp_bias):
    out = {kind: tiny_model(kind, "float32") for kind in KINDS if kind != "llama"}
    out["llama"] = _without_mlp_bias(llama_mlp_bias, llama_mlp_bias.parent / "llama-no-mlp-bias-float32")
    return out


def _by_kind(models, results):
    return {kind: results[str(path)] for kind, path in models.items() if str(path) in results}


@pytest.fixture(scope="module")
def stock(models):
    """SGLang as if atom were not installed: its own models on its torch_native backend."""
    results, log = run_engines("torch_native", list(models.values()), ATOM_DISABLE_SGLANG_PLUGIN="1")
    return _by_kind(models, results), log


@pytest.fixture(scope="module")
def atom_backend(models, llama_mlp_bias):
    """atom's models on atom's ``atom`` attention backend (`--attention-backend atom`), the Llama
    with MLP biases included."""
    results, log = run_engines("atom", [*models.values(), llama_mlp_bias])
    return _by_kind(dict(models, llama_mlp_bias=llama_mlp_bias), results), log


@pytest.fixture(scope="module")
def atom_models_sglang_attention(models):
    """``--attention-backend atom`` with ATOM_DISABLE_SGLANG_PLUGIN_ATTENTION=1: atom's models on
    SGLang's own torch_native backend."""
    results, log = run_engines("atom", list(models.values()), ATOM_DISABLE_SGLANG_PLUGIN_ATTENTION="1")
    return _by_kind(models, results), log


@pytest.fixture(scope="module")
def fused(models):
    """atom's backend with the fused QK-norm + RoPE + cache-write path."""
    results, log = run_engines("atom", [models[k] for k in FUSED_KINDS],
                               ATOM_ENABLE_QK_NORM_ROPE_CACHE_QUANT_FUSION="1")
    return _by_kind({k: models[k] for k in FUSED_KINDS}, results), log


@pytest.fixture(scope="module")
def hf(models, llama_mlp_bias):
    """HF transformers' greedy tokens for every prompt, one prompt at a time (fp32)."""
    import torch
    from transformers import AutoModelForCausalLM

    out = {}
    for kind, path in dict(models, llama_mlp_bias=llama_mlp_bias).items():
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        rows = []
        for prompts in (PROMPTS, FOLLOW_UP):
            batch = []
            for prompt in prompts:
                ids = torch.tensor([prompt])
                with torch.no_grad():
                    gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW_TOKENS,
                                         min_new_tokens=MAX_NEW_TOKENS, do_sample=False)
                batch.append(gen[0, ids.shape[1]:].tolist())
            rows.append(batch)
        out[kind] = rows
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_stock_sglang_matches_hf(kind, stock, hf):
    """The oracle agrees with stock SGLang on this machine (what the atom runs are held to)."""
    assert stock[0][kind] == hf[kind]


@pytest.mark.parametrize("kind", KINDS)
def test_atom_backend_matches_stock_and_hf(kind, atom_backend, stock, hf):
    assert atom_backend[0][kind] == stock[0][kind]
    assert atom_backend[0][kind] == hf[kind]


def test_atom_llama_with_mlp_bias_matches_hf(atom_backend, hf):
    assert atom_backend[0]["llama_mlp_bias"] == hf["llama_mlp_bias"]


@pytest.mark.parametrize("kind", KINDS)
def test_atom_models_on_sglang_attention_match_stock(kind, atom_models_sglang_attention, stock):
    assert atom_models_sglang_attention[0][kind] == stock[0][kind]


@pytest.mark.parametrize("kind", FUSED_KINDS)
def test_fused_qk_norm_rope_matches_stock(kind, fused, stock):
    assert fused[0][kind] == stock[0][kind]


def test_atom_runs_say_what_served(atom_backend, atom_models_sglang_attention, fused):
    log = atom_backend[1]
    for arch, module in (("Qwen3ForCausalLM", "qwen3"), ("Qwen3MoeForCausalLM", "qwen3_moe"),
                         ("LlamaForCausalLM", "llama")):
        assert f"Register model {arch} to SGLang with atom.plugin.sglang.model_wrapper:{arch}" in log
        assert f"built atom.models.{module}:{arch} ({arch}) for {arch} under SGLang" in log
    assert "attention on atom's backend" in log
    assert "atom attention backend ATOMSGLangAttnBackend selected" in log
    off = atom_models_sglang_attention[1]
    assert ("atom attention not used (disabled by ATOM_DISABLE_SGLANG_PLUGIN_ATTENTION=1); "
            "SGLang's torch_native instead") in off
    assert "attention on SGLang's own backend (disabled by ATOM_DISABLE_SGLANG_PLUGIN_ATTENTION=1)" in off
    assert "ignored" not in fused[1]


def test_atom_off_is_stock_sglang(stock):
    log = stock[1]
    assert "atom not activated under SGLang: disabled by ATOM_DISABLE_SGLANG_PLUGIN=1" in log
    assert "atom active" not in log and "built atom.models" not in log


@pytest.fixture(scope="module")
def tp2_runs(models):
    """Two SGLang TP ranks (one CPU core each) on the tiny Qwen3 and Qwen3-MoE: stock SGLang,
    then with atom active."""
    dirs = [models["qwen3"], models["qwen3_moe"]]
    stock = run_engines("torch_native", dirs, tp=2, ATOM_DISABLE_SGLANG_PLUGIN="1")[0]
    ours, log = run_engines("torch_native", dirs, tp=2)
    return {str(d): (ours[str(d)], stock[str(d)]) for d in dirs}, log


def test_tensor_parallel_is_served_by_sglangs_model(tp2_runs):
    """atom's models under SGLang run on one rank for now, stock SGLang's run TP: with atom active,
    a TP=2 engine builds SGLang's own model on each rank (the class atom's override replaced),
    says so once per rank and architecture, and gives stock SGLang's tokens."""
    runs, log = tp2_runs
    for arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"):
        line = f"atom steps aside for {arch} (tp_size=2: atom's models under SGLang run on one rank for now)"
        assert log.count(line) == 2, log[-4000:]  # TP0 and TP1
    assert "under SGLang, tp rank" not in log  # atom's "built ..." line
    for ours, stock in runs.values():
        assert ours == stock
