"""Shared fixtures: tiny random checkpoints (built once per test run) and real vLLM engines.

Set before anything imports triton or vLLM:
* TRITON_INTERPRET=1 when there is no GPU, so atom's Triton kernels run on CPU tensors;
* offline hub, no usage stats, a 1 GiB CPU KV cache.
"""

from __future__ import annotations

import contextlib
import gc
import glob
import json
import os
import re
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
    # atom's overrides are off on CPU by default (no fast path there); the tests exercise them.
    # Tests of that default unset it in their own subprocess.
    "ATOM_ENABLE_ON_CPU": "1",
    # atom's MHA backend steps aside on NVIDIA GPUs by default (measured slower there); the tests
    # exercise it on every device. Tests of that default set it to 0 (tests/attention/test_nvidia_default.py).
    "ATOM_ENABLE_MHA_ON_NVIDIA": "1",
    # likewise atom's models where their table entry steps aside on NVIDIA GPUs (``nvidia_aside``:
    # the dense Qwen3); tests of that default set it to "" (tests/attention/test_nvidia_default.py).
    "ATOM_ENABLE_ON_NVIDIA": "*",
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


#: What decides how a later test's engine runs: atom's switches and vLLM's engine mode, plugin
#: selection, target device and cache size (vLLM itself writes many other variables when it
#: starts an engine in this process: thread counts, ranks, library paths; those are not tests').
_WATCHED_ENV = re.compile(r"^(ATOM_.*|VLLM_ENABLE_V1_MULTIPROCESSING|VLLM_PLUGINS|VLLM_TARGET_DEVICE|"
                          r"VLLM_CPU_KVCACHE_SPACE|TRITON_INTERPRET|HF_HUB_OFFLINE|CUDA_VISIBLE_DEVICES)$")


@pytest.fixture(scope="module", autouse=True)
def environment_unchanged():
    """No test module leaves these variables changed: the next module's results must not depend
    on the order the modules ran in."""
    before = dict(os.environ)
    yield
    changed = sorted(k for k in set(before) | set(os.environ)
                     if _WATCHED_ENV.match(k) and before.get(k) != os.environ.get(k))
    assert not changed, f"environment changed by this module: {changed}"


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
    decides atom on/off must be set before the first engine; use ``run_python`` to compare.
    In-process engines need ``VLLM_ENABLE_V1_MULTIPROCESSING=0``: set for the module, then put
    back as it was (later tests' engine mode must not depend on test order)."""
    before = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
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
    if before is None:
        os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    else:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = before


@contextlib.contextmanager
def record_applied(record_id: str):
    """Apply atom's record ``record_id`` (forced) for the block, and revert it afterwards only if it
    was not applied before: an in-process engine built earlier may hold classes the record
    completes (vLLM caches its attention-backend choice per process), and a later engine in the
    same process would otherwise get them without the injected methods."""
    from atom.patches import apply

    with records_as_found(record_id) as (record,):
        apply(record, enabled=True)
        yield record


@contextlib.contextmanager
def records_as_found(*record_ids: str):
    """Leave atom's records ``record_ids`` as the block found them (applied ones applied again,
    forced; the others reverted), whatever the block applied or reverted: engines built later in
    the same process rely on classes the records complete (see :func:`record_applied`)."""
    from atom.patches import REGISTRY, apply, is_applied, revert
    from atom.plugin import catalog

    catalog.load()
    records = [REGISTRY.get(r) for r in record_ids]
    before = {record.id for record in records if is_applied(record)}
    try:
        yield records
    finally:
        for record in records:
            if record.id in before:
                apply(record, enabled=True)
            else:
                revert(record)


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


def run_main(module: str, args: list[str], env: dict[str, str] | None = None,
             timeout: float = 600) -> subprocess.CompletedProcess:
    """``module``'s ``main(args)`` in a fresh interpreter (:func:`run_python`): the test runners'
    child-engine call (plugins read the environment once per process)."""
    return run_python(f"import sys\nfrom {module} import main\nsys.exit(main({[str(a) for a in args]!r}))\n",
                      env=env, timeout=timeout)


def run_main_json(module: str, args: list, out: Path, env: dict[str, str]) -> tuple[dict, str]:
    """:func:`run_main`, which must succeed, then (the JSON the child wrote to ``out``, its stderr,
    where atom's log lines are)."""
    proc = run_main(module, args, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(Path(out).read_text()), proc.stderr


@pytest.fixture
def python_subprocess():
    return run_python
