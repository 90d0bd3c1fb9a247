"""On CPU atom has no fast path (its kernels there are the torch reference), so by default its
model overrides and attention backend stay off and vLLM-CPU runs its own (issue #19); with
ATOM_ENABLE_ON_CPU=1 they are on. The one start-up line and doctor say which and why."""

from __future__ import annotations

import json

from tests.conftest import run_python

RUN = """
    import json, os
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from atom.testing.tiny_models import build
    from vllm import LLM, SamplingParams
    llm = LLM(model=str(build("qwen3", {path!r}, dtype="float32")), dtype="float32", max_model_len=128,
              gpu_memory_utilization=0.3, seed=0, enforce_eager=True)
    facts = llm.apply_model(lambda m: [type(m).__module__ + "." + type(m).__qualname__,
        sorted({{type(x.impl).__name__ for _, x in m.named_modules() if hasattr(x, "impl")}})])[0]
    out = llm.generate(["hello world, this is"], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    print("FACTS", json.dumps(facts + [list(out[0].outputs[0].token_ids)]))
"""


def _facts(proc):
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("FACTS"))[6:])


def test_off_on_cpu_by_default_and_on_when_asked(tmp_path):
    default = run_python(RUN.format(path=str(tmp_path / "m")), env={"ATOM_ENABLE_ON_CPU": None})
    cls, impls, tokens = _facts(default)
    assert cls == "vllm.model_executor.models.qwen3.Qwen3ForCausalLM" and impls == ["CPUAttentionBackendImpl"]
    lines = [ln for ln in default.stderr.splitlines() if "atom model overrides and attention off on CPU" in ln]
    assert lines and "ATOM_ENABLE_ON_CPU=1" in lines[0]
    assert "atom attention not used (off on CPU" in default.stderr  # the platform defers to vLLM-CPU
    enabled = run_python(RUN.format(path=str(tmp_path / "m")), env={"ATOM_ENABLE_ON_CPU": "1"})
    cls, impls, enabled_tokens = _facts(enabled)
    assert cls == "atom.plugin.vllm.model_wrapper.ATOMForCausalLM" and impls == ["ATOMAttentionImpl"]
    assert enabled_tokens == tokens  # fp32 greedy: the same answer either way


def test_doctor_says_which_is_in_effect():
    for value, expected in ((None, "models and attention: off on CPU"), ("1", "models and attention: on (ATOM_ENABLE_ON_CPU=1)")):
        proc = run_python("import sys; from atom import doctor; sys.exit(doctor.main())", env={"ATOM_ENABLE_ON_CPU": value})
        assert proc.returncode == 0, proc.stderr[-2000:]  # the platform still activates
        assert expected in proc.stdout, proc.stdout


def test_target_device_cpu_bypasses_atoms_platform_but_not_its_models(tmp_path):
    """With VLLM_TARGET_DEVICE=cpu this vLLM resolves its own CPU platform without asking plugins
    (compat.target_device_short_circuits_plugins): atom's models (asked for) still serve, with
    vLLM's CPU attention, one line says so, and the tokens are stock's."""
    from atom.plugin.vllm import compat

    assert compat.target_device_short_circuits_plugins()  # vllm-cpu 0.32, what CI runs
    env = {"VLLM_TARGET_DEVICE": "cpu", "ATOM_ENABLE_ON_CPU": "1"}
    ours = run_python(RUN.format(path=str(tmp_path / "m")), env=env)
    cls, impls, tokens = _facts(ours)
    assert cls == "atom.plugin.vllm.model_wrapper.ATOMForCausalLM" and impls == ["CPUAttentionBackendImpl"]
    assert "VLLM_TARGET_DEVICE=cpu: vLLM picks its CPU platform without asking plugins" in ours.stderr
    assert "atom platform" not in ours.stderr  # never asked
    stock = run_python(RUN.format(path=str(tmp_path / "m")), env={**env, "ATOM_DISABLE_VLLM_PLUGIN": "1"})
    assert _facts(stock)[2] == tokens
