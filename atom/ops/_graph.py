"""atom's model-facing ops as ``torch.library`` custom ops, so ``torch.compile`` can trace atom's models.

vLLM compiles a model's forward with Dynamo (``fullgraph=True``) and Inductor when the model
class carries its ``support_torch_compile`` decorator (atom's vLLM wrapper does, see
``atom.plugin.vllm.compile``). Dynamo cannot trace an atom op's own call path: the dispatcher
reads the environment and picks a backend per call, the Triton implementations launch kernels
through Python wrappers, the torch reference of ``fused_moe`` loops over the experts present
(data-dependent), and RoPE writes into slices of its inputs.

So while Dynamo traces (``torch.compiler.is_compiling()``), :meth:`atom.ops.Op.__call__` hands the
call to the op's *graph form* defined here: one opaque node ``torch.ops.atom.<name>`` in the
graph, with a fake (meta) implementation that gives Inductor the output shapes. At run time the
node calls the same dispatcher as eager mode (AITER / Triton / torch by device and dtype), so the
numbers are the eager op's numbers; Inductor compiles the glue between these nodes (linear
layers, reshapes, residual adds), and vLLM splits the graph at its attention op for piecewise
CUDA graphs.

Elementwise ops (RMSNorm with and without the residual add, fp8 output included; RoPE; SiLU-and-mul)
also have an *inductor form* (``Op.inductor_form``: their torch reference, fp32 math and one
rounding as the kernels do, RoPE writing into its inputs in place), which Dynamo traces instead of
the node below when ``ATOM_COMPILE_ELEMENTWISE=inductor`` (the default): Inductor then fuses them
with their neighbours (residual add + RMSNorm, q/k-norm + RoPE, SiLU-and-mul into the next
projection's input), as vLLM's own models are compiled, rather than launching one atom kernel per
node; AOT functionalisation turns RoPE's in-place writes into functional updates. With
``ATOM_COMPILE_ELEMENTWISE=kernels`` they stay the custom-op nodes below. MoE routing, the experts
and attention always use atom's kernels. Eager and CUDA-graph-only runs (no torch.compile) never
see either form.

Covered: the calls atom's models make (RMSNorm with and without the fused residual add, fp8
output included; RoPE in place; SiLU-and-mul; softmax and grouped-sigmoid top-k routing; fused MoE
with expert biases and either activation; the block-scaled fp8 linear and the producers that
quantise for it, :mod:`atom.ops.fused_quant`, which have no inductor form: their point is the
one kernel). An op without a graph form is traced as it is (fine for pure-torch code; otherwise Dynamo reports where it
stopped). Each node's real implementation returns fresh tensors (never an input or a view of one),
and declares the inputs it writes (``mutates_args``), as ``torch.library`` requires.

This module never imports vLLM.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from atom.ops.activation import SILU_AND_MUL
from atom.ops.fp8_gemm import fp8_block_gemm
from atom.ops.linear import linear, single_row
from atom.ops.fused_quant import rms_norm_quant_fp8, silu_and_mul_quant_fp8
from atom.ops.moe import fused_moe
from atom.ops.moe_routing import grouped_topk_sigmoid, topk_softmax
from atom.ops.rmsnorm import RMS_NORM
from atom.ops.rotary import ROTARY_EMBEDDING

LIB = "atom"
_LIBRARY = torch.library.Library(LIB, "FRAGMENT")


class _Node:
    """One ``torch.ops.atom.<name>`` op (what :func:`node` returns; called as
    ``torch.ops.atom.<name>``): ``register_fake`` as on a ``torch.library.custom_op``."""

    def __init__(self, name: str) -> None:
        self.qualname = f"{LIB}::{name}"

    def register_fake(self, fake):
        torch.library.register_fake(self.qualname, fake, lib=_LIBRARY)
        return fake


def node(name: str, *, mutates_args: tuple = ()):
    """Declare ``fn`` as the op ``atom::<name>``, its schema inferred from its annotations (as
    ``torch.library.custom_op`` infers it), its one implementation registered for every device
    (``CompositeExplicitAutograd``). This is how vLLM registers its own ops
    (``direct_register_custom_op``): Dynamo and Inductor see the same opaque node with a fake
    kernel, and a call outside CUDA graphs skips ``custom_op``'s Python wrapper (~7-10 us a call on a
    development CPU under ``torch.inference_mode``, bench/NOTES.md entry 47). No autograd: these
    are inference kernels."""
    def wrap(fn):
        _LIBRARY.define(name + torch.library.infer_schema(fn, mutates_args=mutates_args))
        _LIBRARY.impl(name, fn, "CompositeExplicitAutograd")
        return _Node(name)
    return wrap


def _fresh(t: torch.Tensor, inputs: tuple) -> torch.Tensor:
    """``t`` itself, or a copy when it shares storage with an input (custom ops may not alias)."""
    for i in inputs:
        if isinstance(i, torch.Tensor) and t.untyped_storage().data_ptr() == i.untyped_storage().data_ptr():
            return t.clone()
    return t


# -- rms_norm ---------------------------------------------------------------------------------
@node("rms_norm", mutates_args=())
def _rms_norm_node(x: torch.Tensor, weight: torch.Tensor, eps: float,
                   out_dtype: Optional[torch.dtype] = None,
                   scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    return _fresh(RMS_NORM(x, weight, eps, None, out_dtype, scale), (x, weight))


@_rms_norm_node.register_fake
def _(x, weight, eps, out_dtype=None, scale=None):
    return x.new_empty(x.shape, dtype=out_dtype or x.dtype)


@node("fused_add_rms_norm", mutates_args=())
def _fused_add_rms_norm_node(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                             out_dtype: Optional[torch.dtype] = None,
                             scale: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    y, s = RMS_NORM(x, weight, eps, residual, out_dtype, scale)
    inputs = (x, residual, weight)
    return _fresh(y, inputs), _fresh(s, inputs)


@_fused_add_rms_norm_node.register_fake
def _(x, residual, weight, eps, out_dtype=None, scale=None):
    return x.new_empty(x.shape, dtype=out_dtype or x.dtype), x.new_empty(x.shape)


@RMS_NORM.graph
def _rms_norm_graph(x, weight, eps, residual=None, out_dtype=None, scale=None, *, out=None, residual_out=None):
    if residual is None:
        y = torch.ops.atom.rms_norm(x, weight, float(eps), out_dtype, scale)
        return y if out is None else out.copy_(y)
    y, s = torch.ops.atom.fused_add_rms_norm(x, residual, weight, float(eps), out_dtype, scale)
    if out is not None:
        y = out.copy_(y)
    if residual_out is not None:
        s = residual_out.copy_(s)
    return y, s


# -- rotary_embedding (in place) --------------------------------------------------------------
@node("rotary_embedding", mutates_args=("query", "key"))
def _rotary_node(positions: torch.Tensor, query: torch.Tensor, key: Optional[torch.Tensor],
                 cos_sin_cache: torch.Tensor, head_size: int, rotary_dim: int, is_neox: bool) -> None:
    ROTARY_EMBEDDING(positions, query, key, cos_sin_cache, head_size, rotary_dim, is_neox)


@_rotary_node.register_fake
def _(positions, query, key, cos_sin_cache, head_size, rotary_dim, is_neox):
    return None


@ROTARY_EMBEDDING.graph
def _rotary_graph(positions, query, key, cos_sin_cache, head_size, rotary_dim, is_neox):
    torch.ops.atom.rotary_embedding(positions, query, key, cos_sin_cache, int(head_size), int(rotary_dim),
                                    bool(is_neox))
    return query, key


# -- silu_and_mul -------------------------------------------------------------------------------
@node("silu_and_mul", mutates_args=())
def _silu_node(x: torch.Tensor) -> torch.Tensor:
    return _fresh(SILU_AND_MUL(x), (x,))


@_silu_node.register_fake
def _(x):
    return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))


@SILU_AND_MUL.graph
def _silu_graph(x, *, out=None):
    y = torch.ops.atom.silu_and_mul(x)
    return y if out is None else out.copy_(y)


# -- MoE routing and experts --------------------------------------------------------------------
@node("topk_softmax", mutates_args=())
def _topk_softmax_node(router_logits: torch.Tensor, top_k: int,
                       renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    w, ids = topk_softmax(router_logits, top_k, renormalize)
    return _fresh(w, (router_logits,)), _fresh(ids, (router_logits,))


@_topk_softmax_node.register_fake
def _(router_logits, top_k, renormalize):
    t = router_logits.shape[0]
    return (router_logits.new_empty((t, top_k), dtype=torch.float32),
            router_logits.new_empty((t, top_k), dtype=torch.int32))


@topk_softmax.graph
def _topk_softmax_graph(router_logits, top_k, renormalize):
    return torch.ops.atom.topk_softmax(router_logits, int(top_k), bool(renormalize))


@node("grouped_topk_sigmoid", mutates_args=())
def _grouped_topk_node(router_logits: torch.Tensor, correction_bias: torch.Tensor, top_k: int, num_groups: int,
                       topk_groups: int, routed_scaling_factor: float,
                       renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    w, ids = grouped_topk_sigmoid(router_logits, correction_bias, top_k, num_groups, topk_groups,
                                  routed_scaling_factor, renormalize)
    inputs = (router_logits, correction_bias)
    return _fresh(w, inputs), _fresh(ids, inputs)


@_grouped_topk_node.register_fake
def _(router_logits, correction_bias, top_k, num_groups, topk_groups, routed_scaling_factor, renormalize):
    t = router_logits.shape[0]
    return (router_logits.new_empty((t, top_k), dtype=torch.float32),
            router_logits.new_empty((t, top_k), dtype=torch.int32))


@grouped_topk_sigmoid.graph
def _grouped_topk_graph(router_logits, correction_bias, top_k, num_groups, topk_groups, routed_scaling_factor,
                        renormalize):
    return torch.ops.atom.grouped_topk_sigmoid(router_logits, correction_bias, int(top_k), int(num_groups),
                                               int(topk_groups), float(routed_scaling_factor), bool(renormalize))


@node("fused_moe", mutates_args=())
def _fused_moe_node(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                    topk_ids: torch.Tensor, expert_map: Optional[torch.Tensor] = None,
                    w13_scale: Optional[torch.Tensor] = None, w2_scale: Optional[torch.Tensor] = None,
                    block_shape: Optional[list[int]] = None, w13_bias: Optional[torch.Tensor] = None,
                    w2_bias: Optional[torch.Tensor] = None, activation: str = "silu",
                    swiglu_alpha: float = 1.702, swiglu_limit: Optional[float] = 7.0,
                    x_fp8: Optional[torch.Tensor] = None,
                    x_fp8_scale: Optional[torch.Tensor] = None, num_shared: int = 0,
                    shared_fused_max_tokens: int = 0) -> torch.Tensor:
    # The shared experts' path is chosen here, at run time, by the batch's size: one compiled graph
    # serves both sides of shared_fused_max_tokens.
    out = fused_moe(x, w13, w2, topk_weights, topk_ids, expert_map=expert_map, w13_scale=w13_scale,
                    w2_scale=w2_scale, block_shape=block_shape, w13_bias=w13_bias, w2_bias=w2_bias,
                    activation=activation, swiglu_alpha=swiglu_alpha, swiglu_limit=swiglu_limit,
                    x_fp8=x_fp8, x_fp8_scale=x_fp8_scale, num_shared=num_shared,
                    shared_fused_max_tokens=shared_fused_max_tokens)
    return _fresh(out, (x, w13, w2, topk_weights, topk_ids))


@_fused_moe_node.register_fake
def _(x, w13, w2, topk_weights, topk_ids, expert_map=None, w13_scale=None, w2_scale=None, block_shape=None,
      w13_bias=None, w2_bias=None, activation="silu", swiglu_alpha=1.702, swiglu_limit=7.0, x_fp8=None,
      x_fp8_scale=None, num_shared=0, shared_fused_max_tokens=0):
    return x.new_empty(x.shape)


@fused_moe.graph
def _fused_moe_graph(x, w13, w2, topk_weights, topk_ids, *, expert_map=None, w13_scale=None, w2_scale=None,
                     block_shape=None, out=None, w13_bias=None, w2_bias=None, activation="silu",
                     swiglu_alpha=1.702, swiglu_limit=7.0, x_fp8=None, x_fp8_scale=None, num_shared=0,
                     shared_fused_max_tokens=0):
    y = torch.ops.atom.fused_moe(x, w13, w2, topk_weights, topk_ids, expert_map, w13_scale, w2_scale,
                                 None if block_shape is None else [int(b) for b in block_shape],
                                 w13_bias, w2_bias, str(activation), float(swiglu_alpha),
                                 None if swiglu_limit is None else float(swiglu_limit), x_fp8, x_fp8_scale,
                                 int(num_shared), int(shared_fused_max_tokens))
    return y if out is None else out.copy_(y)


# -- fp8 block-scaled linear ------------------------------------------------------------------
@node("fp8_block_gemm", mutates_args=())
def _fp8_block_gemm_node(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, block_shape: list[int],
                         x_scale: Optional[torch.Tensor] = None, bias: Optional[torch.Tensor] = None,
                         out_dtype: Optional[torch.dtype] = None, w8a8_from: Optional[int] = None,
                         x_fp8: Optional[torch.Tensor] = None,
                         x_fp8_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    y = fp8_block_gemm(x, weight, weight_scale, block_shape, x_scale=x_scale, bias=bias, out_dtype=out_dtype,
                       w8a8_from=w8a8_from, x_fp8=x_fp8, x_fp8_scale=x_fp8_scale)
    return _fresh(y, (x, weight, weight_scale))


@_fp8_block_gemm_node.register_fake
def _(x, weight, weight_scale, block_shape, x_scale=None, bias=None, out_dtype=None, w8a8_from=None, x_fp8=None,
      x_fp8_scale=None):
    return x.new_empty((x.shape[0], weight.shape[0]), dtype=out_dtype or x.dtype)


@fp8_block_gemm.graph
def _fp8_block_gemm_graph(x, weight, weight_scale, block_shape, *, x_scale=None, bias=None, out_dtype=None,
                          out=None, w8a8_from=None, x_fp8=None, x_fp8_scale=None):
    y = torch.ops.atom.fp8_block_gemm(x, weight, weight_scale, [int(b) for b in block_shape], x_scale, bias,
                                      out_dtype, None if w8a8_from is None else int(w8a8_from), x_fp8, x_fp8_scale)
    return y if out is None else out.copy_(y)


# -- float linear (ATOM_BF16_GEMV) ---------------------------------------------------------------
@node("linear", mutates_args=())
def _linear_node(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    if not single_row(x):
        # only a single row can run atom's GEMV; every other call is the reference, F.linear (a
        # fresh tensor), so it skips the dispatcher: outside CUDA graphs this node runs once per
        # linear layer and step
        return F.linear(x, weight, bias)
    return _fresh(linear(x, weight, bias), (x, weight))


@_linear_node.register_fake
def _(x, weight, bias=None):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@linear.graph
def _linear_graph(x, weight, bias=None):
    return torch.ops.atom.linear(x, weight, bias)


# -- producers that also quantise (atom.ops.fused_quant) ----------------------------------------
def _scales_like(x: torch.Tensor, k: int, group: int, column_major_scales: bool) -> torch.Tensor:
    m, g = x.shape[0], -(-k // group)
    if column_major_scales:
        return x.new_empty((g, m), dtype=torch.float32).t()
    return x.new_empty((m, g), dtype=torch.float32)


@node("rms_norm_quant_fp8", mutates_args=())
def _rms_norm_quant_node(x: torch.Tensor, weight: torch.Tensor, eps: float, group: int,
                         column_major_scales: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    y, q, s = rms_norm_quant_fp8(x, weight, eps, None, group, column_major_scales)
    inputs = (x, weight)
    return _fresh(y, inputs), q, s


@_rms_norm_quant_node.register_fake
def _(x, weight, eps, group, column_major_scales):
    return (x.new_empty(x.shape), x.new_empty(x.shape, dtype=torch.float8_e4m3fn),
            _scales_like(x, x.shape[1], group, column_major_scales))


@node("fused_add_rms_norm_quant_fp8", mutates_args=())
def _fused_add_rms_norm_quant_node(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                                   group: int, column_major_scales: bool
                                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    y, r, q, s = rms_norm_quant_fp8(x, weight, eps, residual, group, column_major_scales)
    inputs = (x, residual, weight)
    return _fresh(y, inputs), _fresh(r, inputs), q, s


@_fused_add_rms_norm_quant_node.register_fake
def _(x, residual, weight, eps, group, column_major_scales):
    return (x.new_empty(x.shape), x.new_empty(x.shape), x.new_empty(x.shape, dtype=torch.float8_e4m3fn),
            _scales_like(x, x.shape[1], group, column_major_scales))


@rms_norm_quant_fp8.graph
def _rms_norm_quant_graph(x, weight, eps, residual=None, group=128, column_major_scales=False):
    if residual is None:
        return torch.ops.atom.rms_norm_quant_fp8(x, weight, float(eps), int(group), bool(column_major_scales))
    return torch.ops.atom.fused_add_rms_norm_quant_fp8(x, residual, weight, float(eps), int(group),
                                                       bool(column_major_scales))


@node("silu_and_mul_quant_fp8", mutates_args=())
def _silu_quant_node(x: torch.Tensor, group: int,
                     column_major_scales: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    y, q, s = silu_and_mul_quant_fp8(x, group, column_major_scales)
    return _fresh(y, (x,)), q, s


@_silu_quant_node.register_fake
def _(x, group, column_major_scales):
    d = x.shape[1] // 2
    return (x.new_empty((x.shape[0], d)), x.new_empty((x.shape[0], d), dtype=torch.float8_e4m3fn),
            _scales_like(x, d, group, column_major_scales))


@silu_and_mul_quant_fp8.graph
def _silu_quant_graph(x, group=128, column_major_scales=False):
    return torch.ops.atom.silu_and_mul_quant_fp8(x, int(group), bool(column_major_scales))
