"""What every step of ``bench/e2e.py`` shares: the sides, logging, the environment of a side's
engine, prompts, number formatting, versions."""

from __future__ import annotations

import importlib.util
import os
import platform
import random
import time
from pathlib import Path
from typing import Any, Optional

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "bench"
SIDES = ("stock", "atom")


def log(msg: str) -> None:
    print(f"[e2e {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def base_env() -> dict[str, str]:
    env = dict(os.environ)
    for key, value in {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
                       "DO_NOT_TRACK": "1", "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false",
                       # lets LLM.apply_model send its (local, trusted) function to the engine
                       # core, to record which model class ran and whether it was compiled
                       "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}.items():
        env.setdefault(key, value)
    if importlib.util.find_spec("flashinfer") is None:
        # vLLM builds its top-k/top-p sampler with an unguarded FlashInfer import on CUDA;
        # greedy decoding never uses that kernel (see ../shared/gpu/README.md).
        env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    return env


def side_env(side: str, env: dict[str, str]) -> dict[str, str]:
    return {**env, "ATOM_DISABLE_VLLM_PLUGIN": "1" if side == "stock" else "0"}


def prompts_for(rng: random.Random, n: int, length: int, vocab: int) -> list[dict]:
    lo, hi = 10, max(11, vocab - 32)  # clear of the special tokens at the start
    return [{"prompt_token_ids": [rng.randrange(lo, hi) for _ in range(length)]} for _ in range(n)]


def parse_pairs(text: str) -> list[tuple[int, int]]:
    pairs = []
    for part in text.split(","):
        a, _, b = part.strip().partition("/")
        pairs.append((int(a), int(b or a)))
    return pairs


def fmt(x: Any, digits: int = 1) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:,.{digits}f}"
    return str(x)


def ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return round(a / b, 3) if a and b else None


def client_versions() -> dict:
    """vLLM / torch / Triton as installed here (what the servers run), and the GPU."""
    import torch
    import vllm

    try:
        import triton

        tv = triton.__version__
    except ImportError:
        tv = None
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else platform.processor() or "cpu"
    return {"vllm": vllm.__version__, "torch": torch.__version__, "triton": tv, "gpu": gpu}
