"""Direct launches of compiled Triton kernels: ``direct(kernel)[grid](*args, **kwargs)``.

A normal launch, ``kernel[grid](...)``, runs Triton's ``JITFunction.run`` every time: knob reads,
the current device and stream, the binder's specialisation of every argument, a cache key built
from the options, then the compiled kernel's launcher. On the H100 host that is ~30 us for a kernel
with ~30 arguments (bench/NOTES.md entry 42), and attention runs eagerly in every mixed or prefill
step (3-4 launches per layer), so it is host time per layer and step.

:func:`direct` keeps, per kernel, the compiled kernels it has seen, keyed by a flat tuple of what
decides Triton's variant: the current device; each tensor's dtype and whether its address is
16-byte aligned; each int's value (which covers Triton's ``== 1`` and divisible-by-16
specialisations and its 32/64-bit choice); each float's type; anything else by type and value;
the keyword arguments (constexprs and options such as ``num_warps``) by name and value. On a key's
first call it launches the normal way (which compiles when needed) and asks Triton for the
compiled kernel (``JITFunction.warmup``, a cache hit); later calls with that key launch the
compiled kernel directly on the current stream: ``compiled[grid](*args, *tail)``, where ``tail``
is the values of the parameters not passed positionally (keyword arguments and defaults, in the
kernel's order), as Triton's own launch passes them.

Where Triton's API differs from what this expects (no ``params``, no ``warmup``, a launcher that
refuses the arguments), the kernel falls back to normal launches for good, with one warning.
Under the interpreter (``TRITON_INTERPRET=1``) and for anything that is not a ``JITFunction``
(tests' stubs) ``direct`` returns the kernel itself. Off unless ``ATOM_TRITON_DIRECT_LAUNCH=1``;
the switch is read live at every launch-site call (two reads of the environment's backing dict,
:func:`atom.envs.raw`). This module never imports vLLM.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch

from atom import envs
from atom._logging import warn_once

_ENV = "ATOM_TRITON_DIRECT_LAUNCH"
#: Keys kept per kernel before its table is cleared (an int argument that takes a new value on
#: every call would otherwise grow it without bound; each entry is one tuple and one reference).
MAX_KEYS = 4096


@functools.lru_cache(maxsize=16)
def _parsed(raw: str) -> bool:
    return bool(envs.get(_ENV, {_ENV: raw}))  # a malformed value raises, naming the variable


def enabled() -> bool:
    """``ATOM_TRITON_DIRECT_LAUNCH`` (read live; unset = off) and not under the interpreter."""
    raw = envs.raw(_ENV)
    if raw is None or not _parsed(raw):
        return False
    return envs.raw("TRITON_INTERPRET") != "1"


_launchers: "dict[int, DirectLauncher]" = {}


def direct(kernel: Any) -> Any:
    """``kernel`` wrapped for direct launches when enabled and it is a Triton ``JITFunction``;
    otherwise ``kernel`` itself (indexing either by a grid gives the launch callable)."""
    if not enabled():
        return kernel
    launcher = _launchers.get(id(kernel))
    if launcher is None or launcher.kernel is not kernel:
        if not _is_jit_function(kernel):
            return kernel
        launcher = _launchers[id(kernel)] = DirectLauncher(kernel)
    return launcher


def _is_jit_function(kernel: Any) -> bool:
    try:
        from triton.runtime.jit import JITFunction
    except Exception:  # noqa: BLE001 - no usable Triton: nothing to wrap
        return False
    return isinstance(kernel, JITFunction)


def _stream_getters() -> "tuple[Callable[[], int], Callable[[int], Any]]":
    from triton.runtime import driver

    active = driver.active
    return active.get_current_device, active.get_current_stream


def arg_key(args: tuple, kwargs: dict, device: Any) -> tuple:
    """The flat key of one launch (see the module docstring)."""
    key: list = [device]
    append = key.append
    for a in args:
        t = type(a)
        if t is torch.Tensor or isinstance(a, torch.Tensor):
            append(a.dtype)
            append(a.data_ptr() & 15 == 0)
        elif t is int:
            append(a)
        elif t is float:
            append(float)
        else:  # bool (kept apart from int: True is not 1 to Triton), None, dtypes, ...
            append(t)
            append(a)
    for name, value in kwargs.items():
        append(name)
        append(value)
    return tuple(key)


class DirectLauncher:
    """One kernel's direct launches (see the module docstring); ``launcher[grid](...)``."""

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        self.compiled: dict[tuple, tuple[Any, tuple]] = {}
        self.failed = False
        self._getters: "tuple[Callable, Callable] | None" = None
        try:
            self._params = [(p.name, p.default, p.has_default) for p in kernel.params]
        except Exception as exc:  # noqa: BLE001 - another Triton: normal launches
            self._fail(f"cannot read its parameters ({exc!r})")

    def _fail(self, why: str) -> None:
        self.failed = True
        name = getattr(self.kernel, "__name__", None) or getattr(getattr(self.kernel, "fn", None), "__name__", "?")
        warn_once(f"direct-launch:{name}",
                  f"atom: direct Triton launches of {name} are off for this process ({why}); "
                  "normal launches instead")

    def __getitem__(self, grid: tuple) -> Callable[..., None]:
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    def tail(self, nargs: int, kwargs: dict) -> tuple:
        """Values of the parameters after the first ``nargs``, as Triton's binder binds them."""
        out = []
        for name, default, has_default in self._params[nargs:]:
            if name in kwargs:
                out.append(kwargs[name])
            elif has_default:
                out.append(default)
            else:
                raise TypeError(f"missing argument {name!r}")
        return tuple(out)

    def launch(self, grid: tuple, args: tuple, kwargs: dict) -> None:
        if self.failed:
            self.kernel[grid](*args, **kwargs)
            return
        if self._getters is None:
            self._getters = _stream_getters()
        get_device, get_stream = self._getters
        device = get_device()
        key = arg_key(args, kwargs, device)
        entry = self.compiled.get(key)
        if entry is None:
            self.kernel[grid](*args, **kwargs)  # compiles if needed, and launches
            self._remember(key, grid, args, kwargs)
            return
        compiled, tail = entry
        g = (grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1)
        try:
            compiled[g](*args, *tail, stream=get_stream(device))
        except Exception as exc:  # noqa: BLE001 - the launcher refused: normal launches for good
            self._fail(f"{type(exc).__name__}: {exc}")
            self.kernel[grid](*args, **kwargs)

    def _remember(self, key: tuple, grid: tuple, args: tuple, kwargs: dict) -> None:
        try:
            compiled = self.kernel.warmup(*args, grid=grid, **kwargs)
            if hasattr(compiled, "result"):  # an asynchronous compile's future
                compiled = compiled.result()
            if compiled is None or not hasattr(compiled, "__getitem__"):
                raise TypeError(f"warmup returned {type(compiled).__name__}")
            tail = self.tail(len(args), kwargs)
        except Exception as exc:  # noqa: BLE001 - Triton's API differs: normal launches
            self._fail(f"{type(exc).__name__}: {exc}")
            return
        if len(self.compiled) >= MAX_KEYS:
            self.compiled.clear()
        self.compiled[key] = (compiled, tail)
