"""A linear layer on a float weight: ``y = x @ W.T (+ bias)``.

The reference is ``F.linear`` (cuBLAS on a GPU). The Triton backend runs only a single row of
activations (batch-1 decode): the GEMV of :mod:`atom.ops.fp8_gemm_triton` without tile scales,
which on the H100 took 0.73-0.93x cuBLAS's time at one token on Qwen3 / DeepSeek-V3 weight
shapes (bench/NOTES.md entry 25). Every other call takes the reference. atom's unquantised
linears call this op on NVIDIA GPUs unless ``ATOM_BF16_GEMV=0`` (:func:`atom.models._linear.bf16_gemv_on`);
otherwise they call ``F.linear`` directly.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from atom.ops._dispatch import declare
from atom.ops._warm import timed

__all__ = ["linear", "warm_up_linear"]

_HALF = (torch.float16, torch.bfloat16)


@declare("linear", doc="Linear on a float weight; Triton: a GEMV for one token (cuBLAS otherwise)")
def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``y = x @ weight.T (+ bias)``; the reference is ``F.linear``."""
    return F.linear(x, weight, bias)


def single_row(x: torch.Tensor) -> bool:
    """The one case the GEMV serves (every other call is ``F.linear``, whatever the backend)."""
    return x.dim() == 2 and x.shape[0] == 1


def _triton_supports(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> Optional[str]:
    if not single_row(x):
        return "not a single row: cuBLAS (the reference) serves batches"
    if weight.dim() != 2 or weight.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype):
        return "x, weight and bias must share one half-precision dtype"
    if x.shape[1] == 0 or weight.shape[0] == 0 or x.shape[1] != weight.shape[1]:
        return "empty or mismatched shapes"
    if x.stride(-1) != 1 or weight.stride(-1) != 1:
        return "x and weight must be unit-stride in their last dim"
    return None


@linear.triton(supports=_triton_supports, dtypes=_HALF)
def _linear_triton(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    from atom.ops.fp8_gemm_triton import _gemv, gemv_config, num_sms

    n, k = weight.shape
    cfg = gemv_config(1, n, k, None, num_sms(x.device))
    return _gemv(x, weight, None, None, bias, torch.empty(1, n, dtype=x.dtype, device=x.device), cfg)


def warm_up_linear(weight: torch.Tensor, has_bias: bool = False, force: bool = False) -> int:
    """Compile the GEMV for this weight's shape now (once per process and shape; 0 where the op
    would not run Triton on the weight's device unless ``force``). Returns the launches made."""
    key = (tuple(weight.shape), weight.dtype, str(weight.device), has_bias)
    if weight.dtype not in _HALF or not linear.claim_warm_up(key, weight.device.type, force):
        return 0

    def launch() -> int:
        x = torch.zeros(1, weight.shape[1], dtype=weight.dtype, device=weight.device)
        bias = torch.zeros(weight.shape[0], dtype=weight.dtype, device=weight.device) if has_bias else None
        linear.run("triton", x, weight, bias)
        return 1

    return timed("linear (GEMV)", str(tuple(weight.shape)), launch, weight.device)
