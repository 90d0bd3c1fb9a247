"""Triton helpers shared by atom's kernel modules (``atom/ops/<op>_triton.py``).

Imported only by the kernel modules, which the op modules import lazily on the first Triton
call: ``import atom.ops`` stays free of Triton (it may be absent, and ``TRITON_INTERPRET`` must be
set before ``@triton.jit`` runs).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from atom.ops._dispatch import triton_interpreting

__all__ = ["to_fp8_e4m3", "cache_store", "num_warps_for", "exact_fp8_cast", "dot_flags"]


def exact_fp8_cast() -> bool:
    """Whether kernels must pre-round to the e4m3 grid before casting (see :func:`to_fp8_e4m3`)."""
    return triton_interpreting()


def dot_flags(dtype: torch.dtype) -> tuple[bool, Optional[str]]:
    """(UPCAST, PREC) constexprs for ``tl.dot`` on operands of ``dtype``.

    Triton's CPU interpreter (3.9) multiplies the raw uint16 storage of bfloat16 operands in
    ``tl.dot``, so under the interpreter bf16 operands are upcast to fp32 first (exact: the
    product of two bf16 values is representable in fp32). fp32 inputs ask for fp32-accurate
    products so the fp32 path is a real check rather than TF32: 3xTF32 on NVIDIA (tensor
    cores; Triton's IEEE FMA path spills registers at attention tile sizes), IEEE elsewhere.
    """
    upcast = triton_interpreting() and dtype == torch.bfloat16
    if dtype != torch.float32:
        return upcast, None  # Triton's default for 16-bit operands
    return upcast, ("ieee" if getattr(torch.version, "hip", None) else "tf32x3")


def num_warps_for(tile_elems: int, elem_bytes: int, max_warps: int = 16) -> int:
    """Warps for a one-tile-per-program kernel: about two 16-byte vectors per thread.

    Memory-bound row kernels want each thread to issue a few wide loads and no more (more
    per-thread work serialises; more threads than vectors idles lanes).
    """
    vectors = max(1, tile_elems * elem_bytes // 16)
    warps = 1
    while warps < max_warps and warps * 32 * 2 < vectors:
        warps *= 2
    return warps


@triton.jit
def to_fp8_e4m3(y, EXACT_CAST: tl.constexpr):
    """fp32 ``y`` (already clamped to +-448) -> float8e4nv, round-to-nearest-even.

    On GPUs the cast is one RNE conversion instruction. Triton's CPU interpreter (3.9) rounds
    half-up and drops the carry when rounding overflows the mantissa (31.6 -> 16 instead of 32),
    so with ``EXACT_CAST`` (interpreter only) the value is first rounded onto the e4m3 grid in
    fp32 with the add-a-magic-number trick, which makes the cast exact.
    """
    if EXACT_CAST:
        bits = y.to(tl.int32, bitcast=True)
        exp = (bits >> 23) & 0xFF
        # e4m3 keeps 3 mantissa bits; below 2**-6 it is subnormal with a fixed spacing of 2**-9.
        ulp_exp = tl.maximum(exp - 3, 127 - 9)
        # 1.5 * 2**(ulp + 23): adding it leaves fp32 exactly ulp-spaced around |y| (RNE).
        magic = (((ulp_exp + 23) << 23) | (1 << 22)).to(tl.float32, bitcast=True)
        r = (tl.abs(y) + magic) - magic
        y = tl.where(y < 0, -r, r)
    return y.to(tl.float8e4nv)


@triton.jit
def cache_store(base_ptr, ptrs, x, mask, scale_ptr, FP8: tl.constexpr, EXACT_FP8: tl.constexpr):
    """Store ``x`` into a KV-cache location: converted to the cache dtype, or as fp8 ``x/scale``.

    ``base_ptr`` is the cache's base pointer (for its element type); ``scale_ptr`` points to the
    per-tensor float32 scale, loaded on the device so callers never synchronise on it.
    """
    if FP8:
        s = tl.load(scale_ptr).to(tl.float32)
        y = tl.clamp(x.to(tl.float32) / s, -448.0, 448.0)
        tl.store(ptrs, to_fp8_e4m3(y, EXACT_FP8), mask=mask)
    else:
        tl.store(ptrs, x.to(base_ptr.dtype.element_ty), mask=mask)
