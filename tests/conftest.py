"""Shared fixtures: tiny random checkpoints (built once per test run) and real vLLM engines.

Set before anything imports triton or vLLM:
* TRITON_INTERPRET=1 when there is no GPU, so atom's Triton kernels run on CPU tensors;
* offline hub, no usage stats, a 1 GiB CPU KV cache.
"""

from __future__ import annotations

import gc
import glob
import os
import subprocess
import sys
import textwrap
from pathlib import Path

_HAS_GPU = bool(glob.glob("/dev/nvidia[0-9]*") or os.path.exists("/dev/kfd"))
if not _HAS_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")
for key, value in {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}.items():
    os.environ.setdefault(key, value)

import pytest  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


def pytest_collection_modifyitems(config, items):
    if _HAS_GPU:
        return
    skip = pytest.mark.skip(reason="needs a CUDA/ROCm GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """``tiny_model(kind, dtype="bfloat16") -> Path``: a tiny random checkpoint, built once per run."""
    from atom.testing.tiny_models import build

    root = tmp_path_factory.mktemp("tiny-models")
    built: dict[tuple[str, str], Path] = {}

    def get(kind: str, dtype: str = "bfloat16") -> Path:
        key = (kind, dtype)
        if key not in built:
            built[key] = build(kind, root / f"{kind}-{dtype}", dtype=dtype)
        return built[key]

    return get


ENGINE_DEFAULTS = dict(
    max_model_len=256, max_num_seqs=8, enforce_eager=True, seed=0, gpu_memory_utilization=0.3,
)


@pytest.fixture(scope="module")
def vllm_engine():
    """``vllm_engine(model_path, **llm_kwargs) -> vllm.LLM`` in-process (fast: ~3 s), torn down
    at the end of the module. Plugins are loaded once per process, so the environment that
    decides atom on/off must be set before the first engine; use ``run_python`` to compare."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    engines = []

    def make(model_path, **kwargs):
        from vllm import LLM

        llm = LLM(model=str(model_path), **{**ENGINE_DEFAULTS, **kwargs})
        engines.append(llm)
        return llm

    yield make
    for llm in engines:
        del llm
    engines.clear()
    gc.collect()
    try:
        from vllm.distributed import cleanup_dist_env_and_memory

        cleanup_dist_env_and_memory()
    except Exception:
        pass


def run_python(code: str, env: dict[str, str] | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter (own plugin state), from the repo root."""
    full_env = {**os.environ, **(env or {})}
    for key, value in (env or {}).items():
        if value is None:
            full_env.pop(key, None)
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], cwd=REPO, env=full_env,
        capture_output=True, text=True, timeout=timeout,
    )


@pytest.fixture
def python_subprocess():
    return run_python
