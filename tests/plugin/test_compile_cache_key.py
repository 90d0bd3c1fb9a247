"""atom's settings are part of vLLM's torch.compile cache key.

vLLM keys its compile cache by ``VllmConfig.compute_hash()``, the traced source files and its own
environment variables, so a graph compiled with one ATOM_* setting would be reused under another
(e.g. with the QK-norm fusion toggled, the cached unfused graph ran while the impl also normed q/k).
The platform puts atom's factors into ``additional_config``, which ``compute_hash`` covers."""

from __future__ import annotations

import pytest


@pytest.fixture
def vllm_config():
    from vllm.config import VllmConfig

    return VllmConfig()


def test_factors_hold_atom_version_and_the_set_variables(monkeypatch):
    from atom.plugin.vllm.platform import compile_cache_factors

    monkeypatch.delenv("ATOM_ENABLE_QK_NORM_ROPE_CACHE_QUANT_FUSION", raising=False)
    monkeypatch.setenv("ATOM_OPS_BACKEND", "rms_norm=torch")
    factors = compile_cache_factors()
    assert factors["version"]
    assert factors["ATOM_OPS_BACKEND"] == "rms_norm=torch"
    assert "ATOM_ENABLE_QK_NORM_ROPE_CACHE_QUANT_FUSION" not in factors


def test_vllm_config_hash_follows_atom_settings(vllm_config, monkeypatch):
    from atom.plugin.vllm.platform import add_compile_cache_factors

    hashes = {}
    for value in ("0", "1"):
        monkeypatch.setenv("ATOM_ENABLE_QK_NORM_ROPE_CACHE_QUANT_FUSION", value)
        add_compile_cache_factors(vllm_config)
        assert vllm_config.additional_config["atom"]["ATOM_ENABLE_QK_NORM_ROPE_CACHE_QUANT_FUSION"] == value
        hashes[value] = vllm_config.compute_hash()
    assert hashes["0"] != hashes["1"]
    add_compile_cache_factors(vllm_config)  # same settings, same key (the cache still hits)
    assert vllm_config.compute_hash() == hashes["1"]


def test_compile_elementwise_is_in_the_key(vllm_config, monkeypatch):
    """ATOM_COMPILE_ELEMENTWISE changes what Dynamo traces (plain torch vs torch.ops.atom nodes).
    Unset, its default is fixed per atom version, which the key holds too."""
    from atom.plugin.vllm.platform import add_compile_cache_factors

    hashes = set()
    for value in (None, "kernels", "inductor"):
        if value is None:
            monkeypatch.delenv("ATOM_COMPILE_ELEMENTWISE", raising=False)
        else:
            monkeypatch.setenv("ATOM_COMPILE_ELEMENTWISE", value)
        add_compile_cache_factors(vllm_config)
        assert vllm_config.additional_config["atom"].get("ATOM_COMPILE_ELEMENTWISE") == value
        hashes.add(vllm_config.compute_hash())
    assert len(hashes) == 3


def test_user_additional_config_is_kept(vllm_config, monkeypatch):
    from atom.plugin.vllm.platform import add_compile_cache_factors

    vllm_config.additional_config = {"mine": 1}
    add_compile_cache_factors(vllm_config)
    assert vllm_config.additional_config["mine"] == 1 and "atom" in vllm_config.additional_config


def test_vllm_calls_it_through_the_platform_hook(vllm_config, monkeypatch):
    """vLLM's VllmConfig construction calls ``current_platform.check_and_update_config``: with
    atom's platform active (this test process), the factors are there without any call of ours."""
    from vllm.platforms import current_platform

    from atom.plugin.vllm.platform import ATOMPlatform

    assert isinstance(current_platform, ATOMPlatform)
    assert "atom" in vllm_config.additional_config
