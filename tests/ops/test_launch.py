"""Direct launches of compiled Triton kernels (``atom.ops._launch``, ATOM_TRITON_DIRECT_LAUNCH).

On the CPU: the launch key separates what decides Triton's compiled variant, the constexpr tail
follows the kernel's parameters (real kernels' parameters, read from a ``JITFunction``), a key's
first call launches normally and later ones directly, and every way Triton's API can differ
falls back to normal launches for good. Stand-in kernels here are the toolkit's own mechanics
(Triton's launcher needs a GPU). On a GPU: atom's paged attention and KV-cache write give
bit-for-bit the outputs of normal launches, aligned or not, and nothing compiles after the
warm-up.
"""

from __future__ import annotations

import pytest
import torch

from atom._logging import _warned
from atom.ops import _launch

DEV = "cuda" if torch.cuda.is_available() else "cpu"


# ---------------------------------------------------------------------------------------------
# the key
# ---------------------------------------------------------------------------------------------


def _key(*args, **kwargs):
    return _launch.arg_key(args, kwargs, 0)


def test_key_separates_what_decides_the_compiled_variant():
    buf = torch.zeros(64, dtype=torch.bfloat16)
    aligned, unaligned = buf[8:], buf[1:]  # 16 bytes in, 2 bytes in
    assert aligned.data_ptr() % 16 == 0 and unaligned.data_ptr() % 16 != 0
    base = _key(aligned, 16, 2.0, True, BLOCK=32, num_warps=4)
    assert base == _key(buf[16:], 16, 3.5, True, BLOCK=32, num_warps=4)  # another aligned tensor, another float
    for other in (
        _key(unaligned, 16, 2.0, True, BLOCK=32, num_warps=4),  # alignment
        _key(aligned.float(), 16, 2.0, True, BLOCK=32, num_warps=4),  # dtype
        _key(aligned, 17, 2.0, True, BLOCK=32, num_warps=4),  # an int's value (divisibility)
        _key(aligned, 1, 2.0, True, BLOCK=32, num_warps=4),  # == 1
        _key(aligned, 2 ** 33, 2.0, True, BLOCK=32, num_warps=4),  # 64-bit
        _key(aligned, 16, 2, True, BLOCK=32, num_warps=4),  # an int where a float was
        _key(aligned, 16, 2.0, 1, BLOCK=32, num_warps=4),  # True is not 1 to Triton
        _key(aligned, 16, 2.0, True, BLOCK=64, num_warps=4),  # a constexpr
        _key(aligned, 16, 2.0, True, BLOCK=32, num_warps=8),  # a launch option
        _key(aligned, 16, 2.0, True, BLOCK=32),  # an option left out
        _key(aligned, 16, 2.0, None, BLOCK=32, num_warps=4),  # None
    ):
        assert other != base
    assert _launch.arg_key((aligned,), {}, 0) != _launch.arg_key((aligned,), {}, 1)  # the device


# ---------------------------------------------------------------------------------------------
# the mechanics, with a stand-in for Triton's JITFunction and CompiledKernel
# ---------------------------------------------------------------------------------------------


class _Param:
    def __init__(self, name, default=None):
        self.name, self.default, self.has_default = name, default, default is not None


class FakeCompiled:
    def __init__(self, log, fail=False):
        self.log, self.fail = log, fail

    def __getitem__(self, grid):
        def run(*args, stream=None):
            if self.fail:
                raise TypeError("function takes exactly 20 arguments")
            self.log.append(("direct", grid, args, stream))
        return run


class FakeKernel:
    """``k(x_ptr, n, BLOCK: constexpr, EVEN: constexpr = True)``."""

    __name__ = "fake_kernel"

    def __init__(self, warmup_error=None, launcher_fails=False):
        self.params = [_Param("x_ptr"), _Param("n"), _Param("BLOCK"), _Param("EVEN", True)]
        self.log: list = []
        self.warmups = 0
        self.warmup_error = warmup_error
        self.launcher_fails = launcher_fails

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.log.append(("normal", grid, args, kwargs))

    def warmup(self, *args, grid, **kwargs):
        self.warmups += 1
        if self.warmup_error:
            raise self.warmup_error
        return FakeCompiled(self.log, fail=self.launcher_fails)


@pytest.fixture
def on(monkeypatch):
    """Direct launches on, the stand-in accepted as a JITFunction, no GPU streams."""
    monkeypatch.setenv("ATOM_TRITON_DIRECT_LAUNCH", "1")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(_launch, "_is_jit_function", lambda k: isinstance(k, FakeKernel))
    monkeypatch.setattr(_launch, "_stream_getters", lambda: (lambda: 0, lambda dev: f"stream{dev}"))
    monkeypatch.setattr(_launch, "_launchers", {})
    for key in [k for k in _warned if k.startswith("direct-launch:")]:
        _warned.discard(key)


def test_first_call_per_variant_launches_normally_then_directly_with_the_constexpr_tail(on):
    k = FakeKernel()
    x = torch.zeros(32)
    launcher = _launch.direct(k)
    assert launcher is not k and _launch.direct(k) is launcher  # one launcher per kernel
    launcher[(4,)](x, 100, BLOCK=16)
    launcher[(5, 2)](x, 100, BLOCK=16)
    launcher[(6,)](x[1:], 100, BLOCK=16)  # unaligned: a new variant
    launcher[(7,)](x, 100, BLOCK=16, EVEN=False)  # another constexpr value: a new variant
    launcher[(8,)](x, 100, BLOCK=16, EVEN=False)
    kinds = [entry[0] for entry in k.log]
    assert kinds == ["normal", "direct", "normal", "normal", "direct"]
    _, grid, args, stream = k.log[1]
    assert grid == (5, 2, 1) and stream == "stream0"
    assert args == (x, 100, 16, True)  # positional arguments, then BLOCK, then EVEN's default
    assert k.log[4][2] == (x, 100, 16, False)
    assert k.warmups == 3 and len(launcher.compiled) == 3


@pytest.fixture
def warnings(monkeypatch):
    """The warnings ``_launch`` logs once per key (what reaches atom's logger)."""
    seen: list = []
    real = _launch.warn_once
    monkeypatch.setattr(_launch, "warn_once", lambda key, message, logger=None: (
        seen.append(message) if key not in _warned else None, real(key, message, logger)))
    return seen


def test_warmup_that_fails_means_normal_launches_for_good_with_one_warning(on, warnings):
    k = FakeKernel(warmup_error=TypeError("warmup() got an unexpected keyword argument 'grid'"))
    x = torch.zeros(32)
    for _ in range(3):
        _launch.direct(k)[(1,)](x, 7, BLOCK=16)
    assert [e[0] for e in k.log] == ["normal"] * 3
    assert k.warmups == 1  # not asked again
    assert len(warnings) == 1 and "direct Triton launches of fake_kernel are off" in warnings[0]


def test_launcher_that_refuses_the_arguments_means_normal_launches_for_good(on, warnings):
    k = FakeKernel(launcher_fails=True)
    x = torch.zeros(32)
    for _ in range(4):
        _launch.direct(k)[(1,)](x, 7, BLOCK=16)
    # the refused direct launch is replaced by a normal one: every call launched exactly once
    assert [e[0] for e in k.log] == ["normal"] * 4
    assert _launch.direct(k).failed
    assert len(warnings) == 1 and "are off for this process (TypeError" in warnings[0]


def test_a_kernel_without_readable_parameters_launches_normally(on):
    k = FakeKernel()
    del k.params
    x = torch.zeros(32)
    for _ in range(2):
        _launch.direct(k)[(1,)](x, 7, BLOCK=16)
    assert [e[0] for e in k.log] == ["normal", "normal"] and k.warmups == 0


def test_missing_argument_without_default_is_not_launched_directly(on):
    k = FakeKernel()
    x = torch.zeros(32)
    for _ in range(2):
        _launch.direct(k)[(1,)](x, 7)  # BLOCK missing: Triton's own launch decides (here: the stand-in)
    assert [e[0] for e in k.log] == ["normal", "normal"]


def test_the_variant_table_is_bounded(on, monkeypatch):
    monkeypatch.setattr(_launch, "MAX_KEYS", 3)
    k = FakeKernel()
    x = torch.zeros(32)
    launcher = _launch.direct(k)
    for n in range(5):
        launcher[(1,)](x, n, BLOCK=16)
    assert len(launcher.compiled) <= 3


def test_off_interpreted_or_not_triton_returns_the_kernel_itself(on, monkeypatch):
    k = FakeKernel()
    monkeypatch.delenv("ATOM_TRITON_DIRECT_LAUNCH")
    assert _launch.direct(k) is k
    monkeypatch.setenv("ATOM_TRITON_DIRECT_LAUNCH", "0")
    assert _launch.direct(k) is k
    monkeypatch.setenv("ATOM_TRITON_DIRECT_LAUNCH", "1")
    assert _launch.direct(k) is not k
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert _launch.direct(k) is k
    monkeypatch.delenv("TRITON_INTERPRET")
    plain = object()
    assert _launch.direct(plain) is plain
    monkeypatch.setenv("ATOM_TRITON_DIRECT_LAUNCH", "maybe")
    with pytest.raises(ValueError, match="ATOM_TRITON_DIRECT_LAUNCH"):
        _launch.direct(k)


def test_the_real_is_jit_function_check():
    from triton.runtime.jit import JITFunction

    from atom.ops import attention_triton as at

    assert _launch._is_jit_function(JITFunction(at._prefill_kernel.fn))
    assert not _launch._is_jit_function(FakeKernel())


# ---------------------------------------------------------------------------------------------
# atom's launch sites against the real kernels' parameters
# ---------------------------------------------------------------------------------------------


def _checking_direct(seen: list):
    """``direct`` for the launch sites: checks each call's arguments against the real
    ``JITFunction``'s parameters (positional ones, then the tail a direct launch would append),
    then launches the kernel as given (the interpreter on a CPU)."""
    from triton.runtime.jit import JITFunction

    def wrap(kernel):
        jit = JITFunction(getattr(kernel, "fn", kernel))
        launcher = _launch.DirectLauncher(jit)
        names = [p.name for p in jit.params]

        class Checked:
            def __getitem__(self, grid):
                def run(*args, **kwargs):
                    tail = launcher.tail(len(args), kwargs)
                    assert len(args) + len(tail) == len(names)
                    for name, value in zip(names[len(args):], tail):
                        assert value is (kwargs[name] if name in kwargs else jit.params[names.index(name)].default)
                    assert set(kwargs) - set(names) <= {"num_warps", "num_stages"}
                    seen.append(jit.fn.__name__)
                    return kernel[grid](*args, **kwargs)
                return run
        return Checked()
    return wrap


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU form of the GPU test below")
def test_attention_launch_sites_pass_what_a_direct_launch_binds(monkeypatch):
    from atom.ops import attention_triton as at
    from atom.ops import kv_cache_triton as kt

    seen: list = []
    monkeypatch.setattr(at, "direct_launch", _checking_direct(seen))
    monkeypatch.setattr(kt, "direct_launch", _checking_direct(seen))
    batch = _batch(torch.float32, "cpu", decodes=3, prefills=1, ctx=40, page=16, heads=4, kv_heads=2, d=32)
    _run(batch, num_splits=3)
    assert set(seen) == {"_reshape_and_cache_kernel", "_prefill_kernel", "_decode_kernel", "_split_kv_reduce_kernel"}


# ---------------------------------------------------------------------------------------------
# GPU: the real launches
# ---------------------------------------------------------------------------------------------


def _batch(dtype, device, *, decodes, prefills, ctx, page, heads, kv_heads, d, prefill_len=37, offset=0):
    g = torch.Generator(device="cpu").manual_seed(decodes * 131 + prefills)
    q_lens = [1] * decodes + [prefill_len] * prefills
    seqs = len(q_lens)
    lens = [ctx + 7 * i for i in range(decodes)] + [prefill_len] * prefills
    blocks = [-(-n // page) for n in lens]
    table = torch.zeros(seqs, max(blocks), dtype=torch.int32)
    perm = torch.randperm(sum(blocks), generator=g).int()
    at = 0
    for i, n in enumerate(blocks):
        table[i, :n] = perm[at:at + n]
        at += n
    qsl = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
    tokens = int(qsl[-1])
    # q / k / v start ``offset`` elements into their buffers: unaligned when it is not a multiple of 8
    def rnd(*shape):  # ``offset`` elements into a buffer on the device
        n = torch.Size(shape).numel()
        buf = torch.randn(n + offset, generator=g).to(dtype=dtype, device=device)
        return buf[offset:].view(*shape)

    q, k, v = rnd(tokens, heads, d), rnd(tokens, kv_heads, d), rnd(tokens, kv_heads, d)
    cache = torch.randn(2, sum(blocks) + 1, page, kv_heads, d, generator=g)
    slots = []
    for i, n in enumerate(lens):  # each row's new tokens sit at its last q_lens[i] positions
        for pos in range(n - q_lens[i], n):
            slots.append(int(table[i, pos // page]) * page + pos % page)
    to = dict(device=device)
    return dict(q=q, k=k, v=v, cache=cache.to(dtype=dtype, **to), table=table.to(**to), seq_lens=torch.tensor(lens, dtype=torch.int32, **to),
                qsl=qsl.to(**to), slots=torch.tensor(slots, dtype=torch.int64, **to), max_q=max(q_lens), max_seq=max(lens))


def _run(b, num_splits=None):
    from atom.ops import attention_triton as at
    from atom.ops import kv_cache_triton as kt

    cache = b["cache"].clone()
    kt.reshape_and_cache_launch(b["k"], b["v"], cache[0], cache[1], b["slots"], False, None, None)
    out = at.paged_attention_fwd(b["q"], cache[0], cache[1], b["table"], b["seq_lens"], b["qsl"], b["max_q"],
                                 b["max_seq"], b["q"].shape[-1] ** -0.5, num_splits=num_splits)
    return cache, out


_GPU_CASES = [  # (decodes, prefills, ctx, num_splits, offset)
    (7, 0, 300, None, 0), (7, 0, 300, 5, 0), (3, 2, 129, None, 0), (3, 2, 129, 1, 0),
    (40, 1, 700, None, 0), (5, 1, 64, 3, 1), (1, 0, 2000, None, 3),
]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (Triton's launcher)")
def test_gpu_direct_launches_give_the_normal_launches_outputs_bit_for_bit(monkeypatch):
    from atom.ops import attention_triton as at

    monkeypatch.setattr(_launch, "_launchers", {})
    batches = [_batch(torch.bfloat16, "cuda", decodes=dc, prefills=pf, ctx=ctx, page=16, heads=32, kv_heads=8, d=128,
                      offset=off) for dc, pf, ctx, _, off in _GPU_CASES]
    monkeypatch.delenv("ATOM_TRITON_DIRECT_LAUNCH", raising=False)
    want = [_run(b, splits) for b, (*_, splits, _) in zip(batches, _GPU_CASES)]
    monkeypatch.setenv("ATOM_TRITON_DIRECT_LAUNCH", "1")
    for _ in range(3):  # the first call per variant launches normally; the next ones directly
        got = [_run(b, splits) for b, (*_, splits, _) in zip(batches, _GPU_CASES)]
        for (wc, wo), (gc, go) in zip(want, got):
            assert torch.equal(wc, gc) and torch.equal(wo, go)
    launchers = {d.kernel.fn.__name__: d for d in _launch._launchers.values()}
    assert set(launchers) == {"_reshape_and_cache_kernel", "_prefill_kernel", "_decode_kernel", "_split_kv_reduce_kernel"}
    assert not any(d.failed for d in launchers.values())
    assert all(d.compiled for d in launchers.values())
    # an unaligned q is its own variant: the decode kernel kept more than one
    assert len(launchers["_decode_kernel"].compiled) >= 2
    assert at._decode_kernel is launchers["_decode_kernel"].kernel


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (Triton's compile caches)")
def test_gpu_no_compile_after_warm_up_with_direct_launches(monkeypatch):
    from atom.ops import attention as attention_op
    from atom.ops import attention_triton as at

    monkeypatch.setenv("ATOM_TRITON_DIRECT_LAUNCH", "1")
    monkeypatch.setattr(_launch, "_launchers", {})
    attention_op.warm_up_paged_attention(32, 8, 128, torch.bfloat16, 16, "cuda")
    kernels = (at._prefill_kernel, at._decode_kernel, at._split_kv_reduce_kernel)

    def compiled():
        return [sum(len(c[0]) for c in k.device_caches.values()) for k in kernels]

    before = compiled()
    for dc, pf, ctx, splits, _ in _GPU_CASES:
        b = _batch(torch.bfloat16, "cuda", decodes=dc, prefills=pf, ctx=ctx, page=16, heads=32, kv_heads=8, d=128)
        for _ in range(2):
            _run(b, splits)
    torch.cuda.synchronize()
    assert compiled() == before
