"""An in-process vLLM engine (the shared ``vllm_engine`` fixture) runs a tiny model on atom's
platform with the override table applied, and gives stock vLLM's greedy tokens in fp32."""

import json

from atom.plugin.models import BY_ARCH
from tests.conftest import run_python

PROMPTS = ["hello world", "x = 1", "the quick brown fox jumps over the lazy dog and keeps on running until"]

STOCK = """
    import json, os
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams
    llm = LLM(model={model!r}, dtype="float32", max_model_len=256, max_num_seqs=8, enforce_eager=True,
              seed=0, gpu_memory_utilization=0.3)
    out = llm.generate({prompts!r}, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    print("TOKENS", json.dumps([list(o.outputs[0].token_ids) for o in out]))
"""


def test_engine_on_atom_platform_with_override_gives_stock_tokens(vllm_engine, tiny_model):
    from vllm import SamplingParams
    from vllm.platforms import current_platform

    from atom.plugin.vllm.platform import ATOMPlatform

    model = tiny_model("qwen3", "float32")
    llm = vllm_engine(model, dtype="float32")
    assert isinstance(current_platform, ATOMPlatform)
    entry = BY_ARCH["Qwen3ForCausalLM"]
    built = llm.apply_model(lambda m: (f"{type(m).__module__}:{type(m).__qualname__}",
                                       f"{type(m.model).__module__}:{type(m.model).__qualname__}"))
    assert built == [(entry.wrapper_ref, entry.model)]
    out = llm.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    ours = [list(o.outputs[0].token_ids) for o in out]
    proc = run_python(STOCK.format(model=str(model), prompts=PROMPTS), env={"ATOM_DISABLE_VLLM_PLUGIN": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    stock = json.loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith("TOKENS"))[7:])
    assert ours == stock and all(len(t) == 12 for t in ours)
