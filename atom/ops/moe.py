"""The fused expert MLP of mixture-of-experts layers (routing: :mod:`atom.ops.moe_routing`).

``fused_moe(x, w13, w2, topk_weights, topk_ids)`` computes, for every token ``t``::

    out[t] = sum_j topk_weights[t, j] * w2[e] @ silu_and_mul(w13[e] @ x[t]),  e = topk_ids[t, j]

with ``w13 = [gate; up]`` (``[E, 2 * inter, hidden]``, gate rows first) and
``silu_and_mul(h) = silu(h[:inter]) * h[inter:]`` (vLLM's convention). With ``expert_map``
(global id -> local id, -1 = expert not on this rank) the weights hold only the local experts
and pairs routed elsewhere contribute zero.

Shared experts (DeepSeek-V3, GLM-4-MoE): with ``num_shared=n`` the last ``n`` experts of ``w13`` /
``w2`` are always on, for every token with weight 1, next to its top-k (``topk_ids`` name routed
experts only). Up to ``shared_fused_max_tokens`` tokens (0: at every size) the Triton path runs them
as extra pairs of the fused kernel; above it, the routed experts in the fused kernel and each shared
one as a dense MLP (fp8: :func:`atom.ops.fp8_block_gemm`, so a host GEMM may serve it). Both give
the same sum (bench/NOTES.md 87-88).

GPT-OSS experts: optional biases ``w13_bias [E, 2 * inter]`` (added to ``w13 @ x``) and
``w2_bias [E, hidden]`` (added to the down projection, before the routing weight), and
``activation="swigluoai"``, the clamped SwiGLU on the same ``[gate; up]`` halves::

    gate = min(gate, limit); up = clamp(up, -limit, limit)
    swigluoai(h) = (up + 1) * gate * sigmoid(alpha * gate)

(``swiglu_alpha`` default 1.702, ``swiglu_limit`` default 7.0, None = no clamp). Checkpoints
that interleave gate and up columns (HF GPT-OSS: gate = ``[..., ::2]``) are de-interleaved
into this layout when loaded, so the kernels read both halves as contiguous row blocks.

fp8 block-scaled weights (``block_shape = [block_n, block_k]``, DeepSeek-V3 / Qwen3-FP8 style):
``w`` is float8_e4m3fn with one float32 scale per ``block_n x block_k`` tile
(``w_scale[e, n // block_n, k // block_k]``, dequant = value * scale). Activations entering each
GEMM are quantised dynamically per token and group of ``block_k`` channels: ``s = max|x_g| /
448``, ``q = fp8(x_g / s)``. The second GEMM's input (the silu-and-mul output) is quantised
from float32 the same way.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from atom.ops._common import FLOAT_DTYPES
from atom.ops._dispatch import declare
from atom.ops._warm import timed
from atom.ops.fp8_gemm import dequant_block_fp8

__all__ = ["fused_moe", "MOE_ACTIVATIONS", "fused_moe_torch", "per_token_group_quant_fp8_torch",
           "dequant_block_fp8_torch", "warm_up_fused_moe"]

FP8_MAX = 448.0
_FP8 = torch.float8_e4m3fn

#: Gated activations of the expert MLP (``activation=``): SwiGLU, and GPT-OSS's clamped SwiGLU.
MOE_ACTIVATIONS = ("silu", "swigluoai")


# -- fused MoE ---------------------------------------------------------------------------------


def per_token_group_quant_fp8_torch(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [rows, cols]`` -> (fp8 e4m3 values, float32 scales ``[rows, ceil(cols / group)]``).

    ``s = max(|x_g|, 1e-10) / 448`` per row and group of ``group`` columns; ``q = fp8(x_g / s)``.
    """
    rows, cols = x.shape
    groups = -(-cols // group)
    xf = x.float()
    pad = groups * group - cols
    if pad:
        xf = torch.nn.functional.pad(xf, (0, pad))
    xg = xf.view(rows, groups, group)
    s = xg.abs().amax(dim=-1).clamp(min=1e-10) / FP8_MAX
    q = (xg / s[..., None]).clamp(-FP8_MAX, FP8_MAX).to(_FP8)
    return q.view(rows, groups * group)[:, :cols], s


def _qdq(x: torch.Tensor, group: int) -> torch.Tensor:
    """Quantise-dequantise per token group (what the fp8 GEMM sees), float32."""
    q, s = per_token_group_quant_fp8_torch(x, group)
    return q.float() * s.repeat_interleave(group, dim=1)[:, : x.shape[1]]


#: fp8 ``w [E, N, K]`` with ``scale [E, ceil(N/bn), ceil(K/bk)]`` -> float32 weights.
dequant_block_fp8_torch = dequant_block_fp8


def gated_activation_torch(h: torch.Tensor, activation: str = "silu", swiglu_alpha: float = 1.702,
                           swiglu_limit: Optional[float] = 7.0) -> torch.Tensor:
    """``h [rows, 2 * inter]`` (gate columns, then up columns) -> ``[rows, inter]``, float32."""
    inter = h.shape[-1] // 2
    gate, up = h[..., :inter].float(), h[..., inter:].float()
    if activation == "silu":
        return torch.nn.functional.silu(gate) * up
    if activation != "swigluoai":
        raise ValueError(f"activation must be one of {MOE_ACTIVATIONS}, got {activation!r}")
    if swiglu_limit is not None:
        gate = gate.clamp(max=swiglu_limit)
        up = up.clamp(min=-swiglu_limit, max=swiglu_limit)
    return (up + 1) * (gate * torch.sigmoid(swiglu_alpha * gate))


def _check_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
               topk_ids: torch.Tensor, expert_map: Optional[torch.Tensor],
               w13_scale: Optional[torch.Tensor], w2_scale: Optional[torch.Tensor],
               block_shape: Optional[Sequence[int]], out: Optional[torch.Tensor] = None,
               w13_bias: Optional[torch.Tensor] = None, w2_bias: Optional[torch.Tensor] = None,
               activation: str = "silu", num_shared: int = 0, shared_fused_max_tokens: int = 0) -> None:
    if x.dim() != 2:
        raise ValueError(f"x must be [tokens, hidden], got {tuple(x.shape)}")
    t, hidden = x.shape
    if w13.dim() != 3 or w13.shape[2] != hidden or w13.shape[1] % 2:
        raise ValueError(f"w13 must be [E, 2 * inter, {hidden}], got {tuple(w13.shape)}")
    e, two_inter, _ = w13.shape
    if tuple(w2.shape) != (e, hidden, two_inter // 2):
        raise ValueError(f"w2 must be [{e}, {hidden}, {two_inter // 2}], got {tuple(w2.shape)}")
    if topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != t:
        raise ValueError(f"topk_ids {tuple(topk_ids.shape)} / topk_weights "
                         f"{tuple(topk_weights.shape)} must both be [{t}, top_k]")
    fp8 = w13.dtype == _FP8
    if fp8 != (block_shape is not None) or fp8 != (w2.dtype == _FP8):
        raise ValueError("fp8 weights (both w13 and w2) go with block_shape and scales; "
                         "bf16/fp16/fp32 weights without")
    if fp8:
        if w13_scale is None or w2_scale is None or len(block_shape) != 2:
            raise ValueError("fp8 weights need w13_scale, w2_scale and block_shape=[bn, bk]")
        bn, bk = block_shape
        for name, w, s in (("w13_scale", w13, w13_scale), ("w2_scale", w2, w2_scale)):
            want = (e, -(-w.shape[1] // bn), -(-w.shape[2] // bk))
            if tuple(s.shape) != want:
                raise ValueError(f"{name} must be {list(want)}, got {tuple(s.shape)}")
    elif w13.dtype != x.dtype or w2.dtype != x.dtype:
        raise ValueError(f"weights {w13.dtype}/{w2.dtype} must match x {x.dtype}")
    if expert_map is not None and expert_map.dim() != 1:
        raise ValueError("expert_map must be [num_global_experts]")
    if out is not None and (out.shape != x.shape or out.dtype != x.dtype):
        raise ValueError(f"out must be {tuple(x.shape)} {x.dtype}, got {tuple(out.shape)} {out.dtype}")
    if w13_bias is not None and tuple(w13_bias.shape) != (e, two_inter):
        raise ValueError(f"w13_bias must be [{e}, {two_inter}], got {tuple(w13_bias.shape)}")
    if w2_bias is not None and tuple(w2_bias.shape) != (e, hidden):
        raise ValueError(f"w2_bias must be [{e}, {hidden}], got {tuple(w2_bias.shape)}")
    if activation not in MOE_ACTIVATIONS:
        raise ValueError(f"activation must be one of {MOE_ACTIVATIONS}, got {activation!r}")
    if not 0 <= num_shared < e or shared_fused_max_tokens < 0:
        raise ValueError(f"num_shared must be in [0, {e}) and shared_fused_max_tokens >= 0, got "
                         f"{num_shared}, {shared_fused_max_tokens}")
    if num_shared and (expert_map is not None or w13_bias is not None or w2_bias is not None):
        raise ValueError("shared experts (num_shared) go without expert_map and expert biases")


@declare("fused_moe",
         doc="Fused MoE expert MLP (gate/up + SiLU-and-mul or GPT-OSS's clamped SwiGLU + down, "
             "optional expert biases, routing-weighted sum); bf16 and fp8 block-scaled weights; "
             "expert parallelism via expert_map.")
def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                    topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
                    expert_map: Optional[torch.Tensor] = None,
                    w13_scale: Optional[torch.Tensor] = None,
                    w2_scale: Optional[torch.Tensor] = None,
                    block_shape: Optional[Sequence[int]] = None,
                    out: Optional[torch.Tensor] = None,
                    w13_bias: Optional[torch.Tensor] = None,
                    w2_bias: Optional[torch.Tensor] = None,
                    activation: str = "silu",
                    swiglu_alpha: float = 1.702,
                    swiglu_limit: Optional[float] = 7.0,
                    x_fp8: Optional[torch.Tensor] = None,
                    x_fp8_scale: Optional[torch.Tensor] = None,
                    num_shared: int = 0,
                    shared_fused_max_tokens: int = 0) -> torch.Tensor:
    """Fused MoE expert MLP of ``x [tokens, hidden]`` routed by ``topk_weights`` / ``topk_ids``
    (see the module docstring). The reference: float32 math, one dense matmul pair per expert
    that has tokens. fp8 experts: ``x_fp8`` / ``x_fp8_scale`` are ``x``'s 1 x ``block_k``
    quantisation when the kernel that produced ``x`` wrote it (:mod:`atom.ops.fused_quant`); the
    experts then read it instead of quantising ``x`` again. ``num_shared`` /
    ``shared_fused_max_tokens``: always-on shared experts (the module docstring).

    Returns ``[tokens, hidden]`` in ``x``'s dtype (written into ``out`` when given).
    """
    _check_moe(x, w13, w2, topk_weights, topk_ids, expert_map, w13_scale, w2_scale, block_shape,
               out, w13_bias, w2_bias, activation, num_shared, shared_fused_max_tokens)
    _check_x_fp8(x, block_shape, x_fp8, x_fp8_scale)
    if num_shared:
        topk_weights, topk_ids = with_shared_experts(topk_weights, topk_ids, w13.shape[0], num_shared)
    fp8 = block_shape is not None
    if fp8:
        bk = int(block_shape[1])
        w13f = dequant_block_fp8_torch(w13, w13_scale, block_shape)
        w2f = dequant_block_fp8_torch(w2, w2_scale, block_shape)
        if x_fp8 is None:
            xin = _qdq(x, bk)
        else:
            xin = x_fp8.float() * x_fp8_scale.repeat_interleave(bk, dim=1)[:, : x.shape[1]]
    else:
        w13f, w2f, xin = w13.float(), w2.float(), x.float()
    ids = topk_ids.long()
    local = expert_map.long()[ids] if expert_map is not None else ids
    acc = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in torch.unique(local).tolist():
        if e < 0:
            continue
        tok, slot = torch.nonzero(local == e, as_tuple=True)
        h = xin[tok] @ w13f[e].t()
        if w13_bias is not None:
            h = h + w13_bias[e].float()
        a = gated_activation_torch(h, activation, swiglu_alpha, swiglu_limit)
        if fp8:
            a = _qdq(a, bk)
        y = a @ w2f[e].t()
        if w2_bias is not None:
            y = y + w2_bias[e].float()
        acc.index_add_(0, tok, y * topk_weights[tok, slot].float()[:, None])
    if out is None:
        return acc.to(x.dtype)
    out.copy_(acc)
    return out


fused_moe_torch = fused_moe.reference


_SHARED_IDS: dict[tuple, torch.Tensor] = {}


def with_shared_experts(topk_weights: torch.Tensor, topk_ids: torch.Tensor, num_experts: int,
                        num_shared: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every token's top-k with the last ``num_shared`` of ``num_experts`` local experts appended,
    weight 1: ``([T, k + n] weights, [T, k + n] ids)``."""
    t = topk_ids.shape[0]
    key = (num_experts, num_shared, topk_ids.dtype, topk_ids.device)
    ids = _SHARED_IDS.get(key)
    if ids is None:  # made once (the first call is a warm-up, before any CUDA-graph capture)
        ids = _SHARED_IDS[key] = torch.arange(num_experts - num_shared, num_experts, dtype=topk_ids.dtype,
                                              device=topk_ids.device)
    return (torch.cat([topk_weights, topk_weights.new_ones(t, num_shared)], dim=1),
            torch.cat([topk_ids, ids[None].expand(t, -1)], dim=1))


def _check_x_fp8(x: torch.Tensor, block_shape: Optional[Sequence[int]], x_fp8: Optional[torch.Tensor],
                 x_fp8_scale: Optional[torch.Tensor]) -> None:
    if x_fp8 is None and x_fp8_scale is None:
        return
    if block_shape is None or x_fp8 is None or x_fp8_scale is None:
        raise ValueError("x_fp8 and x_fp8_scale go together, with fp8 block-scaled experts")
    groups = -(-x.shape[1] // int(block_shape[1]))
    if x_fp8.dtype != _FP8 or x_fp8.shape != x.shape:
        raise ValueError(f"x_fp8 must be float8_e4m3fn {list(x.shape)}, got {x_fp8.dtype} {list(x_fp8.shape)}")
    if x_fp8_scale.dtype != torch.float32 or tuple(x_fp8_scale.shape) != (x.shape[0], groups):
        raise ValueError(f"x_fp8_scale must be float32 {[x.shape[0], groups]}, got {x_fp8_scale.dtype} "
                         f"{list(x_fp8_scale.shape)}")


def _fused_moe_triton_supports(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                               topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
                               block_shape=None, out=None, w13_bias=None, w2_bias=None,
                               **kwargs) -> Optional[str]:
    for name, t in (("x", x), ("w13", w13), ("w2", w2), ("out", out), ("w13_bias", w13_bias),
                    ("w2_bias", w2_bias)):
        if t is not None and t.stride(-1) != 1:
            return f"{name} must be unit-stride in its last dim"
    if block_shape is not None:
        bk = int(block_shape[1])
        if bk < 16 or bk & (bk - 1):
            return f"block_k {bk} must be a power of two >= 16"
    return None


@fused_moe.triton(supports=_fused_moe_triton_supports, dtypes=FLOAT_DTYPES)
def _fused_moe_triton(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                      topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                      **kwargs) -> torch.Tensor:
    n, limit = kwargs.pop("num_shared", 0), kwargs.pop("shared_fused_max_tokens", 0)
    _check_moe(x, w13, w2, topk_weights, topk_ids, kwargs.get("expert_map"),
               kwargs.get("w13_scale"), kwargs.get("w2_scale"), kwargs.get("block_shape"),
               kwargs.get("out"), kwargs.get("w13_bias"), kwargs.get("w2_bias"),
               kwargs.get("activation", "silu"), n, limit)
    _check_x_fp8(x, kwargs.get("block_shape"), kwargs.get("x_fp8"), kwargs.get("x_fp8_scale"))
    from atom.ops.moe_triton import fused_moe_fwd

    if n and shared_in_fused_kernel(x.shape[0], limit):  # the shared experts as extra pairs of the fused kernel
        topk_weights, topk_ids = with_shared_experts(topk_weights, topk_ids, w13.shape[0], n)
    elif n:  # the routed experts alone (the slots cut off), then each shared one dense
        out = fused_moe_fwd(x, w13[:-n], w2[:-n], topk_weights, topk_ids, **_routed_kwargs(n, kwargs))
        for j in range(w13.shape[0] - n, w13.shape[0]):
            out += _dense_expert(x, w13, w2, j, **kwargs)
        return out
    return fused_moe_fwd(x, w13, w2, topk_weights, topk_ids, **kwargs)


def shared_in_fused_kernel(tokens: int, shared_fused_max_tokens: int) -> bool:
    """Whether a batch of ``tokens`` runs the shared experts inside the fused kernel (else dense)."""
    return not shared_fused_max_tokens or tokens <= shared_fused_max_tokens


def _routed_kwargs(n: int, kwargs: dict) -> dict:
    """``kwargs`` with the fp8 scales cut to the routed experts (the last ``n``, shared, dropped: views)."""
    return {k: (v[:-n] if k in ("w13_scale", "w2_scale") and v is not None else v) for k, v in kwargs.items()}


def _dense_expert(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, j: int, *, block_shape=None,
                  w13_scale=None, w2_scale=None, activation: str = "silu", swiglu_alpha: float = 1.702,
                  swiglu_limit: Optional[float] = 7.0, x_fp8=None, x_fp8_scale=None, **_) -> torch.Tensor:
    """Stacked expert ``j``'s MLP of every token (weight 1) on the dense GEMMs: fp8 W8A8
    :func:`atom.ops.fp8_block_gemm` (the host's GEMMs where it offers them; ``x`` quantised as the
    fused kernel quantises it) or ``F.linear``."""
    from atom.ops.activation import silu_and_mul
    from atom.ops.fp8_gemm import fp8_block_gemm
    from atom.ops.fused_quant import silu_and_mul_quant_fp8

    if activation != "silu":
        raise ValueError(f"shared experts run SiLU-and-mul, not {activation!r}")
    if block_shape is None:
        return torch.nn.functional.linear(silu_and_mul.run("triton", torch.nn.functional.linear(x, w13[j])), w2[j])
    fp8_in = {} if x_fp8 is None else dict(x_fp8=x_fp8, x_fp8_scale=x_fp8_scale)
    h = fp8_block_gemm.run("triton", x, w13[j], w13_scale[j], block_shape, w8a8_from=1, **fp8_in)
    a, q, s = silu_and_mul_quant_fp8.run("triton", h, int(block_shape[1]))
    return fp8_block_gemm.run("triton", a, w2[j], w2_scale[j], block_shape, w8a8_from=1, x_fp8=q, x_fp8_scale=s)


def _fused_moe_aiter_supports(x: torch.Tensor, w13: torch.Tensor, *args, expert_map=None,
                              block_shape=None, w13_bias=None, w2_bias=None, activation="silu",
                              num_shared=0, **kwargs) -> Optional[str]:
    if num_shared:
        return "shared experts (num_shared) are not covered by atom's aiter binding"
    if w13_bias is not None or w2_bias is not None or activation != "silu":
        return "expert biases and the swigluoai activation are not covered by atom's aiter binding"
    if expert_map is not None:
        return "expert_map (expert parallelism) is not covered by atom's aiter binding"
    if block_shape is not None:
        return "fp8 block-scaled weights are not covered by atom's aiter binding (aiter wants its own scale layout)"
    return None


@fused_moe.aiter(supports=_fused_moe_aiter_supports, dtypes=(torch.float16, torch.bfloat16))
def _fused_moe_aiter(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                     topk_weights: torch.Tensor, topk_ids: torch.Tensor, **kwargs) -> torch.Tensor:
    from aiter.fused_moe import fused_moe as aiter_fused_moe  # deferred: ROCm only

    for name in ("x_fp8", "x_fp8_scale"):  # bf16 experts only here: nothing reads them
        kwargs.pop(name, None)

    res = aiter_fused_moe(x, w13, w2, topk_weights.float(), topk_ids.to(torch.int32))
    out = kwargs.get("out")
    if out is None:
        return res
    out.copy_(res)
    return out


def warm_up_fused_moe(w13: torch.Tensor, w2: torch.Tensor, top_k: int, num_experts: int, *,
                      act_dtype: torch.dtype, force: bool = False, **kwargs) -> int:
    """Compile, before the first request, the Triton kernels :func:`fused_moe` launches for a
    layer with these weights at every tile configuration (see
    :func:`atom.ops.moe_triton.warm_up`); once per process and layer shape. ``kwargs``: the
    layer's :func:`fused_moe` keywords. Returns the launches made: 0 when the op would not run
    Triton on the weights' device unless ``force`` (tests, under the Triton interpreter)."""
    def part(v):  # tensors and None by presence; lists (block_shape) as tuples
        if isinstance(v, torch.Tensor) or v is None:
            return v is not None
        return tuple(v) if isinstance(v, (list, tuple)) else v

    key = (tuple(w13.shape), tuple(w2.shape), w13.dtype, act_dtype, str(w13.device), top_k, num_experts,
           tuple(sorted((k, part(v)) for k, v in kwargs.items())))
    if not fused_moe.claim_warm_up(key, w13.device.type, force):
        return 0
    from atom.ops.moe_triton import warm_up  # lazy: Triton is optional

    n, limit = kwargs.pop("num_shared", 0), kwargs.pop("shared_fused_max_tokens", 0)
    what = f"w13 {tuple(w13.shape)} {w13.dtype}"
    # Up to ``limit`` tokens (every size at 0) the shared experts are extra pairs of the fused kernel.
    fused_sizes = (1, limit if n else 0)
    launches = timed("fused_moe", what, lambda: warm_up(w13, w2, top_k + n, num_experts + n, act_dtype,
                                                        tokens=fused_sizes, **kwargs), w13.device)
    if not (n and limit):
        return launches
    # Above it: the routed experts alone, and each shared one on the dense GEMMs.
    e, block = w13.shape[0] - n, kwargs.get("block_shape")
    launches += timed("fused_moe", f"{what} routed", lambda: warm_up(w13[:-n], w2[:-n], top_k, num_experts, act_dtype,
                                                                     tokens=(limit + 1, 0), **_routed_kwargs(n, kwargs)),
                      w13.device)
    if block is not None:
        from atom.ops.fp8_gemm import warm_up_fp8_block_gemm

        for w, sc in ((w13[e], kwargs["w13_scale"][e]), (w2[e], kwargs["w2_scale"][e])):
            launches += warm_up_fp8_block_gemm(w, sc, block, act_dtype=act_dtype, w8a8_from=1, force=force,
                                               min_tokens=limit + 1)
    x = torch.zeros(limit + 1, w13.shape[2], dtype=act_dtype, device=w13.device)
    _dense_expert(x, w13, w2, e, **kwargs)  # its activation kernels
    return launches + 1
