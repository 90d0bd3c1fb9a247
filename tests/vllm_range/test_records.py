"""Both ends of the supported vLLM range, at the level every record needs: the environment holds
the release, atom's version check accepts it, every ``vllm`` record passes the toolkit contract
there (its target imports, its signature guards pass against the real classes, an injection's
vLLM base exists; it applies, reverts and re-applies cleanly), and the version-fact and attention
unit tests pass against that release.

On 0.33 (the CUDA wheel, no GPU here) vLLM resolves no platform by itself; the unit tests run
with ``VLLM_TARGET_DEVICE=cpu`` so that vLLM's own CPU platform class answers the config and
selector code they exercise (no kernel runs: the wheel has no CPU kernels). The contract runs
without it, as a user's process on this machine would.
"""

from __future__ import annotations

import json
import re

import pytest

from atom.patches import REGISTRY
from atom.plugin import catalog
from tests.vllm_range.conftest import RELEASES, run_in

pytestmark = [pytest.mark.vllm_range, pytest.mark.timeout(1800)]

catalog.load()
RECORD_IDS = [r.id for r in REGISTRY.select("vllm")]

#: engine-free test modules that check atom's version facts and attention bindings against the
#: installed vLLM (each compat difference has its test in test_compat.py)
UNIT_MODULES = ["tests/plugin/test_compat.py", "tests/attention/test_decorators.py",
                "tests/attention/test_mla_patch.py", "tests/attention/test_backend.py",
                "tests/attention/test_mla_backend.py"]
UNIT_ENV = {"0.26": {}, "0.33": {"VLLM_TARGET_DEVICE": "cpu"}}


@pytest.mark.parametrize("release", RELEASES)
def test_environment_holds_the_release_and_atom_accepts_it(range_python, release):
    """``python -m atom doctor --json`` there: the release, supported; on 0.26 atom's CPU platform
    activates, on 0.33 vLLM has no platform on this machine (no GPU), so atom stays off."""
    dist, version = RELEASES[release]
    proc = run_in(range_python(release), ["-m", "atom", "doctor", "--json"])
    assert proc.returncode in (0, 1), proc.stderr[-3000:]
    report = json.loads(proc.stdout)  # stdout is the JSON alone, whatever vLLM logs
    assert report["versions"]["vllm"] == f"{version} ({dist})"
    assert report["vllm_supported"] == {"ok": True, "why": f"vLLM {version} is supported (>=0.26,<0.34)"}
    if release == "0.26":
        assert report["active"] and report["platform"]["with_atom"] == "atom.plugin.vllm.platform_cpu.ATOMCpuPlatform"
    else:
        assert not report["active"] and report["device"] is None
        assert report["reason"] == "no supported device (vLLM would use no platform)"


def test_every_vllm_record_is_checked():
    assert len(RECORD_IDS) >= 13 and {r.id for r in REGISTRY} >= set(RECORD_IDS)


@pytest.mark.parametrize("record_id", RECORD_IDS)
@pytest.mark.parametrize("release", RELEASES)
def test_contract(range_python, release, record_id):
    proc = run_in(range_python(release), ["-m", "tests.patch_contract", record_id], timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]
    assert f"CONTRACT OK {record_id}" in proc.stdout


@pytest.mark.parametrize("release", RELEASES)
def test_version_facts_and_attention_bindings(range_python, release):
    proc = run_in(range_python(release), ["-m", "pytest", "-p", "no:cacheprovider", "-q", "-rs", *UNIT_MODULES],
                  env=UNIT_ENV[release], timeout=1200)
    assert proc.returncode == 0, proc.stdout[-8000:] + proc.stderr[-2000:]
    skipped = [line for line in proc.stdout.splitlines() if line.startswith("SKIPPED")]
    assert all("needs a CUDA/ROCm GPU" in line for line in skipped), skipped
    assert re.search(r"^\d+ passed", proc.stdout.splitlines()[-1]), proc.stdout[-2000:]
