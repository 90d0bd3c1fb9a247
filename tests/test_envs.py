"""atom/envs.py: declared once, read at access time, parsed strictly."""

import pytest

from atom import envs
from atom.envs import EnvError

BOOLS = [n for n, v in envs.VARIABLES.items() if v.type == "bool"]


def test_required_variables_are_declared():
    for name in ("ATOM_DISABLE_VLLM_PLUGIN", "ATOM_DISABLE_VLLM_PLUGIN_ATTENTION",
                 "ATOM_ENABLE_QK_NORM_ROPE_CACHE_QUANT_FUSION", "ATOM_DISABLED_PATCHES"):
        assert name in envs.VARIABLES
        assert envs.VARIABLES[name].doc


@pytest.mark.parametrize("name", BOOLS)
def test_bool_defaults_and_values(monkeypatch, name):
    default = envs.VARIABLES[name].default == "1"  # every switch's default is "0" or "1"
    assert envs.VARIABLES[name].default in ("0", "1")
    monkeypatch.delenv(name, raising=False)
    assert getattr(envs, name) is default
    for raw, expected in [("1", True), ("true", True), ("YES", True), ("on", True),
                          ("0", False), ("false", False), ("No", False), ("off", False), ("", default)]:
        monkeypatch.setenv(name, raw)
        assert getattr(envs, name) is expected, raw


@pytest.mark.parametrize("name", BOOLS)
def test_bool_bad_value_names_variable_and_accepted_values(monkeypatch, name):
    monkeypatch.setenv(name, "maybe")
    with pytest.raises(EnvError) as exc:
        getattr(envs, name)
    msg = str(exc.value)
    assert name in msg and "'maybe'" in msg and "accepted values" in msg and "0" in msg and "1" in msg


def test_read_at_access_time_not_import(monkeypatch):
    monkeypatch.setenv("ATOM_DISABLE_VLLM_PLUGIN", "0")
    assert envs.ATOM_DISABLE_VLLM_PLUGIN is False
    monkeypatch.setenv("ATOM_DISABLE_VLLM_PLUGIN", "1")
    assert envs.ATOM_DISABLE_VLLM_PLUGIN is True
    assert envs.get("ATOM_DISABLE_VLLM_PLUGIN") is True


def test_raw_reads_the_live_environment_as_os_environ_get_does(monkeypatch):
    """envs.raw (the dispatcher's per-call read) sees every kind of change at once, unset names
    as None, and falls back to the plain read where os.environ was replaced by a mapping."""
    import os
    from unittest import mock

    name = "ATOM_TEST_RAW_READ"
    monkeypatch.delenv(name, raising=False)
    assert envs.raw(name) is None
    monkeypatch.setenv(name, "triton")
    assert envs.raw(name) == "triton"
    os.environ[name] = "caf\u00e9,x=1"  # written directly; non-ASCII round-trips
    assert envs.raw(name) == "caf\u00e9,x=1"
    with mock.patch.dict(os.environ, {name: "torch"}):
        assert envs.raw(name) == "torch"
    assert envs.raw(name) == "caf\u00e9,x=1"  # restored
    monkeypatch.delenv(name)
    assert envs.raw(name) is None
    for key, value in list(os.environ.items())[:50]:
        assert envs.raw(key) == value
    monkeypatch.setattr(envs, "_FAST_READ", False)  # a Python whose os.environ has no _data
    assert envs.raw(name) is None and envs.raw("PATH") == os.environ["PATH"]
    monkeypatch.setattr(envs, "_FAST_READ", True)
    monkeypatch.setattr(os, "environ", {name: "replaced"})
    assert envs.raw(name) == "replaced"


def test_disabled_patches_list(monkeypatch):
    monkeypatch.setenv("ATOM_DISABLED_PATCHES", " a.b , c-d,,* ")
    assert envs.ATOM_DISABLED_PATCHES == ("a.b", "c-d", "*")
    monkeypatch.setenv("ATOM_DISABLED_PATCHES", "a;b")
    with pytest.raises(EnvError, match="ATOM_DISABLED_PATCHES"):
        envs.ATOM_DISABLED_PATCHES


def test_ops_backend(monkeypatch):
    monkeypatch.delenv("ATOM_OPS_BACKEND", raising=False)
    assert envs.ATOM_OPS_BACKEND == {"*": "auto"}
    monkeypatch.setenv("ATOM_OPS_BACKEND", "triton")
    assert envs.ATOM_OPS_BACKEND == {"*": "triton"}
    monkeypatch.setenv("ATOM_OPS_BACKEND", "torch, rms_norm=triton")
    assert envs.ATOM_OPS_BACKEND == {"*": "torch", "rms_norm": "triton"}
    monkeypatch.setenv("ATOM_OPS_BACKEND", "cuda")
    with pytest.raises(EnvError, match="ATOM_OPS_BACKEND.*auto, aiter, triton, torch"):
        envs.ATOM_OPS_BACKEND


def test_mla_decode_tile(monkeypatch):
    monkeypatch.delenv("ATOM_MLA_DECODE_TILE", raising=False)
    assert envs.ATOM_MLA_DECODE_TILE is None  # auto
    monkeypatch.setenv("ATOM_MLA_DECODE_TILE", " 64, 32,8,2")
    assert envs.ATOM_MLA_DECODE_TILE == (64, 32, 8, 2)
    for bad in ("64,32,8", "48,32,8,2", "64,32,3,2", "64,32,8,0", "big"):
        monkeypatch.setenv("ATOM_MLA_DECODE_TILE", bad)
        with pytest.raises(EnvError, match="ATOM_MLA_DECODE_TILE.*auto, or BLOCK_H,BLOCK_N,num_warps,num_stages"):
            envs.ATOM_MLA_DECODE_TILE


def test_unknown_variable():
    with pytest.raises(AttributeError):
        envs.ATOM_NOT_A_VARIABLE
    with pytest.raises(AttributeError):
        envs.get("ATOM_NOT_A_VARIABLE")


def test_set_values(monkeypatch):
    for n in envs.VARIABLES:
        monkeypatch.delenv(n, raising=False)
    monkeypatch.setenv("ATOM_DISABLE_VLLM_PLUGIN_ATTENTION", "1")
    assert envs.set_values() == {"ATOM_DISABLE_VLLM_PLUGIN_ATTENTION": True}


def test_compile_elementwise_choice(monkeypatch):
    monkeypatch.delenv("ATOM_COMPILE_ELEMENTWISE", raising=False)
    assert envs.ATOM_COMPILE_ELEMENTWISE == "inductor"
    for raw, expected in [("kernels", "kernels"), (" Inductor ", "inductor"), ("", "inductor")]:
        monkeypatch.setenv("ATOM_COMPILE_ELEMENTWISE", raw)
        assert envs.ATOM_COMPILE_ELEMENTWISE == expected, raw
    monkeypatch.setenv("ATOM_COMPILE_ELEMENTWISE", "triton")
    with pytest.raises(EnvError) as exc:
        envs.ATOM_COMPILE_ELEMENTWISE
    msg = str(exc.value)
    assert "ATOM_COMPILE_ELEMENTWISE='triton'" in msg and "accepted values: inductor, kernels" in msg


#: For every variable: values its parser must refuse (a new variable must add its own row).
MALFORMED = {
    "ATOM_DISABLE_VLLM_PLUGIN": ["maybe", "2", "yes please"],
    "ATOM_DISABLE_VLLM_PLUGIN_ATTENTION": ["maybe", "-1"],
    "ATOM_DISABLE_SGLANG_PLUGIN": ["maybe", "2"],
    "ATOM_DISABLE_SGLANG_PLUGIN_ATTENTION": ["on please", "-1"],
    "ATOM_ENABLE_QK_NORM_ROPE_CACHE_QUANT_FUSION": ["enabled", "10"],
    "ATOM_DISABLED_PATCHES": ["vllm.mla.x, bad id!", "a;b", "x/y"],
    "ATOM_ENABLE_ON_CPU": ["cpu", "11"],
    "ATOM_ALLOW_UNSUPPORTED_VLLM": ["always", "y es"],
    "ATOM_OPS_BACKEND": ["cuda", "rms_norm=fast", "=triton", "rms_norm=triton,bogus"],
    "ATOM_DISABLE_TORCH_COMPILE": ["never", "01x"],
    "ATOM_COMPILE_ELEMENTWISE": ["fast", "inductor,kernels"],
    "ATOM_MLA_CONTEXT_CHUNK_TOKENS": ["-16", "abc", "1.5", "16k", "0x10", ""],
    "ATOM_FP8_W8A8_MIN_TOKENS": ["-1", "abc", "1.5", ""],
    "ATOM_ENABLE_FP8_BLOCK_ON_NVIDIA": ["2", "maybe", ""],
    "ATOM_ENABLE_MHA_ON_NVIDIA": ["2", "maybe", ""],
    "ATOM_BF16_GEMV": ["2", "yes please", ""],
    "ATOM_FUSE_SHARED_EXPERTS": ["2", "fused", ""],
    "ATOM_FUSE_SHARED_EXPERTS_MAX_TOKENS": ["-1", "many", "1.5", "", "autos"],
    "ATOM_TRITON_DIRECT_LAUNCH": ["2", "maybe"],
    "ATOM_ENABLE_ON_NVIDIA": ["Gpt Oss", "GptOSSForCausalLM", "GptOssForCausalLM,Qwen3Model"],
    "ATOM_DISABLE_FP8_FUSED_ACT_QUANT": ["2", "maybe", ""],
    "ATOM_FP8_HOST_GEMM": ["cublas", "deep_gemm", "auto,cutlass"],
    "ATOM_FP8_HOST_GEMM_MIN_TOKENS": ["-128", "x", "2.0", "", "automatic"],
    "ATOM_FP8_HOST_GEMM_SMALL": ["cutlass", "flash_infer", "auto,atom"],
    "ATOM_MOE_GEMV_MAX_TOKENS": ["-1", "four", "2.5", "", "autos"],
    "ATOM_MLA_HOST_DECODE": ["flash_mla", "triton", "auto,atom"],
    "ATOM_MHA_HOST_PREFILL": ["fa3", "flashattention", "atom,auto"],
    "ATOM_MLA_DECODE_TILE": ["64,64,8", "48,64,8,2", "64,64,3,2", "64,64,8,0", "big"],
}


def test_every_variable_has_malformed_examples():
    assert set(MALFORMED) == set(envs.VARIABLES)


@pytest.mark.parametrize("name,raw", [(n, v) for n, values in MALFORMED.items() for v in values if v])
def test_malformed_values_are_refused_naming_the_variable(monkeypatch, name, raw):
    monkeypatch.setenv(name, raw)
    with pytest.raises(envs.EnvError) as exc:
        envs.get(name)
    assert name in str(exc.value) and "accepted" in str(exc.value)
    with pytest.raises(envs.EnvError):
        envs.set_values()  # what register_model runs first: vLLM stops with this message
