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


def _fi(x, weight, *a, **k):
    return x.new_zeros(x.shape[0], weight.shape[0])


@pytest.fixture
def kernels(monkeypatch):
    """Fake factories: ``available`` says which kernels 'run here'."""
    available = set()
    fakes = {"deepgemm": _dg, "cutlass": _cut}
    # the real table (names, order, auto batch sizes, warm-ups) with factories that say what runs
    monkeypatch.setattr(host, "KERNELS", {
        kind: k._replace(factory=lambda kind=kind: fakes[kind] if kind in available else None)
        for kind, k in host.KERNELS.items()})
    monkeypatch.setattr(host, "flashinfer_block_gemm", lambda: _fi if "flashinfer" in available else None)
    for name in ("ATOM_FP8_HOST_GEMM", "ATOM_FP8_HOST_GEMM_MIN_TOKENS", "ATOM_FP8_HOST_GEMM_SMALL"):
        monkeypatch.delenv(name, raising=False)
    host.install.cache_clear()
    yield available
    host.install.cache_clear()
    op.set_host_gemm(None)


def _installed():
    """The larger-batch host GEMM: (name, first size, function, has a warm-up), or None."""
    large = [h for h in op._HOST_GEMMS if not h.w8a16_batches]
    return None if not large else (large[0].name, large[0].min_tokens, large[0].fn, large[0].warm_up is not None)


def _small():
    """The small-batch host GEMM: (name, rows served, function), or None; it is tried first."""
    small = [h for h in op._HOST_GEMMS if h.w8a16_batches]
    if not small:
        return None
    assert op._HOST_GEMMS[0] is small[0]
    return small[0].name, (small[0].min_tokens, small[0].max_tokens), small[0].fn


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


def test_flashinfer_serves_2_to_16_tokens_ahead_of_deepgemm(kernels):
    """Where FlashInfer's block-scale GEMM runs, it takes 2-16 tokens (a half-open 2..17), DeepGEMM
    from 17; one token stays atom's (its GEMV)."""
    kernels.update({"flashinfer", "deepgemm", "cutlass"})
    assert host.install() == host.DEEPGEMM
    assert _small() == (host.FLASHINFER, (2, 17), _fi)
    assert _installed() == (host.DEEPGEMM, 17, _dg, True)


def test_flashinfer_stops_below_32_tokens(kernels, monkeypatch):
    """Under CUTLASS (from 128) or no larger-batch GEMM at all, FlashInfer's range still ends below
    32 tokens, where its op would switch to the kernel vLLM does not call."""
    kernels.update({"flashinfer", "cutlass"})
    host.install()
    assert _small()[1] == (2, 32) and _installed()[0] == host.CUTLASS
    host.install.cache_clear()
    monkeypatch.setenv("ATOM_FP8_HOST_GEMM_MIN_TOKENS", "0")
    assert host.install() is None and _installed() is None and _small()[1] == (2, 32)


def test_small_batch_kernel_can_be_turned_off_or_absent(kernels, monkeypatch, caplog):
    """Absent, atom's kernel serves small batches (a warning only when FlashInfer was asked for by
    name); ATOM_FP8_HOST_GEMM_SMALL=atom turns it off where it runs."""
    import logging

    from atom import _logging

    kernels.update({"deepgemm"})
    host.install()
    assert _small() is None and _installed()[0] == host.DEEPGEMM
    monkeypatch.setenv("ATOM_FP8_HOST_GEMM_SMALL", "flashinfer")
    monkeypatch.setattr(_logging, "_warned", set())
    host.install.cache_clear()
    with caplog.at_level(logging.WARNING):
        host.install()
    assert _small() is None and "ATOM_FP8_HOST_GEMM_SMALL=flashinfer" in caplog.text
    kernels.add("flashinfer")
    host.install.cache_clear()
    monkeypatch.setenv("ATOM_FP8_HOST_GEMM_SMALL", "atom")
    host.install()
    assert _small() is None and _installed()[0] == host.DEEPGEMM


def test_flashinfer_warm_up_calls_every_size_it_serves(kernels):
    """FlashInfer compiles per shape just in time: the warm-up calls it once per batch size 2-16."""
    import torch

    kernels.update({"flashinfer", "deepgemm"})
    host.install()
    small = op._HOST_GEMMS[0]
    sizes = []

    def record(x, weight, *a):
        sizes.append(x.shape[0])
        return _fi(x, weight)

    warm = host.warm_up_at(record, lambda n, device: list(range(small.min_tokens, small.max_tokens)))
    w = torch.zeros(4224, 256, dtype=torch.float8_e4m3fn)
    assert warm(w, torch.ones(33, 2), (128, 128), torch.bfloat16) == 15 and sizes == list(range(2, 17))
    assert small.warm_up(w, torch.ones(33, 2), (128, 128), torch.bfloat16) == 15


def test_flashinfer_gemm_takes_only_the_shapes_it_wins_on(monkeypatch):
    """The function atom calls (vLLM's FlashInfer wrapper stood in for: the kernel itself is
    compared with the exact product on the GPU) declines weights of fewer than 4096 rows, blocks
    other than 128 x 128, N off 64 / K off 128, non-bf16 activations and non-float32 scales; it
    passes the checkpoint's scales as they are and adds the bias after."""
    import torch
    import vllm.utils.flashinfer as vfi

    seen = []

    def fake_gemm(input, weight, weight_scale, out_dtype):
        seen.append((tuple(input.shape), tuple(weight.shape), weight_scale.dtype, out_dtype))
        return torch.ones(input.shape[0], weight.shape[0], dtype=out_dtype)

    monkeypatch.setattr(host, "nvidia_gpu", lambda *a: True)
    monkeypatch.setattr(vfi, "flashinfer_fp8_blockscale_gemm", fake_gemm)
    monkeypatch.setattr(vfi, "is_flashinfer_fp8_blockscale_gemm_supported", lambda: True)
    gemm = host.flashinfer_block_gemm()

    def call(n, k, block=(128, 128), dtype=torch.bfloat16, scale_dtype=torch.float32, bias=None):
        w = torch.zeros(n, k, dtype=torch.float8_e4m3fn)
        s = torch.ones(-(-n // 128), -(-k // 128), dtype=scale_dtype)
        return gemm(torch.ones(3, k, dtype=dtype), w, s, block, bias)

    assert call(4032, 1024) is None and call(2112, 7168) is None
    assert call(4160, 1024, block=(64, 128)) is None and call(4160, 1000) is None and call(4100, 1024) is None
    assert call(4160, 1024, dtype=torch.float16) is None and call(4160, 1024, scale_dtype=torch.bfloat16) is None
    assert seen == []
    assert call(4096, 1024) is not None and len(seen) == 1
    seen.clear()
    y = call(4160, 1024, bias=torch.full((4160,), 2.0, dtype=torch.bfloat16))
    assert seen == [((3, 1024), (4160, 1024), torch.float32, torch.bfloat16)] and (y == 3).all()
