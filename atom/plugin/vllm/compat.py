"""The differences between the vLLM releases atom supports (0.26 on the GPU, 0.32/0.33 on CPU),
in one place. Each function answers one difference; tests/plugin/test_compat.py has a test per
difference against the installed vLLM.

Facts (``../shared/reference/vllm_interfaces.md``):
* ``VLLM_TARGET_DEVICE=cpu`` short-circuits platform plugins from 0.33 (0.26 still asks them).
* ``AttentionBackend.get_kv_cache_shape`` is required up to 0.28 and gone from 0.29 (kv-cache
  layouts instead); ``CommonAttentionMetadata.seq_lens_cpu`` likewise. So the tensor an attention
  impl receives is the backend's own shape up to 0.28 and vLLM's logical ``[B, H, N, Dk+Dv]``
  view from 0.29 (``kv_cache_as_nhd``).
* Backends that set ``forward_includes_kv_cache_update = False`` get their cache written through
  ``impl.do_kv_cache_update`` before ``forward``; a release without that split would need the
  write inside ``forward`` (``layer_calls_kv_cache_update``).
* ``FusedMoE`` is a factory function in 0.26 and a ``FusedMoEFactory`` from 0.27.
* The deferred post-load gate is an isinstance check in 0.26 and ``is_deferred_attention_layer``
  by 0.30.
* vLLM's ``MLAAttention`` layer lives in ``vllm.model_executor.layers.attention`` in 0.32 and
  in ``vllm.attention.layer`` in older releases (``mla_attention_layer_module``).
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


def kv_cache_as_nhd(kv_cache: Any, head_size: int) -> tuple[Any, Any]:
    """(key_cache, value_cache), each ``[num_blocks, block_size, num_kv_heads, head_size]`` (NHD,
    unit-stride last dim), as views of the per-layer tensor vLLM binds to an attention layer.

    <= 0.28: vLLM allocated the shape atom's backend returned from ``get_kv_cache_shape``,
    ``(2, num_blocks, block_size, num_kv_heads, head_size)``: key and value are its two halves.
    >= 0.29: vLLM hands every backend the logical ``[num_blocks, num_kv_heads, block_size,
    head_size_k + head_size_v]`` view, physically permuted by the resolved ``KVCacheLayout``;
    swapping the head and token axes and splitting the content axis gives NHD views whatever the
    layout (atom's kernels take any block/token/head strides).
    """
    if has_get_kv_cache_shape():
        if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
            raise ValueError(f"expected a (2, blocks, block_size, kv_heads, head_size) cache, got {tuple(kv_cache.shape)}")
        return kv_cache[0], kv_cache[1]
    if kv_cache.dim() != 4:
        raise ValueError(f"expected a [blocks, kv_heads, block_size, 2*head_size] cache view, got {tuple(kv_cache.shape)}")
    nhd = kv_cache.transpose(1, 2)
    return nhd[..., :head_size], nhd[..., head_size:]


def layer_calls_kv_cache_update() -> bool:
    """True where vLLM's ``Attention`` layer honours ``forward_includes_kv_cache_update = False``
    by calling ``impl.do_kv_cache_update`` itself before ``impl.forward``."""
    from vllm.v1.attention.backend import AttentionBackend

    return hasattr(AttentionBackend, "forward_includes_kv_cache_update")


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


def mla_attention_layer_module() -> str:
    """Module defining vLLM's ``MLAAttention`` layer (the latent-attention counterpart of
    ``Attention``; taken out of ``vllm.attention.layer`` together with it)."""
    for name in ("vllm.model_executor.layers.attention.mla_attention",
                 "vllm.model_executor.layers.attention", "vllm.attention.layer"):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(module, "MLAAttention"):
            return name
    raise ImportError("vLLM's MLAAttention layer was not found in any known module")


def selector_config_cls() -> type:
    """``AttentionSelectorConfig`` (``vllm.v1.attention.selector`` from 0.14)."""
    from vllm.v1.attention.selector import AttentionSelectorConfig

    return AttentionSelectorConfig


def compilation_mode(vllm_config: Any) -> Any:
    """``compilation_config.mode`` (an IntEnum), or the older ``level``."""
    cc = vllm_config.compilation_config
    return getattr(cc, "mode", getattr(cc, "level", 0))
