"""``python -m atom``: the command line.

  doctor [--json]          what atom would do here: versions, platform, ops, patches, env
  patches [--json]         every patch/injection record and its state in this environment
  docs [--write|--check]   regenerate / verify docs/env_vars.md and docs/patches.md
"""

from __future__ import annotations

import argparse
import json
import sys


def _cmd_patches(args: argparse.Namespace) -> int:
    from atom.patches import REGISTRY, listing
    from atom.plugin import catalog

    catalog.load()
    rows = listing(REGISTRY)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    if not rows:
        print("no patches or injections declared")
        return 0
    width = max(len(r["id"]) for r in rows)
    for r in rows:
        state = r["state"] + (f" ({r['detail']})" if r["detail"] else "")
        kind = "decorator" if r["kind"] == "injection" else "patch"
        print(f"{r['id']:<{width}}  {kind:<9}  {state}")
        host = f"SGLang {r['sglang']}" if r["host"] == "sglang" else f"vLLM {r['vllm']}"
        print(f"{'':<{width}}  group: {r['group'] or '-'}  target: {r['target']}  {host}  how: {r['how']}")
        print(f"{'':<{width}}  reason: {r['reason']}")
    return 0


def _cmd_docs(args: argparse.Namespace) -> int:
    from atom import _docs

    if args.write:
        for path in _docs.write():
            print(f"wrote {path}")
        return 0
    stale = _docs.check()
    for path in stale:
        print(f"out of date: {path} (run `python -m atom docs --write`)")
    return 1 if stale else 0


def _cmd_doctor(args: argparse.Namespace) -> int:
    from atom import doctor

    return doctor.main(as_json=args.json)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m atom", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    dr = sub.add_parser("doctor", help="explain what atom would do in this environment")
    dr.add_argument("--json", action="store_true", help="machine-readable output")
    dr.set_defaults(func=_cmd_doctor)
    p = sub.add_parser("patches", help="list every patch/injection and its state")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=_cmd_patches)
    d = sub.add_parser("docs", help="regenerate or check the generated docs")
    g = d.add_mutually_exclusive_group()
    g.add_argument("--write", action="store_true")
    g.add_argument("--check", action="store_true")
    d.set_defaults(func=_cmd_docs)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except Exception as exc:  # one clear line for bad env values etc.
        from atom.envs import EnvError

        if isinstance(exc, EnvError):
            print(f"error: {exc}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
