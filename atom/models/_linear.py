"""Tensor-parallel linear and embedding layers, and how checkpoint tensors land in them.

Every layer owns only this rank's slice and knows how to cut it out of a full checkpoint tensor
(``load_weight``), so the model loads straight from the host's weight iterator with no second
read of the files:

* :class:`ColumnParallelLinear`: output rows split across ranks, no communication. Several
  logical matrices may be fused into one (q/k/v, gate/up); each is split on its own, so rank r
  holds ``[q_r; k_r; v_r]``.
* :class:`RowParallelLinear`: input columns split; partial products summed with the TP group's
  all-reduce.
* :class:`VocabParallelEmbedding` / :class:`ParallelLMHead`: vocabulary rows split in contiguous
  blocks (each padded to a multiple of 64 rows, padding at the tail of the vocabulary only).

The column- and row-parallel layers also load fp8 checkpoints (``quant``, an
:class:`atom.models._quant.Fp8Spec`): the weight is float8_e4m3fn and the scales are sliced with
it (per-tensor: one scale per fused matrix; block-scaled: the scale rows/columns of this rank's
tiles, so shard boundaries must fall on tile boundaries). ``process_weights_after_loading``
picks the compute path (see :mod:`atom.models._quant`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from atom import envs, ops
from atom.models._quant import (
    FP8_DTYPE,
    PER_TENSOR_BLOCK_K,
    Fp8Spec,
    dequant_block,
    fp8_w8a8_from,
    quantize_per_tensor,
    scaled_mm_usable,
)
from atom.models.interfaces import ModelParallel
from atom.ops._common import nvidia_gpu
from atom.ops.fused_quant import Activation, QuantizedActivation

VOCAB_PADDING = 64


def bf16_gemv_on(weight: torch.Tensor) -> bool:
    """Whether an unquantised linear on ``weight`` runs one-token steps on atom's GEMV
    (:func:`atom.ops.linear`): bf16 / fp16 weights with ``ATOM_BF16_GEMV`` on (the default) on an
    NVIDIA GPU, where it was measured faster than cuBLAS (bench/NOTES.md entry 27); on a CPU or
    ROCm only when the variable is set explicitly."""
    if weight.dtype not in (torch.bfloat16, torch.float16) or not envs.ATOM_BF16_GEMV:
        return False
    return nvidia_gpu(weight) or envs.is_set("ATOM_BF16_GEMV")


def divide(total: int, parts: int, what: str) -> int:
    if total % parts:
        raise ValueError(f"{what} ({total}) is not divisible by the tensor-parallel size ({parts})")
    return total // parts


def _copy_into(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"{name}: checkpoint shape {tuple(src.shape)} != expected {tuple(dst.shape)}")
    dst.copy_(src)


def _new_param(*shape: int, dtype: Optional[torch.dtype]) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class Fp8Linear(nn.Module):
    """What the column- and row-parallel layers share for fp8 checkpoints: the scale parameters,
    the post-load choice of compute path and the fp8 GEMM. ``quant`` None: a plain layer.

    Parameters (checkpoint names): ``weight`` fp8 ``[N, K]``; per-tensor ``weight_scale``
    ``[num_shards]`` (+ ``input_scale`` ``[num_shards]`` when static); block-scaled
    ``weight_scale_inv`` ``[ceil(N / bn), ceil(K / bk)]``. After
    :meth:`process_weights_after_loading` ``weight`` stays fp8: block-scaled (and per-tensor
    where ``torch._scaled_mm`` does not run, its scales turned into tile scales) it runs
    :func:`atom.ops.fp8_block_gemm` (``fp8_block`` set); on CUDA per-tensor ``torch._scaled_mm``
    with one ``weight_scale``. Only a ``quant.dequantize`` layer is dequantised (activation dtype,
    scales dropped).
    """

    def _init_weight(self, out: int, inp: int, num_shards: int, quant: Optional[Fp8Spec],
                     dtype: Optional[torch.dtype]) -> None:
        self.quant = quant
        self.act_dtype = dtype or torch.get_default_dtype()
        self.fp8_gemm = False
        #: (block_n, block_k) once the weight stays fp8 for :func:`atom.ops.fp8_block_gemm`
        self.fp8_block: Optional[tuple[int, int]] = None
        self.w8a8_from: Optional[int] = None
        #: one-token steps on :func:`atom.ops.linear` (ATOM_BF16_GEMV; set after loading)
        self.bf16_gemv = False
        self.weight = _new_param(out, inp, dtype=FP8_DTYPE if quant is not None else dtype)
        if quant is None:
            return
        if quant.block is None:
            self.weight_scale = _new_param(num_shards, dtype=torch.float32)
            if quant.static_activations:
                self.input_scale = _new_param(num_shards, dtype=torch.float32)
        else:
            bn, bk = quant.block
            self.weight_scale_inv = _new_param(_ceil_div(out, bn), _ceil_div(inp, bk), dtype=torch.float32)

    @staticmethod
    def _check_tiles(start: int, size: int, block: int, last: bool, what: str) -> None:
        if start % block or (size % block and not last):
            raise ValueError(f"fp8 block size {block} does not divide {what} (start {start}, size {size}): "
                             f"block-scaled checkpoints need tensor-parallel shards on tile boundaries")

    def process_weights_after_loading(self) -> None:
        """Repack an fp8 layer for its compute path; an unquantised bf16 / fp16 one takes the
        one-token GEMV where :func:`bf16_gemv_on` (warmed up now), and is otherwise left as it is."""
        q = self.quant
        if q is None and bf16_gemv_on(self.weight):
            self.bf16_gemv = True  # one-token steps on atom's GEMV (ATOM_BF16_GEMV), compiled now
            ops.warm_up_linear(self.weight, has_bias=getattr(self, "bias", None) is not None)
        if q is None or self.weight.dtype != FP8_DTYPE or self.fp8_gemm or self.fp8_block is not None:
            return  # unquantised, or already processed
        if q.dequantize:
            self._dequantize()
        elif q.block is None and scaled_mm_usable(self.weight):
            self._repack_per_tensor()
        elif q.block is None:
            self._per_tensor_as_blocks()
        else:
            self.fp8_block = q.block
        if self.fp8_block is not None:
            self.w8a8_from = fp8_w8a8_from(self.weight.device)
            self.warm_up_kernels()

    def warm_up_kernels(self, force: bool = False) -> int:
        """Compile the block-fp8 GEMM's variants for this layer's shape now (GPU only unless
        ``force``); 0 for other layers."""
        if self.fp8_block is None:
            return 0
        return ops.warm_up_fp8_block_gemm(self.weight, self.weight_scale_inv, self.fp8_block,
                                          act_dtype=self.act_dtype, w8a8_from=self.w8a8_from,
                                          has_bias=self._gemm_bias() is not None, force=force)

    def _gemm_bias(self) -> Optional[torch.Tensor]:
        """The bias the GEMM itself adds (row-parallel layers add theirs after the reduction)."""
        return getattr(self, "bias", None)

    def _dequantize(self) -> None:
        """Weight-only in the activation dtype: dequantise once; forward is the plain F.linear."""
        q = self.quant
        if q.block is None:
            w = self.weight.float() * self._row_scales()[:, None]
        else:
            w = dequant_block(self.weight, self.weight_scale_inv, q.block)
        self.weight = nn.Parameter(w.to(self.act_dtype), requires_grad=False)
        for name in ("weight_scale", "weight_scale_inv", "input_scale"):
            if name in self._parameters:
                delattr(self, name)

    def _per_tensor_as_blocks(self) -> None:
        """Per-tensor scales where ``torch._scaled_mm`` does not run (CPU, dims off 16): the weight
        stays fp8 and each fused shard's scale becomes a column of tile scales (tiles of
        ``gcd(shard rows) x 128``), so the block-scaled GEMM runs it unchanged (W8A16; a static
        ``input_scale`` is not needed without activation quantisation)."""
        rows = self._shard_rows()
        bn = functools.reduce(math.gcd, rows)
        n, k = self.weight.shape
        bk = PER_TENSOR_BLOCK_K
        per_tile = self._row_scales()[::bn].to(self.weight.device)
        self.weight_scale_inv = nn.Parameter(per_tile[:, None].expand(n // bn, _ceil_div(k, bk)).contiguous(),
                                             requires_grad=False)
        for name in ("weight_scale", "input_scale"):
            if name in self._parameters:
                delattr(self, name)
        self.fp8_block = (bn, bk)

    def _row_scales(self) -> torch.Tensor:
        """Per-tensor: the scale of each output row (its fused matrix's scale)."""
        rows = torch.tensor(self._shard_rows(), device=self.weight_scale.device)
        return self.weight_scale.float().repeat_interleave(rows, dim=0)

    def _shard_rows(self) -> list[int]:
        return [self.weight.shape[0]]

    def _repack_per_tensor(self) -> None:
        """CUDA per-tensor: requantise the fused shards to their largest scale (one scale per
        GEMM, as vLLM does), keep the weight fp8 for ``torch._scaled_mm``."""
        scale = self.weight_scale.float().max()
        w = self.weight.float() * self._row_scales()[:, None].to(self.weight.device)
        q, scale = quantize_per_tensor(w, scale)
        self.weight = nn.Parameter(q, requires_grad=False)
        self.weight_scale = nn.Parameter(scale, requires_grad=False)
        if "input_scale" in self._parameters:
            self.input_scale = nn.Parameter(self.input_scale.float().max(), requires_grad=False)
        self.fp8_gemm = True

    def fp8_input_spec(self) -> Optional[tuple[int, bool]]:
        """``(block_k, True)`` when this layer's GEMM will read a producer's fp8 activations
        (:func:`atom.models._layers.link_fp8_producers`): block-scaled, not dequantised, W8A8 on
        its device; else None. Decided from the config when the model is built (the weights are
        repacked later; a layer that does not end up on the block GEMM reads ``x`` as usual)."""
        q = self.quant
        if q is None or q.block is None or q.dequantize or fp8_w8a8_from(self.weight.device) is None:
            return None
        return int(q.block[1]), True

    def _matmul(self, x: Activation, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        act, x = (x, x.x) if isinstance(x, QuantizedActivation) else (None, x)
        if self.fp8_block is not None:
            fp8_in = {} if act is None or x.dim() != 2 else dict(x_fp8=act.q, x_fp8_scale=act.scale)
            return _on_rows(x, lambda x2: ops.fp8_block_gemm(x2, self.weight, self.weight_scale_inv, self.fp8_block,
                                                             bias=bias, w8a8_from=self.w8a8_from, **fp8_in))
        if not self.fp8_gemm:
            if self.weight.dtype == FP8_DTYPE:
                raise RuntimeError("fp8 layer used before process_weights_after_loading() repacked it")
            if self.bf16_gemv:
                return _on_rows(x, lambda x2: ops.linear(x2, self.weight, bias))
            return F.linear(x, self.weight, bias)

        def scaled_mm(x2: torch.Tensor) -> torch.Tensor:
            xq, xs = quantize_per_tensor(x2, getattr(self, "input_scale", None))
            return torch._scaled_mm(xq, self.weight.t(), scale_a=xs, scale_b=self.weight_scale,
                                    bias=bias, out_dtype=x.dtype)
        return _on_rows(x, scaled_mm)


def _on_rows(x: torch.Tensor, fn) -> torch.Tensor:
    """``fn`` (a GEMM of 2-D activations) on ``x [..., K]`` flattened to rows, reshaped back."""
    shape = x.shape
    y = fn(x.reshape(-1, shape[-1]))
    return y.reshape(*shape[:-1], y.shape[-1])


@dataclass(frozen=True)
class OutputSlice:
    """Rows ``[src_start, src_start + size)`` of one logical checkpoint matrix go to rows
    ``[dst_start, dst_start + size)`` of this rank's fused weight."""

    src_start: int
    dst_start: int
    size: int


class ColumnParallelLinear(Fp8Linear):
    """``y = x @ W_r.T (+ b_r)`` where ``W_r`` is this rank's rows of one or more fused matrices.

    ``slices`` maps a shard id (``None`` for an unfused layer, else e.g. ``"q"`` or ``0``) to
    where that matrix's rows for this rank come from and go. Use :meth:`merged` or :meth:`qkv`.
    """

    def __init__(
        self,
        input_size: int,
        local_output_size: int,
        slices: Mapping[Optional[Hashable], OutputSlice],
        bias: bool = False,
        dtype: Optional[torch.dtype] = None,
        quant: Optional[Fp8Spec] = None,
    ) -> None:
        super().__init__()
        self.input_size = input_size
        self.local_output_size = local_output_size
        self.slices = dict(slices)
        # Shards in output order: shard i's per-tensor scale is weight_scale[i].
        keys = [k for k in self.slices if k is not None] or [None]
        self.shard_order = sorted(keys, key=lambda k: self.slices[k].dst_start)
        self._init_weight(local_output_size, input_size, len(self.shard_order), quant, dtype)
        if quant is not None and quant.block is not None:
            last = max(self.slices.values(), key=lambda s: s.dst_start)
            for k, sl in self.slices.items():
                self._check_tiles(sl.src_start, sl.size, quant.block[0], sl is last, f"output shard {k!r}")
                self._check_tiles(sl.dst_start, sl.size, quant.block[0], sl is last, f"output shard {k!r}")
        self.bias = _new_param(local_output_size, dtype=dtype) if bias else None

    @classmethod
    def merged(
        cls,
        input_size: int,
        output_sizes: Sequence[int],
        parallel: ModelParallel,
        bias: bool = False,
        dtype: Optional[torch.dtype] = None,
        quant: Optional[Fp8Spec] = None,
    ) -> "ColumnParallelLinear":
        """Matrices of ``output_sizes`` rows fused along the output (shard ids 0, 1, ...), each
        split evenly; one size gives a plain column-parallel layer (shard id None as well)."""
        slices: dict[Optional[Hashable], OutputSlice] = {}
        dst = 0
        for i, size in enumerate(output_sizes):
            local = divide(size, parallel.tp_size, f"output size {i}")
            slices[i] = OutputSlice(parallel.tp_rank * local, dst, local)
            dst += local
        if len(output_sizes) == 1:
            slices[None] = slices[0]
        return cls(input_size, dst, slices, bias=bias, dtype=dtype, quant=quant)

    @classmethod
    def qkv(
        cls,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        parallel: ModelParallel,
        bias: bool = False,
        dtype: Optional[torch.dtype] = None,
        quant: Optional[Fp8Spec] = None,
    ) -> "ColumnParallelLinear":
        """Fused q/k/v (shard ids ``"q"``, ``"k"``, ``"v"``). Query heads are split across ranks;
        KV heads too when there are at least as many as ranks, otherwise each KV head is
        replicated on ``tp_size / num_kv_heads`` consecutive ranks (grouped-query attention:
        rank r's query heads use exactly the KV head it holds)."""
        tp, rank = parallel.tp_size, parallel.tp_rank
        local_heads = divide(num_heads, tp, "num_attention_heads")
        if num_kv_heads >= tp:
            local_kv = divide(num_kv_heads, tp, "num_key_value_heads")
            kv_index = rank
        else:
            replicas = divide(tp, num_kv_heads, "tensor-parallel size over num_key_value_heads")
            local_kv, kv_index = 1, rank // replicas
        q_rows, kv_rows = local_heads * head_dim, local_kv * head_dim
        slices = {
            "q": OutputSlice(rank * q_rows, 0, q_rows),
            "k": OutputSlice(kv_index * kv_rows, q_rows, kv_rows),
            "v": OutputSlice(kv_index * kv_rows, q_rows + kv_rows, kv_rows),
        }
        layer = cls(hidden_size, q_rows + 2 * kv_rows, slices, bias=bias, dtype=dtype, quant=quant)
        layer.num_local_heads, layer.num_local_kv_heads = local_heads, local_kv
        return layer

    def load_weight(self, param_name: str, loaded: torch.Tensor, shard_id: Optional[Hashable] = None) -> None:
        """Copy this rank's rows of checkpoint matrix ``shard_id`` into ``weight`` or ``bias``
        (or its scales: per-tensor into the shard's entry, block-scaled the scale rows of this
        rank's tiles)."""
        param = getattr(self, param_name)
        if shard_id is None and None not in self.slices:
            raise ValueError(f"fused layer needs a shard id ({list(self.slices)}) for {param_name}")
        s = self.slices[shard_id]
        what = f"{param_name}[{shard_id}]"
        if param_name in ("weight_scale", "input_scale"):
            index = 0 if shard_id is None else self.shard_order.index(shard_id)
            _copy_into(param.data[index:index + 1], loaded.reshape(1), what)
        elif param_name == "weight_scale_inv":
            bn = self.quant.block[0]
            rows = _ceil_div(s.size, bn)
            _copy_into(param.data.narrow(0, s.dst_start // bn, rows), loaded.narrow(0, s.src_start // bn, rows), what)
        else:
            _copy_into(param.data.narrow(0, s.dst_start, s.size), loaded.narrow(0, s.src_start, s.size), what)

    def _shard_rows(self) -> list[int]:
        return [self.slices[k].size for k in self.shard_order]

    def forward(self, x: Activation) -> torch.Tensor:
        return self._matmul(x, self.bias)

    def extra_repr(self) -> str:
        shards = [k for k in self.slices if k is not None]
        return f"in={self.input_size}, local_out={self.local_output_size}, shards={shards}"


class ReplicatedLinear(nn.Module):
    """``y = x @ W.T``, the whole matrix on every rank (small layers such as an MoE router,
    whose output every rank needs in full). Loaded by a plain copy."""

    def __init__(self, input_size: int, output_size: int, dtype: Optional[torch.dtype] = None) -> None:
        super().__init__()
        self.weight = _new_param(output_size, input_size, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class RowParallelLinear(Fp8Linear):
    """``y = all_reduce(x_r @ W_r.T) (+ b)``: ``x_r`` is this rank's slice of the input features
    (the output of a column-parallel layer), ``W_r`` the matching columns."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        parallel: ModelParallel,
        bias: bool = False,
        dtype: Optional[torch.dtype] = None,
        quant: Optional[Fp8Spec] = None,
    ) -> None:
        super().__init__()
        self.parallel = parallel
        self.local_input_size = divide(input_size, parallel.tp_size, "row-parallel input size")
        self._init_weight(output_size, self.local_input_size, 1, quant, dtype)
        if quant is not None and quant.block is not None:
            self._check_tiles(parallel.tp_rank * self.local_input_size, self.local_input_size, quant.block[1],
                              parallel.tp_size == 1, "the row-parallel input split")
        # The bias is added once, after the reduction, so every rank holds it whole.
        self.bias = _new_param(output_size, dtype=dtype) if bias else None

    def load_weight(self, param_name: str, loaded: torch.Tensor, shard_id: Optional[Hashable] = None) -> None:
        if param_name == "bias":
            _copy_into(self.bias.data, loaded, "bias")
            return
        if param_name in ("weight_scale", "input_scale"):
            _copy_into(getattr(self, param_name).data, loaded.reshape(1), param_name)
            return
        start = self.parallel.tp_rank * self.local_input_size
        if param_name == "weight_scale_inv":
            bk = self.quant.block[1]
            cols = self.weight_scale_inv.shape[1]
            _copy_into(self.weight_scale_inv.data, loaded.narrow(1, start // bk, cols), param_name)
            return
        _copy_into(self.weight.data, loaded.narrow(1, start, self.local_input_size), "weight")

    def _gemm_bias(self) -> Optional[torch.Tensor]:
        return None

    @property
    def reduce_group(self) -> Optional[Any]:
        """The group :meth:`forward` sums over (None with one rank)."""
        return self.parallel.tp_group if self.parallel.tp_size > 1 else None

    def forward(self, x: Activation, reduce: bool = True) -> torch.Tensor:
        """``reduce=False``: this rank's partial sum, for a caller that adds it to another partial
        sum over the same group and reduces once (:func:`atom.models._moe.routed_and_shared`)."""
        y = self._matmul(x)
        if not reduce:
            if self.bias is not None:
                raise ValueError("a row-parallel layer with a bias adds it after the reduction; reduce=False "
                                 "would leave it out")
            return y
        if self.parallel.tp_size > 1:
            y = self.parallel.tp_group.all_reduce(y)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Token embedding with the vocabulary split in contiguous per-rank blocks."""

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        parallel: ModelParallel,
        dtype: Optional[torch.dtype] = None,
    ) -> None:
        super().__init__()
        self.parallel = parallel
        self.vocab_size = vocab_size
        self.tp_size = parallel.tp_size
        per_rank = -(-vocab_size // parallel.tp_size)
        self.rows_per_rank = -(-per_rank // VOCAB_PADDING) * VOCAB_PADDING
        self.vocab_start = parallel.tp_rank * self.rows_per_rank
        self.num_real_rows = max(0, min(vocab_size - self.vocab_start, self.rows_per_rank))
        self.weight = _new_param(self.rows_per_rank, hidden_size, dtype=dtype)

    def load_weight(self, param_name: str, loaded: torch.Tensor, shard_id: Optional[Hashable] = None) -> None:
        if loaded.shape[0] != self.vocab_size:
            raise ValueError(
                f"{param_name}: checkpoint has {loaded.shape[0]} rows, config vocab_size is {self.vocab_size}"
            )
        n = self.num_real_rows
        _copy_into(self.weight.data[:n], loaded.narrow(0, self.vocab_start, n), param_name)
        # Padding rows: zero, so their logits are 0 and their (never used) embeddings are too.
        self.weight.data[n:].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        mine = (local >= 0) & (local < self.num_real_rows)
        out = F.embedding(torch.where(mine, local, torch.zeros_like(local)), self.weight)
        out = out * mine.unsqueeze(-1).to(out.dtype)
        return self.parallel.tp_group.all_reduce(out)

    def extra_repr(self) -> str:
        return f"vocab={self.vocab_size}, rows_per_rank={self.rows_per_rank}, start={self.vocab_start}"


class ParallelLMHead(VocabParallelEmbedding):
    """Output projection to this rank's vocabulary block (same layout as the embedding, so the
    two can share one weight when the checkpoint ties them)."""

    def tie_to(self, embedding: VocabParallelEmbedding) -> None:
        if embedding.weight.shape != self.weight.shape or embedding.vocab_start != self.vocab_start:
            raise ValueError("tied lm_head and embedding must have the same vocabulary layout")
        self.weight = embedding.weight

    def local_logits(self, hidden_states: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``[..., rows_per_rank]`` logits of this rank's block (padding included)."""
        return F.linear(hidden_states, self.weight, bias)

    def logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Full ``[..., vocab_size]`` logits on every rank (all-gather across the TP group)."""
        local = self.local_logits(hidden_states)
        if self.tp_size > 1:
            local = self.parallel.tp_group.all_gather(local, dim=-1)
        return local[..., : self.vocab_size]

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("ParallelLMHead projects hidden states: call local_logits() or logits()")
