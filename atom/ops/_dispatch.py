"""One dispatcher for every atom op: AITER -> Triton -> torch, chosen by device, dtype and arguments.

An op is declared once, from its plain-torch reference, whose signature *is* the op's::

    @declare("rms_norm", doc="RMSNorm over the last dim")
    def rms_norm(x, weight, eps, residual=None, *, out=None):
        \"\"\"The public docstring.\"\"\"
        ...                                   # the reference: plain torch

    @rms_norm.triton(supports=_rms_norm_triton_supports)
    def _rms_norm_triton(x, weight, eps, residual=None, *, out=None): ...

    @rms_norm.aiter(supports=_rms_norm_aiter_supports, dtypes=(torch.float16, torch.bfloat16))
    def _rms_norm_aiter(x, weight, eps, residual=None, *, out=None): ...

Every function registered against an op (backend implementations, ``supports`` predicates,
graph and inductor forms) is checked at registration to take the op's arguments
(:func:`conformance`): the same parameters (names, order, kinds, defaults), or a leading part of
them with ``*args`` / ``**kwargs`` taking the rest. A backend whose parameters drifted from the
op's fails at import, not on the first call that hits the difference.

``Op.__call__`` picks the backend:

1. forced by ``ATOM_OPS_BACKEND`` (per-op ``op=backend`` wins over a global value); a forced
   backend that cannot run here raises :class:`BackendUnavailable` (an explicit request that
   cannot be met is an error, never a silent fallback);
2. otherwise ``auto``: AITER on ROCm when ``aiter`` imports and the op has a binding, Triton on
   CUDA/ROCm tensors, the torch reference everywhere else (CPU).

What does not depend on a call's arguments (the environment, which packages import, the device type,
the first tensor's dtype against a backend's ``dtypes``) is decided once per (device type, dtype,
raw ``ATOM_OPS_BACKEND`` string, raw ``TRITON_INTERPRET`` string) and cached: a call does two
environment reads (:func:`atom.envs.raw`) and one dict look-up, and changing either variable between
calls takes effect on the next call. What does depend on the arguments (strides, head sizes, the
dtype of a second tensor) is a backend's ``supports(*args, **kwargs) -> str | None`` predicate, run
on every call of a backend that passed the cached checks: ``None`` when it can run these arguments,
or the reason it cannot (``auto`` then moves down the chain; a forced backend raises with it).

While ``torch.compile`` traces (Dynamo), a call becomes the op's *inductor form* when it has one
and ``ATOM_COMPILE_ELEMENTWISE=inductor`` (the default): plain torch code Inductor fuses with its
neighbours (:mod:`atom.ops._graph` says more); otherwise its *graph form*, one opaque
``torch.ops.atom.*`` node that dispatches as above at run time.

``Op.backend_for(...)`` answers which backend a call would use and why, without running it
(``python -m atom doctor`` prints ``Op.backend_on(device_type)``). This module never imports vLLM.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch

from atom import envs

BACKENDS = ("aiter", "triton", "torch")

Impl = Callable[..., Any]
Supports = Callable[..., Optional[str]]

#: The raw environment strings a backend choice is cached under.
_OPS_BACKEND_ENV = "ATOM_OPS_BACKEND"
_INTERPRET_ENV = "TRITON_INTERPRET"


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
    return envs.raw(_INTERPRET_ENV) == "1"


@torch.compiler.assume_constant_result
def compile_elementwise() -> str:
    """ATOM_COMPILE_ELEMENTWISE, read when Dynamo reaches the call and baked into the traced graph
    as a constant (vLLM keys its compile cache by every set ATOM_* variable)."""
    return envs.ATOM_COMPILE_ELEMENTWISE


def _first_tensor(args: tuple, kwargs: dict) -> Optional[torch.Tensor]:
    for value in args:
        if isinstance(value, torch.Tensor):
            return value
    for value in kwargs.values():
        if isinstance(value, torch.Tensor):
            return value
    return None


# -- signatures ---------------------------------------------------------------------------------
_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def conformance(op_signature: inspect.Signature, fn: Callable) -> Optional[str]:
    """None when ``fn`` takes every call the op's signature takes, with the same meaning; else
    what differs.

    ``fn`` conforms when each parameter it names is the op's parameter of that name, of the same
    kind, default and (positional ones) position, and whatever it does not name is taken by its
    ``*args`` (positional parameters) and ``**kwargs`` (parameters that may come by keyword).
    The op's own signature conforms; so does ``(x, *args, **kwargs)`` for an op whose first
    parameter is ``x``.
    """
    params = inspect.signature(fn).parameters
    op_params = op_signature.parameters
    op_positional = [p.name for p in op_params.values() if p.kind in _POSITIONAL]
    positional = [p.name for p in params.values() if p.kind in _POSITIONAL]
    if positional != op_positional[:len(positional)]:
        return f"positional parameters {positional} are not the op's leading {op_positional[:len(positional)]}"
    var_args = any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params.values())
    var_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    for p in params.values():
        if p.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
            continue
        ours = op_params.get(p.name)
        if ours is None:
            return f"{p.name!r} is not a parameter of the op"
        if p.kind != ours.kind:
            return f"{p.name!r} is {p.kind.description}, the op's is {ours.kind.description}"
        if p.default is not ours.default and p.default != ours.default:
            return f"{p.name!r} defaults to {p.default!r}, the op's to {ours.default!r}"
    for p in op_params.values():
        if p.name in params:
            continue
        needs_args = p.kind in _POSITIONAL or p.kind is inspect.Parameter.VAR_POSITIONAL
        needs_kwargs = p.kind is not inspect.Parameter.POSITIONAL_ONLY and p.kind is not inspect.Parameter.VAR_POSITIONAL
        if (needs_args and not var_args) or (needs_kwargs and not var_kwargs):
            return f"it does not take the op's parameter {p.name!r}"
    return None


# -- backends and the cached choice ---------------------------------------------------------------
@dataclass(frozen=True)
class Backend:
    """One registered implementation of an op."""

    name: str  # one of BACKENDS
    impl: Impl
    #: Per-call check of the arguments (shapes, strides, other tensors' dtypes): None = can run.
    supports: Optional[Supports] = None
    #: dtypes of the call's first tensor this backend runs (None: any); checked once per dtype.
    dtypes: Optional[tuple[torch.dtype, ...]] = None


@dataclass(frozen=True)
class _Plan:
    """The argument-independent part of a choice, for one (device, dtype, environment)."""

    forced: Optional[str]  # the backend ATOM_OPS_BACKEND forces, or None (auto)
    #: Every backend considered, in order: (name, reason it cannot run here or None, supports).
    steps: tuple[tuple[str, Optional[str], Optional[Supports]], ...]
    #: The steps with no such reason, up to the first without a per-call check: (name, supports).
    chain: tuple[tuple[str, Optional[Supports]], ...]


class Op:
    """An op: its torch reference (which declares the signature) and the backends registered
    against it. Calling it dispatches; see the module docstring."""

    def __init__(self, name: str, reference: Impl, doc: str = "") -> None:
        self.name = name
        self.doc = doc
        self.reference = reference
        self.signature = inspect.signature(reference)
        self.__signature__ = self.signature
        self.__doc__ = reference.__doc__
        self._backends: dict[str, Backend] = {"torch": Backend("torch", reference)}
        #: What a call becomes while ``torch.compile`` traces (Dynamo): a ``torch.ops.atom.*``
        #: custom-op node (:mod:`atom.ops._graph`), or None to let Dynamo trace the call as it is.
        self.graph_form: Optional[Impl] = None
        #: Plain torch code (same signature and semantics, in-place writes included) that Dynamo
        #: traces instead of the graph form when ``ATOM_COMPILE_ELEMENTWISE=inductor``, so
        #: Inductor fuses the op with its neighbours; None: always a graph-form node when traced.
        self.inductor_form: Optional[Impl] = None
        self._plans: dict[tuple, _Plan] = {}
        self._warmed: set = set()

    def __repr__(self) -> str:
        return f"<atom op {self.name}: {', '.join(b for b in BACKENDS if b in self._backends)}>"

    # -- registration --------------------------------------------------------------------------
    def _check(self, role: str, fn: Callable) -> None:
        why = conformance(self.signature, fn)
        if why is not None:
            raise TypeError(f"op {self.name}: {role} {getattr(fn, '__qualname__', fn)!r} does not take the "
                            f"op's arguments {self.signature}: {why}")

    def _register(self, backend: str, fn: Impl, supports: Optional[Supports],
                  dtypes: Optional[Sequence[torch.dtype]]) -> Impl:
        self._check(f"{backend} implementation", fn)
        if supports is not None:
            self._check(f"{backend} supports predicate", supports)
        self._backends[backend] = Backend(backend, fn, supports, None if dtypes is None else tuple(dtypes))
        self._plans.clear()
        return fn

    def triton(self, fn: Optional[Impl] = None, *, supports: Optional[Supports] = None,
               dtypes: Optional[Sequence[torch.dtype]] = None) -> Any:
        """Register the Triton implementation (decorator, with or without keywords)."""
        if fn is None:
            return lambda f: self._register("triton", f, supports, dtypes)
        return self._register("triton", fn, supports, dtypes)

    def aiter(self, fn: Optional[Impl] = None, *, supports: Optional[Supports] = None,
              dtypes: Optional[Sequence[torch.dtype]] = None) -> Any:
        """Register the AITER binding (ROCm; decorator, with or without keywords)."""
        if fn is None:
            return lambda f: self._register("aiter", f, supports, dtypes)
        return self._register("aiter", fn, supports, dtypes)

    def graph(self, fn: Impl) -> Impl:
        """Register the graph form (decorator; :mod:`atom.ops._graph`)."""
        self._check("graph form", fn)
        self.graph_form = fn
        return fn

    def inductor(self, fn: Impl) -> Impl:
        """Register the inductor form (decorator; often ``op.inductor(op.reference)``)."""
        self._check("inductor form", fn)
        self.inductor_form = fn
        return fn

    def impl(self, backend: str) -> Optional[Impl]:
        """The registered implementation of ``backend`` (None if the op has none)."""
        b = self._backends.get(backend)
        return None if b is None else b.impl

    # -- selection ---------------------------------------------------------------------------
    def _static_why_not(self, backend: str, device_type: Optional[str], dtype: Optional[torch.dtype],
                        forced: bool, interpreting: bool) -> Optional[str]:
        """None when ``backend`` can run on ``device_type`` with a first tensor of ``dtype``
        (either None: unknown), before any per-call check; else the reason it cannot.

        The Triton interpreter (TRITON_INTERPRET=1) runs Triton on CPU tensors only when the
        backend is asked for explicitly (``run``, ``ATOM_OPS_BACKEND``): ``auto`` never picks a
        slow interpreted kernel over the torch reference."""
        if backend == "torch":
            return None
        b = self._backends.get(backend)
        if b is None:
            return f"atom has no {backend} implementation of {self.name}"
        if backend == "aiter":
            if not aiter_available():
                return "aiter is not installed or torch is not a ROCm build"
            if device_type not in (None, "cuda"):
                return f"tensors are on {device_type}, aiter needs a ROCm GPU"
        else:
            if not triton_available():
                return "triton is not installed"
            if device_type not in (None, "cuda") and not (forced and interpreting):
                return f"tensors are on {device_type} (set TRITON_INTERPRET=1 to run Triton on CPU)"
        if b.dtypes is not None and dtype is not None and dtype not in b.dtypes:
            takes = "/".join(str(d).removeprefix("torch.") for d in b.dtypes)
            return f"dtype {str(dtype).removeprefix('torch.')} (atom's {backend} {self.name} takes {takes})"
        return None

    def _plan(self, device_type: Optional[str], dtype: Optional[torch.dtype], ops_backend: Optional[str],
              interpret: Optional[str]) -> _Plan:
        raw = {} if ops_backend is None else {_OPS_BACKEND_ENV: ops_backend}
        forced_map = envs.VARIABLES[_OPS_BACKEND_ENV].read(raw)  # parsed once per raw string
        choice = forced_map.get(self.name, forced_map.get("*", "auto"))
        interpreting = interpret == "1"
        forced = None if choice == "auto" else choice
        steps, chain = [], []
        for backend in (BACKENDS if forced is None else (forced,)):
            why = self._static_why_not(backend, device_type, dtype, forced is not None, interpreting)
            supports = self._backends[backend].supports if why is None and backend != "torch" else None
            steps.append((backend, why, supports))
            if why is None and (not chain or chain[-1][1] is not None):
                chain.append((backend, supports))
        return _Plan(forced, tuple(steps), tuple(chain))

    def _plan_for(self, device_type: Optional[str], dtype: Optional[torch.dtype]) -> _Plan:
        key = (device_type, dtype, envs.raw(_OPS_BACKEND_ENV), envs.raw(_INTERPRET_ENV))
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = self._plan(*key)
        return plan

    def _forced_error(self, backend: str, why: str) -> BackendUnavailable:
        return BackendUnavailable(f"ATOM_OPS_BACKEND forces {backend} for op {self.name}, but it cannot run: {why}")

    def _choose(self, args: tuple, kwargs: dict) -> str:
        """The backend for this call (the hot path: cached plan + per-call checks only)."""
        t = _first_tensor(args, kwargs)
        plan = self._plan_for(None, None) if t is None else self._plan_for(t.device.type, t.dtype)
        for backend, supports in plan.chain:
            if supports is None:
                return backend
            why = supports(*args, **kwargs)
            if why is None:
                return backend
            if plan.forced is not None:
                raise self._forced_error(backend, why)
        # Only a forced backend can leave the chain empty (auto always ends with torch).
        backend, why, _ = plan.steps[0]
        raise self._forced_error(backend, why)

    def _explain(self, plan: _Plan, call: Optional[tuple[tuple, dict]]) -> tuple[str, str]:
        """(backend, reason) of ``plan`` for ``call`` = (args, kwargs), or before any per-call
        check when ``call`` is None."""
        reasons = []
        for backend, why, supports in plan.steps:
            if why is None and supports is not None and call is not None:
                why = supports(*call[0], **call[1])
            if why is None:
                if plan.forced is not None:
                    return backend, f"forced by ATOM_OPS_BACKEND={backend}"
                return backend, ("auto (" + "; ".join(reasons) + ")") if reasons else "auto"
            if plan.forced is not None:
                raise self._forced_error(backend, why)
            reasons.append(f"not {backend}: {why}")
        raise AssertionError("unreachable: torch always runs")

    def backend_for(self, *args: Any, **kwargs: Any) -> tuple[str, str]:
        """(backend, reason) that a call with these arguments would use."""
        t = _first_tensor(args, kwargs)
        plan = self._plan_for(None, None) if t is None else self._plan_for(t.device.type, t.dtype)
        return self._explain(plan, (args, kwargs))

    def backend_on(self, device_type: str) -> tuple[str, str]:
        """(backend, reason) this op would use for tensors on ``device_type`` ("cuda", "cpu"),
        before any dtype- or argument-dependent check (``python -m atom doctor`` prints it);
        ("error", reason) when ATOM_OPS_BACKEND forces a backend that cannot run there."""
        try:
            return self._explain(self._plan_for(device_type, None), None)
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
        return self._backends[self._choose(args, kwargs)].impl(*args, **kwargs)

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
        why = self._static_why_not(backend, None if t is None else t.device.type, None if t is None else t.dtype,
                                   True, triton_interpreting())
        if why is not None or backend == "torch":
            return why
        supports = self._backends[backend].supports
        return None if supports is None else supports(*args, **kwargs)

    def run(self, backend: str, *args: Any, **kwargs: Any) -> Any:
        """Run one named backend (tests and benchmarks); raises if it cannot run these args."""
        why = self.unsupported(backend, *args, **kwargs)
        if why is not None:
            raise BackendUnavailable(f"{self.name} on {backend}: {why}")
        return self._backends[backend].impl(*args, **kwargs)


#: Every op declared with :func:`declare` (or :func:`register`), by name (doctor and the
#: benchmarks list them).
OPS: dict[str, Op] = {}


def register(op: Op) -> Op:
    if op.name in OPS and OPS[op.name] is not op:
        raise ValueError(f"op {op.name!r} is declared twice")
    OPS[op.name] = op
    return op


def declare(name: str, *, doc: str = "") -> Callable[[Impl], Op]:
    """Decorator: the torch reference it decorates becomes op ``name`` (registered in
    :data:`OPS`), with the reference's signature and docstring."""
    return lambda reference: register(Op(name, reference, doc))
