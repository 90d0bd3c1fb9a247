"""Which of vLLM's block-fp8 GEMMs atom's linears hand larger batches to (atom/plugin/vllm/fp8_gemm.py).

The choice among the kernels is the toolkit's own mechanics, so the kernel factories are
recording fakes here; the kernels themselves are compared with the exact product and with atom's
own W8A8 kernel on the GPU (tests/ops/test_fp8_gemm.py, gpu-marked).
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from atom.ops import fp8_gemm as op  # noqa: E402
from atom.plugin.vllm import fp8_gemm as host  # noqa: E402


def _dg(*a, **k):
    return None


def _cut(*a, **k):
    return None


@pytest.fixture
def kernels(monkeypatch):
    """Fake factories: ``available`` says which kernels 'run here'."""
    available = set()
    fakes = {"deepgemm": _dg, "cutlass": _cut}
    # the real table (names, order, auto batch sizes, warm-ups) with factories that say what runs
    monkeypatch.setattr(host, "KERNELS", {
        kind: k._replace(factory=lambda kind=kind: fakes[kind] if kind in available else None)
        for kind, k in host.KERNELS.items()})
    for name in ("ATOM_FP8_HOST_GEMM", "ATOM_FP8_HOST_GEMM_MIN_TOKENS"):
        monkeypatch.delenv(name, raising=False)
    host.install.cache_clear()
    yield available
    host.install.cache_clear()
    op.set_host_gemm(None)


def _installed():
    h = op._HOST_GEMM
    return None if h is None else (h.name, h.min_tokens, h.fn, h.warm_up is not None)


def test_auto_prefers_deepgemm_from_17_tokens_with_its_warm_up(kernels):
    kernels.update({"deepgemm", "cutlass"})
    assert host.install() == host.DEEPGEMM
    assert _installed() == (host.DEEPGEMM, 17, _dg, True)


def test_auto_falls_back_to_cutlass_from_128_tokens(kernels):
    kernels.add("cutlass")
    assert host.install() == host.CUTLASS
    assert _installed() == (host.CUTLASS, 128, _cut, False)


def test_a_named_kernel_that_does_not_run_leaves_atoms_kernel_alone(kernels, monkeypatch):
    kernels.add("cutlass")
    monkeypatch.setenv("ATOM_FP8_HOST_GEMM", "deepgemm")
    assert host.install() is None and _installed() is None


def test_explicit_kernel_and_batch_size(kernels, monkeypatch):
    kernels.update({"deepgemm", "cutlass"})
    monkeypatch.setenv("ATOM_FP8_HOST_GEMM", "cutlass")
    monkeypatch.setenv("ATOM_FP8_HOST_GEMM_MIN_TOKENS", "64")
    assert host.install() == host.CUTLASS
    assert _installed() == (host.CUTLASS, 64, _cut, False)


def test_zero_min_tokens_turns_the_hand_off_off(kernels, monkeypatch):
    kernels.update({"deepgemm", "cutlass"})
    monkeypatch.setenv("ATOM_FP8_HOST_GEMM_MIN_TOKENS", "0")
    assert host.install() is None and _installed() is None


def test_no_nvidia_gpu_no_host_kernel():
    """The real factories on this machine: without an NVIDIA GPU neither kernel is offered."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert host.deepgemm_block_gemm() is None and host.cutlass_block_gemm() is None


@pytest.mark.parametrize("mode", ["skip", "full", "relax"])
def test_deepgemm_warm_up_sizes_follow_vllms_setting(monkeypatch, mode):
    """The sizes DeepGEMM is compiled for follow VLLM_DEEP_GEMM_WARMUP, start at the hand-off
    size and end at the largest batch (outside an engine: 8192 or vLLM's default config's)."""
    import torch

    monkeypatch.setenv("VLLM_DEEP_GEMM_WARMUP", mode)
    sizes = host.deepgemm_warm_up_sizes(4096, torch.device("cpu"), 17)
    if mode == "skip":
        assert sizes == []
        return
    assert sizes == sorted(set(sizes)) and sizes[0] >= 17 and 1 not in sizes
    top = sizes[-1]
    assert top >= 512
    if mode == "full":
        assert sizes == list(range(17, top + 1))
    else:
        assert len(sizes) < top - 16 and 64 in sizes and 24 in sizes
