"""Paged attention over an NHD KV cache (the layout vLLM and SGLang hold): one entry point for prefill, extend and decode.

Layout (shared with the rest of atom):

* ``q``: ``[total_q_tokens, num_heads, head_size]``, the new tokens of every sequence packed
  back to back; sequence ``s`` owns rows ``query_start_loc[s]:query_start_loc[s+1]``.
* ``key_cache`` / ``value_cache``: ``[num_blocks, block_size, num_kv_heads, head_size]`` each
  (``kv[0]`` / ``kv[1]`` of one ``[2, num_blocks, ...]`` tensor, so any strides except a
  unit-stride last dim). Token ``j`` of sequence ``s`` lives in block ``block_table[s, j //
  block_size]`` at offset ``j % block_size``. The new tokens are already written; they are the
  last ``q_len`` of the ``seq_lens[s]`` tokens.
* fp8 caches (float8_e4m3fn / e5m2) are dequantised as ``value * k_scale`` (``v_scale``).

Masking: new token ``i`` of a sequence sits at position ``p = seq_len - q_len + i``; with
``causal`` it sees keys ``j <= p``; with ``sliding_window = W`` only keys ``j > p - W`` (the
last ``W`` keys including itself). ``sinks`` (one float32 logit per query head, GPT-OSS) add
``exp(sink)`` to every softmax denominator with no value attached.

``lse`` (optional float32 output ``[total_q_tokens, num_heads]``): the natural-log
log-sum-exp of each row's scaled, masked scores, so partial attentions over disjoint key sets
can be merged exactly (MLA's chunked context). A row that sees no key gets output 0 and LSE
``-inf``.

Backends: :func:`paged_attention_torch` (reference, float32 math), Triton
(:mod:`atom.ops.attention_triton`: a tiled prefill/extend kernel plus a split-KV decode kernel
for single-token sequences, both in one call for mixed batches) and an AITER adapter.
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from atom.ops._common import FLOAT_DTYPES
from atom.ops._dispatch import declare
from atom.ops._warm import timed

__all__ = ["paged_attention", "paged_attention_torch"]

Scale = Union[torch.Tensor, float, None]

_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
def _scale_of(scale: Scale) -> Union[torch.Tensor, float]:
    if scale is None:
        return 1.0
    if isinstance(scale, torch.Tensor):
        return scale.reshape(()).float()
    return float(scale)


def _check_args(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                block_table: torch.Tensor, seq_lens: torch.Tensor,
                query_start_loc: torch.Tensor, sinks: Optional[torch.Tensor],
                lse: Optional[torch.Tensor] = None) -> None:
    """Shape checks common to every backend (a malformed call fails the same way anywhere)."""
    if q.dim() != 3:
        raise ValueError(f"q must be [tokens, heads, head_size], got {tuple(q.shape)}")
    _, num_heads, head_size = q.shape
    for name, cache in (("key_cache", key_cache), ("value_cache", value_cache)):
        if cache.dim() != 4 or cache.shape[3] != head_size:
            raise ValueError(f"{name} must be [num_blocks, block_size, kv_heads, {head_size}], "
                             f"got {tuple(cache.shape)}")
    if key_cache.shape != value_cache.shape:
        raise ValueError(f"key_cache {tuple(key_cache.shape)} != value_cache {tuple(value_cache.shape)}")
    if num_heads % key_cache.shape[2] != 0:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {key_cache.shape[2]}")
    num_seqs = seq_lens.shape[0]
    if query_start_loc.shape != (num_seqs + 1,):
        raise ValueError(f"query_start_loc must be [{num_seqs + 1}], got {tuple(query_start_loc.shape)}")
    if block_table.dim() != 2 or block_table.shape[0] < num_seqs:
        raise ValueError(f"block_table must be [num_seqs, max_blocks], got {tuple(block_table.shape)}")
    if sinks is not None and sinks.shape != (num_heads,):
        raise ValueError(f"sinks must be [{num_heads}], got {tuple(sinks.shape)}")
    if lse is not None and (lse.shape != (q.shape[0], num_heads) or lse.dtype != torch.float32):
        raise ValueError(f"lse must be float32 [{q.shape[0]}, {num_heads}], got {lse.dtype} {tuple(lse.shape)}")


@declare("paged_attention",
         doc="Paged (NHD) attention for packed varlen queries: prefill, extend and decode in one call; "
             "GQA, sliding window, sinks, fp8 caches; optional log-sum-exp output.")
def paged_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    max_seq_len: int,
    scale: float,
    *,
    causal: bool = True,
    sliding_window: Optional[int] = None,
    sinks: Optional[torch.Tensor] = None,
    k_scale: Scale = None,
    v_scale: Scale = None,
    out: Optional[torch.Tensor] = None,
    lse: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Paged attention of the packed queries ``q`` over the paged KV cache (see the module
    docstring for the layout, masking, sinks and ``lse``). The reference: per sequence, gather
    its keys/values and do a float32 softmax.

    Returns ``out`` (allocated like ``q`` when not given), ``[total_q_tokens, num_heads,
    head_size]`` in ``q``'s dtype. ``max_query_len`` / ``max_seq_len`` are accepted for
    signature parity and not needed here.
    """
    _check_args(q, key_cache, value_cache, block_table, seq_lens, query_start_loc, sinks, lse)
    if out is None:
        out = torch.empty_like(q)
    num_heads = q.shape[1]
    block_size, num_kv_heads, head_size = key_cache.shape[1:]
    group = num_heads // num_kv_heads
    ks, vs = _scale_of(k_scale), _scale_of(v_scale)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for s, seq_len in enumerate(lens):
        q0, q1 = starts[s], starts[s + 1]
        q_len = q1 - q0
        if q_len == 0:
            continue
        n_blocks = -(-seq_len // block_size)
        blocks = block_table[s, :n_blocks].long()
        k = key_cache[blocks].reshape(n_blocks * block_size, num_kv_heads, head_size)[:seq_len]
        v = value_cache[blocks].reshape(n_blocks * block_size, num_kv_heads, head_size)[:seq_len]
        k = (k.float() * ks).repeat_interleave(group, dim=1)  # [L, H, D]
        v = (v.float() * vs).repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[q0:q1].float(), k) * scale
        qpos = torch.arange(seq_len - q_len, seq_len, device=q.device)[:, None]
        kpos = torch.arange(seq_len, device=q.device)[None, :]
        keep = torch.ones(q_len, seq_len, dtype=torch.bool, device=q.device)
        if causal:
            keep &= kpos <= qpos
        if sliding_window:
            keep &= kpos > qpos - int(sliding_window)
        scores = scores.masked_fill(~keep, float("-inf"))
        if sinks is not None:
            sink_col = sinks.float().view(num_heads, 1, 1).expand(num_heads, q_len, 1)
            scores = torch.cat([scores, sink_col], dim=-1)
        probs = torch.softmax(scores, dim=-1)
        if sinks is not None:
            probs = probs[..., :-1]
        if lse is not None:
            lse[q0:q1] = torch.logsumexp(scores, dim=-1).t()  # [q, H]; -inf for a row without keys
        out[q0:q1] = torch.einsum("hqk,khd->qhd", probs, v).to(out.dtype)
    return out


paged_attention_torch = paged_attention.reference


# -- Triton ------------------------------------------------------------------------------------


def _triton_supports(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                     block_table: torch.Tensor, *args, out=None, lse=None, **kwargs) -> Optional[str]:
    if lse is not None and lse.stride(-1) != 1:
        return "the lse output needs a unit-stride head dimension"
    if key_cache.dtype != q.dtype and key_cache.dtype not in _FP8_DTYPES:
        return f"cache dtype {key_cache.dtype} with q dtype {q.dtype}"
    if value_cache.dtype != key_cache.dtype:
        return "key and value caches differ in dtype"
    if q.shape[-1] > 256:
        return f"head_size {q.shape[-1]} > 256"
    for t in (q, key_cache, value_cache, out):
        if t is not None and t.stride(-1) != 1:
            return "the head dimension must be unit-stride"
    if block_table.dtype not in (torch.int32, torch.int64):
        return f"block_table dtype {block_table.dtype}"
    return None


@paged_attention.triton(supports=_triton_supports, dtypes=FLOAT_DTYPES)
def _paged_attention_triton(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                            block_table: torch.Tensor, seq_lens: torch.Tensor,
                            query_start_loc: torch.Tensor, max_query_len: int, max_seq_len: int,
                            scale: float, **kwargs) -> torch.Tensor:
    _check_args(q, key_cache, value_cache, block_table, seq_lens, query_start_loc,
                kwargs.get("sinks"), kwargs.get("lse"))
    from atom.ops.attention_triton import paged_attention_fwd  # lazy: Triton is optional

    return paged_attention_fwd(q, key_cache, value_cache, block_table, seq_lens, query_start_loc,
                               max_query_len, max_seq_len, scale, **kwargs)


# -- AITER (ROCm) ------------------------------------------------------------------------------


def _aiter_supports(q: torch.Tensor, key_cache: torch.Tensor, *args, sinks=None, lse=None,
                    **kwargs) -> Optional[str]:
    if lse is not None:
        return "the LSE output is not covered by atom's aiter binding"
    if sinks is not None:
        return "attention sinks are not covered by atom's aiter binding"
    if key_cache.dtype in _FP8_DTYPES:
        return "fp8 KV caches are not covered by atom's aiter binding (needs aiter's shuffled layout)"
    return None


@paged_attention.aiter(supports=_aiter_supports, dtypes=(torch.float16, torch.bfloat16))
def _paged_attention_aiter(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           block_table: torch.Tensor, seq_lens: torch.Tensor,
                           query_start_loc: torch.Tensor, max_query_len: int, max_seq_len: int,
                           scale: float, *, causal: bool = True,
                           sliding_window: Optional[int] = None, sinks=None, k_scale=None,
                           v_scale=None, out: Optional[torch.Tensor] = None,
                           lse: Optional[torch.Tensor] = None) -> torch.Tensor:
    """aiter.flash_attn_varlen_func on keys/values gathered out of the paged cache.

    aiter's paged decode kernels (pa_fwd_asm) want their own shuffled cache layout, not vLLM's
    NHD one, so this adapter gathers each sequence's keys into a packed varlen tensor. That costs
    one copy of the context; it keeps the adapter small and layout-agnostic.
    """
    import aiter  # noqa: deferred: ROCm only

    block_size = key_cache.shape[1]
    lens = seq_lens.long()
    cu_k = torch.zeros(lens.numel() + 1, dtype=torch.int32, device=q.device)
    cu_k[1:] = torch.cumsum(lens, 0)
    seq_of_tok = torch.repeat_interleave(torch.arange(lens.numel(), device=q.device), lens)
    pos = torch.arange(int(cu_k[-1]), device=q.device) - cu_k[:-1].long()[seq_of_tok]
    blocks = block_table[seq_of_tok, pos // block_size].long()
    k = key_cache[blocks, pos % block_size]
    v = value_cache[blocks, pos % block_size]
    window = (int(sliding_window) - 1, 0) if sliding_window else (-1, -1)
    res = aiter.flash_attn_varlen_func(q, k, v, query_start_loc, cu_k, max_query_len, max_seq_len,
                                       dropout_p=0.0, softmax_scale=scale, causal=causal,
                                       window_size=window)
    res = res[0] if isinstance(res, (tuple, list)) else res
    if out is None:
        return res
    out.copy_(res)
    return out


def warm_up_paged_attention(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                            page: int, device: Union[torch.device, str], *,
                            kv_dtype: Optional[torch.dtype] = None, sliding_window: Optional[int] = None,
                            sinks: bool = False, force: bool = False) -> int:
    """Compile, before the first request, the Triton kernel variants that :func:`paged_attention`
    can launch for a layer of these shapes (see :func:`atom.ops.attention_triton.warm_up`);
    once per process and shape. Returns the launches made: 0 when the op would not run Triton
    on ``device`` (CPU, AITER, a forced backend) unless ``force`` (tests, under the Triton
    interpreter)."""
    device = torch.device(device)
    key = (num_heads, num_kv_heads, head_dim, dtype, page, str(device), kv_dtype, sliding_window, sinks)
    if not paged_attention.claim_warm_up(key, device.type, force):
        return 0
    from atom.ops.attention_triton import warm_up  # lazy: Triton is optional

    return timed("paged_attention", f"{num_heads}/{num_kv_heads} heads x {head_dim}, page {page}",
                 lambda: warm_up(num_heads, num_kv_heads, head_dim, dtype, page, device, kv_dtype=kv_dtype,
                                 window=int(sliding_window or 0), sinks=sinks), device)
