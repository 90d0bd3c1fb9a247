"""Signature shapes: the parameter list of a callable without annotations or default values.

``shape(f)`` of ``def f(self, x: int, *a, k=1, **kw)`` is ``"(self, x, *a, k=..., **kw)"``. A
record stores the shape it expects of the vLLM function it wraps or stands in for; any upstream
change of names, order, kinds or defaults shows up as a different string.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable


def unwrap_descriptor(obj: Any) -> Any:
    """The function inside a classmethod/staticmethod/property or a wrapt proxy."""
    if isinstance(obj, (classmethod, staticmethod)):
        obj = obj.__func__
    if isinstance(obj, property):
        obj = obj.fget
    return obj


def accepted(expected: "str | tuple[str, ...]") -> tuple[str, ...]:
    """The shapes a record accepts: one string, or a tuple of them (one per vLLM release whose
    shape differs)."""
    return (expected,) if isinstance(expected, str) else tuple(expected)


def shape(obj: Callable[..., Any]) -> str:
    fn = unwrap_descriptor(obj)
    sig = inspect.signature(fn, follow_wrapped=True)
    parts: list[str] = []
    seen_kwonly_marker = False
    positional_only = False
    for p in sig.parameters.values():
        if p.kind is p.POSITIONAL_ONLY:
            positional_only = True
        elif positional_only:
            parts.append("/")
            positional_only = False
        if p.kind is p.VAR_POSITIONAL:
            parts.append(f"*{p.name}")
            seen_kwonly_marker = True
            continue
        if p.kind is p.VAR_KEYWORD:
            parts.append(f"**{p.name}")
            continue
        if p.kind is p.KEYWORD_ONLY and not seen_kwonly_marker:
            parts.append("*")
            seen_kwonly_marker = True
        parts.append(p.name if p.default is p.empty else f"{p.name}=...")
    if positional_only:
        parts.append("/")
    return "(" + ", ".join(parts) + ")"
