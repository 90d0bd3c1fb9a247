"""atom's seam to host frameworks: the one architecture table (``models``), the catalog of
records (``catalog``) and one package per host (``vllm``, ``sglang``). Only ``atom.plugin.<host>``
knows a host's classes; nothing here imports one.
"""

from __future__ import annotations

from typing import Any, NamedTuple


class Decision(NamedTuple):
    """An answer with its reason, shared by the code that acts on it, the log line and
    ``python -m atom doctor``; ``warn`` when a user should see it as a warning (an untested or
    unsupported vLLM, no supported device) rather than as information."""

    value: Any
    reason: str
    warn: bool = False


def overrides_on(on_cpu: bool) -> Decision:
    """Decision(use atom's models and attention backend?, reason), the same under every host: off
    on CPU unless ATOM_ENABLE_ON_CPU=1, because there atom's kernels are the torch reference (a
    correctness path), slower than the host's own; on elsewhere."""
    from atom import envs

    if not on_cpu:
        return Decision(True, "on")
    if envs.ATOM_ENABLE_ON_CPU:
        return Decision(True, "on (ATOM_ENABLE_ON_CPU=1)")
    return Decision(False, "off on CPU: atom has no fast path there (its CPU kernels are the torch reference); "
                           "set ATOM_ENABLE_ON_CPU=1 to use atom's models and attention anyway")
