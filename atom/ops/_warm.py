"""How long the kernel warm-ups at load take: one INFO line per op and layer shape, and the
process totals (:data:`TOTALS`).

A warm-up's time is its kernels' just-in-time compiles (Triton's, or a host GEMM's: DeepGEMM,
FlashInfer) when the caches are cold, and a few launches when they are warm, so these lines
say where a cold start goes (bench/NOTES.md entry 78). Host time: the launches are not waited
for (they are short next to a compile).
"""

from __future__ import annotations

import time
from typing import Callable

from atom._logging import get_logger

#: kernel name -> [warm-ups, launches, seconds] in this process.
TOTALS: dict[str, list] = {}


def timed(kernel: str, shape: str, warm_up: Callable[[], int]) -> int:
    """Run ``warm_up`` (returns its launches), log ``kernel``'s time for ``shape`` when it launched
    anything, add it to :data:`TOTALS`, and return the launches."""
    start = time.perf_counter()
    launches = warm_up()
    seconds = time.perf_counter() - start
    if launches:
        total = TOTALS.setdefault(kernel, [0, 0, 0.0])
        total[0] += 1
        total[1] += launches
        total[2] += seconds
        get_logger("atom.ops").info("warm-up %s %s: %d launches in %.1f s (%s so far: %.1f s)", kernel, shape, launches,
                                    seconds, kernel, total[2])
    return launches
