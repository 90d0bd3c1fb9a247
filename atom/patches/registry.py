"""The registry: every patch/injection record atom declares, by id, in declaration order.

The registry is the single source of truth for ``python -m atom patches``, ``docs/patches.md``
and the contract tests. Declaring a record (``register``) does nothing else: nothing is applied
and nothing is imported.
"""

from __future__ import annotations

from typing import Iterator

from atom.patches.core import status
from atom.patches.records import Injection, Patch, Record
from atom.patches.signatures import accepted

__all__ = ["Registry", "REGISTRY", "register", "listing"]


class Registry:
    def __init__(self) -> None:
        self._records: dict[str, Record] = {}

    def add(self, record: Record) -> Record:
        existing = self._records.get(record.id)
        if existing is not None and existing != record:
            raise ValueError(f"a different record with id {record.id!r} is already registered")
        self._records[record.id] = record
        return record

    def get(self, record_id: str) -> Record:
        try:
            return self._records[record_id]
        except KeyError:
            raise KeyError(f"no patch or injection with id {record_id!r}; known: {sorted(self._records)}") from None

    def __iter__(self) -> Iterator[Record]:
        return iter(list(self._records.values()))

    def __len__(self) -> int:
        return len(self._records)

    def __contains__(self, record_id: object) -> bool:
        return record_id in self._records

    def select(self, group: str) -> tuple[Record, ...]:
        """The records of ``group`` and of its sub-groups (``"vllm"`` selects
        ``"vllm.attention.mha"``), in declaration order."""
        return tuple(r for r in self._records.values()
                     if r.group == group or r.group.startswith(group + "."))


REGISTRY = Registry()


def register(record: Record) -> Record:
    """Declare ``record`` in the global registry and return it (nothing is applied)."""
    return REGISTRY.add(record)


def _callable_name(ref: object) -> str:
    if ref is None:
        return ""
    if isinstance(ref, str):
        return ref
    return f"{getattr(ref, '__module__', '?')}:{getattr(ref, '__qualname__', repr(ref))}"


def listing(registry: Registry = REGISTRY) -> list[dict[str, str]]:
    """One row per record: its declaration and its state now (for the CLI and the docs)."""
    rows = []
    for rec in registry:
        st = status(rec)
        row = {
            "id": rec.id,
            "kind": rec.kind,
            "target": rec.target,
            "vllm": rec.vllm or "any",
            "host": rec.host,
            "sglang": rec.sglang or "any",
            "toggle": rec.toggle,
            "state": st.state.value,
            "detail": st.detail,
            "reason": rec.reason,
            "upstream": rec.upstream,
            "removal": rec.removal,
            "group": rec.group,
        }
        if isinstance(rec, Patch):
            row["how"] = "wrap" if rec.wrapper is not None else "replace"
            row["with"] = _callable_name(rec.wrapper or rec.replacement)
            row["members"] = rec.target.rpartition(".")[2] if "." in rec.target.partition(":")[2] else rec.target.partition(":")[2]
            row["signature"] = " or ".join(accepted(rec.signature)) if rec.signature else ""
            for target, expected in rec.guards:
                row["signature"] += f"; {target.partition(':')[2]}{' or '.join(accepted(expected))}"
            row["aliases"] = ", ".join(rec.aliases)
        else:
            assert isinstance(rec, Injection)
            row["how"] = "inject"
            row["with"] = _callable_name(rec.source)
            row["members"] = ", ".join(rec.members)
            row["signature"] = "; ".join(f"{m}{' or '.join(accepted(s))}" for m, s in rec.signatures)
            row["aliases"] = ""
        rows.append(row)
    return rows
