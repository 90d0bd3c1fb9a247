"""Linear layers on block-scaled fp8 weights: ``y = x @ dequant(W).T (+ bias)``.

``W`` is float8_e4m3fn ``[N, K]`` with one float32 multiplier per ``block_n x block_k`` tile,
``weight_scale [ceil(N / block_n), ceil(K / block_k)]`` (DeepSeek-V3 / Qwen3-FP8 ``weight_scale_inv``;
the last tile row / column may be partial): ``dequant(W)[n, k] = W[n, k] * scale[n // bn, k // bk]``.
The weight stays fp8 in memory; the kernels convert each tile in registers.

Two activation forms, one op (:func:`fp8_block_gemm`):

* **W8A16** (``x`` bf16 / fp16 / fp32, ``x_scale`` None): activations are used as they are; the
  result is what the same layer computes on the dequantised weights, up to summation order
  (fp8 values are exact in bf16, and the tile scale is applied to the fp32 partial sums, so no
  dequantised weight is ever rounded to bf16). Memory-bound small batches (decode) read half the
  bytes of a bf16 weight.
* **W8A8** (``x`` float8_e4m3fn with ``x_scale [M, ceil(K / bk)]`` from
  :func:`atom.ops.per_block_quant_fp8` with ``block = bk``): fp8 x fp8 tensor-core products,
  ``y = sum_kb (xq @ Wq.T)[kb] * x_scale[:, kb] * scale[n // bn, kb]``. ``out_dtype`` required.

``w8a8_from``: with a float ``x`` of at least that many rows, the op quantises ``x`` itself
(:func:`atom.ops.per_block_quant_fp8`, groups of ``bk``) and runs the W8A8 form; below it, W8A16.
The choice is made inside the op, per call, so a torch.compile graph holds one node for every
batch size. ``x_fp8`` / ``x_fp8_scale``: ``x``'s own 1 x ``bk`` quantisation, written by the
kernel that produced ``x`` (:mod:`atom.ops.fused_quant`); wherever the op would quantise ``x``
(W8A8, the host GEMM) it reads these instead, so no quantisation kernel runs in front of it.

Where the op would run W8A8, from a host-set batch size up, it may instead call a block-fp8
GEMM the host ships (:func:`set_host_gemm`; vLLM's plugin offers DeepGEMM or CUTLASS, faster
than atom's Triton W8A8 kernel from the sizes in docs/performance.md). Those are W8A8 kernels, so
a host GEMM serves only batches the op would quantise anyway: from ``max(host min_tokens,
w8a8_from)`` rows, never with ``w8a8_from`` None (W8A16 asked for). A host GEMM that quantises
float activations itself (``HostGemm.w8a16_batches``; vLLM's plugin: FlashInfer's swap-AB kernel,
2-16 tokens) also takes the batches below ``w8a8_from`` in its row range, still never with
``w8a8_from`` None. Which threshold a layer uses is the layer's choice (:mod:`atom.models._linear`).
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional, Sequence

import torch

from atom.ops._common import FLOAT_DTYPES, FP8_DTYPE
from atom.ops._dispatch import declare
from atom.ops._warm import timed
from atom.ops.quant import per_block_quant_fp8

__all__ = ["fp8_block_gemm", "dequant_block_fp8", "warm_up_fp8_block_gemm", "HostGemm", "set_host_gemm"]


def dequant_block_fp8(w: torch.Tensor, scale: torch.Tensor, block_shape: Sequence[int]) -> torch.Tensor:
    """fp8 ``w [..., N, K]`` with per-tile ``scale [..., ceil(N / bn), ceil(K / bk)]`` -> float32."""
    bn, bk = int(block_shape[0]), int(block_shape[1])
    n, k = w.shape[-2:]
    s = scale.float().repeat_interleave(bn, dim=-2)[..., :n, :].repeat_interleave(bk, dim=-1)[..., :k]
    return w.float() * s


def _check(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, block_shape: Sequence[int],
           x_scale: Optional[torch.Tensor], bias: Optional[torch.Tensor], out_dtype: Optional[torch.dtype],
           out: Optional[torch.Tensor], x_fp8: Optional[torch.Tensor] = None,
           x_fp8_scale: Optional[torch.Tensor] = None) -> torch.dtype:
    """Validate (the same for every backend); returns the output dtype."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"x [M, K] and weight [N, K] expected, got {tuple(x.shape)} and {tuple(weight.shape)}")
    if weight.dtype != FP8_DTYPE:
        raise ValueError(f"weight must be float8_e4m3fn, got {weight.dtype}")
    if len(block_shape) != 2 or min(int(b) for b in block_shape) <= 0:
        raise ValueError(f"block_shape must be [block_n, block_k] > 0, got {list(block_shape)}")
    bn, bk = int(block_shape[0]), int(block_shape[1])
    n, k = weight.shape
    want = (-(-n // bn), -(-k // bk))
    if tuple(weight_scale.shape) != want or weight_scale.dtype != torch.float32:
        raise ValueError(f"weight_scale must be float32 {list(want)}, got {weight_scale.dtype} "
                         f"{list(weight_scale.shape)}")
    if x.dtype == FP8_DTYPE:
        want_x = (x.shape[0], want[1])
        if x_scale is None or tuple(x_scale.shape) != want_x or x_scale.dtype != torch.float32:
            raise ValueError(f"fp8 x needs a float32 x_scale {list(want_x)} (per token and group of {bk})")
        if out_dtype not in FLOAT_DTYPES:
            raise ValueError(f"fp8 x needs out_dtype (one of {FLOAT_DTYPES}), got {out_dtype}")
        dtype = out_dtype
    else:
        if x.dtype not in FLOAT_DTYPES:
            raise ValueError(f"x must be float16/bfloat16/float32 or float8_e4m3fn, got {x.dtype}")
        if x_scale is not None:
            raise ValueError("x_scale goes with an fp8 x only")
        dtype = out_dtype or x.dtype
    if (x_fp8 is None) != (x_fp8_scale is None):
        raise ValueError("x_fp8 and x_fp8_scale go together")
    if x_fp8 is not None:
        want_x = (x.shape[0], want[1])
        if x.dtype == FP8_DTYPE or x_fp8.dtype != FP8_DTYPE or x_fp8.shape != x.shape:
            raise ValueError(f"x_fp8 must be float8_e4m3fn {list(x.shape)} next to a float x")
        if tuple(x_fp8_scale.shape) != want_x or x_fp8_scale.dtype != torch.float32:
            raise ValueError(f"x_fp8_scale must be float32 {list(want_x)} (per token and group of {bk})")
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"bias must be [{n}], got {tuple(bias.shape)}")
    if out is not None and (tuple(out.shape) != (x.shape[0], n) or out.dtype != dtype):
        raise ValueError(f"out must be {dtype} [{x.shape[0]}, {n}], got {out.dtype} {tuple(out.shape)}")
    return dtype


@declare("fp8_block_gemm",
         doc="Linear on 128x128-style block-scaled fp8 weights: W8A16 (activations as they are) or "
             "W8A8 (fp8 activations with per-token-group scales)")
def fp8_block_gemm(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                   block_shape: Sequence[int], *, x_scale: Optional[torch.Tensor] = None,
                   bias: Optional[torch.Tensor] = None, out_dtype: Optional[torch.dtype] = None,
                   out: Optional[torch.Tensor] = None, w8a8_from: Optional[int] = None,
                   x_fp8: Optional[torch.Tensor] = None, x_fp8_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``y [M, N] = x @ dequant(weight).T (+ bias)`` (see the module docstring). The reference:
    float32 math on the dequantised weight (and, for fp8 ``x``, the dequantised activations)."""
    dtype = _check(x, weight, weight_scale, block_shape, x_scale, bias, out_dtype, out, x_fp8, x_fp8_scale)
    if _w8a8(x, w8a8_from):
        x, x_scale = ((x_fp8, x_fp8_scale) if x_fp8 is not None
                      else per_block_quant_fp8.reference(x, int(block_shape[1])))
    xf = x.float()
    if x_scale is not None:
        bk = int(block_shape[1])
        xf = xf * x_scale.repeat_interleave(bk, dim=1)[:, : x.shape[1]]
    y = xf @ dequant_block_fp8(weight, weight_scale, block_shape).t()
    if bias is not None:
        y = y + bias.float()
    if out is None:
        return y.to(dtype)
    return out.copy_(y)


class HostGemm(NamedTuple):
    """A block-fp8 GEMM the host framework ships (vLLM: DeepGEMM's ``fp8_gemm_nt``, its CUTLASS
    ``cutlass_scaled_mm``, FlashInfer's swap-AB kernel), offered by the host's plugin
    (:func:`set_host_gemm`) and used for batches of ``min_tokens`` up to (not including)
    ``max_tokens`` rows (None: no end) that the op would run W8A8, and, with ``w8a16_batches``, the
    float batches below the layer's W8A8 threshold as well (a kernel that quantises them itself).
    ``fn(x, weight, weight_scale, block_shape, bias, x_fp8, x_fp8_scale)`` returns ``y``, or None
    where it does not apply (the op then tries the next host GEMM, then runs atom's kernel);
    ``x_fp8`` / ``x_fp8_scale`` (None when absent) are ``x``'s fused 1 x 128 quantisation, any
    scale strides. ``warm_up(weight, weight_scale, block_shape, act_dtype)`` (optional) compiles
    the kernel's variants for one weight before serving and returns the launches made."""

    fn: Callable[..., Optional[torch.Tensor]]
    min_tokens: int
    name: str
    warm_up: Optional[Callable[..., int]] = None
    max_tokens: Optional[int] = None
    w8a16_batches: bool = False

    def serves(self, m: int, w8a8: bool) -> bool:
        """Whether a batch of ``m`` rows (``w8a8``: one the op would quantise) is this GEMM's."""
        return (w8a8 or self.w8a16_batches) and self.min_tokens <= m and (self.max_tokens is None
                                                                          or m < self.max_tokens)


_HOST_GEMMS: tuple[HostGemm, ...] = ()


def set_host_gemm(*gemms: Optional[HostGemm]) -> None:
    """Offer the host's block-fp8 GEMMs (tried in this order); ``set_host_gemm(None)`` or no
    argument withdraws them all."""
    global _HOST_GEMMS
    _HOST_GEMMS = tuple(g for g in gemms if g is not None)


def _w8a8(x: torch.Tensor, w8a8_from: Optional[int]) -> bool:
    """Whether a float ``x`` is to be quantised for the W8A8 form."""
    return x.dtype != FP8_DTYPE and w8a8_from is not None and x.shape[0] >= w8a8_from


def _triton_supports(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                     block_shape: Sequence[int], *, out: Optional[torch.Tensor] = None,
                     **kwargs: object) -> Optional[str]:
    bk = int(block_shape[1])
    if bk < 16 or bk & (bk - 1):
        return f"block_k {bk} must be a power of two >= 16"
    for name, t in (("x", x), ("weight", weight), ("out", out)):
        if t is not None and t.stride(-1) != 1:
            return f"{name} must be unit-stride in its last dim"
    return None


@fp8_block_gemm.triton(supports=_triton_supports, dtypes=FLOAT_DTYPES + (FP8_DTYPE,))
def _fp8_block_gemm_triton(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                           block_shape: Sequence[int], *, x_scale: Optional[torch.Tensor] = None,
                           bias: Optional[torch.Tensor] = None, out_dtype: Optional[torch.dtype] = None,
                           out: Optional[torch.Tensor] = None, w8a8_from: Optional[int] = None,
                           x_fp8: Optional[torch.Tensor] = None,
                           x_fp8_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    dtype = _check(x, weight, weight_scale, block_shape, x_scale, bias, out_dtype, out, x_fp8, x_fp8_scale)
    from atom.ops.fp8_gemm_triton import fp8_block_gemm_fwd

    w8a8 = _w8a8(x, w8a8_from)
    if x_scale is None and out is None and x.dtype != FP8_DTYPE and w8a8_from is not None:
        for host in _HOST_GEMMS:
            if host.serves(x.shape[0], w8a8):
                y = host.fn(x, weight, weight_scale, block_shape, bias, x_fp8, x_fp8_scale)
                if y is not None:
                    return y
    if w8a8:
        x, x_scale = ((x_fp8, x_fp8_scale) if x_fp8 is not None
                      else per_block_quant_fp8.run("triton", x, int(block_shape[1])))

    return fp8_block_gemm_fwd(x, weight, weight_scale, (int(block_shape[0]), int(block_shape[1])),
                              x_scale=x_scale, bias=bias, out_dtype=dtype, out=out)


def warm_up_fp8_block_gemm(weight: torch.Tensor, weight_scale: torch.Tensor, block_shape: Sequence[int], *,
                           act_dtype: torch.dtype, w8a8_from: Optional[int] = None, has_bias: bool = False,
                           force: bool = False, min_tokens: int = 1) -> int:
    """Compile, before the first request, every kernel variant :func:`fp8_block_gemm` launches for
    this weight shape (one per batch-size bucket, W8A16 below ``w8a8_from`` tokens and W8A8 from
    it), and the host GEMMs' own variants where they have a warm-up (:class:`HostGemm`) and W8A8 is
    on (no host GEMM serves a layer that asked for W8A16 only); once per
    process and shape. ``min_tokens``: no smaller batch reaches this weight (the shared experts'
    dense path of :func:`atom.ops.fused_moe`), so a host GEMM that serves only smaller ones is not
    warmed. Returns the launches made: 0 when the op would not run Triton on the weight's device
    unless ``force`` (tests, under the Triton interpreter).

    The host GEMMs warm up first: the op hands the batch sizes they serve to them, so warmed
    after, a host kernel's first just-in-time compile ran inside atom's own line and was logged
    as atom's Triton GEMM (by the code, FlashInfer's swap-AB module: the ~100 s an H200 cold start
    logged for atom's line at the first weight that kernel serves; bench/NOTES.md 80)."""
    key = (tuple(weight.shape), tuple(weight_scale.shape), tuple(int(b) for b in block_shape), act_dtype,
           str(weight.device), w8a8_from, has_bias, min_tokens)
    if not fp8_block_gemm.claim_warm_up(key, weight.device.type, force):
        return 0
    from atom.ops.fp8_gemm_triton import warm_up

    block = (int(block_shape[0]), int(block_shape[1]))
    shape = str(tuple(weight.shape))
    launches = 0
    for host in _HOST_GEMMS if w8a8_from is not None else ():
        if host.warm_up is not None and (host.max_tokens is None or host.max_tokens > min_tokens):
            launches += timed(host.name, shape, lambda: host.warm_up(weight, weight_scale, block, act_dtype),
                              weight.device)
    return launches + timed("fp8_block_gemm", shape, lambda: warm_up(weight, weight_scale, block, act_dtype,
                                                                      w8a8_from, has_bias), weight.device)
