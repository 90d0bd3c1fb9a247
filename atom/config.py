"""atom's own configuration, independent of any host framework.

The plugin layer (``atom.plugin.vllm.config``) translates the host's configuration (vLLM's
``VllmConfig``) into this; atom's models and kernels only ever see these plain, typed values.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class CompilationConfig:
    #: torch.compile level as the host reports it (vLLM: ``compilation_config.mode``, 0 = none).
    level: int = 0
    #: atom never captures CUDA graphs itself when hosted: the host owns graph capture.
    use_cudagraph: bool = False


@dataclass(frozen=True)
class Config:
    model: str
    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int
    gpu_memory_utilization: float
    tensor_parallel_size: int = 1
    kv_cache_block_size: int = 16
    num_kvcache_blocks: int | None = None  # known only after the host profiles memory
    kv_cache_dtype: str = "auto"
    enable_prefix_caching: bool = False
    enable_expert_parallel: bool = False
    #: Always True when hosted: atom's own graph logic stays off, the host owns CUDA graphs.
    enforce_eager: bool = True
    compilation: CompilationConfig = field(default_factory=CompilationConfig)
    #: The HF config of the model (a transformers PretrainedConfig: architecture dims).
    hf_config: Any = None
    dtype: Any = None  # torch.dtype of activations/weights
