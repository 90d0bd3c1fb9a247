#!/usr/bin/env python
"""Benchmark atom's compute ops on one GPU: paged decode/prefill attention, MLA decode, fused MoE.

For every case it times atom's Triton kernel, the torch reference, and vLLM's kernel for the
same work when ``import vllm`` works (FlashAttention with a block table, the Triton MLA decode
kernel, ``fused_experts``), checks atom's output against the reference, and prints one table
with bytes moved / FLOPs and the fraction of the roofline measured in the same run (device
copy bandwidth for memory-bound cases, a large bf16 ``torch.matmul`` for compute-bound ones).

GPU times are per call with a cold L2 (a 256 MiB buffer is rewritten before every call) and
without launch overhead (N calls captured in a CUDA graph, minus the flushes alone); callables
that cannot be captured (the torch references synchronise with the host) are timed eagerly
with CUDA events.

    python bench/ops_compute.py                     # all cases (H100: a few minutes)
    python bench/ops_compute.py --ops decode,moe --json out.json
    python bench/ops_compute.py --dry-run           # tiny shapes on CPU (Triton interpreter)

Cases: paged decode (Qwen3-8B: 32 q / 8 kv heads, D=128, block 16; batch 1/32/128 x context
2k/8k), prefill (one 4096-token causal sequence, same dims), MLA decode (128 heads, 512+64
latent, batch 32/128 x context 2k/8k), fused MoE (Qwen3-30B-A3B: 128 experts, top-8, hidden
2048, inter 768; batch 1..256 and 4096), and one EP=2 rank of those experts (64 local; atom's tiles
by pairs per local expert vs by the global count). vLLM imports are all guarded: a missing vLLM or
kernel leaves its column empty with the reason in the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

OPS = ("decode", "prefill", "mla", "moe", "moe_fp8", "moe_tiles", "moe_ep", "moe_edges")
#: ops that sweep tiles rather than time atom's choice (asked for by name only)
SWEEPS = ("moe_edges",)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Time atom's Triton compute kernels against the torch reference and vLLM.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--ops", default=",".join(o for o in OPS if o not in SWEEPS),
                   help=f"comma-separated subset of {', '.join(OPS)} (the default leaves out the "
                        f"tile sweeps {', '.join(SWEEPS)})")
    p.add_argument("--json", metavar="PATH", help="also write the results (and peaks) as JSON")
    p.add_argument("--iters", type=int, default=20, help="calls per timing sample (graph mode)")
    p.add_argument("--no-torch", action="store_true", help="skip timing the torch references "
                   "(they are still run once for the correctness check unless --no-check)")
    p.add_argument("--no-check", action="store_true", help="skip the correctness check")
    p.add_argument("--no-vllm", action="store_true", help="do not try vLLM's kernels")
    p.add_argument("--eager", action="store_true", help="time eagerly (no CUDA graphs)")
    p.add_argument("--dry-run", action="store_true",
                   help="tiny shapes on CPU under TRITON_INTERPRET=1: checks the script, not speed")
    return p.parse_args(argv)


# -- timing ------------------------------------------------------------------------------------


class Timer:
    """Per-call GPU time in microseconds (see module doc), or wall time on CPU."""

    def __init__(self, torch, device, iters: int, use_graphs: bool):
        self.torch, self.device, self.iters, self.use_graphs = torch, device, iters, use_graphs
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.flush_buf = torch.empty(256 << 20, dtype=torch.uint8, device=device)

    def _flush(self) -> None:
        self.flush_buf.zero_()

    def _events(self):
        return (self.torch.cuda.Event(enable_timing=True), self.torch.cuda.Event(enable_timing=True))

    def _graph_us(self, fn: Callable[[], Any]) -> float:
        torch = self.torch
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up outside capture (allocator, autotuning)
            fn()
            fn()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        work, flush_only = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        with torch.cuda.graph(work):
            for _ in range(self.iters):
                self._flush()
                fn()
        with torch.cuda.graph(flush_only):
            for _ in range(self.iters):
                self._flush()

        def replay(graph) -> float:
            samples = []
            for _ in range(5):
                start, end = self._events()
                start.record()
                graph.replay()
                end.record()
                torch.cuda.synchronize()
                samples.append(start.elapsed_time(end))
            return statistics.median(samples)

        replay(work)
        total, flush = replay(work), replay(flush_only)
        return max(total - flush, 0.0) * 1e3 / self.iters

    def _eager_us(self, fn: Callable[[], Any], reps: int) -> float:
        torch = self.torch
        fn()
        torch.cuda.synchronize()
        samples = []
        for _ in range(reps):
            self._flush()
            start, end = self._events()
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            samples.append(start.elapsed_time(end))
        return statistics.median(samples) * 1e3

    def __call__(self, fn: Callable[[], Any], graph: bool = True, reps: int = 10) -> float:
        if not self.cuda:
            fn()
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e6
        if graph and self.use_graphs:
            try:
                return self._graph_us(fn)
            except Exception:  # not capturable (host sync inside): fall back to events
                self.torch.cuda.synchronize()
        return self._eager_us(fn, reps)


def measure_peaks(torch, device, timer: Timer, dry: bool) -> dict:
    """Device copy bandwidth (read + write bytes / time), read bandwidth (a ``sum`` over the same
    bytes: the bound of weight-streaming kernels; the H200's copy measured 2.7 TB/s, its read 4.2)
    and dense bf16 matmul rate."""
    n = (1 << 20) if dry else (1 << 30)
    src = torch.empty(n, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    copy_us = timer(lambda: dst.copy_(src))
    ones = torch.ones(n // 4, dtype=torch.float32, device=device)
    read_us = timer(lambda: ones.sum())
    m = 256 if dry else 8192
    dt = torch.float32 if dry else torch.bfloat16
    a = torch.randn(m, m, device=device, dtype=dt)
    b = torch.randn(m, m, device=device, dtype=dt)
    mm_us = timer(lambda: torch.matmul(a, b))
    del src, dst, ones, a, b
    return dict(copy_GBps=2 * n / copy_us / 1e3, read_GBps=n / read_us / 1e3, matmul_TFLOPs=2 * m ** 3 / mm_us / 1e6)


# -- results -----------------------------------------------------------------------------------


@dataclass
class Row:
    op: str
    case: str
    bytes: float  # minimal HBM traffic of the op
    flops: float
    bound: str  # "memory" or "compute": which roofline the fraction uses
    atom_us: Optional[float] = None
    torch_us: Optional[float] = None
    vllm_us: Optional[float] = None
    max_err: Optional[float] = None
    notes: dict = field(default_factory=dict)

    def derived(self, peaks: dict) -> dict:
        d: dict = {}
        if self.atom_us:
            d["atom_GBps"] = self.bytes / self.atom_us / 1e3
            d["atom_TFLOPs"] = self.flops / self.atom_us / 1e6
            if self.bound == "memory":
                d["roofline_frac"] = d["atom_GBps"] / peaks["copy_GBps"]
            else:
                d["roofline_frac"] = d["atom_TFLOPs"] / peaks["matmul_TFLOPs"]
            if self.vllm_us:
                d["speedup_vs_vllm"] = self.vllm_us / self.atom_us
            if self.torch_us:
                d["speedup_vs_torch"] = self.torch_us / self.atom_us
        return d


def fmt(v: Optional[float], spec: str = ".1f") -> str:
    return "-" if v is None else format(v, spec)


def print_table(rows: list[Row], peaks: dict, device_name: str) -> None:
    print(f"\n{device_name}: copy {peaks['copy_GBps']:.0f} GB/s, bf16 matmul "
          f"{peaks['matmul_TFLOPs']:.0f} TFLOP/s (measured)\n")
    head = ["op", "case", "atom us", "torch us", "vllm us", "x vllm", "MB", "GFLOP", "GB/s",
            "TFLOP/s", "roofline", "max err"]
    table = [head]
    for r in rows:
        d = r.derived(peaks)
        table.append([
            r.op, r.case, fmt(r.atom_us), fmt(r.torch_us), fmt(r.vllm_us),
            fmt(d.get("speedup_vs_vllm"), ".2f"), fmt(r.bytes / 1e6, ".1f"),
            fmt(r.flops / 1e9, ".2f"), fmt(d.get("atom_GBps"), ".0f"), fmt(d.get("atom_TFLOPs"), ".1f"),
            (f"{d['roofline_frac']:.0%} {r.bound[:3]}" if "roofline_frac" in d else "-"),
            fmt(r.max_err, ".1e"),
        ])
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    for k, row in enumerate(table):
        print("  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))))
        if k == 0:
            print("  ".join("-" * w for w in widths))
    notes = [(r.op, r.case, r.notes["vllm"]) for r in rows if "vllm" in r.notes]
    if notes:
        print("\nvLLM not timed:")
        for op, case, why in dict.fromkeys(notes):
            print(f"  {op} {case}: {why}")


# -- helpers -----------------------------------------------------------------------------------


def _err(a, b) -> float:
    return (a.float() - b.float()).abs().max().item()


class Bench:
    def __init__(self, args: argparse.Namespace):
        import torch

        self.torch = torch
        self.args = args
        self.dry = args.dry_run
        self.device = torch.device("cpu" if self.dry else "cuda")
        self.dtype = torch.float32 if self.dry else torch.bfloat16
        self.timer = Timer(torch, self.device, 2 if self.dry else args.iters, not args.eager)
        self.rows: list[Row] = []
        self.vllm_ok = False
        if not args.no_vllm:
            try:
                import vllm  # noqa: F401

                self.vllm_ok = True
            except Exception as e:  # any import failure means "no vLLM column"
                self.vllm_missing = f"import vllm failed: {type(e).__name__}: {e}"
        else:
            self.vllm_missing = "--no-vllm"

    def run_case(self, row: Row, atom_fn, torch_fn, vllm_fn_factory=None, compare=None) -> None:
        """Time atom / torch / vLLM; ``compare(atom_out, torch_out)`` -> max error."""
        a = self.args
        out_atom = atom_fn()
        if not a.no_check and torch_fn is not None:
            ref = torch_fn()
            row.max_err = compare(out_atom, ref) if compare else _err(out_atom, ref)
        row.atom_us = self.timer(atom_fn)
        if not a.no_torch and torch_fn is not None:
            row.torch_us = self.timer(torch_fn, graph=False, reps=3)
        if vllm_fn_factory is not None:
            if not self.vllm_ok:
                row.notes["vllm"] = self.vllm_missing
            else:
                try:
                    fn = vllm_fn_factory()
                    fn()
                    row.vllm_us = self.timer(fn)
                except Exception as e:
                    row.notes["vllm"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
        self.rows.append(row)
        print(f"  {row.op:8s} {row.case:28s} atom {fmt(row.atom_us)} us"
              f"  torch {fmt(row.torch_us)} us  vllm {fmt(row.vllm_us)} us  err {fmt(row.max_err, '.1e')}",
              flush=True)

    # -- paged attention -------------------------------------------------------------------

    def _paged(self, batch: int, ctx: int, q_len: int, hq: int, hkv: int, d: int, bs: int,
               ragged: bool = False):
        """Paged q / KV cache / block table (pages in random order). ``ragged``: context lengths
        spread evenly over [ctx/2, ctx] (a serving batch) instead of all ``ctx``."""
        torch = self.torch
        blocks = -(-ctx // bs)
        nb = batch * blocks + 1
        kv = torch.randn(2, nb, bs, hkv, d, device=self.device, dtype=self.dtype)
        table = torch.randperm(nb - 1, device=self.device)[: batch * blocks].view(batch, blocks).int()
        if ragged:
            seq_lens = torch.linspace(ctx // 2, ctx, batch, device=self.device).round().int()
            seq_lens = seq_lens[torch.randperm(batch, device=self.device)]
        else:
            seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=self.device)
        q = torch.randn(batch * q_len, hq, d, device=self.device, dtype=self.dtype)
        qsl = torch.arange(0, batch + 1, dtype=torch.int32, device=self.device) * q_len
        return q, kv[0], kv[1], table, seq_lens, qsl

    def _vllm_fa(self, q, kc, vc, table, seq_lens, qsl, q_len, ctx, scale, out):
        def make():
            from vllm.vllm_flash_attn import flash_attn_varlen_func

            kwargs = {}
            version = _vllm_fa_version(q.shape[-1])
            if version is not None:
                kwargs["fa_version"] = version
            return lambda: flash_attn_varlen_func(
                q=q, k=kc, v=vc, max_seqlen_q=q_len, cu_seqlens_q=qsl, max_seqlen_k=ctx,
                seqused_k=seq_lens, softmax_scale=scale, causal=True, block_table=table, out=out,
                **kwargs)
        return make

    def decode(self) -> None:
        from atom.ops.attention import paged_attention

        hq, hkv, d, bs = 32, 8, 128, 16
        # (batch, context, ragged): the last cases are a serving decode step at C=256 with
        # contexts 1k-2k (1024/1024 cells of the end-to-end table).
        cases = [(2, 64, False), (3, 64, True)] if self.dry else (
            [(b, c, False) for c in (2048, 8192) for b in (1, 32, 128)] + [(256, 2048, False), (256, 2048, True)])
        el = self.torch.finfo(self.dtype).bits // 8
        for batch, ctx, ragged in cases:
            q, kc, vc, table, sl, qsl = self._paged(batch, ctx, 1, hq, hkv, d, bs, ragged)
            scale = d ** -0.5
            args = (q, kc, vc, table, sl, qsl, 1, ctx, scale)
            out = self.torch.empty_like(q)
            out_v = self.torch.empty_like(q)
            keys = int(sl.sum()) if ragged else batch * ctx
            row = Row("decode", f"b={batch} ctx={ctx // 2}-{ctx}" if ragged else f"b={batch} ctx={ctx}",
                      bytes=keys * hkv * d * 2 * el + 2 * q.numel() * el,
                      flops=4.0 * keys * hq * d, bound="memory")
            self.run_case(row, lambda: paged_attention.run("triton", *args, out=out),
                          lambda: paged_attention.run("torch", *args),
                          self._vllm_fa(q, kc, vc, table, sl, qsl, 1, ctx, scale, out_v))
            del q, kc, vc, table

    def prefill(self) -> None:
        from atom.ops.attention import paged_attention

        hq, hkv, d, bs = 32, 8, 128, 16
        t = 64 if self.dry else 4096
        q, kc, vc, table, sl, qsl = self._paged(1, t, t, hq, hkv, d, bs)
        scale = d ** -0.5
        args = (q, kc, vc, table, sl, qsl, t, t, scale)
        out = self.torch.empty_like(q)
        out_v = self.torch.empty_like(q)
        el = self.torch.finfo(self.dtype).bits // 8
        row = Row("prefill", f"T={t} causal",
                  bytes=(q.numel() * 2 + 2 * t * hkv * d) * el,
                  flops=4.0 * hq * d * t * (t + 1) / 2, bound="compute")
        self.run_case(row, lambda: paged_attention.run("triton", *args, out=out),
                      lambda: paged_attention.run("torch", *args),
                      self._vllm_fa(q, kc, vc, table, sl, qsl, t, t, scale, out_v))

    # -- MLA -------------------------------------------------------------------------------

    def mla(self) -> None:
        from atom.ops.mla import mla_decode

        torch = self.torch
        heads, rank, rope, bs = (16, 64, 16, 16) if self.dry else (128, 512, 64, 16)
        cases = [(2, 64)] if self.dry else [(b, c) for c in (2048, 8192) for b in (32, 128)]
        el = torch.finfo(self.dtype).bits // 8
        for batch, ctx in cases:
            blocks = -(-ctx // bs)
            nb = batch * blocks + 1
            cache = torch.randn(nb, bs, rank + rope, device=self.device, dtype=self.dtype)
            table = torch.randperm(nb - 1, device=self.device)[: batch * blocks].view(batch, blocks).int()
            sl = torch.full((batch,), ctx, dtype=torch.int32, device=self.device)
            qn = torch.randn(batch, heads, rank, device=self.device, dtype=self.dtype)
            qp = torch.randn(batch, heads, rope, device=self.device, dtype=self.dtype)
            scale = (rank + rope) ** -0.5
            out = torch.empty_like(qn)
            args = (qn, qp, cache, table, sl, scale)
            row = Row("mla", f"b={batch} ctx={ctx}",
                      bytes=(batch * ctx * (rank + rope) + batch * heads * (2 * rank + rope)) * el,
                      flops=2.0 * batch * heads * ctx * (2 * rank + rope), bound="memory")
            self.run_case(row, lambda: mla_decode.run("triton", *args, max_seq_len=ctx, out=out),
                          lambda: mla_decode.run("torch", *args),
                          self._vllm_mla(qn, qp, cache, table, sl, ctx, scale))
            if not self.dry:
                # vLLM's default MLA decode on Hopper is FlashMLA (page size 64): same work, its
                # own cache layout; a second row so both vLLM kernels are on the table.
                frow = Row("mla", f"b={batch} ctx={ctx} vs FlashMLA", bytes=row.bytes, flops=row.flops,
                           bound="memory")
                self.run_case(frow, lambda: mla_decode.run("triton", *args, max_seq_len=ctx, out=out),
                              None, self._vllm_flashmla(qn, qp, ctx, scale))
                # atom's decode rows as served on Hopper (ATOM_MLA_HOST_DECODE=auto): FlashMLA
                # offered by atom's vLLM plugin, on 64-token pages, q_pe copied into its query
                hosted = self._atom_flashmla(qn, qp, ctx, scale) if self.vllm_ok else None
                if hosted is not None:
                    hrow = Row("mla", f"b={batch} ctx={ctx} atom->FlashMLA", bytes=row.bytes, flops=row.flops,
                               bound="memory")
                    self.run_case(hrow, *hosted, self._vllm_flashmla(qn, qp, ctx, scale))
            del cache

    def _vllm_mla(self, qn, qp, cache, table, sl, ctx, scale):
        def make():
            import inspect

            torch = self.torch
            try:
                from vllm.v1.attention.ops.triton_decode_attention import decode_attention_fwd
            except ImportError:
                from vllm.attention.ops.triton_decode_attention import decode_attention_fwd
            import triton

            batch, heads, rank = qn.shape
            q = torch.cat([qn, qp], -1)
            kv = cache.unsqueeze(2)  # [blocks, bs, 1, rank + rope]
            v = kv[..., :rank]
            o = torch.empty(batch, heads, rank, dtype=q.dtype, device=q.device)
            # vLLM TritonMLAImpl's split rule: next_pow2(max_seq_len // 512), capped at 2 x SMs
            sms = torch.cuda.get_device_properties(q.device).multi_processor_count
            splits = min(triton.next_power_of_2(max(1, ctx // 512)), 2 * sms)
            logits = torch.empty(batch, heads, splits, rank + 1, dtype=torch.float32, device=q.device)
            params = inspect.signature(decode_attention_fwd).parameters
            page = cache.shape[1]
            if "lse" in params:
                lse = torch.empty(batch, heads, dtype=q.dtype, device=q.device)
                extra = {"is_mla": True} if "is_mla" in params else {}
                return lambda: decode_attention_fwd(q, kv, v, o, lse, table, sl, logits, splits,
                                                    scale, page, **extra)
            return lambda: decode_attention_fwd(q, kv, v, o, table, sl, logits, splits, scale, page)
        return make

    def _latent_pages(self, qn, qp, ctx, page):
        """A random latent cache of ``ctx`` tokens per sequence in ``page``-token pages (pages in
        random order): (cache ``[blocks, page, rank + rope]``, block table, sequence lengths)."""
        torch = self.torch
        batch, rank, rope = qn.shape[0], qn.shape[-1], qp.shape[-1]
        blocks = -(-ctx // page)
        cache = torch.randn(batch * blocks, page, rank + rope, device=qn.device, dtype=qn.dtype)
        table = torch.randperm(batch * blocks, device=qn.device).view(batch, blocks).int()
        return cache, table, torch.full((batch,), ctx, dtype=torch.int32, device=qn.device)

    def _atom_flashmla(self, qn, qp, ctx, scale):
        """(atom's hosted decode, the torch reference on the same 64-token-page cache), or None
        where atom's plugin offers no host decode here. The scheduling state is reused across
        calls, as in the FlashMLA row (a served step shares one across its layers)."""
        from atom.ops.mla import mla_decode
        from atom.plugin.vllm.mla_decode import flashmla_decode

        host = flashmla_decode()
        if host is None:
            return None
        batch, heads, rank = qn.shape
        rope = qp.shape[-1]
        cache, table, seqlens = self._latent_pages(qn, qp, ctx, host.page_size)
        q = self.torch.empty(batch, heads, rank + rope, device=qn.device, dtype=qn.dtype)
        q[..., :rank].copy_(qn)  # served: the W_UK bmm writes here
        state = host.new_step()

        def hosted():
            q[..., rank:].copy_(qp)
            return host.run(q, cache, table, seqlens, scale, state)

        return hosted, lambda: mla_decode.run("torch", qn, qp, cache, table, seqlens, scale)

    def _vllm_flashmla(self, qn, qp, ctx, scale):
        def make():
            torch = self.torch
            from vllm.v1.attention.ops.flashmla import (
                flash_mla_with_kvcache, get_mla_metadata, is_flashmla_dense_supported)

            ok, why = is_flashmla_dense_supported()
            if not ok:
                raise RuntimeError(f"FlashMLA unavailable: {why}")
            rank = qn.shape[-1]
            cache, table, seqlens = self._latent_pages(qn, qp, ctx, 64)
            kv = cache.unsqueeze(2)  # [blocks, 64, 1 head, rank + rope]
            q = torch.cat([qn, qp], -1).unsqueeze(1)  # [B, 1, H, rank + rope]
            meta, _ = get_mla_metadata()  # filled on the first call, reused as vLLM does
            return lambda: flash_mla_with_kvcache(q, kv, table, seqlens, rank, meta,
                                                  softmax_scale=scale, causal=True)
        return make

    # -- MoE -------------------------------------------------------------------------------

    def _moe_dims(self) -> tuple[int, int, int, int]:
        """(experts, top_k, hidden, inter): Qwen3-30B-A3B's experts, tiny when dry."""
        return (16, 4, 256, 128) if self.dry else (128, 8, 2048, 768)

    def _moe_case(self, t: int, fp8: bool):
        """:meth:`_moe_dims` experts: (fused_moe args, keywords, Row fields) for a batch of ``t``
        tokens."""
        from atom.ops.moe_routing import topk_softmax

        torch = self.torch
        experts, top_k, hidden, inter = self._moe_dims()
        key = (fp8,)
        if getattr(self, "_moe_w", (None,))[0] != key:
            g = torch.Generator(device=self.device).manual_seed(0)
            w13 = torch.randn(experts, 2 * inter, hidden, device=self.device, generator=g) / hidden ** 0.5
            w2 = torch.randn(experts, hidden, inter, device=self.device, generator=g) / inter ** 0.5
            kw = {}
            if fp8:
                f8 = torch.float8_e4m3fn
                s13 = w13.abs().view(experts, 2 * inter // 128, 128, hidden // 128, 128).amax((2, 4)) / 448
                s2 = w2.abs().view(experts, hidden // 128, 128, inter // 128, 128).amax((2, 4)) / 448
                q13 = (w13 / s13.repeat_interleave(128, 1).repeat_interleave(128, 2)).to(f8)
                q2 = (w2 / s2.repeat_interleave(128, 1).repeat_interleave(128, 2)).to(f8)
                w13, w2 = q13, q2
                kw = dict(w13_scale=s13.float().contiguous(), w2_scale=s2.float().contiguous(), block_shape=[128, 128])
            else:
                w13, w2 = w13.to(self.dtype), w2.to(self.dtype)
            self._moe_w = (key, w13, w2, kw)
        _, w13, w2, kw = self._moe_w
        x = torch.randn(t, hidden, device=self.device, dtype=self.dtype)
        logits = torch.randn(t, experts, device=self.device, dtype=torch.float32)
        tw, ti = topk_softmax(logits, top_k, True)
        used = int(torch.unique(ti).numel())
        el = 1 if fp8 else torch.finfo(self.dtype).bits // 8
        fields = dict(bytes=(used * 3 * hidden * inter) * el + 2 * t * hidden * 2,
                      flops=6.0 * t * top_k * hidden * inter,
                      bound="memory" if t * top_k / experts < 64 else "compute")
        return (x, w13, w2, tw, ti), kw, fields, (experts, top_k)

    def moe(self, fp8: bool = False) -> None:
        """atom's default dispatch per batch size; for batches the small-batch (GEMV) path takes,
        also atom's grouped path on the same batch (the before / after of that path)."""
        from atom.ops.moe import fused_moe
        from atom.ops.moe_triton import expert_bytes, fused_moe_fwd, moe_config, takes_gemv

        batches = [1, 8] if self.dry else [1, 2, 4, 8, 16, 32, 64, 128, 256, 4096]
        name = "moe-fp8" if fp8 else "moe"
        for t in batches:
            args, kw, fields, (experts, top_k) = self._moe_case(t, fp8)
            out = self.torch.empty_like(args[0])
            gemv = takes_gemv(t, top_k, experts, fp8, expert_bytes(args[1], args[2]))
            row = Row(name, f"T={t} E={experts} k={top_k}" + (" gemv" if gemv else ""), **fields)
            self.run_case(row, lambda: fused_moe.run("triton", *args, out=out, **kw),
                          lambda: fused_moe.run("torch", *args, **kw),
                          self._vllm_moe(*args, **kw))
            if gemv or t <= 16:
                cfg = moe_config(t, top_k, experts, 128 if fp8 else None, self.dtype)
                row = Row(name, f"T={t} E={experts} k={top_k} grouped", **fields)
                self.run_case(row, lambda: fused_moe_fwd(*args, out=out, config=cfg, **kw),
                              lambda: fused_moe.run("torch", *args, **kw))

    def moe_fp8(self) -> None:
        self.moe(fp8=True)

    def moe_tiles(self) -> None:
        """The small-batch path's tiles (GemvConfig) at T = 1..8, bf16 and fp8 experts."""
        from atom.ops.moe_triton import GemvConfig, fused_moe_fwd

        bf16_tiles = [GemvConfig(n1, n2, 128, g, w) for n1 in (8, 16, 32) for n2 in (16, 32, 64)
                      for g in (1, 2, 4) for w in (4,)] + [GemvConfig(16, 32, 128, 2, 8), GemvConfig(32, 64, 128, 2, 8)]
        fp8_tiles = [GemvConfig(n1, n2, 128, g, w) for n1 in (8, 16, 32) for n2 in (16, 32, 64)
                     for g in (2, 4, 8) for w in (4,)] + [GemvConfig(16, 32, 128, 4, 8), GemvConfig(32, 64, 128, 4, 8)]
        if self.dry:
            bf16_tiles, fp8_tiles = bf16_tiles[:2], fp8_tiles[:2]
        for fp8, tiles in ((False, bf16_tiles), (True, fp8_tiles)):
            for t in ([1] if self.dry else [1, 2, 4, 8]):
                args, kw, fields, (experts, top_k) = self._moe_case(t, fp8)
                out = self.torch.empty_like(args[0])
                for cfg in tiles:
                    row = Row("moe-tile" + ("-fp8" if fp8 else ""),
                              f"T={t} {cfg.block_n1},{cfg.block_n2},{cfg.kb}x{cfg.g},w{cfg.num_warps}", **fields)
                    self.run_case(row, lambda: fused_moe_fwd(*args, out=out, config=cfg, **kw), None)

    def moe_ep(self) -> None:
        """One rank of EP=2 (the first half of the experts local, the expert map over all of
        them), bf16 and fp8: atom's default, whose tiles count pairs per local expert, and the
        tiles the global count would choose (``by-global``; bench/NOTES.md entry 22). Each batch
        routes over all the experts, as every rank sees it."""
        from atom.ops.moe import fused_moe
        from atom.ops.moe_triton import fused_moe_fwd, moe_config

        torch = self.torch
        for fp8 in (False, True):
            for t in ([64] if self.dry else [32, 64, 256, 1024, 2048]):
                (x, w13, w2, tw, ti), kw, fields, (experts, top_k) = self._moe_case(t, fp8)
                local = experts // 2
                em = torch.full((experts,), -1, dtype=torch.int32, device=self.device)
                em[:local] = torch.arange(local, dtype=torch.int32, device=self.device)
                args = (x, w13[:local], w2[:local], tw, ti)
                kw = dict(kw, expert_map=em)
                if fp8:
                    kw.update(w13_scale=kw["w13_scale"][:local], w2_scale=kw["w2_scale"][:local])
                used = int(torch.unique(ti[ti < local]).numel())
                el = 1 if fp8 else torch.finfo(self.dtype).bits // 8
                fields = dict(fields, bytes=used * 3 * x.shape[1] * w2.shape[2] * el + 2 * x.numel() * 2,
                              flops=fields["flops"] / 2)
                quant = 128 if fp8 else None
                local_cfg, global_cfg = (moe_config(t, top_k, n, quant, self.dtype) for n in (local, experts))
                name = "moe-ep-fp8" if fp8 else "moe-ep"
                out = torch.empty_like(x)
                for label, cfg in (("", None), (" by-global", global_cfg)):
                    case = (f"T={t} {local}/{experts} k={top_k}{label}"
                            + (" same-tiles" if local_cfg == global_cfg else ""))
                    self.run_case(Row(name, case, **fields),
                                  lambda cfg=cfg: fused_moe_fwd(*args, out=out, config=cfg, **kw),
                                  lambda: fused_moe.run("torch", *args, **kw))

    def moe_edges(self) -> None:
        """The grouped path's tile buckets (``moe_config``) around their edges, one GPU, bf16 and fp8
        experts: every bucket's tiles forced through ``config=`` at batches of 8-256 tokens per
        expert, so the table shows where the tiles' times cross (bench/NOTES.md entry 22: at
        exactly 64 tokens per expert the fp8 ``<= 64`` tile was 1.46x slower than the next one's).
        The row atom picks by default is marked ``default``."""
        from atom.ops.moe import fused_moe
        from atom.ops.moe_triton import fused_moe_fwd, moe_config

        torch = self.torch
        experts, top_k, _, _ = self._moe_dims()
        for fp8 in (False, True):
            quant = 128 if fp8 else None
            # each bucket's tiles, named by a tokens-per-expert count inside it (the first that gives them)
            tiles: dict = {}
            for b in (2, 8, 32, 100, 200):
                tiles.setdefault(moe_config(max(1, b * experts // top_k), top_k, experts, quant, self.dtype), b)
            per_expert = [16, 64] if self.dry else [8, 16, 24, 32, 48, 64, 80, 96, 128, 160, 256]
            for pe in per_expert:
                t = max(1, pe * experts // top_k)
                args, kw, fields, _ = self._moe_case(t, fp8)
                default = moe_config(t, top_k, experts, quant, self.dtype)
                out = torch.empty_like(args[0])
                for cfg, b in tiles.items():
                    label = (f"T={t} {pe}/expert tiles({b}/expert) m{cfg.block_m}"
                             + (" default" if cfg == default else ""))
                    self.run_case(Row("moe-edge-fp8" if fp8 else "moe-edge", label, **fields),
                                  lambda cfg=cfg: fused_moe_fwd(*args, out=out, config=cfg, **kw),
                                  lambda: fused_moe.run("torch", *args, **kw))

    def _vllm_moe(self, x, w13, w2, tw, ti, **kw):
        def make():
            from vllm.model_executor.layers.fused_moe import fused_experts

            if not kw:
                return lambda: fused_experts(x, w13, w2, tw, ti)
            from vllm.model_executor.layers.fused_moe.config import fp8_w8a8_moe_quant_config

            qc = fp8_w8a8_moe_quant_config(w1_scale=kw["w13_scale"], w2_scale=kw["w2_scale"],
                                           block_shape=kw["block_shape"])
            return lambda: fused_experts(x, w13, w2, tw, ti, quant_config=qc)
        return make


def _vllm_fa_version(head_size: int) -> Optional[int]:
    """The FlashAttention version vLLM's own backend would pick (None: leave the default)."""
    for mod in ("vllm.v1.attention.backends.fa_utils", "vllm.attention.utils.fa_utils"):
        try:
            get = getattr(__import__(mod, fromlist=["get_flash_attn_version"]), "get_flash_attn_version")
        except Exception:
            continue
        for call in (lambda: get(head_size=head_size), lambda: get()):
            try:
                return call()
            except TypeError:
                continue
    return None


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    unknown = sorted(set(ops) - set(OPS))
    if unknown:
        print(f"unknown --ops entries: {', '.join(unknown)} (choose from {', '.join(OPS)})", file=sys.stderr)
        return 2
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
    repo = Path(__file__).resolve().parent.parent
    if str(repo) not in sys.path:
        sys.path.insert(0, str(repo))
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        print("needs a CUDA GPU (use --dry-run to exercise the script on CPU)", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    bench = Bench(args)
    device_name = "cpu (dry run)" if args.dry_run else torch.cuda.get_device_name()
    print(f"measuring peaks on {device_name} ...", flush=True)
    peaks = measure_peaks(torch, bench.device, bench.timer, args.dry_run)
    with torch.no_grad():  # (inference_mode tensors and CUDA-graph capture mix poorly)
        for op in ops:
            getattr(bench, op)()
    print_table(bench.rows, peaks, device_name)
    if args.json:
        versions = {"torch": torch.__version__, "python": platform.python_version()}
        for name in ("triton", "vllm"):
            try:
                versions[name] = __import__(name).__version__
            except Exception:
                versions[name] = None
        doc = dict(device=device_name, peaks=peaks, versions=versions, args=vars(args),
                   results=[{**asdict(r), **r.derived(peaks)} for r in bench.rows])
        Path(args.json).write_text(json.dumps(doc, indent=2))
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
