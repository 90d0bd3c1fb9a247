"""The contract (tests/patch_contract.py) for every record in the registry: the fixture records
exercise the mechanics on tiny modules; atom's real vLLM records run it on vLLM itself."""

import subprocess
import sys

import pytest

from atom.patches import REGISTRY
from atom.plugin import catalog
from tests.conftest import REPO

catalog.load(include_test_fixtures=True)
RECORD_IDS = [r.id for r in REGISTRY]


def test_registry_has_fixture_and_vllm_records():
    assert any(i.startswith("fixture.") for i in RECORD_IDS)
    assert any(i.startswith("vllm.") for i in RECORD_IDS), "no real vLLM record in the registry"


@pytest.mark.parametrize("record_id", RECORD_IDS)
def test_contract(record_id):
    proc = subprocess.run(
        [sys.executable, "-m", "tests.patch_contract", record_id],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert f"CONTRACT OK {record_id}" in proc.stdout
