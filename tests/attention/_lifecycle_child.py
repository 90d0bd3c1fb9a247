"""One process, one side (atom on or off, from the environment): request lifecycles that stress an
attention backend's bookkeeping, reduced to JSON (tests/attention/test_lifecycle_e2e.py).

* preemption: a KV cache of 9 blocks of 32 tokens for 4 requests that need ~16 between them, so
  vLLM preempts (and recomputes) requests mid-decode;
* abort: requests stepped one engine step at a time, one aborted after 3 steps and one after 6,
  the others run to the end (blocks freed and reused by later steps).

    python -m tests.attention._lifecycle_child MODEL_DIR OUT.json
"""

from __future__ import annotations

import gc
import json
import os
import sys

ENGINE = dict(dtype="float32", max_model_len=192, max_num_seqs=8, enforce_eager=True, seed=0,
              gpu_memory_utilization=0.3, block_size=32, enable_prefix_caching=False)


def _prompts(n: int, base: int) -> list[list[int]]:
    return [[(7 * i + j) % 900 + 10 for j in range(base + 5 * i)] for i in range(n)]


def preemption(model: str) -> dict:
    from vllm import LLM, SamplingParams

    llm = LLM(model=model, num_gpu_blocks_override=9, disable_log_stats=False, **ENGINE)
    outs = llm.generate([{"prompt_token_ids": p} for p in _prompts(4, 40)],
                        SamplingParams(max_tokens=60, temperature=0, ignore_eos=True), use_tqdm=False)
    preemptions = next(m.value for m in llm.get_metrics() if m.name == "vllm:num_preemptions")
    result = {"tokens": [list(o.outputs[0].token_ids) for o in outs], "preemptions": preemptions}
    del llm
    gc.collect()
    return result


def abort(model: str) -> dict:
    from vllm import LLM, SamplingParams

    llm = LLM(model=model, **ENGINE)
    engine = llm.llm_engine
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    for i, prompt in enumerate(_prompts(5, 30)):
        engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, params)
    seen: dict[str, list[int]] = {}
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen[out.request_id] = list(out.outputs[0].token_ids)
        steps += 1
        if steps == 3:
            engine.abort_request(["r1"])
        if steps == 6:
            engine.abort_request(["r3"])
            engine.add_request("late", {"prompt_token_ids": _prompts(1, 50)[0]}, params)  # reuses freed blocks
    del llm
    gc.collect()
    return {"tokens": seen}


def main(argv: list[str]) -> int:
    model, out = argv
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    result = {"preemption": preemption(model), "abort": abort(model)}
    with open(out, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
