"""The differences between the vLLM releases atom supports (0.26 on the GPU, 0.32/0.33 on CPU),
in one place. Each function answers one difference; tests/plugin/test_compat.py has a test per
difference against the installed vLLM.

Facts (``../shared/reference/vllm_interfaces.md``):
* ``VLLM_TARGET_DEVICE=cpu`` short-circuits platform plugins from 0.33 (0.26 still asks them).
* ``AttentionBackend.get_kv_cache_shape`` is required up to 0.28 and gone from 0.29 (kv-cache
  layouts instead); ``CommonAttentionMetadata.seq_lens_cpu`` likewise.
* ``FusedMoE`` is a factory function in 0.26 and a ``FusedMoEFactory`` from 0.27.
* The deferred post-load gate is an isinstance check in 0.26 and ``is_deferred_attention_layer``
  by 0.30.
"""

from __future__ import annotations

import importlib
from typing import Any

from packaging.version import Version

from atom.patches.versions import installed_vllm


def vllm_version() -> Version:
    found = installed_vllm()
    if found is None:
        raise RuntimeError("vLLM is not installed")
    return found[1]


def target_device_short_circuits_plugins() -> bool:
    """True where ``VLLM_TARGET_DEVICE=cpu`` makes vLLM skip platform plugins (>= 0.33)."""
    return vllm_version() >= Version("0.33")


def has_get_kv_cache_shape() -> bool:
    """True where attention backends must implement ``get_kv_cache_shape`` (<= 0.28)."""
    return vllm_version() < Version("0.29")


def attention_layer_module() -> str:
    """Module defining vLLM's ``Attention`` layer (moved out of ``vllm.attention`` ~0.17-0.19)."""
    for name in ("vllm.model_executor.layers.attention.attention", "vllm.attention.layer"):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(module, "Attention"):
            return name
    raise ImportError("vLLM's Attention layer was not found in any known module")


def selector_config_cls() -> type:
    """``AttentionSelectorConfig`` (``vllm.v1.attention.selector`` from 0.14)."""
    from vllm.v1.attention.selector import AttentionSelectorConfig

    return AttentionSelectorConfig


def compilation_mode(vllm_config: Any) -> Any:
    """``compilation_config.mode`` (an IntEnum), or the older ``level``."""
    cc = vllm_config.compilation_config
    return getattr(cc, "mode", getattr(cc, "level", 0))
