"""atom's Qwen3 end to end: vLLM (CPU, real engine) runs atom's model and agrees with stock vLLM
and with HF transformers; the model alone agrees with HF (rope variants, tied head) and with
itself across tensor-parallel ranks.

Engines (in-process, ~10 s each once vLLM is imported) are built once per module: atom's fp32 and
bf16 runs here, stock vLLM's in a fresh interpreter with ATOM_DISABLE_VLLM_PLUGIN=1 (plugins load
once per process), started first so that it overlaps with atom's runs.
"""

from __future__ import annotations

import inspect
import json
import os
import random
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Optional

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.conftest import REPO, run_python
from tests.models import _engine_runner as runner

PROMPT_LENGTHS = (1, 2, 5, 9, 17, 28, 43, 60)
NUM_LAYERS = 2  # atom.testing.tiny_models.KINDS["qwen3"]
# Measured atom vs stock vLLM on the tiny checkpoint: fp32 max |d logprob| 1e-6; bf16 0.045
# (teacher-forced prompt) and 0.036 (sampled, agreeing prefix), where bf16 itself is 0.015
# (stock) / 0.034 (atom) away from fp32. The bounds leave ~3x headroom.
FP32_LOGPROB_ATOL = 1e-3
BF16_LOGPROB_ATOL = 0.15


def _prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, 1000) for _ in range(n)] for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def checkpoint(tiny_model) -> Path:
    return tiny_model("qwen3")


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return _prompts()


# -- stock vLLM, in a subprocess --------------------------------------------------------------------
@pytest.fixture(scope="module")
def stock_process(checkpoint, prompts, tmp_path_factory):
    """Stock vLLM's fp32 and bf16 runs, started in the background (collected by ``stock_runs``)."""
    work = tmp_path_factory.mktemp("stock")
    (work / "prompts.json").write_text(json.dumps(prompts))
    env = {**os.environ, **runner.ENGINE_ENV, "ATOM_DISABLE_VLLM_PLUGIN": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.models._engine_runner", str(checkpoint), str(work / "prompts.json"),
         str(work / "out.json"), "float32", "bfloat16"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    yield proc, work / "out.json"
    if proc.poll() is None:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def stock_runs(stock_process) -> dict[str, dict]:
    proc, out = stock_process
    log, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, log[-4000:]
    assert "[atom] built atom.models" not in log, "stock run used atom's model despite ATOM_DISABLE_VLLM_PLUGIN=1"
    return {r["dtype"]: r for r in json.loads(out.read_text())}


# -- atom in vLLM, in this process ------------------------------------------------------------------
def _engine_facts(llm: Any) -> dict[str, Any]:
    """Which classes vLLM built, and whether atom's attention layers are vLLM's registered ones."""
    context = llm.llm_engine.vllm_config.compilation_config.static_forward_context

    def facts(model: nn.Module) -> dict[str, Any]:
        attn = [m for name, m in model.named_modules() if name.endswith("self_attn.attn")]
        inner = getattr(model, "model", None)
        return {
            "wrapper": f"{type(model).__module__}:{type(model).__qualname__}",
            "atom_model": f"{type(inner).__module__}:{type(inner).__qualname__}",
            "attention": sorted({f"{type(m).__module__}:{type(m).__qualname__}" for m in attn}),
            "registered": sorted(k for k, v in context.items() if any(v is m for m in attn)),
        }

    return llm.apply_model(facts)[0]


@pytest.fixture(scope="module")
def atom_runs(checkpoint, prompts, stock_process) -> dict[str, dict]:
    """atom's fp32 and bf16 runs, one engine each, built and torn down in turn."""
    if os.environ.get("ATOM_DISABLE_VLLM_PLUGIN", "0") not in ("", "0"):
        pytest.skip("ATOM_DISABLE_VLLM_PLUGIN is set for this test process")
    with pytest.MonkeyPatch.context() as mp:
        for key, value in runner.ENGINE_ENV.items():
            mp.setenv(key, value)
        return {
            "float32": runner.run_engine(str(checkpoint), prompts, "float32", inspect=_engine_facts),
            "bfloat16": runner.run_engine(str(checkpoint), prompts, "bfloat16"),
        }


# -- HF transformers oracle -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def hf_fp32_tokens(checkpoint, prompts) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()
    rows = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=runner.NEW_TOKENS, min_new_tokens=runner.NEW_TOKENS)
            rows.append(out[0, len(prompt):].tolist())
    return rows


def _max_diff(a: list[Optional[float]], b: list[Optional[float]]) -> float:
    pairs = [(x, y) for x, y in zip(a, b, strict=True)]
    assert all(x is not None and y is not None for x, y in pairs)
    return max((abs(x - y) for x, y in pairs), default=0.0)


# -- the wrapper as vLLM sees it --------------------------------------------------------------------
def test_wrapper_takes_keyword_vllm_config_and_is_a_vllm_text_generation_model():
    from vllm.model_executor.models.interfaces_base import is_text_generation_model

    from atom.plugin.vllm.model_wrapper import ATOMForCausalLM, ATOMModelBase, ATOMMoEForCausalLM

    param = inspect.signature(ATOMModelBase.__init__).parameters["vllm_config"]
    assert param.kind is inspect.Parameter.KEYWORD_ONLY
    for cls in (ATOMForCausalLM, ATOMMoEForCausalLM):
        assert is_text_generation_model(cls), cls  # vLLM's own check of the model interface


def test_vllm_registry_resolves_qwen3_to_atom_wrapper(monkeypatch):
    from vllm import ModelRegistry

    from atom.plugin.vllm.model_wrapper import ATOMForCausalLM
    from atom.plugin.vllm.register import register_model

    monkeypatch.delenv("ATOM_DISABLE_VLLM_PLUGIN", raising=False)
    register_model()
    entry = ModelRegistry.models["Qwen3ForCausalLM"]
    assert (entry.module_name, entry.class_name) == ("atom.plugin.vllm.model_wrapper", "ATOMForCausalLM")
    assert ModelRegistry._try_load_model_cls("Qwen3ForCausalLM") is ATOMForCausalLM


def test_atom_models_never_import_vllm():
    proc = run_python("""
        import sys
        import atom.models.qwen3, atom.models.interfaces
        print("VLLM", sorted(m for m in sys.modules if m == "vllm" or m.startswith("vllm.")))
    """)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "VLLM []" in proc.stdout


# -- vLLM runs atom's model -------------------------------------------------------------------------
def test_vllm_builds_atom_model_with_vllm_attention_layers(atom_runs):
    facts = atom_runs["float32"]["facts"]
    assert facts["wrapper"] == "atom.plugin.vllm.model_wrapper:ATOMForCausalLM"
    assert facts["atom_model"] == "atom.models.qwen3:Qwen3ForCausalLM"
    assert facts["attention"] == ["vllm.model_executor.layers.attention.attention:Attention"]
    # Registered in vLLM's forward context under the same names as vLLM's own Qwen3 uses.
    assert facts["registered"] == [f"model.layers.{i}.self_attn.attn" for i in range(NUM_LAYERS)]


def test_fp32_greedy_tokens_equal_stock_vllm(atom_runs, stock_runs):
    ours, theirs = atom_runs["float32"]["rows"], stock_runs["float32"]["rows"]
    assert [r["tokens"] for r in ours] == [r["tokens"] for r in theirs]
    for a, b in zip(ours, theirs):
        assert _max_diff(a["logprobs"], b["logprobs"]) < FP32_LOGPROB_ATOL
        assert _max_diff(a["prompt_logprobs"], b["prompt_logprobs"]) < FP32_LOGPROB_ATOL


def test_fp32_greedy_tokens_equal_hf_transformers(atom_runs, hf_fp32_tokens):
    assert [r["tokens"] for r in atom_runs["float32"]["rows"]] == hf_fp32_tokens


def test_bf16_logprobs_close_to_stock_vllm(atom_runs, stock_runs):
    """Teacher-forced prompt logprobs at every position, and the sampled tokens' logprobs while
    both greedy continuations agree (bf16 rounding may legitimately flip a near-tie later)."""
    ours, theirs = atom_runs["bfloat16"]["rows"], stock_runs["bfloat16"]["rows"]
    agreeing = 0
    for a, b in zip(ours, theirs):
        assert _max_diff(a["prompt_logprobs"], b["prompt_logprobs"]) < BF16_LOGPROB_ATOL
        n = next((i for i, (x, y) in enumerate(zip(a["tokens"], b["tokens"])) if x != y), len(a["tokens"]))
        agreeing += n
        assert _max_diff(a["logprobs"][:n], b["logprobs"][:n]) < BF16_LOGPROB_ATOL
    assert agreeing >= 0.75 * sum(len(r["tokens"]) for r in ours)


# -- atom's model alone (no vLLM): against HF, and across tensor-parallel ranks ---------------------
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


ROPE_VARIANTS = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
             "rope_theta": 10000.0},
}


def _hf_model(tied: bool, rope: Optional[dict]) -> nn.Module:
    import transformers

    from atom.testing.tiny_models import KINDS, VOCAB_SIZE

    kwargs = dict(KINDS["qwen3"][1], tie_word_embeddings=tied, vocab_size=VOCAB_SIZE)
    if rope is not None:
        kwargs.pop("rope_theta")
        kwargs["rope_parameters"] = rope
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.Qwen3Config(**kwargs), dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():  # wider than HF's init: distinct logits
            p.normal_(0.0, 0.08 if p.dim() >= 2 else 0.5).add_(1.0 if p.dim() == 1 else 0.0)
    return model.eval()


def _atom_model(hf_model: nn.Module, parallel: Any = None) -> nn.Module:
    from atom.config import Config
    from atom.models.interfaces import ModelParallel
    from atom.models.qwen3 import Qwen3ForCausalLM

    config = Config(model="tiny-qwen3", max_num_batched_tokens=256, max_num_seqs=1, max_model_len=256,
                    gpu_memory_utilization=0.0, hf_config=hf_model.config, dtype=torch.float32)
    model = Qwen3ForCausalLM(config, make_attention=CausalSelfAttention, parallel=parallel or ModelParallel())
    loaded = model.load_weights((n, t.clone()) for n, t in hf_model.state_dict().items())
    assert loaded == {n for n, _ in model.named_parameters()}
    return model.eval()


@pytest.mark.parametrize("tied,rope", [(False, "default"), (True, "default"), (False, "linear"),
                                       (False, "yarn")])
def test_atom_qwen3_logits_match_hf_transformers(tied, rope):
    hf = _hf_model(tied, ROPE_VARIANTS[rope])
    atom = _atom_model(hf)
    assert (atom.lm_head.weight is atom.model.embed_tokens.weight) == tied
    ids = torch.tensor(_prompts()[-1])
    with torch.no_grad():
        ours = atom.compute_logits(atom(ids, torch.arange(len(ids))))
        theirs = hf(ids[None]).logits[0]
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


def test_unknown_checkpoint_tensor_is_an_error():
    hf = _hf_model(False, None)
    atom = _atom_model(hf)
    with pytest.raises(ValueError, match="no matching parameter"):
        atom.load_weights([("model.layers.0.self_attn.not_a_proj.weight", torch.zeros(1))])


class _ThreadGroup:
    """vLLM's TP collectives (sum all-reduce, concatenating all-gather) for ranks running as
    threads of this process: enough to check atom's sharding math without processes."""

    def __init__(self, size: int) -> None:
        self.size, self.slots, self.barrier = size, [None] * size, threading.Barrier(size, timeout=60)

    def rank(self, rank: int) -> "_ThreadGroup._Rank":
        return self._Rank(self, rank)

    class _Rank:
        def __init__(self, group: "_ThreadGroup", rank: int) -> None:
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


@pytest.mark.parametrize("tp", [2, 4])  # 4 ranks > 2 KV heads: each KV head replicated twice
def test_tensor_parallel_ranks_match_single_rank(tp):
    from atom.models.interfaces import ModelParallel

    hf = _hf_model(False, None)
    ids = torch.tensor(_prompts()[-1])
    positions = torch.arange(len(ids))
    single = _atom_model(hf)
    with torch.no_grad():
        expected = single.compute_logits(single(ids, positions))
    group = _ThreadGroup(tp)
    models = [_atom_model(hf, ModelParallel(r, tp, group.rank(r))) for r in range(tp)]
    heads = hf.config.num_attention_heads // tp
    kv_heads = max(1, hf.config.num_key_value_heads // tp)
    assert models[0].model.layers[0].self_attn.qkv_proj.weight.shape[0] == (heads + 2 * kv_heads) * hf.config.head_dim
    assert models[0].lm_head.weight.shape[0] == hf.config.vocab_size // tp

    results: list[Any] = [None] * tp

    def run(rank: int) -> None:
        try:
            with torch.no_grad():
                m = models[rank]
                results[rank] = m.compute_logits(m(ids, positions))
        except BaseException as exc:  # surfaced below; a dead rank would hang the others
            group.barrier.abort()
            results[rank] = exc

    threads = [threading.Thread(target=run, args=(r,)) for r in range(tp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for rank, logits in enumerate(results):
        assert not isinstance(logits, BaseException), logits
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4, msg=f"rank {rank}")


def test_causal_lm_check_sees_submodules():
    """The wrapper's interface check must find nn.Module submodules (Python 3.12's protocol
    isinstance uses getattr_static and missed ``lm_head`` on the GPU image)."""
    import torch.nn as nn

    from atom.models.interfaces import missing_causal_lm_members

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.lm_head = nn.Linear(2, 2)

        def embed_input_ids(self, input_ids): ...

        def compute_logits(self, hidden_states): ...

        def load_weights(self, weights): ...

    assert missing_causal_lm_members(Model()) == []
    assert missing_causal_lm_members(nn.Module()) == ["lm_head", "embed_input_ids", "compute_logits", "load_weights"]
