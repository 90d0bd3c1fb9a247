"""MLA: latent-cache write (RoPE + store) and absorbed decode, Triton vs the torch reference,
and the references against independent formulations (RoPE as a rotation, MLA decode as MQA
paged attention over the latent rows)."""

from __future__ import annotations

import math

import pytest
import torch

from atom.ops.attention import paged_attention
from atom.ops.mla import mla_decode, mla_write_latent_cache, rope_torch

FP8 = torch.float8_e4m3fn
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def cos_sin(max_pos: int, rope: int, dtype=torch.float32) -> torch.Tensor:
    inv = 1.0 / (10000.0 ** (torch.arange(0, rope, 2, dtype=torch.float64) / rope))
    f = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv[None, :]
    return torch.cat([f.cos(), f.sin()], -1).to(dtype).to(DEV)


def nan_cache(blocks: int, block_size: int, width: int, dtype) -> torch.Tensor:
    c = torch.empty(blocks, block_size, width, dtype=dtype, device=DEV)
    if dtype == FP8:
        c.view(torch.uint8).fill_(0x7F)  # e4m3 NaN
    else:
        c.fill_(float("nan"))
    return c


# -- write -------------------------------------------------------------------------------------


@pytest.mark.parametrize("is_neox", [False, True], ids=["gptj", "neox"])
@pytest.mark.parametrize("cache_dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2), (FP8, 0.0)],
                         ids=["fp32", "bf16", "fp8"])
def test_write_latent_cache(is_neox, cache_dtype, tol):
    g = torch.Generator().manual_seed(int(is_neox) * 7 + 3)
    t, rank, rope, blocks, bs = 9, 48, 16, 7, 4
    act = torch.float32 if cache_dtype == torch.float32 else torch.bfloat16
    # kv_c and k_pe as strided views of one projection output, like vLLM's kv_a split
    proj = torch.randn(t, rank + rope + 8, generator=g).to(act).to(DEV)
    kv_c, k_pe = proj[:, :rank], proj[:, rank:rank + rope].unsqueeze(1)
    positions = torch.randint(0, 100, (t,), generator=g).to(DEV)
    slots = torch.randperm(blocks * bs, generator=g)[:t]
    slots[[1, 5]] = -1  # padding tokens: skipped
    slots = slots.to(DEV)
    kv_scale = torch.tensor([0.25], device=DEV) if cache_dtype == FP8 else None
    cs = cos_sin(128, rope)
    caches = {}
    for backend in ("torch", "triton"):
        cache = nan_cache(blocks, bs, rank + rope, cache_dtype)
        mla_write_latent_cache.run(backend, kv_c, k_pe, positions, cs, cache, slots, is_neox,
                                   kv_scale=kv_scale)
        caches[backend] = cache.float()
    ref, out = caches["torch"], caches["triton"]
    written = torch.zeros(blocks * bs, dtype=torch.bool, device=DEV)
    written[slots[slots >= 0]] = True
    written = written.view(blocks, bs)
    assert torch.isnan(out[~written]).all(), "a slot outside slot_mapping was written"
    assert torch.isfinite(out[written]).all()
    torch.testing.assert_close(out[written], ref[written], atol=tol, rtol=tol)


def test_rope_reference_is_a_rotation():
    """Independent check of the reference RoPE: position 0 is identity, norms per rotated pair
    are kept, and neox on halves equals GPT-J on the de-interleaved vector."""
    rope = 16
    x = torch.randn(5, rope, dtype=torch.float64)
    cs = cos_sin(64, rope, torch.float64).cpu()
    zero = torch.zeros(5, dtype=torch.long)
    torch.testing.assert_close(rope_torch(x, zero, cs, True).double(), x, atol=1e-6, rtol=0)
    pos = torch.tensor([1, 7, 13, 40, 63])
    gptj = rope_torch(x, pos, cs, False)
    torch.testing.assert_close(gptj.view(5, -1, 2).norm(dim=-1), x.view(5, -1, 2).norm(dim=-1).float())
    halves = torch.cat([x[:, 0::2], x[:, 1::2]], -1)  # de-interleave
    neox = rope_torch(halves, pos, cs, True)
    torch.testing.assert_close(torch.cat([gptj[:, 0::2], gptj[:, 1::2]], -1), neox)


# -- decode ------------------------------------------------------------------------------------


def make_decode(seq_lens, heads, rank, rope, bs, dtype, cache_dtype=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    cache_dtype = cache_dtype or dtype
    n_blocks = [-(-L // bs) for L in seq_lens]
    total = sum(n_blocks) + 3
    data = torch.randn(total, bs, rank + rope, generator=g)
    kv_scale = None
    if cache_dtype == FP8:
        kv_scale = torch.tensor([0.5], device=DEV)
        data = data / 0.5
    real = torch.zeros(total, bs, dtype=torch.bool)
    perm = torch.randperm(total, generator=g)
    table = perm[torch.randint(0, total, (len(seq_lens), max(n_blocks) + 1), generator=g)].int()
    used = 0
    for i, (nb, L) in enumerate(zip(n_blocks, seq_lens)):
        blocks = perm[used:used + nb]
        used += nb
        table[i, :nb] = blocks.int()
        j = torch.arange(L)
        real[blocks[j // bs], j % bs] = True
    cache = torch.where(real[..., None], data, float("nan")).to(cache_dtype).to(DEV)
    t = len(seq_lens)
    qn = torch.randn(t, heads, rank, generator=g).to(dtype).to(DEV)
    qp = torch.randn(t, heads, rope, generator=g).to(dtype).to(DEV)
    return (qn, qp, cache, table.to(DEV), torch.tensor(seq_lens, dtype=torch.int32, device=DEV),
            1.0 / math.sqrt(rank + rope)), kv_scale


def run_decode(args, kv_scale, **kw):
    ref = mla_decode.run("torch", *args, kv_scale=kv_scale, **kw)
    out = torch.full_like(args[0], float("nan"))
    res = mla_decode.run("triton", *args, kv_scale=kv_scale, out=out, **kw)
    assert res is out and torch.isfinite(out.float()).all()
    return out, ref


@pytest.mark.parametrize("dtype,atol,rtol", [(torch.float32, 2e-5, 1e-4), (torch.bfloat16, 2e-2, 2e-2)],
                         ids=["fp32", "bf16"])
@pytest.mark.parametrize("heads,rank,rope", [(1, 32, 16), (16, 64, 16), (20, 48, 8)])
def test_decode(dtype, atol, rtol, heads, rank, rope):
    args, ks = make_decode([5, 70, 33, 1], heads, rank, rope, 8, dtype, seed=heads + rank)
    out, ref = run_decode(args, ks)
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol)


def test_decode_long_context_several_splits():
    from atom.ops.mla_triton import _decode_config, choose_num_splits

    args, ks = make_decode([400], 4, 32, 16, 16, torch.float32, seed=4)
    if DEV == "cpu":
        assert choose_num_splits(1, 400, _decode_config(32)["BLOCK_N"], torch.device("cpu")) >= 4
    out, ref = run_decode(args, ks, max_seq_len=400)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("num_splits", [1, 5, 16])
def test_decode_explicit_splits_with_empty_partitions(num_splits):
    from atom.ops.mla_triton import mla_decode_fwd

    args, ks = make_decode([3, 90, 40], 16, 32, 16, 8, torch.float32, seed=num_splits)
    ref = mla_decode.run("torch", *args)
    out = torch.full_like(args[0], float("nan"))
    mla_decode_fwd(*args, out=out, num_splits=num_splits)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("tile", ["64,64,8,2", "64,32,4,1", "32,64,8,2", "16,16,4,3"])
def test_decode_explicit_tile(tile, monkeypatch):
    """ATOM_MLA_DECODE_TILE (the tiles bench/mla_tiles.py sweeps) changes the kernel's tiling,
    not its result; a BLOCK_H above the head count masks the extra rows."""
    from atom.ops.mla_triton import _decode_config

    monkeypatch.setenv("ATOM_MLA_DECODE_TILE", tile)
    h, n, w, st = (int(x) for x in tile.split(","))
    assert _decode_config(512) == dict(BLOCK_H=h, BLOCK_N=n, num_warps=w, num_stages=st)
    args, ks = make_decode([5, 70, 33], 20, 32, 16, 8, torch.float32, seed=h + n)
    out, ref = run_decode(args, ks)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


def test_decode_fp8_latent_cache():
    args, ks = make_decode([17, 64, 3], 16, 64, 16, 16, torch.bfloat16, cache_dtype=FP8, seed=9)
    out, ref = run_decode(args, ks)
    torch.testing.assert_close(out.float(), ref.float(), atol=3e-2, rtol=3e-2)


def test_write_then_decode_roundtrip():
    """The Triton write feeds the Triton decode: the result matches the all-torch pipeline."""
    g = torch.Generator().manual_seed(5)
    t, rank, rope, heads, bs = 20, 32, 16, 4, 8
    kv_c = torch.randn(t, rank, generator=g).to(DEV)
    k_pe = torch.randn(t, rope, generator=g).to(DEV)
    pos = torch.arange(t, device=DEV)
    table = torch.randperm(6, generator=g)[:3].view(1, 3).int().to(DEV)
    slots = (table[0, pos // bs].long() * bs + pos % bs)
    cs = cos_sin(64, rope)
    qn = torch.randn(1, heads, rank, generator=g).to(DEV)
    qp = torch.randn(1, heads, rope, generator=g).to(DEV)
    sl = torch.tensor([t], dtype=torch.int32, device=DEV)
    outs = []
    for backend in ("torch", "triton"):
        cache = nan_cache(6, bs, rank + rope, torch.float32)
        mla_write_latent_cache.run(backend, kv_c, k_pe, pos, cs, cache, slots, False)
        outs.append(mla_decode.run(backend, qn, qp, cache, table, sl, 0.2))
    torch.testing.assert_close(outs[1], outs[0], atol=2e-5, rtol=1e-4)


def test_reference_equals_mqa_paged_attention():
    """Absorbed MLA decode == MQA attention with key = value = the latent row (first
    kv_lora_rank output channels), via the independent paged-attention reference."""
    args, _ = make_decode([7, 30], 8, 24, 8, 4, torch.float32, seed=1)
    qn, qp, cache, table, sl, scale = args
    ref = mla_decode.run("torch", *args)
    kv = cache.unsqueeze(2)  # [blocks, bs, 1 kv head, rank + rope]
    q = torch.cat([qn, qp], -1)
    qsl = torch.arange(3, dtype=torch.int32, device=DEV)
    mqa = paged_attention.run("torch", q, kv, kv, table, sl, qsl, 1, 30, scale)
    torch.testing.assert_close(ref, mqa[..., :24], atol=1e-5, rtol=1e-5)


# -- GPU, real sizes ---------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("batch,ctx", [(1, 2048), (32, 2048), (16, 8192)])
@pytest.mark.parametrize("cache", ["bf16", "fp8"])
def test_gpu_decode_deepseek(batch, ctx, cache):
    args, ks = make_decode([ctx - 31 * i for i in range(batch)], 128, 512, 64, 64 if cache == "bf16" else 16,
                           torch.bfloat16, cache_dtype=FP8 if cache == "fp8" else None, seed=batch)
    out, ref = run_decode(args, ks, max_seq_len=ctx)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("is_neox", [False, True])
def test_gpu_write_deepseek(is_neox):
    t, rank, rope, bs = 4096, 512, 64, 16
    kv_c = torch.randn(t, rank, device=DEV, dtype=torch.bfloat16)
    k_pe = torch.randn(t, 1, rope, device=DEV, dtype=torch.bfloat16)
    pos = torch.randint(0, 8192, (t,), device=DEV)
    slots = torch.randperm(512 * bs, device=DEV)[:t]
    cs = cos_sin(8192, rope)
    caches = []
    for backend in ("torch", "triton"):
        c = nan_cache(512, bs, rank + rope, torch.bfloat16)
        mla_write_latent_cache.run(backend, kv_c, k_pe, pos, cs, c, slots, is_neox)
        caches.append(c.float())
    torch.testing.assert_close(caches[1], caches[0], atol=1e-2, rtol=1e-2, equal_nan=True)
