"""Dynamic fp8 (float8_e4m3fn) activation quantisation.

* :func:`per_token_quant_fp8`: one scale per row, ``scale = max(amax(|row|), eps) / 448``.
* :func:`per_block_quant_fp8`: one scale per ``1 x block`` group along the last dim
  (DeepSeek-style 1x128 blocks), same formula per group; a short last group is allowed.

``q = clamp(x / scale, -448, 448)`` rounded to nearest-even; dequantise with ``q * scale``.
Scales are float32, row-major: ``[..., 1]`` and ``[..., ceil(K / block)]``.

Backends: torch reference, Triton, AITER (``get_hip_quant(QuantType.per_Token / per_1x128)``).
"""

from __future__ import annotations

from typing import Optional

import torch

from atom.ops._common import FP8_AMAX_EPS, FP8_DTYPE, FP8_E4M3_MAX, check_float
from atom.ops._dispatch import declare

__all__ = ["per_token_quant_fp8", "per_block_quant_fp8", "PER_TOKEN_QUANT_FP8", "PER_BLOCK_QUANT_FP8"]


def _check(
    x: torch.Tensor, groups: int, out: Optional[torch.Tensor], scales: Optional[torch.Tensor]
) -> tuple[int, ...]:
    """Validate (same for every backend); returns the scales' shape."""
    check_float("x", x)
    if x.dim() == 0:
        raise ValueError("x must have at least one dim")
    scale_shape = (*x.shape[:-1], groups)
    if out is not None and (out.shape != x.shape or out.dtype != FP8_DTYPE):
        raise ValueError(f"out must be {tuple(x.shape)} float8_e4m3fn, got {tuple(out.shape)} {out.dtype}")
    if scales is not None and (tuple(scales.shape) != scale_shape or scales.dtype != torch.float32):
        raise ValueError(f"scales must be {scale_shape} float32, got {tuple(scales.shape)} {scales.dtype}")
    return scale_shape


def _check_block(block: int) -> None:
    if not isinstance(block, int) or block <= 0:
        raise ValueError(f"block must be a positive int, got {block!r}")


def _quant_rows(xf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise fp32 ``xf`` per row of its last dim: ``(q, scale[..., 1])``."""
    scale = xf.abs().amax(dim=-1, keepdim=True).clamp(min=FP8_AMAX_EPS) / FP8_E4M3_MAX
    q = (xf / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(FP8_DTYPE)
    return q, scale


def _finish(
    q: torch.Tensor, s: torch.Tensor, out: Optional[torch.Tensor], scales: Optional[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    if out is not None:
        q = out.copy_(q)
    if scales is not None:
        s = scales.copy_(s)
    return q, s


def _rows_view(t: torch.Tensor) -> Optional[torch.Tensor]:
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        return None
    try:
        return t.view(-1, t.shape[-1])
    except RuntimeError:
        return None


# -- per token ------------------------------------------------------------------------------
@declare("per_token_quant_fp8", doc="dynamic per-token fp8 e4m3 quantisation")
def per_token_quant_fp8(
    x: torch.Tensor, *, out: Optional[torch.Tensor] = None, scales: Optional[torch.Tensor] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-row fp8 quantisation of ``x`` ``[..., K]``.

    Returns:
        ``(q, scales)``: ``q`` float8_e4m3fn like ``x``; ``scales`` float32 ``[..., 1]`` with
        ``x ~= q * scales``. ``out`` / ``scales`` may be passed preallocated.
    """
    _check(x, 1, out, scales)
    q, s = _quant_rows(x.float())
    return _finish(q, s, out, scales)


PER_TOKEN_QUANT_FP8 = per_token_quant_fp8


def _per_token_triton_supports(
    x: torch.Tensor, *, out: Optional[torch.Tensor] = None, scales: Optional[torch.Tensor] = None
) -> Optional[str]:
    if out is not None and _rows_view(out) is None:
        return "out cannot be viewed as [rows, K] with a unit last stride"
    if scales is not None and not scales.is_contiguous():
        return "scales must be contiguous"
    return None


@per_token_quant_fp8.triton(supports=_per_token_triton_supports)
def _per_token_triton(
    x: torch.Tensor, *, out: Optional[torch.Tensor] = None, scales: Optional[torch.Tensor] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    from atom.ops import quant_triton as kernels

    scale_shape = _check(x, 1, out, scales)
    x2 = _rows_view(x)
    x2 = x.reshape(-1, x.shape[-1]).contiguous() if x2 is None else x2
    if out is None:
        out = torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device)
    if scales is None:
        scales = torch.empty(scale_shape, dtype=torch.float32, device=x.device)
    kernels.per_token_quant_launch(x2, _rows_view(out), scales.view(-1))
    return out, scales


@per_token_quant_fp8.aiter
def _per_token_aiter(
    x: torch.Tensor, *, out: Optional[torch.Tensor] = None, scales: Optional[torch.Tensor] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    from aiter import QuantType, get_hip_quant

    scale_shape = _check(x, 1, out, scales)
    q, s = get_hip_quant(QuantType.per_Token)(x.contiguous(), quant_dtype=FP8_DTYPE)
    return _finish(q, s.view(scale_shape), out, scales)


# -- per 1 x block group ------------------------------------------------------------------------
def _groups(x: torch.Tensor, block: int) -> int:
    return -(-x.shape[-1] // block)


@declare("per_block_quant_fp8", doc="dynamic per-1xblock-group fp8 e4m3 quantisation (DeepSeek 1x128)")
def per_block_quant_fp8(
    x: torch.Tensor,
    block: int = 128,
    *,
    out: Optional[torch.Tensor] = None,
    scales: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic fp8 quantisation of ``x`` ``[..., K]`` in ``1 x block`` groups along the last dim.

    Returns:
        ``(q, scales)``: ``q`` float8_e4m3fn like ``x``; ``scales`` float32
        ``[..., ceil(K / block)]`` (row-major), ``x[..., j] ~= q[..., j] * scales[..., j // block]``.
    """
    _check_block(block)
    k = x.shape[-1] if x.dim() else 0
    _check(x, _groups(x, block), out, scales)
    g = _groups(x, block)
    # Zero padding to whole groups leaves every group's amax unchanged.
    xf = torch.nn.functional.pad(x.float(), (0, g * block - k)).unflatten(-1, (g, block))
    q, s = _quant_rows(xf)
    return _finish(q.flatten(-2)[..., :k], s.squeeze(-1), out, scales)


PER_BLOCK_QUANT_FP8 = per_block_quant_fp8


def _per_block_triton_supports(x: torch.Tensor, *args: object, out: Optional[torch.Tensor] = None,
                               scales: Optional[torch.Tensor] = None, **kwargs: object) -> Optional[str]:
    if out is not None and _rows_view(out) is None:
        return "out cannot be viewed as [rows, K] with a unit last stride"
    if scales is not None and _rows_view(scales) is None:
        return "scales cannot be viewed as [rows, groups] with a unit last stride"
    return None


@per_block_quant_fp8.triton(supports=_per_block_triton_supports)
def _per_block_triton(
    x: torch.Tensor,
    block: int = 128,
    *,
    out: Optional[torch.Tensor] = None,
    scales: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    from atom.ops import quant_triton as kernels

    _check_block(block)
    scale_shape = _check(x, _groups(x, block), out, scales)
    x2 = _rows_view(x)
    x2 = x.reshape(-1, x.shape[-1]).contiguous() if x2 is None else x2
    if out is None:
        out = torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device)
    if scales is None:
        scales = torch.empty(scale_shape, dtype=torch.float32, device=x.device)
    kernels.per_block_quant_launch(x2, _rows_view(out), _rows_view(scales), block)
    return out, scales


def _per_block_aiter_supports(x: torch.Tensor, block: int = 128, **kwargs: object) -> Optional[str]:
    if block != 128 or x.shape[-1] % 128:
        return "aiter's group quant is 1x128 on a last dim divisible by 128"
    return None


@per_block_quant_fp8.aiter(supports=_per_block_aiter_supports)
def _per_block_aiter(
    x: torch.Tensor,
    block: int = 128,
    *,
    out: Optional[torch.Tensor] = None,
    scales: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    from aiter import QuantType, get_hip_quant

    scale_shape = _check(x, _groups(x, block), out, scales)
    q, s = get_hip_quant(QuantType.per_1x128)(x.contiguous(), quant_dtype=FP8_DTYPE)
    return _finish(q.view(x.shape), s.reshape(scale_shape), out, scales)
