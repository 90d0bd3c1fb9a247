"""The patch / injection toolkit.

Declare a frozen record (:class:`Patch` wraps or replaces one attribute; :class:`Injection` adds a
declared set of members to a class), register it, and drive it with :func:`apply`,
:func:`revert`, :func:`is_applied` and :func:`status`. Patches on modules that are not imported
yet are armed with a post-import hook and land when the module is imported.

This package imports neither vLLM nor torch.
"""

from atom.patches.core import State, Status, apply, apply_to_class, disabled_by, is_applied, resolve, revert, status
from atom.patches.records import Injection, Patch, PatchError, Record
from atom.patches.registry import REGISTRY, Registry, listing, register


def as_decorator(record: Injection):
    """The class decorator an :class:`Injection` declares: ``as_decorator(rec)(cls)`` injects
    ``rec.members`` into ``cls`` now (``cls`` must be ``rec.target``) and returns ``cls``."""

    def decorate(cls: type) -> type:
        apply_to_class(record, cls)
        return cls

    return decorate


__all__ = [
    "Injection", "Patch", "PatchError", "Record", "REGISTRY", "Registry", "State", "Status",
    "apply", "apply_to_class", "as_decorator", "disabled_by", "is_applied", "listing", "register", "resolve",
    "revert", "status",
]
