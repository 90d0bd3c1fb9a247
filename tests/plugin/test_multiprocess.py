"""Default multi-process vLLM: atom activates in the engine-core and worker processes too."""

import json
import re

import pytest

from tests.conftest import run_python


RUN = """
    if __name__ == "__main__":
        import json
        from vllm import LLM, SamplingParams
        llm = LLM(model={model!r}, dtype="float32", max_model_len=128, max_num_seqs=2, enforce_eager=True,
                  gpu_memory_utilization=0.3, seed=0)
        out = llm.generate(["hello", "one two three four five six"],
                           SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
        print("TOKENS", json.dumps([list(o.outputs[0].token_ids) for o in out]))
"""


def _tokens(proc):
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith("TOKENS"))[7:])


@pytest.mark.slow
def test_plugin_active_in_engine_core_and_worker(tiny_model):
    """vLLM's default engine (engine core and worker in their own processes): atom activates in
    each and the greedy fp32 tokens equal stock vLLM's default engine."""
    model = tiny_model("qwen3", "float32")
    proc = run_python(RUN.format(model=str(model)), env={"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}, timeout=600)
    ours = _tokens(proc)
    stock = _tokens(run_python(RUN.format(model=str(model)),
                               env={"VLLM_ENABLE_V1_MULTIPROCESSING": "1", "ATOM_DISABLE_VLLM_PLUGIN": "1"},
                               timeout=600))
    assert ours == stock and [len(t) for t in ours] == [8, 8]
    activated = re.findall(r"\((\S+) pid=(\d+)\) INFO .*atom platform ATOMCpuPlatform activated", proc.stderr)
    names = {name for name, _ in activated}
    pids = {pid for _, pid in activated}
    assert "MainProcess" in names, proc.stderr[-4000:]
    assert any(n.startswith("EngineCore") for n in names), names
    assert len(pids) >= 3, activated  # main, engine core, worker
    registered = re.findall(r"\((\S+) pid=(\d+)\) INFO .*Register model Qwen3ForCausalLM", proc.stderr)
    assert len({pid for _, pid in registered}) >= 3, registered
