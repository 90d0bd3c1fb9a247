"""What the model tests share: the comparisons of an atom engine run with a stock vLLM run, the
model-alone attention stand-in, and in-process "ranks" for tensor/expert-parallel checks.

The engine fixtures built on these live in ``tests/models/conftest.py``; a test module provides
``checkpoint`` and ``prompts``.
"""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn


#: One batch of prompts of very different lengths (prefill and decode mixed in one step).
PROMPT_LENGTHS = (1, 2, 5, 9, 17, 28, 43, 60)


def mixed_prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, 1000) for _ in range(n)] for n in PROMPT_LENGTHS]


def max_diff(a: list[Optional[float]], b: list[Optional[float]]) -> float:
    pairs = [(x, y) for x, y in zip(a, b, strict=True)]
    assert all(x is not None and y is not None for x, y in pairs)
    return max((abs(x - y) for x, y in pairs), default=0.0)


def engine_facts(llm: Any) -> dict[str, Any]:
    """Which classes vLLM built, and whether atom's attention layers are vLLM's registered ones."""
    context = llm.llm_engine.vllm_config.compilation_config.static_forward_context

    def facts(model: nn.Module) -> dict[str, Any]:
        attn_names = [name for name, _ in model.named_modules() if name.endswith("self_attn.attn")]
        attn = [model.get_submodule(name) for name in attn_names]
        inner = getattr(model, "model", None)
        return {
            "wrapper": f"{type(model).__module__}:{type(model).__qualname__}",
            "atom_model": f"{type(inner).__module__}:{type(inner).__qualname__}",
            "attention": sorted({f"{type(m).__module__}:{type(m).__qualname__}" for m in attn}),
            "registered": sorted(k for k, v in context.items() if any(v is m for m in attn)),
            "modules": sorted({f"{type(m).__module__}:{type(m).__qualname__}" for m in model.modules()}),
            # vLLM layers other than the attention layers and their own submodules.
            "vllm_outside_attention": sorted({
                f"{type(m).__module__}:{type(m).__qualname__}" for name, m in model.named_modules()
                if type(m).__module__.startswith("vllm.model_executor.layers")
                and not any(name == a or name.startswith(a + ".") for a in attn_names)}),
        }

    return llm.apply_model(facts)[0]


def assert_within_fp8_activation_noise(name: str, logits: torch.Tensor, reference: torch.Tensor,
                                       mean_atol: float = 0.25, min_argmax_agreement: float = 0.7) -> None:
    """Logits of a run that quantises activations to fp8 vs a weight-only reference: mean
    |difference| within ``mean_atol`` and most argmaxes equal (the measured numbers printed)."""
    diff = (logits - reference).abs()
    agree = (logits.argmax(-1) == reference.argmax(-1)).float().mean()
    print(f"[fp8 W8A8 default] {name}: max {diff.max():.3f} mean {diff.mean():.4f} argmax agree {agree:.2f}")
    assert diff.mean() < mean_atol and agree > min_argmax_agreement


def assert_same_greedy_run(ours: dict, theirs: dict, logprob_atol: float) -> None:
    """fp32: identical tokens, and logprobs (sampled and teacher-forced) within ``logprob_atol``."""
    assert [r["tokens"] for r in ours["rows"]] == [r["tokens"] for r in theirs["rows"]]
    for a, b in zip(ours["rows"], theirs["rows"]):
        assert max_diff(a["logprobs"], b["logprobs"]) < logprob_atol
        assert max_diff(a["prompt_logprobs"], b["prompt_logprobs"]) < logprob_atol


def assert_close_greedy_run(ours: dict, theirs: dict, logprob_atol: float, *, prompt_atol: Optional[float] = None,
                            prompt_mean_atol: Optional[float] = None, min_agreeing: float = 0.75) -> None:
    """bf16: teacher-forced prompt logprobs at every position (max within ``prompt_atol``,
    default ``logprob_atol``; mean within ``prompt_mean_atol`` if given), and the sampled tokens'
    logprobs while both greedy continuations agree (bf16 rounding may legitimately flip a
    near-tie later); at least ``min_agreeing`` of all tokens before the first divergence."""
    prompt_atol = logprob_atol if prompt_atol is None else prompt_atol
    agreeing, prompt_diffs = 0, []
    for a, b in zip(ours["rows"], theirs["rows"]):
        assert max_diff(a["prompt_logprobs"], b["prompt_logprobs"]) < prompt_atol
        prompt_diffs += [abs(x - y) for x, y in zip(a["prompt_logprobs"], b["prompt_logprobs"])]
        n = next((i for i, (x, y) in enumerate(zip(a["tokens"], b["tokens"])) if x != y), len(a["tokens"]))
        agreeing += n
        assert max_diff(a["logprobs"][:n], b["logprobs"][:n]) < logprob_atol
    if prompt_mean_atol is not None:
        assert sum(prompt_diffs) / len(prompt_diffs) < prompt_mean_atol
    assert agreeing >= min_agreeing * sum(len(r["tokens"]) for r in ours["rows"])


class CausalSelfAttention(nn.Module):
    """The attention an :class:`AttentionFactory` returns, for one unpadded sequence (no cache)."""

    def __init__(self, *, num_heads: int, head_dim: int, scale: float, num_kv_heads: int, prefix: str,
                 sliding_window: Optional[int] = None) -> None:
        super().__init__()
        self.num_heads, self.head_dim, self.scale, self.num_kv_heads = num_heads, head_dim, scale, num_kv_heads

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        t, group = q.shape[0], self.num_heads // self.num_kv_heads
        q = q.reshape(t, self.num_heads, self.head_dim).transpose(0, 1)
        k = k.reshape(t, self.num_kv_heads, self.head_dim).transpose(0, 1).repeat_interleave(group, 0)
        v = v.reshape(t, self.num_kv_heads, self.head_dim).transpose(0, 1).repeat_interleave(group, 0)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        return o.transpose(0, 1).reshape(t, self.num_heads * self.head_dim)


class LatentSelfAttention(nn.Module):
    """The multi-head latent attention an ``MLAAttentionFactory`` returns, for one unpadded
    sequence (no cache): keys and values expanded from the latent with the model's kv_b_proj."""

    def __init__(self, *, num_heads: int, scale: float, qk_nope_head_dim: int, qk_rope_head_dim: int,
                 v_head_dim: int, q_lora_rank: Optional[int], kv_lora_rank: int, kv_b_proj: nn.Module,
                 prefix: str) -> None:
        super().__init__()
        self.num_heads, self.scale = num_heads, scale
        self.nope, self.rope, self.v_head_dim = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        self._kv_b_proj = [kv_b_proj]  # the model's module, not a submodule of this one

    def forward(self, q: torch.Tensor, kv_c_normed: torch.Tensor, k_pe: torch.Tensor) -> torch.Tensor:
        t, h = q.shape[0], self.num_heads
        kv = self._kv_b_proj[0](kv_c_normed).view(t, h, self.nope + self.v_head_dim)
        k_nope, v = kv.split([self.nope, self.v_head_dim], dim=-1)
        k = torch.cat([k_nope, k_pe.expand(t, h, self.rope)], dim=-1)
        o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                           is_causal=True, scale=self.scale)
        return o.transpose(0, 1).reshape(t, h * self.v_head_dim)


class ReferenceAttention:
    """An attention factory for a model alone: :class:`CausalSelfAttention`, and
    :class:`LatentSelfAttention` as its ``mla`` variant."""

    def __call__(self, **kwargs: Any) -> nn.Module:
        return CausalSelfAttention(**kwargs)

    def mla(self, **kwargs: Any) -> nn.Module:
        return LatentSelfAttention(**kwargs)


def widen_init(model: nn.Module) -> nn.Module:
    """Re-draw an HF model's weights wider than HF's init, so logits (and expert routes) are
    well separated and comparisons test the math rather than near-ties."""
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.08 if p.dim() >= 2 else 0.5).add_(1.0 if p.dim() == 1 else 0.0)
    return model.eval()


def build_atom_model(model_cls: type, hf_config: Any, tensors: Iterable[tuple[str, torch.Tensor]],
                     parallel: Any = None, **config: Any) -> nn.Module:
    """An atom model alone (no host): :class:`ReferenceAttention`, fp32, loaded from HF-named
    ``tensors``; every parameter must be loaded. ``config`` overrides atom Config fields."""
    from atom.config import Config
    from atom.models.interfaces import ModelParallel

    cfg = Config(max_model_len=256, hf_config=hf_config, dtype=torch.float32, **config)
    model = model_cls(cfg, make_attention=ReferenceAttention(), parallel=parallel or ModelParallel())
    loaded = model.load_weights(tensors)
    assert loaded == {n for n, _ in model.named_parameters()}
    return model.eval()


def full_logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Logits of one sequence through an atom model alone."""
    with torch.no_grad():
        return model.compute_logits(model(ids, torch.arange(len(ids))))


class ThreadGroup:
    """vLLM's TP collectives (sum all-reduce, concatenating all-gather) for ranks running as
    threads of this process: enough to check atom's sharding math without processes."""

    def __init__(self, size: int) -> None:
        self.size, self.slots, self.barrier = size, [None] * size, threading.Barrier(size, timeout=60)

    def rank(self, rank: int) -> "ThreadGroup._Rank":
        return self._Rank(self, rank)

    class _Rank:
        def __init__(self, group: "ThreadGroup", rank: int) -> None:
            self.group, self.r = group, rank

        def _exchange(self, x: torch.Tensor) -> list[torch.Tensor]:
            g = self.group
            g.slots[self.r] = x
            g.barrier.wait()
            parts = list(g.slots)
            g.barrier.wait()  # nobody overwrites a slot before every rank has read them all
            return parts

        def all_reduce(self, input_: torch.Tensor) -> torch.Tensor:
            return torch.stack(self._exchange(input_)).sum(0)

        def all_gather(self, input_: torch.Tensor, dim: int = -1) -> torch.Tensor:
            return torch.cat(self._exchange(input_), dim=dim)


def run_ranks(group: ThreadGroup, step: Callable[[int], Any]) -> list[Any]:
    """``step(rank)`` on one thread per rank of ``group``; returns the results in rank order and
    re-raises the first rank's failure (a dead rank aborts the barrier so the others stop too)."""
    results: list[Any] = [None] * group.size

    def run(rank: int) -> None:
        try:
            with torch.no_grad():
                results[rank] = step(rank)
        except BaseException as exc:
            group.barrier.abort()
            results[rank] = exc

    threads = [threading.Thread(target=run, args=(r,)) for r in range(group.size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for rank, result in enumerate(results):
        if isinstance(result, BaseException):
            raise AssertionError(f"rank {rank} failed") from result
    return results


def tiny_hf_model(kind: str, out_dir: Any, **overrides: Any) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """A random fp32 HF model of ``atom.testing.tiny_models`` kind ``kind`` (config fields
    overridden by ``overrides``, weights drawn by :func:`widen_init`), and its tensors as
    ``save_pretrained`` writes them into ``out_dir``: the checkpoint names a host's weight
    iterator yields (one matrix per expert, not transformers' in-memory fused experts)."""
    import transformers
    from safetensors.torch import load_file

    from atom.testing.tiny_models import KINDS, VOCAB_SIZE

    cls_name, kwargs = KINDS[kind]
    config = getattr(transformers, cls_name)(**{**kwargs, "vocab_size": VOCAB_SIZE, **overrides})
    torch.manual_seed(0)
    model = widen_init(transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32))
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.05)  # a zero-initialised buffer in HF: make the correction count
    model.save_pretrained(out_dir, safe_serialization=True)
    return model, load_file(f"{out_dir}/model.safetensors")


def prompt_error_profile(diffs: list[float]) -> dict[str, float]:
    """Max, mean, 95th percentile (nearest rank) of teacher-forced |d logprob| values, and the
    fraction of them over 0.3 (positions a flipped router pick moved). The
    percentile is what a tiny random MoE's router near-ties leave alone: a flipped top-k pick
    moves one position by up to about 1, and which ties flip changes with the machine's
    arithmetic, so its max is not a stable measure of a kernel's error."""
    ranked = sorted(diffs)
    return {"prompt_max": ranked[-1], "prompt_mean": sum(ranked) / len(ranked),
            "prompt_p95": ranked[max(math.ceil(0.95 * len(ranked)) - 1, 0)],
            "prompt_over_0.3": sum(d > 0.3 for d in ranked) / len(ranked)}


def greedy_run_stats(ours: dict, theirs: dict) -> dict[str, float]:
    """Measured distance of two greedy runs (printed by the model tests, for the record):
    :func:`prompt_error_profile` of the teacher-forced prompts, max over the sampled tokens while
    the continuations agree, and the fraction of tokens before the first divergence."""
    prompt_diffs, sampled, agreeing, total = [], [0.0], 0, 0
    for a, b in zip(ours["rows"], theirs["rows"]):
        prompt_diffs += [abs(x - y) for x, y in zip(a["prompt_logprobs"], b["prompt_logprobs"])]
        n = next((i for i, (x, y) in enumerate(zip(a["tokens"], b["tokens"])) if x != y), len(a["tokens"]))
        sampled += [abs(x - y) for x, y in zip(a["logprobs"][:n], b["logprobs"][:n])]
        agreeing, total = agreeing + n, total + len(a["tokens"])
    return {**prompt_error_profile(prompt_diffs), "sampled_max": max(sampled), "agreeing": agreeing / total}


def run_two_worker_engine(checkpoint: Path, prompts: list[list[int]], tmp_path: Path, engine: dict) -> tuple[dict, str]:
    """One fp32 greedy run of ``prompts`` on a real vLLM engine of two CPU worker processes (one
    core each; ``engine`` says how they split the model: ``tensor_parallel_size`` or
    ``pipeline_parallel_size`` 2, with other keyword arguments); returns the run (as
    ``tests.models._engine_runner`` writes it) and the engine's log. Skips on a machine with fewer
    than 2 CPUs."""
    import pytest

    from tests.conftest import REPO
    from tests.models import _engine_runner as runner

    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs 2 CPUs for 2 vLLM CPU workers")
    (tmp_path / "prompts.json").write_text(json.dumps(prompts))
    env = {**os.environ, **runner.ENGINE_ENV,
           # the workers need processes; vLLM-CPU binds one core per worker (one NUMA node here).
           "VLLM_ENABLE_V1_MULTIPROCESSING": "1", "VLLM_CPU_OMP_THREADS_BIND": f"{cpus[0]}|{cpus[1]}"}
    proc = subprocess.run(
        [sys.executable, "-m", "tests.models._engine_runner", str(checkpoint), str(tmp_path / "prompts.json"),
         str(tmp_path / "out.json"), "--engine", json.dumps(engine), "float32"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    (ours,) = json.loads((tmp_path / "out.json").read_text())
    return ours, proc.stderr + proc.stdout


def run_tp2_engine(checkpoint: Path, prompts: list[list[int]], tmp_path: Path, engine: dict,
                   model: str, wrapper: str, arch: str) -> dict:
    """One fp32 greedy run of ``prompts`` on a real vLLM engine with ``tensor_parallel_size=2`` (two
    vLLM CPU worker processes, one core each) and ``engine``'s other keyword arguments; asserts that
    each rank built atom's ``model`` (class path) behind ``wrapper`` for ``arch`` and returns the
    run (as ``tests.models._engine_runner`` writes it). Skips on a machine with fewer than 2 CPUs."""
    ours, log = run_two_worker_engine(checkpoint, prompts, tmp_path, {**engine, "tensor_parallel_size": 2})
    for rank in range(2):
        assert f"built {model} ({wrapper}) for {arch}, tp rank {rank} of 2" in log
    return ours


def first_token_error(a: dict, b: dict) -> tuple[float, float]:
    """Run ``a`` against run ``b`` (the same prompts): (max |first-token logprob difference| --
    the same context on both sides, so one forward pass --, fraction of greedy tokens before the
    first divergence)."""
    first, before, total = 0.0, 0, 0
    for x, y in zip(a["rows"], b["rows"]):
        first = max(first, abs(x["logprobs"][0] - y["logprobs"][0]))
        total += len(y["tokens"])
        before += next((i for i, (s, t) in enumerate(zip(x["tokens"], y["tokens"])) if s != t), len(y["tokens"]))
    return first, before / total
