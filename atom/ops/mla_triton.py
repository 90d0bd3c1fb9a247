"""Triton kernels for MLA (imported lazily by :mod:`atom.ops.mla`).

* ``_write_latent_kernel``: one program per token; RoPE on ``k_pe`` (neox halves or GPT-J
  interleaved pairs) and the store of ``[kv_c | roped k_pe]`` into its cache slot.
* ``_mla_decode_kernel``: one program per (token, block of BLOCK_H heads, KV split). Every KV
  tile of the latent cache is loaded once and used twice, as keys (``q_nope . c_kv +
  q_pe . k_pe``) and as values (``P @ c_kv``); the partials are merged by
  :func:`atom.ops.attention_triton.split_kv_reduce`.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from atom import envs
from atom.ops._common import cdiv, next_pow2
from atom.ops._dispatch import triton_interpreting
from atom.ops.attention_triton import WARM_UP_SPLITS, choose_num_splits, split_kv_reduce
from atom.ops.common_triton import dot_flags, exact_fp8_cast, to_fp8_e4m3


@triton.jit
def _write_latent_kernel(
    kv_c_ptr, k_pe_ptr, pos_ptr, cos_sin_ptr, cache_ptr, slot_ptr, scale_ptr,
    stride_ct, stride_pt, stride_cs, stride_cb, stride_co,
    RANK: tl.constexpr, BLOCK_R: tl.constexpr, HALF_P: tl.constexpr,
    PAGE: tl.constexpr, IS_NEOX: tl.constexpr, HAS_SCALE: tl.constexpr, FP8_OUT: tl.constexpr,
    FP8_ROUND: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:  # padding token: nothing to write
        return
    dst = cache_ptr + (slot // PAGE) * stride_cb + (slot % PAGE) * stride_co
    inv = 1.0
    if HAS_SCALE:
        inv = 1.0 / tl.load(scale_ptr)

    offs_r = tl.arange(0, BLOCK_R)
    rmask = offs_r < RANK
    c = tl.load(kv_c_ptr + t.to(tl.int64) * stride_ct + offs_r, mask=rmask, other=0.0).to(tl.float32)
    c = c * inv
    if FP8_OUT:
        tl.store(dst + offs_r, to_fp8_e4m3(c, FP8_ROUND), mask=rmask)
    else:
        tl.store(dst + offs_r, c.to(cache_ptr.dtype.element_ty), mask=rmask)

    i = tl.arange(0, HALF_P)
    if IS_NEOX:  # rotate the two halves
        i1 = i
        i2 = i + HALF_P
    else:  # rotate interleaved (even, odd) pairs
        i1 = 2 * i
        i2 = 2 * i + 1
    pos = tl.load(pos_ptr + t).to(tl.int64)
    cos = tl.load(cos_sin_ptr + pos * stride_cs + i).to(tl.float32)
    sin = tl.load(cos_sin_ptr + pos * stride_cs + HALF_P + i).to(tl.float32)
    x1 = tl.load(k_pe_ptr + t.to(tl.int64) * stride_pt + i1).to(tl.float32)
    x2 = tl.load(k_pe_ptr + t.to(tl.int64) * stride_pt + i2).to(tl.float32)
    o1 = (x1 * cos - x2 * sin) * inv
    o2 = (x2 * cos + x1 * sin) * inv
    if FP8_OUT:
        tl.store(dst + RANK + i1, to_fp8_e4m3(o1, FP8_ROUND))
        tl.store(dst + RANK + i2, to_fp8_e4m3(o2, FP8_ROUND))
    else:
        tl.store(dst + RANK + i1, o1.to(cache_ptr.dtype.element_ty))
        tl.store(dst + RANK + i2, o2.to(cache_ptr.dtype.element_ty))


def write_latent_cache_fwd(kv_c: torch.Tensor, k_pe: torch.Tensor, positions: torch.Tensor,
                           cos_sin_cache: torch.Tensor, latent_cache: torch.Tensor,
                           slot_mapping: torch.Tensor, is_neox: bool,
                           kv_scale: Optional[torch.Tensor] = None) -> None:
    """Triton :func:`atom.ops.mla.mla_write_latent_cache`."""
    num_tokens, rank = kv_c.shape
    rope = k_pe.shape[-1]
    k_pe = k_pe.reshape(num_tokens, rope)
    if num_tokens == 0:
        return
    fp8 = latent_cache.dtype == torch.float8_e4m3fn
    has_scale = kv_scale is not None
    _write_latent_kernel[(num_tokens,)](
        kv_c, k_pe, positions, cos_sin_cache, latent_cache, slot_mapping,
        kv_scale if has_scale else cos_sin_cache,
        kv_c.stride(0), k_pe.stride(0), cos_sin_cache.stride(0), latent_cache.stride(0),
        latent_cache.stride(1),
        RANK=rank, BLOCK_R=next_pow2(rank), HALF_P=rope // 2,
        PAGE=latent_cache.shape[1], IS_NEOX=bool(is_neox), HAS_SCALE=has_scale, FP8_OUT=fp8,
        FP8_ROUND=exact_fp8_cast(), num_warps=4 if rank >= 256 else 1,
    )


@triton.jit(do_not_specialize=["num_splits", "stride_bt", "stride_pl_t", "stride_pl_h"])
def _mla_decode_kernel(
    qn_ptr, qp_ptr, cache_ptr, out_ptr, part_o_ptr, part_lse_ptr, bt_ptr, seq_lens_ptr, scale_ptr,
    sm_scale, num_heads, num_splits,
    stride_qnt, stride_qnh, stride_qpt, stride_qph, stride_cb, stride_co, stride_bt,
    stride_ot, stride_oh, stride_po_t, stride_po_h, stride_po_p, stride_pl_t, stride_pl_h,
    RANK: tl.constexpr, BLOCK_R: tl.constexpr, ROPE: tl.constexpr, BLOCK_P: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr,
    HAS_SCALE: tl.constexpr, DIRECT: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr,
):
    tok = tl.program_id(0)
    hblk = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + tok)
    chunk = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * chunk
    end = tl.minimum(start + chunk, seq_len)

    heads = hblk * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < num_heads
    offs_r = tl.arange(0, BLOCK_R)
    offs_p = tl.arange(0, BLOCK_P)
    rmask = offs_r < RANK
    pmask = offs_p < ROPE
    offs_n = tl.arange(0, BLOCK_N)
    qn = tl.load(qn_ptr + tok.to(tl.int64) * stride_qnt + heads[:, None] * stride_qnh
                 + offs_r[None, :], mask=hmask[:, None] & rmask[None, :], other=0.0)
    qp = tl.load(qp_ptr + tok.to(tl.int64) * stride_qpt + heads[:, None] * stride_qph
                 + offs_p[None, :], mask=hmask[:, None] & pmask[None, :], other=0.0)
    if UPCAST:
        qn = qn.to(tl.float32)
        qp = qp.to(tl.float32)
    qk_scale = sm_scale * 1.4426950408889634
    if HAS_SCALE:
        qk_scale = qk_scale * tl.load(scale_ptr)

    m_i = tl.zeros([BLOCK_H], dtype=tl.float32) - float("inf")
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_R], dtype=tl.float32)
    bt_row = bt_ptr + tok.to(tl.int64) * stride_bt
    for n0 in range(start, end, BLOCK_N):
        kpos = n0 + offs_n
        kmask = kpos < end
        blk = tl.load(bt_row + kpos // PAGE, mask=kmask, other=0).to(tl.int64)
        row = blk * stride_cb + (kpos % PAGE).to(tl.int64) * stride_co
        c = tl.load(cache_ptr + row[:, None] + offs_r[None, :],
                    mask=kmask[:, None] & rmask[None, :], other=0.0).to(qn.dtype)
        kp = tl.load(cache_ptr + row[:, None] + RANK + offs_p[None, :],
                     mask=kmask[:, None] & pmask[None, :], other=0.0).to(qn.dtype)
        s = tl.dot(qn, tl.trans(c), input_precision=PREC)
        s = tl.dot(qp, tl.trans(kp), s, input_precision=PREC)
        s = tl.where(kmask[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(c.dtype), c, input_precision=PREC)
        m_i = m_new
    if HAS_SCALE:
        acc = acc * tl.load(scale_ptr)
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    if DIRECT:
        tl.store(out_ptr + tok.to(tl.int64) * stride_ot + heads[:, None] * stride_oh
                 + offs_r[None, :], o.to(out_ptr.dtype.element_ty),
                 mask=hmask[:, None] & rmask[None, :])
    else:
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        tl.store(part_o_ptr + tok.to(tl.int64) * stride_po_t + heads[:, None] * stride_po_h
                 + split * stride_po_p + offs_r[None, :], o, mask=hmask[:, None] & rmask[None, :])
        tl.store(part_lse_ptr + tok.to(tl.int64) * stride_pl_t + heads * stride_pl_h + split,
                 lse, mask=hmask)


def _decode_config(rank: int, dtype: torch.dtype = torch.bfloat16, num_heads: int = 128) -> dict:
    tile = envs.ATOM_MLA_DECODE_TILE
    if tile is not None:  # an explicit choice (bench/mla_tiles.py measures them)
        return dict(zip(("BLOCK_H", "BLOCK_N", "num_warps", "num_stages"), tile))
    if triton_interpreting():
        return dict(BLOCK_H=16, BLOCK_N=16, num_warps=4, num_stages=1)
    if dtype == torch.float32:  # the exact-check path
        return dict(BLOCK_H=16, BLOCK_N=16, num_warps=8, num_stages=1)
    if rank <= 512:
        # 512-wide latent rows. The H100 sweep (bench/mla_tiles.py, docs/performance.md): 64 heads
        # x 64 keys, 8 warps, 2 stages is 1.98x the former 32 x 32 tile at DeepSeek-V3 sizes (a
        # wgmma-sized M, and half the latent re-reads: one per 64 heads). Fewer heads (a TP shard)
        # take the smallest power of two >= 16 that covers them.
        return dict(BLOCK_H=min(64, max(16, next_pow2(num_heads))), BLOCK_N=64, num_warps=8, num_stages=2)
    return dict(BLOCK_H=16, BLOCK_N=32, num_warps=8, num_stages=2)


def mla_decode_fwd(q_nope: torch.Tensor, q_pe: torch.Tensor, latent_cache: torch.Tensor,
                   block_table: torch.Tensor, seq_lens: torch.Tensor, scale: float, *,
                   kv_scale: Optional[torch.Tensor] = None, max_seq_len: Optional[int] = None,
                   out: Optional[torch.Tensor] = None,
                   num_splits: Optional[int] = None) -> torch.Tensor:
    """Triton :func:`atom.ops.mla.mla_decode`; ``num_splits`` overrides the split count."""
    num_tokens, num_heads, rank = q_nope.shape
    rope = q_pe.shape[-1]
    if out is None:
        out = q_nope.new_empty(num_tokens, num_heads, rank)
    if num_tokens == 0:
        return out
    cfg = _decode_config(rank, q_nope.dtype, num_heads)
    upcast, prec = dot_flags(q_nope.dtype)
    # without max_seq_len the block table's width bounds the context (no host sync)
    max_ctx = max_seq_len if max_seq_len is not None else block_table.shape[1] * latent_cache.shape[1]
    head_blocks = cdiv(num_heads, cfg["BLOCK_H"])
    if num_splits is None:
        num_splits = choose_num_splits(num_tokens * head_blocks, max_ctx, cfg["BLOCK_N"],
                                       q_nope.device)
    num_splits = max(1, int(num_splits))
    direct = num_splits == 1
    if direct:
        part_o = part_lse = out
        po, pl = (0, 0, 0), (0, 0)
    else:
        part_o = torch.empty(num_tokens, num_heads, num_splits, rank, dtype=torch.float32,
                             device=q_nope.device)
        part_lse = torch.empty(num_tokens, num_heads, num_splits, dtype=torch.float32,
                               device=q_nope.device)
        po, pl = part_o.stride()[:3], part_lse.stride()[:2]
    has_scale = kv_scale is not None
    _mla_decode_kernel[(num_tokens, head_blocks, num_splits)](
        q_nope, q_pe, latent_cache, out, part_o, part_lse, block_table, seq_lens,
        kv_scale if has_scale else seq_lens,
        float(scale), num_heads, num_splits,
        q_nope.stride(0), q_nope.stride(1), q_pe.stride(0), q_pe.stride(1),
        latent_cache.stride(0), latent_cache.stride(1), block_table.stride(0),
        out.stride(0), out.stride(1), *po, *pl,
        RANK=rank, BLOCK_R=next_pow2(rank), ROPE=rope, BLOCK_P=max(16, next_pow2(rope)),
        BLOCK_H=cfg["BLOCK_H"], BLOCK_N=cfg["BLOCK_N"], PAGE=latent_cache.shape[1],
        HAS_SCALE=has_scale, DIRECT=direct, UPCAST=upcast, PREC=prec,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    if not direct:
        split_kv_reduce(part_o, part_lse, out, num_splits)
    return out


def warm_up(num_heads: int, rank: int, rope: int, dtype: torch.dtype, page: int,
            device: torch.device) -> int:
    """Launch every variant of the absorbed decode that a serving step can meet with these
    shapes, on a tiny two-sequence batch: the direct path (one split) and the split-KV path
    with every ``BLOCK_S`` bucket of its reduce (:data:`atom.ops.attention_triton.WARM_UP_SPLITS`).
    The queries are views of one ``[T, H, rank + rope]`` tensor, as vLLM's concatenated decode
    query is; the split count, block-table width and partial-LSE strides are not specialised,
    so these launches cover every later batch. Returns the number of launches."""
    ctx = 2 * page
    blocks_per_seq = cdiv(ctx, page)
    cache = torch.zeros(2 * blocks_per_seq, page, rank + rope, dtype=dtype, device=device)
    table = torch.arange(2 * blocks_per_seq, dtype=torch.int32, device=device).view(2, -1)
    seq_lens = torch.full((2,), ctx, dtype=torch.int32, device=device)
    q_nope, q_pe = torch.zeros(2, num_heads, rank + rope, dtype=dtype, device=device).split([rank, rope], -1)
    for splits in WARM_UP_SPLITS:
        mla_decode_fwd(q_nope, q_pe, cache, table, seq_lens, 1.0, max_seq_len=ctx, num_splits=splits)
    return len(WARM_UP_SPLITS)
