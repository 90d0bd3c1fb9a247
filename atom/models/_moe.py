"""The mixture-of-experts layer shared by atom's MoE models: stacked expert weights, softmax
top-k routing and the fused expert MLP (:func:`atom.ops.topk_softmax`, :func:`atom.ops.fused_moe`),
and the sigmoid grouped top-k router of DeepSeek-V3-style models (:class:`GroupedTopkRouter`,
:func:`atom.ops.grouped_topk_sigmoid`), whose choice goes to :meth:`FusedMoE.forward_routed`.

Weights are stacked per layer, the layout :func:`atom.ops.fused_moe` takes: ``w13`` is
``[local_experts, 2 * local_inter, hidden]`` (each expert's gate rows, then its up rows) and
``w2`` is ``[local_experts, hidden, local_inter]``. They are filled at load from the
checkpoint's per-expert matrices (:meth:`FusedMoE.checkpoint_params` names them).

Shared experts (DeepSeek-V3, GLM-4-MoE): :func:`routed_and_shared` adds them to the routed sum,
either held in the fused MoE's slots after the routed experts (``FusedMoE(..., shared_experts=n)``,
tensor parallel, ``ATOM_FUSE_SHARED_EXPERTS``: :func:`atom.ops.fused_moe` runs each slot for every
token with weight 1, inside the fused kernel up to ``ATOM_FUSE_SHARED_EXPERTS_MAX_TOKENS`` tokens per
step and as a dense MLP above) or as a separate MLP whose partial sum joins the routed one before the
single all-reduce.

Parallelism (the MoE output is a sum of partial results, reduced once per layer):

* tensor parallel (default): every rank holds every expert, with its intermediate dim split
  like a column-parallel gate/up and a row-parallel down; the partial outputs are summed over
  the TP group.
* expert parallel (``use_expert_parallel``): rank r holds a contiguous block of whole experts;
  ``expert_map`` (global id -> local id, -1 elsewhere) makes the others contribute zero, and the
  partial outputs are summed over the EP group. Every rank sees every token (the all-reduce
  scheme, not all-to-all dispatch), so the EP group must hold the same tokens on every rank.

fp8 checkpoints (``quant``, :class:`atom.models._quant.Fp8Spec`): ``w13``/``w2`` are
float8_e4m3fn. Block-scaled: ``w13_weight_scale_inv [E, 2 * inter / bn, ceil(hidden / bk)]`` and
``w2_weight_scale_inv [E, ceil(hidden / bn), inter / bk]`` (this rank's tiles; the local
intermediate dim must be a multiple of the block). Per-tensor: ``w13_weight_scale [E, 2]``
(gate, up), ``w2_weight_scale [E]`` and, for static activations, ``w13_input_scale [E, 2]`` /
``w2_input_scale [E]`` (loaded; the fused kernel quantises activations per token group itself).
On CUDA the experts run :func:`atom.ops.fused_moe` on the fp8 weights (per-tensor scales are
expanded to 128 x 128 tiles when the dims allow); elsewhere the weights are dequantised at load
(weight-only, see :mod:`atom.models._quant`).
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from atom import envs, ops
from atom.models._linear import divide
from atom.models._loading import StackedParams
from atom.models._quant import FP8_DTYPE, Fp8Spec, dequant_block, fp8_w8a8_from
from atom.models.interfaces import ModelParallel
from atom.ops.fused_quant import Activation, QuantizedActivation

#: Position of each checkpoint matrix in an expert's stacked weights (shard id = (expert, this)).
GATE, UP, DOWN = 0, 1, 2


def _f32_param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=torch.float32), requires_grad=False)


class FusedMoE(nn.Module):
    """Routed experts with SwiGLU: ``out = sum_k w_k * down_e(silu(gate_e x) * up_e x)``
    (or, with ``activation="swigluoai"`` and ``bias``, GPT-OSS's biased, clamped variant; see
    :func:`atom.ops.fused_moe`).

    Args:
        num_experts: global expert count.
        top_k: experts per token.
        hidden_size, intermediate_size: the model dim and one expert's intermediate dim.
        parallel: this rank's TP/EP position and groups.
        renormalize: rescale the top-k softmax weights to sum 1 (Qwen3's ``norm_topk_prob``).
        use_expert_parallel: split experts across the EP group instead of splitting each expert
            across the TP group.
        activation: ``"silu"`` (SwiGLU) or ``"swigluoai"`` (GPT-OSS), with ``swiglu_alpha`` and
            ``swiglu_limit`` for the latter.
        bias: per-expert biases ``w13_bias [E, 2 * inter]`` and ``w2_bias [E, hidden]``. In
            tensor-parallel mode only TP rank 0 adds ``w2_bias`` (the partial outputs are summed).
        shared_experts: slots after the routed experts for always-on shared experts of the same
            shape (tensor parallel only): slot ``E + j`` holds the ``j``-th ``intermediate_size``
            chunk of the checkpoint's ``shared_experts`` MLP, and :func:`routed_and_shared` routes
            every token to each slot with weight 1 (bench/NOTES.md 87).
    """

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        parallel: ModelParallel,
        *,
        renormalize: bool,
        use_expert_parallel: bool = False,
        dtype: Optional[torch.dtype] = None,
        activation: str = "silu",
        swiglu_alpha: float = 1.702,
        swiglu_limit: Optional[float] = 7.0,
        bias: bool = False,
        quant: Optional[Fp8Spec] = None,
        shared_experts: int = 0,
    ) -> None:
        super().__init__()
        if shared_experts and (use_expert_parallel or bias):
            raise ValueError("shared-expert slots need tensor-parallel experts without biases")
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.num_shared, self.intermediate_size = shared_experts, intermediate_size
        self.activation_kwargs = ({"activation": "swigluoai", "swiglu_alpha": float(swiglu_alpha),
                                   "swiglu_limit": None if swiglu_limit is None else float(swiglu_limit)}
                                  if activation == "swigluoai" else {"activation": activation})
        if use_expert_parallel:
            self.num_local_experts = divide(num_experts, parallel.ep_size, "num_experts (over the EP size)")
            self.expert_start = parallel.ep_rank * self.num_local_experts
            self.local_inter, self.inter_start = intermediate_size, 0
            self.reduce_group = parallel.ep_group if parallel.ep_size > 1 else None
        else:
            self.num_local_experts, self.expert_start = num_experts, 0
            self.local_inter = divide(intermediate_size, parallel.tp_size, "moe intermediate size")
            self.inter_start = parallel.tp_rank * self.local_inter
            self.reduce_group = parallel.tp_group if parallel.tp_size > 1 else None
        e, i = self.num_local_experts + shared_experts, self.local_inter
        self.quant, self.act_dtype = quant, dtype or torch.get_default_dtype()
        self.block_shape: Optional[tuple[int, int]] = None  # set when the experts run in fp8
        wdtype = FP8_DTYPE if quant is not None else dtype
        self.w13 = nn.Parameter(torch.empty(e, 2 * i, hidden_size, dtype=wdtype), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(e, hidden_size, i, dtype=wdtype), requires_grad=False)
        if quant is not None and quant.block is not None:
            bn, bk = quant.block
            if i % bn or self.inter_start % bn or (i % bk and i != intermediate_size) or self.inter_start % bk:
                raise ValueError(f"fp8 block {list(quant.block)} does not tile this rank's expert "
                                 f"intermediate slice ({self.inter_start}+{i} of {intermediate_size})")
            self.w13_weight_scale_inv = _f32_param(e, 2 * i // bn, -(-hidden_size // bk))
            self.w2_weight_scale_inv = _f32_param(e, -(-hidden_size // bn), -(-i // bk))
        elif quant is not None:
            self.w13_weight_scale, self.w2_weight_scale = _f32_param(e, 2), _f32_param(e)
            if quant.static_activations:
                self.w13_input_scale, self.w2_input_scale = _f32_param(e, 2), _f32_param(e)
        if bias:
            self.w13_bias = nn.Parameter(torch.empty(e, 2 * i, dtype=dtype), requires_grad=False)
            self.w2_bias = nn.Parameter(torch.empty(e, hidden_size, dtype=dtype), requires_grad=False)
            # TP ranks each hold a slice of every expert and their outputs are summed: the down
            # bias must be added once, by rank 0. EP ranks hold whole experts: each adds its own.
            self.adds_w2_bias = use_expert_parallel or parallel.tp_rank == 0
        else:
            self.w13_bias = self.w2_bias = None
            self.adds_w2_bias = False
        #: Batches of at most this many tokens run the shared slots inside the fused kernel (0: every
        #: size); larger ones run them dense (ops.fused_moe; ATOM_FUSE_SHARED_EXPERTS_MAX_TOKENS).
        self.shared_fused_max_tokens = shared_fused_max_tokens(self.local_inter)
        if self.num_local_experts < num_experts:
            # A buffer, not a parameter: derived from the layout, never in a checkpoint.
            e = self.num_local_experts
            expert_map = torch.full((num_experts,), -1, dtype=torch.int32)
            expert_map[self.expert_start:self.expert_start + e] = torch.arange(e, dtype=torch.int32)
            self.register_buffer("expert_map", expert_map, persistent=False)
        else:
            self.expert_map = None

    @staticmethod
    def checkpoint_params(num_experts: int, module: str = "experts",
                          names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
                          quant: Optional[Fp8Spec] = None, shared: Optional[str] = None) -> StackedParams:
        """How HF's ``{module}.{e}.{gate,up,down}.weight`` (and, for fp8, their scales) land in
        ``{module}.w13/w2`` (``w13_weight_scale_inv``, ...); ``names`` are the checkpoint's gate,
        up and down matrix names (Mixtral: ``w1``, ``w3``, ``w2``). ``shared``: the checkpoint
        module of the shared experts that ride in the slots after the routed ones (shard id
        ``("shared", which)``)."""
        gate, up, down = names
        tensors = ["weight"]  # checkpoint tensor -> parameter ``w13_<tensor>`` (``w13`` for the weight)
        if quant is not None:
            tensors.append(quant.scale_name)
            if quant.block is None and quant.static_activations:
                tensors.append("input_scale")
        params = []
        for e in [*range(num_experts), *(["shared"] if shared else [])]:
            src = f"{module}.{e}" if e != "shared" else shared
            for tensor in tensors:
                sfx = "" if tensor == "weight" else f"_{tensor}"
                params += [
                    (f"{module}.w13{sfx}", f"{src}.{gate}.{tensor}", (e, GATE)),
                    (f"{module}.w13{sfx}", f"{src}.{up}.{tensor}", (e, UP)),
                    (f"{module}.w2{sfx}", f"{src}.{down}.{tensor}", (e, DOWN)),
                ]
        return params

    def load_weight(self, param_name: str, loaded: torch.Tensor, shard_id: Optional[Hashable] = None) -> None:
        """Copy this rank's part of one expert's checkpoint matrix or scale (others' experts:
        nothing)."""
        expert, which = shard_id
        if expert == "shared":  # chunk j of the shared MLP's intermediate dim -> slot E + j
            for j in range(self.num_shared):
                self._load_local(param_name, self._shared_chunk(param_name, loaded, j, which),
                                 self.num_local_experts + j, which, f"shared expert chunk {j}")
            return
        local = expert - self.expert_start
        if not 0 <= local < self.num_local_experts:
            return
        self._load_local(param_name, loaded, local, which, f"expert {expert}")

    def _shared_chunk(self, param_name: str, loaded: torch.Tensor, j: int, which: int) -> torch.Tensor:
        """The ``j``-th ``intermediate_size`` chunk of a shared-expert matrix or block scale (rows of
        gate/up, columns of down; a per-tensor scale is every chunk's)."""
        if param_name.endswith(("_weight_scale", "_input_scale")):
            return loaded
        size = self.intermediate_size
        if param_name.endswith("_weight_scale_inv"):  # whole tiles per chunk (fuses_shared_experts' check)
            size = -(-size // self.quant.block[1 if which == DOWN else 0])
        return loaded.narrow(1 if which == DOWN else 0, j * size, size)

    def _load_local(self, param_name: str, loaded: torch.Tensor, local: int, which: int, what: str) -> None:
        if param_name.endswith(("_weight_scale", "_input_scale")):  # per-tensor: one number
            param = getattr(self, param_name).data[local]
            (param if which == DOWN else param[which]).copy_(loaded.reshape(()))
            return
        if param_name.endswith("_weight_scale_inv"):
            self._load_block_scale(param_name, loaded, local, which)
            return
        i, start = self.local_inter, self.inter_start
        if which == DOWN:
            src, dst = loaded.narrow(1, start, i), self.w2.data[local]
        else:
            src, dst = loaded.narrow(0, start, i), self.w13.data[local].narrow(0, which * i, i)
        if dst.shape != src.shape:
            raise ValueError(f"{what} {param_name}[{which}]: checkpoint slice {tuple(src.shape)} "
                             f"!= expected {tuple(dst.shape)}")
        dst.copy_(src)

    def _load_block_scale(self, param_name: str, loaded: torch.Tensor, local: int, which: int) -> None:
        """The scale tiles of this rank's slice: rows of gate/up (intermediate rows split),
        columns of down (intermediate columns split)."""
        bn, bk = self.quant.block
        param = getattr(self, param_name).data[local]
        if which == DOWN:
            n = param.shape[1]
            src, dst = loaded.narrow(1, self.inter_start // bk, n), param
        else:
            n = self.local_inter // bn
            src, dst = loaded.narrow(0, self.inter_start // bn, n), param.narrow(0, which * n, n)
        if dst.shape != src.shape:
            raise ValueError(f"{param_name}[{which}]: checkpoint scale slice {tuple(src.shape)} "
                             f"!= expected {tuple(dst.shape)}")
        dst.copy_(src)

    def process_weights_after_loading(self) -> None:
        """fp8: keep the weights fp8 for :func:`atom.ops.fused_moe` on CUDA (per-tensor scales
        expanded to 128 x 128 tiles), else dequantise them to the activation dtype. Then, on a
        GPU, compile the expert kernels for every tile configuration (:meth:`warm_up_kernels`)."""
        self._repack_fp8()
        self.warm_up_kernels()

    def warm_up_kernels(self, force: bool = False) -> int:
        """Compile :func:`atom.ops.fused_moe`'s kernels for this layer's shapes now, at load, and
        not in the first served batch of each tile configuration (once per process and shape;
        CUDA only unless ``force``: tests, under the Triton interpreter). Returns the launches
        made."""
        if (self.w13.device.type != "cuda" and not force) or (self.w13.dtype == FP8_DTYPE and self.block_shape is None):
            return 0
        return ops.warm_up_fused_moe(self.w13, self.w2, self.top_k, self.num_experts, act_dtype=self.act_dtype,
                                     force=force, **self._fused_moe_kwargs())

    def _fused_moe_kwargs(self) -> dict:
        """The keywords this layer passes to :func:`atom.ops.fused_moe` besides weights and routing."""
        fp8 = {} if self.block_shape is None else dict(
            w13_scale=self.w13_weight_scale_inv, w2_scale=self.w2_weight_scale_inv, block_shape=self.block_shape)
        shared = {} if not self.num_shared else dict(num_shared=self.num_shared,
                                                      shared_fused_max_tokens=self.shared_fused_max_tokens)
        return dict(expert_map=self.expert_map, w13_bias=self.w13_bias,
                    w2_bias=self.w2_bias if self.adds_w2_bias else None, **self.activation_kwargs, **fp8, **shared)

    def _repack_fp8(self) -> None:
        if self.quant is None or self.w13.dtype != FP8_DTYPE or self.block_shape is not None:
            return  # unquantised, or already processed
        i, hidden = self.local_inter, self.w2.shape[1]
        if self.quant.block is None:
            s13 = self.w13_weight_scale.float().repeat_interleave(i, dim=1)  # [E, 2i]
            s2 = self.w2_weight_scale.float()
            if self.w13.device.type == "cuda" and i % 128 == 0 and hidden % 128 == 0:
                # A per-tensor scale is a block scale repeated over every tile.
                self._set_scales(s13[:, ::128, None].expand(-1, -1, hidden // 128),
                                 s2[:, None, None].expand(-1, hidden // 128, i // 128), (128, 128))
                return
            w13 = self.w13.float() * s13[:, :, None]
            w2 = self.w2.float() * s2[:, None, None]
        else:
            if self.w13.device.type == "cuda":
                self._set_scales(self.w13_weight_scale_inv.data, self.w2_weight_scale_inv.data, self.quant.block)
                return
            w13 = dequant_block(self.w13, self.w13_weight_scale_inv, self.quant.block)
            w2 = dequant_block(self.w2, self.w2_weight_scale_inv, self.quant.block)
        self.w13 = nn.Parameter(w13.to(self.act_dtype), requires_grad=False)
        self.w2 = nn.Parameter(w2.to(self.act_dtype), requires_grad=False)
        for name in ("w13_weight_scale", "w2_weight_scale", "w13_input_scale", "w2_input_scale",
                     "w13_weight_scale_inv", "w2_weight_scale_inv"):
            if name in self._parameters:
                delattr(self, name)

    def _set_scales(self, w13_scale: torch.Tensor, w2_scale: torch.Tensor, block: tuple[int, int]) -> None:
        for name in ("w13_weight_scale", "w2_weight_scale", "w13_input_scale", "w2_input_scale"):
            if name in self._parameters:
                delattr(self, name)
        self.w13_weight_scale_inv = nn.Parameter(w13_scale.contiguous(), requires_grad=False)
        self.w2_weight_scale_inv = nn.Parameter(w2_scale.contiguous(), requires_grad=False)
        self.block_shape = tuple(block)

    def fp8_input_spec(self) -> Optional[tuple[int, bool]]:
        """``(block_k, False)`` when the experts will read a producer's fp8 activations
        (block-scaled experts on a GPU, where they stay fp8, with W8A8 on), else None."""
        q = self.quant
        dev = self.w13.device
        if q is None or q.block is None or dev.type != "cuda" or fp8_w8a8_from(dev) is None:
            return None
        return int(q.block[1]), False

    def forward(self, hidden_states: Activation, router_logits: torch.Tensor) -> torch.Tensor:
        """Softmax top-k routing of ``router_logits`` ``[T, num_experts]``, then the experts."""
        topk_weights, topk_ids = ops.topk_softmax(router_logits, self.top_k, self.renormalize)
        return self.forward_routed(hidden_states, topk_weights, topk_ids)

    def forward_routed(self, hidden_states: Activation, topk_weights: torch.Tensor,
                       topk_ids: torch.Tensor, reduce: bool = True) -> torch.Tensor:
        """The experts for a routing already chosen (``[T, top_k]`` weights and global ids),
        summed over the TP or EP group (``reduce=False``: this rank's partial sum)."""
        if self.block_shape is None and self.w13.dtype == FP8_DTYPE:
            raise RuntimeError("fp8 experts used before process_weights_after_loading() repacked them")
        act, hidden_states = ((hidden_states, hidden_states.x) if isinstance(hidden_states, QuantizedActivation)
                              else (None, hidden_states))
        fp8_in = {} if act is None or self.block_shape is None else dict(x_fp8=act.q, x_fp8_scale=act.scale)
        out = ops.fused_moe(hidden_states, self.w13, self.w2, topk_weights, topk_ids, **self._fused_moe_kwargs(),
                            **fp8_in)
        if reduce and self.reduce_group is not None:
            out = self.reduce_group.all_reduce(out)
        return out

    def extra_repr(self) -> str:
        return (f"experts={self.num_local_experts}/{self.num_experts} from {self.expert_start}, "
                f"top_k={self.top_k}, local_inter={self.local_inter}, {self.activation_kwargs['activation']}"
                f"{', bias' if self.w13_bias is not None else ''}")


def routed_and_shared(experts: FusedMoE, shared: Optional[nn.Module], hidden_states: Activation,
                      topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """The routed experts plus the always-on shared ones: in the fused MoE's slots
    (``experts.num_shared``: :func:`atom.ops.fused_moe` adds them, weight 1) or a separate module
    (``shared(x, reduce=...)``, e.g. :class:`atom.models._decoder.GatedMLP`; None: none). When both
    sum over the same group (TP, or EP whose group is the TP group) each rank adds its two partial
    sums and the group reduces once, as vLLM's ``SharedFusedMoE`` does: one all-reduce per layer
    instead of two and no separate add of two reduced outputs (bench/NOTES.md 86)."""
    group = experts.reduce_group
    once = shared is not None and group is not None and group is getattr(shared, "reduce_group", None)
    out = experts.forward_routed(hidden_states, topk_weights, topk_ids, reduce=not once)
    if shared is not None:
        out = out + shared(hidden_states, reduce=not once)
    return group.all_reduce(out) if once else out


#: ``ATOM_FUSE_SHARED_EXPERTS_MAX_TOKENS=auto``: experts of at most this many intermediate rows on a
#: rank are "small" (DeepSeek-V3's TP-8 shard: 256; whole: 2048).
SMALL_EXPERT_INTER = 512


def shared_fused_max_tokens(local_inter: int) -> int:
    """``ATOM_FUSE_SHARED_EXPERTS_MAX_TOKENS``: the largest batch whose shared experts run inside
    the fused MoE (0: every batch). auto: 128 for experts of at most :data:`SMALL_EXPERT_INTER`
    intermediate rows on this rank, 1 for larger ones: the sizes where the slot measured faster than
    the separate MLP on the H100, at 256 and 2048 rows (bench/NOTES.md 88)."""
    limit = envs.ATOM_FUSE_SHARED_EXPERTS_MAX_TOKENS
    if limit is not None:
        return limit
    return 128 if local_inter <= SMALL_EXPERT_INTER else 1


def fuses_shared_experts(num_shared: int, use_expert_parallel: bool, intermediate_size: int = 0,
                         block: Optional[tuple[int, int]] = None) -> bool:
    """Whether a MoE block's shared experts ride in its fused MoE's slots (``FusedMoE(...,
    shared_experts=)``): there are some, the experts are tensor parallel (under EP the routed
    experts are whole and the shared ones split: other shapes), several shared chunks start on
    whole fp8 tiles (``block``), and ``ATOM_FUSE_SHARED_EXPERTS``."""
    if num_shared > 1 and block is not None and (intermediate_size % block[0] or intermediate_size % block[1]):
        return False
    return num_shared > 0 and not use_expert_parallel and bool(envs.ATOM_FUSE_SHARED_EXPERTS)


class GroupedTopkRouter(nn.Module):
    """Sigmoid grouped top-k routing with a score-correction bias (DeepSeek-V3's ``noaux_tc``, as
    GLM-4-MoE uses it): see :func:`atom.ops.grouped_topk_sigmoid`.

    HF names: ``gate.weight`` ``[num_experts, hidden]`` and ``gate.e_score_correction_bias``
    ``[num_experts]``, both held in float32 (as HF does; vLLM 0.26 keeps the weight in the model
    dtype and the bias in float32) whatever the model dtype, and replicated: every rank routes every
    token itself.
    """

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, *, num_groups: int, topk_groups: int,
                 routed_scaling_factor: float, renormalize: bool) -> None:
        super().__init__()
        self.top_k, self.num_groups, self.topk_groups = top_k, num_groups, topk_groups
        self.routed_scaling_factor, self.renormalize = float(routed_scaling_factor), renormalize
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=torch.float32), requires_grad=False)
        self.e_score_correction_bias = nn.Parameter(torch.empty(num_experts, dtype=torch.float32),
                                                    requires_grad=False)

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(topk_weights [T, top_k] float32, topk_ids [T, top_k] int32)``."""
        router_logits = F.linear(hidden_states.float(), self.weight)
        return ops.grouped_topk_sigmoid(router_logits, self.e_score_correction_bias, self.top_k, self.num_groups,
                                        self.topk_groups, self.routed_scaling_factor, self.renormalize)

    def extra_repr(self) -> str:
        return (f"experts={self.weight.shape[0]}, top_k={self.top_k}, groups={self.topk_groups}/{self.num_groups}, "
                f"scale={self.routed_scaling_factor}, renormalize={self.renormalize}")
