"""Write new key/value tokens into atom's paged MHA KV cache.

Cache layout (NHD, the same as vLLM FlashAttention's): ``key_cache`` and ``value_cache`` are
``[num_blocks, block_size, num_kv_heads, head_size]`` each, usually ``kv[0]`` and ``kv[1]`` of a
``[2, num_blocks, block_size, num_kv_heads, head_size]`` tensor, so they may be strided views.
Token ``t`` goes to block ``slot_mapping[t] // block_size``, row ``slot_mapping[t] % block_size``;
``slot_mapping[t] < 0`` (padding) writes nothing.

``kv_cache_dtype="auto"`` stores the values converted to the cache dtype; ``"fp8"`` /
``"fp8_e4m3"`` stores ``clamp(x / scale, -448, 448)`` as float8_e4m3fn with per-tensor float32
scales ``k_scale`` / ``v_scale`` (one-element tensors, read on the device).

Backends: torch reference, Triton, AITER (``reshape_and_cache_flash``, its NHD-layout kernel).
"""

from __future__ import annotations

from typing import Optional

import torch

from atom.ops._common import (
    FP8_DTYPE,
    FP8_E4M3_MAX,
    check_float,
    check_paged_cache,
    check_scale,
    check_slot_mapping,
    kv_cache_is_fp8,
    last_dim_contiguous,
)
from atom.ops._dispatch import declare

__all__ = ["reshape_and_cache", "RESHAPE_AND_CACHE"]


def _check(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_cache_dtype: str,
    k_scale: Optional[torch.Tensor],
    v_scale: Optional[torch.Tensor],
) -> bool:
    """Validate (same for every backend); True when the cache is fp8."""
    check_float("key", key)
    if key.dim() != 3 or value.shape != key.shape or value.dtype != key.dtype:
        raise ValueError(
            f"key/value must both be [T, num_kv_heads, head_size] of one dtype, got "
            f"{tuple(key.shape)} {key.dtype} / {tuple(value.shape)} {value.dtype}"
        )
    check_paged_cache(key_cache, value_cache, key.shape[1], key.shape[2])
    check_slot_mapping(slot_mapping, key.shape[0])
    fp8 = kv_cache_is_fp8(kv_cache_dtype, key_cache, value_cache)
    if fp8:
        check_scale("k_scale", k_scale, key)
        check_scale("v_scale", v_scale, key)
    return fp8


def cache_reference_(
    x: torch.Tensor,
    cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    scale: Optional[torch.Tensor],
) -> None:
    """Scatter ``x`` ``[T, H, D]`` into ``cache`` rows by slot (skipping slots < 0); fp8 when ``scale``."""
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    block_size = cache.shape[1]
    rows = x[valid]
    if scale is not None:
        rows = (rows.float() / scale.float()).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(FP8_DTYPE)
    else:
        rows = rows.to(cache.dtype)
    cache[slots // block_size, slots % block_size] = rows


# -- the op, declared by its torch reference ---------------------------------------------------
@declare("reshape_and_cache", doc="write key/value tokens into the paged NHD KV cache (fp8 optional)")
def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_cache_dtype: str = "auto",
    k_scale: Optional[torch.Tensor] = None,
    v_scale: Optional[torch.Tensor] = None,
) -> None:
    """Write ``key``/``value`` ``[T, num_kv_heads, head_size]`` into the paged caches in place.

    Args:
        key, value: new tokens (last dim contiguous for the Triton path).
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_size]``, any
            strides (e.g. ``kv[0]``, ``kv[1]`` of one allocation).
        slot_mapping: ``[T]`` int64 (int32 accepted): ``block_id * block_size + offset``;
            negative = padding, skipped.
        kv_cache_dtype: ``"auto"`` or ``"fp8"`` / ``"fp8_e4m3"`` (float8_e4m3fn caches).
        k_scale, v_scale: per-tensor float32 scales (one element), required for fp8.
    """
    fp8 = _check(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale)
    cache_reference_(key, key_cache, slot_mapping, k_scale if fp8 else None)
    cache_reference_(value, value_cache, slot_mapping, v_scale if fp8 else None)


RESHAPE_AND_CACHE = reshape_and_cache


# -- Triton -----------------------------------------------------------------------------------
def _cache_strides_supported(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                             value_cache: torch.Tensor, *args: object, **kwargs: object) -> Optional[str]:
    return last_dim_contiguous(key, value, key_cache, value_cache)


@reshape_and_cache.triton(supports=_cache_strides_supported)
def _cache_triton(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_cache_dtype: str = "auto",
    k_scale: Optional[torch.Tensor] = None,
    v_scale: Optional[torch.Tensor] = None,
) -> None:
    from atom.ops import kv_cache_triton as kernels

    fp8 = _check(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale)
    kernels.reshape_and_cache_launch(
        key, value, key_cache, value_cache, slot_mapping, fp8, k_scale, v_scale
    )


# -- AITER (ROCm) ---------------------------------------------------------------------------
@reshape_and_cache.aiter(supports=_cache_strides_supported)
def _cache_aiter(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_cache_dtype: str = "auto",
    k_scale: Optional[torch.Tensor] = None,
    v_scale: Optional[torch.Tensor] = None,
) -> None:
    import aiter

    _check(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale)
    # aiter.reshape_and_cache expects its own x-packed 5-D layout; reshape_and_cache_flash is
    # the NHD one. It takes scale tensors even for "auto" (unused there).
    one = torch.ones(1, dtype=torch.float32, device=key.device)
    aiter.reshape_and_cache_flash(
        key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype,
        one if k_scale is None else k_scale, one if v_scale is None else v_scale,
    )
