"""On an NVIDIA GPU, by default: a dense Qwen3 is served by vLLM's own model and attention (atom's
model steps aside there, measured slower in online serving: bench/NOTES.md 56; atom's MHA backend
too: NOTES 55), with one log line each that says why; ``ATOM_ENABLE_ON_NVIDIA=Qwen3ForCausalLM``
brings atom's model back, still on vLLM's attention backend. Both give stock's greedy tokens in
fp32. Each side in a fresh interpreter (plugins read the environment once per process)."""

from __future__ import annotations

import json

import pytest
import torch

from tests.attention import _runner as runner
from tests.conftest import run_main_json

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(getattr(torch.version, "hip", None) is not None,
                                 reason="NVIDIA's default; on ROCm atom's MHA backend serves")]

PROMPTS = [[11, 12, 13], [7] * 33, list(range(100, 170))]
STOCK_QWEN3 = "vllm.model_executor.models.qwen3.Qwen3ForCausalLM"


def _side(checkpoint, work, name: str, env: dict) -> tuple[dict, str]:
    out = work / f"{name}.json"
    return run_main_json("tests.attention._runner", [checkpoint, work / "prompts.json", out], out,
                         {**runner.ENGINE_ENV, **env})


@pytest.fixture(scope="module")
def sides(tiny_model, tmp_path_factory):
    checkpoint = tiny_model("qwen3", "float32")
    work = tmp_path_factory.mktemp("nvidia-default")
    (work / "prompts.json").write_text(json.dumps(PROMPTS))
    # tests/conftest.py enables both of atom's NVIDIA step-asides for the rest of the suite
    default = {"ATOM_ENABLE_MHA_ON_NVIDIA": "0", "ATOM_ENABLE_ON_NVIDIA": ""}
    return {
        "default": _side(checkpoint, work, "default", default),
        "model": _side(checkpoint, work, "model", {**default, "ATOM_ENABLE_ON_NVIDIA": "Qwen3ForCausalLM"}),
        "stock": _side(checkpoint, work, "stock", {"ATOM_DISABLE_VLLM_PLUGIN": "1"}),
    }


def test_vllms_model_and_attention_by_default(sides):
    (ours, stderr), (theirs, _) = sides["default"], sides["stock"]
    assert ours["facts"]["model_class"] == theirs["facts"]["model_class"] == STOCK_QWEN3
    assert ours["impls"] == theirs["impls"] and "ATOMAttentionImpl" not in ours["impls"]
    assert stderr.count("atom steps aside for Qwen3ForCausalLM (on an NVIDIA GPU: ") == 1, stderr[-3000:]
    assert "ATOM_ENABLE_ON_NVIDIA=Qwen3ForCausalLM serves it with atom's model" in stderr


def test_atoms_model_when_enabled_runs_on_vllms_attention(sides):
    (ours, stderr), (theirs, _) = sides["model"], sides["stock"]
    assert ours["facts"]["model_class"] == "atom.plugin.vllm.model_wrapper.ATOMForCausalLM"
    assert "ATOMAttentionImpl" not in ours["impls"] and ours["impls"] == theirs["impls"]
    assert stderr.count("atom's MHA backend steps aside on NVIDIA GPUs") == 1, stderr[-3000:]
    assert "atom steps aside for Qwen3ForCausalLM" not in stderr


@pytest.mark.parametrize("side", ["default", "model"])
def test_same_greedy_tokens_as_stock(sides, side):
    (ours, _), (theirs, _) = sides[side], sides["stock"]
    assert [r["tokens"] for r in ours["rows"]] == [r["tokens"] for r in theirs["rows"]]
