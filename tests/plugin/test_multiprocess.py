"""Default multi-process vLLM: atom activates in the engine-core and worker processes too."""

import re

import pytest

from tests.conftest import run_python


@pytest.mark.slow
def test_plugin_active_in_engine_core_and_worker(tiny_model):
    model = tiny_model("qwen3")
    proc = run_python(f"""
        if __name__ == "__main__":
            from vllm import LLM, SamplingParams
            llm = LLM(model={str(model)!r}, max_model_len=128, max_num_seqs=2, enforce_eager=True,
                      gpu_memory_utilization=0.3, seed=0)
            out = llm.generate(["hello"], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
            print("TOKENS", len(out[0].outputs[0].token_ids))
    """, env={"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "TOKENS 4" in proc.stdout
    activated = re.findall(r"\((\S+) pid=(\d+)\) INFO .*atom platform ATOMCpuPlatform activated", proc.stderr)
    names = {name for name, _ in activated}
    pids = {pid for _, pid in activated}
    assert "MainProcess" in names, proc.stderr[-4000:]
    assert any(n.startswith("EngineCore") for n in names), names
    assert len(pids) >= 3, activated  # main, engine core, worker
    registered = re.findall(r"\((\S+) pid=(\d+)\) INFO .*Register model Qwen3ForCausalLM", proc.stderr)
    assert len({pid for _, pid in registered}) >= 3, registered
