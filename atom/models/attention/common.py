"""What atom's MHA and MLA layers share: one step's batch as they see it, whatever the host, and
whether their kernels may be captured in CUDA graphs.

A host translates its own per-step metadata into :class:`AttentionBatch` (vLLM:
``atom.plugin.vllm.compat.attention_batch`` from ``CommonAttentionMetadata``); atom's metadata
builders read only this. Device tensors are the host's own (no copies); every int and the
``*_cpu`` tensors are host-side, so building metadata never reads a device value.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class AttentionBatch:
    num_actual_tokens: int
    num_reqs: int
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32, device
    query_start_loc_cpu: torch.Tensor  # the same, host
    seq_lens: torch.Tensor  # [num_reqs] int32, device, new tokens included
    #: host seq_lens: exact for prefill and extend rows (an upper bound is enough for decode
    #: rows); None when the host gives none
    seq_lens_cpu: Optional[torch.Tensor]
    block_table: torch.Tensor  # [num_reqs, max_blocks] int32
    slot_mapping: torch.Tensor  # [num_actual_tokens] int64, -1 = padding
    causal: bool = True


def split_decodes(batch: AttentionBatch, decode_threshold: int = 1) -> tuple[int, int, int, int]:
    """(num_decodes, num_rest, num_decode_tokens, num_rest_tokens) of a batch whose rows of at
    most ``decode_threshold`` query tokens come first (the host reorders them so), from host
    tensors only."""
    if batch.max_query_len <= decode_threshold:
        return batch.num_reqs, 0, batch.num_actual_tokens, 0
    qsl = batch.query_start_loc_cpu
    is_rest = (qsl[1: batch.num_reqs + 1] - qsl[: batch.num_reqs]) > decode_threshold
    if not bool(is_rest.any()):
        return batch.num_reqs, 0, batch.num_actual_tokens, 0
    num_decodes = int(is_rest.int().argmax())
    num_decode_tokens = int(qsl[num_decodes])
    return (num_decodes, batch.num_reqs - num_decodes, num_decode_tokens,
            batch.num_actual_tokens - num_decode_tokens)


def graph_safe(op_names: tuple[str, ...]) -> bool:
    """True when every op in ``op_names`` dispatches to its Triton kernel on this machine's
    device: those are the kernels a builder declares CUDA-graph support for (the torch
    reference paths sync with the host and must not be captured)."""
    import atom.ops as ops

    device = "cuda" if torch.cuda.is_available() else "cpu"
    return all(ops.OPS[name].backend_on(device)[0] == "triton" for name in op_names)
