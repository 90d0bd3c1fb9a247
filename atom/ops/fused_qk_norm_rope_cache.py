"""Qwen3-style fused attention prologue: per-head RMSNorm of q and k, RoPE, KV-cache write.

Given the q/k/v split of the qkv projection, one kernel does, per token:

1. ``q = rms_norm(q, q_norm_weight)``, ``k = rms_norm(k, k_norm_weight)`` over ``head_dim``;
2. RoPE on q and k (NeoX or GPT-J, partial rotary);
3. k and v written into the paged NHD cache at ``slot_mapping`` (fp8 with per-tensor scales
   optional; slot < 0 skipped);

and leaves the normed + rotated q and k in place. Numerically it is exactly the unfused
sequence ``rms_norm`` -> ``rotary_embedding`` -> ``reshape_and_cache`` (the torch reference *is*
that composition, and the kernel rounds to the activation dtype where the sequence does).

Backends: torch reference, Triton (one kernel), and AITER as the composition of the AITER
kernels atom binds for the three steps (``rmsnorm2d_fwd`` for q and k,
``rope_cached_positions_2c_fwd_inplace``, ``reshape_and_cache_flash``): four launches instead of
one, with each step's semantics those of atom's own ``rms_norm`` / ``rotary_embedding`` /
``reshape_and_cache`` AITER bindings. atom does not bind AITER's single-kernel variants because
neither computes this op on this cache: ``fused_qk_norm_rope_cache_quant_shuffle`` writes an
x-packed/shuffled cache (``[B, H, D/x, page, x]`` keys), and the Triton
``fused_qkv_split_qk_norm_rope_cache`` normalises with a Gemma-style ``(1 + w)`` weight in the
releases that take an NHD cache. On ROCm ``auto`` picks the AITER composition when all three
steps accept the arguments, else the Triton kernel.
"""

from __future__ import annotations

from typing import Optional

import torch

from atom.ops._common import (
    check_float,
    check_paged_cache,
    check_scale,
    check_slot_mapping,
    kv_cache_is_fp8,
    last_dim_contiguous,
)
from atom.ops._dispatch import declare
from atom.ops.kv_cache import RESHAPE_AND_CACHE
from atom.ops.rmsnorm import RMS_NORM
from atom.ops.rotary import ROTARY_EMBEDDING

__all__ = ["fused_qk_norm_rope_cache", "FUSED_QK_NORM_ROPE_CACHE", "split_qkv"]


def split_qkv(
    qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Views ``q [T, Hq, D]``, ``k [T, Hkv, D]``, ``v [T, Hkv, D]`` of a ``[T, (Hq+2Hkv)*D]`` qkv output."""
    t = qkv.shape[0]
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    return (
        q.view(t, num_heads, head_dim),
        k.view(t, num_kv_heads, head_dim),
        v.view(t, num_kv_heads, head_dim),
    )


def _check(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_norm_weight: torch.Tensor,
    k_norm_weight: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_cache_dtype: str,
    k_scale: Optional[torch.Tensor],
    v_scale: Optional[torch.Tensor],
    rotary_dim: Optional[int],
) -> tuple[int, bool]:
    """Validate (same for every backend); returns ``(rotary_dim, fp8_cache)``."""
    check_float("q", q)
    if q.dim() != 3 or k.dim() != 3 or v.shape != k.shape:
        raise ValueError(
            f"q must be [T, Hq, D] and k, v [T, Hkv, D]; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    t, _, d = q.shape
    if k.shape[0] != t or k.shape[2] != d:
        raise ValueError(f"k {tuple(k.shape)} does not match q {tuple(q.shape)}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q/k/v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    for name, w in (("q_norm_weight", q_norm_weight), ("k_norm_weight", k_norm_weight)):
        if w.shape != (d,):
            raise ValueError(f"{name} must be [{d}], got {tuple(w.shape)}")
    if positions.dim() != 1 or positions.shape[0] != t or positions.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"positions must be [{t}] int64/int32, got {tuple(positions.shape)} {positions.dtype}")
    check_float("cos_sin_cache", cos_sin_cache)
    rotary_dim = d if rotary_dim is None else rotary_dim
    if rotary_dim <= 0 or rotary_dim % 2 or rotary_dim > d:
        raise ValueError(f"rotary_dim must be even and in (0, {d}], got {rotary_dim}")
    if cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] != rotary_dim:
        raise ValueError(f"cos_sin_cache must be [max_position, {rotary_dim}], got {tuple(cos_sin_cache.shape)}")
    check_paged_cache(key_cache, value_cache, k.shape[1], d)
    check_slot_mapping(slot_mapping, t)
    fp8 = kv_cache_is_fp8(kv_cache_dtype, key_cache, value_cache)
    if fp8:
        check_scale("k_scale", k_scale, q)
        check_scale("v_scale", v_scale, q)
    return rotary_dim, fp8


# -- the op, declared by its torch reference: exactly the unfused composition -------------------
@declare("fused_qk_norm_rope_cache",
         doc="per-head RMSNorm(q, k) + RoPE + paged KV-cache write (fp8 optional), one kernel")
def fused_qk_norm_rope_cache(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_norm_weight: torch.Tensor,
    k_norm_weight: torch.Tensor,
    eps: float,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_cache_dtype: str = "auto",
    k_scale: Optional[torch.Tensor] = None,
    v_scale: Optional[torch.Tensor] = None,
    rotary_dim: Optional[int] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head RMSNorm + RoPE of q and k (in place) and k/v paged-cache write, fused.

    Args:
        q: ``[T, Hq, D]``; k, v: ``[T, Hkv, D]``. Strided views are fine (e.g. from
            :func:`split_qkv`) as long as the last dim is contiguous.
        q_norm_weight, k_norm_weight: ``[D]`` RMSNorm weights; ``eps`` their epsilon.
        positions: ``[T]`` int64 positions; ``cos_sin_cache``: ``[max_pos, rotary_dim]`` =
            ``cat(cos, sin)``; ``is_neox``: NeoX vs GPT-J pairing; ``rotary_dim`` defaults to D.
        key_cache, value_cache: ``[num_blocks, block_size, Hkv, D]`` (NHD), any strides.
        slot_mapping: ``[T]`` int64; negative = padding (q/k still updated, cache not).
        kv_cache_dtype, k_scale, v_scale: as in :func:`atom.ops.kv_cache.reshape_and_cache`.

    Returns:
        ``(q, k)``: the input tensors, now normed and rotated.
    """
    rotary_dim, _ = _check(
        q, k, v, q_norm_weight, k_norm_weight, positions, cos_sin_cache, key_cache, value_cache,
        slot_mapping, kv_cache_dtype, k_scale, v_scale, rotary_dim,
    )
    qn = RMS_NORM.reference(q, q_norm_weight, eps)
    kn = RMS_NORM.reference(k, k_norm_weight, eps)
    ROTARY_EMBEDDING.reference(positions, qn, kn, cos_sin_cache, q.shape[2], rotary_dim, is_neox)
    RESHAPE_AND_CACHE.reference(kn, v, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale)
    q.copy_(qn)
    k.copy_(kn)
    return q, k


FUSED_QK_NORM_ROPE_CACHE = fused_qk_norm_rope_cache


# -- Triton: one kernel ------------------------------------------------------------------------
def _fused_triton_supports(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_norm_weight: torch.Tensor,
    k_norm_weight: torch.Tensor,
    eps: float,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    *args: object,
    **kwargs: object,
) -> Optional[str]:
    return last_dim_contiguous(q, k, v, q_norm_weight, k_norm_weight, cos_sin_cache, key_cache, value_cache)


@fused_qk_norm_rope_cache.triton(supports=_fused_triton_supports)
def _fused_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_norm_weight: torch.Tensor,
    k_norm_weight: torch.Tensor,
    eps: float,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_cache_dtype: str = "auto",
    k_scale: Optional[torch.Tensor] = None,
    v_scale: Optional[torch.Tensor] = None,
    rotary_dim: Optional[int] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    from atom.ops import fused_qk_norm_rope_cache_triton as kernels

    rotary_dim, fp8 = _check(
        q, k, v, q_norm_weight, k_norm_weight, positions, cos_sin_cache, key_cache, value_cache,
        slot_mapping, kv_cache_dtype, k_scale, v_scale, rotary_dim,
    )
    kernels.qk_norm_rope_cache_launch(
        q, k, positions, cos_sin_cache, rotary_dim, is_neox,
        q_weight=q_norm_weight, k_weight=k_norm_weight, eps=eps,
        v=v, key_cache=key_cache, value_cache=value_cache, slot_mapping=slot_mapping,
        fp8=fp8, k_scale=k_scale, v_scale=v_scale,
    )
    return q, k


# -- AITER (ROCm): atom's three AITER step bindings -----------------------------------------------
def _fused_aiter_supports(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_norm_weight: torch.Tensor,
    k_norm_weight: torch.Tensor,
    eps: float,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_cache_dtype: str = "auto",
    k_scale: Optional[torch.Tensor] = None,
    v_scale: Optional[torch.Tensor] = None,
    rotary_dim: Optional[int] = None,
) -> Optional[str]:
    """The first reason one of the three AITER steps cannot take these arguments."""
    d = q.shape[-1]
    rows = q[:0].reshape(0, d)  # shape/dtype stand-in: the norm runs on contiguous rows
    return (
        RMS_NORM.unsupported("aiter", rows, q_norm_weight, eps)
        or RMS_NORM.unsupported("aiter", rows, k_norm_weight, eps)
        or ROTARY_EMBEDDING.unsupported(
            "aiter", positions, q, k, cos_sin_cache, d, d if rotary_dim is None else rotary_dim, is_neox
        )
        or RESHAPE_AND_CACHE.unsupported(
            "aiter", k, v, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale
        )
    )


@fused_qk_norm_rope_cache.aiter(supports=_fused_aiter_supports)
def _fused_aiter(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_norm_weight: torch.Tensor,
    k_norm_weight: torch.Tensor,
    eps: float,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_cache_dtype: str = "auto",
    k_scale: Optional[torch.Tensor] = None,
    v_scale: Optional[torch.Tensor] = None,
    rotary_dim: Optional[int] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    rotary_dim, _ = _check(
        q, k, v, q_norm_weight, k_norm_weight, positions, cos_sin_cache, key_cache, value_cache,
        slot_mapping, kv_cache_dtype, k_scale, v_scale, rotary_dim,
    )
    d = q.shape[-1]
    for x, w in ((q, q_norm_weight), (k, k_norm_weight)):
        x.copy_(RMS_NORM.run("aiter", x.reshape(-1, d), w, eps).view_as(x))
    ROTARY_EMBEDDING.run("aiter", positions, q, k, cos_sin_cache, d, rotary_dim, is_neox)
    RESHAPE_AND_CACHE.run("aiter", k, v, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale)
    return q, k
