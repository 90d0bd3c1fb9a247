"""Run real SGLang CPU engines (one per tiny model) and print their greedy tokens as JSON.

    python -m tests.sglang._engine_runner [--tp N] BACKEND MODEL_DIR [MODEL_DIR ...]

One line ``RESULT {"model": dir, "batches": [[tokens per prompt], ...]}`` per model; the caller
sets the environment (``ATOM_DISABLE_SGLANG_PLUGIN`` ...) and ``PYTHONPATH`` (the test-only
stand-ins). The prompts are :data:`PROMPTS` then :data:`FOLLOW_UP` (submitted after the first
batch so it extends a cached prefix of the first batch's longest prompt).
"""

from __future__ import annotations

import json
import sys

#: Token ids (the tiny vocabulary has 1000): lengths 5, 21 and 40 in one batch -- the longer two
#: past one 16-token page -- each decoding 24 tokens across page boundaries.
PROMPTS = [
    [1, 2, 3, 4, 5],
    [7, 8, 9] * 7,
    [(17 * i + 3) % 997 for i in range(40)],
]
#: The third prompt plus 7 tokens: with SGLang's radix cache its first 32 tokens (two pages) are
#: a cache hit, so this is an extend over a cached prefix.
FOLLOW_UP = [PROMPTS[2] + [11, 12, 13, 14, 15, 16, 17]]
MAX_NEW_TOKENS = 24
PAGE_SIZE = 16


def run(backend: str, model_dirs: list[str], tp_size: int = 1) -> None:
    import sglang

    for model_dir in model_dirs:
        engine = sglang.Engine(
            model_path=model_dir, device="cpu", attention_backend=backend, dtype="float32",
            page_size=PAGE_SIZE, max_total_tokens=2048, mem_fraction_static=0.1, disable_cuda_graph=True,
            sampling_backend="pytorch", skip_server_warmup=True, log_level="info", random_seed=0, tp_size=tp_size)
        try:
            params = {"temperature": 0.0, "max_new_tokens": MAX_NEW_TOKENS, "ignore_eos": True}
            batches = []
            for prompts in (PROMPTS, FOLLOW_UP):
                outs = engine.generate(input_ids=prompts, sampling_params=params)
                batches.append([out["output_ids"] for out in outs])
        finally:
            engine.shutdown()
        print("RESULT " + json.dumps({"model": model_dir, "batches": batches}), flush=True)


if __name__ == "__main__":
    argv = sys.argv[1:]
    tp = 1
    if argv[:1] == ["--tp"]:
        tp, argv = int(argv[1]), argv[2:]
    run(argv[0], argv[1:], tp)
