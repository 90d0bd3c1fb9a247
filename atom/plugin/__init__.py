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
