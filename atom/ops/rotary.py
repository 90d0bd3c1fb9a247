"""Rotary position embedding (RoPE) applied in place to query and key.

``cos_sin_cache`` is ``[max_position, rotary_dim]`` laid out as ``cat(cos, sin)``, each
``rotary_dim // 2`` wide (vLLM's convention). For rotary pair ``i`` with angle ``(cos_i, sin_i)``
at the token's position: ``(x1, x2) -> (x1*cos - x2*sin, x2*cos + x1*sin)``, where the pair is
``(x[i], x[i + r/2])`` in NeoX style and ``(x[2i], x[2i+1])`` in GPT-J style. Only the first
``rotary_dim`` dims of each head rotate (partial rotary); the rest are left untouched.

Backends: torch reference, Triton (shared with the fused QK-norm kernel), AITER
(``rope_cached_positions_2c_fwd_inplace``).
"""

from __future__ import annotations

from typing import Optional

import torch

from atom.ops._common import check_float, last_dim_contiguous
from atom.ops._dispatch import declare

__all__ = ["rotary_embedding", "ROTARY_EMBEDDING", "rope_reference_"]


def _heads_view(x: torch.Tensor, num_tokens: int, head_size: int) -> torch.Tensor:
    """``[T, H*hs]`` or ``[T, H, hs]`` -> a ``[T, H, hs]`` view sharing storage (in-place ops)."""
    if x.dim() == 3 and x.shape[0] == num_tokens and x.shape[2] == head_size:
        return x
    if x.dim() == 2 and x.shape[0] == num_tokens and x.shape[1] % head_size == 0:
        return x.view(num_tokens, x.shape[1] // head_size, head_size)
    raise ValueError(
        f"expected [{num_tokens}, heads*{head_size}] or [{num_tokens}, heads, {head_size}], "
        f"got {tuple(x.shape)}"
    )


def _check(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: Optional[torch.Tensor],
    cos_sin_cache: torch.Tensor,
    head_size: int,
    rotary_dim: int,
) -> None:
    if positions.dim() != 1 or positions.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"positions must be a 1-D int64/int32 tensor, got {tuple(positions.shape)} {positions.dtype}")
    if rotary_dim <= 0 or rotary_dim % 2 or rotary_dim > head_size:
        raise ValueError(f"rotary_dim must be even and in (0, head_size={head_size}], got {rotary_dim}")
    if cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] != rotary_dim:
        raise ValueError(f"cos_sin_cache must be [max_position, {rotary_dim}], got {tuple(cos_sin_cache.shape)}")
    check_float("cos_sin_cache", cos_sin_cache)
    check_float("query", query)
    _heads_view(query, positions.shape[0], head_size)
    if key is not None:
        if key.dtype != query.dtype:
            raise ValueError(f"key dtype {key.dtype} != query dtype {query.dtype}")
        _heads_view(key, positions.shape[0], head_size)


def rope_reference_(
    positions: torch.Tensor,
    x: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    rotary_dim: int,
    is_neox: bool,
) -> None:
    """Rotate the first ``rotary_dim`` dims of every head of ``x`` ``[T, H, D]`` in place (fp32 math)."""
    half = rotary_dim // 2
    cos, sin = cos_sin_cache.index_select(0, positions.long()).float().split(half, dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    rot = x[..., :rotary_dim].float()
    if is_neox:
        x1, x2 = rot[..., :half], rot[..., half:]
    else:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    if is_neox:
        new = torch.cat((o1, o2), dim=-1)
    else:
        new = torch.stack((o1, o2), dim=-1).flatten(-2)
    x[..., :rotary_dim] = new.to(x.dtype)


# -- the op, declared by its torch reference ---------------------------------------------------
@declare("rotary_embedding", doc="RoPE (NeoX / GPT-J, partial rotary) on query and key, in place")
def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: Optional[torch.Tensor],
    cos_sin_cache: torch.Tensor,
    head_size: int,
    rotary_dim: int,
    is_neox: bool,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Apply RoPE to ``query`` and ``key`` **in place**; returns ``(query, key)`` (the same tensors).

    Args:
        positions: ``[T]`` int64/int32 token positions (index rows of ``cos_sin_cache``).
        query: ``[T, Hq*head_size]`` or ``[T, Hq, head_size]``; may be a strided view (e.g. a
            slice of a fused qkv output) as long as the last dim is contiguous.
        key: like ``query`` with its own head count, or None.
        cos_sin_cache: ``[max_position, rotary_dim]`` = ``cat(cos, sin)``; any float dtype
            (the rotation is computed in fp32).
        head_size: per-head dim.
        rotary_dim: leading dims of each head that rotate (even, <= head_size).
        is_neox: NeoX (rotate halves) when True, GPT-J (interleaved pairs) when False.
    """
    _check(positions, query, key, cos_sin_cache, head_size, rotary_dim)
    t = positions.shape[0]
    rope_reference_(positions, _heads_view(query, t, head_size), cos_sin_cache, rotary_dim, is_neox)
    if key is not None:
        rope_reference_(positions, _heads_view(key, t, head_size), cos_sin_cache, rotary_dim, is_neox)
    return query, key


ROTARY_EMBEDDING = rotary_embedding
# While torch.compile traces (ATOM_COMPILE_ELEMENTWISE=inductor): the reference as it is.
rotary_embedding.inductor(rotary_embedding.reference)


# -- Triton -----------------------------------------------------------------------------------
def _rope_in_place_supports(positions: torch.Tensor, query: torch.Tensor, key: Optional[torch.Tensor],
                            cos_sin_cache: torch.Tensor, *args: object, **kwargs: object) -> Optional[str]:
    # The kernels update q/k in place through their strides; they cannot copy a gathered input back.
    return last_dim_contiguous(query, key, cos_sin_cache)


@rotary_embedding.triton(supports=_rope_in_place_supports)
def _rope_triton(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: Optional[torch.Tensor],
    cos_sin_cache: torch.Tensor,
    head_size: int,
    rotary_dim: int,
    is_neox: bool,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    from atom.ops import fused_qk_norm_rope_cache_triton as kernels

    _check(positions, query, key, cos_sin_cache, head_size, rotary_dim)
    t = positions.shape[0]
    kernels.qk_norm_rope_cache_launch(
        _heads_view(query, t, head_size),
        None if key is None else _heads_view(key, t, head_size),
        positions, cos_sin_cache, rotary_dim, is_neox,
    )
    return query, key


# -- AITER (ROCm) ---------------------------------------------------------------------------
@rotary_embedding.aiter(supports=_rope_in_place_supports)  # aiter also rotates in place through views
def _rope_aiter(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: Optional[torch.Tensor],
    cos_sin_cache: torch.Tensor,
    head_size: int,
    rotary_dim: int,
    is_neox: bool,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    import aiter

    _check(positions, query, key, cos_sin_cache, head_size, rotary_dim)
    t = positions.shape[0]
    half = rotary_dim // 2
    # aiter takes cos and sin separately as [max_pos, 1, 1, r/2] in the activation dtype, and
    # (s, b, h, d) inputs: s=1, b=tokens. rotate_style 0 = NeoX, 1 = GPT-J.
    cos = cos_sin_cache[:, :half].to(query.dtype).contiguous().view(-1, 1, 1, half)
    sin = cos_sin_cache[:, half:].to(query.dtype).contiguous().view(-1, 1, 1, half)
    q4 = _heads_view(query, t, head_size).unsqueeze(0)[..., :rotary_dim]
    pos = positions.view(1, t)
    style = 0 if is_neox else 1
    if key is None:
        aiter.rope_cached_positions_fwd_inplace(q4, cos, sin, pos, style, True, False)
    else:
        k4 = _heads_view(key, t, head_size).unsqueeze(0)[..., :rotary_dim]
        aiter.rope_cached_positions_2c_fwd_inplace(
            q4, k4, cos, sin, pos, style, reuse_freqs_front_part=True, nope_first=False
        )
    return query, key
