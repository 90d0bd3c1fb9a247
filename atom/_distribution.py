"""Is the ``atom`` this process imports atom-vllm's own, and is another ``atom`` installed too?

The import name ``atom`` is not ours alone: PyPI's ``atom`` ("Memory efficient Python objects", a
dependency of enaml and others) installs a package of that name as well. Two distributions that
install one import package into one ``site-packages`` overwrite each other's files: whichever
was installed last owns ``atom/__init__.py``, and uninstalling either one deletes files the other
needs. Installed in two ``sys.path`` entries, the first hides the other. Either way one of them
is broken, silently, so atom stays off (``register``) and ``doctor`` says what to do.

What ``check()`` looks at, cheaply (vLLM calls the plugin hooks in every process): the ``atom``
module's ``__distribution__`` marker, one directory listing against this distribution's RECORD,
and one stat per ``sys.path`` entry. Which distribution owns a foreign ``atom`` is looked up only
once one is found. Imports neither vLLM nor torch, nor anything from ``atom``: it must run when
``atom/__init__.py`` is someone else's.
"""

from __future__ import annotations

import functools
import importlib.metadata
import json
import os
import re
import sys
import urllib.parse
from pathlib import Path
from typing import NamedTuple, Optional

#: The distribution name (pyproject.toml ``[project] name``; ``atom.__distribution__``).
DISTRIBUTION = "atom-vllm"

_FIX = ("atom-vllm and {owners} cannot share one environment: install atom-vllm in an environment "
        "without {owners}, or remove both and reinstall atom-vllm alone "
        "(`pip uninstall {names} atom-vllm`, then `pip install` atom-vllm again)")


class Provenance(NamedTuple):
    """Where the running atom comes from. ``ok`` False: atom must stay off; ``reason`` is one
    line (where atom runs from, or what is wrong and what to do)."""

    ok: bool
    reason: str
    version: Optional[str]  # the installed distribution's version; None when not installed
    location: str  # the directory atom's code runs from


@functools.lru_cache(maxsize=None)
def check() -> Provenance:
    """Provenance of the running ``atom`` package (computed once per process)."""
    here = Path(__file__).resolve().parent
    module = sys.modules.get("atom")
    dist = _installed()
    version = dist.version if dist is not None else None

    def refuse(what: str, owners: list[str]) -> Provenance:
        return Provenance(False, f"{what}; {_fix(owners)}", version, str(here))

    # 1. The `atom` module itself: another distribution's atom/__init__.py was installed over
    #    ours, or deleted when that distribution was uninstalled (atom is then a namespace
    #    package), and this is atom's code running under a package that is not atom-vllm's.
    if getattr(module, "__distribution__", None) != DISTRIBUTION:
        owners = _owners(here.parent)
        if getattr(module, "__file__", None) is None and not owners:
            return Provenance(False, f"atom-vllm's {here / '__init__.py'} is missing (deleted with another "
                                     "distribution that had installed `atom` into the same place?): reinstall "
                                     "atom-vllm (`pip install --force-reinstall --no-deps` the same wheel)",
                              version, str(here))
        return refuse(f"another `atom` package is installed over atom-vllm's ({here / '__init__.py'} is "
                      "not atom-vllm's)", owners)

    editable = dist is not None and _is_editable(dist)
    installed_at = _package_dir(dist) if dist is not None else None
    # 2. Both installed into one site-packages: the other's files sit in our package directory.
    if installed_at == here and dist.files is not None and not editable:
        ours = {p.parts[1] for p in dist.files if len(p.parts) > 1 and p.parts[0] == "atom"}
        foreign = sorted(set(os.listdir(here)) - ours - {"__pycache__"})
        if foreign:
            return refuse(f"another distribution installed files into atom-vllm's package directory {here} "
                          f"({', '.join(foreign[:4])}{', ...' if len(foreign) > 4 else ''})", _owners(here.parent))

    # 3. Another `atom` package elsewhere on sys.path, hidden behind this one. Another copy of
    #    atom-vllm (a checkout ahead of the installed wheel, as bench/gpu_run.sh runs) is fine.
    for entry in dict.fromkeys(sys.path):
        other = Path(entry or os.getcwd()) / "atom"
        try:
            foreign = (other / "__init__.py").is_file() and other.resolve() != here and not _declares_ours(other)
        except OSError:  # an unreadable sys.path entry holds nothing Python could import either
            continue
        if foreign:
            return refuse(f"another `atom` package is installed at {other}", _owners(other.parent))

    if dist is None:
        return Provenance(False, f"atom-vllm is not installed (atom runs from {here}): vLLM finds atom only "
                                 "through an installed distribution's entry points; install it (README.md, "
                                 "\"Installing atom into a vLLM environment\")", None, str(here))
    if installed_at in (None, here):
        return Provenance(True, f"atom-vllm {version} {'(editable) ' if editable else ''}from {here}", version, str(here))
    running = getattr(module, "__version__", "?")
    return Provenance(True, f"atom {running} runs from {here}, ahead of atom-vllm {version} "
                            f"{'(editable) ' if editable else ''}installed at {installed_at}, whose entry points "
                            "vLLM loads", version, str(here))


def _installed() -> Optional[importlib.metadata.Distribution]:
    try:
        return importlib.metadata.distribution(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return None


def _direct_url(dist: importlib.metadata.Distribution) -> dict:
    """PEP 610 ``direct_url.json`` (written by pip for installs from a path, URL or editable)."""
    try:
        return json.loads(dist.read_text("direct_url.json") or "{}")
    except ValueError:
        return {}


def _is_editable(dist: importlib.metadata.Distribution) -> bool:
    return bool(_direct_url(dist).get("dir_info", {}).get("editable"))


def _package_dir(dist: importlib.metadata.Distribution) -> Optional[Path]:
    """The ``atom`` directory this distribution installed: the project folder's for an editable
    install (PEP 610 URL), next to its metadata otherwise."""
    if _is_editable(dist):
        url = _direct_url(dist).get("url", "")
        if not url.startswith("file:"):
            return None
        return (Path(urllib.parse.unquote(urllib.parse.urlparse(url).path)) / "atom").resolve()
    return Path(dist.locate_file("atom")).resolve()


def _declares_ours(package: Path) -> bool:
    """Whether the ``atom`` package folder ``package`` is a copy of atom-vllm's: its marker, or
    (a copy from before the marker, e.g. an older wheel behind a checkout) atom's entry-point
    module."""
    text = (package / "__init__.py").read_text(errors="replace")
    return f'__distribution__ = "{DISTRIBUTION}"' in text or (package / "plugin" / "vllm" / "register.py").is_file()


def _owners(site: Path) -> list[str]:
    """``"name version"`` of each distribution in ``site``, other than atom-vllm, that installs a
    top-level ``atom`` (read from RECORD: only called once a foreign ``atom`` was found)."""
    owners = set()
    for dist in importlib.metadata.distributions(path=[str(site)]):
        name = dist.metadata["Name"] or "?"
        if re.sub(r"[-_.]+", "-", name).lower() == DISTRIBUTION:
            continue
        top = (dist.read_text("top_level.txt") or "").split()
        if "atom" in top or any(p.parts[0] == "atom" for p in dist.files or () if p.parts):
            owners.add(f"{name} {dist.version}")
    return sorted(owners)


def _fix(owners: list[str]) -> str:
    if not owners:
        return _FIX.format(owners="the other `atom`", names="<its distribution>")
    return _FIX.format(owners=" and ".join(owners), names=" ".join(o.split()[0] for o in owners))
