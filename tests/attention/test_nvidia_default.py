"""On an NVIDIA GPU, by default: atom's Qwen3 model with vLLM's own attention backend (atom's MHA
backend steps aside there, measured slower: bench/NOTES.md 55), the same backend stock vLLM
picks, the same greedy tokens as stock in fp32, and one log line that says why. Each side in a
fresh interpreter (plugins read the environment once per process)."""

from __future__ import annotations

import json

import pytest
import torch

from tests.attention import _runner as runner
from tests.conftest import run_python

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(getattr(torch.version, "hip", None) is not None,
                                 reason="NVIDIA's default; on ROCm atom's MHA backend serves")]

PROMPTS = [[11, 12, 13], [7] * 33, list(range(100, 170))]


def _side(checkpoint, work, name: str, env: dict) -> tuple[dict, str]:
    out = work / f"{name}.json"
    proc = run_python(
        f"""
        import sys
        from tests.attention._runner import main
        sys.exit(main([{str(checkpoint)!r}, {str(work / 'prompts.json')!r}, {str(out)!r}]))
        """,
        env={**runner.ENGINE_ENV, **env},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text()), proc.stderr


@pytest.fixture(scope="module")
def sides(tiny_model, tmp_path_factory):
    checkpoint = tiny_model("qwen3", "float32")
    work = tmp_path_factory.mktemp("nvidia-default")
    (work / "prompts.json").write_text(json.dumps(PROMPTS))
    return {
        "atom": _side(checkpoint, work, "atom", {"ATOM_ENABLE_MHA_ON_NVIDIA": "0"}),
        "stock": _side(checkpoint, work, "stock", {"ATOM_DISABLE_VLLM_PLUGIN": "1"}),
    }


def test_vllms_attention_under_atoms_model_by_default(sides):
    (ours, stderr), (theirs, _) = sides["atom"], sides["stock"]
    assert ours["facts"]["model_class"] == "atom.plugin.vllm.model_wrapper.ATOMForCausalLM"
    assert theirs["facts"]["model_class"] != ours["facts"]["model_class"]
    assert "ATOMAttentionImpl" not in ours["impls"] and ours["impls"] == theirs["impls"]
    assert stderr.count("atom's MHA backend steps aside on NVIDIA GPUs") == 1, stderr[-3000:]


def test_same_greedy_tokens_as_stock(sides):
    (ours, _), (theirs, _) = sides["atom"], sides["stock"]
    assert [r["tokens"] for r in ours["rows"]] == [r["tokens"] for r in theirs["rows"]]
