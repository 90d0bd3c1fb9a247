"""The memory-bound ops behind the dispatcher: registration, ATOM_OPS_BACKEND forcing, AITER
unavailability, import purity, GPU compilation of every launch config, the benchmark's CLI."""

from __future__ import annotations

import json
import os

import pytest
import torch

import atom.ops as ops
from atom.ops import OPS, BackendUnavailable
from tests.conftest import REPO, run_python
from tests.ops._helpers import DEVICE, assert_close, make_cos_sin_cache, make_kv_cache

MEMORY_OPS = (
    "rms_norm", "rotary_embedding", "reshape_and_cache", "fused_qk_norm_rope_cache",
    "silu_and_mul", "per_token_quant_fp8", "per_block_quant_fp8",
)


def _example_calls():
    """One small valid call per op: ``name -> (public function, args, kwargs)``."""
    x = torch.randn(3, 96, device=DEVICE)
    w = torch.rand(96, device=DEVICE) + 0.5
    qkv = torch.randn(3, (2 + 2) * 64, device=DEVICE)
    q, k, v = ops.split_qkv(qkv, 2, 1, 64)
    pos = torch.arange(3, device=DEVICE)
    cs = make_cos_sin_cache(8, 64)
    _, kc, vc = make_kv_cache(2, 4, 1, 64, torch.float32, "nhd")
    slots = torch.tensor([5, -1, 0], device=DEVICE)
    w64 = torch.rand(64, device=DEVICE) + 0.5
    return {
        "rms_norm": (ops.rms_norm, (x, w, 1e-6), {}),
        "rotary_embedding": (ops.rotary_embedding, (pos, q, k, cs, 64, 64, True), {}),
        "reshape_and_cache": (ops.reshape_and_cache, (k, v, kc, vc, slots), {}),
        "fused_qk_norm_rope_cache": (
            ops.fused_qk_norm_rope_cache, (q, k, v, w64, w64, 1e-6, pos, cs, True, kc, vc, slots), {}),
        "silu_and_mul": (ops.silu_and_mul, (x,), {}),
        "per_token_quant_fp8": (ops.per_token_quant_fp8, (x,), {}),
        "per_block_quant_fp8": (ops.per_block_quant_fp8, (x, 64), {}),
    }


def test_all_ops_registered_with_three_backends_declared():
    for name in MEMORY_OPS:
        op = OPS[name]
        assert op.torch_impl is not None and op.triton_impl is not None, name
        assert name in ops.__all__ and callable(getattr(ops, name)), name
    assert [n for n in MEMORY_OPS if OPS[n].aiter_impl is None] == []


@pytest.mark.parametrize("name", MEMORY_OPS)
def test_forcing_each_backend(monkeypatch, name):
    """ATOM_OPS_BACKEND=triton / =torch / per-op pairs route the public function's call."""
    fn, args, kwargs = _example_calls()[name]
    op = OPS[name]
    seen = []
    for backend in ("torch", "triton"):
        impl = op._impls[backend]
        spy = lambda *a, _impl=impl, _b=backend, **k: seen.append(_b) or _impl(*a, **k)  # noqa: E731
        monkeypatch.setitem(op._impls, backend, spy)
    monkeypatch.setenv("ATOM_OPS_BACKEND", "triton")
    assert op.backend_for(*args, **kwargs)[0] == "triton"
    fn(*args, **kwargs)
    monkeypatch.setenv("ATOM_OPS_BACKEND", f"{name}=torch,some_other_op=triton")
    assert op.backend_for(*args, **kwargs) == ("torch", "forced by ATOM_OPS_BACKEND=torch")
    fn(*args, **kwargs)
    monkeypatch.setenv("ATOM_OPS_BACKEND", f"triton,{name}=torch")  # per-op wins over global
    fn(*args, **kwargs)
    assert seen == ["triton", "torch", "torch"]


@pytest.mark.parametrize("name", MEMORY_OPS)
def test_forcing_aiter_here_raises_clearly(monkeypatch, name):
    fn, args, kwargs = _example_calls()[name]
    monkeypatch.setenv("ATOM_OPS_BACKEND", "aiter")
    with pytest.raises(BackendUnavailable) as info:
        fn(*args, **kwargs)
    msg = str(info.value)
    assert f"forces aiter for op {name}" in msg
    assert "aiter is not installed or torch is not a ROCm build" in msg


def test_auto_uses_triton_where_it_can_run(monkeypatch):
    fn, args, kwargs = _example_calls()["rms_norm"]
    monkeypatch.delenv("ATOM_OPS_BACKEND", raising=False)
    backend, why = OPS["rms_norm"].backend_for(*args, **kwargs)
    if DEVICE.type == "cuda":
        assert backend == "triton" and "not aiter" in why
    else:
        # auto never picks the (slow) interpreter over the torch reference on CPU tensors...
        assert backend == "torch" and "tensors are on cpu" in why
        # ...but forcing Triton runs it under TRITON_INTERPRET=1 (the kernel tests rely on it)
        monkeypatch.setenv("ATOM_OPS_BACKEND", "rms_norm=triton")
        assert OPS["rms_norm"].backend_for(*args, **kwargs)[0] == "triton"


def test_auto_falls_back_when_triton_cannot_run_the_layout(monkeypatch):
    """A q with a strided last dim cannot be rotated in place by the kernel: auto -> torch."""
    pos = torch.arange(3, device=DEVICE)
    cs = make_cos_sin_cache(8, 64)
    q = torch.randn(3, 2, 64, 2, device=DEVICE)[..., 0]  # last-dim stride 2
    k = torch.randn(3, 1, 64, device=DEVICE)
    want_q, want_k = q.clone(), k.clone()
    OPS["rotary_embedding"].run("torch", pos, want_q, want_k, cs, 64, 64, True)
    monkeypatch.delenv("ATOM_OPS_BACKEND", raising=False)
    backend, why = OPS["rotary_embedding"].backend_for(pos, q, k, cs, 64, 64, True)
    assert backend == "torch" and ("stride" in why or DEVICE.type == "cpu")
    ops.rotary_embedding(pos, q, k, cs, 64, 64, True)
    assert_close(q, want_q, 0, 0)
    monkeypatch.setenv("ATOM_OPS_BACKEND", "rotary_embedding=triton")
    with pytest.raises(BackendUnavailable, match="stride"):
        ops.rotary_embedding(pos, q, k, cs, 64, 64, True)


def test_importing_atom_ops_imports_neither_vllm_nor_triton():
    proc = run_python("""
        import sys
        import atom.ops
        from atom.ops import rms_norm, fused_qk_norm_rope_cache, per_block_quant_fp8
        print("VLLM", any(m == "vllm" or m.startswith("vllm.") for m in sys.modules))
        print("ATOM_TRITON", sorted(m for m in sys.modules if m.startswith("atom.ops.") and m.endswith("_triton")))
    """)
    assert proc.returncode == 0, proc.stderr
    assert "VLLM False" in proc.stdout and "ATOM_TRITON []" in proc.stdout, proc.stdout


def test_every_launch_config_compiles_for_sm90_with_vector_access():
    """Compile (not run) every kernel launch the ops make at Qwen3-8B sizes for an H100 target:
    catches what the interpreter accepts but the GPU compiler rejects, and unvectorised code."""
    env = {"TRITON_INTERPRET": None, "TRITON_DEFAULT_FP_FUSION": "1"}
    proc = run_python("from tests.ops._aot_compile import main; raise SystemExit(main())", env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    launches = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    kernels = {launch["kernel"] for launch in launches}
    assert kernels == {
        "_rms_norm_kernel", "_qk_norm_rope_cache_kernel", "_reshape_and_cache_kernel",
        "_silu_and_mul_kernel", "_per_token_quant_kernel", "_per_block_quant_kernel",
    }
    for launch in launches:
        # Activations (bf16, 128-wide heads, 4096-wide rows) move in 16-byte vectors.
        assert launch["loads"].get("ld.global.v4.b32", 0) > 0, launch
        assert launch["stores"].get("st.global.v4.b32", 0) > 0, launch


def test_benchmark_script_imports_and_shows_help_on_cpu():
    """Importing the script runs nothing (it only defines the shape tables); --help works."""
    script = str(REPO / "bench" / "ops_memory.py")
    proc = run_python(f"""
        import contextlib, io, runpy, sys
        g = runpy.run_path({script!r})
        print(sorted(g["MODELS"]), g["TOKENS"])
        sys.argv = ["ops_memory.py", "--help"]
        try:
            runpy.run_path({script!r}, run_name="__main__")
        except SystemExit as exc:
            print("EXIT", exc.code)
    """, env={"TRITON_INTERPRET": None})
    assert proc.returncode == 0, proc.stderr
    assert "Qwen3-8B" in proc.stdout and "[32, 256, 4096, 16384]" in proc.stdout
    assert "--json" in proc.stdout and "EXIT 0" in proc.stdout


def test_tests_run_with_interpreter_or_gpu():
    assert DEVICE.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
