"""An in-process vLLM engine (the shared ``vllm_engine`` fixture) runs a tiny model on atom's
platform with the override table applied."""

from atom.plugin.models import BY_ARCH


def test_engine_on_atom_platform_with_override(vllm_engine, tiny_model):
    from vllm import SamplingParams
    from vllm.platforms import current_platform

    from atom.plugin.vllm.platform import ATOMPlatform

    llm = vllm_engine(tiny_model("qwen3", "float32"), dtype="float32")
    assert isinstance(current_platform, ATOMPlatform)
    entry = BY_ARCH["Qwen3ForCausalLM"]
    built = llm.apply_model(lambda m: (f"{type(m).__module__}:{type(m).__qualname__}",
                                       f"{type(m.model).__module__}:{type(m.model).__qualname__}"))
    assert built == [(entry.wrapper_ref, entry.model)]
    out = llm.generate(["hello world", "x = 1"], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert [len(o.outputs[0].token_ids) for o in out] == [8, 8]
