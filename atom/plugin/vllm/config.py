"""vLLM's ``VllmConfig`` -> atom's :class:`atom.config.Config` (plain values only: no vLLM object
where atom expects its own). The vLLM objects a layer needs (cache and quantisation configs)
go to vLLM's own layers through the model wrapper's attention factory, not into atom's Config.
"""

from __future__ import annotations

from typing import Any

from atom.config import CompilationConfig, Config


def _int_mode(mode: Any) -> int:
    # vLLM >= 0.11 has an IntEnum ``compilation_config.mode``; older releases had ``level``.
    return int(getattr(mode, "value", mode) or 0)


def atom_config_from_vllm(vllm_config: Any) -> Config:
    """Translate a ``VllmConfig`` into atom's Config, field by field."""
    from atom.plugin.vllm import compat

    model = vllm_config.model_config
    sched = vllm_config.scheduler_config
    cache = vllm_config.cache_config
    par = vllm_config.parallel_config
    max_model_len = model.max_model_len or getattr(sched, "max_model_len", None)
    return Config(
        model=str(model.model),
        max_num_batched_tokens=int(sched.max_num_batched_tokens),
        max_num_seqs=int(sched.max_num_seqs),
        max_model_len=int(max_model_len),
        gpu_memory_utilization=float(cache.gpu_memory_utilization),
        tensor_parallel_size=int(par.tensor_parallel_size),
        kv_cache_block_size=int(cache.block_size),
        num_kvcache_blocks=cache.num_gpu_blocks,
        kv_cache_dtype=str(cache.cache_dtype),
        enable_prefix_caching=bool(cache.enable_prefix_caching),
        enable_expert_parallel=bool(par.enable_expert_parallel),
        enforce_eager=True,
        compilation=CompilationConfig(level=_int_mode(compat.compilation_mode(vllm_config)), use_cudagraph=False),
        hf_config=model.hf_config,
        dtype=model.dtype,
    )
