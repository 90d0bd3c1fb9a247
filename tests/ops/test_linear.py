"""atom.ops.linear (float weights): the Triton GEMV for one token against ``F.linear``, batches
left to the reference, the load-time warm-up, and atom's linears calling it only with
ATOM_BF16_GEMV=1. On CPU under the Triton interpreter; a real shape on a GPU (``gpu``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from atom import ops
from atom.ops import linear
from tests.ops._helpers import DEVICE


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("n,k,bias", [(200, 300, True), (16, 1100, False), (72, 64, True)])
def test_gemv_matches_reference(n, k, bias, dtype):
    """Odd N and K, K below / above the GEMV's K tile, a grid small enough for split-K."""
    w = torch.randn(n, k, device=DEVICE).to(dtype)
    x = torch.randn(1, k, device=DEVICE).to(dtype)
    b = torch.randn(n, device=DEVICE).to(dtype) if bias else None
    want = F.linear(x.float(), w.float(), None if b is None else b.float())
    got = linear.run("triton", x, w, b)
    assert got.dtype == dtype and got.shape == (1, n)
    torch.testing.assert_close(got.float(), want, atol=2e-2 * want.abs().max().item(), rtol=2e-2)


def test_only_one_token_takes_the_gemv():
    from atom.ops.linear import _triton_supports

    w = torch.randn(64, 32, device=DEVICE).to(torch.bfloat16)
    assert _triton_supports(torch.randn(1, 32, device=DEVICE).to(torch.bfloat16), w) is None
    assert "single row" in _triton_supports(torch.randn(2, 32, device=DEVICE).to(torch.bfloat16), w)
    assert "dtype" in _triton_supports(torch.randn(1, 32, device=DEVICE), w)
    assert "unit-stride" in _triton_supports(torch.randn(1, 64, device=DEVICE).to(torch.bfloat16)[:, ::2], w)
    x = torch.randn(3, 32, device=DEVICE).to(torch.bfloat16)
    torch.testing.assert_close(ops.linear(x, w), F.linear(x, w))  # a batch: the reference, any backend


def test_warm_up_once_per_shape():
    w = torch.randn(40, 96).to(torch.bfloat16)
    assert ops.warm_up_linear(w) == 0  # CPU: the op runs the reference, nothing to compile
    assert ops.warm_up_linear(w, force=True) == 1
    assert ops.warm_up_linear(w, force=True) == 0
    assert ops.warm_up_linear(w.float(), force=True) == 0  # fp32 weights never take the GEMV


def test_warm_up_times_on_the_weights_device(monkeypatch):
    """The warm-up's timer is given the weight's device (on a GPU it syncs there: atom.ops._warm)."""
    from atom.ops import _warm

    seen = []
    monkeypatch.setattr(_warm, "_synchronize", seen.append)
    w = torch.randn(24, 80).to(torch.bfloat16)
    assert ops.warm_up_linear(w, force=True) == 1
    assert seen == [w.device, w.device]


@pytest.mark.parametrize("enabled", [False, True])
def test_atom_linears_call_it_only_when_enabled(monkeypatch, enabled):
    """ATOM_BF16_GEMV=1: a bf16 layer routes through ops.linear after loading (and warms it up);
    =0, or an fp32 layer: F.linear as before. Same numbers either way."""
    from atom.models import _linear
    from atom.models._linear import ColumnParallelLinear, RowParallelLinear
    from atom.models.interfaces import ModelParallel

    monkeypatch.setenv("ATOM_BF16_GEMV", "1" if enabled else "0")
    calls, warm, real = [], [], ops.linear
    monkeypatch.setattr(_linear.ops, "linear", lambda *a: calls.append(a[0].shape) or real(*a))
    monkeypatch.setattr(_linear.ops, "warm_up_linear", lambda w, has_bias=False: warm.append((w.shape, has_bias)) or 0)
    col = ColumnParallelLinear.merged(32, [24], ModelParallel(), bias=True, dtype=torch.bfloat16)
    row = RowParallelLinear(24, 32, ModelParallel(), dtype=torch.float32)
    torch.nn.init.normal_(col.bias)
    for layer in (col, row):
        torch.nn.init.normal_(layer.weight)
        layer.process_weights_after_loading()
    assert col.bf16_gemv is enabled and row.bf16_gemv is False
    assert warm == ([(torch.Size([24, 32]), True)] if enabled else [])
    x = torch.randn(1, 1, 32).to(torch.bfloat16)
    torch.testing.assert_close(col(x).float(), F.linear(x, col.weight, col.bias).float())
    assert calls == ([torch.Size([1, 32])] if enabled else [])


def test_default_on_nvidia_gpus_only(monkeypatch):
    """ATOM_BF16_GEMV unset: on for bf16 / fp16 weights on an NVIDIA GPU (where it was measured),
    off on a CPU or ROCm; set, it decides everywhere; fp32 weights never."""
    from atom.models import _linear

    w = torch.zeros(8, 16, dtype=torch.bfloat16)
    monkeypatch.delenv("ATOM_BF16_GEMV", raising=False)
    assert not _linear.bf16_gemv_on(w)  # a CPU tensor
    monkeypatch.setattr(_linear, "nvidia_gpu", lambda t: True)
    assert _linear.bf16_gemv_on(w) and _linear.bf16_gemv_on(w.half())
    assert not _linear.bf16_gemv_on(w.float())
    monkeypatch.setenv("ATOM_BF16_GEMV", "0")
    assert not _linear.bf16_gemv_on(w)
    monkeypatch.setattr(_linear, "nvidia_gpu", lambda t: False)
    monkeypatch.setenv("ATOM_BF16_GEMV", "1")
    assert _linear.bf16_gemv_on(w)


def test_nvidia_gpu_is_cuda_without_hip(monkeypatch):
    """The one "NVIDIA GPU?" answer of atom's kernels (a tensor's device, or this process): CUDA
    and not ROCm's HIP (whose torch also says ``cuda``)."""
    from types import SimpleNamespace

    from atom.ops._common import nvidia_gpu

    cuda = SimpleNamespace(is_cuda=True)
    assert not nvidia_gpu(torch.zeros(1)) and nvidia_gpu(cuda) == (getattr(torch.version, "hip", None) is None)
    monkeypatch.setattr(torch.version, "hip", "6.4", raising=False)
    assert not nvidia_gpu(cuda)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert not nvidia_gpu()
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    assert nvidia_gpu() and nvidia_gpu(cuda)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_real_shape():
    w = torch.randn(6144, 4096, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    want = F.linear(x.float(), w.float())
    torch.testing.assert_close(ops.linear(x, w).float(), want, atol=1e-2 * want.abs().max().item(), rtol=1e-2)


def test_traced_as_one_graph_node():
    """Under torch.compile the call is one ``torch.ops.atom.linear`` node (its fake gives the
    output shape for any batch), with the reference's numbers."""
    w = torch.randn(24, 32).to(torch.bfloat16)
    seen = []

    def backend(gm, inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm

    fn = torch.compile(lambda x: ops.linear(x, w) * 2, backend=backend, fullgraph=True, dynamic=True)
    for m in (1, 5):
        x = torch.randn(m, 32).to(torch.bfloat16)
        torch.testing.assert_close(fn(x), F.linear(x, w) * 2)
    assert "atom.linear" in seen and "aten" not in " ".join(seen)


def test_graph_node_sends_only_single_rows_to_the_dispatcher(monkeypatch):
    """Outside CUDA graphs the ``torch.ops.atom.linear`` node runs once per linear layer and step
    (bench/NOTES.md entries 46-47): rows other than one (the GEMV's only case) go straight to
    ``F.linear``; a single row goes through atom's dispatcher, as in eager mode."""
    import atom.ops._graph  # noqa: F401 - registers the nodes

    calls = []
    op_type = type(linear)  # atom's Op: the dispatcher's entry
    real = op_type.__call__
    monkeypatch.setattr(op_type, "__call__", lambda self, *a, **k: calls.append(self.name) or real(self, *a, **k))
    w = torch.randn(24, 32).to(torch.bfloat16)
    b = torch.randn(24).to(torch.bfloat16)
    for m in (5, 64):
        x = torch.randn(m, 32).to(torch.bfloat16)
        torch.testing.assert_close(torch.ops.atom.linear(x, w, b), F.linear(x, w, b))
    assert calls == []
    x = torch.randn(1, 32).to(torch.bfloat16)
    torch.testing.assert_close(torch.ops.atom.linear(x, w, b), F.linear(x, w, b))
    assert calls == ["linear"]


def test_graph_nodes_are_library_ops_without_custom_op_wrappers():
    """atom's nodes are declared as vLLM declares its own ops (``Library.define`` + ``impl`` + a
    fake), not through ``torch.library.custom_op``, whose Python wrapper costs ~2x the call's host
    time outside CUDA graphs (bench/NOTES.md entry 47); the schemas still say what each writes."""
    from torch._library.custom_ops import _maybe_get_opdef

    from atom.ops import _graph

    names = [v.qualname.split("::")[1] for v in vars(_graph).values() if isinstance(v, _graph._Node)]
    assert {"linear", "rms_norm", "rotary_embedding", "fused_moe", "fp8_block_gemm"} <= set(names)
    for name in names:
        assert _maybe_get_opdef(f"atom::{name}") is None, name
        assert getattr(torch.ops.atom, name).default._schema.name == f"atom::{name}"
    schema = torch.ops.atom.rotary_embedding.default._schema
    assert [a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write] == ["query", "key"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (Triton's compile caches)")
def test_gpu_no_compile_after_warm_up():
    from atom.ops import fp8_gemm_triton as gt
    from tests.ops.test_warm_up import _compiled

    for bias in (False, True):
        w = torch.randn(4096, 12288, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(4096, device="cuda", dtype=torch.bfloat16) if bias else None
        ops.warm_up_linear(w, has_bias=bias)
        before = _compiled(gt._gemv_kernel)
        ops.linear(torch.randn(1, 12288, device="cuda", dtype=torch.bfloat16), w, b)
        torch.cuda.synchronize()
        assert _compiled(gt._gemv_kernel) == before
