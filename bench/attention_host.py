#!/usr/bin/env python
"""Host time of one attention layer call outside CUDA graphs: atom's vLLM impl against vLLM's
FlashAttention impl, on the same batch.

Under vLLM's default ``FULL_AND_PIECEWISE`` CUDA-graph mode a mixed prefill + decode step (and
any prefill step) replays the piecewise graphs and runs every layer's attention eagerly, between
them: ``impl.do_kv_cache_update`` then ``impl.forward``, once per layer. Their Python and kernel
launches are host time per layer and step; when a step's host time exceeds its GPU time the GPU
waits. This measures that call pair for each side, the way vLLM's layer makes it (the
``unified_*`` custom-op wrappers around them are vLLM's and the same for both sides, so they are
left out):

* **atom**: ``ATOMAttentionImpl`` (its decorators applied as the platform does) on the cache
  layout the running vLLM allocates, with the metadata atom's builder produces;
* **stock**: ``FlashAttentionImpl`` with ``FlashAttentionMetadata`` (no AOT scheduler metadata,
  no cascade), on FlashAttention's cache layout and stride order.

Per scenario and side (the sides' loops interleaved in one process, their order rotated each
repeat): ``host_us``, the median over ``--repeats`` of the wall time of ``--iters``
back-to-back call pairs launched without synchronising (the launch queue holds them, so this is
the host's cost while the GPU keeps up), and ``synced_us``, the same loop including the final
synchronisation (the larger of host and GPU time per call), and ``gpu_us``, the call's GPU time
alone (GPU only: each call's launches queued behind a GPU sleep, so the host's pace does not show,
timed with CUDA events; a call whose ``host_us`` exceeds it is host-bound, one whose
``synced_us`` is near it GPU-bound). Scenarios (Qwen3-8B attention: 32
query / 8 KV heads of 128, bf16, 16-token pages): ``mixed-256`` (255 decode rows with 200 tokens
of context + one 128-token prefill), ``mixed-64``, ``prefill-16x128`` and ``decode-256`` (the
last runs inside full graphs in a served engine; here eager, for reference).

    python bench/attention_host.py --json /tmp/out/attention_host.json            # GPU
    PYTHONPATH=/tmp/atom-old:$PYTHONPATH python bench/attention_host.py --sides atom --label atom-old
    python bench/attention_host.py --sides atom --stub-kernels --label atom-python  # the Python alone
    python bench/attention_host.py --launch-probe ...                              # + bare Triton launches
    python bench/attention_host.py --smoke --sides atom                             # CPU check
    python bench/attention_host.py --sides atom,atom-fa,stock   # + atom on FlashAttention 3, all in one process
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Optional

import torch

HEADS, KV_HEADS, HEAD_DIM, PAGE = 32, 8, 128, 16
SMOKE = dict(heads=4, kv_heads=2, head_dim=32, page=16)


@dataclass(frozen=True)
class Scenario:
    """``decodes`` rows of one new token after ``ctx`` cached tokens, then ``prefills`` rows of
    ``prefill_len`` new tokens with no context."""

    name: str
    decodes: int
    ctx: int
    prefills: int
    prefill_len: int


SCENARIOS = (
    Scenario("mixed-256", 255, 200, 1, 128),
    Scenario("mixed-64", 63, 200, 1, 128),
    Scenario("prefill-16x128", 0, 0, 16, 128),
    Scenario("decode-256", 256, 200, 0, 0),
)
SMOKE_SCENARIOS = (Scenario("mixed-smoke", 5, 21, 2, 7),)


@dataclass
class Batch:
    """One step's tensors for a scenario: queries and new keys / values ``[T, heads, D]``, and
    the paged layout (``block_table`` rows of consecutive private blocks, ``slot_mapping`` of
    the new tokens)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    num_blocks: int
    page: int
    max_query_len: int
    max_seq_len: int
    # every request's cached context (keys / values of its first seq_len - q_len tokens)
    ctx_k: list
    ctx_v: list


def build_batch(sc: Scenario, heads: int, kv_heads: int, head_dim: int, page: int, dtype: torch.dtype,
                device: str, seed: int = 0) -> Batch:
    g = torch.Generator().manual_seed(seed)
    rows = [(sc.ctx, 1)] * sc.decodes + [(0, sc.prefill_len)] * sc.prefills
    q_lens = [n for _, n in rows]
    seq_lens = [c + n for c, n in rows]
    per_req = max(-(-s // page) for s in seq_lens)
    table = torch.arange(len(rows) * per_req, dtype=torch.int32).view(len(rows), per_req)
    slots = []
    for r, (c, n) in enumerate(rows):
        slots += [int(table[r, p // page]) * page + p % page for p in range(c, c + n)]
    t = sum(q_lens)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    qsl = [0]
    for n in q_lens:
        qsl.append(qsl[-1] + n)
    return Batch(
        q=rnd(t, heads, head_dim).to(device), k=rnd(t, kv_heads, head_dim).to(device),
        v=rnd(t, kv_heads, head_dim).to(device),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_table=table.to(device), slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        num_blocks=len(rows) * per_req + 1, page=page, max_query_len=max(q_lens), max_seq_len=max(seq_lens),
        ctx_k=[rnd(c, kv_heads, head_dim).to(device) for c, _ in rows],
        ctx_v=[rnd(c, kv_heads, head_dim).to(device) for c, _ in rows],
    )


def _ctx_slots(b: Batch, r: int) -> torch.Tensor:
    """Slots of request ``r``'s cached context (its first ``seq_len - q_len`` tokens)."""
    c, page = b.ctx_k[r].shape[0], b.page
    return torch.tensor([int(b.block_table[r, p // page]) * page + p % page for p in range(c)],
                        dtype=torch.int64, device=b.q.device)


def _cache_view(shape: tuple, stride_order: tuple, dtype: torch.dtype, device: str) -> torch.Tensor:
    """A tensor of logical ``shape`` laid out physically in ``stride_order`` (as vLLM allocates)."""
    physical = torch.zeros([shape[i] for i in stride_order], dtype=dtype, device=device)
    return physical.permute(*[stride_order.index(i) for i in range(len(shape))])


# -- the sides ------------------------------------------------------------------------------------
def atom_side(b: Batch, heads: int, kv_heads: int, head_dim: int, page: int, dtype: torch.dtype,
              device: str, host_prefill: bool = False) -> Callable[[], torch.Tensor]:
    """atom's impl as vLLM calls it; returns one step's call pair (output tensor). With
    ``host_prefill`` its steps with multi-token rows run on vLLM's FlashAttention 3
    (``ATOM_MHA_HOST_PREFILL=flash_attn``, offered to this layer only, whatever the variable says),
    so that both settings can be timed in one process."""
    from atom.patches import REGISTRY, Injection, apply
    from atom.plugin import catalog

    catalog.load()
    for record in REGISTRY.select("vllm.attention"):
        if isinstance(record, Injection):
            apply(record, enabled=True)
    from atom.models.attention import mha
    from atom.models.attention.mha import PagedAttentionMetadata
    from atom.plugin.vllm import compat, mha_prefill
    from atom.plugin.vllm.attention_mha import ATOMAttentionBackend, ATOMAttentionImpl

    impl = ATOMAttentionImpl(heads, head_dim, head_dim ** -0.5, kv_heads, None, None, "auto", None, "decoder", None)
    if host_prefill:
        offer = mha_prefill.flash_attn_prefill()  # what ATOM_MHA_HOST_PREFILL=flash_attn installs
        if offer is None:
            raise SystemExit("the atom-fa side needs vLLM's FlashAttention 3 (an NVIDIA Hopper GPU)")
        before = mha.host_prefill()
        mha.set_host_prefill(offer)
        try:
            impl.process_weights_after_loading(dtype)
        finally:
            mha.set_host_prefill(before)
        if impl.host_prefill is None:
            raise SystemExit(f"FlashAttention declined the layer: {impl.host_prefill_declined}")
    else:
        impl.process_weights_after_loading(dtype)
    if compat.has_get_kv_cache_shape():  # <= 0.28: the shape atom's backend asked for
        kv = torch.zeros(ATOMAttentionBackend.get_kv_cache_shape(b.num_blocks, page, kv_heads, head_dim),
                         dtype=dtype, device=device)
    else:  # >= 0.29: the logical [B, H, N, 2D] view in atom's first layout (token-major blocks)
        kv = _cache_view((b.num_blocks, kv_heads, page, 2 * head_dim), (0, 2, 1, 3), dtype, device)
    layer = SimpleNamespace()
    for r in range(len(b.ctx_k)):
        if b.ctx_k[r].shape[0]:
            impl.do_kv_cache_update(layer, b.ctx_k[r], b.ctx_v[r], kv, _ctx_slots(b, r))
    md = PagedAttentionMetadata(
        num_actual_tokens=b.q.shape[0], num_reqs=b.seq_lens.shape[0], max_query_len=b.max_query_len,
        max_seq_len=b.max_seq_len, query_start_loc=b.query_start_loc, seq_lens=b.seq_lens,
        block_table=b.block_table, slot_mapping=b.slot_mapping)
    out = torch.empty_like(b.q)

    def call() -> torch.Tensor:
        impl.do_kv_cache_update(layer, b.k, b.v, kv, b.slot_mapping)
        return impl.forward(layer, b.q, b.k, b.v, kv, md, out)

    return call


def stock_side(b: Batch, heads: int, kv_heads: int, head_dim: int, page: int, dtype: torch.dtype,
               device: str) -> Callable[[], torch.Tensor]:
    """vLLM's FlashAttention impl as its layer calls it (GPU only)."""
    from vllm.v1.attention.backends.flash_attn import (FlashAttentionBackend, FlashAttentionImpl,
                                                       FlashAttentionMetadata)

    impl = FlashAttentionImpl(heads, head_dim, head_dim ** -0.5, kv_heads, None, None, "auto")
    shape = FlashAttentionBackend.get_kv_cache_shape(b.num_blocks, page, kv_heads, head_dim)
    try:
        order = tuple(FlashAttentionBackend.get_kv_cache_stride_order())
    except (AttributeError, NotImplementedError):
        order = tuple(range(len(shape)))
    kv = _cache_view(tuple(shape), order, dtype, device)
    one = torch.ones((), dtype=torch.float32, device=device)
    layer = SimpleNamespace(_q_scale=one, _k_scale=one, _v_scale=one)
    for r in range(len(b.ctx_k)):
        if b.ctx_k[r].shape[0]:
            impl.do_kv_cache_update(layer, b.ctx_k[r], b.ctx_v[r], kv, _ctx_slots(b, r))
    md = FlashAttentionMetadata(
        num_actual_tokens=b.q.shape[0], max_query_len=b.max_query_len, query_start_loc=b.query_start_loc,
        max_seq_len=b.max_seq_len, seq_lens=b.seq_lens, block_table=b.block_table,
        slot_mapping=b.slot_mapping, use_cascade=False, common_prefix_len=0, cu_prefix_query_lens=None,
        prefix_kv_lens=None, suffix_kv_lens=None)
    out = torch.empty_like(b.q)

    def call() -> torch.Tensor:
        impl.do_kv_cache_update(layer, b.k, b.v, kv, b.slot_mapping)
        return impl.forward(layer, b.q, b.k, b.v, kv, md, out)

    return call


SIDES = {"atom": atom_side, "atom-fa": functools.partial(atom_side, host_prefill=True), "stock": stock_side}


class _NoLaunch:
    """Stands in for a ``@triton.jit`` kernel: ``kernel[grid](...)`` does nothing."""

    def __getitem__(self, grid: Any) -> Callable[..., None]:
        return lambda *args, **kwargs: None


#: (module, kernel) of every Triton kernel atom's eager MHA attention launches
ATTENTION_KERNELS = tuple(("atom.ops.attention_triton", k) for k in ("_prefill_kernel", "_decode_kernel",
                                                                     "_split_kv_reduce_kernel")) + \
    (("atom.ops.kv_cache_triton", "_reshape_and_cache_kernel"),)


def stub_atom_kernels() -> None:
    """Replace :data:`ATTENTION_KERNELS` with no-ops (their warm-up, at
    ``process_weights_after_loading``, then launches nothing either)."""
    import importlib

    for module, name in ATTENTION_KERNELS:
        setattr(importlib.import_module(module), name, _NoLaunch())


def launch_probe(iters: int, repeats: int) -> dict:
    """Host microseconds per launch of a trivial Triton kernel taking 1 pointer, and taking 1
    pointer + 31 integers (about what atom's attention kernels take), plus torch's ``add_`` as
    a C++ op for scale."""
    import triton
    import triton.language as tl

    @triton.jit
    def one(x_ptr):
        tl.store(x_ptr + tl.program_id(0), 1.0)

    @triton.jit
    def many(x_ptr, a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15, a16, a17, a18,
             a19, a20, a21, a22, a23, a24, a25, a26, a27, a28, a29, a30, B: tl.constexpr, C: tl.constexpr):
        tl.store(x_ptr + tl.program_id(0), (a0 + a30 + B + C).to(tl.float32))

    x = torch.zeros(64, device="cuda")
    ints = list(range(3, 34))
    out = {}
    for name, fn in (("triton_1_arg", lambda: one[(1,)](x)),
                     ("triton_32_args", lambda: many[(1,)](x, *ints, B=4, C=8)),
                     ("torch_add_", lambda: x.add_(1.0))):
        out[name] = time_calls(fn, iters, repeats, torch.cuda.synchronize)["host_us"]
        print(f"launch probe {name:16s} host {out[name]:6.1f} us", flush=True)
    return out


def reference(b: Batch) -> torch.Tensor:
    """The batch's attention in float32 by atom's torch reference
    (:func:`atom.ops.attention.paged_attention_torch`) over a float32 NHD cache holding every
    request's context and new tokens, written by the cache op's reference
    (:func:`atom.ops.kv_cache.cache_reference_`)."""
    from atom.ops.attention import paged_attention_torch
    from atom.ops.kv_cache import cache_reference_

    kc = torch.zeros(b.num_blocks, b.page, *b.k.shape[1:], device=b.q.device)
    vc = torch.zeros_like(kc)
    for r in range(len(b.ctx_k)):
        for src, cache in ((b.ctx_k[r], kc), (b.ctx_v[r], vc)):
            cache_reference_(src.float(), cache, _ctx_slots(b, r), None)
    for src, cache in ((b.k, kc), (b.v, vc)):
        cache_reference_(src.float(), cache, b.slot_mapping, None)
    return paged_attention_torch(b.q.float(), kc, vc, b.block_table, b.seq_lens, b.query_start_loc,
                                 b.max_query_len, b.max_seq_len, b.q.shape[-1] ** -0.5)


def time_calls(call: Callable[[], Any], iters: int, repeats: int, sync: Callable[[], None]) -> dict:
    """Median host and synced microseconds per call over ``repeats`` loops of ``iters`` calls."""
    return time_interleaved({"call": call}, iters, repeats, sync)["call"]


def time_interleaved(calls: dict[str, Callable[[], Any]], iters: int, repeats: int,
                     sync: Callable[[], None]) -> dict[str, dict]:
    """:func:`time_calls` for several sides at once, their loops interleaved: each repeat times one
    loop of every side, in an order rotated by one side per repeat, so that a drift of the host's
    speed (up to 2x between processes on the GPU machine, bench/NOTES.md entry 52) reaches every
    side alike."""
    names = list(calls)
    for name in names:
        for _ in range(3):
            calls[name]()
    sync()
    host: dict[str, list] = {n: [] for n in names}
    synced: dict[str, list] = {n: [] for n in names}
    for r in range(repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:
            call = calls[name]
            t0 = time.perf_counter()
            for _ in range(iters):
                call()
            t1 = time.perf_counter()
            sync()
            t2 = time.perf_counter()
            host[name].append(1e6 * (t1 - t0) / iters)
            synced[name].append(1e6 * (t2 - t0) / iters)
    return {n: {"host_us": statistics.median(host[n]), "host_us_range": [min(host[n]), max(host[n])],
                "synced_us": statistics.median(synced[n]), "iters": iters, "repeats": repeats,
                "interleaved": names} for n in names}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sides", default="atom,stock",
                    help="of atom, atom-fa (atom with its multi-token steps on vLLM's FlashAttention 3), stock; "
                         "timed interleaved in this process")
    ap.add_argument("--label", default="", help="name of the atom side in the output (e.g. atom-old)")
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU, fp32 (a check of the script)")
    ap.add_argument("--stub-kernels", action="store_true",
                    help="atom's attention and cache-write launches become no-ops (after the warm-up): "
                         "what remains is the Python around them (outputs are then wrong)")
    ap.add_argument("--launch-probe", action="store_true",
                    help="also time bare launches of a Triton kernel with 1 and with 32 arguments")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if args.smoke:
        dims, scenarios, dtype, device = SMOKE, SMOKE_SCENARIOS, torch.float32, "cpu"
    else:
        dims, scenarios, dtype, device = (dict(heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM, page=PAGE),
                                          SCENARIOS, torch.bfloat16, "cuda")
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    result: dict = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "dims": dims,
                    "dtype": str(dtype), "scenarios": {}}
    import atom
    result["atom_source"] = str(Path(atom.__file__).parent)  # which tree the atom side imported
    try:
        import vllm
        result["vllm"] = vllm.__version__
    except ImportError:
        pass
    try:
        import triton
        n, t0 = 20000, time.perf_counter()
        for _ in range(n):
            triton.cdiv(1000, 16)
        result["triton"] = {"version": triton.__version__, "cdiv_us": 1e6 * (time.perf_counter() - t0) / n}
    except ImportError:
        pass
    if args.launch_probe and device == "cuda":
        result["launch_probe"] = launch_probe(args.iters, args.repeats)
    if args.stub_kernels:
        stub_atom_kernels()
        result["stubbed"] = True
    ctx = contextlib.nullcontext()
    if "stock" in args.sides.split(","):  # vLLM's impl reads the current config (cache layout)
        from vllm.config import VllmConfig, set_current_vllm_config

        ctx = set_current_vllm_config(VllmConfig())
    from atom.ops import _launch

    result["direct_launch"] = _launch.enabled()  # ATOM_TRITON_DIRECT_LAUNCH (atom.ops._launch)
    with ctx:
        run_scenarios(args, scenarios, dims, dtype, device, sync, result)
    from atom.models.attention.mha import host_prefill

    # ATOM_MHA_HOST_PREFILL: the host kernel the atom side's steps with multi-token rows ran on
    # (the atom-fa side's: FlashAttention 3 whatever this says)
    result["mha_host_prefill"] = getattr(host_prefill(), "name", None)
    # per kernel launched directly: the variants it keeps, and whether it fell back to normal launches
    result["direct_launchers"] = {getattr(d.kernel, "__name__", "?"): {"variants": len(d.compiled), "failed": d.failed}
                                  for d in _launch._launchers.values()}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))
    return 0


def gpu_time_us(call: Callable[[], Any], repeats: int, device: str) -> Optional[float]:
    """Median GPU microseconds of one call with its launches queued behind a 2 ms GPU sleep (the
    host has enqueued them all before the GPU reaches the first: CUDA events then time the kernels
    alone); None off CUDA."""
    if device != "cuda":
        return None
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        torch.cuda._sleep(4_000_000)  # ~2 ms at ~2 GHz, well above one call's host time
        start.record()
        call()
        end.record()
        torch.cuda.synchronize()
        times.append(1e3 * start.elapsed_time(end))
    return statistics.median(times)


def run_scenarios(args: argparse.Namespace, scenarios: tuple, dims: dict, dtype: torch.dtype, device: str,
                  sync: Callable[[], None], result: dict) -> None:
    for sc in scenarios:
        b = build_batch(sc, **dims, dtype=dtype, device=device)
        want = reference(b)
        cell = result["scenarios"][sc.name] = {"tokens": int(b.q.shape[0]), "requests": int(b.seq_lens.shape[0])}
        calls, errors = {}, {}
        for side in args.sides.split(","):
            name = (args.label or side) if side == "atom" else side
            calls[name] = SIDES[side](b, **dims, dtype=dtype, device=device)
            errors[name] = (calls[name]().float() - want).abs().max().item()
        timings = time_interleaved(calls, args.iters, args.repeats, sync)
        for name, call in calls.items():
            timing, err = timings[name], errors[name]
            try:
                timing["gpu_us"] = gpu_time_us(call, args.repeats, device)
            except (RuntimeError, AttributeError) as e:  # a diagnostic: never the run's end
                timing["gpu_us"], timing["gpu_us_error"] = None, repr(e)
            cell[name] = dict(timing, max_abs_err=err)
            gpu = "" if timing["gpu_us"] is None else f"  gpu {timing['gpu_us']:7.1f} us"
            print(f"{sc.name:16s} {name:10s} host {timing['host_us']:7.1f} us  synced {timing['synced_us']:7.1f} us{gpu}"
                  f"  (host range {timing['host_us_range'][0]:.1f}-{timing['host_us_range'][1]:.1f}; max |err| {err:.2e})",
                  flush=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
