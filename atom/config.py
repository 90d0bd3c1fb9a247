"""atom's own configuration, independent of any host framework.

A host translates its configuration into this (vLLM: ``atom.plugin.vllm.config``); atom's models
only ever see these plain values. Only what a model reads is here: the host owns scheduling,
the KV cache, compilation and CUDA graphs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Config:
    #: The HF config of the model (a transformers PretrainedConfig: architecture dims).
    hf_config: Any
    #: torch.dtype of activations and unquantised weights.
    dtype: Any
    #: Longest sequence the host serves (sizes the rotary tables beyond the model's own limit).
    max_model_len: int
    #: Split experts across the expert-parallel group instead of each expert across TP ranks.
    enable_expert_parallel: bool = False
