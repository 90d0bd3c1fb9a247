"""fp8_block_gemm (block-scaled fp8 weights, W8A16 and W8A8) against its torch reference, and
the reference against an independent dequantise-then-matmul computation.

Odd M / N / K, partial edge tiles of the weight scale, M = 1, every configuration bucket,
split-K, bias, fp32 / bf16 / fp16 activations. On CPU under the Triton interpreter; real shapes
on a GPU (``gpu``)."""

from __future__ import annotations

import pytest
import torch

from atom.ops import fp8_block_gemm, per_block_quant_fp8
from atom.ops.fp8_gemm import dequant_block_fp8
from tests.ops._helpers import DEVICE, FP8

TOLS = {torch.float32: (2e-4, 2e-4), torch.bfloat16: (2e-2, 2e-2), torch.float16: (2e-3, 2e-3)}


def _weights(n: int, k: int, block: tuple[int, int], device=DEVICE) -> tuple[torch.Tensor, torch.Tensor]:
    w = (torch.randn(n, k, device=device) * 100).clamp(-448, 448).to(FP8)
    s = torch.rand(-(-n // block[0]), -(-k // block[1]), device=device) * 1e-3 + 1e-4
    return w, s


def _triton(*args, **kwargs) -> torch.Tensor:
    return fp8_block_gemm.run("triton", *args, **kwargs)


def test_reference_is_dequantise_then_matmul():
    """The reference against a hand-built dequantisation: every element of a partial edge tile
    uses its own tile's scale."""
    w = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]]).to(FP8)
    s = torch.tensor([[2.0, 3.0, 10.0], [5.0, 7.0, 100.0]])  # 2 x 1 tiles: rows {0, 1}, {2}
    wd = dequant_block_fp8(w, s, (2, 1))
    expect = torch.tensor([[2.0, 6.0, 30.0], [8.0, 15.0, 60.0], [35.0, 56.0, 900.0]])
    assert torch.equal(wd, expect)
    x = torch.tensor([[1.0, 0.0, 1.0], [0.0, 1.0, 0.0]])
    y = fp8_block_gemm(x, w, s, (2, 1), bias=torch.tensor([0.5, 0.0, -1.0]))
    torch.testing.assert_close(y, x @ expect.t() + torch.tensor([0.5, 0.0, -1.0]))


# (m, n, k, block): odd sizes, partial tiles on both axes, M in every bucket, K that forces split-K.
CASES = [
    (1, 200, 300, (128, 128)),  # GEMV
    (1, 136, 1100, (64, 128)),  # GEMV, K off the step
    (3, 130, 257, (128, 128)),
    (16, 64, 1024, (128, 128)),  # split-K: one column tile, 8 K steps
    (17, 96, 160, (64, 32)),
    (70, 136, 200, (128, 64)),
    (300, 72, 128, (32, 128)),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("m,n,k,block", CASES)
def test_w8a16_matches_reference(m, n, k, block, dtype):
    w, s = _weights(n, k, block)
    x = torch.randn(m, k, device=DEVICE).to(dtype)
    bias = torch.randn(n, device=DEVICE).to(dtype) if m % 2 else None
    want = fp8_block_gemm.reference(x, w, s, block, bias=bias)
    got = _triton(x, w, s, block, bias=bias)
    assert got.dtype == dtype and got.shape == (m, n)
    atol, rtol = TOLS[dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=atol * want.abs().max().item(), rtol=rtol)


@pytest.mark.parametrize("m,n,k,block", CASES)
def test_w8a8_matches_reference(m, n, k, block):
    w, s = _weights(n, k, block)
    x = torch.randn(m, k, device=DEVICE).to(torch.bfloat16)
    xq, xs = per_block_quant_fp8(x, block[1])
    bias = torch.randn(n, device=DEVICE).to(torch.bfloat16) if m % 2 else None
    want = fp8_block_gemm.reference(xq, w, s, block, x_scale=xs, bias=bias, out_dtype=torch.bfloat16)
    got = _triton(xq, w, s, block, x_scale=xs, bias=bias, out_dtype=torch.bfloat16)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2 * want.abs().max().item(), rtol=2e-2)
    # and close to the unquantised-activation product (fp8 activation noise only)
    w16 = fp8_block_gemm.reference(x, w, s, block, bias=bias).float()
    assert (got.float() - w16).abs().max() <= 0.08 * w16.abs().max()


def test_split_k_and_every_bucket_are_exercised():
    from atom.ops.fp8_gemm_triton import GEMV_MAX_M, M_BUCKETS, bucket_of, gemm_config, gemv_config, num_sms

    buckets = {bucket_of(m) for m, *_ in CASES if m > GEMV_MAX_M}
    assert buckets == set(range(len(M_BUCKETS) + 1))
    cfg = gemm_config(16, 64, 1024, 128, False, num_sms(DEVICE))
    assert cfg.split_k > 1
    sms = num_sms(DEVICE)
    assert {gemv_config(m, n, k, b[0], sms) is not None for m, n, k, b in CASES} == {True, False}
    assert all(gemv_config(m, n, k, b[0], sms) is not None for m, n, k, b in CASES if m <= GEMV_MAX_M)


def test_gemv_config_choices():
    """GEMV for GEMV_MAX_M rows only, a row tile that divides the scale tile's rows (none: the
    tensor-core kernel), split-K only when the grid has fewer programs than SMs."""
    from atom.ops.fp8_gemm_triton import GEMV_BLOCK_N, GEMV_MAX_M, gemv_config

    assert gemv_config(GEMV_MAX_M + 1, 4096, 4096, 128, 132) is None
    assert gemv_config(1, 4096, 4096, 6, 132) is None  # 6-row scale tiles: no 8 / 4 row tile fits
    assert gemv_config(1, 4096, 4096, 4, 132).block_n == GEMV_BLOCK_N // 2
    c = gemv_config(1, 6144, 4096, 128, 132)
    assert c.gemv and c.block_m == 1 and c.block_n == GEMV_BLOCK_N and c.split_k == 1
    assert gemv_config(1, 2112, 7168, 128, 132).split_k == 1  # 264 programs on 132 SMs
    assert gemv_config(1, 512, 16384, 128, 132).split_k > 1  # 64 programs
    assert gemv_config(1, 96, 300, 64, 8).block_k == 512  # K below the tile: one step


@pytest.mark.parametrize("m,split,bias", [(1, 3, True), (5, 2, False), (3, 1, True)])
def test_gemv_forms_match_reference(m, split, bias):
    """The GEMV kernel's forced forms: several rows (one program row each), split-K with and
    without a bias, a K tile wider than the scale tile (per-column scales) and narrower."""
    from atom.ops.fp8_gemm_triton import GemmConfig, fp8_block_gemm_fwd

    w, s = _weights(72, 700, (8, 64))
    x = torch.randn(m, 700, device=DEVICE).to(torch.bfloat16)
    b = torch.randn(72, device=DEVICE).to(torch.bfloat16) if bias else None
    want = fp8_block_gemm.reference(x, w, s, (8, 64), bias=b).float()
    for bk in (32, 256):
        got = fp8_block_gemm_fwd(x, w, s, (8, 64), x_scale=None, bias=b, out_dtype=torch.bfloat16,
                                 config=GemmConfig(1, 8, bk, 1, 4, 1, False, split, gemv=True))
        torch.testing.assert_close(got.float(), want, atol=2e-2 * want.abs().max().item(), rtol=2e-2)
    with pytest.raises(ValueError, match="must divide the scale tile"):
        fp8_block_gemm_fwd(x, w, s, (8, 64), x_scale=None, bias=b, out_dtype=torch.bfloat16,
                           config=GemmConfig(1, 16, 64, 1, 4, 1, False, 1, gemv=True))


def test_gemv_unscaled_weight():
    """The GEMV kernel on a bf16 weight without scales (bench/fp8_gemm.py's bf16 GEMV)."""
    from atom.ops.fp8_gemm_triton import GemmConfig, _gemv

    w = torch.randn(40, 300, device=DEVICE).to(torch.bfloat16)
    x = torch.randn(1, 300, device=DEVICE).to(torch.bfloat16)
    out = torch.empty(1, 40, device=DEVICE, dtype=torch.bfloat16)
    _gemv(x, w, None, None, None, out, GemmConfig(1, 8, 128, 1, 4, 1, False, 2, gemv=True))
    want = x.float() @ w.float().t()
    torch.testing.assert_close(out.float(), want, atol=2e-2 * want.abs().max().item(), rtol=2e-2)


@pytest.mark.parametrize("a_fp8", [False, True], ids=["w8a16", "w8a8"])
def test_swapped_operand_form_matches_reference(a_fp8):
    """The transposed form (``SWAP_AB``, weight tile as the wide MMA operand), kept as a tile
    option, on odd sizes with split-K and a bias."""
    from atom.ops.fp8_gemm_triton import GemmConfig, fp8_block_gemm_fwd

    w, s = _weights(100, 300, (64, 128))
    x = torch.randn(5, 300, device=DEVICE).to(torch.bfloat16)
    bias = torch.randn(100, device=DEVICE).to(torch.bfloat16)
    xs = None
    if a_fp8:
        x, xs = per_block_quant_fp8(x, 128)
    want = fp8_block_gemm.reference(x, w, s, (64, 128), x_scale=xs, bias=bias, out_dtype=torch.bfloat16)
    got = fp8_block_gemm_fwd(x, w, s, (64, 128), x_scale=xs, bias=bias, out_dtype=torch.bfloat16,
                             config=GemmConfig(16, 32, 64, 1, 4, 2, True, 2))
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2 * want.abs().max().item(), rtol=2e-2)


def test_out_and_errors():
    w, s = _weights(40, 64, (16, 32))
    x = torch.randn(5, 64, device=DEVICE)
    out = torch.empty(5, 40, device=DEVICE)
    y = _triton(x, w, s, (16, 32), out=out)
    assert y.data_ptr() == out.data_ptr()
    with pytest.raises(ValueError, match="weight_scale must be float32"):
        fp8_block_gemm(x, w, s[:1], (16, 32))
    with pytest.raises(ValueError, match="fp8 x needs a float32 x_scale"):
        fp8_block_gemm(x.to(FP8), w, s, (16, 32), out_dtype=torch.float32)
    with pytest.raises(ValueError, match="weight must be float8_e4m3fn"):
        fp8_block_gemm(x, w.float(), s, (16, 32))
    with pytest.raises(ValueError, match="x_scale goes with an fp8 x only"):
        fp8_block_gemm(x, w, s, (16, 32), x_scale=torch.ones(5, 2))


def test_warm_up_compiles_every_bucket():
    from atom.ops import warm_up_fp8_block_gemm
    from atom.ops.fp8_gemm_triton import warm_up_sizes

    w, s = _weights(64, 128, (64, 64))
    n = warm_up_fp8_block_gemm(w, s, (64, 64), act_dtype=torch.bfloat16, w8a8_from=65, force=True)
    assert n == len(warm_up_sizes(65)) and 65 in warm_up_sizes(65) and 1 in warm_up_sizes(65)
    assert {1, 2, 17, 65, 257} <= set(warm_up_sizes(17))  # the GEMV and every tile bucket
    assert warm_up_fp8_block_gemm(w, s, (64, 64), act_dtype=torch.bfloat16, w8a8_from=65, force=True) == 0


def test_warm_up_times_on_the_weights_device(monkeypatch):
    """The warm-up's timer is given the weight's device (on a GPU it syncs there: atom.ops._warm)."""
    from atom.ops import _warm, warm_up_fp8_block_gemm

    seen = []
    monkeypatch.setattr(_warm, "_synchronize", seen.append)
    w, s = _weights(64, 96, (64, 64))
    assert warm_up_fp8_block_gemm(w, s, (64, 64), act_dtype=torch.bfloat16, w8a8_from=65, force=True) > 0
    assert seen and all(d == w.device for d in seen)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 2, 3, 8, 64, 256, 4096])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 12288), (576 + 1536, 7168), (576, 7168)])
def test_gpu_real_shapes(m, n, k):
    w, s = _weights(n, k, (128, 128))
    x = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16)
    want = x.float() @ dequant_block_fp8(w, s, (128, 128)).t()
    got = _triton(x, w, s, (128, 128))
    torch.testing.assert_close(got.float(), want, atol=1e-2 * want.abs().max().item(), rtol=1e-2)
    xq, xs = per_block_quant_fp8(x, 128)
    got8 = _triton(xq, w, s, (128, 128), x_scale=xs, out_dtype=torch.bfloat16)
    assert (got8.float() - want).abs().max() <= 0.08 * want.abs().max()


def test_host_gemm_is_used_from_its_batch_size_and_declines_fall_back():
    """The host seam (the toolkit's own mechanics, so a recording fake): on W8A8 batches, from
    ``min_tokens`` rows, the op calls the host's GEMM; a host that returns None leaves the row to
    atom's kernel."""
    from atom.ops.fp8_gemm import HostGemm, set_host_gemm

    w, s = _weights(64, 128, (64, 64))
    calls, fed = [], []

    def host(x, weight, weight_scale, block, bias, x_fp8, x_fp8_scale):
        calls.append(x.shape[0])
        fed.append(x_fp8 is not None and x_fp8_scale is not None)
        return None if x.shape[0] == 9 else torch.full((x.shape[0], weight.shape[0]), 7.0, dtype=x.dtype,
                                                       device=x.device)

    set_host_gemm(HostGemm(host, 8, "fake"))
    try:
        small = _triton(torch.randn(3, 128, device=DEVICE), w, s, (64, 64), w8a8_from=1)
        big = _triton(torch.randn(8, 128, device=DEVICE), w, s, (64, 64), w8a8_from=1)
        x9 = torch.randn(9, 128, device=DEVICE)
        declined = _triton(x9, w, s, (64, 64), w8a8_from=1)
        q, qs = per_block_quant_fp8(x9, 64)
        _triton(x9, w, s, (64, 64), x_fp8=q, x_fp8_scale=qs, w8a8_from=1)  # a producer's quantisation is handed on
    finally:
        set_host_gemm(None)
    assert calls == [8, 9, 9] and fed == [False, False, True]
    assert not (small == 7).all() and (big == 7).all()
    torch.testing.assert_close(declined, fp8_block_gemm.reference(x9, w, s, (64, 64), w8a8_from=1),
                               atol=1e-3, rtol=1e-3)


def test_host_gemm_serves_only_batches_the_op_would_quantise():
    """vLLM's block-fp8 GEMMs quantise activations, so W8A16 (``w8a8_from`` None, as with
    ``ATOM_FP8_W8A8_MIN_TOKENS=0``) never reaches the host GEMM, whatever the batch: the product
    is the exact dequantised layer's; a later W8A8 threshold than the host's moves the hand-off
    to it."""
    from atom.ops.fp8_gemm import HostGemm, set_host_gemm

    w, s = _weights(64, 128, (64, 64))
    calls = []

    def host(x, weight, *rest):
        calls.append(x.shape[0])
        return torch.full((x.shape[0], weight.shape[0]), 7.0, dtype=x.dtype, device=x.device)

    x = torch.randn(40, 128, device=DEVICE)
    set_host_gemm(HostGemm(host, 8, "fake"))
    try:
        a16 = _triton(x, w, s, (64, 64))
        below = _triton(x[:19], w, s, (64, 64), w8a8_from=20)
        from_it = _triton(x[:20], w, s, (64, 64), w8a8_from=20)
    finally:
        set_host_gemm(None)
    assert calls == [20] and (from_it == 7).all()
    torch.testing.assert_close(a16, fp8_block_gemm.reference(x, w, s, (64, 64)), atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(below, fp8_block_gemm.reference(x[:19], w, s, (64, 64)), atol=1e-3, rtol=1e-3)


def test_small_batch_host_gemm_takes_float_batches_in_its_range():
    """A host GEMM that quantises float activations itself (vLLM's plugin: FlashInfer's swap-AB
    kernel) serves the batches of its row range below the layer's W8A8 threshold too, tried in the
    order offered; past its range the next host GEMM or atom's kernel runs; a layer that asked for
    W8A16 only (``w8a8_from`` None) never reaches it."""
    from atom.ops.fp8_gemm import HostGemm, set_host_gemm

    w, s = _weights(64, 128, (64, 64))
    calls = []

    def fake(tag, value):
        def fn(x, weight, *rest):
            calls.append((tag, x.shape[0]))
            return torch.full((x.shape[0], weight.shape[0]), value, dtype=x.dtype, device=x.device)
        return fn

    x = torch.randn(20, 128, device=DEVICE)
    set_host_gemm(HostGemm(fake("small", 5.0), 2, "small", max_tokens=8, w8a16_batches=True),
                  HostGemm(fake("large", 7.0), 12, "large"))
    try:
        got = {m: _triton(x[:m], w, s, (64, 64), w8a8_from=10) for m in (1, 2, 7, 8, 11, 12)}
        a16 = _triton(x[:4], w, s, (64, 64))
    finally:
        set_host_gemm(None)
    assert calls == [("small", 2), ("small", 7), ("large", 12)]
    assert (got[2] == 5).all() and (got[7] == 5).all() and (got[12] == 7).all()
    for m in (1, 8, 11):  # atom's W8A16 (1, 8) and W8A8 (11) kernels
        torch.testing.assert_close(got[m], fp8_block_gemm.reference(x[:m], w, s, (64, 64), w8a8_from=10),
                                   atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(a16, fp8_block_gemm.reference(x[:4], w, s, (64, 64)), atol=1e-3, rtol=1e-3)


def test_host_gemm_warm_up_runs_with_the_layers_warm_up():
    """A host GEMM's warm-up (DeepGEMM compiles per shape just in time) runs inside atom's
    per-shape warm-up where W8A8 is on, once per shape, and its launches are counted; a W8A16
    layer (which never calls the host GEMM) does not compile its variants."""
    from atom.ops import warm_up_fp8_block_gemm
    from atom.ops.fp8_gemm import HostGemm, set_host_gemm

    w, s = _weights(80, 96, (16, 32))
    seen = []

    def warm(weight, weight_scale, block, act_dtype):
        seen.append((tuple(weight.shape), block, act_dtype))
        return 5

    set_host_gemm(HostGemm(lambda *a: None, 8, "fake", warm))
    try:
        a16 = warm_up_fp8_block_gemm(w, s, (16, 32), act_dtype=torch.float32, force=True)
        first = warm_up_fp8_block_gemm(w, s, (16, 32), act_dtype=torch.float32, w8a8_from=8, force=True)
        again = warm_up_fp8_block_gemm(w, s, (16, 32), act_dtype=torch.float32, w8a8_from=8, force=True)
    finally:
        set_host_gemm(None)
    assert seen == [((80, 96), (16, 32), torch.float32)]
    assert a16 > 0 and first > 5 and again == 0


def test_warm_up_times_each_kernel_apart(monkeypatch, caplog):
    """A warm-up's time is logged per kernel and shape (each host GEMM, then atom's Triton GEMM,
    apart: a cold start's JIT time by kernel), and added to the process totals; a shape already
    warmed logs nothing."""
    import logging

    from atom.ops import _warm, warm_up_fp8_block_gemm
    from atom.ops.fp8_gemm import HostGemm, set_host_gemm

    monkeypatch.setattr(_warm, "TOTALS", {})
    clock = iter([20.0, 20.25, 10.0, 12.5])  # the host's warm-up 0.25 s, then atom's 2.5 s
    monkeypatch.setattr(_warm.time, "perf_counter", lambda: next(clock))
    w, s = _weights(48, 64, (16, 32))
    set_host_gemm(HostGemm(lambda *a: None, 8, "fake-host", lambda *a: 3))
    try:
        with caplog.at_level(logging.INFO, logger="atom.ops"):
            launches = warm_up_fp8_block_gemm(w, s, (16, 32), act_dtype=torch.float32, w8a8_from=8, force=True)
            assert warm_up_fp8_block_gemm(w, s, (16, 32), act_dtype=torch.float32, w8a8_from=8, force=True) == 0
    finally:
        set_host_gemm(None)
    mine = launches - 3
    assert _warm.TOTALS == {"fp8_block_gemm": [1, mine, 2.5], "fake-host": [1, 3, 0.25]}
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("warm-up")]
    assert lines == ["warm-up fake-host (48, 64): 3 launches in 0.2 s (fake-host so far: 0.2 s)",
                     f"warm-up fp8_block_gemm (48, 64): {mine} launches in 2.5 s (fp8_block_gemm so far: 2.5 s)"]


def test_host_gemms_warm_before_atoms_triton_gemm(monkeypatch):
    """The host GEMMs' warm-ups run before atom's: atom's warm-up sizes the op hands to a host
    GEMM would otherwise hold that host kernel's first compile in atom's line (an engine's cold
    start logged ~100 s for atom's Triton GEMM at the first weight FlashInfer's swap-AB kernel
    serves, where the same Triton warm-up alone took ~5 s: bench/NOTES.md 80)."""
    from atom.ops import fp8_gemm_triton, warm_up_fp8_block_gemm
    from atom.ops.fp8_gemm import HostGemm, set_host_gemm

    order = []
    monkeypatch.setattr(fp8_gemm_triton, "warm_up", lambda *a: order.append("atom") or 4)
    w, s = _weights(56, 64, (16, 32))  # a shape no other test warms (once per process and shape)
    set_host_gemm(HostGemm(lambda *a: None, 2, "small", lambda *a: order.append("small") or 2, max_tokens=8),
                  HostGemm(lambda *a: None, 8, "large", lambda *a: order.append("large") or 3))
    try:
        assert warm_up_fp8_block_gemm(w, s, (16, 32), act_dtype=torch.float32, w8a8_from=8, force=True) == 9
    finally:
        set_host_gemm(None)
    assert order == ["small", "large", "atom"]


@pytest.mark.gpu
@pytest.mark.parametrize("m", [128, 1000])
def test_gpu_vllm_cutlass_host_gemm_matches_reference(m, monkeypatch):
    """vLLM's CUTLASS block-fp8 GEMM as atom's plugin calls it (activation quantisation included)
    is within fp8 activation noise of the exact product, and the op routes to it."""
    pytest.importorskip("vllm")
    from atom.ops.fp8_gemm import set_host_gemm
    from atom.plugin.vllm import fp8_gemm as host

    monkeypatch.setenv("ATOM_FP8_HOST_GEMM", "cutlass")
    host.install.cache_clear()
    assert host.install() == host.CUTLASS
    try:
        # with the producer's quantisation (atom.ops.fused_quant; fp32 scales, where vLLM's own
        # quantisation on the H100 rounds scales to powers of two, E8M0)
        _check_host_gemm(host.cutlass_block_gemm(), m, own_atol=0.01, fed_near_exact=True)
    finally:
        set_host_gemm(None)
        host.install.cache_clear()


@pytest.mark.gpu
@pytest.mark.parametrize("m", [17, 64, 300])
def test_gpu_vllm_deepgemm_host_gemm_matches_atoms_w8a8_on_the_same_numbers(m, monkeypatch):
    """DeepGEMM's ``fp8_gemm_nt`` as atom's plugin calls it, on the checkpoint's float32 scales:
    the op routes to it from 17 tokens (auto), its product on a producer's quantised input equals
    atom's own W8A8 kernel's on that input up to accumulation order (no E8M0 rounding of any
    scale), and with its own quantisation it is within fp8 activation noise of the exact product.
    Its warm-up compiles the variants for the shape."""
    pytest.importorskip("vllm")
    from vllm.utils import deep_gemm as dg

    if not dg.is_deep_gemm_supported() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("DeepGEMM's Hopper kernel does not run here")
    from atom.ops.fp8_gemm import set_host_gemm
    from atom.plugin.vllm import fp8_gemm as host

    monkeypatch.setenv("ATOM_FP8_HOST_GEMM", "auto")
    monkeypatch.delenv("ATOM_FP8_HOST_GEMM_MIN_TOKENS", raising=False)
    host.install.cache_clear()
    assert host.install() == host.DEEPGEMM
    try:
        from atom.ops import fp8_gemm as op

        dg_gemm = op._HOST_GEMMS[-1]
        assert (dg_gemm.name, dg_gemm.min_tokens, dg_gemm.max_tokens) == (host.DEEPGEMM, 17, None)
        w, s = _weights(1024, 2048, (128, 128))
        assert dg_gemm.warm_up is not None and dg_gemm.warm_up(w, s, (128, 128), torch.bfloat16) > 0
        _check_host_gemm(host.deepgemm_block_gemm(), m, own_atol=0.005, fed_near_exact=False)
    finally:
        set_host_gemm(None)
        host.install.cache_clear()


@pytest.mark.gpu
def test_gpu_vllm_flashinfer_small_batch_host_gemm_matches_reference(monkeypatch):
    """FlashInfer's swap-AB block-fp8 GEMM as atom's plugin calls it (bf16 activations, the
    checkpoint's float32 tile scales, partial last row block): installed for 2-16 tokens ahead of
    DeepGEMM where vLLM says it runs; the op's product at 2 / 5 / 16 tokens is the kernel's called
    directly and within fp8 activation noise of the exact product; one token, and a weight of fewer
    than 4096 rows, stay on atom's kernel (the dequantised layer's numbers); its warm-up makes one
    call per batch size it serves."""
    pytest.importorskip("vllm")
    from vllm.utils.flashinfer import is_flashinfer_fp8_blockscale_gemm_supported

    if not is_flashinfer_fp8_blockscale_gemm_supported():
        pytest.skip("vLLM says FlashInfer's block-scale fp8 GEMM does not run here")
    from atom.ops import fp8_gemm as op
    from atom.plugin.vllm import fp8_gemm as host

    monkeypatch.delenv("ATOM_FP8_HOST_GEMM_SMALL", raising=False)
    monkeypatch.delenv("ATOM_FP8_HOST_GEMM_MIN_TOKENS", raising=False)
    host.install.cache_clear()
    host.install()
    try:
        small = op._HOST_GEMMS[0]
        assert (small.name, small.min_tokens, small.w8a16_batches) == (host.FLASHINFER, 2, True)
        n, k = 4160, 2048  # 32.5 row blocks
        w, s = _weights(n, k, (128, 128))
        assert small.warm_up(w, s, (128, 128), torch.bfloat16) == small.max_tokens - 2
        direct = host.flashinfer_block_gemm()
        exact = dequant_block_fp8(w, s, (128, 128)).t()
        bias = torch.randn(n, device=DEVICE, dtype=torch.bfloat16)
        for m in (2, 5, 16):
            x = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16)
            want = x.float() @ exact + bias.float()
            got = _triton(x, w, s, (128, 128), bias=bias, w8a8_from=17)
            assert torch.equal(got, direct(x, w, s, (128, 128), bias))
            assert (got.float() - want).abs().max() <= 0.08 * want.abs().max()
        x1 = torch.randn(1, k, device=DEVICE, dtype=torch.bfloat16)
        torch.testing.assert_close(_triton(x1, w, s, (128, 128), w8a8_from=17).float(), x1.float() @ exact,
                                   atol=0.02, rtol=0.02)
        wn, sn = _weights(4032, k, (128, 128))
        assert direct(x1.expand(4, k).contiguous(), wn, sn, (128, 128), None) is None
    finally:
        op.set_host_gemm(None)
        host.install.cache_clear()


def _check_host_gemm(direct_gemm, m: int, own_atol: float, fed_near_exact: bool) -> None:
    """The op's product (the host GEMM installed) is the kernel's called directly and within fp8
    activation noise of the exact product; on a producer's quantised input, either scale layout,
    it is atom's own W8A8 kernel's product on that input up to ``own_atol`` of the output's range
    (and, with ``fed_near_exact``, also within the noise of the exact product)."""
    from atom.ops.fused_quant import column_major

    w, s = _weights(1024, 2048, (128, 128))
    x = torch.randn(m, 2048, device=DEVICE, dtype=torch.bfloat16)
    bias = torch.randn(1024, device=DEVICE, dtype=torch.bfloat16)
    want = x.float() @ dequant_block_fp8(w, s, (128, 128)).t() + bias.float()
    got = _triton(x, w, s, (128, 128), bias=bias, w8a8_from=17)
    assert torch.equal(got, direct_gemm(x, w, s, (128, 128), bias))
    assert (got.float() - want).abs().max() <= 0.08 * want.abs().max()
    q, qs = per_block_quant_fp8(x, 128)
    own = _triton(q, w, s, (128, 128), x_scale=qs, bias=bias, out_dtype=torch.bfloat16)
    for scales in (qs, column_major(qs)):
        fed = _triton(x, w, s, (128, 128), bias=bias, x_fp8=q, x_fp8_scale=scales, w8a8_from=17)
        if fed_near_exact:
            assert (fed.float() - want).abs().max() <= 0.08 * want.abs().max()
        torch.testing.assert_close(fed.float(), own.float(), atol=own_atol * want.abs().max().item(), rtol=0.01)


def test_warm_up_skips_host_gemms_that_serve_only_smaller_batches():
    """``min_tokens``: a weight no batch under 129 tokens reaches (the shared experts' dense path above
    fused_moe's limit) warms the host GEMM serving 17+ tokens, not the one serving 2-16."""
    from atom.ops import warm_up_fp8_block_gemm
    from atom.ops.fp8_gemm import HostGemm, set_host_gemm

    warmed = []
    small = HostGemm(lambda *a: None, 2, "small", lambda *a: warmed.append("small") or 1, max_tokens=17)
    large = HostGemm(lambda *a: None, 17, "large", lambda *a: warmed.append("large") or 1)
    w, s = _weights(48, 64, (16, 32))
    set_host_gemm(small, large)
    try:
        warm_up_fp8_block_gemm(w, s, (16, 32), act_dtype=torch.float32, w8a8_from=1, force=True, min_tokens=129)
        assert warmed == ["large"]
        warm_up_fp8_block_gemm(w, s, (16, 32), act_dtype=torch.float32, w8a8_from=1, force=True, min_tokens=16)
        assert warmed == ["large", "small", "large"]
    finally:
        set_host_gemm(None)
