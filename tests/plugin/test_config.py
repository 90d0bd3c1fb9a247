"""Config translation on a real VllmConfig built by vLLM's EngineArgs for a tiny checkpoint."""

import pytest
import torch

from atom.config import Config
from atom.plugin.vllm.config import atom_config_from_vllm


@pytest.fixture(scope="module")
def vllm_config(tiny_model):
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(
        model=str(tiny_model("qwen3")), max_model_len=200, max_num_seqs=5,
        max_num_batched_tokens=300, gpu_memory_utilization=0.25, block_size=32,
        enable_prefix_caching=False, dtype="float32", kv_cache_dtype="auto",
    )
    return args.create_engine_config()


def test_field_by_field(vllm_config, tiny_model):
    cfg = atom_config_from_vllm(vllm_config)
    assert isinstance(cfg, Config)
    assert cfg.model == str(tiny_model("qwen3"))
    assert cfg.max_num_batched_tokens == 300
    assert cfg.max_num_seqs == 5
    assert cfg.max_model_len == 200
    assert cfg.gpu_memory_utilization == pytest.approx(0.25)
    assert cfg.tensor_parallel_size == 1
    assert cfg.kv_cache_block_size == 32
    assert cfg.num_kvcache_blocks is None  # vLLM sizes the cache after profiling
    assert cfg.kv_cache_dtype == "auto"
    assert cfg.enable_prefix_caching is False
    assert cfg.enable_expert_parallel is False
    assert cfg.enforce_eager is True  # vLLM owns CUDA graphs
    assert cfg.compilation.level == int(vllm_config.compilation_config.mode)
    assert cfg.compilation.use_cudagraph is False
    assert cfg.dtype == torch.float32
    assert cfg.hf_config.architectures == ["Qwen3ForCausalLM"]


def test_atom_config_holds_no_vllm_objects(vllm_config):
    import dataclasses

    cfg = atom_config_from_vllm(vllm_config)
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        assert not type(value).__module__.startswith("vllm"), f.name
    for f in dataclasses.fields(cfg.compilation):
        assert not type(getattr(cfg.compilation, f.name)).__module__.startswith("vllm")
