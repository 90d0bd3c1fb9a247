"""reshape_and_cache: Triton vs the torch reference on shuffled paged layouts with padding."""

from __future__ import annotations

import pytest
import torch

from atom.ops.kv_cache import RESHAPE_AND_CACHE
from tests.ops._helpers import (
    DEVICE, DTYPE_IDS, DTYPE_TOLS, FP8, assert_fp8_close, fp8_scale, make_kv_cache,
    make_slot_mapping, same_bytes, written_mask,
)

# (T, Hkv, head_size, num_blocks, block_size, num_pad, layout)
CASES = [
    (1, 1, 64, 3, 4, 0, "nhd"),
    (7, 2, 64, 5, 4, 2, "nhd"),
    (33, 2, 128, 6, 16, 5, "hnd"),
    (7, 4, 96, 4, 8, 1, "blocks_outer"),
    (33, 1, 64, 20, 2, 0, "blocks_outer"),
    (7, 8, 128, 3, 16, 7, "nhd"),  # all padding
]
CASE_IDS = [f"T{c[0]}-h{c[1]}-d{c[2]}-nb{c[3]}-bs{c[4]}-pad{c[5]}-{c[6]}" for c in CASES]


def _run_both(case, dtype, kv_cache_dtype, slot_dtype=torch.int64):
    t, h, d, nb, bs, pad, layout = case
    cache_dtype = FP8 if kv_cache_dtype != "auto" else dtype
    key = torch.randn(t, h, d, device=DEVICE).to(dtype)
    # value as a strided view (every other head of a wider tensor): kernels use its strides.
    value = torch.randn(t, 2 * h, d, device=DEVICE).to(dtype)[:, ::2]
    slots = make_slot_mapping(t, nb, bs, pad, dtype=slot_dtype)
    ks, vs = (fp8_scale(0.021), fp8_scale(0.017)) if cache_dtype == FP8 else (None, None)
    phys_a, kc_a, vc_a = make_kv_cache(nb, bs, h, d, cache_dtype, layout)
    phys_b = phys_a.clone()
    kc_b, vc_b = (phys_b[:, 0], phys_b[:, 1]) if layout == "blocks_outer" else (
        (phys_b.permute(0, 1, 3, 2, 4)[0], phys_b.permute(0, 1, 3, 2, 4)[1]) if layout == "hnd"
        else (phys_b[0], phys_b[1]))
    before = phys_a.clone()
    RESHAPE_AND_CACHE.run("triton", key, value, kc_a, vc_a, slots, kv_cache_dtype, ks, vs)
    RESHAPE_AND_CACHE.run("torch", key, value, kc_b, vc_b, slots, kv_cache_dtype, ks, vs)
    return (kc_a, vc_a), (kc_b, vc_b), before, slots


# Every dtype with "auto"; fp8 from fp32 and bf16; vLLM's other fp8 spelling once (fp32).
KV_DTYPES = [(dt, "auto") for dt in DTYPE_TOLS] + [(DTYPE_TOLS[0], "fp8"), (DTYPE_TOLS[1], "fp8"),
                                                   (DTYPE_TOLS[0], "fp8_e4m3")]
KV_IDS = [f"{i}-auto" for i in DTYPE_IDS] + ["fp32-fp8", "bf16-fp8", "fp32-fp8_e4m3"]


@pytest.mark.parametrize("dtype_tol,kv_cache_dtype", KV_DTYPES, ids=KV_IDS)
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_triton_matches_reference(case, dtype_tol, kv_cache_dtype):
    dtype = dtype_tol[0]
    (kc_a, vc_a), (kc_b, vc_b), before, slots = _run_both(case, dtype, kv_cache_dtype)
    t, h, d, nb, bs, pad, layout = case
    written = written_mask(slots, nb, bs)
    for got, want in ((kc_a, kc_b), (vc_a, vc_b)):
        if kv_cache_dtype == "auto":
            # A pure copy: bit-exact, written rows and untouched rows alike.
            assert same_bytes(got, want)
        else:
            assert_fp8_close(got[written], want[written])
            assert same_bytes(got[~written], want[~written])
    # Rows no slot points at still hold their old bytes.
    kc0, vc0 = (before[:, 0], before[:, 1]) if layout == "blocks_outer" else (
        (before.permute(0, 1, 3, 2, 4)[0], before.permute(0, 1, 3, 2, 4)[1]) if layout == "hnd"
        else (before[0], before[1]))
    assert same_bytes(kc_a[~written], kc0[~written])
    assert same_bytes(vc_a[~written], vc0[~written])
    assert int(written.sum()) == t - pad


def test_int32_slot_mapping():
    case = (7, 2, 64, 5, 4, 2, "nhd")
    (kc_a, vc_a), (kc_b, vc_b), _, _ = _run_both(case, torch.bfloat16, "auto", slot_dtype=torch.int32)
    assert same_bytes(kc_a, kc_b) and same_bytes(vc_a, vc_b)


def test_fp8_values_are_value_over_scale():
    """Independent of the reference: dequantised cache rows are the inputs to fp8 precision."""
    key = torch.randn(5, 2, 64, device=DEVICE)
    value = torch.randn(5, 2, 64, device=DEVICE) * 10
    _, kc, vc = make_kv_cache(4, 4, 2, 64, FP8, "nhd")
    slots = torch.tensor([3, 0, 15, 7, 8], device=DEVICE)
    ks, vs = fp8_scale(0.01), fp8_scale(0.1)
    RESHAPE_AND_CACHE.run("triton", key, value, kc, vc, slots, "fp8", ks, vs)
    for src, cache, scale in ((key, kc, 0.01), (value, vc, 0.1)):
        rows = cache.view(16, 2, 64)[slots].float() * scale
        torch.testing.assert_close(rows, src.clamp(-448 * scale, 448 * scale), rtol=0.07, atol=scale * 2**-9)


def test_validation_errors():
    key = torch.randn(3, 2, 64, device=DEVICE)
    _, kc, vc = make_kv_cache(2, 4, 2, 64, torch.float32, "nhd")
    _, kc8, vc8 = make_kv_cache(2, 4, 2, 64, FP8, "nhd")
    slots = torch.tensor([0, 1, -1], device=DEVICE)
    for backend in ("torch", "triton"):
        with pytest.raises(ValueError, match="fp8_e5m2"):
            RESHAPE_AND_CACHE.run(backend, key, key, kc, vc, slots, "fp8_e5m2")
        with pytest.raises(ValueError, match="k_scale"):
            RESHAPE_AND_CACHE.run(backend, key, key, kc8, vc8, slots, "fp8")
        with pytest.raises(ValueError, match="auto"):
            RESHAPE_AND_CACHE.run(backend, key, key, kc8, vc8, slots, "auto")
        with pytest.raises(ValueError, match="float8"):
            RESHAPE_AND_CACHE.run(backend, key, key, kc, vc, slots, "fp8", fp8_scale(1.0), fp8_scale(1.0))
        with pytest.raises(ValueError, match="slot_mapping"):
            RESHAPE_AND_CACHE.run(backend, key, key, kc, vc, slots[:2])
        with pytest.raises(ValueError, match="key_cache"):
            RESHAPE_AND_CACHE.run(backend, key[:, :1], key[:, :1], kc, vc, slots)
