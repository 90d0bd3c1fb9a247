"""One greedy vLLM run for the attention-backend comparison, reduced to JSON-able results.

Used in-process (atom's backend) and as a script in a fresh interpreter for the fallback side
(``ATOM_DISABLE_VLLM_PLUGIN_ATTENTION=1`` must be set before vLLM loads its plugins)::

    python -m tests.attention._runner MODEL_DIR PROMPTS.json OUT.json
"""

from __future__ import annotations

import gc
import json
import os
import sys
from typing import Any

# Small token budget so the long prompts are chunked and steps mix prefill chunks with decodes;
# 32-token blocks (vLLM-CPU's attention takes multiples of 32) so that a later prompt sharing a
# few dozen tokens with an earlier one reuses a whole cached block (prefix caching is on).
ENGINE_KWARGS = dict(
    dtype="float32", enforce_eager=True, max_model_len=256, max_num_seqs=8, seed=0,
    gpu_memory_utilization=0.3, enable_chunked_prefill=True, max_num_batched_tokens=32,
    enable_prefix_caching=True, block_size=32,
)
ENGINE_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "HF_HUB_OFFLINE": "1",
}
NEW_TOKENS = 12


def attention_impls(llm: Any) -> list[str]:
    """Class names of the attention impls vLLM built for the model's layers."""

    def impls(model: Any) -> list[str]:
        return sorted({type(m.impl).__name__ for _, m in model.named_modules() if hasattr(m, "impl")})

    return llm.apply_model(impls)[0]


def layer_facts(llm: Any) -> dict[str, Any]:
    """Model class, how many impls run atom's fused QK-norm path, and the ``act_dtype`` each
    atom impl's ``process_weights_after_loading`` was called with by vLLM's loader."""

    def facts(model: Any) -> dict[str, Any]:
        impls = [m.impl for _, m in model.named_modules() if hasattr(m, "impl")]
        return {
            "model_class": f"{type(model).__module__}.{type(model).__name__}",
            "layers": len(impls),
            "fused": sum(getattr(i, "fused", None) is not None for i in impls),
            "post_load_dtypes": sorted({str(getattr(i, "weights_processed_dtype", None)) for i in impls}),
        }

    return llm.apply_model(facts)[0]


def generate_rows(llm: Any, prompts: Any) -> list[dict[str, Any]]:
    """Greedy rows (tokens, logprobs, cached prompt tokens) for ``prompts``: a list of token-id
    lists, or ``{"rounds": [[...], [...]]}``, each round one ``generate`` call on the same engine
    (a later round's prompts can hit the prefix cache an earlier round filled)."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=1)
    rows = []
    for round_ in (prompts["rounds"] if isinstance(prompts, dict) else [prompts]):
        for out in llm.generate([{"prompt_token_ids": p} for p in round_], params, use_tqdm=False):
            c = out.outputs[0]
            rows.append({
                "tokens": list(c.token_ids),
                "logprobs": [float(e[t].logprob) for e, t in zip(c.logprobs, c.token_ids)],
                "num_cached_tokens": int(out.num_cached_tokens or 0),
            })
    return rows


def use_vllm_qwen3() -> None:
    """vLLM's own Qwen3 class instead of atom's override (engine in this process: plugins are
    loaded now, so the engine's later load is a no-op)."""
    from vllm import ModelRegistry
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    ModelRegistry.register_model("Qwen3ForCausalLM", "vllm.model_executor.models.qwen3:Qwen3ForCausalLM")


def run(model_dir: str, prompts: list[list[int]], **engine_kwargs: Any) -> dict[str, Any]:
    from vllm import LLM, SamplingParams

    llm = LLM(model=model_dir, **{**ENGINE_KWARGS, **engine_kwargs})
    try:
        impls = attention_impls(llm)
        facts = layer_facts(llm)
        return {"impls": impls, "rows": generate_rows(llm, prompts), "facts": facts}
    finally:
        del llm
        gc.collect()
        from vllm.distributed import cleanup_dist_env_and_memory

        cleanup_dist_env_and_memory()


def main(argv: list[str]) -> int:
    """``MODEL_DIR PROMPTS.json OUT.json [ENGINE_KWARGS_JSON] [--vllm-qwen3]``"""
    vllm_qwen3 = "--vllm-qwen3" in argv
    argv = [a for a in argv if a != "--vllm-qwen3"]
    model_dir, prompts_path, out_path, *extra = argv
    engine_kwargs = json.loads(extra[0]) if extra else {}
    for key, value in ENGINE_ENV.items():
        os.environ.setdefault(key, value)
    if vllm_qwen3:
        use_vllm_qwen3()
    with open(prompts_path) as f:
        prompts = json.load(f)
    with open(out_path, "w") as f:
        json.dump(run(model_dir, prompts, **engine_kwargs), f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
