"""vLLM's block-fp8 GEMMs (DeepGEMM, CUTLASS), offered to :func:`atom.ops.fp8_block_gemm` for larger batches.

atom's Triton kernel streams the fp8 weights as fast as vLLM's kernels at decode sizes (W8A16,
up to 16 tokens per step), but its tensor-core path is slower than vLLM's from there up on the
H100 (bench/fp8_gemm.py; docs/performance.md): DeepGEMM's ``fp8_gemm_nt`` takes 0.7-0.85x
atom's W8A8 time at 64 tokens and about half at 256+, CUTLASS ``cutlass_scaled_mm`` wins from
about 128 tokens. So, under vLLM on an NVIDIA GPU, atom's block-fp8 linears call vLLM's kernel
from ``ATOM_FP8_HOST_GEMM_MIN_TOKENS`` tokens up (auto: 17 for DeepGEMM, 128 for CUTLASS):
``ATOM_FP8_HOST_GEMM`` picks it (auto: DeepGEMM where vLLM says it runs, else CUTLASS).

Both are called as vLLM's own ``DeepGemmFp8BlockScaledMMKernel`` / ``CutlassFp8BlockScaledMMKernel``
call them, on atom's weight and ``weight_scale_inv`` as loaded (no copy), with one difference for
DeepGEMM: vLLM (``VLLM_USE_DEEP_GEMM_E8M0``, on by default) requantises the weights to
power-of-two (E8M0) tile scales at load and rounds the activations' scales the same way; atom
passes the checkpoint's float32 scales (DeepGEMM's Hopper kernel reads float32 scales either
way) and so stays on the checkpoint's exact numbers. On a GPU whose DeepGEMM kernel needs E8M0
scales (Blackwell, SM100) atom uses CUTLASS instead. The activation quantisation (1 x 128 per
token group) is the one atom's producer kernel already wrote (:mod:`atom.ops.fused_quant`) where
there is one, else vLLM's ``per_token_group_quant_fp8``. Shapes a kernel does not take (blocks
other than 128 x 128, DeepGEMM N off 64 or K off 128, CUTLASS dims off 128, non-bf16/fp16
activations) stay on atom's kernel. DeepGEMM compiles its kernels just in time, so its
variants for every weight shape are compiled when the layer warms up (the batch sizes vLLM's own
DeepGEMM warm-up uses, ``VLLM_DEEP_GEMM_WARMUP``), not inside a served batch. Installed once per
process, when vLLM's loader reaches the first atom fp8 layer.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple, Optional

from atom import envs
from atom._logging import get_logger, info_once, warn_once
from atom.ops._common import nvidia_gpu
from atom.ops.fp8_gemm import HostGemm, set_host_gemm
from atom.ops.fused_quant import column_major

logger = get_logger("atom.plugin")

CUTLASS = "vLLM CUTLASS cutlass_scaled_mm (block fp8)"
DEEPGEMM = "vLLM DeepGEMM fp8_gemm_nt (block fp8)"


def _block_gemm(accepts: Callable[..., bool], quantise: Callable[..., Any],
                matmul: Callable[..., Any]) -> Callable[..., Any]:
    """A :class:`HostGemm` function: 128 x 128 blocks and a contiguous ``x`` that ``accepts(n, k,
    dtype)``; the activation's 1 x 128 quantisation from its producer (``x_fp8``) or
    ``quantise(x)``, both laid out by ``quantise`` for the kernel; ``matmul(xq, xs, weight,
    weight_scale, out_dtype)``; the bias added after. None (atom's kernel) for anything else."""

    def gemm(x: Any, weight: Any, weight_scale: Any, block: Any, bias: Any,
             x_fp8: Any = None, x_fp8_scale: Any = None) -> Any:
        n, k = weight.shape
        if tuple(int(b) for b in block) != (128, 128) or not x.is_contiguous() or not accepts(n, k, x.dtype):
            return None
        xq, xs = quantise(x, x_fp8, x_fp8_scale)
        y = matmul(xq, xs, weight, weight_scale, x.dtype)
        return y if bias is None else y + bias

    return gemm


def cutlass_block_gemm() -> Optional[Callable[..., Any]]:
    """The GEMM function, or None (with the reason logged once) where vLLM's kernel does not run."""
    import torch

    if not nvidia_gpu():
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

    def quantise(x, x_fp8, x_fp8_scale):
        if x_fp8 is not None:  # quantised by the kernel that produced x (atom.ops.fused_quant)
            return x_fp8, column_major(x_fp8_scale)
        return per_token_group_quant_fp8(x, 128, column_major_scales=True)

    return _block_gemm(
        lambda n, k, dtype: not (n % 128 or k % 128) and dtype in (torch.bfloat16, torch.float16), quantise,
        lambda xq, xs, w, ws, dtype: vops.cutlass_scaled_mm(xq, w.t(), out_dtype=dtype, scale_a=xs, scale_b=ws.t()))


def deepgemm_block_gemm() -> Optional[Callable[..., Any]]:
    """DeepGEMM's ``fp8_gemm_nt`` as atom's host GEMM, or None (reason logged once) where vLLM
    says it does not run, or where it would need E8M0 scales."""
    import torch

    if not nvidia_gpu():
        return None
    try:
        from vllm.model_executor.layers.quantization.utils.fp8_utils import per_token_group_quant_fp8
        from vllm.utils import deep_gemm as dg
    except ImportError as e:
        warn_once("fp8-host-deepgemm", f"vLLM's DeepGEMM wrapper not found ({e}); trying its CUTLASS "
                                       "block-fp8 GEMM", logger)
        return None
    if not dg.is_deep_gemm_supported():
        info_once("fp8-host-deepgemm", "vLLM says DeepGEMM does not run here (not Hopper/Blackwell, no "
                                       "deep_gemm package, or VLLM_USE_DEEP_GEMM=0); trying its CUTLASS "
                                       "block-fp8 GEMM", logger)
        return None
    if torch.cuda.get_device_capability()[0] != 9:
        info_once("fp8-host-deepgemm", "DeepGEMM on this GPU reads E8M0 (power-of-two) scales, which "
                                       "atom's checkpoint-exact weights do not have; trying vLLM's "
                                       "CUTLASS block-fp8 GEMM", logger)
        return None

    def quantise(x, x_fp8, x_fp8_scale):
        if x_fp8 is not None:  # quantised by the kernel that produced x (atom.ops.fused_quant)
            return x_fp8, dg.get_col_major_tma_aligned_tensor(x_fp8_scale.float())
        return per_token_group_quant_fp8(x, 128, column_major_scales=True, tma_aligned_scales=True, use_ue8m0=False)

    def matmul(xq, xs, w, ws, dtype):
        out = torch.empty(xq.shape[0], w.shape[0], dtype=dtype, device=xq.device)
        dg.fp8_gemm_nt((xq, xs), (w, ws), out, is_deep_gemm_e8m0_used=False)
        return out

    return _block_gemm(lambda n, k, dtype: not (n % 64 or k % 128) and dtype == torch.bfloat16, quantise, matmul)


def deepgemm_warm_up_sizes(n: int, device: Any, min_tokens: int) -> list[int]:
    """The batch sizes (>= ``min_tokens``) at which to compile DeepGEMM's variants for an N-row
    weight: those vLLM's own DeepGEMM warm-up uses (``VLLM_DEEP_GEMM_WARMUP``: ``relax`` its
    wave-boundary set, ``full`` every size, ``skip`` none) up to vLLM's ``max_num_batched_tokens``
    (8192 without a current vLLM config); where vLLM's helper moved, every multiple of 64 and the
    small sizes (one warning)."""
    import vllm.envs as venvs

    try:
        from vllm.config import get_current_vllm_config

        max_tokens = int(get_current_vllm_config().scheduler_config.max_num_batched_tokens or 8192)
    except Exception:  # noqa: BLE001 - no current config (outside an engine)
        max_tokens = 8192
    mode = getattr(venvs, "VLLM_DEEP_GEMM_WARMUP", "relax")
    if mode == "skip":
        return []
    if mode == "full":
        sizes = set(range(1, max_tokens + 1))
    else:
        try:
            from vllm.model_executor.warmup.deep_gemm_warmup import _generate_optimal_warmup_m_values

            sizes = set(_generate_optimal_warmup_m_values(max_tokens, n, device))
        except Exception as e:  # noqa: BLE001 - a changed target: a coarser set, one warning
            warn_once("fp8-host-deepgemm-warmup", f"vLLM's DeepGEMM warm-up sizes not found ({e}); atom "
                                                  "warms every multiple of 64 instead", logger)
            sizes = {1, 2, 4, *range(8, 65, 8), *range(64, max_tokens + 1, 64)}
    return sorted(m for m in sizes | {max_tokens} if min_tokens <= m <= max_tokens)


def deepgemm_warm_up(gemm: Callable[..., Any], min_tokens: int) -> Callable[..., int]:
    """A :class:`HostGemm` warm-up: DeepGEMM's just-in-time compiles for one weight, now."""
    import torch

    def warm_up(weight: torch.Tensor, weight_scale: torch.Tensor, block_shape: Any, act_dtype: torch.dtype) -> int:
        n, k = weight.shape
        sizes = deepgemm_warm_up_sizes(n, weight.device, min_tokens)
        if not sizes:
            return 0
        x = torch.zeros(sizes[-1], k, dtype=act_dtype, device=weight.device)
        launches = 0
        for m in sizes:
            launches += gemm(x[:m], weight, weight_scale, block_shape, None) is not None
        return launches

    return warm_up


class Kernel(NamedTuple):
    """One of vLLM's block-fp8 GEMMs atom can hand batches to."""

    name: str
    factory: Callable[[], Optional[Callable[..., Any]]]  #: the GEMM function, or None where it does not run
    #: ATOM_FP8_HOST_GEMM_MIN_TOKENS=auto (bench/fp8_gemm.py on the H100: DeepGEMM at or below
    #: atom's W8A8 time from 8 tokens, where atom's producers start writing fp8 activations at 17;
    #: CUTLASS from about 128)
    auto_min_tokens: int
    #: (gemm, min_tokens) -> the HostGemm warm-up, for kernels that compile per shape just in time
    warm_up: Optional[Callable[..., Callable[..., int]]] = None


#: ATOM_FP8_HOST_GEMM -> the kernel (auto tries them in this order)
KERNELS = {"deepgemm": Kernel(DEEPGEMM, deepgemm_block_gemm, 17, deepgemm_warm_up),
           "cutlass": Kernel(CUTLASS, cutlass_block_gemm, 128)}


@functools.lru_cache(maxsize=None)
def install() -> Optional[str]:
    """Offer vLLM's kernel to atom's op (once per process); returns its name, or None."""
    min_tokens = envs.ATOM_FP8_HOST_GEMM_MIN_TOKENS
    if min_tokens == 0:
        info_once("fp8-host-gemm", "ATOM_FP8_HOST_GEMM_MIN_TOKENS=0: atom's Triton fp8 GEMM serves every batch size",
                  logger)
        return None
    choice = envs.ATOM_FP8_HOST_GEMM
    for kernel in (KERNELS.values() if choice == "auto" else (KERNELS[choice],)):
        fn = kernel.factory()
        if fn is not None:
            break
    else:
        return None
    name = kernel.name
    if min_tokens is None:
        min_tokens = kernel.auto_min_tokens
    set_host_gemm(HostGemm(fn, min_tokens, name, kernel.warm_up and kernel.warm_up(fn, min_tokens)))
    info_once("fp8-host-gemm", f"block-fp8 linears: atom's Triton GEMM below {min_tokens} tokens per step, "
                               f"{name} from {min_tokens}", logger)
    return name
