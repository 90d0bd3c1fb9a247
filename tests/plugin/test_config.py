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


def test_field_by_field(vllm_config):
    cfg = atom_config_from_vllm(vllm_config)
    assert isinstance(cfg, Config)
    assert cfg.max_model_len == 200
    assert cfg.enable_expert_parallel is False
    assert cfg.dtype == torch.float32
    assert cfg.hf_config.architectures == ["Qwen3ForCausalLM"]


def test_atom_config_holds_no_vllm_objects(vllm_config):
    import dataclasses

    cfg = atom_config_from_vllm(vllm_config)
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        assert not type(value).__module__.startswith("vllm"), f.name


def test_every_field_is_read_by_a_model():
    """Config holds only what atom's models read (the host owns the rest)."""
    import dataclasses
    import re

    from tests.conftest import REPO

    sources = "".join(p.read_text() for p in (REPO / "atom" / "models").rglob("*.py"))
    for f in dataclasses.fields(Config):
        assert re.search(rf"\bconfig\.{f.name}\b", sources), f.name
