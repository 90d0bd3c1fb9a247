"""atom's conventions match vLLM's: the ops against vLLM's own CPU kernels (vllm._custom_ops),
and the benchmark's case builder exercised end to end on CPU at toy shapes."""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch

import atom.ops as ops
from atom.ops import OPS
from tests.conftest import REPO
from tests.ops._helpers import BF16, FP32, assert_close, make_cos_sin_cache



def _vllm():
    import vllm._custom_ops as custom_ops  # CPU build: rms_norm, fused_add, rotary, silu_and_mul

    return custom_ops


BACKENDS = ["torch", "triton"]
EPS = 1e-6


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype_tol", [FP32, BF16], ids=["fp32", "bf16"])
def test_rms_norm_and_fused_add_match_vllm(backend, dtype_tol):
    dtype, atol, rtol = dtype_tol
    v = _vllm()
    x = torch.randn(7, 160).to(dtype)
    r = torch.randn(7, 160).to(dtype)
    w = (torch.rand(160) + 0.5).to(dtype)
    want = torch.empty_like(x)
    v.rms_norm(want, x, w, EPS)
    assert_close(OPS["rms_norm"].run(backend, x, w, EPS), want, atol, rtol)
    xv, rv = x.clone(), r.clone()
    v.fused_add_rms_norm(xv, rv, w, EPS)  # in place: x <- norm(x + r), r <- x + r
    got_y, got_r = OPS["rms_norm"].run(backend, x, w, EPS, r)
    assert_close(got_r, rv, atol, rtol)
    assert_close(got_y, xv, atol, rtol)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize("rotary_dim", [64, 32])
def test_rotary_embedding_matches_vllm(backend, neox, rotary_dim):
    """Same cos_sin_cache layout, pairing styles and partial rotary as vLLM's kernel."""
    v = _vllm()
    t, hq, hk, d = 7, 4, 2, 64
    cs = make_cos_sin_cache(100, rotary_dim).cpu()
    pos = torch.randint(0, 100, (t,))
    qkv = torch.randn(t, (hq + 2 * hk) * d)
    mine, theirs = qkv.clone(), qkv.clone()
    q, k, _ = ops.split_qkv(mine, hq, hk, d)
    OPS["rotary_embedding"].run(backend, pos, q, k, cs, d, rotary_dim, neox)
    v.rotary_embedding(pos, theirs[:, : hq * d], theirs[:, hq * d: (hq + hk) * d], d, cs, neox)
    assert_close(mine, theirs, 1e-5, 1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype_tol", [FP32, BF16], ids=["fp32", "bf16"])
def test_silu_and_mul_matches_vllm(backend, dtype_tol):
    dtype, atol, rtol = dtype_tol
    x = (torch.randn(7, 2 * 160) * 3).to(dtype)
    want = torch.empty(7, 160, dtype=dtype)
    _vllm()
    torch.ops._C.silu_and_mul(want, x)
    assert_close(OPS["silu_and_mul"].run(backend, x), want, atol, rtol)


def _load_bench():
    spec = importlib.util.spec_from_file_location("atom_bench_ops_memory", REPO / "bench" / "ops_memory.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses resolve their module through sys.modules
    spec.loader.exec_module(mod)
    return mod


def test_benchmark_cases_run_on_cpu_at_toy_shapes():
    """Every benchmark case's atom / torch / check callables run (Triton through the
    interpreter), and atom agrees with the reference; vLLM callables that exist on this
    build run too (the CUDA-only ones report an error row in the real benchmark)."""
    bench = _load_bench()
    toy = bench.Model(hidden=128, q_heads=4, kv_heads=2, head_dim=32, ffn_rows_per_token=2, ffn_dim=48)
    cases = bench.build_cases("toy", toy, 5, torch.float32, _vllm(), set(), device="cpu")
    assert {c.op for c in cases} == set(bench.OP_NAMES)
    ran_vllm = set()
    for case in cases:
        case.atom()
        case.torch_ref()
        assert case.bytes > 0
        diff = case.check()
        assert diff <= (1.0 if "fp8" in case.op else 1e-4), (case.op, diff)
        for label, fn in case.vllm.items():
            try:
                fn()
                ran_vllm.add(label)
            except Exception:  # noqa: BLE001 -- the benchmark records these as error rows
                pass  # CUDA-only kernels
    assert {"vllm rms_norm", "vllm fused_add_rms_norm", "vllm rotary_embedding", "vllm silu_and_mul"} <= ran_vllm
