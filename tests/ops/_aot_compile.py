"""Compile atom's memory-bound Triton kernels for an NVIDIA sm_90 target without a GPU.

The CPU tests run kernels through Triton's interpreter, which accepts programs the GPU compiler
rejects (and says nothing about codegen). This script drives the real launchers at realistic
(Qwen3-8B) shapes with CPU tensors, records the launches instead of running them, and compiles
each recorded launch ahead of time with the same specialisation the JIT would apply (16-byte
aligned pointers, ints divisible by 16, ints equal to 1 as constants). It prints one JSON line
per launch: kernel, constexprs, and the global load/store vector widths found in the PTX.

Run in a process where TRITON_INTERPRET is unset (kernels must be real JIT functions):
``python -m tests.ops._aot_compile``.
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections import Counter

import torch

_TRITON_TYPES = {
    torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16",
    torch.float8_e4m3fn: "fp8e4nv", torch.int64: "i64", torch.int32: "i32", torch.uint8: "u8",
}


class _Recorder:
    """Stands in for a JIT kernel: ``kernel[grid](*args, **kwargs)`` records instead of launching."""

    def __init__(self, fn):
        self.fn = fn
        self.calls: list[tuple[tuple, dict]] = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((args, kwargs))


def _compile(fn, args: tuple, kwargs: dict, arch: int) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kwargs = dict(kwargs)
    num_warps = kwargs.pop("num_warps", 4)
    names = list(fn.arg_names)
    values = dict(zip(names, args))
    values.update(kwargs)
    constexpr_names = {p.name for p in fn.params if p.is_constexpr}
    signature, constexprs, attrs = {}, {}, {}
    for i, name in enumerate(names):
        v = values[name]
        if name in constexpr_names:
            signature[name], constexprs[name] = "constexpr", v
        elif isinstance(v, torch.Tensor):
            signature[name] = "*" + _TRITON_TYPES[v.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(v, bool):
            signature[name] = "i1"
        elif isinstance(v, int):
            if v == 1:  # the JIT specialises ints equal to 1 as constants
                signature[name], constexprs[name] = "constexpr", 1
                continue
            signature[name] = "i32" if -(2**31) <= v < 2**31 else "i64"
            if v % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(v, float):
            signature[name] = "fp32"
        else:
            raise TypeError(f"{fn.__name__}: cannot type argument {name}={v!r}")
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    kernel = triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps})
    ptx = kernel.asm["ptx"]
    return {
        "kernel": fn.__name__,
        "num_warps": num_warps,
        "constexprs": {k: v for k, v in constexprs.items() if not isinstance(v, torch.Tensor)},
        "loads": dict(Counter(re.findall(r"ld\.global[.\w]*", ptx))),
        "stores": dict(Counter(re.findall(r"st\.global[.\w]*", ptx))),
    }


def _drive_launchers() -> list[tuple[object, tuple, dict]]:
    """Call every op's Triton implementation at Qwen3-8B-like shapes, recording the launches."""
    from atom.ops import (activation_triton, fused_qk_norm_rope_cache_triton, kv_cache_triton, quant_triton,
                          rmsnorm_triton)
    from atom.ops.activation import SILU_AND_MUL
    from atom.ops.fused_qk_norm_rope_cache import FUSED_QK_NORM_ROPE_CACHE, split_qkv
    from atom.ops.kv_cache import RESHAPE_AND_CACHE
    from atom.ops.quant import PER_BLOCK_QUANT_FP8, PER_TOKEN_QUANT_FP8
    from atom.ops.rmsnorm import RMS_NORM
    from atom.ops.rotary import ROTARY_EMBEDDING

    recorders = []
    for mod, name in (
        (rmsnorm_triton, "_rms_norm_kernel"), (fused_qk_norm_rope_cache_triton, "_qk_norm_rope_cache_kernel"),
        (kv_cache_triton, "_reshape_and_cache_kernel"), (activation_triton, "_silu_and_mul_kernel"),
        (quant_triton, "_per_token_quant_kernel"), (quant_triton, "_per_block_quant_kernel"),
    ):
        rec = _Recorder(getattr(mod, name))
        setattr(mod, name, rec)
        recorders.append(rec)

    bf, f8, t, hidden, hq, hk, d = torch.bfloat16, torch.float8_e4m3fn, 4, 4096, 32, 8, 128
    x = torch.empty(t, hidden, dtype=bf)
    w = torch.empty(hidden, dtype=bf)
    scale = torch.ones(1)
    RMS_NORM.impl("triton")(x, w, 1e-6)
    RMS_NORM.impl("triton")(x, w, 1e-6, x.clone())
    RMS_NORM.impl("triton")(x, w, 1e-6, x.clone(), f8, scale)
    RMS_NORM.impl("triton")(torch.empty(t, 32768, dtype=bf), torch.empty(32768, dtype=bf), 1e-6)  # loop path

    qkv = torch.empty(t, (hq + 2 * hk) * d, dtype=bf)
    q, k, v = split_qkv(qkv, hq, hk, d)
    pos = torch.zeros(t, dtype=torch.int64)
    cs = torch.empty(4096, d, dtype=torch.float32)
    slots = torch.zeros(t, dtype=torch.int64)
    for neox in (True, False):
        ROTARY_EMBEDDING.impl("triton")(pos, q, k, cs, d, d, neox)
        for cache_dtype, kvd in ((bf, "auto"), (f8, "fp8")):
            kv = torch.empty(2, 64, 16, hk, d, dtype=cache_dtype)
            FUSED_QK_NORM_ROPE_CACHE.impl("triton")(
                q, k, v, w[:d], w[:d], 1e-6, pos, cs, neox, kv[0], kv[1], slots, kvd, scale, scale)
    kv = torch.empty(2, 64, 16, hk, d, dtype=bf)
    FUSED_QK_NORM_ROPE_CACHE.impl("triton")(  # partial rotary
        q, k, v, w[:d], w[:d], 1e-6, pos, cs[:, :64], True, kv[0], kv[1], slots, "auto", None, None, 64)
    # Qwen3-30B-A3B heads (32 q / 4 kv): q and kv head blocks of different sizes in one kernel
    # (the GPU compiler rejected this once; the interpreter did not).
    q30, k30, v30 = split_qkv(torch.empty(t, (32 + 2 * 4) * d, dtype=bf), 32, 4, d)
    kv = torch.empty(2, 64, 16, 4, d, dtype=bf)
    FUSED_QK_NORM_ROPE_CACHE.impl("triton")(
        q30, k30, v30, w[:d], w[:d], 1e-6, pos, cs, True, kv[0], kv[1], slots, "auto", None, None)
    for cache_dtype, kvd in ((bf, "auto"), (f8, "fp8")):
        kv = torch.empty(2, 64, 16, hk, d, dtype=cache_dtype)
        RESHAPE_AND_CACHE.impl("triton")(k, v, kv[0], kv[1], slots, kvd, scale, scale)
    SILU_AND_MUL.impl("triton")(torch.empty(t, 2 * 12288, dtype=bf))
    PER_TOKEN_QUANT_FP8.impl("triton")(x)
    PER_BLOCK_QUANT_FP8.impl("triton")(x, 128)
    return [(rec.fn, args, kwargs) for rec in recorders for args, kwargs in rec.calls]


def main(arch: int = 90) -> int:
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        print("unset TRITON_INTERPRET: the kernels must be JIT functions", file=sys.stderr)
        return 2
    for fn, args, kwargs in _drive_launchers():
        print(json.dumps(_compile(fn, args, kwargs, arch)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
