"""vLLM's CUTLASS block-fp8 GEMM, offered to :func:`atom.ops.fp8_block_gemm` for large batches.

atom's Triton kernel streams the fp8 weights well at decode sizes but its tensor-core path is
slower than vLLM's CUTLASS ``cutlass_scaled_mm`` from about 128 tokens per step on the H100
(bench/fp8_gemm.py; docs/performance.md). So, under vLLM on a GPU where vLLM says its CUTLASS
block-fp8 kernel runs (``cutlass_block_fp8_supported``), atom's block-fp8 linears call it from
``ATOM_FP8_HOST_GEMM_MIN_TOKENS`` tokens up: vLLM's per-token-group activation quantisation (1 x
128, column-major scales) and ``cutlass_scaled_mm``, exactly as vLLM's own
``CutlassFp8BlockScaledMMKernel`` calls them, on atom's weight and ``weight_scale_inv`` as loaded
(no copy); where atom's producer kernel already wrote the activation's quantisation
(:mod:`atom.ops.fused_quant`, column-major scales) it is passed straight in. Shapes it does not take (blocks other than 128 x 128, dims off 128, fp32) stay on
atom's kernel. Installed once per process, when vLLM's loader reaches the first atom fp8 layer.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

from atom import envs
from atom._logging import get_logger, info_once, warn_once
from atom.ops.fp8_gemm import HostGemm, set_host_gemm
from atom.ops.fused_quant import column_major

logger = get_logger("atom.plugin")

NAME = "vLLM CUTLASS cutlass_scaled_mm (block fp8)"


def cutlass_block_gemm() -> Optional[Any]:
    """The GEMM function, or None (with the reason logged once) where vLLM's kernel does not run."""
    import torch

    if not torch.cuda.is_available() or getattr(torch.version, "hip", None):
        return None
    try:
        from vllm import _custom_ops as vops
        from vllm.model_executor.layers.quantization.utils.fp8_utils import per_token_group_quant_fp8
        from vllm.model_executor.layers.quantization.utils.w8a8_utils import cutlass_block_fp8_supported
    except ImportError as e:  # a changed target: atom's own kernel serves every size
        warn_once("fp8-host-gemm", f"vLLM's CUTLASS block-fp8 GEMM not found ({e}); atom's Triton fp8 GEMM "
                          "serves every batch size", logger)
        return None
    if not cutlass_block_fp8_supported():
        info_once("fp8-host-gemm", "vLLM's CUTLASS block-fp8 GEMM does not run on this GPU; atom's Triton "
                          "fp8 GEMM serves every batch size", logger)
        return None

    def gemm(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, block: Any,
             bias: Optional[torch.Tensor], x_fp8: Optional[torch.Tensor] = None,
             x_fp8_scale: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        n, k = weight.shape
        if (tuple(int(b) for b in block) != (128, 128) or n % 128 or k % 128
                or x.dtype not in (torch.bfloat16, torch.float16) or not x.is_contiguous()):
            return None
        if x_fp8 is not None:  # quantised by the kernel that produced x (atom.ops.fused_quant)
            xq, xs = x_fp8, column_major(x_fp8_scale)
        else:
            xq, xs = per_token_group_quant_fp8(x, 128, column_major_scales=True)
        y = vops.cutlass_scaled_mm(xq, weight.t(), out_dtype=x.dtype, scale_a=xs, scale_b=weight_scale.t())
        return y if bias is None else y + bias

    return gemm


@functools.lru_cache(maxsize=None)
def install() -> Optional[str]:
    """Offer vLLM's kernel to atom's op (once per process); returns its name, or None."""
    min_tokens = envs.ATOM_FP8_HOST_GEMM_MIN_TOKENS
    if not min_tokens:
        info_once("fp8-host-gemm", "ATOM_FP8_HOST_GEMM_MIN_TOKENS=0: atom's Triton fp8 GEMM serves every batch size",
                  logger)
        return None
    fn = cutlass_block_gemm()
    if fn is None:
        return None
    set_host_gemm(HostGemm(fn, min_tokens, NAME))
    info_once("fp8-host-gemm", f"block-fp8 linears: atom's Triton GEMM below {min_tokens} tokens per step, "
                               f"{NAME} from {min_tokens}", logger)
    return NAME
