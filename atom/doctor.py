"""``python -m atom doctor``: what atom would do in this environment, without starting an engine.

Reports where atom is installed from (and any other package named ``atom``, which keeps it off),
versions (vLLM, torch, triton, aiter) and whether the vLLM version is supported, the
platform vLLM resolves with and without atom, the device, the backend each op would use and why,
every patch/injection with its state (it arms them and imports their vLLM modules to find out),
and every ATOM_* variable that is set with its parsed value. Exit status 0 when atom would
activate; otherwise 1 with the reason on the last line (2 for a malformed ATOM_* value).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import os
from typing import Any


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def collect() -> dict[str, Any]:
    from atom import _distribution, envs

    report: dict[str, Any] = {"atom": _version("atom-vllm"), "install": _distribution.check()._asdict()}
    try:
        report["env"] = {k: v for k, v in envs.set_values().items()}
    except envs.EnvError as exc:
        report["env_error"] = str(exc)
        report["active"] = False
        report["reason"] = str(exc)
        return report

    from atom.patches.versions import installed_vllm
    from atom.plugin.vllm import register

    found = installed_vllm()
    report["versions"] = {
        "vllm": f"{found[1]} ({found[0]})" if found else None,
        "torch": _version("torch"),
        "triton": _version("triton"),
        "aiter": _version("amd-aiter") or _version("aiter"),
    }
    ok, why, _ = register.vllm_support()
    report["vllm_supported"] = {"ok": ok, "why": why}

    device = None
    if found is not None:
        device = register.detect_device()
    report["device"] = device
    stock = {"cpu": "vllm.platforms.cpu.CpuPlatform", "cuda": "vllm.platforms.cuda.CudaPlatform",
             "rocm": "vllm.platforms.rocm.RocmPlatform"}
    qualname, reason, _ = register.activation() if found is not None else (None, "vLLM is not installed", False)
    report["platform"] = {
        "without_atom": stock.get(device or "", device),
        "with_atom": qualname or stock.get(device or "", device),
        "atom_active": qualname is not None,
        "reason": reason,
    }
    if device == "cuda":
        try:
            import torch

            report["device_name"] = torch.cuda.get_device_name(0)
        except Exception as exc:  # pragma: no cover - GPU only
            report["device_name"] = f"unknown ({exc})"

    if found is not None and qualname is not None:
        in_effect = register.overrides_in_effect()
        report["overrides"] = {"on": bool(in_effect.value), "why": in_effect.reason}
    report["attention"] = _attention_choices(found is not None)

    import atom.ops  # registers every op
    from atom.ops import OPS

    op_device = "cuda" if device in ("cuda", "rocm") else "cpu"
    report["ops"] = {name: dict(zip(("backend", "why"), op.backend_on(op_device))) for name, op in sorted(OPS.items())}

    report["sglang"] = _sglang_state()
    report["patches"] = _patch_states(found is not None)
    report["active"] = qualname is not None or report["sglang"]["active"]
    report["reason"] = reason if qualname is not None or not report["sglang"]["active"] \
        else f"under SGLang: {report['sglang']['reason']}"
    return report


def _sglang_state() -> dict[str, Any]:
    """atom under SGLang: the version, whether ``register`` would activate and why, the
    ``atom`` backend's decision (records applied as ``register`` arms them) and the overrides."""
    from atom.patches.versions import installed_sglang
    from atom.plugin.models import MODEL_TABLE
    from atom.plugin.sglang import register

    version = installed_sglang()
    on, why, _ = register.activation()
    state: dict[str, Any] = {"version": str(version) if version else None, "active": bool(on), "reason": why,
                             "models": [e.arch for e in MODEL_TABLE if e.sglang_wrapper], "attention": why}
    if on:
        from atom.plugin.sglang import records
        from atom.plugin.sglang.attention_mha import attention_backend

        use, why, _ = register.overrides_in_effect()
        if not use:
            state["models"] = [f"none ({why})"]
        records.arm_all()
        use, reason, _ = attention_backend()
        state["attention"] = f"{'atom' if use else 'SGLang default'} ({reason}; with --attention-backend atom)"
    return state


def _attention_choices(vllm_installed: bool) -> dict[str, dict[str, Any]]:
    """atom's answer for a typical decoder layer (bf16, auto cache, block 16; head size 128 for
    MHA, 576 for MLA), through the same function the platform calls."""
    if not vllm_installed:
        return {kind: {"atom_backend": None, "reason": "vLLM is not installed"} for kind in ("mha", "mla")}
    import torch

    from atom.plugin.vllm import compat
    from atom.plugin.vllm.selection import attention_backend

    cls = compat.selector_config_cls()
    base = dict(dtype=torch.bfloat16, kv_cache_dtype="auto", block_size=16)
    # MLA: DeepSeek-V3's latent head (kv_lora_rank 512 + rope 64)
    head_size = {"mha": 128, "mla": 576}
    return {
        kind: dict(zip(("atom_backend", "reason"), attention_backend(
            None, cls(**base, head_size=head_size[kind], use_mla=kind == "mla"))[:2]))
        for kind in ("mha", "mla")
    }


def _patch_states(vllm_installed: bool) -> list[dict[str, str]]:
    from atom.patches import REGISTRY, listing
    from atom.plugin import catalog
    from atom.plugin.vllm import records

    catalog.load()
    if vllm_installed:
        # Arm exactly as register_model does, then import each target so the real state shows.
        records.arm_all()
        for rec in REGISTRY:
            try:
                importlib.import_module(rec.module)
            except Exception:  # an unimportable target stays "armed": the listing says so
                pass
    return [{k: r[k] for k in ("id", "kind", "target", "state", "detail")} for r in listing(REGISTRY)]


def render(report: dict[str, Any]) -> str:
    lines = [f"atom {report.get('atom')}", f"installed: {report['install']['reason']}"]
    if "env_error" in report:
        lines.append(f"ATOM_* variables: ERROR {report['env_error']}")
        lines.append(f"atom would NOT activate: {report['reason']}")
        return "\n".join(lines)
    v = report["versions"]
    lines.append("versions: " + ", ".join(f"{k} {v[k] or 'not installed'}" for k in v))
    lines.append(f"vLLM support: {'yes' if report['vllm_supported']['ok'] else 'NO'} - {report['vllm_supported']['why']}")
    p = report["platform"]
    lines.append(f"device: {report['device'] or 'none'}" + (f" ({report['device_name']})" if report.get("device_name") else ""))
    lines.append(f"platform without atom: {p['without_atom']}")
    lines.append(f"platform with atom:    {p['with_atom']}")
    if "overrides" in report:
        lines.append(f"models and attention: {report['overrides']['why']}")
    lines.append("attention:")
    for kind, a in report["attention"].items():
        lines.append(f"  {kind}: {a['atom_backend'] or 'vLLM default'} ({a['reason']})")
    lines.append("ops (backend on this device, why):")
    for name, o in report["ops"].items():
        lines.append(f"  {name:<28} {o['backend']:<7} {o['why']}")
    sg = report["sglang"]
    lines.append(f"SGLang: {sg['version'] or 'not installed'}; atom {'activates' if sg['active'] else 'stays off'} "
                 f"({sg['reason']})")
    if sg["active"]:
        lines.append(f"  models: {', '.join(sg['models'])}")
        lines.append(f"  attention: {sg['attention']}")
    lines.append("patches:")
    for r in report["patches"]:
        state = r["state"] + (f" ({r['detail']})" if r["detail"] else "")
        lines.append(f"  {r['id']}: {state}")
    env = report["env"]
    lines.append("ATOM_* variables set: " + (", ".join(f"{k}={v!r}" for k, v in env.items()) if env else "none"))
    lines.append(f"atom would {'activate' if report['active'] else 'NOT activate'}: {report['reason']}")
    return "\n".join(lines)


def main(as_json: bool = False) -> int:
    if as_json:
        # stdout is the JSON alone: vLLM logs to stdout by default, and 0.26 logs its plugin
        # loading at INFO (a user's own VLLM_LOGGING_STREAM is kept)
        os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    report = collect()
    print(json.dumps(report, indent=2, default=str) if as_json else render(report))
    if "env_error" in report:
        return 2
    return 0 if report["active"] else 1
