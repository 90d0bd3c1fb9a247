"""bench/e2e.py's random checkpoint writer (bench/e2e_models.py): what it writes loads into HF transformers with no
missing or unexpected tensor, matrices drawn at the requested std, 1-D parameters at HF's init
(norm weights 1, DeepSeek's correction bias 0; GPT-OSS's sinks drawn), for each architecture the benchmark
builds; each model is one atom serves, at its released model's dims."""

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
    "llama": dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16),
    "mixtral": dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                    num_local_experts=4),
    # 6 query heads of 16 (wider than hidden, as GLM-4.5-Air's 96 x 128 > 4096)
    "glm4moe": dict(hidden_size=64, intermediate_size=128, num_attention_heads=6, num_key_value_heads=2, head_dim=16,
                    moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2),
    # intermediate != hidden / 2 and != hidden: the fused [E, H, 2I] layout is not a split one's
    "gptoss": dict(hidden_size=64, intermediate_size=96, num_attention_heads=8, num_key_value_heads=2, head_dim=16,
                   num_local_experts=4, num_experts_per_tok=2, sliding_window=8),
}
TINY["mla8"] = TINY["mla"]  # one TP-8 rank of the same architecture
#: Every model the benchmarks build -> the architecture its checkpoint declares (atom serves each:
#: test_every_model_is_an_architecture_atom_serves).
ARCHITECTURES = {
    "dense": "Qwen3ForCausalLM", "dense32": "Qwen3ForCausalLM", "moe": "Qwen3MoeForCausalLM",
    "moe235": "Qwen3MoeForCausalLM", "mla": "DeepseekV3ForCausalLM", "mla8": "DeepseekV3ForCausalLM",
    "llama": "LlamaForCausalLM",
    "mixtral": "MixtralForCausalLM", "glm4moe": "Glm4MoeForCausalLM", "gptoss": "GptOssForCausalLM",
}
#: The released models whose dims the issue-#17 entries take: (layers, vocab, published parameter count).
RELEASED = {"llama": (32, 128256, 8.03e9), "mixtral": (32, 32000, 46.7e9), "glm4moe": (46, 151552, 106e9),
            "gptoss": (24, 201088, 20.9e9)}


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
        elif pname.endswith(e2e.SINKS_SUFFIX):  # per-head sinks N(0, 1): none zero, each head its own
            assert t.abs().min() > 0 and t.std() > 0.3 and len(set(t.tolist())) == t.numel(), pname
        else:
            assert torch.equal(t, torch.full_like(t, 1.0 if pname.endswith("norm.weight") else 0.0)), pname
    assert any(n.endswith(e2e.SINKS_SUFFIX) for n in model.state_dict()) == (name == "gptoss")


def test_every_model_is_an_architecture_atom_serves(e2e):
    """Each entry's config instantiates in transformers at its real dims (a model on the meta
    device), declares the architecture expected of it, which atom's architecture table overrides
    in vLLM with a model module present; SMOKE_KINDS' stand-in is a tiny kind of the same config."""
    import transformers

    from atom.plugin.models import BY_ARCH
    from atom.testing.tiny_models import KINDS

    assert sorted(e2e.MODELS) == sorted(ARCHITECTURES)
    for name, (cls_name, kwargs, layers) in e2e.MODELS.items():
        assert 1 <= layers <= 4, name  # a cold start that fits one GPU command
        cfg = getattr(transformers, cls_name)(**{**kwargs, "num_hidden_layers": layers, "vocab_size": 32000})
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(cfg)
        assert type(model).__name__ == ARCHITECTURES[name], name
        assert ARCHITECTURES[name] in BY_ARCH and BY_ARCH[ARCHITECTURES[name]].implemented(), name
        assert "quantization_config" not in cfg.to_dict(), name  # plain bf16 (GPT-OSS's release is MXFP4)
        if name in e2e.SMOKE_KINDS:
            assert KINDS[e2e.SMOKE_KINDS[name]][0] == cls_name, name
    assert set(RELEASED) <= set(e2e.SMOKE_KINDS)


def test_mla8_is_one_tp8_rank_of_the_mla_model(e2e):
    """mla8 is mla (DeepSeek-V3's dims) with what vLLM's TP-8 shards split by 8 (attention heads, the dense
    MLP, the experts' intermediate) and DeepSeek-V3's own 256 experts; everything else the same."""
    mla, mla8 = e2e.MODELS["mla"][1], e2e.MODELS["mla8"][1]
    split = {"num_attention_heads", "num_key_value_heads", "intermediate_size", "moe_intermediate_size"}
    assert {k: mla[k] // 8 for k in split} == {k: mla8[k] for k in split}
    assert (mla8["num_attention_heads"], mla8["intermediate_size"], mla8["moe_intermediate_size"],
            mla8["n_routed_experts"], mla8["hidden_size"], mla8["q_lora_rank"]) == (16, 2304, 256, 256, 7168, 1536)
    same = set(mla) - split - {"n_routed_experts"}
    assert set(mla8) == set(mla) and {k: mla[k] for k in same} == {k: mla8[k] for k in same}


@pytest.mark.parametrize("name", sorted(RELEASED))
def test_new_models_have_their_released_models_dims(e2e, name):
    """At the released model's depth and vocabulary, the entry's config has that model's published
    parameter count (within 1.5 %; GLM-4.5-Air's without its MTP layer): the dims are the real ones."""
    import transformers

    cls_name, kwargs, _ = e2e.MODELS[name]
    layers, vocab, published = RELEASED[name]
    cfg = getattr(transformers, cls_name)(**{**kwargs, "num_hidden_layers": layers, "vocab_size": vocab,
                                             "tie_word_embeddings": False})
    with torch.device("meta"):
        params = sum(t.numel() for t in transformers.AutoModelForCausalLM.from_config(cfg).state_dict().values())
    assert abs(params / published - 1) < 0.015, (name, params)


@pytest.mark.parametrize("name", ["moe", "mla"])
def test_router_skew_gives_zipf_like_expert_load(e2e, name, tmp_path):
    """``router_skew``: each router's rows scaled by (e + 1) ** -skew (mean square 1, so the matrix
    keeps its std), every other tensor as without it; the load measured on the written router is
    skewed (hot experts at several times the mean), the unskewed one close to uniform."""
    import transformers
    from safetensors.torch import load_file

    cls_name, kwargs, _ = e2e.MODELS[name]
    tiny = {**TINY[name], **({"num_experts": 32} if name == "moe" else {"n_routed_experts": 32, "n_group": 4})}
    cfg = getattr(transformers, cls_name)(**{**kwargs, **tiny, "num_hidden_layers": 2, "vocab_size": 128,
                                             "tie_word_embeddings": False, "num_experts_per_tok": 4})
    plain, skewed = tmp_path / "plain", tmp_path / "skewed"
    e2e.write_random_checkpoint(cfg, plain, 0.05)
    e2e.write_random_checkpoint(cfg, skewed, 0.05, router_skew=0.5)
    a = {k: v for f in plain.glob("*.safetensors") for k, v in load_file(str(f)).items()}
    b = {k: v for f in skewed.glob("*.safetensors") for k, v in load_file(str(f)).items()}
    routers = [k for k in a if k.endswith(e2e.ROUTER_SUFFIXES)]
    assert routers and a.keys() == b.keys()
    scales = e2e.router_row_scales(32, 0.5)
    assert scales[0] > 2.5 * scales[-1] and abs(scales.pow(2).mean().item() - 1.0) < 1e-6
    for k in a:
        if k in routers:  # the same draw, rows scaled (bf16 rounding of the product)
            torch.testing.assert_close(b[k].float(), (a[k].float() * scales[:, None]).to(torch.bfloat16).float())
        else:
            assert torch.equal(a[k], b[k]), k
    flat, hot = e2e.router_load(a[routers[0]], 4), e2e.router_load(b[routers[0]], 4)
    assert flat["max_over_mean"] < 1.7 < 2.5 < hot["max_over_mean"], (flat, hot)
    assert hot["top10pct_share"] > 1.5 * flat["top10pct_share"] and hot["min_over_mean"] < flat["min_over_mean"]
    assert e2e._first_router(skewed).shape == b[routers[0]].shape


def test_build_model_records_the_router_skew_and_its_load(e2e, tmp_path, monkeypatch):
    """build_model (the ab step's builder, AB_ROUTER_SKEW) passes the skew to the writer and
    records it with the load measured on the checkpoint's first router."""
    cls_name, kwargs, layers = e2e.MODELS["moe"]
    monkeypatch.setitem(e2e.MODELS, "moe", (cls_name, {**kwargs, **TINY["moe"], "num_experts": 16,
                                                       "num_experts_per_tok": 2}, layers))
    monkeypatch.setattr(e2e, "transformers_sources", lambda max_chars: ["def f(x):\n    return x + 1\n" * 200])
    info = e2e.build_model("moe", 2, tmp_path / "m", 512, 64, 0.05, router_skew=0.5)
    assert info["config"]["router_skew"] == 0.5
    assert info["config"]["router_load"] == e2e.router_load(e2e._first_router(tmp_path / "m"), 2)
    assert info["config"]["router_load"]["max_over_mean"] > 1.5


@pytest.mark.parametrize("name", sorted(RELEASED))
def test_build_model_smoke_of_each_new_architecture(e2e, name, tmp_path, monkeypatch):
    """build_model (the agreement and ab steps' builder) at reduced dims, its default depth: the
    checkpoint is plain bf16 (no quantization_config), declares the architecture, has the expert
    layout vLLM's loader for it reads (Mixtral per expert w1/w3/w2 under block_sparse_moe, GLM
    per expert, GPT-OSS fused with biases), and a MoE model's router load is recorded (its
    router found under the architecture's name for it)."""
    import json

    from safetensors import safe_open

    cls_name, kwargs, layers = e2e.MODELS[name]
    monkeypatch.setitem(e2e.MODELS, name, (cls_name, {**kwargs, **TINY[name]}, layers))
    monkeypatch.setattr(e2e, "transformers_sources", lambda max_chars: ["def f(x):\n    return x + 1\n" * 200])
    out = tmp_path / name
    info = e2e.build_model(name, layers, out, 512, 64, 0.02)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [ARCHITECTURES[name]] and config["num_hidden_layers"] == layers
    assert "quantization_config" not in config and config["vocab_size"] == 512
    assert (out / "tokenizer.json").exists() and info["layers"] == layers
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    with safe_open(str(out / index["model.embed_tokens.weight"]), "pt") as st:
        assert st.get_slice("model.embed_tokens.weight").get_dtype() == "BF16"
    last = f"model.layers.{layers - 1}."
    expected = {
        "llama": [last + "mlp.gate_proj.weight"],
        "mixtral": [last + "block_sparse_moe.gate.weight", last + "block_sparse_moe.experts.3.w1.weight",
                    last + "block_sparse_moe.experts.3.w2.weight", last + "block_sparse_moe.experts.3.w3.weight"],
        "glm4moe": ["model.layers.0.mlp.gate_proj.weight", last + "mlp.gate.weight",
                    last + "mlp.gate.e_score_correction_bias", last + "mlp.experts.7.up_proj.weight",
                    last + "mlp.shared_experts.down_proj.weight"],
        "gptoss": [last + "mlp.router.weight", last + "mlp.router.bias", last + "mlp.experts.gate_up_proj",
                   last + "mlp.experts.gate_up_proj_bias", last + "mlp.experts.down_proj",
                   last + "mlp.experts.down_proj_bias", last + "self_attn.sinks"],
    }[name]
    assert set(expected) <= set(index), sorted(set(expected) - set(index))
    assert not any(".mlp.experts.gate_up_proj" in n for n in index) or name == "gptoss"
    if name != "llama":
        top_k = {**kwargs, **TINY[name]}["num_experts_per_tok"]
        assert info["config"]["router_load"] == e2e.router_load(e2e._first_router(out), top_k)


@pytest.mark.parametrize("name", ["moe", "mla"])
def test_block_fp8_written_as_drawn_equals_the_quantised_bf16_checkpoint(e2e, name, tmp_path):
    """``block_fp8`` (the ab step's AB_FP8 builder, one pass, no bf16 copy on disk) writes the same
    tensors, bit for bit, and the same quantization_config as drawing the bf16 checkpoint and
    converting it (quantize_block_fp8), sharded and indexed; routers, norms and embeddings stay
    bf16; the shard size counts the fp8 bytes."""
    import json

    import transformers
    from safetensors.torch import load_file

    cls_name, kwargs, _ = e2e.MODELS[name]
    cfg = lambda: getattr(transformers, cls_name)(**{**kwargs, **TINY[name], "num_hidden_layers": 2,  # noqa: E731
                                                     "vocab_size": 128, "tie_word_embeddings": False})
    bf16, conv, direct = tmp_path / "bf16", tmp_path / "conv", tmp_path / "direct"
    e2e.write_random_checkpoint(cfg(), bf16, 0.05, shard_bytes=64 << 10, router_skew=0.3)
    quant = e2e.quantize_block_fp8(bf16, conv, (32, 32))
    params = e2e.write_random_checkpoint(cfg(), direct, 0.05, shard_bytes=64 << 10, router_skew=0.3,
                                         block_fp8=(32, 32))

    def tensors(folder):
        out = {}
        for f in folder.glob("*.safetensors"):
            out.update(load_file(str(f)))
        return out

    want, got = tensors(conv), tensors(direct)
    assert set(got) == set(want) and any(k.endswith("weight_scale_inv") for k in got)
    for k, t in want.items():
        assert got[k].dtype == t.dtype and torch.equal(got[k].view(torch.uint8) if t.dtype == torch.float8_e4m3fn
                                                       else got[k], t.view(torch.uint8)
                                                       if t.dtype == torch.float8_e4m3fn else t), k
        if ".layers." in k and k.endswith(".weight") and "_proj" in k.removesuffix(".weight").rpartition(".")[2]:
            assert t.dtype == torch.float8_e4m3fn, k
        elif k.endswith(".weight") and "scale" not in k:
            assert t.dtype == torch.bfloat16, k
    assert json.loads((direct / "config.json").read_text())["quantization_config"] == quant
    index = json.loads((direct / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(index) == set(got) and len(set(index.values())) > 1
    assert params == e2e.write_random_checkpoint(cfg(), tmp_path / "again", 0.05)
    assert not list(direct.glob("part-*"))


def test_build_model_without_weights_writes_the_config_vllm_reads_for_dummy_loading(e2e, tmp_path, monkeypatch):
    """``weights=False`` (the ab step's AB_DUMMY, vLLM's load_format "dummy"): the same config.json as
    the full build (architecture, depth, the fp8 quantization_config), a tokenizer, no tensor
    files, and the parameter count of the model it describes."""
    import json

    cls_name, kwargs, layers = e2e.MODELS["moe"]
    monkeypatch.setitem(e2e.MODELS, "moe", (cls_name, {**kwargs, **TINY["moe"], "num_experts_per_tok": 2}, layers))
    monkeypatch.setattr(e2e, "transformers_sources", lambda max_chars: ["def f(x):\n    return x + 1\n" * 200])
    full = e2e.build_model("moe", 3, tmp_path / "full", 512, 64, 0.02, block_fp8=(32, 32))
    bare = e2e.build_model("moe", 3, tmp_path / "bare", 512, 64, 0.02, block_fp8=(32, 32), weights=False)
    assert json.loads((tmp_path / "bare" / "config.json").read_text()) == \
        json.loads((tmp_path / "full" / "config.json").read_text())
    assert not list((tmp_path / "bare").glob("*.safetensors*")) and (tmp_path / "bare" / "tokenizer.json").exists()
    assert bare["params"] == full["params"] and (bare["weights"], full["weights"]) == ("dummy", "random")
    assert "router_load" not in bare["config"] and "router_load" in full["config"]


def test_qwen3_moe_fp8_checkpoints_keep_their_routers_unquantised_as_the_releases_do(e2e, tmp_path, monkeypatch):
    """The bench's block-fp8 Qwen3-MoE checkpoints (drawn, config-only, converted) list ``lm_head`` and
    every sparse layer's ``mlp.gate`` in ``modules_to_not_convert``, as Qwen3-30B-A3B-FP8 does: real
    vLLM's fp8 config then leaves each router unquantised (its Qwen3-MoE router takes the quant config:
    without the list vLLM quantised the bf16 router and kept its placeholder scale, so every stock side
    of the fp8 MoE cells before 2026-12-01 routed wrongly). Other architectures' releases list none."""
    import json

    from vllm.model_executor.layers.linear import ReplicatedLinear, UnquantizedLinearMethod
    from vllm.model_executor.layers.quantization.fp8 import Fp8Config
    from vllm.model_executor.layers.quantization.utils.quant_utils import is_layer_skipped

    cls_name, kwargs, layers = e2e.MODELS["moe"]
    monkeypatch.setitem(e2e.MODELS, "moe", (cls_name, {**kwargs, **TINY["moe"], "num_experts_per_tok": 2,
                                                       "mlp_only_layers": [1]}, layers))
    monkeypatch.setattr(e2e, "transformers_sources", lambda max_chars: ["def f(x):\n    return x + 1\n" * 200])
    e2e.build_model("moe", 3, tmp_path / "bare", 512, 64, 0.02, block_fp8=(32, 32), weights=False)
    e2e.build_model("moe", 3, tmp_path / "bf16", 512, 64, 0.02)
    converted = e2e.quantize_block_fp8(tmp_path / "bf16", tmp_path / "conv", (32, 32))
    quant = json.loads((tmp_path / "bare" / "config.json").read_text())["quantization_config"]
    assert quant["modules_to_not_convert"] == ["lm_head", "model.layers.0.mlp.gate", "model.layers.2.mlp.gate"]
    assert converted == quant
    vllm_fp8 = Fp8Config.from_config(quant)
    for router in quant["modules_to_not_convert"][1:]:
        assert isinstance(vllm_fp8.get_quant_method(object.__new__(ReplicatedLinear), router), UnquantizedLinearMethod)
    assert not is_layer_skipped("model.layers.0.self_attn.o_proj", vllm_fp8.ignored_layers)
    unlisted = Fp8Config.from_config({k: v for k, v in quant.items() if k != "modules_to_not_convert"})
    assert not is_layer_skipped("model.layers.0.mlp.gate", unlisted.ignored_layers or [])
    assert "modules_to_not_convert" not in e2e.fp8_quantization_config((128, 128), {"model_type": "deepseek_v3"})
    # a checkpoint cached from before (no list in its config) gets the list when the build finds it
    stale = json.loads((tmp_path / "bare" / "config.json").read_text())
    del stale["quantization_config"]["modules_to_not_convert"]
    (tmp_path / "bare" / "config.json").write_text(json.dumps(stale))
    e2e.build_model("moe", 3, tmp_path / "bare", 512, 64, 0.02, block_fp8=(32, 32), weights=False)
    assert json.loads((tmp_path / "bare" / "config.json").read_text())["quantization_config"] == quant
