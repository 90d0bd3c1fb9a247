"""atom's logger: ``logging.getLogger("atom")``, formatted like vLLM's, one line per decision."""

from __future__ import annotations

import logging
import os
import sys

_FORMAT = "(%(processName)s pid=%(process)d) %(levelname)s %(asctime)s [atom] %(message)s"
_DATEFMT = "%m-%d %H:%M:%S"


def get_logger(name: str = "atom") -> logging.Logger:
    """The ``atom`` logger (or a child), with a stderr handler installed once.

    vLLM configures only its own ``vllm`` logger, so without a handler atom's INFO lines would be
    dropped. The level follows ``VLLM_LOGGING_LEVEL`` (default INFO) so one knob silences both.
    """
    root = logging.getLogger("atom")
    if not getattr(root, "_atom_configured", False):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(_FORMAT, _DATEFMT))
        root.addHandler(handler)
        root.setLevel(os.environ.get("VLLM_LOGGING_LEVEL", "INFO").upper())
        root.propagate = False
        root._atom_configured = True  # type: ignore[attr-defined]
    return logging.getLogger(name)


_warned: set[str] = set()


def warn_once(key: str, message: str, logger: logging.Logger | None = None) -> None:
    """Log ``message`` as a warning the first time ``key`` is seen in this process."""
    if key in _warned:
        return
    _warned.add(key)
    (logger or get_logger()).warning(message)


def info_once(key: str, message: str, logger: logging.Logger | None = None) -> None:
    if key in _warned:
        return
    _warned.add(key)
    (logger or get_logger()).info(message)
