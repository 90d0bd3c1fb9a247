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

# Small token budget so the long prompts are chunked and steps mix prefill chunks with decodes.
ENGINE_KWARGS = dict(
    dtype="float32", enforce_eager=True, max_model_len=256, max_num_seqs=8, seed=0,
    gpu_memory_utilization=0.3, enable_chunked_prefill=True, max_num_batched_tokens=32,
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


def run(model_dir: str, prompts: list[list[int]]) -> dict[str, Any]:
    from vllm import LLM, SamplingParams

    llm = LLM(model=model_dir, **ENGINE_KWARGS)
    try:
        impls = attention_impls(llm)
        params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=1)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        rows = []
        for out in outputs:
            c = out.outputs[0]
            rows.append({
                "tokens": list(c.token_ids),
                "logprobs": [float(e[t].logprob) for e, t in zip(c.logprobs, c.token_ids)],
            })
        return {"impls": impls, "rows": rows}
    finally:
        del llm
        gc.collect()
        from vllm.distributed import cleanup_dist_env_and_memory

        cleanup_dist_env_and_memory()


def main(argv: list[str]) -> int:
    model_dir, prompts_path, out_path = argv
    for key, value in ENGINE_ENV.items():
        os.environ.setdefault(key, value)
    with open(prompts_path) as f:
        prompts = json.load(f)
    with open(out_path, "w") as f:
        json.dump(run(model_dir, prompts), f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
