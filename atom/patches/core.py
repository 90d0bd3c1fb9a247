"""apply / revert / is_applied / status, driven by a record alone.

Lifecycle of one record::

    apply(r)  -- disabled by env?  -> DISABLED (nothing touched)
              -- target imported?  -> guards (vLLM version, signature) -> APPLIED or REFUSED
              -- not imported yet  -> ARMED: a post-import hook applies it when the module loads
    revert(r) -- every site that still holds our object gets the exact original back;
                 a site someone else re-patched since is left alone (warning); ARMED is disarmed.

Idempotent: applying an applied record changes nothing (never a double wrap); reverting twice is a
no-op; reverting a record whose target was never imported is a no-op. Arming never imports the
target (so registering vLLM patches does not import vLLM).

Precedence: explicit argument (``apply(r, enabled=True/False)``) > environment > default (on).
An explicit ``enabled=True`` imports the target at once and raises :class:`PatchError` when the
record cannot apply; an implicit apply refuses that one record with one warning and carries on.
"""

from __future__ import annotations

import abc
import enum
import importlib
import sys
import threading
from dataclasses import dataclass, field
from typing import Any, Optional

import wrapt

from atom import envs
from atom._logging import get_logger, info_once, warn_once
from atom.patches.records import Injection, Patch, PatchError, Record, Ref, split_target
from atom.patches.signatures import accepted, shape
from atom.patches.versions import sglang_version_in, vllm_version_in

logger = get_logger("atom.patches")

__all__ = ["State", "Status", "apply", "apply_to_class", "revert", "is_applied", "status", "disabled_by", "resolve"]


class State(str, enum.Enum):
    NOT_REQUESTED = "not requested"
    ARMED = "armed"  # waiting for the target module to be imported
    APPLIED = "applied"
    DISABLED = "disabled"
    REFUSED = "refused"


@dataclass(frozen=True)
class Status:
    state: State
    detail: str = ""

    def __str__(self) -> str:
        return f"{self.state.value}: {self.detail}" if self.detail else self.state.value


_MISSING = object()


@dataclass
class _Site:
    """One attribute we changed: where, what was there (or _MISSING), what we put."""

    owner: Any
    name: str
    original: Any
    installed: Any

    def holds_ours(self) -> bool:
        return self.owner.__dict__.get(self.name, _MISSING) is self.installed


@dataclass
class _Entry:
    record: Record
    state: State = State.NOT_REQUESTED
    detail: str = ""
    explicit: bool = False
    sites: list[_Site] = field(default_factory=list)
    #: what the main site held before us (aliases are patched only where they hold the same)
    original: Any = _MISSING


_lock = threading.RLock()
_entries: dict[str, _Entry] = {}
_hooked: set[str] = set()  # module names with our trampoline registered


def resolve(ref: Ref) -> Any:
    """A ``"module:qualname"`` string -> the object (imports the module); objects pass through."""
    if not isinstance(ref, str):
        return ref
    module, path = split_target(ref)
    obj: Any = importlib.import_module(module)
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def _walk(obj: Any, dotted: str) -> Any:
    for part in filter(None, dotted.split(".")):
        obj = getattr(obj, part)
    return obj


def _lookup(owner: Any, name: str) -> Any:
    """The raw attribute (descriptor, not bound method) as stored, searching a class's MRO."""
    if isinstance(owner, type):
        for klass in owner.__mro__:
            if name in klass.__dict__:
                return klass.__dict__[name]
        raise AttributeError(f"{owner.__qualname__} has no attribute {name!r}")
    try:
        return owner.__dict__[name]
    except KeyError:
        raise AttributeError(f"{owner!r} has no attribute {name!r}") from None


def disabled_by(record: Record) -> Optional[str]:
    """The variable that disables ``record`` now, as ``NAME=value`` text, or None."""
    master = f"ATOM_DISABLE_{record.host.upper()}_PLUGIN"  # the record's host's master switch
    if envs.get(master):
        return f"{master}=1"
    ids = envs.ATOM_DISABLED_PATCHES
    if "*" in ids or record.id in ids:
        return "ATOM_DISABLED_PATCHES"
    if record.toggle and envs.get(record.toggle):
        return f"{record.toggle}=1"
    return None


# -- arming ----------------------------------------------------------------------------------


def _arm(module: str) -> None:
    if module in _hooked:
        return
    _hooked.add(module)
    # wrapt calls the hook right away when the module is already imported, else after it loads.
    wrapt.register_post_import_hook(_on_import, module)


def _on_import(module: Any) -> None:
    name = module.__name__
    with _lock:
        # wrapt fires a hook once; forget it so a later arm (after a re-import) registers anew.
        _hooked.discard(name)
        for entry in list(_entries.values()):
            if entry.state is not State.ARMED and entry.state is not State.APPLIED:
                continue
            rec = entry.record
            if entry.state is State.ARMED and rec.module == name:
                _apply_now(entry)
            elif entry.state is State.APPLIED and isinstance(rec, Patch):
                if any(split_target(a)[0] == name for a in rec.aliases):
                    _patch_aliases(entry)


# -- apply -----------------------------------------------------------------------------------


def apply(record: Record, *, enabled: Optional[bool] = None) -> Status:
    """Apply ``record`` now, or arm it for when its target module is imported.

    ``enabled=None`` follows the environment; ``True`` forces it (ignoring env toggles, importing
    the target now, raising :class:`PatchError` if it cannot apply); ``False`` leaves it off.
    """
    with _lock:
        entry = _entries.get(record.id)
        if entry is None or entry.record is not record:
            if entry is not None and entry.state is State.APPLIED:
                raise PatchError(f"another record with id {record.id!r} is applied")
            entry = _entries[record.id] = _Entry(record)
        if enabled is False:
            revert(record)
            entry.state, entry.detail = State.DISABLED, "by argument"
            return status(record)
        if enabled is None:
            why = disabled_by(record)
            if why is not None:
                if entry.state is State.APPLIED:
                    revert(record)
                entry.state, entry.detail = State.DISABLED, f"by {why}"
                info_once(f"disabled:{record.id}", f"patch {record.id} disabled by {why}", logger)
                return status(record)
        entry.explicit = enabled is True
        if entry.state is State.APPLIED and all(s.holds_ours() for s in entry.sites):
            return status(record)
        if record.module in sys.modules or entry.explicit:
            if entry.explicit:
                importlib.import_module(record.module)
            _apply_now(entry)
        else:
            entry.state, entry.detail = State.ARMED, f"waiting for import of {record.module}"
            _arm(record.module)
        return status(record)


def _refuse(entry: _Entry, why: str) -> None:
    rec = entry.record
    entry.state, entry.detail = State.REFUSED, why
    message = f"patch {rec.id} on {rec.target} refused: {why}; the rest of atom continues without it"
    if entry.explicit:
        raise PatchError(message)
    warn_once(f"refused:{rec.id}", message, logger)


def _apply_now(entry: _Entry, cls: Any = None) -> None:
    rec = entry.record
    for name, spec, version_in in (("vLLM", rec.vllm, vllm_version_in), ("SGLang", rec.sglang, sglang_version_in)):
        ok, installed_version = version_in(spec)
        if not ok:
            _refuse(entry, f"installed {name} {installed_version} is outside the supported range {spec}")
            return
    _, path = split_target(rec.target)
    try:
        if isinstance(rec, Patch):
            _install_patch(entry, sys.modules[rec.module], path)
        else:
            _install_injection(entry, cls if cls is not None else _walk(sys.modules[rec.module], path))
    except (AttributeError, ImportError) as exc:
        _refuse(entry, f"target not found ({exc})")


def _install_patch(entry: _Entry, module: Any, path: str) -> None:
    rec = entry.record
    assert isinstance(rec, Patch)
    owner_path, _, name = path.rpartition(".")
    owner = _walk(module, owner_path)
    current = _lookup(owner, name)
    if entry.sites and entry.sites[0].owner is owner and entry.sites[0].holds_ours():
        entry.state, entry.detail = State.APPLIED, ""
        return
    if getattr(current, "_self_atom_patch", None) == rec.id:
        # Our wrapper from an earlier, forgotten apply (e.g. a reloaded atom): never wrap twice.
        entry.sites = [_Site(owner, name, current.__wrapped__, current)]
        entry.original, entry.state, entry.detail = current.__wrapped__, State.APPLIED, ""
        return
    checks = ((rec.target, current, rec.signature),) if rec.signature is not None else ()
    checks += tuple((target, _lookup_target(target), expected) for target, expected in rec.guards)
    for target, obj, expected in checks:
        actual = shape(obj)
        if actual not in accepted(expected):
            _refuse(entry, f"signature of {target} is {actual}, expected {' or '.join(accepted(expected))}")
            return
    if rec.wrapper is not None:
        installed: Any = wrapt.FunctionWrapper(current, resolve(rec.wrapper))
        installed._self_atom_patch = rec.id
    else:
        installed = resolve(rec.replacement)
    own = name in owner.__dict__
    setattr(owner, name, installed)
    entry.sites = [_Site(owner, name, current if own else _MISSING, installed)]
    entry.original = current
    entry.state, entry.detail = State.APPLIED, ""
    logger.debug("patch %s applied to %s", rec.id, rec.target)
    _patch_aliases(entry)
    for alias in rec.aliases:
        _arm(split_target(alias)[0])


def _lookup_target(target: str) -> Any:
    """The raw attribute a ``"module:Owner.attr"`` names (imports the module)."""
    module, path = split_target(target)
    owner_path, _, name = path.rpartition(".")
    return _lookup(_walk(importlib.import_module(module), owner_path), name)


def _patch_aliases(entry: _Entry) -> None:
    rec = entry.record
    assert isinstance(rec, Patch)
    installed = entry.sites[0].installed
    for alias in rec.aliases:
        module_name, path = split_target(alias)
        module = sys.modules.get(module_name)
        if module is None:
            continue
        owner_path, _, name = path.rpartition(".")
        try:
            owner = _walk(module, owner_path)
        except AttributeError:
            continue
        current = owner.__dict__.get(name, _MISSING)
        if current is installed:
            # Imported after we patched: it bound our object; revert must still restore it.
            if not any(s.owner is owner and s.name == name for s in entry.sites):
                entry.sites.append(_Site(owner, name, entry.original, installed))
            continue
        if current is entry.original:
            setattr(owner, name, installed)
            entry.sites.append(_Site(owner, name, current, installed))
        else:
            warn_once(
                f"alias:{rec.id}:{alias}",
                f"patch {rec.id}: binding site {alias} holds a different object than "
                f"{rec.target}; left unpatched",
                logger,
            )


def _install_injection(entry: _Entry, cls: type) -> None:
    rec = entry.record
    assert isinstance(rec, Injection)
    source = resolve(rec.source)
    values = {m: _lookup(source, m) for m in rec.members}
    if entry.sites and all(s.owner is cls and s.holds_ours() for s in entry.sites):
        entry.state, entry.detail = State.APPLIED, ""
        return
    if rec.signatures:
        base = resolve(rec.base) if rec.base else cls
        for member, expected in rec.signatures:
            actual = shape(_lookup(base, member))
            if actual not in accepted(expected):
                where = rec.base or rec.target
                _refuse(entry, f"signature of {where}.{member} is {actual}, expected {' or '.join(accepted(expected))}")
                return
    sites = []
    for member, value in values.items():
        sites.append(_Site(cls, member, cls.__dict__.get(member, _MISSING), value))
        setattr(cls, member, value)
    entry.sites = sites
    _refresh_abstract(cls)
    entry.state, entry.detail = State.APPLIED, ""
    logger.debug("injection %s applied to %s (%s)", rec.id, rec.target, ", ".join(rec.members))


def _refresh_abstract(owner: Any) -> None:
    """An ABC computes ``__abstractmethods__`` once, at class creation: recompute it after members
    were injected or removed, so an injected abstract member makes the class instantiable and a
    revert makes it abstract again -- for ``owner`` and every subclass of it, parents first (a
    host's class that subclasses both an atom layer and the host's abstract base inherits the
    members injected into the atom layer)."""
    if not isinstance(owner, type):
        return
    todo, seen = [owner], set()
    while todo:
        klass = todo.pop(0)
        if klass in seen:
            continue
        seen.add(klass)
        if hasattr(klass, "__abstractmethods__"):
            abc.update_abstractmethods(klass)
        todo.extend(klass.__subclasses__())


def apply_to_class(record: Injection, cls: type) -> Status:
    """Inject ``record`` into ``cls`` now -- the class-decorator form, usable while ``cls``'s
    module is still executing. Explicit: raises :class:`PatchError` if it cannot apply."""
    target = f"{cls.__module__}:{cls.__qualname__}"
    if target != record.target:
        raise PatchError(f"injection {record.id} targets {record.target}, not {target}")
    with _lock:
        entry = _entries.get(record.id)
        if entry is None or entry.record is not record:
            entry = _entries[record.id] = _Entry(record)
        entry.explicit = True
        _apply_now(entry, cls)
        return status(record)


# -- revert / query --------------------------------------------------------------------------


def revert(record: Record) -> bool:
    """Undo ``record``: True if something was restored. Safe to call any number of times."""
    with _lock:
        entry = _entries.get(record.id)
        if entry is None or entry.record is not record:
            return False
        restored = False
        for site in reversed(entry.sites):
            if site.holds_ours():
                if site.original is _MISSING:
                    delattr(site.owner, site.name)
                else:
                    setattr(site.owner, site.name, site.original)
                _refresh_abstract(site.owner)
                restored = True
            else:
                warn_once(
                    f"revert:{record.id}:{site.name}",
                    f"patch {record.id}: {site.name} was changed by someone else since; left as is",
                    logger,
                )
        entry.sites = []
        entry.original = _MISSING
        if entry.state in (State.APPLIED, State.ARMED):
            entry.state, entry.detail = State.NOT_REQUESTED, "reverted"
        return restored


def is_applied(record: Record) -> bool:
    with _lock:
        entry = _entries.get(record.id)
        return bool(
            entry is not None
            and entry.record is record
            and entry.state is State.APPLIED
            and entry.sites
            and all(s.holds_ours() for s in entry.sites)
        )


def status(record: Record) -> Status:
    """Where ``record`` stands now (for a never-requested record: whether env would disable it)."""
    with _lock:
        entry = _entries.get(record.id)
        if entry is None or entry.record is not record or entry.state is State.NOT_REQUESTED:
            why = disabled_by(record)
            if why is not None:
                return Status(State.DISABLED, f"by {why}")
            return Status(State.NOT_REQUESTED, entry.detail if entry else "")
        if entry.state is State.APPLIED and not all(s.holds_ours() for s in entry.sites):
            return Status(State.APPLIED, "but a site was changed by someone else since")
        return Status(entry.state, entry.detail)
