"""Triton kernels for paged attention (imported lazily by :mod:`atom.ops.attention`).

Three kernels:

* ``_prefill_kernel``: one program per (sequence, tile of BLOCK_M new tokens, query head); it
  walks the sequence's KV blocks through ``block_table`` in tiles of BLOCK_N keys with an
  online softmax. Key tiles that every row of the query tile sees in full run without score
  masks (the bulk of a long causal prefill); only the tiles at the causal diagonal, the
  sliding-window edge and the context end pay for masking.
* ``_decode_kernel``: one program per (sequence, KV head, KV split) for sequences with exactly
  one new token. The GQA group's query heads are the M rows of one ``tl.dot`` so each KV tile
  is read once per group, and the context is split into ``num_splits`` partitions so short
  batches still fill the GPU.
* ``_split_kv_reduce_kernel``: merges the per-split partial outputs with their log-sum-exps
  (and the attention sink, if any). Also used by :mod:`atom.ops.mla_triton`.

All softmax arithmetic is in base 2 (``exp2``) with ``log2(e)`` folded into the score scale.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import triton
import triton.language as tl

from atom.ops._common import cdiv, next_pow2
from atom.ops._dispatch import triton_interpreting
from atom.ops._launch import direct as direct_launch
from atom.ops.common_triton import dot_flags

LOG2E = 1.4426950408889634

_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


@functools.lru_cache(maxsize=8)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def num_programs_target(device: torch.device) -> int:
    """Programs a split-KV launch aims for: about four per SM (enough loads in flight to
    saturate HBM, and small enough pieces that uneven sequence lengths even out); a small
    fixed number under the interpreter."""
    if device.type != "cuda":
        return 8
    return 4 * _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def choose_num_splits(rows: int, max_ctx: int, block_n: int, device: torch.device,
                      min_tiles: int = 2, max_splits: int = 64) -> int:
    """KV splits for a split-KV decode of ``rows`` (sequence x head-group) programs.

    As many splits as it takes for ``rows * splits`` to reach the program target, but every
    split keeps at least ``min_tiles`` key tiles of the longest context (below that the extra
    partial outputs and the reduce pass cost more than the parallelism gains).
    """
    want = cdiv(num_programs_target(device), max(rows, 1))
    cap = max(1, cdiv(max_ctx, block_n) // min_tiles)
    return max(1, min(want, cap, max_splits))


# --------------------------------------------------------------------------------------------
# kernels
# --------------------------------------------------------------------------------------------


@triton.jit
def _qk_pv_tile(acc, m_i, l_i, q, k_base, v_base, bt_row, kpos, kmask, qpos, window,
                qk_scale, stride_kb, stride_ks, stride_vb, stride_vs, offs_d, dmask,
                PAGE: tl.constexpr, MASK_SCORES: tl.constexpr, CAUSAL: tl.constexpr,
                HAS_WINDOW: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr):
    """One BLOCK_N tile of keys: scores, online-softmax update, P @ V."""
    blk = tl.load(bt_row + kpos // PAGE, mask=kmask, other=0).to(tl.int64)
    slot = (kpos % PAGE).to(tl.int64)
    ldmask = kmask[:, None] & dmask[None, :]
    k = tl.load(k_base + blk[:, None] * stride_kb + slot[:, None] * stride_ks + offs_d[None, :],
                mask=ldmask, other=0.0)
    k = k.to(q.dtype)  # fp8 cache -> compute dtype (no-op otherwise)
    if UPCAST:
        s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision=PREC)
    else:
        s = tl.dot(q, tl.trans(k), input_precision=PREC)
    s = s * qk_scale
    if MASK_SCORES:
        keep = kmask[None, :]
        if CAUSAL:
            keep = keep & (kpos[None, :] <= qpos[:, None])
        if HAS_WINDOW:
            keep = keep & (kpos[None, :] > qpos[:, None] - window)
        s = tl.where(keep, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    # rows that have seen no key yet (padding rows, or fully masked so far) keep m = -inf;
    # subtracting 0 instead avoids inf - inf = nan
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v = tl.load(v_base + blk[:, None] * stride_vb + slot[:, None] * stride_vs + offs_d[None, :],
                mask=ldmask, other=0.0)
    v = v.to(q.dtype)
    if UPCAST:
        pv = tl.dot(p, v.to(tl.float32), input_precision=PREC)
    else:
        pv = tl.dot(p.to(v.dtype), v, input_precision=PREC)
    acc = acc * alpha[:, None] + pv
    return acc, m_new, l_i


@triton.jit(do_not_specialize=["window", "stride_bt"])
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, bt_ptr, seq_lens_ptr, qsl_ptr, sinks_ptr, k_scale_ptr, v_scale_ptr,
    lse_ptr, sm_scale, window,
    stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_bt, stride_ot, stride_oh, stride_lt,
    GROUP: tl.constexpr, HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, PAGE: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HAS_SINKS: tl.constexpr, HAS_KV_SCALE: tl.constexpr, SKIP_DECODE: tl.constexpr,
    STORE_LSE: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr,
):
    seq = tl.program_id(0)
    m_tile = tl.program_id(1)
    head = tl.program_id(2)
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    m0 = m_tile * BLOCK_M
    if m0 >= q_len:
        return
    if SKIP_DECODE:
        if q_len == 1:  # the split-KV decode kernel owns single-token sequences
            return
    seq_len = tl.load(seq_lens_ptr + seq)
    prefix = seq_len - q_len
    kv_head = head // GROUP

    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    mmask = offs_m < q_len
    dmask = offs_d < HEAD_D
    qpos = prefix + offs_m
    q = tl.load(q_ptr + (q_start + offs_m)[:, None].to(tl.int64) * stride_qt + head * stride_qh
                + offs_d[None, :], mask=mmask[:, None] & dmask[None, :], other=0.0)

    qk_scale = sm_scale * 1.4426950408889634
    if HAS_KV_SCALE:
        qk_scale = qk_scale * tl.load(k_scale_ptr)

    if HAS_SINKS:
        sink = tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634
        m_i = tl.zeros([BLOCK_M], dtype=tl.float32) + sink
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32) + 1.0  # exp2(sink - m_i)
    else:
        m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    # key range of the whole tile: [lo, hi)
    last_row = tl.minimum(m0 + BLOCK_M, q_len) - 1
    hi = seq_len
    if CAUSAL:
        hi = tl.minimum(seq_len, prefix + last_row + 1)
    lo = 0
    # [full_lo, full_hi): tiles (aligned on lo) that every row of the tile sees entirely
    full_lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(prefix + m0 - window + 1, 0)
        first_full = tl.maximum(prefix + last_row - window + 1, lo)
        full_lo = lo + tl.cdiv(first_full - lo, BLOCK_N) * BLOCK_N
    full_end = seq_len
    if CAUSAL:
        full_end = tl.minimum(seq_len, prefix + m0 + 1)
    full_hi = full_lo + tl.maximum(full_end - full_lo, 0) // BLOCK_N * BLOCK_N
    full_hi = tl.maximum(full_hi, full_lo)

    bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
    k_base = k_ptr + kv_head * stride_kh
    v_base = v_ptr + kv_head * stride_vh

    # phase 1: masked tiles before the fully visible run (sliding-window edge)
    for n0 in range(lo, full_lo, BLOCK_N):
        kpos = n0 + offs_n
        acc, m_i, l_i = _qk_pv_tile(acc, m_i, l_i, q, k_base, v_base, bt_row, kpos, kpos < hi,
                                    qpos, window, qk_scale, stride_kb, stride_ks, stride_vb,
                                    stride_vs, offs_d, dmask, PAGE, True, CAUSAL, HAS_WINDOW,
                                    UPCAST, PREC)
    # phase 2: unmasked tiles
    for n0 in range(full_lo, full_hi, BLOCK_N):
        kpos = n0 + offs_n
        acc, m_i, l_i = _qk_pv_tile(acc, m_i, l_i, q, k_base, v_base, bt_row, kpos, kpos < hi,
                                    qpos, window, qk_scale, stride_kb, stride_ks, stride_vb,
                                    stride_vs, offs_d, dmask, PAGE, False, CAUSAL, HAS_WINDOW,
                                    UPCAST, PREC)
    # phase 3: masked tiles after it (causal diagonal, context end)
    for n0 in range(tl.maximum(full_hi, lo), hi, BLOCK_N):
        kpos = n0 + offs_n
        acc, m_i, l_i = _qk_pv_tile(acc, m_i, l_i, q, k_base, v_base, bt_row, kpos, kpos < hi,
                                    qpos, window, qk_scale, stride_kb, stride_ks, stride_vb,
                                    stride_vs, offs_d, dmask, PAGE, True, CAUSAL, HAS_WINDOW,
                                    UPCAST, PREC)

    if HAS_KV_SCALE:
        acc = acc * tl.load(v_scale_ptr)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + (q_start + offs_m)[:, None].to(tl.int64) * stride_ot + head * stride_oh
             + offs_d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=mmask[:, None] & dmask[None, :])
    if STORE_LSE:
        # natural log: m_i is in base-2 units (log2(e) folded into the scale); -inf without keys
        lse = tl.where(l_i > 0, (m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0))) * 0.6931471805599453,
                       float("-inf"))
        tl.store(lse_ptr + (q_start + offs_m).to(tl.int64) * stride_lt + head, lse, mask=mmask)


@triton.jit(do_not_specialize=["window", "num_splits", "stride_bt", "stride_pl_s", "stride_pl_h"])
def _decode_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, part_o_ptr, part_lse_ptr, bt_ptr, seq_lens_ptr, qsl_ptr,
    sinks_ptr, k_scale_ptr, v_scale_ptr,
    sm_scale, window, num_splits,
    stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_bt, stride_ot, stride_oh, stride_po_s, stride_po_h, stride_po_p, stride_pl_s,
    stride_pl_h,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, PAGE: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HAS_SINKS: tl.constexpr, HAS_KV_SCALE: tl.constexpr, MIXED: tl.constexpr,
    DIRECT: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    q_tok = tl.load(qsl_ptr + seq)
    if MIXED:
        if tl.load(qsl_ptr + seq + 1) - q_tok != 1:  # the prefill kernel owns these
            return
    seq_len = tl.load(seq_lens_ptr + seq)
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(seq_len - window, 0)
    # split this sequence's keys into num_splits chunks of whole tiles
    chunk = tl.cdiv(tl.cdiv(seq_len - lo, num_splits), BLOCK_N) * BLOCK_N
    start = lo + split * chunk
    end = tl.minimum(start + chunk, seq_len)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    hmask = offs_h < GROUP
    dmask = offs_d < HEAD_D
    heads = kv_head * GROUP + offs_h
    q = tl.load(q_ptr + q_tok.to(tl.int64) * stride_qt + heads[:, None] * stride_qh
                + offs_d[None, :], mask=hmask[:, None] & dmask[None, :], other=0.0)

    qk_scale = sm_scale * 1.4426950408889634
    if HAS_KV_SCALE:
        qk_scale = qk_scale * tl.load(k_scale_ptr)
    m_i = tl.zeros([BLOCK_H], dtype=tl.float32) - float("inf")
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
    k_base = k_ptr + kv_head * stride_kh
    v_base = v_ptr + kv_head * stride_vh
    qpos = tl.zeros([BLOCK_H], dtype=tl.int32)  # unused: the one token sees [lo, seq_len)
    for n0 in range(start, end, BLOCK_N):
        kpos = n0 + offs_n
        acc, m_i, l_i = _qk_pv_tile(acc, m_i, l_i, q, k_base, v_base, bt_row, kpos, kpos < end,
                                    qpos, window, qk_scale, stride_kb, stride_ks, stride_vb,
                                    stride_vs, offs_d, dmask, PAGE, True, False, False,
                                    UPCAST, PREC)
    if HAS_KV_SCALE:
        acc = acc * tl.load(v_scale_ptr)

    if DIRECT:
        # single split: finish here, folding the sink into the denominator
        if HAS_SINKS:
            sink = tl.load(sinks_ptr + heads, mask=hmask, other=0.0).to(tl.float32) * 1.4426950408889634
            m_f = tl.maximum(m_i, sink)
            corr = tl.exp2(m_i - m_f)
            l_i = l_i * corr + tl.exp2(sink - m_f)
            acc = acc * corr[:, None]
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + q_tok.to(tl.int64) * stride_ot + heads[:, None] * stride_oh
                 + offs_d[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=hmask[:, None] & dmask[None, :])
    else:
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        po = (part_o_ptr + seq.to(tl.int64) * stride_po_s + heads[:, None] * stride_po_h
              + split * stride_po_p + offs_d[None, :])
        tl.store(po, o, mask=hmask[:, None] & dmask[None, :])
        tl.store(part_lse_ptr + seq.to(tl.int64) * stride_pl_s + heads * stride_pl_h + split,
                 lse, mask=hmask)


@triton.jit(do_not_specialize=["num_splits", "stride_pl_r", "stride_pl_h"])
def _split_kv_reduce_kernel(
    part_o_ptr, part_lse_ptr, out_ptr, qsl_ptr, sinks_ptr, num_splits,
    stride_po_r, stride_po_h, stride_po_p, stride_pl_r, stride_pl_h, stride_ot, stride_oh,
    HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
    HAS_QSL: tl.constexpr, HAS_SINKS: tl.constexpr,
):
    """out[t, h] = sum_p w_p o_p / (sum_p w_p + sink), w_p = 2^(lse_p - max)."""
    row = tl.program_id(0)
    head = tl.program_id(1)
    if HAS_QSL:
        tok = tl.load(qsl_ptr + row)
        if tl.load(qsl_ptr + row + 1) - tok != 1:
            return
    else:
        tok = row
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    smask = offs_s < num_splits
    dmask = offs_d < HEAD_D
    lse = tl.load(part_lse_ptr + row.to(tl.int64) * stride_pl_r + head * stride_pl_h + offs_s,
                  mask=smask, other=float("-inf"))
    m = tl.max(lse, axis=0)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634
        m = tl.maximum(m, sink)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m)
    denom = tl.sum(w, axis=0)
    if HAS_SINKS:
        denom = denom + tl.exp2(sink - m)
    o = tl.load(part_o_ptr + row.to(tl.int64) * stride_po_r + head * stride_po_h
                + offs_s[:, None] * stride_po_p + offs_d[None, :],
                mask=smask[:, None] & dmask[None, :], other=0.0)
    acc = tl.sum(o * w[:, None], axis=0)
    out = acc / tl.where(denom > 0, denom, 1.0)
    tl.store(out_ptr + tok.to(tl.int64) * stride_ot + head * stride_oh + offs_d,
             out.to(out_ptr.dtype.element_ty), mask=dmask)


# --------------------------------------------------------------------------------------------
# launchers
# --------------------------------------------------------------------------------------------


def _prefill_config(head_dim: int, dtype: torch.dtype) -> dict:
    """Tile sizes and launch options by head size (H100-shaped; tiny under the interpreter)."""
    if triton_interpreting():
        # small tiles so tiny test shapes still cross several query and key tiles
        return dict(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=1)
    if dtype == torch.float32:  # the exact-check path: small tiles keep 3xTF32 out of spills
        if head_dim <= 64:
            return dict(BLOCK_M=32, BLOCK_N=16, num_warps=4, num_stages=2)
        return dict(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=1)
    if head_dim <= 64:
        return dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=3)
    if head_dim <= 128:
        return dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3)
    return dict(BLOCK_M=64, BLOCK_N=32, num_warps=8, num_stages=2)


def _decode_config(head_dim: int, dtype: torch.dtype = torch.bfloat16) -> dict:
    if triton_interpreting():
        return dict(BLOCK_N=16, num_warps=4, num_stages=1)
    if dtype == torch.float32:
        return dict(BLOCK_N=16, num_warps=4, num_stages=2)
    if head_dim <= 128:
        return dict(BLOCK_N=64, num_warps=4, num_stages=3)
    return dict(BLOCK_N=32, num_warps=4, num_stages=2)


def split_kv_reduce(part_o: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor,
                    num_splits: int, query_start_loc: Optional[torch.Tensor] = None,
                    sinks: Optional[torch.Tensor] = None) -> None:
    """Merge split-KV partials ``part_o [R, H, S, D]`` / ``part_lse [R, H, S]`` (base-2 LSE).

    Row r writes ``out[r]``, or ``out[query_start_loc[r]]`` when given (only for rows whose
    query length is 1: the decode sequences of a mixed batch).
    """
    rows, heads, _, head_dim = part_o.shape
    direct_launch(_split_kv_reduce_kernel)[(rows, heads)](
        part_o, part_lse, out,
        query_start_loc if query_start_loc is not None else part_lse,
        sinks if sinks is not None else part_lse,
        num_splits,
        part_o.stride(0), part_o.stride(1), part_o.stride(2),
        part_lse.stride(0), part_lse.stride(1), out.stride(0), out.stride(1),
        HEAD_D=head_dim, BLOCK_D=next_pow2(head_dim), BLOCK_S=next_pow2(num_splits),
        HAS_QSL=query_start_loc is not None, HAS_SINKS=sinks is not None,
        num_warps=4 if head_dim * next_pow2(num_splits) >= 2048 else 1,
    )


def paged_attention_fwd(
    q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
    block_table: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
    max_query_len: int, max_seq_len: int, scale: float, *, causal: bool = True,
    sliding_window: Optional[int] = None, sinks: Optional[torch.Tensor] = None,
    k_scale: Optional[torch.Tensor] = None, v_scale: Optional[torch.Tensor] = None,
    out: Optional[torch.Tensor] = None, num_splits: Optional[int] = None,
    lse: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Triton paged attention; arguments as :func:`atom.ops.attention.paged_attention`.

    ``num_splits`` overrides the decode split-KV count (tests and tuning). With ``lse`` every
    sequence (single-token ones too) goes through the prefill kernel, which stores the LSE.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_seqs = seq_lens.shape[0]
    num_kv_heads = key_cache.shape[2]
    page = key_cache.shape[1]
    group = num_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(q)
    if num_tokens == 0 or num_seqs == 0:
        return out
    has_scale = key_cache.dtype in _FP8_DTYPES
    if has_scale:
        k_scale, v_scale = _scale_tensor(k_scale, q.device), _scale_tensor(v_scale, q.device)
    window = int(sliding_window) if sliding_window else 0
    upcast, prec = dot_flags(q.dtype)
    block_d = next_pow2(head_dim)
    dummy = seq_lens  # placeholder pointer for absent optional tensors (never read)
    common = dict(HEAD_D=head_dim, BLOCK_D=block_d, PAGE=page, HAS_WINDOW=window > 0,
                  HAS_SINKS=sinks is not None, HAS_KV_SCALE=has_scale, UPCAST=upcast, PREC=prec)
    # Strides read once per tensor (one call each rather than one per dimension: outside CUDA
    # graphs this function is host time per layer and step).
    sq, sk, sv, so = q.stride(), key_cache.stride(), value_cache.stride(), out.stride()
    stride_bt = block_table.stride(0)

    if max_query_len > 1 or lse is not None:
        cfg = _prefill_config(head_dim, q.dtype)
        grid = (num_seqs, cdiv(max(max_query_len, 1), cfg["BLOCK_M"]), num_heads)
        direct_launch(_prefill_kernel)[grid](
            q, key_cache, value_cache, out, block_table, seq_lens, query_start_loc,
            sinks if sinks is not None else dummy,
            k_scale if has_scale else dummy, v_scale if has_scale else dummy,
            lse if lse is not None else dummy, float(scale), window,
            sq[0], sq[1], sk[0], sk[1], sk[2], sv[0], sv[1], sv[2], stride_bt, so[0], so[1],
            lse.stride(0) if lse is not None else 0,
            GROUP=group, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], CAUSAL=bool(causal),
            SKIP_DECODE=lse is None, STORE_LSE=lse is not None,
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **common,
        )
        if lse is not None:
            return out

    cfg = _decode_config(head_dim, q.dtype)
    # context a decode token actually reads (the window bounds it)
    ctx = min(max_seq_len, window) if window > 0 else max_seq_len
    if num_splits is None:
        num_splits = choose_num_splits(num_seqs * num_kv_heads, ctx, cfg["BLOCK_N"], q.device)
    num_splits = max(1, int(num_splits))
    direct = num_splits == 1
    if direct:
        part_o = part_lse = out  # unused
        po_strides = (0, 0, 0)
        pl_strides = (0, 0)
    else:
        part_o = torch.empty(num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32,
                             device=q.device)
        part_lse = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32,
                               device=q.device)
        po_strides = part_o.stride()[:3]
        pl_strides = part_lse.stride()[:2]
    direct_launch(_decode_kernel)[(num_seqs, num_kv_heads, num_splits)](
        q, key_cache, value_cache, out, part_o, part_lse, block_table, seq_lens, query_start_loc,
        sinks if sinks is not None else dummy,
        k_scale if has_scale else dummy, v_scale if has_scale else dummy,
        float(scale), window, num_splits,
        sq[0], sq[1], sk[0], sk[1], sk[2], sv[0], sv[1], sv[2], stride_bt, so[0], so[1],
        *po_strides, *pl_strides,
        GROUP=group, BLOCK_H=max(16, next_pow2(group)), BLOCK_N=cfg["BLOCK_N"],
        MIXED=max_query_len > 1, DIRECT=direct,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **common,
    )
    if not direct:
        split_kv_reduce(part_o, part_lse, out, num_splits, query_start_loc=query_start_loc,
                        sinks=sinks)
    return out


#: Split counts whose reduce launches cover every ``BLOCK_S`` bucket (1 = the direct path).
WARM_UP_SPLITS = (1, 2, 3, 5, 9, 17, 33)


def warm_up(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, page: int,
            device: torch.device, *, kv_dtype: Optional[torch.dtype] = None, window: int = 0,
            sinks: bool = False) -> int:
    """Launch every kernel variant (constexpr combination) that a serving step can meet with
    these shapes, on a tiny two-sequence batch: the prefill kernel, the decode kernel for pure
    and mixed batches with one or several KV splits, and the split-KV reduce for every
    ``BLOCK_S``. Triton compiles a variant on its first launch; without this the first served
    batch that needs a new split count stalls while it compiles. Integer arguments that vary
    between this batch and a server's (split count, window, block-table width, partial-LSE
    strides) are ``do_not_specialize``, so these launches cover every later batch. Returns the
    number of launches."""
    kv_dtype = kv_dtype or dtype
    ctx = 2 * page
    blocks = 2 * cdiv(ctx, page)
    cache = torch.zeros(2, blocks, page, num_kv_heads, head_dim, dtype=dtype, device=device).to(kv_dtype)
    table = torch.arange(blocks, dtype=torch.int32, device=device).view(2, -1)
    seq_lens = torch.full((2,), ctx, dtype=torch.int32, device=device)
    scale = torch.ones(1, dtype=torch.float32, device=device) if kv_dtype in _FP8_DTYPES else None
    sink = torch.zeros(num_heads, dtype=torch.float32, device=device) if sinks else None
    launches = 0
    for q_lens in ((1, 1), (2, 1)):  # pure decode; a mixed batch (one prefill, one decode)
        qsl = torch.tensor([0, q_lens[0], sum(q_lens)], dtype=torch.int32, device=device)
        q = torch.zeros(sum(q_lens), num_heads, head_dim, dtype=dtype, device=device)
        for splits in WARM_UP_SPLITS:
            paged_attention_fwd(q, cache[0], cache[1], table, seq_lens, qsl, max(q_lens), ctx,
                                head_dim ** -0.5, sliding_window=window or None, sinks=sink,
                                k_scale=scale, v_scale=scale, num_splits=splits)
            launches += 1
    return launches


def _scale_tensor(scale, device: torch.device) -> torch.Tensor:
    """A per-tensor dequant scale as a one-element float32 device tensor (1.0 when absent)."""
    if scale is None:
        return torch.ones(1, dtype=torch.float32, device=device)
    if isinstance(scale, torch.Tensor):
        return scale.reshape(1).to(device=device, dtype=torch.float32)
    return torch.full((1,), float(scale), dtype=torch.float32, device=device)
