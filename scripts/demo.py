"""The main job: build a tiny Qwen3 locally, serve it with `vllm serve` with atom active, send
requests over HTTP, then do the same with ATOM_DISABLE_VLLM_PLUGIN=1 and compare the answers.

    bash scripts/main.sh [--out DIR] [--quiet]

Greedy decoding in fp32: the answers with atom on and off must be identical.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

PROMPTS = [
    "def fibonacci(n):",
    "The quick brown fox",
    "import torch\nimport numpy as np\n\nclass Model:",
]
CHAT = [{"role": "user", "content": "What does atom do for vLLM?"}]


def ask(srv) -> list[str]:
    answers = []
    for prompt in PROMPTS:
        status, body = srv.post("/v1/completions", {
            "model": srv.model, "prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True})
        assert status == 200, body
        answers.append(body["choices"][0]["text"])
    status, body = srv.post("/v1/chat/completions", {
        "model": srv.model, "messages": CHAT, "max_tokens": 24, "temperature": 0, "ignore_eos": True})
    assert status == 200, body
    answers.append(body["choices"][0]["message"]["content"])
    return answers


def run(model: Path, atom: bool, quiet: bool) -> tuple[list[str], list[str], float]:
    from atom.testing.server import serve

    # On CPU atom's overrides are off by default (no fast path there): the demo asks for them.
    env = {"ATOM_DISABLE_VLLM_PLUGIN": "0", "ATOM_ENABLE_ON_CPU": "1"} if atom else {"ATOM_DISABLE_VLLM_PLUGIN": "1"}
    echo = None if quiet else (lambda line: print(f"   | {line[:160]}", flush=True))
    start = time.time()
    with serve(model, env=env, echo=echo) as srv:
        startup = time.time() - start
        print(f"   server healthy after {startup:.0f} s at {srv.base_url}; sending {len(PROMPTS) + 1} requests", flush=True)
        answers = ask(srv)
        atom_lines = [l.split("[atom] ", 1)[1] for l in srv.log().splitlines() if "[atom] " in l]
    return answers, atom_lines, startup


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.path.join(os.path.expanduser("~"), ".cache", "atom-demo"))
    parser.add_argument("--quiet", action="store_true", help="don't echo vLLM's start-up log")
    args = parser.parse_args()

    from atom.testing.tiny_models import build

    print(f"[1/3] building a tiny random Qwen3 checkpoint + tokenizer in {args.out} ...", flush=True)
    model = build("qwen3", Path(args.out) / "tiny-qwen3-fp32", dtype="float32")

    print("[2/3] vllm serve with atom installed (ATOM_ENABLE_ON_CPU=1: on a CPU atom's models and "
          "attention are off unless asked for) ...", flush=True)
    on, lines, _ = run(model, atom=True, quiet=args.quiet)
    print("   atom activation, from the server's log (every process logs its own):")
    for line in dict.fromkeys(lines):  # each process repeats them; show each once
        print(f"     atom: {line}")

    print("[3/3] vllm serve with ATOM_DISABLE_VLLM_PLUGIN=1 (stock vLLM) ...", flush=True)
    off, off_lines, _ = run(model, atom=False, quiet=True)
    print(f"   atom lines in the stock server's log: {len(set(off_lines))} "
          f"({'; '.join(dict.fromkeys(off_lines)) or 'none'})")

    same = 0
    for prompt, a, b in zip(PROMPTS + ["chat: " + CHAT[0]["content"]], on, off):
        same += a == b
        print(f"\nrequest: {prompt!r}\n  atom : {a!r}\n  stock: {b!r}\n  {'MATCH' if a == b else 'MISMATCH'}")
    total = len(PROMPTS) + 1
    print(f"\n{same}/{total} answers identical (greedy, fp32) with atom on and off")
    return 0 if same == total else 1


if __name__ == "__main__":
    sys.exit(main())
