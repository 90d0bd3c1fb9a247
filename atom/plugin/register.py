"""Host-side choices that atom makes per process: which attention backend, which parallel groups.

Decided at call time from the arguments and the environment; nothing here is a process-global
mode flag.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Optional

from atom import envs

#: atom's attention backends for vLLM, by kind. A kind without an entry makes the platform
#: return vLLM's own choice and say why once.
ATTENTION_BACKENDS: dict[str, str] = {
    "mha": "atom.plugin.attention_mha.ATOMAttentionBackend",
    "mla": "atom.plugin.attention_mla.ATOMMLABackend",
}


def select_attention_backend(attn_selector_config: Any) -> tuple[Optional[str], str]:
    """(atom backend qualname or None, reason) for one vLLM ``AttentionSelectorConfig``.

    vLLM asks once per distinct layer configuration (it caches the answer), so a model may mix
    atom's backend (decoder layers it supports) with vLLM's (e.g. encoder or cross attention).
    """
    if envs.ATOM_DISABLE_VLLM_PLUGIN_ATTENTION:
        return None, "disabled by ATOM_DISABLE_VLLM_PLUGIN_ATTENTION=1"
    kind = "mla" if getattr(attn_selector_config, "use_mla", False) else "mha"
    backend = ATTENTION_BACKENDS.get(kind)
    if backend is None:
        return None, f"atom has no {kind.upper()} attention backend yet"
    if getattr(attn_selector_config, "use_sparse", False):
        return None, "sparse attention is not supported by atom"
    module_name, _, cls_name = backend.rpartition(".")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:  # no (importable) vLLM: nothing to select for
        return None, f"atom's {kind.upper()} backend cannot be imported ({exc})"
    from atom.plugin.attention import apply_decorators, unsupported_reasons

    # The decorators make atom's classes a vLLM backend: applied now that vLLM asks (idempotent).
    not_applied = apply_decorators(kind)
    if not_applied is not None:
        return None, not_applied
    reasons = unsupported_reasons(getattr(module, cls_name), attn_selector_config)
    if reasons:
        return None, f"atom's {kind.upper()} backend does not support this layer: {', '.join(reasons)}"
    taken = module.register()
    if taken is not None:
        return None, taken
    # A backend that needs vLLM's layers patched (MLA: atom.plugin.vllm.mla_patch) applies its
    # injections now and says why not when the patches are off or refused.
    enable = getattr(module, "enable_plugin_mode", None)
    blocked = enable() if enable is not None else None
    if blocked is not None:
        return None, blocked
    return backend, f"atom {kind.upper()} backend"


@dataclass(frozen=True)
class ParallelGroups:
    """vLLM's own process groups, reused by atom (never a second process group)."""

    tp_rank: int
    tp_size: int
    tp_group: Any  # vllm.distributed.parallel_state.GroupCoordinator
    ep_group: Any = None


def vllm_parallel_groups() -> ParallelGroups:
    """The tensor/expert-parallel groups vLLM already initialised for this worker."""
    from vllm.distributed import parallel_state as ps

    tp = ps.get_tp_group()
    ep = ps.get_ep_group() if hasattr(ps, "get_ep_group") and getattr(ps, "_EP", None) is not None else None
    return ParallelGroups(tp_rank=tp.rank_in_group, tp_size=tp.world_size, tp_group=tp, ep_group=ep)
