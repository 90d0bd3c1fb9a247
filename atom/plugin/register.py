"""Host-side choices that atom makes per process: which attention backend, which parallel groups.

Decided at call time from the arguments and the environment; nothing here is a process-global
mode flag.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from atom import envs

#: atom's attention backends for vLLM, by kind. Empty until atom's backends land; the platform
#: then returns vLLM's own choice and says why once.
ATTENTION_BACKENDS: dict[str, str] = {}


def select_attention_backend(attn_selector_config: Any) -> tuple[Optional[str], str]:
    """(atom backend qualname or None, reason) for one vLLM ``AttentionSelectorConfig``."""
    if envs.ATOM_DISABLE_VLLM_PLUGIN_ATTENTION:
        return None, "disabled by ATOM_DISABLE_VLLM_PLUGIN_ATTENTION=1"
    kind = "mla" if getattr(attn_selector_config, "use_mla", False) else "mha"
    backend = ATTENTION_BACKENDS.get(kind)
    if backend is None:
        return None, f"atom has no {kind.upper()} attention backend yet"
    if getattr(attn_selector_config, "use_sparse", False):
        return None, "sparse attention is not supported by atom"
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
