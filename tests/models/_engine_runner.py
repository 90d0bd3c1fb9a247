"""One greedy vLLM run per dtype on a checkpoint, reduced to plain JSON-able results.

Used in-process by the model tests (atom on) and as a script in a fresh interpreter for the
stock-vLLM side (``ATOM_DISABLE_VLLM_PLUGIN=1`` must be set before vLLM loads its plugins, and
plugins load once per process)::

    python -m tests.models._engine_runner MODEL_DIR PROMPTS.json OUT.json float32 bfloat16

``--engine '{"tensor_parallel_size": 2}'`` (before the dtypes) adds engine arguments.
"""

from __future__ import annotations

import gc
import json
import os
import sys
from typing import Any, Callable, Optional

#: Engine settings shared by both sides of every comparison.
ENGINE_KWARGS = dict(
    enforce_eager=True, max_model_len=256, max_num_seqs=8, seed=0, gpu_memory_utilization=0.3,
)
ENGINE_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "HF_HUB_OFFLINE": "1",
}
NEW_TOKENS = 16


def _token_logprob(entry: Optional[dict], token: int) -> Optional[float]:
    if entry is None or token not in entry:
        return None
    return float(entry[token].logprob)


def stock_mla_kwargs(model_dir: str, engine_kwargs: dict[str, Any]) -> dict[str, Any]:
    """Engine arguments that name vLLM's portable ``CPU_MLA`` backend for a run of an MLA
    checkpoint without atom's attention (``ATOM_DISABLE_VLLM_PLUGIN`` or
    ``ATOM_DISABLE_VLLM_PLUGIN_ATTENTION``) on vLLM-CPU, where that vLLM also has ``AMX_MLA``
    and the caller named no backend; ``{}`` otherwise.

    vLLM-CPU 0.32 picks AMX_MLA by itself on CPUs with AMX tiles, and AMX_MLA refuses fp32
    weights ("expect weight to be bfloat16, float16, int8, fp8_e4m3 ..."): named, the stock side
    runs the same kernels on every CPU, and the comparisons' fp32 runs run at all."""
    if "attention_config" in engine_kwargs or "attention_backend" in engine_kwargs:
        return {}
    from atom import envs

    if not (envs.get("ATOM_DISABLE_VLLM_PLUGIN") or envs.get("ATOM_DISABLE_VLLM_PLUGIN_ATTENTION")):
        return {}
    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f)
    if not (config.get("kv_lora_rank") or (config.get("text_config") or {}).get("kv_lora_rank")):
        return {}
    from vllm.platforms import current_platform

    try:
        from vllm.v1.attention.backends.registry import AttentionBackendEnum
    except ImportError:
        return {}
    names = AttentionBackendEnum.__members__
    if not current_platform.is_cpu() or "AMX_MLA" not in names or "CPU_MLA" not in names:
        return {}
    return {"attention_config": {"backend": "CPU_MLA"}}


def run_engine(
    model_dir: str,
    prompts: list[list[int]],
    dtype: str,
    inspect: Optional[Callable[[Any], Any]] = None,
    **engine_kwargs: Any,
) -> dict[str, Any]:
    """Start an engine, generate greedily (``ignore_eos``, NEW_TOKENS tokens, with sampled and
    prompt logprobs), shut it down. A stock run of an MLA checkpoint runs vLLM's CPU_MLA
    (:func:`stock_mla_kwargs`). ``inspect(llm)`` may return extra facts about the engine."""
    from vllm import LLM, SamplingParams

    kwargs = {**ENGINE_KWARGS, **engine_kwargs}
    llm = LLM(model=model_dir, dtype=dtype, **kwargs, **stock_mla_kwargs(model_dir, kwargs))
    try:
        facts = inspect(llm) if inspect is not None else None
        params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=1, prompt_logprobs=1)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        rows = []
        for prompt, out in zip(prompts, outputs):
            completion = out.outputs[0]
            tokens = list(completion.token_ids)
            rows.append({
                "tokens": tokens,
                "logprobs": [_token_logprob(e, t) for e, t in zip(completion.logprobs, tokens)],
                # Teacher-forced: the logprob of each prompt token given the ones before it.
                "prompt_logprobs": [_token_logprob(e, t) for e, t in zip(out.prompt_logprobs[1:], prompt[1:])],
            })
        return {"dtype": dtype, "rows": rows, "facts": facts}
    finally:
        del llm
        gc.collect()
        from vllm.distributed import cleanup_dist_env_and_memory

        cleanup_dist_env_and_memory()


def main(argv: list[str]) -> int:
    model_dir, prompts_path, out_path, *dtypes = argv
    engine_kwargs: dict[str, Any] = {}
    if dtypes[:1] == ["--engine"]:
        engine_kwargs, dtypes = json.loads(dtypes[1]), dtypes[2:]
    for key, value in ENGINE_ENV.items():
        os.environ.setdefault(key, value)
    with open(prompts_path) as f:
        prompts = json.load(f)
    results = [run_engine(model_dir, prompts, dtype, **engine_kwargs) for dtype in dtypes]
    with open(out_path, "w") as f:
        json.dump(results, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
