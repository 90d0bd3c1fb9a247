"""bench/e2e.py's random checkpoint writer (bench/e2e_models.py): what it writes loads into HF transformers with no
missing or unexpected tensor, matrices drawn at the requested std, 1-D parameters at HF's init
(norm weights 1, DeepSeek's correction bias 0), for each architecture the benchmark builds."""

from __future__ import annotations

import pytest
import torch

from tests._bench import load_bench

TINY = {
    "dense": dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16),
    "moe": dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                num_experts=4, moe_intermediate_size=32),
    "mla": dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_attention_heads=4,
                num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16,
                v_head_dim=16, n_routed_experts=8, n_group=2, topk_group=1, num_experts_per_tok=2),
}


def _tensor_shapes(folder) -> dict:
    from safetensors import safe_open

    shapes = {}
    for f in folder.glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            shapes.update({k: tuple(st.get_slice(k).get_shape()) for k in st.keys()})
    return shapes


@pytest.fixture(scope="module")
def e2e():
    return load_bench("e2e_models")


@pytest.mark.parametrize("name", sorted(TINY))
def test_random_checkpoint_loads_into_hf_with_hf_1d_init(e2e, name, tmp_path):
    import transformers

    cls_name, kwargs, _ = e2e.MODELS[name]
    cfg = getattr(transformers, cls_name)(**{**kwargs, **TINY[name], "num_hidden_layers": 2, "vocab_size": 128,
                                             "tie_word_embeddings": False})
    params = e2e.write_random_checkpoint(cfg, tmp_path, 0.05, shard_bytes=64 << 10)
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1  # sharded, with an index
    # the tensors (names and shapes) save_pretrained writes: per-expert MoE weights, as published
    # checkpoints have them (atom's loaders do not take transformers 5's in-memory fused experts)
    ref = tmp_path / "hf"
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(ref)
    assert _tensor_shapes(tmp_path) == _tensor_shapes(ref)
    assert transformers.AutoConfig.from_pretrained(tmp_path).architectures == [cls_name.replace("Config", "ForCausalLM")]
    model, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert params == sum(t.numel() for t in model.state_dict().values())
    for pname, t in model.state_dict().items():
        t = t.float()
        if t.dim() >= 2:
            assert abs(t.std().item() - 0.05) < 0.01, pname
        else:
            assert torch.equal(t, torch.full_like(t, 1.0 if pname.endswith("norm.weight") else 0.0)), pname
