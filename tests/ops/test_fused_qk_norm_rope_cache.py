"""fused_qk_norm_rope_cache: the one-kernel Triton path vs the unfused reference composition."""

from __future__ import annotations

import importlib

import pytest
import torch

from atom.ops.fused_qk_norm_rope_cache import FUSED_QK_NORM_ROPE_CACHE, split_qkv
from atom.ops.kv_cache import RESHAPE_AND_CACHE
from atom.ops.rmsnorm import RMS_NORM
from atom.ops.rotary import ROTARY_EMBEDDING
from tests.ops._helpers import (
    BF16, DEVICE, FP8, FP32, assert_close, assert_fp8_close, fp8_scale, make_cos_sin_cache,
    make_kv_cache, make_slot_mapping, same_bytes, written_mask,
)

EPS = 1e-6
MAX_POS = 300

# (T, Hq, Hkv, D, rotary_dim, is_neox, num_blocks, block_size, num_pad, layout, kv_cache_dtype)
CASES = [
    (1, 4, 1, 64, 64, True, 2, 4, 0, "nhd", "auto"),
    (7, 4, 2, 64, 64, True, 4, 4, 2, "nhd", "fp8"),
    (7, 4, 2, 64, 32, False, 4, 4, 1, "hnd", "auto"),
    (33, 2, 1, 128, 128, False, 6, 8, 3, "blocks_outer", "fp8"),
    (33, 4, 4, 64, 32, True, 10, 4, 0, "hnd", "fp8"),
    (7, 6, 2, 96, 48, True, 3, 4, 2, "nhd", "auto"),  # non-power-of-two D, 6 q heads
    (7, 3, 1, 96, 96, False, 3, 4, 7, "nhd", "fp8"),  # every token is padding
]
CASE_IDS = [
    f"T{c[0]}-q{c[1]}k{c[2]}-d{c[3]}-r{c[4]}-{'neox' if c[5] else 'gptj'}-bs{c[7]}-pad{c[8]}-{c[9]}-{c[10]}"
    for c in CASES
]


def _caches_like(phys: torch.Tensor, layout: str):
    if layout == "blocks_outer":
        return phys[:, 0], phys[:, 1]
    if layout == "hnd":
        kv = phys.permute(0, 1, 3, 2, 4)
        return kv[0], kv[1]
    return phys[0], phys[1]


def _setup(case, dtype):
    t, hq, hk, d, rd, neox, nb, bs, pad, layout, kvd = case
    cache_dtype = FP8 if kvd != "auto" else dtype
    qkv = torch.randn(t, (hq + 2 * hk) * d, device=DEVICE).to(dtype) * 2
    qw = (torch.rand(d, device=DEVICE) + 0.5).to(dtype)
    kw = (torch.rand(d, device=DEVICE) + 0.5).to(dtype)
    positions = torch.randint(0, MAX_POS, (t,), device=DEVICE)
    cs = make_cos_sin_cache(MAX_POS, rd, dtype=torch.float32 if dtype == torch.float32 else dtype)
    slots = make_slot_mapping(t, nb, bs, pad)
    phys, _, _ = make_kv_cache(nb, bs, hk, d, cache_dtype, layout)
    ks, vs = (fp8_scale(0.013), fp8_scale(0.011)) if kvd != "auto" else (None, None)
    return dict(qkv=qkv, qw=qw, kw=kw, positions=positions, cs=cs, slots=slots, phys=phys, ks=ks, vs=vs)


def _run(backend, case, s, qkv, phys):
    t, hq, hk, d, rd, neox, nb, bs, pad, layout, kvd = case
    q, k, v = split_qkv(qkv, hq, hk, d)  # strided views of one buffer
    kc, vc = _caches_like(phys, layout)
    rq, rk = FUSED_QK_NORM_ROPE_CACHE.run(
        backend, q, k, v, s["qw"], s["kw"], EPS, s["positions"], s["cs"], neox, kc, vc,
        s["slots"], kvd, s["ks"], s["vs"], rd,
    )
    assert rq is q and rk is k
    return kc, vc


@pytest.mark.parametrize("dtype_tol", [FP32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_triton_matches_reference(case, dtype_tol):
    dtype, atol, rtol = dtype_tol
    t, hq, hk, d, rd, neox, nb, bs, pad, layout, kvd = case
    s = _setup(case, dtype)
    got_qkv, want_qkv = s["qkv"].clone(), s["qkv"].clone()
    got_phys, want_phys = s["phys"].clone(), s["phys"].clone()
    gkc, gvc = _run("triton", case, s, got_qkv, got_phys)
    wkc, wvc = _run("torch", case, s, want_qkv, want_phys)

    # q and k normed + rotated in place (padding tokens too); v untouched.
    assert_close(got_qkv[:, : (hq + hk) * d], want_qkv[:, : (hq + hk) * d], atol, rtol)
    assert same_bytes(got_qkv[:, (hq + hk) * d:], s["qkv"][:, (hq + hk) * d:])
    written = written_mask(s["slots"], nb, bs)
    okc, ovc = _caches_like(s["phys"], layout)
    for got, want, old in ((gkc, wkc, okc), (gvc, wvc, ovc)):
        if kvd == "auto":
            assert_close(got[written], want[written], atol, rtol)
        else:
            # q/k may differ by the activation dtype's rounding before quantisation.
            assert_fp8_close(got[written], want[written], atol=atol / 0.011,
                             max_mismatch=0.02 if dtype == torch.float32 else 0.25)
        assert same_bytes(got[~written], old[~written])
    # The cache holds exactly the returned k (the same rounding): check against it directly.
    k_out = split_qkv(got_qkv, hq, hk, d)[1]
    valid = s["slots"] >= 0
    slot = s["slots"][valid]
    cached_k = gkc[slot // bs, slot % bs]
    if kvd == "auto":
        assert same_bytes(cached_k, k_out[valid])
    else:
        want_k8 = (k_out[valid].float() / s["ks"]).clamp(-448, 448).to(FP8)
        assert_fp8_close(cached_k, want_k8, max_mismatch=0.0)


@pytest.mark.parametrize("case", [CASES[1], CASES[2]], ids=[CASE_IDS[1], CASE_IDS[2]])
def test_reference_is_the_unfused_composition(case):
    """The torch reference equals running the three public ops' references in sequence."""
    t, hq, hk, d, rd, neox, nb, bs, pad, layout, kvd = case
    s = _setup(case, torch.bfloat16)
    fused_qkv, fused_phys = s["qkv"].clone(), s["phys"].clone()
    _run("torch", case, s, fused_qkv, fused_phys)

    seq_qkv, seq_phys = s["qkv"].clone(), s["phys"].clone()
    q, k, v = split_qkv(seq_qkv, hq, hk, d)
    q.copy_(RMS_NORM.run("torch", q, s["qw"], EPS))
    k.copy_(RMS_NORM.run("torch", k, s["kw"], EPS))
    ROTARY_EMBEDDING.run("torch", s["positions"], q, k, s["cs"], d, rd, neox)
    kc, vc = _caches_like(seq_phys, layout)
    RESHAPE_AND_CACHE.run("torch", k, v, kc, vc, s["slots"], kvd, s["ks"], s["vs"])
    assert same_bytes(fused_qkv, seq_qkv)
    assert same_bytes(fused_phys, seq_phys)


@pytest.mark.parametrize("case", [CASES[1], CASES[2]], ids=[CASE_IDS[1], CASE_IDS[2]])
def test_fused_triton_equals_unfused_triton(case):
    """Fusing does not change numerics: one kernel == rms_norm -> rotary -> cache (all Triton)."""
    t, hq, hk, d, rd, neox, nb, bs, pad, layout, kvd = case
    s = _setup(case, torch.bfloat16)
    fused_qkv, fused_phys = s["qkv"].clone(), s["phys"].clone()
    _run("triton", case, s, fused_qkv, fused_phys)

    seq_qkv, seq_phys = s["qkv"].clone(), s["phys"].clone()
    q, k, v = split_qkv(seq_qkv, hq, hk, d)
    RMS_NORM.run("triton", q, s["qw"], EPS, out=q)
    RMS_NORM.run("triton", k, s["kw"], EPS, out=k)
    ROTARY_EMBEDDING.run("triton", s["positions"], q, k, s["cs"], d, rd, neox)
    kc, vc = _caches_like(seq_phys, layout)
    RESHAPE_AND_CACHE.run("triton", k, v, kc, vc, s["slots"], kvd, s["ks"], s["vs"])
    # Same roundings in the same places; fp32 op order may differ by an ulp before rounding.
    assert_close(fused_qkv, seq_qkv, 1e-2, 1e-2)
    mismatch = (fused_qkv != seq_qkv).float().mean().item()
    assert mismatch < 0.02, mismatch


@pytest.mark.parametrize("case", [CASES[1], CASES[2]], ids=[CASE_IDS[1], CASE_IDS[2]])
def test_aiter_path_composes_the_three_aiter_step_bindings(case, monkeypatch):
    """The AITER backend (ROCm only) is rms_norm(q), rms_norm(k), rotary, cache write through
    each step op's AITER binding. Here each step's ``run`` records the backend asked for and runs
    its reference, so the composition (norm into strided views, rotary dims, cache) is checked
    against the fused reference on this machine; the bindings themselves need ROCm."""
    mod = importlib.import_module("atom.ops.fused_qk_norm_rope_cache")
    from atom.ops._dispatch import Op

    calls = []
    for op in (RMS_NORM, ROTARY_EMBEDDING, RESHAPE_AND_CACHE):
        def run(backend, *args, _op=op, **kwargs):
            calls.append((_op.name, backend))
            return Op.run(_op, "torch", *args, **kwargs)
        monkeypatch.setattr(op, "run", run)

    t, hq, hk, d, rd, neox, nb, bs, pad, layout, kvd = case
    s = _setup(case, torch.bfloat16)
    got_qkv, got_phys = s["qkv"].clone(), s["phys"].clone()
    q, k, v = split_qkv(got_qkv, hq, hk, d)
    kc, vc = _caches_like(got_phys, layout)
    rq, rk = mod._fused_aiter(q, k, v, s["qw"], s["kw"], EPS, s["positions"], s["cs"], neox, kc, vc,
                              s["slots"], kvd, s["ks"], s["vs"], rd)
    assert rq is q and rk is k
    assert calls == [("rms_norm", "aiter"), ("rms_norm", "aiter"), ("rotary_embedding", "aiter"),
                     ("reshape_and_cache", "aiter")]
    want_qkv, want_phys = s["qkv"].clone(), s["phys"].clone()
    _run("torch", case, s, want_qkv, want_phys)
    assert same_bytes(got_qkv, want_qkv)
    assert same_bytes(got_phys, want_phys)
    # Off ROCm the binding declines with the dispatcher's reason (auto then picks Triton/torch).
    monkeypatch.undo()
    why = mod._fused_aiter_supports(q, k, v, s["qw"], s["kw"], EPS, s["positions"], s["cs"], neox, kc, vc,
                                    s["slots"], kvd, s["ks"], s["vs"], rd)
    assert why is not None and "aiter" in why


def test_separate_noncontiguous_tensors():
    """q/k/v need not share a buffer: each a strided view of its own wider tensor."""
    dtype, atol, rtol = FP32
    t, hq, hk, d = 7, 4, 2, 64
    q = torch.randn(t, hq, 2 * d, device=DEVICE)[..., :d]
    k = torch.randn(t, 2 * hk, d, device=DEVICE)[:, 1::2]
    v = torch.randn(t, hk, d + 32, device=DEVICE)[..., 32:]
    qw, kw = torch.rand(d, device=DEVICE) + 0.5, torch.rand(d, device=DEVICE) + 0.5
    positions = torch.randint(0, MAX_POS, (t,), device=DEVICE)
    cs = make_cos_sin_cache(MAX_POS, d)
    slots = make_slot_mapping(t, 4, 4, 1)
    phys, _, _ = make_kv_cache(4, 4, hk, d, torch.float32, "nhd")
    out = {}
    for backend in ("triton", "torch"):
        qq, kk, pp = q.clone(), k.clone(), phys.clone()
        FUSED_QK_NORM_ROPE_CACHE.run(backend, qq, kk, v, qw, kw, EPS, positions, cs, True, pp[0], pp[1], slots)
        out[backend] = (qq, kk, pp)
    for got, want in zip(out["triton"], out["torch"]):
        assert_close(got, want, atol, rtol)


def test_validation_errors():
    t, hq, hk, d = 3, 2, 1, 64
    qkv = torch.randn(t, (hq + 2 * hk) * d, device=DEVICE)
    q, k, v = split_qkv(qkv, hq, hk, d)
    w = torch.ones(d, device=DEVICE)
    pos = torch.zeros(t, dtype=torch.int64, device=DEVICE)
    cs = make_cos_sin_cache(8, d)
    _, kc, vc = make_kv_cache(2, 4, hk, d, torch.float32, "nhd")
    slots = torch.tensor([0, 1, 2], device=DEVICE)
    for backend in ("torch", "triton"):
        run = FUSED_QK_NORM_ROPE_CACHE.run
        with pytest.raises(ValueError, match="q_norm_weight"):
            run(backend, q, k, v, w[:-1], w, EPS, pos, cs, True, kc, vc, slots)
        with pytest.raises(ValueError, match="cos_sin_cache"):
            run(backend, q, k, v, w, w, EPS, pos, cs, True, kc, vc, slots, rotary_dim=32)
        with pytest.raises(ValueError, match="value_cache|key_cache"):
            run(backend, q, k, v, w, w, EPS, pos, cs, True, kc[:, :, :, :32], vc, slots)
        with pytest.raises(ValueError, match="fp8"):
            run(backend, q, k, v, w, w, EPS, pos, cs, True, kc, vc, slots, "fp8")
