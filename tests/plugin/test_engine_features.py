"""vLLM engine features whose support is a property of the model class, with atom installed:
where atom's models take the feature, they serve it; where they do not, atom steps aside when
vLLM builds the model (``atom.plugin.vllm.overrides.builds``) and vLLM's own class serves, with
one log line. Either way the results equal stock vLLM's (atom off) in fp32.

- LoRA adapters (``enable_lora``): atom's models take none, so vLLM's model serves; before,
  vLLM refused to start ("ATOMForCausalLM does not support LoRA yet").
- ngram speculative decoding proposes from token ids alone: atom's model serves it.
- Speculation that hands the target model to a draft (EAGLE / EAGLE3 hidden states, MTP, a
  draft model sharing its embeddings): vLLM's model serves it (the decision on real configs).
"""

from __future__ import annotations

import json

import pytest

from tests.conftest import run_python

QWEN3 = "vllm.model_executor.models.qwen3:Qwen3ForCausalLM"


def build_adapter(model_dir, out_dir):
    """A rank-8 PEFT LoRA adapter for the tiny Qwen3: q/v/o and the MLP's down projection of
    every layer, random A and B (B nonzero, so the adapter changes the output)."""
    import torch
    from safetensors.torch import save_file

    cfg = json.loads((model_dir / "config.json").read_text())
    hidden, heads, kv, head_dim = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    dims = {"q_proj": (hidden, heads * head_dim), "v_proj": (hidden, kv * head_dim),
            "o_proj": (heads * head_dim, hidden), "down_proj": (cfg["intermediate_size"], hidden)}
    gen = torch.Generator().manual_seed(0)
    tensors = {}
    for layer in range(cfg["num_hidden_layers"]):
        for name, (n_in, n_out) in dims.items():
            block = "mlp" if name == "down_proj" else "self_attn"
            key = f"base_model.model.model.layers.{layer}.{block}.{name}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(8, n_in, generator=gen) * 0.2
            tensors[f"{key}.lora_B.weight"] = torch.randn(n_out, 8, generator=gen) * 0.2
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "adapter_model.safetensors"))
    (out_dir / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 8, "lora_alpha": 16, "lora_dropout": 0.0,
        "bias": "none", "target_modules": sorted(dims), "base_model_name_or_path": str(model_dir)}))
    return out_dir


@pytest.fixture(scope="module")
def sides(tiny_model, tmp_path_factory):
    model = tiny_model("qwen3", "float32")
    adapter = build_adapter(model, tmp_path_factory.mktemp("lora") / "tiny")
    out = {}
    for side, env in (("stock", {"ATOM_DISABLE_VLLM_PLUGIN": "1"}), ("atom", {})):
        path = tmp_path_factory.mktemp(side) / "out.json"
        proc = run_python(f"""
            import json
            from tests.plugin._features_child import run
            json.dump(run({str(model)!r}, {str(adapter)!r}), open({str(path)!r}, "w"))
        """, env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0", **env}, timeout=900)
        assert proc.returncode == 0, proc.stderr[-4000:]
        out[side] = (json.loads(path.read_text()), proc.stderr)
    return out


def _same(ours, theirs, atol=1e-4):
    assert [r["tokens"] for r in ours] == [r["tokens"] for r in theirs]
    for a, b in zip(ours, theirs):
        assert max(abs(x - y) for x, y in zip(a["logprobs"], b["logprobs"])) < atol


def test_lora_is_served_by_vllms_model(sides):
    (ours, log), (theirs, _) = sides["atom"], sides["stock"]
    assert ("atom steps aside for Qwen3ForCausalLM (LoRA adapters enabled: atom's models take none): "
            "vLLM's own model serves it") in log
    _same(ours["lora"], theirs["lora"])
    _same(ours["lora_base"], theirs["lora_base"])
    # the adapter took part: its tokens are not the base model's
    assert [r["tokens"] for r in theirs["lora"]] != [r["tokens"] for r in theirs["lora_base"]]


def test_ngram_speculation_stays_atoms(sides):
    (ours, log), (theirs, _) = sides["atom"], sides["stock"]
    assert ours["ngram_model"] == "atom.plugin.vllm.model_wrapper:ATOMForCausalLM"
    assert theirs["ngram_model"] == QWEN3
    _same(ours["ngram"], theirs["ngram"], atol=1e-3)


def test_draft_model_speculation_builds_vllms_model(tiny_model):
    """On a real vLLM config of the tiny Qwen3, the decision atom's wrapper asks at build: LoRA
    and the speculation methods that hand the target to a draft go to vLLM's model; ngram and
    suffix (token ids only) stay atom's. (EAGLE / MTP drafts need checkpoints of their own, so the
    method is set on vLLM's built config.)"""
    checkpoint = tiny_model("qwen3", "float32")
    proc = run_python(f"""
        import copy, json
        from vllm.engine.arg_utils import EngineArgs
        from atom.plugin.vllm import overrides

        config = EngineArgs(model={str(checkpoint)!r}, max_model_len=256, speculative_config={{
            "method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}}).create_engine_config()
        out = {{}}
        for method in ("ngram", "suffix", "eagle", "eagle3", "mtp", "draft_model", "medusa"):
            config.speculative_config.method = method
            out[method] = list(overrides.builds(config)[:2])
        lora = EngineArgs(model={str(checkpoint)!r}, max_model_len=256, enable_lora=True).create_engine_config()
        out["lora"] = list(overrides.builds(lora)[:2])
        print("RESULT", json.dumps(out))
    """, env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.split("RESULT ", 1)[1])
    assert out["ngram"][0] and out["suffix"][0]
    for method in ("eagle", "eagle3", "mtp", "draft_model", "medusa"):
        assert out[method] == [False, f"speculative decoding by {method!r}: atom's models serve ngram and suffix "
                                      "speculation only"], method
    assert out["lora"] == [False, "LoRA adapters enabled: atom's models take none"]
