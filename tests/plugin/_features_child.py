"""One process, one side (atom on or off, from the environment): vLLM engine features whose
support is a property of the model class, on the tiny fp32 Qwen3. ``run`` is called in a fresh
interpreter per side by tests/plugin/test_engine_features.py (plugins load once per process)."""

from __future__ import annotations

import gc

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9] * 7, [(17 * i + 3) % 997 for i in range(40)]]
ENGINE = dict(dtype="float32", max_model_len=256, max_num_seqs=8, gpu_memory_utilization=0.3, seed=0,
              enforce_eager=True)


def _rows(outputs) -> list[dict]:
    rows = []
    for out in outputs:
        completion = out.outputs[0]
        tokens = list(completion.token_ids)
        rows.append({"tokens": tokens, "logprobs": [float(e[t].logprob) for e, t in zip(completion.logprobs, tokens)]})
    return rows


def run(model: str, adapter: str) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.distributed import cleanup_dist_env_and_memory
    from vllm.lora.request import LoRARequest

    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    out = {}
    llm = LLM(model=model, enable_lora=True, max_lora_rank=8, **ENGINE)
    out["lora"] = _rows(llm.generate(prompts, params, lora_request=LoRARequest("tiny", 1, adapter), use_tqdm=False))
    out["lora_base"] = _rows(llm.generate(prompts, params, use_tqdm=False))
    del llm
    gc.collect()
    cleanup_dist_env_and_memory()
    llm = LLM(model=model, speculative_config={"method": "ngram", "num_speculative_tokens": 2,
                                               "prompt_lookup_max": 3, "prompt_lookup_min": 1}, **ENGINE)
    out["ngram"] = _rows(llm.generate(prompts, params, use_tqdm=False))
    out["ngram_model"] = llm.apply_model(lambda m: f"{type(m).__module__}:{type(m).__qualname__}")[0]
    del llm
    gc.collect()
    cleanup_dist_env_and_memory()
    return out
