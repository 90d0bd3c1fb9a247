"""How long the kernel warm-ups at load take: one INFO line per op and layer shape, and the
process totals (:data:`TOTALS`).

A warm-up's time is its kernels' just-in-time compiles (Triton's, or a host GEMM's: DeepGEMM,
FlashInfer) when the caches are cold, and a few launches when they are warm, so these lines
say where a cold start goes (bench/NOTES.md entry 78). On a GPU the device is synchronised
before and after each warm-up, so a line holds its own compiles and launches, not a wait on GPU
work queued before it (entry 79: one shape's line took ~100 s in an engine's cold start, the same
warm-up ~5 s alone).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Optional

from atom._logging import get_logger

#: kernel name -> [warm-ups, launches, seconds] in this process.
TOTALS: dict[str, list] = {}


def _synchronize(device: Any) -> None:
    """Wait for ``device``'s queued work when it is a CUDA (or HIP) device; nothing otherwise."""
    if device is None:
        return
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(kernel: str, shape: str, warm_up: Callable[[], int], device: Optional[Any] = None) -> int:
    """Run ``warm_up`` (returns its launches), log ``kernel``'s time for ``shape`` when it launched
    anything, add it to :data:`TOTALS`, and return the launches. ``device``: the warm-up's device;
    a GPU's queued work is waited for before the clock starts and the warm-up's own before it
    stops."""
    _synchronize(device)
    start = time.perf_counter()
    launches = warm_up()
    _synchronize(device)
    seconds = time.perf_counter() - start
    if launches:
        total = TOTALS.setdefault(kernel, [0, 0, 0.0])
        total[0] += 1
        total[1] += launches
        total[2] += seconds
        get_logger("atom.ops").info("warm-up %s %s: %d launches in %.1f s (%s so far: %.1f s)", kernel, shape, launches,
                                    seconds, kernel, total[2])
    return launches
