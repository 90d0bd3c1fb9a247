"""Where atom's patch/injection records are declared: importing these modules registers them.

Declaring a record imports nothing of vLLM or SGLang, so loading the catalog is cheap and safe anywhere
(``python -m atom patches``, docs generation, the contract tests).
"""

from __future__ import annotations

import importlib

#: Modules that declare records at import (each must import neither vLLM nor torch).
CATALOG_MODULES = ("atom.plugin.vllm.records", "atom.plugin.sglang.records")


def load(include_test_fixtures: bool = False) -> None:
    for name in CATALOG_MODULES:
        importlib.import_module(name)
    if include_test_fixtures:
        importlib.import_module("tests.fixtures.patch_catalog")


def group_blocked(group: str) -> "str | None":
    """Apply every record of ``group`` (importing each target: idempotent, environment
    permitting); why one is not in effect, or None. What a host asks before handing atom's
    attention backend of a kind to its framework (the backend is half-bound otherwise)."""
    from atom.patches import REGISTRY, Injection, State, apply

    load()
    for record in REGISTRY.select(group):
        importlib.import_module(record.module)
        st = apply(record)
        if st.state is not State.APPLIED:
            return f"{'decorator' if isinstance(record, Injection) else 'patch'} {record.id} is {st}"
    return None
