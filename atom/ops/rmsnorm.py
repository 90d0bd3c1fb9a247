"""RMSNorm over the last dim, with optional fused residual add and static fp8 output.

``y = x * rsqrt(mean(x**2) + eps) * weight``, accumulated in fp32 and rounded once to the
output dtype. With ``residual``: ``s = x + residual`` is rounded to ``x.dtype`` (it is the new
residual stream) and ``s`` is normalised; both are returned. With ``out_dtype=float8_e4m3fn``
and a per-tensor ``scale``: the output is ``clamp(y / scale, -448, 448)`` in fp8.

Backends: torch reference, Triton (one program per row), AITER (``rmsnorm2d_fwd`` /
``rmsnorm2d_fwd_with_add``; not for fp8 output, which AITER only offers with dynamic scales).
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from atom.ops._common import FP8_DTYPE, FP8_E4M3_MAX, check_float, check_scale
from atom.ops._dispatch import declare

__all__ = ["rms_norm", "RMS_NORM"]

RmsNormResult = Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]


def _check(
    x: torch.Tensor,
    weight: torch.Tensor,
    residual: Optional[torch.Tensor],
    out_dtype: Optional[torch.dtype],
    scale: Optional[torch.Tensor],
    out: Optional[torch.Tensor],
    residual_out: Optional[torch.Tensor],
) -> torch.dtype:
    """Validate the call (same for every backend); returns the resolved output dtype."""
    check_float("x", x)
    check_float("weight", weight)
    if x.dim() == 0 or weight.shape != (x.shape[-1],):
        raise ValueError(f"weight must be [{x.shape[-1] if x.dim() else '?'}], got {tuple(weight.shape)}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(
            f"residual must match x ({tuple(x.shape)}, {x.dtype}), got {tuple(residual.shape)}, {residual.dtype}"
        )
    if residual is None and residual_out is not None:
        raise ValueError("residual_out is only meaningful with residual")
    out_dtype = x.dtype if out_dtype is None else out_dtype
    if out_dtype == FP8_DTYPE:
        check_scale("scale", scale, x)
    elif scale is not None:
        raise ValueError("scale is only used with out_dtype=torch.float8_e4m3fn")
    elif out_dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"out_dtype must be a float dtype or torch.float8_e4m3fn, got {out_dtype}")
    if out is not None and (out.shape != x.shape or out.dtype != out_dtype):
        raise ValueError(f"out must be {tuple(x.shape)} {out_dtype}, got {tuple(out.shape)} {out.dtype}")
    if residual_out is not None and (residual_out.shape != x.shape or residual_out.dtype != x.dtype):
        raise ValueError(f"residual_out must be {tuple(x.shape)} {x.dtype}")
    return out_dtype


def _finish(
    y: torch.Tensor,
    s: Optional[torch.Tensor],
    out: Optional[torch.Tensor],
    residual_out: Optional[torch.Tensor],
) -> RmsNormResult:
    if out is not None:
        out.copy_(y)
        y = out
    if s is None:
        return y
    if residual_out is not None:
        residual_out.copy_(s)
        s = residual_out
    return y, s


# -- the op, declared by its torch reference ---------------------------------------------------
@declare("rms_norm", doc="RMSNorm over the last dim (+ fused residual add, + static fp8 output)")
def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: Optional[torch.Tensor] = None,
    out_dtype: Optional[torch.dtype] = None,
    scale: Optional[torch.Tensor] = None,
    *,
    out: Optional[torch.Tensor] = None,
    residual_out: Optional[torch.Tensor] = None,
) -> RmsNormResult:
    """RMSNorm of ``x`` over its last dim (fp32 accumulation), out of place.

    Args:
        x: ``[..., hidden]`` float16/bfloat16/float32, any strides.
        weight: ``[hidden]``.
        eps: added to the mean square.
        residual: optional ``[..., hidden]`` (x's dtype). When given, ``s = x + residual``
            (rounded to ``x.dtype``) is normalised and returned as the new residual.
        out_dtype: output dtype (default ``x.dtype``); ``torch.float8_e4m3fn`` needs ``scale``.
        scale: per-tensor float32 scale (one element) for fp8 output: ``out = y / scale``
            clamped to +-448.
        out, residual_out: optional preallocated outputs (``out`` may alias ``x``,
            ``residual_out`` may alias ``residual``, for in-place use).

    Returns:
        ``normed``, or ``(normed, new_residual)`` when ``residual`` is given.
    """
    out_dtype = _check(x, weight, residual, out_dtype, scale, out, residual_out)
    xf = x.float()
    s = None
    if residual is not None:
        s = (xf + residual.float()).to(x.dtype)
        xf = s.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps) * weight.float()
    if out_dtype == FP8_DTYPE:
        y = (y / scale.float()).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    return _finish(y.to(out_dtype), s, out, residual_out)


RMS_NORM = rms_norm
# While torch.compile traces (ATOM_COMPILE_ELEMENTWISE=inductor): the reference as it is.
rms_norm.inductor(rms_norm.reference)


# -- Triton -----------------------------------------------------------------------------------
def _as_rows(t: torch.Tensor, n: int) -> Optional[torch.Tensor]:
    """A ``[A, B, n]`` view of ``t`` with unit last stride (rows indexed by two strided dims),
    or None if no such view exists."""
    if t.dim() == 0 or (n > 1 and t.stride(-1) != 1):
        return None
    if t.dim() <= 2:
        return t.view(1, -1, n)
    try:
        return t.view(-1, t.shape[-2], n)
    except RuntimeError:
        return None


def _rms_norm_triton_supports(x: torch.Tensor, *args: object, out: Optional[torch.Tensor] = None,
                              residual_out: Optional[torch.Tensor] = None, **kwargs: object) -> Optional[str]:
    n = x.shape[-1] if x.dim() else 1
    for name, t in (("out", out), ("residual_out", residual_out)):
        if t is not None and _as_rows(t, n) is None:
            return f"{name} cannot be viewed as [A, B, {n}] rows with a unit last stride"
    return None


@rms_norm.triton(supports=_rms_norm_triton_supports)
def _rms_norm_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: Optional[torch.Tensor] = None,
    out_dtype: Optional[torch.dtype] = None,
    scale: Optional[torch.Tensor] = None,
    *,
    out: Optional[torch.Tensor] = None,
    residual_out: Optional[torch.Tensor] = None,
) -> RmsNormResult:
    from atom.ops import rmsnorm_triton as kernels

    out_dtype = _check(x, weight, residual, out_dtype, scale, out, residual_out)
    n = x.shape[-1]
    # Inputs may be any layout: strided rows go in as they are, anything else is copied. Every
    # tensor here has x's shape, so all [A, B, n] views agree on A and B.
    x2 = _as_rows(x, n)
    x2 = _as_rows(x.contiguous(), n) if x2 is None else x2
    r2 = None
    if residual is not None:
        r2 = _as_rows(residual, n)
        r2 = _as_rows(residual.contiguous(), n) if r2 is None else r2
        if residual_out is None:
            residual_out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if out is None:
        out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    kernels.rms_norm_launch(
        x2, weight.contiguous(), eps, _as_rows(out, n), r2,
        None if residual is None else _as_rows(residual_out, n),
        scale if out_dtype == FP8_DTYPE else None,
    )
    return out if residual is None else (out, residual_out)


# -- AITER (ROCm) ---------------------------------------------------------------------------
def _rms_norm_aiter_supports(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: Optional[torch.Tensor] = None,
    out_dtype: Optional[torch.dtype] = None,
    scale: Optional[torch.Tensor] = None,
    *,
    out: Optional[torch.Tensor] = None,
    residual_out: Optional[torch.Tensor] = None,
) -> Optional[str]:
    if scale is not None or (out_dtype is not None and out_dtype != x.dtype):
        return "aiter's rmsnorm has no static-scale fp8 / dtype-changing output"
    if weight.dtype != x.dtype:
        return f"aiter's rmsnorm needs weight dtype == x dtype ({weight.dtype} != {x.dtype})"
    for t in (out, residual_out):
        if t is not None and not t.is_contiguous():
            return "aiter's rmsnorm writes contiguous outputs only"
    return None


@rms_norm.aiter(supports=_rms_norm_aiter_supports)
def _rms_norm_aiter(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: Optional[torch.Tensor] = None,
    out_dtype: Optional[torch.dtype] = None,
    scale: Optional[torch.Tensor] = None,
    *,
    out: Optional[torch.Tensor] = None,
    residual_out: Optional[torch.Tensor] = None,
) -> RmsNormResult:
    import aiter

    _check(x, weight, residual, out_dtype, scale, out, residual_out)
    x = x.contiguous()
    if residual is None:
        return _finish(aiter.rmsnorm2d_fwd(x, weight, eps), None, out, None)
    out = torch.empty_like(x) if out is None else out
    residual_out = torch.empty_like(x) if residual_out is None else residual_out
    # rmsnorm2d_fwd_with_add(out, input, residual_in, residual_out, weight, epsilon)
    aiter.rmsnorm2d_fwd_with_add(out, x, residual.contiguous(), residual_out, weight, eps)
    return out, residual_out
