"""Real-size checks of the memory-bound Triton kernels on a GPU (skipped without CUDA).

Qwen3-8B / Qwen3-30B-A3B shapes at prefill token counts, Triton vs the torch reference, plus a
KV cache larger than 2**31 elements (64-bit addressing).
"""

from __future__ import annotations

import pytest
import torch

from atom.ops import OPS, split_qkv
from tests.ops._helpers import (
    assert_close, assert_fp8_close, make_cos_sin_cache, make_slot_mapping, poison_, same_bytes,
    written_mask,
)

pytestmark = pytest.mark.gpu

BF16_TOL = (2e-2, 2e-2)
T = 4096


@pytest.mark.parametrize("hidden", [4096, 8192])
@pytest.mark.parametrize("mode", ["plain", "residual", "residual_fp8"])
def test_rms_norm_real_size(hidden, mode):
    x = torch.randn(T, hidden, device="cuda", dtype=torch.bfloat16)
    w = torch.rand(hidden, device="cuda", dtype=torch.bfloat16) + 0.5
    r = torch.randn_like(x) if "residual" in mode else None
    out_dtype, scale = (torch.float8_e4m3fn, torch.tensor([0.02], device="cuda")) if "fp8" in mode else (None, None)
    out = poison_(torch.empty(T, hidden, device="cuda", dtype=out_dtype or torch.bfloat16))
    got = OPS["rms_norm"].run("triton", x, w, 1e-6, r, out_dtype, scale, out=out)
    want = OPS["rms_norm"].run("torch", x, w, 1e-6, r, out_dtype, scale)
    got_y, want_y = (got[0], want[0]) if r is not None else (got, want)
    if out_dtype is not None:
        assert_fp8_close(got_y, want_y)
    else:
        assert_close(got_y, want_y, *BF16_TOL)
    if r is not None:
        assert torch.equal(got[1], want[1])  # x + residual, rounded once to bf16 (RNE on GPU)


@pytest.mark.parametrize("neox", [True, False])
def test_rotary_real_size(neox):
    hq, hk, d = 32, 8, 128
    qkv = torch.randn(T, (hq + 2 * hk) * d, device="cuda", dtype=torch.bfloat16)
    cs = make_cos_sin_cache(40960, d, dtype=torch.bfloat16)
    pos = torch.randint(0, 40960, (T,), device="cuda")
    a, b = qkv.clone(), qkv.clone()
    OPS["rotary_embedding"].run("triton", pos, *split_qkv(a, hq, hk, d)[:2], cs, d, d, neox)
    OPS["rotary_embedding"].run("torch", pos, *split_qkv(b, hq, hk, d)[:2], cs, d, d, neox)
    assert_close(a, b, *BF16_TOL)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
@pytest.mark.parametrize("shape", [(32, 8), (32, 4)], ids=["qwen3-8b", "qwen3-30b-a3b"])
def test_fused_qk_norm_rope_cache_real_size(shape, kv_cache_dtype):
    hq, hk = shape
    d, bs = 128, 16
    nb = T // bs + 64
    cache_dtype = torch.float8_e4m3fn if kv_cache_dtype == "fp8" else torch.bfloat16
    qkv = torch.randn(T, (hq + 2 * hk) * d, device="cuda", dtype=torch.bfloat16)
    qw = torch.rand(d, device="cuda", dtype=torch.bfloat16) + 0.5
    kw = torch.rand(d, device="cuda", dtype=torch.bfloat16) + 0.5
    cs = make_cos_sin_cache(40960, d, dtype=torch.bfloat16)
    pos = torch.randint(0, 40960, (T,), device="cuda")
    slots = make_slot_mapping(T, nb, bs, num_pad=37)
    ks, vs = torch.tensor([0.05], device="cuda"), torch.tensor([0.04], device="cuda")
    kv0 = torch.zeros(2, nb, bs, hk, d, device="cuda").to(cache_dtype)
    out = {}
    for backend in ("triton", "torch"):
        buf, kv = qkv.clone(), kv0.clone()
        q, k, v = split_qkv(buf, hq, hk, d)
        OPS["fused_qk_norm_rope_cache"].run(backend, q, k, v, qw, kw, 1e-6, pos, cs, True, kv[0], kv[1],
                                            slots, kv_cache_dtype, ks, vs)
        out[backend] = (buf, kv)
    assert_close(out["triton"][0], out["torch"][0], *BF16_TOL)
    written = written_mask(slots, nb, bs)
    for i in range(2):
        got, want = out["triton"][1][i], out["torch"][1][i]
        if kv_cache_dtype == "fp8":
            assert_fp8_close(got[written], want[written], atol=2e-2 / 0.04)
        else:
            assert_close(got[written], want[written], *BF16_TOL)
        assert same_bytes(got[~written], kv0[i][~written])


def test_reshape_and_cache_beyond_2_31_elements():
    """Offsets into a >2**31-element cache need 64-bit math (blocks near the end are written)."""
    hk, d, bs = 8, 128, 16
    nb = (2**31 // (bs * hk * d)) + 1024  # each of key_cache / value_cache > 2**31 elements
    kv = torch.zeros(2, nb, bs, hk, d, device="cuda", dtype=torch.bfloat16)
    key = torch.randn(64, hk, d, device="cuda", dtype=torch.bfloat16)
    value = torch.randn(64, hk, d, device="cuda", dtype=torch.bfloat16)
    blocks = torch.tensor([nb - 1, nb - 2, 0, nb - 700], device="cuda")
    slots = (blocks.repeat_interleave(16) * bs + torch.arange(16, device="cuda").repeat(4))
    OPS["reshape_and_cache"].run("triton", key, value, kv[0], kv[1], slots)
    assert torch.equal(kv[0][slots // bs, slots % bs], key)
    assert torch.equal(kv[1][slots // bs, slots % bs], value)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_reshape_and_cache_real_size(kv_cache_dtype):
    hk, d, bs = 8, 128, 16
    nb = T // bs + 128
    cache_dtype = torch.float8_e4m3fn if kv_cache_dtype == "fp8" else torch.bfloat16
    key = torch.randn(T, hk, d, device="cuda", dtype=torch.bfloat16)
    value = torch.randn(T, hk, d, device="cuda", dtype=torch.bfloat16)
    slots = make_slot_mapping(T, nb, bs, num_pad=100)
    ks, vs = torch.tensor([0.05], device="cuda"), torch.tensor([0.04], device="cuda")
    kv_a = torch.zeros(2, nb, bs, hk, d, device="cuda").to(cache_dtype)
    kv_b = kv_a.clone()
    OPS["reshape_and_cache"].run("triton", key, value, kv_a[0], kv_a[1], slots, kv_cache_dtype, ks, vs)
    OPS["reshape_and_cache"].run("torch", key, value, kv_b[0], kv_b[1], slots, kv_cache_dtype, ks, vs)
    assert same_bytes(kv_a, kv_b)  # RNE conversion on GPU: bit-identical to torch


def test_silu_and_mul_real_size():
    x = torch.randn(T, 2 * 12288, device="cuda", dtype=torch.bfloat16) * 3
    assert_close(OPS["silu_and_mul"].run("triton", x), OPS["silu_and_mul"].run("torch", x), *BF16_TOL)


@pytest.mark.parametrize("k", [4096, 7168])
def test_fp8_quant_real_size(k):
    x = torch.randn(T, k, device="cuda", dtype=torch.bfloat16) * 5
    for op, args in ((OPS["per_token_quant_fp8"], ()), (OPS["per_block_quant_fp8"], (128,))):
        gq, gs = op.run("triton", x, *args)
        wq, ws = op.run("torch", x, *args)
        torch.testing.assert_close(gs, ws, atol=0, rtol=1e-6)
        assert_fp8_close(gq, wq, max_mismatch=0.001)
