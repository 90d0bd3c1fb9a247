"""What atom's elementwise ops become while torch.compile traces (``Op.inductor_form``).

``ATOM_COMPILE_ELEMENTWISE=inductor`` (default): RMSNorm (with / without residual, fp8 output),
RoPE (in place) and SiLU-and-mul are traced as plain torch, so the FX graph Dynamo hands to the
backend has no ``torch.ops.atom.*`` node for them and Inductor can fuse them with their
neighbours. ``=kernels``: each is one ``torch.ops.atom.<name>`` node (``atom.ops._graph``).
Either way the compiled function computes the torch reference's numbers.

The graphs are recorded by a backend that keeps Dynamo's FX graph and runs it as it is (CPU,
real Dynamo, no vLLM); one test per form compiles with Inductor on CPU. A GPU-marked test compares
Inductor's code on CUDA with atom's Triton kernels.
"""

from __future__ import annotations

import pytest
import torch

from atom import envs, ops
from atom.ops._common import FP8_DTYPE
from tests.ops._helpers import assert_close, assert_fp8_close, make_cos_sin_cache, same_bytes

CPU = torch.device("cpu")
T, H, D = 7, 3, 32  # tokens, heads, head size (odd counts on purpose)


@pytest.fixture
def compile_with(monkeypatch):
    """``compile_with(fn, mode, backend="record")`` -> (compiled fn, recorded FX graphs).

    Dynamo caches compiled code per function and ATOM_COMPILE_ELEMENTWISE is read once per trace
    (a constant in the graph), so every compilation starts from a reset Dynamo."""
    graphs: list[torch.fx.GraphModule] = []

    def record(gm: torch.fx.GraphModule, example_inputs):
        graphs.append(gm)
        return gm.forward

    def compile_(fn, mode: str, backend: str = "record"):
        monkeypatch.setenv("ATOM_COMPILE_ELEMENTWISE", mode)
        assert envs.ATOM_COMPILE_ELEMENTWISE == mode
        torch._dynamo.reset()
        graphs.clear()
        return torch.compile(fn, backend=record if backend == "record" else backend, fullgraph=True), graphs

    yield compile_
    torch._dynamo.reset()


def atom_nodes(graphs: list[torch.fx.GraphModule]) -> list[str]:
    """Names of the ``torch.ops.atom.*`` calls in the recorded graphs (e.g. ``atom.rms_norm``)."""
    names = []
    for gm in graphs:
        for node in gm.graph.nodes:
            if node.op == "call_function" and str(node.target).startswith("atom."):
                names.append(str(node.target).split(".")[1])
    return names


def check_mode(mode: str, graphs, kernel_nodes: set[str]) -> None:
    assert graphs, "the backend saw no graph"
    found = set(atom_nodes(graphs))
    if mode == "inductor":
        assert not found, f"atom custom-op nodes left in the graph: {found}"
    else:
        assert found == kernel_nodes, found


def assert_same(got: torch.Tensor, ref: torch.Tensor) -> None:
    assert got.dtype == ref.dtype and same_bytes(got, ref), (got.float() - ref.float()).abs().max()


MODES = ["inductor", "kernels"]
DTYPES = [torch.float32, torch.bfloat16]
DTYPE_IDS = ["fp32", "bf16"]


def test_only_the_elementwise_ops_have_an_inductor_form():
    """MoE routing / experts, attention, KV-cache writes and quantisation keep their kernels."""
    assert {name for name, op in ops.OPS.items() if op.inductor_form is not None} == {
        "rms_norm", "rotary_embedding", "silu_and_mul"}


# -- rms_norm ---------------------------------------------------------------------------------
def _norm_plain(x, w):
    return ops.rms_norm(x * 2.0, w, 1e-6) + 1.0


def _norm_residual(x, w, r):
    y, s = ops.rms_norm(x * 2.0, w, 1e-6, r + 1.0)
    return y, s


def _norm_fp8(x, w, scale):
    return ops.rms_norm(x * 2.0, w, 1e-6, None, FP8_DTYPE, scale)


def _norm_out(x, w, r):
    out, res = torch.empty_like(x), torch.empty_like(x)
    ops.rms_norm(x, w, 1e-6, r, out=out, residual_out=res)
    return out, res


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("mode", MODES)
def test_rms_norm(mode, dtype, compile_with):
    x, r = torch.randn(T, 96, dtype=dtype), torch.randn(T, 96, dtype=dtype)
    w = torch.randn(96, dtype=dtype)
    cases = [
        (_norm_plain, (x, w), {"rms_norm"}),
        (_norm_residual, (x, w, r), {"fused_add_rms_norm"}),
        (_norm_out, (x, w, r), {"fused_add_rms_norm"}),
        (_norm_fp8, (x, w, torch.tensor([0.02])), {"rms_norm"}),
    ]
    for fn, args, kernel_nodes in cases:
        compiled, graphs = compile_with(fn, mode)
        got, ref = compiled(*args), fn(*args)
        check_mode(mode, graphs, kernel_nodes)
        for g, e in zip(got if isinstance(got, tuple) else (got,), ref if isinstance(ref, tuple) else (ref,)):
            assert_same(g, e)


# -- rotary_embedding -----------------------------------------------------------------------
def _rope_deepseek(positions, q_in, k_pe, cache, nope: int, rope_dim: int, is_neox: bool):
    """DeepSeek-V3's call: rotate the tail of every head of an intermediate ``q`` in place (the
    returned tensors are ignored) and a graph-input ``k_pe`` in place."""
    q = (q_in * 1.5).view(positions.shape[0], H, nope + rope_dim)
    ops.rotary_embedding(positions, q[..., nope:], k_pe, cache, rope_dim, rope_dim, is_neox)
    return q * 1.0


def _rope_qwen(positions, qkv, cache, is_neox: bool):
    """Qwen3's call: q and k are slices of a fused qkv output; use the returned tensors."""
    q, k, v = (qkv + 0.0).split([H * D, D, D], dim=-1)
    q, k = ops.rotary_embedding(positions, q, k, cache, D, D // 2, is_neox)
    return q + 0.0, k + 0.0, v


@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("mode", MODES)
def test_rotary_embedding_in_place(mode, dtype, is_neox, compile_with):
    positions = torch.randint(0, 100, (T,))
    nope, rope_dim = 24, 16
    q_in = torch.randn(T, H * (nope + rope_dim), dtype=dtype)
    k_pe = torch.randn(T, 1, rope_dim, dtype=dtype)
    cache = make_cos_sin_cache(128, rope_dim).to(CPU)
    compiled, graphs = compile_with(_rope_deepseek, mode)
    k_got, k_ref = k_pe.clone(), k_pe.clone()
    got = compiled(positions, q_in, k_got, cache, nope, rope_dim, is_neox)
    ref = _rope_deepseek(positions, q_in, k_ref, cache, nope, rope_dim, is_neox)
    check_mode(mode, graphs, {"rotary_embedding"})
    assert_same(got, ref)
    assert_same(k_got, k_ref)  # the in-place write to a graph input survives compilation
    assert not same_bytes(k_got, k_pe) and not same_bytes(got[..., nope:], (q_in * 1.5).view_as(got)[..., nope:])

    qkv = torch.randn(T, (H + 2) * D, dtype=dtype)
    cache = make_cos_sin_cache(128, D // 2).to(CPU)
    compiled, graphs = compile_with(_rope_qwen, mode)
    for g, e in zip(compiled(positions, qkv, cache, is_neox), _rope_qwen(positions, qkv, cache, is_neox)):
        assert_same(g, e)
    check_mode(mode, graphs, {"rotary_embedding"})


# -- silu_and_mul -----------------------------------------------------------------------------
def _silu(x):
    return ops.silu_and_mul(x + 1.0) * 2.0


def _silu_out(x):
    out = torch.empty((*x.shape[:-1], x.shape[-1] // 2), dtype=x.dtype)
    ops.silu_and_mul(x, out=out)
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("mode", MODES)
def test_silu_and_mul(mode, dtype, compile_with):
    x = torch.randn(T, 2 * 80, dtype=dtype)
    for fn in (_silu, _silu_out):
        compiled, graphs = compile_with(fn, mode)
        assert_same(compiled(x), fn(x))
        check_mode(mode, graphs, {"silu_and_mul"})


# -- Inductor itself (CPU) --------------------------------------------------------------------
def _layer(x, r, w, positions, cache, q_w, scale, nope, rope_dim):
    """A residual add + RMSNorm feeding a projection whose head tails get RoPE in place
    (DeepSeek's pattern), then SiLU-and-mul: the neighbours Inductor fuses atom's ops with."""
    h, res = ops.rms_norm(x, w, 1e-6, r)
    q = (h @ q_w).view(positions.shape[0], H, nope + rope_dim)
    ops.rotary_embedding(positions, q[..., nope:], None, cache, rope_dim, rope_dim, True)
    return q, res, ops.silu_and_mul(h), ops.rms_norm(h, w, 1e-6, None, FP8_DTYPE, scale)


def test_inductor_compiles_the_forms_on_cpu(compile_with):
    nope, rope_dim, hidden = 24, 16, 64
    x, r, w = torch.randn(T, hidden), torch.randn(T, hidden), torch.randn(hidden)
    positions = torch.randint(0, 100, (T,))
    cache = make_cos_sin_cache(128, rope_dim).to(CPU)
    q_w = torch.randn(hidden, H * (nope + rope_dim)) / 8
    args = (x, r, w, positions, cache, q_w, torch.tensor([0.05]), nope, rope_dim)
    compiled, _ = compile_with(_layer, "inductor", backend="inductor")
    got, ref = compiled(*args), _layer(*args)
    for g, e in zip(got[:3], ref[:3]):
        assert_close(g, e, atol=1e-5, rtol=1e-5)  # Inductor's reductions may sum in another order
    assert_fp8_close(got[3], ref[3])


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
def test_gpu_compiled_forms_match_atoms_kernels(mode, compile_with):
    """CUDA, bf16: Inductor's code for the forms (or the custom-op nodes) vs atom's Triton kernels
    run eagerly."""
    nope, rope_dim, hidden = 64, 64, 4096
    dev = torch.device("cuda")
    x, r = torch.randn(33, hidden, device=dev, dtype=torch.bfloat16), torch.randn(33, hidden, device=dev,
                                                                                   dtype=torch.bfloat16)
    w = torch.randn(hidden, device=dev, dtype=torch.bfloat16)
    positions = torch.randint(0, 4000, (33,), device=dev)
    cache = make_cos_sin_cache(4096, rope_dim).to(dev)
    q_w = (torch.randn(hidden, H * (nope + rope_dim), device=dev) / 64).to(torch.bfloat16)
    args = (x, r, w, positions, cache, q_w, torch.tensor([0.05], device=dev), nope, rope_dim)
    compiled, _ = compile_with(_layer, mode, backend="inductor")
    got, ref = compiled(*args), _layer(*args)
    for g, e in zip(got[:3], ref[:3]):
        assert_close(g, e, atol=3e-2, rtol=2e-2)
    assert_fp8_close(got[3], ref[3], atol=2.0**-6)
