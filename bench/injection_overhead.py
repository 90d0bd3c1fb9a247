"""Call overhead of an injected method vs a native one, and of a wrapt-wrapped patch.

    python bench/injection_overhead.py [--calls 2000000] [--repeat 7]

Three classes with the same tiny method (the kind of per-token call an attention impl makes):
``native`` defines it in the class body; ``injected`` receives it through a toolkit Injection
(plain attribute, no proxy); ``wrapped`` gets it through a toolkit Patch with a pass-through wrapt
wrapper (what non-hot-path patches use). Prints ns/call (best of --repeat) and the ratio to native,
all measured in this run.
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
    finally:
        revert(INJECT)
        revert(WRAP)
    return 0


if __name__ == "__main__":
    sys.exit(main())
