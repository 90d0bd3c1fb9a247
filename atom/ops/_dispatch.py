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

While ``torch.compile`` traces (Dynamo), a call becomes the op's *inductor form* when it has one
and ``ATOM_COMPILE_ELEMENTWISE=inductor`` (the default): plain torch code Inductor fuses with its
neighbours (:mod:`atom.ops._graph` says more); otherwise its *graph form*, one opaque
``torch.ops.atom.*`` node that dispatches as above at run time.

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


@torch.compiler.assume_constant_result
def compile_elementwise() -> str:
    """ATOM_COMPILE_ELEMENTWISE, read when Dynamo reaches the call and baked into the traced graph
    as a constant (vLLM keys its compile cache by every set ATOM_* variable)."""
    return envs.ATOM_COMPILE_ELEMENTWISE


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
    #: What a call becomes while ``torch.compile`` traces (Dynamo): a ``torch.ops.atom.*`` custom
    #: op node (:mod:`atom.ops._graph`), or None to let Dynamo trace the call as it is.
    graph_form: Optional[Impl] = field(default=None, repr=False)
    #: Plain torch code (same signature and semantics, in-place writes included) that Dynamo
    #: traces instead of the graph form when ``ATOM_COMPILE_ELEMENTWISE=inductor``, so Inductor
    #: fuses the op with its neighbours; None: the op is always a graph-form node when traced.
    inductor_form: Optional[Impl] = field(default=None, repr=False)
    _impls: dict = field(init=False, repr=False)
    _warmed: set = field(init=False, repr=False, default_factory=set)

    def __post_init__(self) -> None:
        self._impls = {"torch": self.torch_impl, "triton": self.triton_impl, "aiter": self.aiter_impl}

    # -- selection ---------------------------------------------------------------------------
    def _why_not(self, backend: str, device_type: Optional[str], forced: bool,
                 call: Optional[tuple[tuple, dict]] = None) -> Optional[str]:
        """None when ``backend`` can run on ``device_type`` (None: no tensor argument) and, when
        ``call`` = (args, kwargs) is given, these arguments; else the reason it cannot.

        The Triton interpreter (TRITON_INTERPRET=1) runs Triton on CPU tensors only when the
        backend is asked for explicitly (``run``, ``ATOM_OPS_BACKEND``): ``auto`` never picks a
        slow interpreted kernel over the torch reference."""
        if backend == "torch":
            return None
        if self._impls[backend] is None:
            return f"atom has no {backend} implementation of {self.name}"
        if backend == "aiter":
            if not aiter_available():
                return "aiter is not installed or torch is not a ROCm build"
            if device_type not in (None, "cuda"):
                return f"tensors are on {device_type}, aiter needs a ROCm GPU"
            check = self.aiter_supports
        else:
            if not triton_available():
                return "triton is not installed"
            if device_type not in (None, "cuda") and not (forced and triton_interpreting()):
                return f"tensors are on {device_type} (set TRITON_INTERPRET=1 to run Triton on CPU)"
            check = self.triton_supports
        if call is None or check is None:
            return None
        return check(*call[0], **call[1])

    def _choose(self, device_type: Optional[str], call: Optional[tuple[tuple, dict]]) -> tuple[str, str]:
        """(backend, reason): the forced backend (raising if it cannot run) or auto's first fit."""
        forced = envs.ATOM_OPS_BACKEND
        choice = forced.get(self.name, forced.get("*", "auto"))
        if choice != "auto":
            why = self._why_not(choice, device_type, True, call)
            if why is not None:
                raise BackendUnavailable(
                    f"ATOM_OPS_BACKEND forces {choice} for op {self.name}, but it cannot run: {why}"
                )
            return choice, f"forced by ATOM_OPS_BACKEND={choice}"
        reasons = []
        for backend in BACKENDS:
            why = self._why_not(backend, device_type, False, call)
            if why is None:
                return backend, ("auto (" + "; ".join(reasons) + ")") if reasons else "auto"
            reasons.append(f"not {backend}: {why}")
        raise AssertionError("unreachable: torch always runs")

    def backend_for(self, *args: Any, **kwargs: Any) -> tuple[str, str]:
        """(backend, reason) that a call with these arguments would use."""
        t = _first_tensor(args, kwargs)
        return self._choose(None if t is None else t.device.type, (args, kwargs))

    def backend_on(self, device_type: str) -> tuple[str, str]:
        """(backend, reason) this op would use for tensors on ``device_type`` ("cuda", "cpu"),
        before any shape-dependent ``supports`` check (``python -m atom doctor`` prints it);
        ("error", reason) when ATOM_OPS_BACKEND forces a backend that cannot run there."""
        try:
            return self._choose(device_type, None)
        except BackendUnavailable as exc:
            return "error", str(exc)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            if self.inductor_form is not None and compile_elementwise() == "inductor":
                # Plain torch ops in the traced graph, for Inductor to fuse with its neighbours.
                return self.inductor_form(*args, **kwargs)
            if self.graph_form is not None:
                # One opaque node in the traced graph; at run time it dispatches as below.
                return self.graph_form(*args, **kwargs)
        backend, _ = self.backend_for(*args, **kwargs)
        return self._impls[backend](*args, **kwargs)

    def claim_warm_up(self, key: Any, device_type: str, force: bool = False) -> bool:
        """True the first time ``key`` is claimed for this op when its Triton kernels are what runs
        on ``device_type`` (or ``force``: tests under the interpreter); the caller then launches
        its warm-up. Kernel warm-ups at load (:func:`atom.ops.warm_up_paged_attention`,
        :func:`atom.ops.warm_up_mla_decode`, :func:`atom.ops.warm_up_fused_moe`) happen once per
        process and layer shape."""
        if key in self._warmed or (not force and self.backend_on(device_type)[0] != "triton"):
            return False
        self._warmed.add(key)
        return True

    def unsupported(self, backend: str, *args: Any, **kwargs: Any) -> Optional[str]:
        """None when ``backend`` can run these arguments (as if forced), else the reason."""
        t = _first_tensor(args, kwargs)
        return self._why_not(backend, None if t is None else t.device.type, True, (args, kwargs))

    def run(self, backend: str, *args: Any, **kwargs: Any) -> Any:
        """Run one named backend (tests and benchmarks); raises if it cannot run these args."""
        why = self.unsupported(backend, *args, **kwargs)
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
