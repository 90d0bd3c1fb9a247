"""Triton kernels for :func:`atom.ops.fp8_gemm.fp8_block_gemm` (imported lazily).

One GEMM kernel, tiled ``BLOCK_M x BLOCK_N`` over the output with a ``BLOCK_K`` loop that never
straddles a weight-scale column (``BLOCK_K`` divides ``block_k``), so each K step is one
``tl.dot`` on raw fp8 (W8A8) or register-converted fp8 (W8A16) tiles, scaled in fp32 by the
tile's weight scale (and the activations' group scale) as it is accumulated.

Configurations by batch size ``M`` (:func:`gemm_config`):

* ``M <= GEMV_MAX_M`` (1: batch-1 decode, float activations): a GEMV without tensor cores
  (:func:`gemv_config`): each program multiplies ``BLOCK_N`` whole weight rows by one
  activation row, reading ``BLOCK_N x BLOCK_K`` fp8 weight tiles with long contiguous loads
  along K, converting them in registers, with the tile scales folded into the activations;
  split-K when the grid has fewer programs than SMs. On the H100 it takes 0.73-0.91x the
  tensor-core kernel's time at M = 1 (bench/NOTES.md entry 25).
* ``M <= 16`` (decode): weight streaming. 16 x 32 tiles; when the output has too few column
  tiles for two programs per SM, the K loop is split over programs (split-K) whose fp32 partial
  sums a second kernel adds (with the bias) into the output. (Measured on the H100,
  bench/fp8_gemm.py --sweep: 16 x 32 with split-K beat 64- and 128-wide tiles and the transposed
  ``SWAP_AB`` form, which the kernel keeps as an option.)
* ``M <= 64``: 64-row tiles, still split-K when the grid is small.
* larger: 64 x 128 and 128 x 128 tiles, grouped so neighbouring programs share weight tiles in L2.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from atom.ops._common import FP8_DTYPE, cdiv, next_pow2
from atom.ops._dispatch import triton_interpreting
from atom.ops.common_triton import dot_flags


@triton.jit
def _tile(pid, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Grouped ordering: GROUP_M row blocks walk the same weight columns while they are in L2."""
    in_group = GROUP_M * num_pid_n
    first_m = (pid // in_group) * GROUP_M
    size_m = tl.minimum(num_pid_m - first_m, GROUP_M)
    return first_m + (pid % in_group) % size_m, (pid % in_group) // size_m


@triton.jit
def _k_steps(K, BLOCK_K: tl.constexpr, split_k, pid_k):
    """This split's K steps ``[kt0, kt1)`` of ``BLOCK_K`` (split-K program ``pid_k`` of ``split_k``)."""
    k_tiles = tl.cdiv(K, BLOCK_K)
    per_split = tl.cdiv(k_tiles, split_k)
    kt0 = pid_k * per_split
    return kt0, tl.minimum(kt0 + per_split, k_tiles)


@triton.jit(do_not_specialize=["M", "split_k", "stride_xsm", "stride_xsk"])
def _fp8_gemm_kernel(
    x_ptr, xs_ptr, w_ptr, ws_ptr, b_ptr, y_ptr, M, N, K, split_k,
    stride_xm, stride_xsm, stride_xsk, stride_wn, stride_wsn, stride_ym, stride_ys,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SCALE_BN: tl.constexpr, SCALE_BK: tl.constexpr, GROUP_M: tl.constexpr,
    A_FP8: tl.constexpr, ADD_BIAS: tl.constexpr, SWAP_AB: tl.constexpr, EVEN_K: tl.constexpr,
    UPCAST: tl.constexpr, PREC: tl.constexpr,
):
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m, pid_n = _tile(pid, tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mmask = offs_m < M
    nmask = offs_n < N
    kt0, kt1 = _k_steps(K, BLOCK_K, split_k, pid_k)

    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + (kt0 * BLOCK_K + offs_k)[None, :]
    w_ptrs = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + (kt0 * BLOCK_K + offs_k)[:, None]
    ws_ptrs = ws_ptr + (offs_n // SCALE_BN) * stride_wsn
    xs_ptrs = xs_ptr + offs_m * stride_xsm
    if SWAP_AB:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for kt in range(kt0, kt1):
        k0 = kt * BLOCK_K
        if EVEN_K:
            x = tl.load(x_ptrs, mask=mmask[:, None], other=0.0)
            w = tl.load(w_ptrs, mask=nmask[None, :], other=0.0)
        else:
            kmask = offs_k < K - k0
            x = tl.load(x_ptrs, mask=mmask[:, None] & kmask[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=kmask[:, None] & nmask[None, :], other=0.0)
        sw = tl.load(ws_ptrs + k0 // SCALE_BK, mask=nmask, other=0.0)
        if UPCAST:
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        elif not A_FP8:
            w = w.to(x.dtype)
        if SWAP_AB:
            part = tl.dot(tl.trans(w), tl.trans(x), input_precision=PREC)
            if A_FP8:
                sx = tl.load(xs_ptrs + (k0 // SCALE_BK) * stride_xsk, mask=mmask, other=0.0)
                acc += part * (sw[:, None] * sx[None, :])
            else:
                acc += part * sw[:, None]
        else:
            part = tl.dot(x, w, input_precision=PREC)
            if A_FP8:
                sx = tl.load(xs_ptrs + (k0 // SCALE_BK) * stride_xsk, mask=mmask, other=0.0)
                acc += part * (sx[:, None] * sw[None, :])
            else:
                acc += part * sw[None, :]
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if SWAP_AB:
        acc = tl.trans(acc)
    if ADD_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=nmask, other=0.0).to(tl.float32)[None, :]
    y_ptrs = y_ptr + pid_k * stride_ys + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mmask[:, None] & nmask[None, :])


@triton.jit(do_not_specialize=["M", "split_k", "stride_ys"])
def _gemv_kernel(
    x_ptr, w_ptr, ws_ptr, b_ptr, y_ptr, M, N, K, split_k,
    stride_xm, stride_wn, stride_wsn, stride_ym, stride_ys,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SCALE_BN: tl.constexpr, SCALE_BK: tl.constexpr, HAS_SCALE: tl.constexpr,
    ADD_BIAS: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
):
    """``y[m, n] = sum_k x[m, k] * w[n, k] * scale[n // SCALE_BN, k // SCALE_BK]`` for one row
    ``m`` of ``x`` and ``BLOCK_N`` rows of ``w`` (``SCALE_BN`` a multiple of ``BLOCK_N``: one
    scale row per program, so the scales fold into the activations), over this program's share
    of K; fp32 sums (split-K partials when ``split_k`` > 1). The products accumulate elementwise
    in a ``BLOCK_N x BLOCK_K`` register tile, reduced across K once at the end (no cross-thread
    reduction inside the loop)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    m = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    nmask = offs_n < N
    kt0, kt1 = _k_steps(K, BLOCK_K, split_k, pid_k)
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + (kt0 * BLOCK_K + offs_k)[None, :]
    x_ptrs = x_ptr + m.to(tl.int64) * stride_xm + kt0 * BLOCK_K + offs_k
    ws_row = ws_ptr + ((pid_n * BLOCK_N) // SCALE_BN) * stride_wsn
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for kt in range(kt0, kt1):
        k = kt * BLOCK_K + offs_k
        kmask = k < K
        if EVEN_K:
            if EVEN_N:
                w = tl.load(w_ptrs)
            else:
                w = tl.load(w_ptrs, mask=nmask[:, None], other=0.0)
            x = tl.load(x_ptrs).to(tl.float32)
        else:
            w = tl.load(w_ptrs, mask=nmask[:, None] & kmask[None, :], other=0.0)
            x = tl.load(x_ptrs, mask=kmask, other=0.0).to(tl.float32)
        if HAS_SCALE:
            if BLOCK_K <= SCALE_BK:
                x = x * tl.load(ws_row + (kt * BLOCK_K) // SCALE_BK)
            else:
                x = x * tl.load(ws_row + k // SCALE_BK, mask=kmask, other=0.0)
        acc += w.to(tl.float32) * x[None, :]
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    y = tl.sum(acc, axis=1)
    if ADD_BIAS:
        y += tl.load(b_ptr + offs_n, mask=nmask, other=0.0).to(tl.float32)
    tl.store(y_ptr + pid_k * stride_ys + m.to(tl.int64) * stride_ym + offs_n, y.to(y_ptr.dtype.element_ty), mask=nmask)


@triton.jit(do_not_specialize=["M"])
def _split_k_sum_kernel(part_ptr, b_ptr, y_ptr, M, N, stride_ym,
                        SPLIT_K: tl.constexpr, BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    total = M * N
    mask = offs < total
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(part_ptr + s * total + offs, mask=mask, other=0.0)
    m = offs // N
    n = offs % N
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + m * stride_ym + n, acc.to(y_ptr.dtype.element_ty), mask=mask)


@dataclass(frozen=True)
class GemmConfig:
    block_m: int
    block_n: int
    block_k: int
    group_m: int
    warps: int
    stages: int
    swap_ab: bool
    split_k: int = 1
    #: the tensor-core-free GEMV kernel (one program row per activation row; ``block_m`` unused)
    gemv: bool = False


#: Upper M of each configuration bucket (the last one is open-ended).
M_BUCKETS = (16, 64, 256)
#: Split the K loop until the grid has this many programs per SM (small-M buckets only).
SPLIT_K_PROGRAMS_PER_SM = 2
#: Each split keeps at least this many K steps.
SPLIT_K_MIN_STEPS = 4


@functools.lru_cache(maxsize=None)
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 8  # the interpreter: small grids, still exercising split-K
    return _num_sms(device.index if device.index is not None else torch.cuda.current_device())


def bucket_of(m: int) -> int:
    """Index of ``m``'s configuration bucket (one compiled variant each)."""
    for i, top in enumerate(M_BUCKETS):
        if m <= top:
            return i
    return len(M_BUCKETS)


#: Batches of at most this many rows (float activations) take the GEMV kernel (one program
#: row per activation row: at 2 rows it already trails the tensor-core kernel on the large
#: shapes, bench/NOTES.md entry 25).
GEMV_MAX_M = 1
#: The GEMV tile (weight rows x K elements per step) and warps: within 8 % of each shape's best
#: variant in the H100 sweep (bench/fp8_gemm.py --gemv-sweep) on Qwen3-8B / 32B, DeepSeek-V3 and
#: Qwen3-30B-A3B shapes.
GEMV_BLOCK_N, GEMV_BLOCK_K, GEMV_WARPS = 8, 1024, 4


def gemv_config(m: int, n: int, k: int, scale_bn: Optional[int], sms: int) -> Optional[GemmConfig]:
    """The GEMV configuration for an ``m x n x k`` product, or None where it does not apply
    (``m`` above :data:`GEMV_MAX_M`, or neither :data:`GEMV_BLOCK_N` nor half of it divides the
    scale tile's ``scale_bn`` rows; None: an unscaled weight). Split-K only while the grid has
    fewer programs than SMs (the sweep: splitting a grid of >= 1 program per SM lost more often
    than it won)."""
    if m > GEMV_MAX_M:
        return None
    bn = next((b for b in (GEMV_BLOCK_N, GEMV_BLOCK_N // 2) if scale_bn is None or scale_bn % b == 0), None)
    if bn is None:
        return None
    bk = max(64, min(GEMV_BLOCK_K, next_pow2(k)))
    tiles, steps, split = -(-n // bn), -(-k // bk), 1
    while tiles * split < sms and steps // (split * 2) >= 2:
        split *= 2
    return GemmConfig(1, bn, bk, 1, GEMV_WARPS, 1, False, split, gemv=True)


def gemm_config(m: int, n: int, k: int, block_k: int, a_fp8: bool, sms: int) -> GemmConfig:
    """The tile configuration for an ``m x n x k`` product (see the module docstring)."""
    bk = min(128, block_k)
    b = bucket_of(m)
    if b == 0:
        cfg = GemmConfig(16, 32, bk, 1, 4, 4, False)
    elif b == 1:
        cfg = GemmConfig(64, 64, bk, 1, 4, 4, False)
    elif b == 2:
        cfg = GemmConfig(64, 128, bk if a_fp8 else min(bk, 64), 8, 4, 4, False)
    else:
        cfg = GemmConfig(128, 128, bk if a_fp8 else min(bk, 64), 8, 8, 3, False)
    if b <= 1:
        tiles = -(-n // cfg.block_n)  # one row tile in these buckets
        steps = -(-k // cfg.block_k)
        split = 1
        while tiles * split < SPLIT_K_PROGRAMS_PER_SM * sms and steps // (split * 2) >= SPLIT_K_MIN_STEPS:
            split *= 2
        cfg = GemmConfig(cfg.block_m, cfg.block_n, cfg.block_k, cfg.group_m, cfg.warps, cfg.stages,
                         cfg.swap_ab, split)
    return cfg


def _split_k_target(out: torch.Tensor, split: int) -> tuple[torch.Tensor, int, int]:
    """Where a GEMM kernel writes: ``out`` itself, or ``split`` fp32 partial outputs to add up
    (:func:`_split_k_sum`). Returns (target, split stride, row stride)."""
    if split == 1:
        return out, 0, out.stride(0)
    m, n = out.shape
    return torch.empty(split, m, n, dtype=torch.float32, device=out.device), m * n, n


def _split_k_sum(target: torch.Tensor, bias: Optional[torch.Tensor], out: torch.Tensor, split: int) -> torch.Tensor:
    """``out`` = the sum of the split-K partials (+ bias); nothing when the kernel wrote ``out``."""
    if split > 1:
        m, n = out.shape
        block = 1024
        _split_k_sum_kernel[(cdiv(m * n, block),)](
            target, bias if bias is not None else target, out, m, n, out.stride(0),
            SPLIT_K=split, BLOCK=block, HAS_BIAS=bias is not None, num_warps=4)
    return out


def fp8_block_gemm_fwd(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                       block_shape: tuple[int, int], *, x_scale: Optional[torch.Tensor],
                       bias: Optional[torch.Tensor], out_dtype: torch.dtype,
                       out: Optional[torch.Tensor] = None,
                       config: Optional[GemmConfig] = None) -> torch.Tensor:
    """``x [M, K]`` (float, or fp8 with ``x_scale``) times block-scaled fp8 ``weight [N, K]``."""
    m, k = x.shape
    n = weight.shape[0]
    if out is None:
        out = torch.empty(m, n, dtype=out_dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.copy_(bias.expand(m, n) if bias is not None else torch.zeros_like(out))
    a_fp8 = x.dtype == FP8_DTYPE
    cfg = config or (None if a_fp8 else gemv_config(m, n, k, block_shape[0], num_sms(x.device))) \
        or gemm_config(m, n, k, block_shape[1], a_fp8, num_sms(x.device))
    if cfg.gemv:
        return _gemv(x, weight, weight_scale, block_shape, bias, out, cfg)
    upcast = triton_interpreting()
    _, prec = dot_flags(torch.float32 if x.dtype == torch.float32 else torch.bfloat16)
    split = cfg.split_k
    target, stride_ys, stride_ym = _split_k_target(out, split)
    grid = (cdiv(m, cfg.block_m) * cdiv(n, cfg.block_n), split)
    xs = x_scale if x_scale is not None else weight_scale  # unused pointer when not A_FP8
    _fp8_gemm_kernel[grid](
        x, xs, weight, weight_scale, bias if bias is not None else weight_scale, target, m, n, k, split,
        x.stride(0), xs.stride(0), xs.stride(1), weight.stride(0), weight_scale.stride(0), stride_ym, stride_ys,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        SCALE_BN=block_shape[0], SCALE_BK=block_shape[1], GROUP_M=cfg.group_m,
        A_FP8=a_fp8, ADD_BIAS=bias is not None and split == 1, SWAP_AB=cfg.swap_ab,
        EVEN_K=k % cfg.block_k == 0, UPCAST=upcast, PREC=prec,
        num_warps=cfg.warps, num_stages=cfg.stages,
    )
    return _split_k_sum(target, bias, out, split)


def _gemv(x: torch.Tensor, weight: torch.Tensor, weight_scale: Optional[torch.Tensor],
          block_shape: Optional[tuple[int, int]], bias: Optional[torch.Tensor], out: torch.Tensor,
          cfg: GemmConfig) -> torch.Tensor:
    """The GEMV kernel (``cfg.gemv``; one program row per row of the float ``x``);
    ``weight_scale`` and ``block_shape`` None: an unscaled weight of any float dtype
    (:func:`atom.ops.linear`)."""
    m, k = x.shape
    n = weight.shape[0]
    if weight_scale is None:
        block_shape = (1, 1)  # the scale tile's constexprs, unused without scales
    elif block_shape[0] % cfg.block_n:
        raise ValueError(f"GEMV row tile {cfg.block_n} must divide the scale tile's {block_shape[0]} rows")
    split = cfg.split_k
    target, stride_ys, stride_ym = _split_k_target(out, split)
    ws = weight_scale if weight_scale is not None else weight
    _gemv_kernel[(cdiv(n, cfg.block_n), split, m)](
        x, weight, ws, bias if bias is not None else ws, target, m, n, k, split,
        x.stride(0), weight.stride(0), ws.stride(0), stride_ym, stride_ys,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        SCALE_BN=block_shape[0], SCALE_BK=block_shape[1], HAS_SCALE=weight_scale is not None,
        ADD_BIAS=bias is not None and split == 1, EVEN_K=k % cfg.block_k == 0, EVEN_N=n % cfg.block_n == 0,
        num_warps=cfg.warps, num_stages=cfg.stages,
    )
    return _split_k_sum(target, bias, out, split)


def warm_up_sizes(w8a8_from: Optional[int]) -> list[int]:
    """One batch size per configuration bucket (each bucket is one compiled variant, W8A16 below
    ``w8a8_from`` and W8A8 from it; the GEMV for a single row, then the first size after
    :data:`GEMV_MAX_M`), and the first W8A8 size."""
    sizes = {1, GEMV_MAX_M + 1, *(top + 1 for top in M_BUCKETS)}
    if w8a8_from is not None:
        sizes.add(w8a8_from)
    return sorted(sizes)


def warm_up(weight: torch.Tensor, weight_scale: torch.Tensor, block_shape: tuple[int, int],
            act_dtype: torch.dtype, w8a8_from: Optional[int], has_bias: bool) -> int:
    """Launch the kernels once per :func:`warm_up_sizes` size on zeros (Triton compiles now, not
    inside the first served batch or a CUDA-graph capture). Returns the launches made."""
    from atom.ops.fp8_gemm import fp8_block_gemm

    n, k = weight.shape
    bias = torch.zeros(n, dtype=act_dtype, device=weight.device) if has_bias else None
    sizes = warm_up_sizes(w8a8_from)
    for m in sizes:
        x = torch.zeros(m, k, dtype=act_dtype, device=weight.device)
        fp8_block_gemm.run("triton", x, weight, weight_scale, block_shape, bias=bias, w8a8_from=w8a8_from)
    return len(sizes)
