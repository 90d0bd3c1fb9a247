"""The contract every registry record must satisfy, run in a fresh interpreter per record:

    python -m tests.patch_contract RECORD_ID

Order: revert of a never-imported target is a no-op -> apply arms without importing ->
apply-then-import lands the patch (and an injection's ``base`` resolves) -> apply twice changes nothing (no double wrap) -> revert
restores the identical original objects (effect gone) -> revert twice is a no-op ->
import-then-apply lands at once -> apply-revert-apply -> final revert restores identity.

Prints ``CONTRACT OK <id>`` on success; any failure raises (non-zero exit).
"""

from __future__ import annotations

import importlib
import sys

import wrapt

_MISSING = object()


def _sites(record):
    """(owner, attribute) pairs the record touches, for the modules imported now."""
    from atom.patches.core import _walk
    from atom.patches.records import Patch, split_target

    pairs = []
    if isinstance(record, Patch):
        for target in (record.target, *record.aliases):
            module, path = split_target(target)
            if module in sys.modules:
                owner_path, _, name = path.rpartition(".")
                pairs.append((_walk(sys.modules[module], owner_path), name))
    else:
        module, path = split_target(record.target)
        if module in sys.modules:
            cls = _walk(sys.modules[module], path)
            pairs.extend((cls, m) for m in record.members)
    return pairs


def _snapshot(record):
    return [(owner, name, owner.__dict__.get(name, _MISSING)) for owner, name in _sites(record)]


def run_contract(record_id: str) -> None:
    from atom.plugin import catalog
    from atom.patches import REGISTRY, State, apply, is_applied, revert, status

    catalog.load(include_test_fixtures=True)
    record = REGISTRY.get(record_id)
    assert record.module not in sys.modules, f"{record.module} imported by declaring records"

    # Revert of a never-imported target, and arming, touch nothing and import nothing.
    assert revert(record) is False
    st = apply(record)
    assert st.state is State.ARMED, st
    assert record.module not in sys.modules, "arming imported the target"

    # apply-then-import: the post-import hook lands it.
    importlib.import_module(record.module)
    for alias in getattr(record, "aliases", ()):
        importlib.import_module(alias.partition(":")[0])
    assert is_applied(record), status(record)
    patched = _snapshot(record)
    assert patched, "no binding site found"
    # an injection's host side: the vLLM class whose members it stands in for exists here
    if getattr(record, "base", ""):
        from atom.patches.core import resolve

        assert isinstance(resolve(record.base), type), f"{record.base} is not a class"

    # apply twice: the same installed objects, never a wrapper around our own wrapper.
    apply(record)
    assert _snapshot(record) == patched
    for _owner, _name, obj in patched:
        inner = getattr(obj, "__wrapped__", None)
        assert getattr(inner, "_self_atom_patch", None) != record.id, "double wrap"

    # revert: originals back (effect gone), exactly the same objects.
    assert revert(record) is True
    originals = _snapshot(record)
    for (_, name, before), (_, _, after) in zip(patched, originals):
        assert before is not after, f"revert left {name} patched"
    assert not is_applied(record)

    # revert twice: nothing to do, nothing changes.
    assert revert(record) is False
    assert _snapshot(record) == originals

    # import-then-apply: lands at once; wrappers wrap the exact original.
    st = apply(record)
    assert st.state is State.APPLIED and is_applied(record), st
    again = _snapshot(record)
    for (_, name, orig), (_, _, now) in zip(originals, again):
        assert now is not orig, f"{name} not patched"
        if isinstance(now, wrapt.ObjectProxy) and orig is not _MISSING:
            assert now.__wrapped__ is orig, f"{name} wraps something other than the original"

    # apply-revert-apply, then a final revert restores identity.
    assert revert(record) is True
    assert _snapshot(record) == originals
    assert apply(record).state is State.APPLIED
    assert revert(record) is True
    assert _snapshot(record) == originals, "identity not restored"
    print(f"CONTRACT OK {record_id}")


if __name__ == "__main__":
    run_contract(sys.argv[1])
