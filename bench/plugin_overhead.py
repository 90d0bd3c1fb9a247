"""Cost of atom's two vLLM hooks in one process, excluding vLLM's own import.

    python bench/plugin_overhead.py [--repeat 20]

Imports vLLM first (its cost is not atom's), then times in a fresh interpreter:
``register_platform()`` first call (runs vLLM's device detectors once), second call (cached),
and ``register_model()`` (registry overrides + arming patches). Runs --repeat fresh
interpreters and prints the median and min in milliseconds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

CHILD = r"""
import json, time
import vllm, vllm.platforms, vllm.model_executor.models.registry  # vLLM's own import, not timed
from atom.plugin.vllm.register import register_model, register_platform
t0 = time.perf_counter(); register_platform(); t1 = time.perf_counter()
register_platform(); t2 = time.perf_counter()
register_model(); t3 = time.perf_counter()
print("TIMES " + json.dumps([(t1 - t0) * 1e3, (t2 - t1) * 1e3, (t3 - t2) * 1e3]))
"""


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeat", type=int, default=20)
    args = p.parse_args()
    rows = []
    for _ in range(args.repeat):
        out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, check=True)
        rows.append(json.loads(out.stdout.split("TIMES ", 1)[1]))
    names = ["register_platform() 1st", "register_platform() 2nd", "register_model()", "total"]
    cols = list(zip(*rows))
    cols.append(tuple(sum(r) for r in rows))
    print(f"{args.repeat} fresh interpreters; milliseconds")
    print(f"{'call':<26}{'median':>9}{'min':>9}")
    for name, col in zip(names, cols):
        print(f"{name:<26}{statistics.median(col):>9.2f}{min(col):>9.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
