"""Call overhead of an injected method vs a native one, and of a wrapt-wrapped patch.

    python bench/injection_overhead.py [--calls 2000000] [--repeat 7]

Three classes with the same tiny method (the kind of per-token call an attention impl makes):
``native`` defines it in the class body; ``injected`` receives it through a toolkit Injection
(plain attribute, no proxy); ``wrapped`` gets it through a toolkit Patch with a pass-through wrapt
wrapper (what non-hot-path patches use). Prints ns/call (best of --repeat) and the ratio to native,
all measured in this run.

Then the per-step path of an atom MLA layer under vLLM (``MLAAttention.forward_impl``, called
once per layer and step): mla_patch's per-layer route (an instance attribute installed when the
layer's weights are processed: the impl's forward with the layer bound) against calling the impl
directly, and against the previous design (a wrapt wrapper on the class with an ``isinstance``
check per call). The impl's forward is a stub, so only the routing is timed.
"""

from __future__ import annotations

import argparse
import sys
import timeit
import types

from atom.patches import Injection, Patch, apply, revert


def _method(self, x):
    return x


MOD = types.ModuleType("atom_bench_targets")
exec(
    "class Native:\n    def step(self, x):\n        return x\n"
    "class Injected:\n    pass\n"
    "class Wrapped:\n    def step(self, x):\n        return x\n"
    "class Source:\n    def step(self, x):\n        return x\n",
    MOD.__dict__,
)
sys.modules[MOD.__name__] = MOD


def _passthrough(wrapped, instance, args, kwargs):
    return wrapped(*args, **kwargs)


INJECT = Injection(id="bench.inject", target=f"{MOD.__name__}:Injected", members=("step",),
                   source=f"{MOD.__name__}:Source")
WRAP = Patch(id="bench.wrap", target=f"{MOD.__name__}:Wrapped.step", wrapper=_passthrough)


def _mla_route(calls: int, repeat: int) -> dict[str, float]:
    """ns/call of the three ways a step reaches an atom MLA impl's forward."""
    import functools

    import wrapt

    from atom.models.attention.mla import MLAttentionImpl

    class Impl(MLAttentionImpl):
        def forward(self, layer, q, k_c_normed, k_pe, kv_cache, attn_metadata, output,
                    output_scale=None, output_block_scale=None, **rest):
            if rest and any(v is not None for v in rest.values()):
                raise NotImplementedError
            return output

    class Layer:  # what vLLM's MLAAttention is to the call: a forward_impl method on the class
        def forward_impl(self, q, k_c_normed, k_pe, kv_cache, attn_metadata, output, output_scale=None,
                         output_block_scale=None, **rest):
            raise AssertionError("vLLM's own forward_impl is not reached for atom's layers")

    def per_call(wrapped, instance, args, kwargs):  # the previous mla_patch: checked every call
        if not isinstance(getattr(instance, "impl", None), MLAttentionImpl):
            return wrapped(*args, **kwargs)
        return instance.impl.forward(instance, *args, **kwargs)

    class WrappedLayer(Layer):
        forward_impl = wrapt.FunctionWrapper(Layer.__dict__["forward_impl"], per_call)

    impl = Impl.__new__(Impl)
    routed, wrapped = Layer(), WrappedLayer()
    routed.impl = wrapped.impl = impl
    routed.forward_impl = functools.partial(impl.forward, routed)  # what mla_patch installs
    stmts = {
        "impl.forward (direct)": ("impl.forward(layer, 1, 2, 3, 4, 5, output=6)", {"impl": impl, "layer": routed}),
        "per-layer route": ("layer.forward_impl(1, 2, 3, 4, 5, output=6)", {"layer": routed}),
        "wrapt + isinstance": ("layer.forward_impl(1, 2, 3, 4, 5, output=6)", {"layer": wrapped}),
    }
    return {name: min(timeit.repeat(stmt, globals=g, number=calls, repeat=repeat)) / calls * 1e9
            for name, (stmt, g) in stmts.items()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=2_000_000)
    p.add_argument("--repeat", type=int, default=7)
    args = p.parse_args()
    apply(INJECT, enabled=True)
    apply(WRAP, enabled=True)
    try:
        objs = {"native": MOD.Native(), "injected": MOD.Injected(), "wrapped (wrapt patch)": MOD.Wrapped()}
        results = {}
        for name, obj in objs.items():
            step = obj.step  # noqa: F841  (resolved per call below, as a real call site does)
            t = min(timeit.repeat("o.step(1)", globals={"o": obj}, number=args.calls, repeat=args.repeat))
            results[name] = t / args.calls * 1e9
        base = results["native"]
        print(f"python {sys.version.split()[0]}, {args.calls} calls, best of {args.repeat}")
        print(f"{'method':<24}{'ns/call':>10}{'vs native':>12}")
        for name, ns in results.items():
            print(f"{name:<24}{ns:>10.1f}{ns / base:>11.2f}x")
        mla = _mla_route(args.calls // 4, args.repeat)
        direct = mla["impl.forward (direct)"]
        print(f"\nMLA forward_impl per layer and step ({args.calls // 4} calls)")
        print(f"{'path':<24}{'ns/call':>10}{'vs direct':>12}")
        for name, ns in mla.items():
            print(f"{name:<24}{ns:>10.1f}{ns / direct:>11.2f}x")
    finally:
        revert(INJECT)
        revert(WRAP)
    return 0


if __name__ == "__main__":
    sys.exit(main())
