"""The main job: build a tiny Qwen3 locally, run it through real vLLM with atom active, run it
again with ATOM_DISABLE_VLLM_PLUGIN=1, print what atom activated and compare greedy outputs.

    bash scripts/main.sh [--out DIR] [--kind qwen3]

Each run is a fresh process (plugins are loaded once per process). fp32, greedy, so the two
must produce identical tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

PROMPTS = [
    "def fibonacci(n):",
    "The quick brown fox",
    "import torch\nimport numpy as np\n\nclass Model:",
]

CHILD = r"""
import json, os, sys
if __name__ == "__main__":
    from vllm import LLM, SamplingParams
    llm = LLM(model=sys.argv[1], max_model_len=256, max_num_seqs=4, enforce_eager=True,
              dtype="float32", seed=0, gpu_memory_utilization=0.3)
    outs = llm.generate(json.loads(sys.argv[2]), SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    from vllm.platforms import current_platform
    from vllm import ModelRegistry
    arch = "Qwen3ForCausalLM"
    m = ModelRegistry.models.get(arch)
    report = {
        "platform": type(current_platform).__module__ + "." + type(current_platform).__qualname__,
        "model_impl": f"{getattr(m, 'module_name', '?')}:{getattr(m, 'class_name', '?')}",
        "outputs": [{"text": o.outputs[0].text, "tokens": list(o.outputs[0].token_ids)} for o in outs],
    }
    try:
        from atom.patches import status
        from atom.plugin.vllm.patches import VLLM_RECORDS
        report["patches"] = {r.id: str(status(r)) for r in VLLM_RECORDS}
    except Exception as exc:
        report["patches"] = {"error": repr(exc)}
    print("REPORT " + json.dumps(report))
"""


def run(model: Path, disable: bool) -> tuple[dict, list[str], float]:
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1")
    if disable:
        env["ATOM_DISABLE_VLLM_PLUGIN"] = "1"
    else:
        env.pop("ATOM_DISABLE_VLLM_PLUGIN", None)
    start = time.time()
    proc = subprocess.run([sys.executable, "-c", CHILD, str(model), json.dumps(PROMPTS)],
                          env=env, capture_output=True, text=True)
    elapsed = time.time() - start
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-6000:])
        raise SystemExit(f"vLLM run failed (atom {'off' if disable else 'on'})")
    report = json.loads(proc.stdout.split("REPORT ", 1)[1].splitlines()[0])
    atom_lines = [line.split("[atom] ", 1)[1] for line in proc.stderr.splitlines() if "[atom] " in line]
    return report, atom_lines, elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.path.join(os.path.expanduser("~"), ".cache", "atom-demo"))
    parser.add_argument("--kind", default="qwen3")
    args = parser.parse_args()

    from atom.testing.tiny_models import build

    print(f"[1/3] building a tiny random {args.kind} checkpoint + tokenizer in {args.out} ...", flush=True)
    model = build(args.kind, Path(args.out) / f"tiny-{args.kind}-fp32", dtype="float32")

    print("[2/3] vLLM with atom (default: atom active) ...", flush=True)
    on, lines, t_on = run(model, disable=False)
    print(f"      done in {t_on:.1f} s; what atom did:")
    for line in lines:
        print(f"        atom: {line}")
    print(f"        platform:   {on['platform']}")
    print(f"        model impl: {on['model_impl']}")
    for pid, st in on["patches"].items():
        print(f"        patch {pid}: {st}")

    print("[3/3] vLLM with ATOM_DISABLE_VLLM_PLUGIN=1 (stock vLLM) ...", flush=True)
    off, _, t_off = run(model, disable=True)
    print(f"      done in {t_off:.1f} s; platform {off['platform']}, model impl {off['model_impl']}")

    same = 0
    for prompt, a, b in zip(PROMPTS, on["outputs"], off["outputs"]):
        match = a["tokens"] == b["tokens"]
        same += match
        print(f"\nprompt: {prompt!r}\n  atom : {a['text']!r}\n  stock: {b['text']!r}\n  {'MATCH' if match else 'MISMATCH'}")
    print(f"\n{same}/{len(PROMPTS)} prompts give identical greedy tokens (fp32) with atom on and off")
    return 0 if same == len(PROMPTS) else 1


if __name__ == "__main__":
    sys.exit(main())
