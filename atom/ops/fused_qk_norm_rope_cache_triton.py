"""One Triton kernel for per-head q/k work: optional RMSNorm, RoPE, optional paged-cache write.

Used by ``rotary_embedding`` (RoPE only, in place) and ``fused_qk_norm_rope_cache`` (per-head
RMSNorm + RoPE on q and k, in place, and k/v written into the paged cache, fp8 optional).

Grid: ``(tokens, q_head_blocks + k_head_blocks)``. A q program normalises/rotates a block of q
heads of one token; a k program does the same for k heads and also writes those k heads and
the matching v heads into the cache. Each head is handled as three register tiles: the two
halves of every rotary pair (NeoX: ``[0, r/2)`` and ``[r/2, r)``; GPT-J: even and odd dims) and
the non-rotated tail ``[r, D)``, so the pair partner is always in registers and every element
is loaded and stored exactly once (GPT-J pairs are loaded contiguously and split in registers).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from atom.ops._common import cdiv, next_pow2
from atom.ops.common_triton import cache_store, exact_fp8_cast, num_warps_for

#: Target elements per head-block tile (D=128 -> 8 heads per program).
TILE_ELEMS = 1024


@triton.jit
def _norm_rope_heads(
    base, heads, stride_h, mask_h, i, mask_i, offp, mask_p,
    w_ptr, cos, sin, eps,
    HEAD_DIM: tl.constexpr, ROT_HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
    IS_NEOX: tl.constexpr, DO_NORM: tl.constexpr, LOAD_PASS: tl.constexpr,
):
    """Norm + rotate a ``[heads, D]`` block in place; returns it (in the tensor's dtype) for the
    cache write as ``(first, second, tail)``: NeoX gives the two half tiles, GPT-J gives the
    interleaved ``[heads, r]`` tile as ``first`` (``second`` unused)."""
    dtype = base.dtype.element_ty
    rows = base + heads[:, None] * stride_h
    m1 = mask_h[:, None] & mask_i[None, :]
    mp = mask_h[:, None] & mask_p[None, :]
    if IS_NEOX:
        x1 = tl.load(rows + i[None, :], mask=m1, other=0.0).to(tl.float32)
        x2 = tl.load(rows + ROT_HALF + i[None, :], mask=m1, other=0.0).to(tl.float32)
    else:
        # GPT-J pairs are adjacent: load the rotary span contiguously (vector loads) and
        # de-interleave in registers rather than issuing two stride-2 loads.
        c = tl.arange(0, 2 * BLOCK_HALF)
        mc = mask_h[:, None] & (c[None, :] < 2 * ROT_HALF)
        x = tl.load(rows + c[None, :], mask=mc, other=0.0).to(tl.float32)
        x1, x2 = tl.split(tl.reshape(x, [x.shape[0], BLOCK_HALF, 2]))
    if LOAD_PASS:
        xp = tl.load(rows + offp[None, :], mask=mp, other=0.0).to(tl.float32)
    else:
        xp = tl.zeros([x1.shape[0], offp.shape[0]], dtype=tl.float32)
    if DO_NORM:
        ss = tl.sum(x1 * x1 + x2 * x2, axis=1)
        if LOAD_PASS:
            ss += tl.sum(xp * xp, axis=1)
        rstd = tl.rsqrt(ss / HEAD_DIM + eps)[:, None]
        if IS_NEOX:
            w1 = tl.load(w_ptr + i, mask=mask_i, other=0.0).to(tl.float32)
            w2 = tl.load(w_ptr + ROT_HALF + i, mask=mask_i, other=0.0).to(tl.float32)
        else:
            w = tl.load(w_ptr + tl.arange(0, 2 * BLOCK_HALF), mask=tl.arange(0, 2 * BLOCK_HALF) < 2 * ROT_HALF,
                        other=0.0).to(tl.float32)
            w1, w2 = tl.split(tl.reshape(w, [BLOCK_HALF, 2]))
        # Round the normed value to the activation dtype before RoPE, exactly where the
        # unfused rms_norm -> rotary_embedding sequence rounds: fusion does not change numerics.
        x1 = (x1 * rstd * w1[None, :]).to(dtype).to(tl.float32)
        x2 = (x2 * rstd * w2[None, :]).to(dtype).to(tl.float32)
        if LOAD_PASS:
            wp = tl.load(w_ptr + offp, mask=mask_p, other=0.0).to(tl.float32)
            xp = (xp * rstd * wp[None, :]).to(dtype).to(tl.float32)
            tl.store(rows + offp[None, :], xp.to(dtype), mask=mp)
    o1 = (x1 * cos[None, :] - x2 * sin[None, :]).to(dtype)
    o2 = (x2 * cos[None, :] + x1 * sin[None, :]).to(dtype)
    if IS_NEOX:
        tl.store(rows + i[None, :], o1, mask=m1)
        tl.store(rows + ROT_HALF + i[None, :], o2, mask=m1)
        return o1, o2, xp.to(dtype)
    else:
        o = tl.reshape(tl.join(o1, o2), [o1.shape[0], 2 * BLOCK_HALF])
        tl.store(rows + c[None, :], o, mask=mc)
        return o, o, xp.to(dtype)


@triton.jit
def _qk_norm_rope_cache_kernel(
    q_ptr, k_ptr, v_ptr, qw_ptr, kw_ptr, pos_ptr, cs_ptr,
    kc_ptr, vc_ptr, slot_ptr, ks_ptr, vs_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_cs,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
    HQ, HK, block_size, eps,
    NUM_Q_BLOCKS: tl.constexpr, HEAD_DIM: tl.constexpr, ROT_HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
    IS_NEOX: tl.constexpr, DO_NORM: tl.constexpr, LOAD_PASS: tl.constexpr,
    DO_CACHE: tl.constexpr, FP8: tl.constexpr, EXACT_FP8: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    i = tl.arange(0, BLOCK_HALF)
    mask_i = i < ROT_HALF
    offp = 2 * ROT_HALF + tl.arange(0, BLOCK_PASS)
    mask_p = offp < HEAD_DIM
    # cos_sin_cache row: [cos(0..r/2) | sin(0..r/2)] (vLLM's layout).
    cos = tl.load(cs_ptr + pos * stride_cs + i, mask=mask_i, other=0.0).to(tl.float32)
    sin = tl.load(cs_ptr + pos * stride_cs + ROT_HALF + i, mask=mask_i, other=0.0).to(tl.float32)
    # Distinct names per branch: Triton merges variables assigned in both branches of an `if`,
    # and BLOCK_HQ != BLOCK_HK (e.g. 32 q heads, 4 kv heads) would give them mismatched types.
    if hb < NUM_Q_BLOCKS:
        q_heads = hb * BLOCK_HQ + tl.arange(0, BLOCK_HQ)
        _norm_rope_heads(
            q_ptr + t * stride_qt, q_heads, stride_qh, q_heads < HQ, i, mask_i, offp, mask_p,
            qw_ptr, cos, sin, eps, HEAD_DIM, ROT_HALF, BLOCK_HALF, IS_NEOX, DO_NORM, LOAD_PASS,
        )
    else:
        heads = (hb - NUM_Q_BLOCKS) * BLOCK_HK + tl.arange(0, BLOCK_HK)
        mask_h = heads < HK
        if DO_CACHE:
            # Issue the slot and v loads first so they are in flight during the k math.
            slot = tl.load(slot_ptr + t).to(tl.int64)
            d = tl.arange(0, BLOCK_D)
            mv = mask_h[:, None] & (d[None, :] < HEAD_DIM)
            v = tl.load(v_ptr + t * stride_vt + heads[:, None] * stride_vh + d[None, :], mask=mv)
        k1, k2, kp = _norm_rope_heads(
            k_ptr + t * stride_kt, heads, stride_kh, mask_h, i, mask_i, offp, mask_p,
            kw_ptr, cos, sin, eps, HEAD_DIM, ROT_HALF, BLOCK_HALF, IS_NEOX, DO_NORM, LOAD_PASS,
        )
        if DO_CACHE:
            # slot < 0 marks a padding token: q/k are still updated, the cache is not.
            if slot >= 0:
                blk = slot // block_size
                off = slot - blk * block_size
                kc = kc_ptr + blk * stride_kcb + off * stride_kcs + heads[:, None] * stride_kch
                if IS_NEOX:
                    m1 = mask_h[:, None] & mask_i[None, :]
                    cache_store(kc_ptr, kc + i[None, :], k1, m1, ks_ptr, FP8, EXACT_FP8)
                    cache_store(kc_ptr, kc + ROT_HALF + i[None, :], k2, m1, ks_ptr, FP8, EXACT_FP8)
                else:
                    c = tl.arange(0, 2 * BLOCK_HALF)
                    mc = mask_h[:, None] & (c[None, :] < 2 * ROT_HALF)
                    cache_store(kc_ptr, kc + c[None, :], k1, mc, ks_ptr, FP8, EXACT_FP8)
                if LOAD_PASS:
                    mp = mask_h[:, None] & mask_p[None, :]
                    cache_store(kc_ptr, kc + offp[None, :], kp, mp, ks_ptr, FP8, EXACT_FP8)
                vc = vc_ptr + blk * stride_vcb + off * stride_vcs + heads[:, None] * stride_vch
                cache_store(vc_ptr, vc + d[None, :], v, mv, vs_ptr, FP8, EXACT_FP8)


def qk_norm_rope_cache_launch(
    q: torch.Tensor,
    k: Optional[torch.Tensor],
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    rotary_dim: int,
    is_neox: bool,
    *,
    q_weight: Optional[torch.Tensor] = None,
    k_weight: Optional[torch.Tensor] = None,
    eps: float = 0.0,
    v: Optional[torch.Tensor] = None,
    key_cache: Optional[torch.Tensor] = None,
    value_cache: Optional[torch.Tensor] = None,
    slot_mapping: Optional[torch.Tensor] = None,
    fp8: bool = False,
    k_scale: Optional[torch.Tensor] = None,
    v_scale: Optional[torch.Tensor] = None,
) -> None:
    """q ``[T, Hq, D]``, k/v ``[T, Hk, D]`` (unit last stride, any other strides), in place.

    Norm runs when ``q_weight`` is given (then ``k_weight`` too); the cache write when
    ``key_cache`` is given (then ``v``, ``value_cache``, ``slot_mapping``).
    """
    t, hq, d = q.shape
    if t == 0:
        return
    hk = 0 if k is None else k.shape[1]
    do_norm = q_weight is not None
    do_cache = key_cache is not None
    rot_half = rotary_dim // 2
    n_pass = d - rotary_dim
    block_hq = min(next_pow2(hq), max(1, TILE_ELEMS // next_pow2(d)))
    block_hk = min(next_pow2(max(hk, 1)), max(1, TILE_ELEMS // next_pow2(d)))
    nqb = cdiv(hq, block_hq)
    nkb = cdiv(hk, block_hk) if hk else 0
    dummy = positions  # stands in for absent pointers; never dereferenced (constexpr-gated)
    kk = k if k is not None else q
    vv = v if do_cache else q
    kc = key_cache if do_cache else q
    vc = value_cache if do_cache else q
    _qk_norm_rope_cache_kernel[(t, nqb + nkb)](
        q, kk, vv,
        q_weight if do_norm else dummy, k_weight if do_norm else dummy,
        positions, cos_sin_cache,
        kc, vc, slot_mapping if do_cache else dummy,
        k_scale if fp8 else dummy, v_scale if fp8 else dummy,
        q.stride(0), q.stride(1), kk.stride(0), kk.stride(1), vv.stride(0), vv.stride(1),
        cos_sin_cache.stride(0),
        kc.stride(0), kc.stride(1), kc.stride(2) if do_cache else 0,
        vc.stride(0), vc.stride(1), vc.stride(2) if do_cache else 0,
        hq, hk, key_cache.shape[1] if do_cache else 1, float(eps),
        NUM_Q_BLOCKS=nqb, HEAD_DIM=d, ROT_HALF=rot_half,
        BLOCK_HALF=next_pow2(rot_half), BLOCK_PASS=next_pow2(max(n_pass, 1)),
        BLOCK_D=next_pow2(d), BLOCK_HQ=block_hq, BLOCK_HK=block_hk,
        IS_NEOX=bool(is_neox), DO_NORM=do_norm, LOAD_PASS=n_pass > 0 and (do_norm or do_cache),
        DO_CACHE=do_cache, FP8=fp8, EXACT_FP8=fp8 and exact_fp8_cast(),
        # About one 16-byte vector per thread per rotary half-tile (D=128 bf16, 8 heads: 2 warps).
        num_warps=num_warps_for(max(block_hq, block_hk) * next_pow2(d), q.element_size(), max_warps=8),
    )
