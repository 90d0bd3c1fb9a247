"""tests/ops: atom's kernels against their torch references.

Small odd-shaped cases run everywhere: on CUDA when ``torch.cuda.is_available()`` (real Triton
kernels), else on CPU through the Triton interpreter (``TRITON_INTERPRET=1``, set here too in
case the root conftest did not, before any atom kernel module is imported). Real-size cases
are marked ``gpu`` and skipped without CUDA.
"""

from __future__ import annotations

import os
import zlib
from pathlib import Path

import pytest
import torch

_HAS_CUDA = torch.cuda.is_available()
if not _HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

_HERE = Path(__file__).resolve().parent


def pytest_configure(config: pytest.Config) -> None:
    # Registered here as well as in pyproject.toml so --strict-markers holds in any invocation.
    config.addinivalue_line("markers", "gpu: needs a CUDA/ROCm GPU (skipped on CPU)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs CUDA (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords and _HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed_per_case(request: pytest.FixtureRequest) -> None:
    """Fresh but reproducible random inputs: every test case gets its own seed."""
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))
