"""Inputs where each numerical detail of a kernel decides the answer, against float64 formulas
written out here, on every backend that runs on this machine (Triton under the interpreter on
CPU): a test that passes with the detail broken is no test (issue #19).

* the norm epsilon, on rows of tiny magnitude (mean square far below eps, where dropping or
  misplacing eps changes the output by orders of magnitude) and all-zero rows (0, not NaN), for
  every norm-like kernel: RMSNorm (plain, residual, fp8 output) and the fused QK-norm + RoPE +
  cache prologue;
* scale application: a static fp8 output scale that is not 1, dynamic per-token and per-group
  scales (partial last group), an fp8 KV cache's scales;
* boundary positions: RoPE at position 0 (identity) and at the last row of its table, both
  pairings and partial rotary; cache slots at the first and last offsets of a block, padding
  slots (-1) skipped;
* MoE routing: renormalisation and the correction bias of grouped top-k each change the result.
"""

from __future__ import annotations

import pytest
import torch

from atom.ops import (
    fused_qk_norm_rope_cache,
    grouped_topk_sigmoid,
    per_block_quant_fp8,
    per_token_quant_fp8,
    reshape_and_cache,
    rms_norm,
    rotary_embedding,
    topk_softmax,
)
from tests.ops._helpers import DEVICE, FP8

EPS = 1e-6
BACKENDS = ["torch", "triton"]


def _run(op, backend, *args, **kwargs):
    if backend == "triton" and op.unsupported("triton", *args, **kwargs):
        pytest.skip(f"{op.name}: {op.unsupported('triton', *args, **kwargs)}")
    return op.run(backend, *args, **kwargs)


def _rms64(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.double()
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.double()


def _tiny_rows(t: int, n: int) -> torch.Tensor:
    """Rows of magnitude ~1e-5 (mean square ~1e-10 << eps), one ordinary row, one all-zero row."""
    x = torch.randn(t, n, device=DEVICE) * 1e-5
    x[1] = torch.randn(n, device=DEVICE)
    x[2] = 0
    return x


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("residual", [False, True])
def test_rms_norm_epsilon_on_tiny_and_zero_rows(backend, residual):
    torch.manual_seed(0)
    n = 96
    x, w = _tiny_rows(5, n), torch.rand(n, device=DEVICE) + 0.5
    r = torch.zeros_like(x) if residual else None
    got = _run(rms_norm, backend, x, w, EPS, r)
    y = got[0] if residual else got
    want = _rms64(x, w, EPS)
    # tiny rows: ~x / sqrt(eps) (eps dominates), far from x / rms(x) (~w)
    assert y[0].abs().max() < 0.1
    torch.testing.assert_close(y.double(), want, atol=1e-6, rtol=1e-4)
    assert torch.equal(y[2], torch.zeros_like(y[2]))  # all-zero row: zeros, not NaN


@pytest.mark.parametrize("backend", BACKENDS)
def test_rms_norm_static_fp8_scale_is_applied(backend):
    torch.manual_seed(1)
    n = 130
    x, w = torch.randn(4, n, device=DEVICE), torch.rand(n, device=DEVICE) + 0.5
    scale = torch.tensor([0.0371], device=DEVICE)
    q = _run(rms_norm, backend, x, w, EPS, None, FP8, scale)
    assert q.dtype == FP8
    want = (_rms64(x, w, EPS) / 0.0371).clamp(-448, 448)
    got = q.double()
    # one e4m3 step (3 mantissa bits): |err| <= 2^-4 relative, or the smallest normal
    assert ((got - want).abs() <= want.abs() * 2 ** -4 + 2 ** -6).all()
    assert got.abs().max() > 20  # the scale matters: without it the values would stay below ~4


@pytest.mark.parametrize("backend", BACKENDS)
def test_fused_qk_norm_epsilon_and_rope_boundaries(backend):
    """The fused prologue norms tiny-magnitude and all-zero q/k heads with eps (0 stays 0), and
    rotates at position 0 (identity) and at the table's last row, like the float64 formula."""
    torch.manual_seed(2)
    t, hq, hk, d, max_pos = 3, 4, 2, 64, 50
    q = torch.randn(t, hq, d, device=DEVICE)
    k = torch.randn(t, hk, d, device=DEVICE)
    q[0] *= 1e-5
    k[0] *= 1e-5
    q[1, 0] = 0
    v = torch.randn(t, hk, d, device=DEVICE)
    wq, wk = torch.rand(d, device=DEVICE) + 0.5, torch.rand(d, device=DEVICE) + 0.5
    positions = torch.tensor([0, max_pos - 1, 7], device=DEVICE)
    cos_sin = _cos_sin(max_pos, d)
    kc = torch.zeros(4, 16, hk, d, device=DEVICE)
    vc = torch.zeros_like(kc)
    slots = torch.tensor([0, 15, 16], device=DEVICE)
    q_in, k_in = q.clone(), k.clone()
    _run(fused_qk_norm_rope_cache, backend, q, k, v, wq, wk, EPS, positions, cos_sin, True, kc, vc, slots)
    want_q = _rope64(_rms64(q_in, wq, EPS), positions, cos_sin, d, True)
    want_k = _rope64(_rms64(k_in, wk, EPS), positions, cos_sin, d, True)
    torch.testing.assert_close(q.double(), want_q, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(k.double(), want_k, atol=1e-5, rtol=1e-4)
    assert torch.equal(q[1, 0], torch.zeros_like(q[1, 0]))
    torch.testing.assert_close(kc.view(-1, hk, d)[slots].double(), want_k, atol=1e-5, rtol=1e-4)


def _cos_sin(max_pos: int, rot: int, base: float = 10000.0) -> torch.Tensor:
    inv = 1.0 / base ** (torch.arange(0, rot, 2, dtype=torch.float64) / rot)
    ang = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv[None, :]
    return torch.cat([ang.cos(), ang.sin()], -1).float().to(DEVICE)


def _rope64(x: torch.Tensor, pos: torch.Tensor, cos_sin: torch.Tensor, rot: int, neox: bool) -> torch.Tensor:
    """RoPE by complex multiplication in float64 on ``x [T, H, D]`` (first ``rot`` dims)."""
    x = x.double().clone()
    cs = cos_sin.double()[pos]
    cos, sin = cs[:, None, : rot // 2], cs[:, None, rot // 2:]
    part = x[..., :rot]
    a, b = (part[..., : rot // 2], part[..., rot // 2:]) if neox else (part[..., 0::2], part[..., 1::2])
    ra, rb = a * cos - b * sin, b * cos + a * sin
    if neox:
        x[..., : rot // 2], x[..., rot // 2: rot] = ra, rb
    else:
        x[..., 0:rot:2], x[..., 1:rot:2] = ra, rb
    return x


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("neox,rot", [(True, 64), (False, 64), (True, 32)])
def test_rope_at_the_first_and_last_positions(backend, neox, rot):
    torch.manual_seed(3)
    t, h, d, max_pos = 3, 2, 64, 33
    q, k = torch.randn(t, h * d, device=DEVICE), torch.randn(t, h * d, device=DEVICE)
    positions = torch.tensor([0, max_pos - 1, 5], device=DEVICE)
    cos_sin = _cos_sin(max_pos, rot)
    want_q = _rope64(q.view(t, h, d), positions, cos_sin, rot, neox)
    want_k = _rope64(k.view(t, h, d), positions, cos_sin, rot, neox)
    _run(rotary_embedding, backend, positions, q, k, cos_sin, d, rot, neox)
    torch.testing.assert_close(q.view(t, h, d).double(), want_q, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k.view(t, h, d).double(), want_k, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(q.view(t, h, d)[0], want_q[0].float(), atol=0, rtol=0)  # position 0: identity


@pytest.mark.parametrize("backend", BACKENDS)
def test_per_token_and_per_group_scales(backend):
    """x ~= q * scale within one e4m3 step per element; the last group of 130 columns in groups
    of 64 holds 2 columns (its own amax, not the previous group's)."""
    torch.manual_seed(4)
    x = torch.randn(5, 130, device=DEVICE)
    x[:, 128:] *= 1e-3  # the partial last group is tiny: a shared scale would flush it to zero
    q, s = _run(per_token_quant_fp8, backend, x)
    assert s.shape == (5, 1)
    torch.testing.assert_close(s[:, 0], x.abs().amax(-1) / 448, atol=0, rtol=1e-6)
    assert ((q.double() * s.double() - x.double()).abs() <= x.abs().double() * 2 ** -4 + s.double() * 2 ** -9).all()
    qb, sb = _run(per_block_quant_fp8, backend, x, 64)
    assert sb.shape == (5, 3)
    torch.testing.assert_close(sb[:, 2], x[:, 128:].abs().amax(-1) / 448, atol=0, rtol=1e-6)
    deq = qb.double() * sb.double().repeat_interleave(64, dim=1)[:, :130]
    assert ((deq - x.double()).abs() <= x.abs().double() * 2 ** -4 + 1e-9).all()
    assert deq[:, 128:].abs().min() > 0


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fp8", [False, True])
def test_cache_slots_at_block_boundaries_and_padding(backend, fp8):
    torch.manual_seed(5)
    blocks, bs, h, d = 3, 16, 2, 32
    dtype = FP8 if fp8 else torch.float32
    kc = torch.zeros(blocks, bs, h, d, device=DEVICE).to(dtype)
    vc = torch.zeros_like(kc)
    key, value = torch.randn(5, h, d, device=DEVICE), torch.randn(5, h, d, device=DEVICE)
    slots = torch.tensor([0, bs - 1, bs, blocks * bs - 1, -1], device=DEVICE)
    scales = (torch.tensor([0.05], device=DEVICE), torch.tensor([0.02], device=DEVICE)) if fp8 else (None, None)
    _run(reshape_and_cache, backend, key, value, kc, vc, slots, "fp8" if fp8 else "auto", *scales)
    flat_k, flat_v = kc.view(-1, h, d).double(), vc.view(-1, h, d).double()
    for i, slot in enumerate(slots[:4].tolist()):
        if fp8:
            want_k = (key[i] / 0.05).clamp(-448, 448).to(FP8).double() * 0.05
            torch.testing.assert_close(flat_k[slot] * 0.05, want_k, atol=0, rtol=0)
            assert ((flat_v[slot] * 0.02 - value[i].double()).abs() <= value[i].abs().double() * 2 ** -4 + 1e-3).all()
        else:
            torch.testing.assert_close(flat_k[slot], key[i].double(), atol=0, rtol=0)
            torch.testing.assert_close(flat_v[slot], value[i].double(), atol=0, rtol=0)
    written = {0, bs - 1, bs, blocks * bs - 1}
    untouched = [s for s in range(blocks * bs) if s not in written]
    assert not flat_k[untouched].any() and not flat_v[untouched].any()  # the padding row wrote nothing


@pytest.mark.parametrize("backend", BACKENDS)
def test_routing_renormalisation_and_correction_bias_decide(backend):
    torch.manual_seed(6)
    logits = torch.randn(6, 16, device=DEVICE)
    w, ids = _run(topk_softmax, backend, logits, 4, True)
    probs = torch.softmax(logits.double(), -1)
    top = probs.topk(4, -1)
    torch.testing.assert_close(w.double(), top.values / top.values.sum(-1, keepdim=True), atol=1e-6, rtol=1e-6)
    assert torch.equal(ids.long().sort(-1).values, top.indices.sort(-1).values)
    w_raw, _ = _run(topk_softmax, backend, logits, 4, False)
    torch.testing.assert_close(w_raw.double(), top.values, atol=1e-6, rtol=1e-6)
    # grouped top-k: a bias that moves experts into the top set, weights from the unbiased scores
    bias = torch.zeros(16, device=DEVICE)
    bias[[3, 9]] = 5.0  # in two different groups of 4
    w, ids = _run(grouped_topk_sigmoid, backend, logits, bias, 4, 4, 2, 2.5, True)
    assert ((ids == 3).any(-1) & (ids == 9).any(-1)).all()
    score = torch.sigmoid(logits.double())
    chosen = score.gather(1, ids.long())
    torch.testing.assert_close(w.double(), chosen / chosen.sum(-1, keepdim=True) * 2.5, atol=1e-6, rtol=1e-6)


def test_host_cdiv_is_ceiling_division():
    """Launch grids are sized with atom's host ``cdiv`` (not ``triton.cdiv``): it must agree with
    the ceiling of the quotient everywhere a grid meets (0, exact multiples, one past)."""
    import math

    from atom.ops._common import cdiv

    for b in (1, 3, 16, 128):
        for a in range(0, 4 * b + 2):
            assert cdiv(a, b) == math.ceil(a / b), (a, b)
