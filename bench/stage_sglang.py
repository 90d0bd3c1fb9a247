#!/usr/bin/env python3
"""Stage SGLang 0.5.17 (and atom's SGLang plugin next to it) for the offline GPU machine.

The GPU image has Python 3.12, torch 2.11.0+cu130, triton 3.6.0, torchvision, transformers 5.17
and no network (../shared/gpu/README.md). sglang 0.5.17 is the last release pinned to that torch.
This script, on a machine that reaches PyPI:

  1. downloads ``sglang==0.5.17``, ``sglang-kernel==0.4.5``, ``flashinfer-python`` and the pinned
     pure-Python dependencies the image lacks (:data:`CARRY`) for CPython 3.12 / manylinux x86_64;
  2. installs them with ``pip install --no-deps --target`` into a staging prefix;
  3. strips what an H100 run of SGLang's Triton backend and atom's backend does not load
     (:data:`STRIP`: the kernel package's 1.1 GB ``flash_ops`` (FlashAttention 3, so stock SGLang
     runs its ``triton`` backend here, not ``fa3``), its SM100 ops and FlashMLA);
  4. packs the prefix into ``.stage/sglang0517.tar.xz.part00, 01, ...`` (``--part-mib``, default
     55) with SHA256SUMS, and prints the commands that unpack it into ``/tmp/site-sglang`` on the
     GPU machine (``bench/gpu_run.sh sglang`` does it itself when the parts travel with the step).

Why these choices:
  * transformers 5.17 (the image's) fails SGLang's import ('qwen3_asr' is already used by a
    Transformers config): 5.12.1 with tokenizers 0.22.2 is carried and shadows it;
  * flashinfer-python is imported at module level by SGLang's sampler on CUDA, and stock SGLang's
    RMSNorm on CUDA (sgl_kernel.rmsnorm) is flashinfer's JIT-compiled norm: its JIT sources and
    headers (``flashinfer/data``, 76 MiB unpacked) are carried (the first H100 run without them
    failed in stock's first forward: ``norm.cu ... missing``), and the GPU machine compiles them
    on first use;
  * the dependency list is the closure that SGLang's CPU engine imports in atom's SGLang test
    environment (requirements/sglang-cpu.txt) minus the image's packages, plus what the CUDA path
    adds (the kernel package, flashinfer and their pure-Python dependencies).
    ``bench/gpu_run.sh sglang`` first imports SGLang's CUDA engine path and prints any missing
    module, so a gap costs one short GPU call, not a benchmark.

Usage (repo root):  python3 bench/stage_sglang.py [--part-mib 55] [--extra NAME==VERSION ...]
                    python3 bench/stage_sglang.py --plan-only
"""
from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

PREFIX = "sglang0517"
PY_VERSION = "3.12"
PLATFORMS = ["manylinux_2_35_x86_64", "manylinux_2_34_x86_64", "manylinux_2_31_x86_64", "manylinux_2_28_x86_64",
             "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64"]

#: wheel -> why it is carried (the image has torch, triton, torchvision, numpy, requests, psutil,
#: pillow, aiohttp, sentencepiece, einops, safetensors, pyyaml, tqdm, regex, filelock, jinja2 ...)
CARRY = {
    "sglang==0.5.17": "the host",
    "sglang-kernel==0.4.5": "SGLang's CUDA ops (sgl_kernel), imported at module level on CUDA",
    "flashinfer-python==0.6.15.post1": "imported by SGLang's sampler on CUDA (kernels unused with --sampling-backend pytorch)",
    "apache-tvm-ffi==0.1.11": "xgrammar, sgl_kernel, flashinfer (sglang pins it)",
    "transformers==5.12.1": "the image's 5.17 fails SGLang's import",
    "tokenizers==0.22.2": "transformers 5.12.1",
    "huggingface-hub==1.33.0": "transformers 5.12.1",
    "xgrammar==0.2.1": "grammar backend, imported by the scheduler",
    "compressed-tensors==0.20.0": "SGLang's quantization registry (module level)",
    "loguru==0.7.3": "compressed-tensors",
    "gguf==0.19.0": "SGLang's GGUF loader (module level)",
    "openai==2.6.1": "SGLang's entrypoints (module level)",
    "httpx==0.28.1": "openai",
    "httpcore==1.0.9": "httpx",
    "jiter==0.19.0": "openai",
    "distro==1.9.0": "openai",
    "sniffio==1.3.1": "openai",
    "pydantic==2.14.3": "SGLang's io structs",
    "pydantic-core==2.50.4": "pydantic",
    "annotated-types==0.8.0": "pydantic",
    "typing-inspection==0.4.5": "pydantic",
    "fastapi==0.165.0": "SGLang's http server module (imported by the engine)",
    "starlette==1.10.0": "fastapi; sglang.srt.utils.common",
    "annotated-doc==0.0.7": "fastapi",
    "uvicorn==0.54.0": "SGLang's engine module",
    "uvloop==0.23.0": "SGLang's tokenizer manager event loop",
    "orjson==3.13.0": "sglang.srt.utils.common",
    "pybase64==1.5.1": "sglang.srt.utils.common",
    "msgspec==0.22.0": "SGLang's io structs",
    "pyzmq==27.3.0": "engine <-> scheduler sockets",
    "partial-json-parser==0.2.1.1.post7": "SGLang's function-call parsers (module level)",
    "setproctitle==1.3.8": "names the scheduler processes",
    "dill==0.4.1": "imported at module level",
    "ipython==9.18.1": "imported at module level by sglang.utils",
    "ipython-pygments-lexers==1.1.1": "ipython",
    "jedi==0.20.1": "ipython",
    "parso==0.8.7": "jedi",
    "matplotlib-inline==0.2.2": "ipython",
    "prompt-toolkit==3.0.53": "ipython",
    "wcwidth==0.9.4": "prompt-toolkit",
    "stack-data==0.6.3": "ipython",
    "asttokens==3.0.2": "stack-data",
    "executing==2.3.0": "stack-data",
    "pure-eval==0.2.4": "stack-data",
    "traitlets==5.16.1": "ipython",
    "pexpect==4.9.0": "ipython",
    "ptyprocess==0.7.0": "pexpect",
    "decorator==5.2.1": "ipython",
    "nvidia-ml-py==13.590.48": "sgl_kernel / flashinfer device queries",
    "tabulate==0.9.0": "flashinfer",
    "wrapt==2.5.2": "atom",
    "opentelemetry-api==1.45.2": "SGLang's engine and scheduler (imported at module level; found missing on the H100)",
}

STRIP = [
    "sgl_kernel/flash_ops.abi3.so",  # FlashAttention 3 (1.1 GB): stock SGLang runs `triton` here
    "sgl_kernel/sm100",  # Blackwell ops
    "sgl_kernel/flashmla_ops.abi3.so",  # MLA (imported lazily by sgl_kernel.flash_mla only)
    "bin",
]

MiB = 1024 * 1024


def sh(cmd: list[str]) -> None:
    print("+", " ".join(cmd[:12]), "..." if len(cmd) > 12 else "", flush=True)
    subprocess.run(cmd, check=True)


def pip(action: str) -> list[str]:
    cmd = [sys.executable, "-m", "pip", action, "--no-deps", "--only-binary=:all:", "--python-version", PY_VERSION,
           "--implementation", "cp"]
    for p in PLATFORMS:
        cmd += ["--platform", p]
    return cmd


def du(path: Path) -> int:
    return path.stat().st_size if path.is_file() else sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def build(args: argparse.Namespace, root: Path) -> None:
    work = Path(args.work)
    wheels, site = work / "wheels", work / "site"
    wheels.mkdir(parents=True, exist_ok=True)
    specs = list(CARRY) + list(args.extra)
    t0 = time.time()
    sh(pip("download") + ["-q", "-d", str(wheels)] + specs)
    norm = lambda n: n.lower().replace("-", "_").replace(".", "_")  # noqa: E731
    want = {(norm(s.split("==")[0]), s.split("==")[1]) for s in specs}
    files = [w for w in sorted(wheels.glob("*.whl")) if (norm(w.name.split("-")[0]), w.name.split("-")[1]) in want]
    if len(files) != len(specs):
        raise SystemExit(f"expected {len(specs)} wheels, found {len(files)} in {wheels}")
    print(f"downloaded {len(files)} wheels, {sum(w.stat().st_size for w in files) / MiB:.1f} MiB, {time.time() - t0:.0f}s")
    if site.exists():
        shutil.rmtree(site)
    sh(pip("install") + ["-q", "--no-index", "--no-compile", "--target", str(site)] + [str(w) for w in files])
    for rel in STRIP:
        p = site / rel
        if p.exists():
            print(f"stripped {rel} ({du(p) / MiB:.1f} MiB)")
            shutil.rmtree(p) if p.is_dir() else p.unlink()
    for tests in site.glob("*/tests"):
        shutil.rmtree(tests)
    (site / "SGLANG_STAGE_MANIFEST.json").write_text(json.dumps(
        {"carried": specs, "stripped": STRIP, "built": time.strftime("%Y-%m-%d %H:%M:%S")}, indent=1))
    print(f"staged tree: {du(site) / MiB:.1f} MiB")

    out = root / ".stage"
    out.mkdir(exist_ok=True)
    for old in out.glob(f"{PREFIX}.*"):
        old.unlink()
    archive = out / f"{PREFIX}.tar.xz"
    with archive.open("wb") as f:
        tar = subprocess.Popen(["tar", "-C", str(site), "--sort=name", "--owner=0", "--group=0", "-cf", "-", "."],
                               stdout=subprocess.PIPE)
        xz = subprocess.Popen(["xz", "-9e", "-T0", "-c"], stdin=tar.stdout, stdout=f)
        tar.stdout.close()
        if xz.wait() or tar.wait():
            raise SystemExit("tar | xz failed")
    data, parts = archive.read_bytes(), []
    step = int(args.part_mib * MiB)
    for i in range(0, len(data), step):
        part = out / f"{PREFIX}.tar.xz.part{i // step:02d}"
        part.write_bytes(data[i:i + step])
        parts.append(part)
    archive.unlink()
    (out / f"{PREFIX}.SHA256SUMS").write_text(
        "".join(f"{hashlib.sha256(p.read_bytes()).hexdigest()}  {p.name}\n" for p in parts))
    print(f"packed {len(parts)} part(s), {len(data) / MiB:.1f} MiB")


def plan(root: Path) -> str:
    out = root / ".stage"
    parts = sorted(out.glob(f"{PREFIX}.tar.xz.part*"))
    if not parts:
        raise SystemExit("no parts: run without --plan-only first")
    lines = [f"# {len(parts)} part(s) in .stage/ ({sum(p.stat().st_size for p in parts) / MiB:.1f} MiB); "
             "each GPU call carries the repo's files plus what .stage/ holds that is named in `carry`.",
             "# One call per part, back to back on the same machine (the parts accumulate in /tmp/sglang-parts);",
             "# the last call checks the sums, unpacks into /tmp/site-sglang and runs the bench step:"]
    for i, p in enumerate(parts):
        cmd = (f"mkdir -p /tmp/sglang-parts && cp .stage/{p.name} .stage/{PREFIX}.SHA256SUMS /tmp/sglang-parts/")
        if i == len(parts) - 1:
            cmd += " && bash bench/gpu_run.sh sglang"
        lines.append(f"call {i + 1}: carry=['.stage/{p.name}', '.stage/{PREFIX}.SHA256SUMS']  "
                     f"command: {cmd}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part-mib", type=float, default=55)
    ap.add_argument("--work", default=str(Path("/tmp") / f"{PREFIX}-stage"))
    ap.add_argument("--extra", action="append", default=[], help="one more pinned wheel NAME==VERSION")
    ap.add_argument("--plan-only", action="store_true")
    args = ap.parse_args()
    root = Path(subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True,
                               check=True).stdout.strip())
    if not args.plan_only:
        build(args, root)
    print(plan(root))


if __name__ == "__main__":
    main()
