"""The contract (tests/patch_contract.py) for every record in the registry: the fixture records
exercise the mechanics on tiny modules; atom's real records run it on their host itself.

A host's records need that host installed (their sources subclass or read its classes): each
runs where its host is -- vLLM's in the main environment, SGLang's in the SGLang environment
(``scripts/test.sh`` runs this file in both) -- and is skipped elsewhere, with the reason."""

import importlib.util
import subprocess
import sys

import pytest

from atom.patches import REGISTRY
from atom.plugin import catalog
from tests.conftest import REPO

catalog.load(include_test_fixtures=True)
RECORD_IDS = [r.id for r in REGISTRY]
INSTALLED_HOSTS = {host for host in ("vllm", "sglang") if importlib.util.find_spec(host) is not None}


def _param(record):
    """A host's own record (its id starts with the host) needs the host installed."""
    host = record.host if record.id.startswith(record.host + ".") else None
    marks = [] if host is None or host in INSTALLED_HOSTS else [pytest.mark.skip(
        reason=f"{host} is not installed in this environment: its records run where it is")]
    return pytest.param(record.id, marks=marks, id=record.id)


def test_registry_has_fixture_and_host_records():
    assert any(i.startswith("fixture.") for i in RECORD_IDS)
    assert any(i.startswith("vllm.") for i in RECORD_IDS), "no real vLLM record in the registry"
    assert any(i.startswith("sglang.") for i in RECORD_IDS), "no real SGLang record in the registry"
    assert INSTALLED_HOSTS, "neither host is installed: no real record runs its contract"


@pytest.mark.parametrize("record_id", [_param(r) for r in REGISTRY])
def test_contract(record_id):
    proc = subprocess.run(
        [sys.executable, "-m", "tests.patch_contract", record_id],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert f"CONTRACT OK {record_id}" in proc.stdout
