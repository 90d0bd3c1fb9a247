"""vLLM's ``VllmConfig`` -> atom's :class:`atom.config.Config` (plain values only: no vLLM object
where atom expects its own). The vLLM objects a layer needs (cache and quantisation configs)
go to vLLM's own layers through the model wrapper's attention factory, not into atom's Config.
"""

from __future__ import annotations

from typing import Any

from atom.config import Config


def atom_config_from_vllm(vllm_config: Any) -> Config:
    """Translate a ``VllmConfig`` into atom's Config, field by field."""
    model = vllm_config.model_config
    max_model_len = model.max_model_len or getattr(vllm_config.scheduler_config, "max_model_len", None)
    return Config(
        hf_config=model.hf_config,
        dtype=model.dtype,
        max_model_len=int(max_model_len),
        enable_expert_parallel=bool(vllm_config.parallel_config.enable_expert_parallel),
    )
