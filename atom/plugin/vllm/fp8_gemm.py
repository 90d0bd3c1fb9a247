"""vLLM's block-fp8 GEMMs (DeepGEMM, CUTLASS; FlashInfer's for small batches), offered to :func:`atom.ops.fp8_block_gemm`.

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
DeepGEMM warm-up uses, ``VLLM_DEEP_GEMM_WARMUP``), not inside a served batch.

Small batches (2 tokens up to the larger-batch GEMM's first size): where vLLM says FlashInfer's
block-scale GEMM runs (Hopper), ``ATOM_FP8_HOST_GEMM_SMALL`` (auto) hands them to FlashInfer's
swap-AB kernel, the one stock vLLM runs below 32 tokens with FlashInfer installed, on weights of
at least ``FLASHINFER_MIN_ROWS`` output rows, where the kernel table measured it faster than
atom's W8A16 kernel (bench/NOTES.md entry 31). It is called as stock calls it (bf16 activations,
which the kernel quantises per 1 x 128 group itself), on the checkpoint's float32 tile scales
(stock's are E8M0-requantised). One token stays on atom's GEMV, the narrower weights on atom's
kernel. Its per-shape variants are compiled just in time, so the layer's warm-up calls it once
per batch size it serves.

Installed once per process, when vLLM's loader reaches the first atom fp8 layer.
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
FLASHINFER = "vLLM FlashInfer fp8_blockscale_gemm_sm90 (block fp8, swap-AB)"
#: FlashInfer's swap-AB kernel serves weights of at least this many output rows. At M = 2-16 it took
#: 0.81-0.97x atom's W8A16 time above 4096 rows on the H100 (bench/results/h100_2026-11-27c/) and
#: 0.62-0.83x on the H200 (bench/results/gpu_2026-11-27h/); at 4096 rows 0.98-1.03x on the H100 and
#: 0.90-0.94x on the H200; on the 2048 / 2112-row weights 1.14-1.30x (H100) and 1.14-1.24x (H200).
FLASHINFER_MIN_ROWS = 4096
#: the first batch size FlashInfer's kernel serves (one token: atom's GEMV, faster on 5 of the 6
#: shapes of bench/NOTES.md entry 25)
FLASHINFER_MIN_TOKENS = 2
#: FlashInfer's op runs its swap-AB kernel below this many tokens, its other kernel from it, which
#: vLLM does not call (lower accuracy on DeepSeek-V3.1, vLLM's ``dynamic_flashinfer_deepgemm_blockscale_gemm``)
FLASHINFER_MAX_TOKENS = 32


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


def flashinfer_block_gemm() -> Optional[Callable[..., Any]]:
    """FlashInfer's swap-AB block-fp8 GEMM (through vLLM's wrapper) as atom's small-batch host
    GEMM, or None (reason logged once) where vLLM says it does not run."""
    import torch

    if not nvidia_gpu():
        return None
    try:
        from vllm.utils.flashinfer import flashinfer_fp8_blockscale_gemm, is_flashinfer_fp8_blockscale_gemm_supported
    except ImportError as e:
        warn_once("fp8-host-flashinfer", f"vLLM's FlashInfer block-fp8 GEMM wrapper not found ({e}); atom's "
                                         "Triton fp8 GEMM serves small batches", logger)
        return None
    if not is_flashinfer_fp8_blockscale_gemm_supported():
        info_once("fp8-host-flashinfer", "vLLM says FlashInfer's block-scale fp8 GEMM does not run here (no "
                                         "flashinfer, not SM 9.0, or VLLM_BLOCKSCALE_FP8_GEMM_FLASHINFER=0); "
                                         "atom's Triton fp8 GEMM serves small batches", logger)
        return None

    def gemm(x: Any, weight: Any, weight_scale: Any, block: Any, bias: Any,
             x_fp8: Any = None, x_fp8_scale: Any = None) -> Any:
        n, k = weight.shape
        if (tuple(int(b) for b in block) != (128, 128) or n < FLASHINFER_MIN_ROWS or n % 64 or k % 128
                or x.dtype != torch.bfloat16 or not (x.is_contiguous() and weight.is_contiguous())
                or weight_scale.dtype != torch.float32 or not weight_scale.is_contiguous()):
            return None
        y = flashinfer_fp8_blockscale_gemm(input=x, weight=weight, weight_scale=weight_scale, out_dtype=x.dtype)
        return y if bias is None else y + bias

    return gemm


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


def warm_up_at(gemm: Callable[..., Any], sizes: Callable[[int, Any], list[int]]) -> Callable[..., int]:
    """A :class:`HostGemm` warm-up: the kernel's just-in-time compiles for one weight, now, one
    call per batch size ``sizes(n, device)``."""
    import torch

    def warm_up(weight: torch.Tensor, weight_scale: torch.Tensor, block_shape: Any, act_dtype: torch.dtype) -> int:
        n, k = weight.shape
        ms = sizes(n, weight.device)
        if not ms:
            return 0
        x = torch.zeros(max(ms), k, dtype=act_dtype, device=weight.device)
        return sum(gemm(x[:m], weight, weight_scale, block_shape, None) is not None for m in ms)

    return warm_up


def deepgemm_warm_up(gemm: Callable[..., Any], min_tokens: int) -> Callable[..., int]:
    """DeepGEMM's warm-up: the batch sizes of :func:`deepgemm_warm_up_sizes`."""
    return warm_up_at(gemm, lambda n, device: deepgemm_warm_up_sizes(n, device, min_tokens))


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


def _small_batch_gemm(large_from: Optional[int]) -> Optional[HostGemm]:
    """FlashInfer's kernel from 2 tokens up to ``large_from`` and below 32 (the sizes where
    FlashInfer picks its swap-AB kernel, and vLLM calls it), or None (``ATOM_FP8_HOST_GEMM_SMALL``)."""
    if envs.ATOM_FP8_HOST_GEMM_SMALL == "atom":
        return None
    fn = flashinfer_block_gemm()
    if fn is None:
        if envs.ATOM_FP8_HOST_GEMM_SMALL == "flashinfer":
            warn_once("fp8-host-flashinfer-asked", "ATOM_FP8_HOST_GEMM_SMALL=flashinfer, but FlashInfer's block-fp8 "
                                                   "GEMM does not run here; atom's Triton fp8 GEMM serves small "
                                                   "batches", logger)
        return None
    top = min(large_from if large_from is not None else FLASHINFER_MAX_TOKENS, FLASHINFER_MAX_TOKENS)
    if top <= FLASHINFER_MIN_TOKENS:
        return None
    sizes = list(range(FLASHINFER_MIN_TOKENS, top))
    return HostGemm(fn, FLASHINFER_MIN_TOKENS, FLASHINFER, warm_up_at(fn, lambda n, device: sizes), max_tokens=top,
                    w8a16_batches=True)


@functools.lru_cache(maxsize=None)
def install() -> Optional[str]:
    """Offer vLLM's kernels to atom's op (once per process): the larger-batch GEMM
    (``ATOM_FP8_HOST_GEMM``) and the small-batch one (``ATOM_FP8_HOST_GEMM_SMALL``). Returns the
    larger-batch kernel's name, or None."""
    large = _large_batch_gemm()
    small = _small_batch_gemm(large.min_tokens if large is not None else None)
    set_host_gemm(small, large)
    if small is not None:
        info_once("fp8-host-gemm-small", f"block-fp8 linears: {small.name} for {small.min_tokens}-"
                                         f"{small.max_tokens - 1} tokens per step on weights of at least "
                                         f"{FLASHINFER_MIN_ROWS} rows", logger)
    return None if large is None else large.name


def _large_batch_gemm() -> Optional[HostGemm]:
    """The larger-batch GEMM (``ATOM_FP8_HOST_GEMM`` from ``ATOM_FP8_HOST_GEMM_MIN_TOKENS``), or None."""
    min_tokens = envs.ATOM_FP8_HOST_GEMM_MIN_TOKENS
    if min_tokens == 0:
        info_once("fp8-host-gemm", "ATOM_FP8_HOST_GEMM_MIN_TOKENS=0: atom's Triton fp8 GEMM serves larger batches",
                  logger)
        return None
    choice = envs.ATOM_FP8_HOST_GEMM
    for kernel in (KERNELS.values() if choice == "auto" else (KERNELS[choice],)):
        fn = kernel.factory()
        if fn is not None:
            break
    else:
        return None
    if min_tokens is None:
        min_tokens = kernel.auto_min_tokens
    info_once("fp8-host-gemm", f"block-fp8 linears: atom's Triton GEMM below {min_tokens} tokens per step, "
                               f"{kernel.name} from {min_tokens}", logger)
    return HostGemm(fn, min_tokens, kernel.name, kernel.warm_up and kernel.warm_up(fn, min_tokens))
