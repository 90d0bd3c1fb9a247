"""Producers that also quantise their output for the next block-fp8 GEMM (1 x ``group`` dynamic).

A W8A8 block-fp8 GEMM (:func:`atom.ops.fp8_block_gemm`, the host's CUTLASS kernel, the fp8 expert
GEMM of :func:`atom.ops.fused_moe`) reads its activations as fp8 with one float32 scale per
token and group of ``group`` (= the weight's ``block_k``) channels. Rather than a quantisation
kernel in front of every such GEMM, the kernel that produces the activation writes both forms
in one pass:

* :func:`rms_norm_quant_fp8`: RMSNorm (optionally with the fused residual add) -> ``y``, its
  fp8 ``q`` and ``scale``;
* :func:`silu_and_mul_quant_fp8`: SiLU-and-mul -> ``y``, ``q``, ``scale``.

``y`` is exactly what :func:`atom.ops.rms_norm` / :func:`atom.ops.silu_and_mul` return (rounded to
the activation dtype), and ``(q, scale)`` is exactly :func:`atom.ops.per_block_quant_fp8` of that
rounded ``y``: the result equals the two steps, bit for bit (``s = max(|y_g|, 1e-10) / 448``,
``q = fp8(clamp(y_g / s))``). ``y`` is kept because small batches run the weight-only (W8A16) form
and other consumers (an MoE router) read it. ``column_major_scales``: ``scale`` is ``[M, groups]``
with strides ``(1, M)``, the layout vLLM's CUTLASS block-fp8 GEMM reads, so no transposing copy
runs before it.

:class:`QuantizedActivation` carries the three tensors from the producer to the GEMM (atom's
models pass it where a tensor would go; :mod:`atom.models._linear` and :mod:`atom.models._moe`
unwrap it).

Backends: torch reference (the two steps), Triton (one pass per row / row block).
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Union

import torch

from atom.ops._common import FLOAT_DTYPES
from atom.ops._dispatch import declare
from atom.ops.activation import _check as _silu_check
from atom.ops.activation import silu_and_mul
from atom.ops.quant import per_block_quant_fp8
from atom.ops.rmsnorm import _check as _norm_check
from atom.ops.rmsnorm import rms_norm

__all__ = ["QuantizedActivation", "rms_norm_quant_fp8", "silu_and_mul_quant_fp8", "plain", "column_major"]


class QuantizedActivation(NamedTuple):
    """An activation in both forms: ``x`` (activation dtype, ``[M, K]``), ``q`` (its fp8 e4m3
    per-token-group quantisation, ``[M, K]``) and ``scale`` (float32 ``[M, ceil(K / group)]``,
    row- or column-major)."""

    x: torch.Tensor
    q: torch.Tensor
    scale: torch.Tensor


Activation = Union[torch.Tensor, QuantizedActivation]


def plain(x: Activation) -> torch.Tensor:
    """The activation-dtype tensor of ``x`` (a consumer that does not read the fp8 form)."""
    return x.x if isinstance(x, QuantizedActivation) else x


def column_major(s: torch.Tensor) -> torch.Tensor:
    """``s [M, G]`` with strides ``(1, M)`` (a copy unless it already is)."""
    if s.dim() == 2 and (s.shape[0] <= 1 or s.stride(0) == 1) and (s.shape[1] <= 1 or s.stride(1) == s.shape[0]):
        return s
    return s.t().contiguous().t()


def _check(x: torch.Tensor, group: int) -> None:
    if x.dim() != 2:
        raise ValueError(f"x must be [tokens, channels], got {tuple(x.shape)}")
    if x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"x must be float16/bfloat16/float32, got {x.dtype}")
    if not isinstance(group, int) or group <= 0:
        raise ValueError(f"group must be a positive int, got {group!r}")


def _quantised(y: torch.Tensor, group: int, column_major_scales: bool) -> tuple[torch.Tensor, torch.Tensor]:
    q, s = per_block_quant_fp8.reference(y, group)
    return q, column_major(s) if column_major_scales else s


# -- RMSNorm (+ residual add) + quantisation -----------------------------------------------------
@declare("rms_norm_quant_fp8",
         doc="RMSNorm (+ fused residual add) writing its output and the output's 1 x group fp8 quantisation")
def rms_norm_quant_fp8(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: Optional[torch.Tensor] = None,
                       group: int = 128, column_major_scales: bool = False) -> tuple[torch.Tensor, ...]:
    """``(y, q, scale)``, or ``(y, new_residual, q, scale)`` with ``residual``: ``y`` and
    ``new_residual`` as :func:`atom.ops.rms_norm` returns them, ``(q, scale)`` as
    :func:`atom.ops.per_block_quant_fp8` of ``y`` (``x`` ``[M, K]``)."""
    _check(x, group)
    out = rms_norm.reference(x, weight, eps, residual)
    y = out if residual is None else out[0]
    q, s = _quantised(y, group, column_major_scales)
    return (y, q, s) if residual is None else (y, out[1], q, s)


def _empty_scales(m: int, groups: int, column_major_scales: bool, device: torch.device) -> torch.Tensor:
    if column_major_scales:
        return torch.empty(groups, m, dtype=torch.float32, device=device).t()
    return torch.empty(m, groups, dtype=torch.float32, device=device)


def _norm_triton_supports(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: Optional[torch.Tensor] = None,
                          group: int = 128, column_major_scales: bool = False) -> Optional[str]:
    from atom.ops.fused_quant_triton import NORM_MAX_N

    if group & (group - 1) or group < 16:
        return f"group {group} must be a power of two >= 16"
    if x.shape[-1] > NORM_MAX_N:
        return f"rows longer than {NORM_MAX_N} elements"
    for name, t in (("x", x), ("residual", residual)):
        if t is not None and t.dim() == 2 and t.shape[-1] > 1 and t.stride(-1) != 1:
            return f"{name} must be unit-stride in its last dim"
    return None


@rms_norm_quant_fp8.triton(supports=_norm_triton_supports)
def _rms_norm_quant_triton(x: torch.Tensor, weight: torch.Tensor, eps: float,
                           residual: Optional[torch.Tensor] = None, group: int = 128,
                           column_major_scales: bool = False) -> tuple[torch.Tensor, ...]:
    from atom.ops.fused_quant_triton import rms_norm_quant_launch

    _check(x, group)
    _norm_check(x, weight, residual, None, None, None, None)
    m, k = x.shape
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    new_res = None if residual is None else torch.empty_like(y)
    q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    s = _empty_scales(m, -(-k // group), column_major_scales, x.device)
    rms_norm_quant_launch(x, weight.contiguous(), eps, residual, y, new_res, q, s, group)
    return (y, q, s) if residual is None else (y, new_res, q, s)


# -- SiLU-and-mul + quantisation -----------------------------------------------------------------
@declare("silu_and_mul_quant_fp8",
         doc="silu(x[..., :d]) * x[..., d:] writing its output and the output's 1 x group fp8 quantisation")
def silu_and_mul_quant_fp8(x: torch.Tensor, group: int = 128,
                           column_major_scales: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(y, q, scale)``: ``y`` = :func:`atom.ops.silu_and_mul` of ``x [M, 2d]``, ``(q, scale)``
    = :func:`atom.ops.per_block_quant_fp8` of ``y``."""
    _check(x, group)
    y = silu_and_mul.reference(x)
    q, s = _quantised(y, group, column_major_scales)
    return y, q, s


def _silu_triton_supports(x: torch.Tensor, group: int = 128, column_major_scales: bool = False) -> Optional[str]:
    if group & (group - 1) or group < 16:
        return f"group {group} must be a power of two >= 16"
    if x.dim() == 2 and x.shape[-1] > 1 and x.stride(-1) != 1:
        return "x must be unit-stride in its last dim"
    return None


@silu_and_mul_quant_fp8.triton(supports=_silu_triton_supports)
def _silu_and_mul_quant_triton(x: torch.Tensor, group: int = 128,
                               column_major_scales: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from atom.ops.fused_quant_triton import silu_and_mul_quant_launch

    _check(x, group)
    m, d = _silu_check(x, None)
    y = torch.empty(m, d, dtype=x.dtype, device=x.device)
    q = torch.empty(m, d, dtype=torch.float8_e4m3fn, device=x.device)
    s = _empty_scales(m, -(-d // group), column_major_scales, x.device)
    silu_and_mul_quant_launch(x, y, q, s, group)
    return y, q, s
