"""One test per vLLM-version difference in atom.plugin.vllm.compat, against the installed vLLM."""

import importlib

import pytest
from packaging.version import Version

from atom.plugin.vllm import compat


def test_version():
    assert Version("0.26") <= compat.vllm_version() < Version("0.34")


def test_target_device_short_circuit_matches_vllm_source():
    import inspect

    import vllm.platforms as P

    src = inspect.getsource(P.resolve_current_platform_cls_qualname)
    has_short_circuit = 'VLLM_TARGET_DEVICE == "cpu"' in src
    assert has_short_circuit == compat.target_device_short_circuits_plugins()


def test_get_kv_cache_shape_presence():
    from vllm.v1.attention.backend import AttentionBackend

    assert hasattr(AttentionBackend, "get_kv_cache_shape") == compat.has_get_kv_cache_shape()


def test_attention_layer_module():
    module = importlib.import_module(compat.attention_layer_module())
    assert hasattr(module, "Attention")


def test_mla_attention_layer_module():
    """vLLM's MLA layer, with the constructor arguments and forward atom's MLA factory uses."""
    import inspect

    layer = importlib.import_module(compat.mla_attention_layer_module()).MLAAttention
    params = inspect.signature(layer.__init__).parameters
    assert {"num_heads", "scale", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "q_lora_rank",
            "kv_lora_rank", "kv_b_proj", "cache_config", "quant_config", "prefix"} <= set(params)
    assert list(inspect.signature(layer.forward).parameters)[:5] == ["self", "q", "kv_c_normed", "k_pe",
                                                                     "output_shape"]


def test_selector_config_fields():
    cls = compat.selector_config_cls()
    assert {"head_size", "dtype", "kv_cache_dtype", "block_size", "use_mla"} <= set(cls._fields)


def test_compilation_mode(tiny_model):
    from vllm.engine.arg_utils import EngineArgs

    cfg = EngineArgs(model=str(tiny_model("qwen3")), max_model_len=128).create_engine_config()
    assert compat.compilation_mode(cfg) is cfg.compilation_config.mode


def test_kv_cache_as_nhd(monkeypatch):
    import torch
    from packaging.version import Version

    blocks, heads, block_size, d = 3, 2, 4, 5
    if not compat.has_get_kv_cache_shape():
        # >= 0.29: vLLM's logical [B, H, N, Dk+Dv] per-layer view (here in LBNHC order)
        physical = torch.randn(blocks, block_size, heads, 2 * d)
        view = physical.permute(0, 2, 1, 3)
        k, v = compat.kv_cache_as_nhd(view, d)
        assert k.shape == v.shape == (blocks, block_size, heads, d)
        assert torch.equal(k[1, 2, 0], view[1, 0, 2, :d]) and torch.equal(v[1, 2, 0], view[1, 0, 2, d:])
        assert k.stride(-1) == v.stride(-1) == 1
    # <= 0.28: the backend's own (2, B, N, H, D) tensor
    monkeypatch.setattr(compat, "vllm_version", lambda: Version("0.26.0"))
    cache = torch.randn(2, blocks, block_size, heads, d)
    k, v = compat.kv_cache_as_nhd(cache, d)
    assert torch.equal(k, cache[0]) and torch.equal(v, cache[1])


def test_layer_calls_kv_cache_update():
    import inspect

    layer = importlib.import_module(compat.attention_layer_module()).Attention
    calls_it = "forward_includes_kv_cache_update" in inspect.getsource(layer.forward)
    assert calls_it == compat.layer_calls_kv_cache_update()


def test_platform_selects_mla_prefill_matches_vllm_source():
    """0.32+: vLLM's MLA prefill selector asks the platform; 0.26: device capability alone."""
    import inspect

    from vllm.v1.attention.backends.mla.prefill import selector

    asks = "current_platform.get_mla_prefill_backend_cls(" in inspect.getsource(selector)
    assert asks == compat.platform_selects_mla_prefill()


def test_layer_quant_method_asks_as_the_installed_mla_layer_does():
    """0.32+: ``MLAAttention.process_weights_after_loading`` calls ``resolve_quant_method``; 0.26
    has no such function and calls ``quant_config.get_quant_method`` (the call that failed on 0.26
    before). Either way vLLM's fp8 config has no method for an MLA layer (its KV-cache method is
    for ``Attention`` layers), so the layer gets vLLM's default q/k/v scales."""
    import inspect

    from vllm.model_executor.layers.quantization.fp8 import Fp8Config

    module = importlib.import_module("vllm.model_executor.layers.attention.mla_attention")
    source = inspect.getsource(module.MLAAttention.process_weights_after_loading)
    assert ("resolve_quant_method(" in source) == hasattr(module, "resolve_quant_method")
    assert "resolve_quant_method(" in source or "quant_config.get_quant_method(" in source
    layer = module.MLAAttention.__new__(module.MLAAttention)
    config = Fp8Config.from_config({"quant_method": "fp8", "activation_scheme": "dynamic",
                                    "weight_block_size": [128, 128]})
    method = compat.layer_quant_method(config, layer, "model.layers.0.self_attn.attn")
    assert method is None and not module.should_load_quant_weights(method)


def test_mla_layer_builds_its_prefill_backend_through_the_patched_name():
    """MLAAttention.__init__ calls the ``get_mla_prefill_backend`` of its own module (the name
    the ``vllm.mla.prefill_backend`` record wraps), on every supported release."""
    import inspect

    module = importlib.import_module("vllm.model_executor.layers.attention.mla_attention")
    assert "get_mla_prefill_backend(" in inspect.getsource(module.MLAAttention.__init__)
    assert callable(vars(module)["get_mla_prefill_backend"])


def test_backend_names_extensible_matches_vllm():
    """0.32+: ``register_backend("NEW", path)`` adds an enum member; 0.26: members only."""
    import inspect

    from vllm.v1.attention.backends import registry

    takes_strings = "isinstance(backend, str)" in inspect.getsource(registry.register_backend)
    assert takes_strings == compat.backend_names_extensible()


def test_the_supported_range_is_stated_once():
    """compat.SUPPORTED_VLLM is the range; pyproject's [vllm] extra states the same, and the
    records and register_platform use compat's (no other copy in atom/)."""
    import re
    import tomllib

    from atom.patches import REGISTRY
    from atom.plugin import catalog
    from tests.conftest import REPO

    extra = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["vllm"]
    assert extra == [f"vllm{compat.SUPPORTED_VLLM}"]
    catalog.load()
    assert {r.vllm for r in REGISTRY.select("vllm")} == {compat.SUPPORTED_VLLM}
    literal = re.compile(re.escape(compat.SUPPORTED_VLLM))
    copies = [p for p in (REPO / "atom").rglob("*.py") if literal.search(p.read_text())]
    assert copies == [REPO / "atom" / "plugin" / "vllm" / "compat.py"], copies
