"""rotary_embedding: Triton vs the torch reference; the reference vs a complex-number oracle."""

from __future__ import annotations

import pytest
import torch

from atom.ops.rotary import ROTARY_EMBEDDING
from tests.ops._helpers import (
    BF16, DEVICE, DTYPE_IDS, DTYPE_TOLS, FP32, assert_close, make_cos_sin_cache, same_bytes,
)

MAX_POS = 257

# (T, Hq, Hk, head_size, rotary_dim, is_neox): odd token counts, GQA ratios 1/2/4, partial rotary.
CASES = [
    (1, 4, 1, 64, 64, True),
    (7, 4, 2, 64, 32, True),
    (33, 2, 2, 128, 128, True),
    (7, 4, 1, 128, 64, True),
    (1, 4, 4, 64, 64, False),
    (7, 4, 2, 64, 32, False),
    (33, 2, 1, 128, 128, False),
    (7, 3, 1, 96, 48, True),  # non-power-of-two head and rotary halves (masked tiles)
    (7, 3, 1, 96, 48, False),
]
CASE_IDS = [f"T{c[0]}-q{c[1]}k{c[2]}-d{c[3]}-r{c[4]}-{'neox' if c[5] else 'gptj'}" for c in CASES]


def _qkv(t: int, hq: int, hk: int, d: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(t, (hq + 2 * hk) * d, device=DEVICE).to(dtype)


def _views(qkv: torch.Tensor, hq: int, hk: int, d: int, three_d: bool):
    """q/k as strided slices of a fused qkv output: 2-D ``[T, H*D]`` or 3-D ``[T, H, D]``."""
    q = qkv[:, : hq * d]
    k = qkv[:, hq * d: (hq + hk) * d]
    if three_d:
        q, k = q.view(q.shape[0], hq, d), k.view(k.shape[0], hk, d)
    return q, k


@pytest.mark.parametrize("dtype_tol", DTYPE_TOLS, ids=DTYPE_IDS)
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_triton_matches_reference(case, dtype_tol):
    t, hq, hk, d, rd, neox = case
    dtype, atol, rtol = dtype_tol
    cache = make_cos_sin_cache(MAX_POS, rd, dtype=torch.float32 if dtype == torch.float32 else dtype)
    positions = torch.randint(0, MAX_POS, (t,), device=DEVICE)
    qkv = _qkv(t, hq, hk, d, dtype)
    got_buf, want_buf = qkv.clone(), qkv.clone()
    three_d = t % 2 == 1 and hq % 2 == 0  # alternate between the two accepted layouts
    gq, gk = _views(got_buf, hq, hk, d, three_d)
    wq, wk = _views(want_buf, hq, hk, d, three_d)
    rq, rk = ROTARY_EMBEDDING.run("triton", positions, gq, gk, cache, d, rd, neox)
    assert rq is gq and rk is gk  # in place, same tensors back
    ROTARY_EMBEDDING.run("torch", positions, wq, wk, cache, d, rd, neox)
    assert_close(got_buf, want_buf, atol, rtol)
    # Untouched: v, and the non-rotary tail of every q/k head (bit for bit).
    assert same_bytes(got_buf[:, (hq + hk) * d:], qkv[:, (hq + hk) * d:])
    if rd < d:
        tail = lambda b: b[:, : (hq + hk) * d].view(t, hq + hk, d)[..., rd:]  # noqa: E731
        assert same_bytes(tail(got_buf), tail(qkv))


@pytest.mark.parametrize("neox", [True, False], ids=["neox", "gptj"])
def test_query_only(neox):
    dtype, atol, rtol = FP32
    cache = make_cos_sin_cache(MAX_POS, 64)
    positions = torch.randint(0, MAX_POS, (7,), device=DEVICE)
    q = torch.randn(7, 3 * 64, device=DEVICE)
    got, want = q.clone(), q.clone()
    assert ROTARY_EMBEDDING.run("triton", positions, got, None, cache, 64, 64, neox)[1] is None
    ROTARY_EMBEDDING.run("torch", positions, want, None, cache, 64, 64, neox)
    assert_close(got, want, atol, rtol)


def test_int32_positions_and_bf16_cache():
    dtype, atol, rtol = BF16
    cache = make_cos_sin_cache(MAX_POS, 64, dtype=torch.bfloat16)
    positions = torch.randint(0, MAX_POS, (7,), device=DEVICE, dtype=torch.int32)
    qkv = _qkv(7, 2, 1, 64, dtype)
    got, want = qkv.clone(), qkv.clone()
    ROTARY_EMBEDDING.run("triton", positions, *_views(got, 2, 1, 64, False), cache, 64, 64, True)
    ROTARY_EMBEDDING.run("torch", positions, *_views(want, 2, 1, 64, False), cache, 64, 64, True)
    assert_close(got, want, atol, rtol)


# -- the reference itself, against an independent complex-number formulation (torch only) ----
def _oracle(positions, x, rd, neox, base=10000.0):
    """RoPE as a complex rotation by angle pos * base**(-2i/rd), in float64."""
    inv_freq = 1.0 / (base ** (torch.arange(0, rd, 2, dtype=torch.float64) / rd))
    angle = positions.double()[:, None] * inv_freq[None, :]
    rot = torch.polar(torch.ones_like(angle), angle)[:, None, :]
    xd = x.double()
    if neox:
        z = torch.complex(xd[..., : rd // 2], xd[..., rd // 2: rd]) * rot
        new = torch.cat((z.real, z.imag), dim=-1)
    else:
        z = torch.view_as_complex(xd[..., :rd].reshape(*xd.shape[:-1], rd // 2, 2).contiguous()) * rot
        new = torch.view_as_real(z).flatten(-2)
    return torch.cat((new, xd[..., rd:]), dim=-1)


@pytest.mark.parametrize("neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize("shape", [(1, 1, 64, 64), (9, 8, 128, 128), (40, 4, 128, 64), (5, 2, 80, 32)])
def test_reference_matches_complex_oracle(shape, neox):
    t, h, d, rd = shape
    cache = make_cos_sin_cache(4096, rd).cpu()
    positions = torch.randint(0, 4096, (t,))
    q = torch.randn(t, h, d)
    want = _oracle(positions, q, rd, neox)
    ROTARY_EMBEDDING.run("torch", positions, q, None, cache, d, rd, neox)
    torch.testing.assert_close(q.double(), want, atol=1e-5, rtol=1e-5)


def test_validation_errors():
    cache = make_cos_sin_cache(16, 64)
    positions = torch.zeros(3, dtype=torch.int64, device=DEVICE)
    q = torch.randn(3, 2 * 64, device=DEVICE)
    for backend in ("torch", "triton"):
        with pytest.raises(ValueError, match="rotary_dim"):
            ROTARY_EMBEDDING.run(backend, positions, q, None, cache, 64, 65, True)
        with pytest.raises(ValueError, match="cos_sin_cache"):
            ROTARY_EMBEDDING.run(backend, positions, q, None, cache, 64, 32, True)
        with pytest.raises(ValueError, match="expected"):
            ROTARY_EMBEDDING.run(backend, positions, q[:, :100], None, cache, 64, 64, True)
        with pytest.raises(ValueError, match="positions"):
            ROTARY_EMBEDDING.run(backend, positions.float(), q, None, cache, 64, 64, True)
