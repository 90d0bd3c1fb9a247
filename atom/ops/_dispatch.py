"""One dispatcher for every atom op: AITER -> Triton -> torch, chosen per call by device and dtype.

An op is declared once with :class:`Op` and up to three implementations that take the same
arguments. ``Op.__call__`` picks the backend:

1. forced by ``ATOM_OPS_BACKEND`` (per-op ``op=backend`` wins over a global value); a forced
   backend that cannot run here raises :class:`BackendUnavailable` (an explicit request that
   cannot be met is an error, never a silent fallback);
2. otherwise ``auto``: AITER on ROCm when ``aiter`` imports and the op has a binding, Triton on
   CUDA/ROCm tensors, the torch reference everywhere else (CPU).

Each implementation may come with a ``supports(*args, **kwargs) -> str | None`` predicate that
returns ``None`` when it can run these arguments, or the reason it cannot (``auto`` then moves
down the chain; a forced backend raises with that reason).

``Op.backend_for(...)`` answers which backend a call would use and why, without running it
(``python -m atom doctor`` prints it). This module never imports vLLM.
"""

from __future__ import annotations

import functools
import importlib.util
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from atom import envs

BACKENDS = ("aiter", "triton", "torch")

Impl = Callable[..., Any]
Supports = Callable[..., Optional[str]]


class BackendUnavailable(RuntimeError):
    """A backend was forced (ATOM_OPS_BACKEND) for an op that cannot run on it here."""


@functools.lru_cache(maxsize=None)
def aiter_available() -> bool:
    """True on ROCm builds of torch where ``aiter`` is installed (import is deferred to the call)."""
    return getattr(torch.version, "hip", None) is not None and importlib.util.find_spec("aiter") is not None


@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def triton_interpreting() -> bool:
    """TRITON_INTERPRET=1: Triton kernels run on CPU tensors (tests only; slow)."""
    import os

    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _first_tensor(args: tuple, kwargs: dict) -> Optional[torch.Tensor]:
    for value in list(args) + list(kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value
    return None


@dataclass
class Op:
    """An op with a torch reference and optional Triton / AITER implementations."""

    name: str
    torch_impl: Impl
    triton_impl: Optional[Impl] = None
    aiter_impl: Optional[Impl] = None
    triton_supports: Optional[Supports] = None
    aiter_supports: Optional[Supports] = None
    doc: str = ""
    _impls: dict = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._impls = {"torch": self.torch_impl, "triton": self.triton_impl, "aiter": self.aiter_impl}

    # -- selection ---------------------------------------------------------------------------
    def _why_not(self, backend: str, args: tuple, kwargs: dict, forced: bool = False) -> Optional[str]:
        """None when ``backend`` can run these arguments, else the reason it cannot.

        The Triton interpreter (TRITON_INTERPRET=1) runs Triton on CPU tensors only when the
        backend is asked for explicitly (``run``, ``ATOM_OPS_BACKEND``): ``auto`` never picks a
        slow interpreted kernel over the torch reference."""
        if backend == "torch":
            return None
        if self._impls[backend] is None:
            return f"atom has no {backend} implementation of {self.name}"
        t = _first_tensor(args, kwargs)
        if backend == "aiter":
            if not aiter_available():
                return "aiter is not installed or torch is not a ROCm build"
            if t is not None and t.device.type != "cuda":
                return f"tensors are on {t.device.type}, aiter needs a ROCm GPU"
            check = self.aiter_supports
        else:
            if not triton_available():
                return "triton is not installed"
            if t is not None and t.device.type != "cuda" and not (forced and triton_interpreting()):
                return f"tensors are on {t.device.type} (set TRITON_INTERPRET=1 to run Triton on CPU)"
            check = self.triton_supports
        return check(*args, **kwargs) if check is not None else None

    def backend_for(self, *args: Any, **kwargs: Any) -> tuple[str, str]:
        """(backend, reason) that a call with these arguments would use."""
        forced = envs.ATOM_OPS_BACKEND
        choice = forced.get(self.name, forced.get("*", "auto"))
        if choice != "auto":
            why = self._why_not(choice, args, kwargs, forced=True)
            if why is not None:
                raise BackendUnavailable(
                    f"ATOM_OPS_BACKEND forces {choice} for op {self.name}, but it cannot run: {why}"
                )
            return choice, f"forced by ATOM_OPS_BACKEND={choice}"
        reasons = []
        for backend in BACKENDS:
            why = self._why_not(backend, args, kwargs)
            if why is None:
                prefix = "; ".join(reasons)
                return backend, (f"auto ({prefix})" if prefix else "auto")
            reasons.append(f"not {backend}: {why}")
        raise AssertionError("unreachable: torch always runs")

    def backend_on(self, device_type: str) -> tuple[str, str]:
        """(backend, reason) this op would use for tensors on ``device_type`` ("cuda", "cpu"),
        before any shape-dependent ``supports`` check (``python -m atom doctor`` prints it)."""
        forced = envs.ATOM_OPS_BACKEND
        choice = forced.get(self.name, forced.get("*", "auto"))

        def why_not(backend: str, forced: bool = False) -> Optional[str]:
            if backend == "torch":
                return None
            if self._impls[backend] is None:
                return f"atom has no {backend} implementation of {self.name}"
            if backend == "aiter" and not aiter_available():
                return "aiter is not installed or torch is not a ROCm build"
            if backend == "triton" and not triton_available():
                return "triton is not installed"
            if device_type != "cuda" and not (forced and backend == "triton" and triton_interpreting()):
                return f"tensors on {device_type}"
            return None

        if choice != "auto":
            why = why_not(choice, forced=True)
            return (choice, f"forced by ATOM_OPS_BACKEND") if why is None else (
                "error", f"ATOM_OPS_BACKEND forces {choice} but {why}")
        reasons = []
        for backend in BACKENDS:
            why = why_not(backend)
            if why is None:
                return backend, "auto" + (f" ({'; '.join(reasons)})" if reasons else "")
            reasons.append(f"not {backend}: {why}")
        raise AssertionError("unreachable")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        backend, _ = self.backend_for(*args, **kwargs)
        return self._impls[backend](*args, **kwargs)

    def run(self, backend: str, *args: Any, **kwargs: Any) -> Any:
        """Run one named backend (tests and benchmarks); raises if it cannot run these args."""
        why = self._why_not(backend, args, kwargs, forced=True)
        if why is not None:
            raise BackendUnavailable(f"{self.name} on {backend}: {why}")
        return self._impls[backend](*args, **kwargs)


#: Every op declared with :func:`register`, by name (doctor and the benchmarks list them).
OPS: dict[str, Op] = {}


def register(op: Op) -> Op:
    if op.name in OPS and OPS[op.name] is not op:
        raise ValueError(f"op {op.name!r} is declared twice")
    OPS[op.name] = op
    return op
