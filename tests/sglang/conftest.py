"""The SGLang tests run where SGLang is installed: the cached environment of
``scripts/ensure_env.sh --sglang``, which ``scripts/test.sh`` runs them in after the vLLM suite.
In the vLLM environment (no SGLang) they are skipped, said so in each test's skip reason.

Engines run in subprocesses with the test-only stand-ins (``stand_ins/``) on ``PYTHONPATH``,
SGLang's CPU engine switched on and Triton's interpreter for the Triton kernels SGLang (its
paged allocator) and atom run on CPU tensors.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

HAS_SGLANG = importlib.util.find_spec("sglang") is not None
STAND_INS = Path(__file__).resolve().parent / "stand_ins"

collect_ignore_glob = ["stand_ins/*"]

if HAS_SGLANG and str(STAND_INS) not in sys.path:
    # In-process tests import SGLang's classes too (scripts/test.sh also sets PYTHONPATH).
    sys.path.insert(0, str(STAND_INS))
    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")


def pytest_collection_modifyitems(config, items):
    if HAS_SGLANG:
        return
    skip = pytest.mark.skip(reason="SGLang is not installed here: these run in the SGLang environment "
                                   "(scripts/ensure_env.sh --sglang), which scripts/test.sh runs them in")
    for item in items:
        if Path(str(item.fspath)).is_relative_to(Path(__file__).parent):
            item.add_marker(skip)


def sglang_env(**overrides: str) -> dict[str, str]:
    """The environment of an SGLang subprocess: stand-ins first on PYTHONPATH, the checkout
    next, SGLang's CPU engine on, atom on on CPU (ATOM_ENABLE_ON_CPU=1), no other ATOM_*
    switch unless given."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ATOM_")}
    env.update(SGLANG_USE_CPU_ENGINE="1", TRITON_INTERPRET="1", ATOM_ENABLE_ON_CPU="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=os.pathsep.join([str(STAND_INS), str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    env.update(overrides)
    return env


def run_engines(backend: str, model_dirs: list[Path], tp: int = 1, **env: str) -> tuple[dict[str, list], str]:
    """({model dir: batches of greedy tokens}, stderr) of one runner subprocess; ``tp`` ranks (one
    CPU core each)."""
    if tp > 1:
        cpus = sorted(os.sched_getaffinity(0))
        if len(cpus) < tp:
            pytest.skip(f"needs {tp} CPUs for {tp} SGLang TP ranks")
        env = {"SGLANG_CPU_OMP_THREADS_BIND": "|".join(map(str, cpus[:tp])), **env}
    proc = subprocess.run(
        [sys.executable, "-m", "tests.sglang._engine_runner", "--tp", str(tp), backend, *map(str, model_dirs)],
        cwd=REPO, env=sglang_env(**env), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-8000:]
    results = {}
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            row = json.loads(line[len("RESULT "):])
            results[row["model"]] = row["batches"]
    assert len(results) == len(model_dirs), proc.stdout[-3000:] + proc.stderr[-3000:]
    return results, proc.stderr
