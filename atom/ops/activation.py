"""SiLU-and-mul (SwiGLU gate): ``x [..., 2d] -> silu(x[..., :d]) * x[..., d:]`` (fp32 math).

Backends: torch reference, Triton, AITER (``aiter.silu_and_mul(out, input)``).
"""

from __future__ import annotations

from typing import Optional

import torch

from atom.ops._common import check_float
from atom.ops._dispatch import declare

__all__ = ["silu_and_mul", "SILU_AND_MUL"]


def _check(x: torch.Tensor, out: Optional[torch.Tensor]) -> tuple[int, ...]:
    """Validate (same for every backend); returns the output shape."""
    check_float("x", x)
    if x.dim() == 0 or x.shape[-1] % 2:
        raise ValueError(f"x must be [..., 2*d], got {tuple(x.shape)}")
    shape = (*x.shape[:-1], x.shape[-1] // 2)
    if out is not None and (tuple(out.shape) != shape or out.dtype != x.dtype):
        raise ValueError(f"out must be {shape} {x.dtype}, got {tuple(out.shape)} {out.dtype}")
    return shape


@declare("silu_and_mul", doc="silu(x[..., :d]) * x[..., d:]")
def silu_and_mul(x: torch.Tensor, *, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``silu(x[..., :d]) * x[..., d:]`` for ``x`` ``[..., 2*d]``, computed in fp32.

    Args:
        x: gate and up projections concatenated on the last dim (float16/bfloat16/float32).
        out: optional preallocated ``[..., d]`` output of ``x``'s dtype.

    Returns:
        ``[..., d]`` in ``x``'s dtype (``out`` when given).
    """
    _check(x, out)
    a, b = x.float().chunk(2, dim=-1)
    y = (torch.nn.functional.silu(a) * b).to(x.dtype)
    if out is None:
        return y
    return out.copy_(y)


SILU_AND_MUL = silu_and_mul
# While torch.compile traces (ATOM_COMPILE_ELEMENTWISE=inductor): the reference as it is.
silu_and_mul.inductor(silu_and_mul.reference)


def _as_rows(t: torch.Tensor) -> Optional[torch.Tensor]:
    if t.stride(-1) != 1:
        return None
    try:
        return t.view(-1, t.shape[-1])
    except RuntimeError:
        return None


def _silu_triton_supports(x: torch.Tensor, *, out: Optional[torch.Tensor] = None) -> Optional[str]:
    if out is not None and _as_rows(out) is None:
        return "out cannot be viewed as [rows, d] with a unit last stride"
    return None


@silu_and_mul.triton(supports=_silu_triton_supports)
def _silu_triton(x: torch.Tensor, *, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    from atom.ops import activation_triton as kernels

    shape = _check(x, out)
    x2 = _as_rows(x)
    x2 = x.reshape(-1, x.shape[-1]).contiguous() if x2 is None else x2
    if out is None:
        out = torch.empty(shape, dtype=x.dtype, device=x.device)
    kernels.silu_and_mul_launch(x2, _as_rows(out))
    return out


def _silu_aiter_supports(x: torch.Tensor, *, out: Optional[torch.Tensor] = None) -> Optional[str]:
    if out is not None and not out.is_contiguous():
        return "aiter's silu_and_mul writes a contiguous out"
    return None


@silu_and_mul.aiter(supports=_silu_aiter_supports)
def _silu_aiter(x: torch.Tensor, *, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    import aiter

    shape = _check(x, out)
    if out is None:
        out = torch.empty(shape, dtype=x.dtype, device=x.device)
    aiter.silu_and_mul(out, x.contiguous())
    return out
