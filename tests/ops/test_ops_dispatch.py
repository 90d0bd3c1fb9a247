"""The memory-bound ops behind the dispatcher: registration, ATOM_OPS_BACKEND forcing, AITER
unavailability, import purity, GPU compilation of every launch config, the benchmark's CLI."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

import atom.ops as ops
from atom import envs
from atom.ops import OPS, BackendUnavailable, Op
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
        assert op.impl("torch") is op.reference and op.impl("triton") is not None, name
        assert name in ops.__all__ and callable(getattr(ops, name)), name
    assert [n for n in MEMORY_OPS if OPS[n].impl("aiter") is None] == []


@pytest.mark.parametrize("name", MEMORY_OPS)
def test_forcing_each_backend(monkeypatch, name):
    """ATOM_OPS_BACKEND=triton / =torch / per-op pairs route the public function's call."""
    fn, args, kwargs = _example_calls()[name]
    op = OPS[name]
    seen = []
    for backend in ("torch", "triton"):
        impl = op.impl(backend)
        spy = lambda *a, _impl=impl, _b=backend, **k: seen.append(_b) or _impl(*a, **k)  # noqa: E731
        monkeypatch.setitem(op._backends, backend, dataclasses.replace(op._backends[backend], impl=spy))
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


class _CountingEnvVar:
    """Stands in for ATOM_OPS_BACKEND's declaration and counts how often it is read and parsed."""

    def __init__(self, var, counts):
        self.var, self.counts = var, counts

    def read(self, environ=None):
        self.counts["env_reads"] += 1
        return self.var.read(environ)


def _count_choices(monkeypatch, op):
    """From here on, count ATOM_OPS_BACKEND reads, argument-independent checks (package
    availability, device, dtype) and runs of the Triton backend's per-call ``supports``."""
    counts = {"env_reads": 0, "static_checks": 0, "supports": 0}
    monkeypatch.setattr(op, "_plans", {})  # nothing cached from earlier tests
    monkeypatch.setitem(envs.VARIABLES, "ATOM_OPS_BACKEND",
                        _CountingEnvVar(envs.VARIABLES["ATOM_OPS_BACKEND"], counts))
    static = Op._static_why_not

    def counted_static(self, *args, **kwargs):
        counts["static_checks"] += 1
        return static(self, *args, **kwargs)

    monkeypatch.setattr(Op, "_static_why_not", counted_static)
    triton = op._backends["triton"]

    def counted_supports(*args, **kwargs):
        counts["supports"] += 1
        return triton.supports(*args, **kwargs)

    monkeypatch.setitem(op._backends, "triton", dataclasses.replace(triton, supports=counted_supports))
    return counts


def test_backend_choice_is_cached_per_device_dtype_and_environment(monkeypatch):
    """A repeated call neither reads ATOM_OPS_BACKEND nor re-checks what does not depend on its
    arguments; the per-call check runs every time; a new dtype or a changed ATOM_OPS_BACKEND /
    TRITON_INTERPRET is a new choice, made on the next call."""
    op = OPS["rms_norm"]
    counts = _count_choices(monkeypatch, op)
    x, w = torch.randn(3, 96, device=DEVICE), torch.rand(96, device=DEVICE) + 0.5
    monkeypatch.setenv("ATOM_OPS_BACKEND", "rms_norm=triton")
    ops.rms_norm(x, w, 1e-6)
    assert counts == {"env_reads": 1, "static_checks": 1, "supports": 1}
    for _ in range(3):
        ops.rms_norm(x, w, 1e-6)
    assert counts == {"env_reads": 1, "static_checks": 1, "supports": 4}
    ops.rms_norm(x.bfloat16(), w.bfloat16(), 1e-6)  # another dtype: another cached choice
    assert counts == {"env_reads": 2, "static_checks": 2, "supports": 5}

    monkeypatch.setenv("ATOM_OPS_BACKEND", "rms_norm=torch")  # takes effect on the next call
    assert op.backend_for(x, w, 1e-6) == ("torch", "forced by ATOM_OPS_BACKEND=torch")
    ops.rms_norm(x, w, 1e-6)
    assert counts["supports"] == 5  # torch has no per-call check
    monkeypatch.setenv("ATOM_OPS_BACKEND", "rms_norm=triton")  # back: the first choice, still cached
    ops.rms_norm(x, w, 1e-6)
    assert counts == {"env_reads": 3, "static_checks": 3, "supports": 6}
    if DEVICE.type == "cpu":
        # Triton on CPU tensors only runs interpreted: TRITON_INTERPRET is part of the choice.
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        with pytest.raises(BackendUnavailable, match="TRITON_INTERPRET=1"):
            ops.rms_norm(x, w, 1e-6)
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        ops.rms_norm(x, w, 1e-6)
    monkeypatch.delenv("ATOM_OPS_BACKEND")
    want = "triton" if DEVICE.type == "cuda" else "torch"
    assert op.backend_for(x, w, 1e-6)[0] == want


def test_argument_checks_still_decide_with_a_cached_choice(monkeypatch):
    """Shape- and stride-dependent limits (the attention kernel's head size, an output the
    kernel cannot address) are checked on every call, after the cached part of the choice."""
    monkeypatch.setenv("ATOM_OPS_BACKEND", "triton")
    x, w = torch.randn(3, 96, device=DEVICE), torch.rand(96, device=DEVICE) + 0.5
    ops.rms_norm(x, w, 1e-6)
    strided_out = torch.empty(3, 192, device=DEVICE)[:, ::2]
    with pytest.raises(BackendUnavailable, match="out cannot be viewed"):
        ops.rms_norm(x, w, 1e-6, out=strided_out)

    def attention_args(head_size):
        q = torch.randn(2, 2, head_size, device=DEVICE)
        cache = torch.randn(4, 16, 1, head_size, device=DEVICE)
        block_table = torch.zeros(2, 1, dtype=torch.int32, device=DEVICE)
        seq_lens = torch.tensor([1, 1], dtype=torch.int32, device=DEVICE)
        query_start_loc = torch.tensor([0, 1, 2], dtype=torch.int32, device=DEVICE)
        return q, cache, cache.clone(), block_table, seq_lens, query_start_loc, 1, 1, 1.0

    assert ops.paged_attention.backend_for(*attention_args(64))[0] == "triton"
    with pytest.raises(BackendUnavailable, match="head_size 512 > 256"):
        ops.paged_attention(*attention_args(512))
    monkeypatch.delenv("ATOM_OPS_BACKEND")
    backend, why = ops.paged_attention.backend_for(*attention_args(512))
    assert backend == "torch" and (DEVICE.type == "cpu" or "head_size 512 > 256" in why)


def test_backends_are_checked_against_the_ops_signature_at_registration():
    """Everything registered against an op takes the op's arguments: the same parameters, or a
    leading part of them with *args / **kwargs taking the rest."""

    def reference(x, weight, eps=1e-6, *, out=None):
        return x

    op = Op("signature_check_only", reference)  # not in OPS
    with pytest.raises(TypeError, match="'eps' defaults to 1e-05, the op's to 1e-06"):
        op.triton(lambda x, weight, eps=1e-5, *, out=None: x)
    with pytest.raises(TypeError, match="positional parameters"):
        op.triton(lambda weight, x, eps=1e-6, *, out=None: x)
    with pytest.raises(TypeError, match="'scale' is not a parameter of the op"):
        op.aiter(lambda x, weight, eps=1e-6, *, out=None, scale=None: x)
    with pytest.raises(TypeError, match="does not take the op's parameter 'out'"):
        op.aiter(lambda x, weight, eps=1e-6: x)
    with pytest.raises(TypeError, match="'weight' is keyword-only, the op's is positional or keyword"):
        op.graph(lambda x, *, weight, eps=1e-6, out=None: x)
    with pytest.raises(TypeError, match="supports predicate"):
        op.triton(lambda x, weight, eps=1e-6, *, out=None: x, supports=lambda x, *args: None)
    assert op.impl("triton") is None and op.impl("aiter") is None and op.graph_form is None
    op.triton(lambda x, weight, eps=1e-6, *, out=None: x, supports=lambda x, *args, out=None, **kw: None)
    op.aiter(lambda x, *args, **kwargs: x)
    assert op.impl("triton") is not None and op.impl("aiter") is not None


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
