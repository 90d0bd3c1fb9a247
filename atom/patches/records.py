"""The declarative records: one frozen :class:`Patch` per wrapped/replaced attribute and one frozen
:class:`Injection` per class decorator that adds a declared set of members to a class.

Apply, revert, listing, docs and the contract tests are all driven by these records alone.
Importing this module imports neither vLLM nor torch: targets and callables may be given as
``"module:qualname"`` strings, resolved only when the target module is imported.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Union

Ref = Union[str, Callable[..., Any], type]

__all__ = ["Patch", "Injection", "Record", "PatchError", "split_target", "HOSTS"]

#: The host frameworks a record can belong to.
HOSTS = ("vllm", "sglang")


class PatchError(RuntimeError):
    """An explicitly requested patch/injection could not be applied (the message says why)."""


def split_target(target: str) -> tuple[str, str]:
    """``"pkg.mod:Owner.attr"`` -> (``"pkg.mod"``, ``"Owner.attr"``)."""
    module, sep, path = target.partition(":")
    if not sep or not module or not path:
        raise ValueError(f"target {target!r} must look like 'package.module:Name[.attr]'")
    return module, path


@dataclass(frozen=True)
class _Common:
    #: Unique id, used by ATOM_DISABLED_PATCHES and ``python -m atom patches``.
    id: str
    #: ``"package.module:Owner.attr"`` (Patch) or ``"package.module:Class"`` (Injection).
    target: str
    #: PEP 440 specifier of the vLLM versions this was written and tested for ("" = any).
    vllm: str = ""
    #: An ATOM_* boolean variable that, when true, disables this record (besides the host's
    #: master switch, ATOM_DISABLE_<HOST>_PLUGIN, and ATOM_DISABLED_PATCHES).
    toggle: str = ""
    #: One line: why this exists.
    reason: str = ""
    #: Upstream issue/PR/commit or the vLLM API it stands in for.
    upstream: str = ""
    #: When it can be deleted.
    removal: str = ""
    #: The set this record belongs to, dotted (``"vllm.attention.mha"``): the code that applies
    #: a set selects it from the registry (:meth:`atom.patches.Registry.select`) instead of
    #: keeping its own list of records.
    group: str = ""
    #: The framework whose process applies this record (one of :data:`HOSTS`): its master
    #: switch (``ATOM_DISABLE_VLLM_PLUGIN`` / ``ATOM_DISABLE_SGLANG_PLUGIN``) disables it.
    host: str = "vllm"
    #: PEP 440 specifier of the SGLang versions this was written and tested for ("" = any).
    sglang: str = ""

    def __post_init__(self) -> None:
        split_target(self.target)
        if self.host not in HOSTS:
            raise ValueError(f"record {self.id}: host {self.host!r} is not one of {', '.join(HOSTS)}")
        if not self.id or not all(c.isalnum() or c in "._-" for c in self.id):
            raise ValueError(f"record id {self.id!r} must use letters, digits, '.', '_', '-'")

    @property
    def module(self) -> str:
        return split_target(self.target)[0]


@dataclass(frozen=True)
class Patch(_Common):
    """Wrap (through wrapt) or replace one attribute of a module or class.

    Exactly one of ``wrapper`` (a wrapt wrapper ``(wrapped, instance, args, kwargs)``) or
    ``replacement`` (a plain object installed as is: for per-token hot paths, no proxy).
    """

    wrapper: Ref | None = None
    replacement: Ref | None = None
    #: Other binding sites of the same object (``"module:attr"``): re-exports made with
    #: ``from x import f`` keep the old object unless they are patched too.
    aliases: tuple[str, ...] = ()
    #: Expected shape of the original's signature, e.g. ``"(self, act_dtype)"`` (or a tuple of
    #: shapes, one per vLLM release the wrapper was written for); ``None`` = unchecked.
    signature: str | tuple[str, ...] | None = None
    #: Other attributes the wrapper relies on, with their expected shapes:
    #: ``(("module:Owner.attr", "(self, x)" or a tuple of shapes), ...)``; checked like
    #: ``signature`` before applying (e.g. a method the wrapper routes calls of).
    guards: tuple[tuple[str, str | tuple[str, ...]], ...] = ()

    def __post_init__(self) -> None:
        super().__post_init__()
        if (self.wrapper is None) == (self.replacement is None):
            raise ValueError(f"patch {self.id}: give exactly one of wrapper= or replacement=")
        for alias in self.aliases:
            split_target(alias)
        for target, _ in self.guards:
            split_target(target)

    kind = "patch"


@dataclass(frozen=True)
class Injection(_Common):
    """Add ``members`` from ``source`` (a class, or ``"module:Class"``) to the ``target`` class.

    Members are installed as plain class attributes (the very function/descriptor objects from
    ``source.__dict__``), so an injected per-token method costs exactly what a native one does.
    ``base`` names the vLLM class whose same-named members they stand in for; ``signatures`` gives
    the expected shape of those base members (``((member, "(self, ...)"), ...)``, or a tuple of
    shapes where supported vLLM releases differ), checked before applying.
    """

    members: tuple[str, ...] = ()
    source: Ref | None = None
    base: str = ""
    signatures: tuple[tuple[str, str | tuple[str, ...]], ...] = field(default=())

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.members or self.source is None:
            raise ValueError(f"injection {self.id}: members and source are required")
        if self.base:
            split_target(self.base)
        unknown = {m for m, _ in self.signatures} - set(self.members)
        if unknown:
            raise ValueError(f"injection {self.id}: signatures for undeclared members {sorted(unknown)}")

    kind = "injection"


Record = Union[Patch, Injection]
