"""Engine fixtures shared by the model tests; each test module provides ``checkpoint`` (a tiny
checkpoint folder) and ``prompts`` (token-id lists), both module-scoped.

Engines (in-process, ~10 s each once vLLM is imported) are built once per module: atom's fp32 and
bf16 runs in this process, stock vLLM's in a fresh interpreter with ATOM_DISABLE_VLLM_PLUGIN=1
(plugins load once per process), started first so that it overlaps with atom's runs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.conftest import REPO
from tests.models import _engine_runner as runner
from tests.models._harness import engine_facts


@pytest.fixture(scope="module")
def engine_kwargs() -> dict:
    """Extra vLLM engine arguments for both sides of a module's comparisons (a test module may
    override this fixture)."""
    return {}


@pytest.fixture(scope="module")
def stock_process(checkpoint, prompts, engine_kwargs, tmp_path_factory):
    """Stock vLLM's fp32 and bf16 runs, started in the background (collected by ``stock_runs``)."""
    work = tmp_path_factory.mktemp("stock")
    (work / "prompts.json").write_text(json.dumps(prompts))
    env = {**os.environ, **runner.ENGINE_ENV, "ATOM_DISABLE_VLLM_PLUGIN": "1"}
    engine = ["--engine", json.dumps(engine_kwargs)] if engine_kwargs else []
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.models._engine_runner", str(checkpoint), str(work / "prompts.json"),
         str(work / "out.json"), *engine, "float32", "bfloat16"],
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


@pytest.fixture(scope="module")
def atom_runs(checkpoint, prompts, engine_kwargs, stock_process) -> dict[str, dict]:
    """atom's fp32 and bf16 runs, one engine each, built and torn down in turn."""
    if os.environ.get("ATOM_DISABLE_VLLM_PLUGIN", "0") not in ("", "0"):
        pytest.skip("ATOM_DISABLE_VLLM_PLUGIN is set for this test process")
    with pytest.MonkeyPatch.context() as mp:
        for key, value in runner.ENGINE_ENV.items():
            mp.setenv(key, value)
        return {
            "float32": runner.run_engine(str(checkpoint), prompts, "float32", inspect=engine_facts,
                                         **engine_kwargs),
            "bfloat16": runner.run_engine(str(checkpoint), prompts, "bfloat16", **engine_kwargs),
        }


@pytest.fixture(scope="module")
def hf_fp32_tokens(checkpoint, prompts) -> list[list[int]]:
    """HF transformers' greedy continuations in fp32 (the second oracle)."""
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


@pytest.fixture(scope="module")
def hf_fp32_teacher_forced(checkpoint, prompts, atom_runs) -> list[list[int]]:
    """HF transformers' fp32 argmax at every position of atom's fp32 greedy continuations, fed
    atom's own tokens (one full forward per prompt, no KV cache). Equal to atom's tokens iff every
    token atom chose is HF's choice for the same prefix; unlike ``hf_fp32_tokens`` a single
    routing near-tie in HF's incremental decode cannot send the whole continuation elsewhere."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()
    rows = []
    with torch.no_grad():
        for prompt, row in zip(prompts, atom_runs["float32"]["rows"]):
            ids = torch.tensor([prompt + row["tokens"][:-1]])
            logits = model(ids, attention_mask=torch.ones_like(ids)).logits[0]
            rows.append(logits[len(prompt) - 1:].argmax(-1).tolist())
    return rows
