"""Every runner vLLM offers for an architecture atom overrides keeps working with atom installed
(issue #19): pooling (embed, classify, score), ``--convert``, and architecture names atom's
wrapper does not know (``Qwen3Model``, ``Qwen3ForSequenceClassification``, which vLLM maps onto
``Qwen3ForCausalLM``). atom's models serve text generation only, so for these atom steps aside
(``atom.plugin.vllm.overrides``): vLLM's own model class serves them, with one log line, and the
results equal stock vLLM's (atom off) in fp32. Generation is still atom's."""

from __future__ import annotations

import json

import pytest

from tests.conftest import run_python

MODEL_WRAPPER = "atom.plugin.vllm.model_wrapper"


@pytest.fixture(scope="module")
def sides(tmp_path_factory):
    models = tmp_path_factory.mktemp("runner-models")
    out = {}
    for side, env in (("stock", {"ATOM_DISABLE_VLLM_PLUGIN": "1"}), ("atom", {})):
        path = tmp_path_factory.mktemp(side) / "out.json"
        proc = run_python(f"""
            import sys
            from tests.plugin._runner_child import main
            sys.exit(main([{str(models)!r}, {str(path)!r}]))
        """, env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0", **env}, timeout=1200)
        assert proc.returncode == 0, proc.stderr[-4000:]
        out[side] = (json.loads(path.read_text()), proc.stderr)
    return out


POOLING = ["embed_qwen3", "embed_llama", "embed_convert", "embed_qwen3_model_arch", "classify", "score"]


@pytest.mark.parametrize("case", POOLING)
def test_pooling_runners_give_stock_results(sides, case):
    ours, theirs = sides["atom"][0][case], sides["stock"][0][case]
    assert ours["classes"] == theirs["classes"]  # vLLM's own (pooling-adapted) model class
    assert not any(MODEL_WRAPPER in c for c in ours["classes"])
    assert len(ours["values"]) == len(theirs["values"]) > 0
    for a, b in zip(ours["values"], theirs["values"]):
        assert len(a) == len(b) > 0
        assert max(abs(x - y) for x, y in zip(a, b)) < 1e-5, (case, a[:4], b[:4])


def test_atom_says_it_steps_aside_once_per_model(sides):
    log = sides["atom"][1]
    for arch, why in (("Qwen3ForCausalLM", "runner pooling"), ("LlamaForCausalLM", "runner pooling"),
                      ("Qwen3Model", "atom has no model for architecture 'Qwen3Model'"),
                      ("Qwen3ForSequenceClassification", "atom has no model for architecture")):
        lines = [ln for ln in log.splitlines() if f"atom steps aside for {arch} ({why}" in ln]
        assert len(lines) == 1, (arch, [ln for ln in log.splitlines() if "steps aside" in ln])
    assert "steps aside" not in sides["stock"][1]


def test_generation_is_still_atoms(sides):
    ours, theirs = sides["atom"][0]["generate"], sides["stock"][0]["generate"]
    assert ours["classes"][0] == f"{MODEL_WRAPPER}.ATOMForCausalLM"
    assert ours["impls"] == ["ATOMAttentionImpl"]
    assert ours["values"] == theirs["values"]  # greedy, fp32


def test_block_fp8_on_nvidia_steps_aside_unless_enabled(monkeypatch):
    """The decision itself (the engine-level check is the GPU test in tests/models/test_fp8.py):
    a 128x128 block-fp8 checkpoint on an NVIDIA GPU goes to vLLM's own model unless
    ATOM_ENABLE_FP8_BLOCK_ON_NVIDIA=1 when it is a dense architecture's (one reason) or a MoE one whose
    table entry records why (Qwen3-MoE: no measured gain); DeepSeek-V3's, per-tensor fp8, bf16 and other
    devices stay atom's."""
    from types import SimpleNamespace

    from atom.plugin.vllm import overrides

    def config(quant):
        return SimpleNamespace(runner_type="generate", convert_type=None,
                               hf_config=SimpleNamespace(quantization_config=quant))

    block = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    per_tensor = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    monkeypatch.setattr(overrides, "on_nvidia", lambda: True)
    monkeypatch.delenv("ATOM_ENABLE_FP8_BLOCK_ON_NVIDIA", raising=False)
    refused = overrides.serves(["Qwen3ForCausalLM"], config(block))
    assert not refused.value and refused.reason.startswith(overrides.FP8_DENSE_ON_NVIDIA)
    assert "ATOM_ENABLE_FP8_BLOCK_ON_NVIDIA=1" in refused.reason
    assert not overrides.serves(["LlamaForCausalLM"], config(block)).value
    refused = overrides.serves(["Qwen3MoeForCausalLM"], config(block))  # its table entry says why
    assert not refused.value and refused.reason.startswith(overrides.FP8_MOE_ON_NVIDIA)
    assert "measured no gain" in refused.reason and "ATOM_ENABLE_FP8_BLOCK_ON_NVIDIA=1" in refused.reason
    for moe in ("DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM"):  # the other fp8 MoE loaders stay atom's
        assert overrides.serves([moe], config(block)).value, moe
    for arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "DeepseekV3ForCausalLM"):
        assert overrides.serves([arch], config(per_tensor)).value, arch
    assert overrides.serves(["Qwen3MoeForCausalLM"], config(None)).value
    monkeypatch.setenv("ATOM_ENABLE_FP8_BLOCK_ON_NVIDIA", "1")
    assert overrides.serves(["DeepseekV3ForCausalLM"], config(block)).value
    assert overrides.serves(["Qwen3MoeForCausalLM"], config(block)).value
    monkeypatch.delenv("ATOM_ENABLE_FP8_BLOCK_ON_NVIDIA")
    monkeypatch.setattr(overrides, "on_nvidia", lambda: False)
    assert overrides.serves(["Qwen3ForCausalLM"], config(block)).value
    assert overrides.serves(["Qwen3MoeForCausalLM"], config(block)).value


def test_unloadable_quantization_steps_aside():
    """A checkpoint in a format atom's model does not load (MXFP4 GPT-OSS, AWQ, compressed-tensors)
    goes to vLLM's own model instead of failing at build; vLLM's --quantization name counts first,
    else the HF config's quant_method; formats the table lists stay atom's."""
    from types import SimpleNamespace

    from atom.plugin.vllm import overrides

    def config(quant, quantization=None):
        return SimpleNamespace(runner_type="generate", convert_type=None, quantization=quantization,
                               hf_config=SimpleNamespace(quantization_config=quant))

    mxfp4 = overrides.serves(["GptOssForCausalLM"], config({"quant_method": "mxfp4"}))
    assert not mxfp4.value and "'mxfp4'" in mxfp4.reason and "loads unquantized checkpoints only" in mxfp4.reason
    awq = overrides.serves(["Qwen3ForCausalLM"], config({"quant_method": "awq"}, "awq_marlin"))
    assert not awq.value and "'awq_marlin'" in awq.reason and "unquantized or fp8" in awq.reason
    assert not overrides.serves(["DeepseekV3ForCausalLM"], config({"quant_method": "compressed-tensors"})).value
    assert overrides.serves(["Qwen3ForCausalLM"], config({"quant_method": "fp8"})).value
    assert overrides.serves(["Qwen3ForCausalLM"], config(None, "fp8")).value  # online fp8 of a bf16 checkpoint
    assert overrides.serves(["GptOssForCausalLM"], config(None)).value
    assert overrides.quant_method(config(None)) is None


def test_architecture_measured_slower_on_nvidia_steps_aside_unless_enabled(monkeypatch):
    """An architecture whose table entry records a measured loss on NVIDIA GPUs (``nvidia_aside``)
    goes to vLLM's own model there unless ATOM_ENABLE_ON_NVIDIA names it (or is *); other
    architectures and other devices stay atom's. The dense Qwen3 has one (measured 0.80x of stock in
    online serving on an H200, bench/NOTES.md 56); GPT-OSS's measured loss did not hold up under more
    launches (docs/performance.md), so it is atom's by default."""
    import dataclasses
    from types import SimpleNamespace

    from atom.plugin.models import BY_ARCH, MODEL_TABLE
    from atom.plugin.vllm import overrides

    cfg = SimpleNamespace(runner_type="generate", convert_type=None, hf_config=SimpleNamespace())
    monkeypatch.setattr(overrides, "on_nvidia", lambda: True)
    monkeypatch.delenv("ATOM_ENABLE_ON_NVIDIA", raising=False)

    def switch(arch: str, other: str) -> None:
        """ATOM_ENABLE_ON_NVIDIA naming ``arch`` (alone, in a list, or *) serves it; naming only ``other`` does not."""
        for value in (arch, f"{other},{arch}", "*"):
            monkeypatch.setenv("ATOM_ENABLE_ON_NVIDIA", value)
            assert overrides.serves([arch], cfg).value, value
        monkeypatch.setenv("ATOM_ENABLE_ON_NVIDIA", other)
        assert not overrides.serves([arch], cfg).value
        monkeypatch.delenv("ATOM_ENABLE_ON_NVIDIA")

    assert [e.arch for e in MODEL_TABLE if e.nvidia_aside] == ["Qwen3ForCausalLM"]
    qwen3 = overrides.serves(["Qwen3ForCausalLM"], cfg)
    assert not qwen3.value and "ATOM_ENABLE_ON_NVIDIA=Qwen3ForCausalLM serves it" in qwen3.reason
    assert "0.80x" in qwen3.reason
    switch("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
    assert overrides.serves(["GptOssForCausalLM"], cfg).value
    monkeypatch.setitem(BY_ARCH, "GptOssForCausalLM",
                        dataclasses.replace(BY_ARCH["GptOssForCausalLM"], nvidia_aside="measured 0.5x of vLLM's"))
    aside = overrides.serves(["GptOssForCausalLM"], cfg)
    assert not aside.value and "ATOM_ENABLE_ON_NVIDIA=GptOssForCausalLM" in aside.reason
    assert "measured 0.5x of vLLM's" in aside.reason
    for arch in ("Qwen3MoeForCausalLM", "LlamaForCausalLM", "MixtralForCausalLM", "DeepseekV3ForCausalLM"):
        assert overrides.serves([arch], cfg).value, arch
    switch("GptOssForCausalLM", "LlamaForCausalLM")
    monkeypatch.setattr(overrides, "on_nvidia", lambda: False)
    assert overrides.serves(["GptOssForCausalLM"], cfg).value
    assert overrides.serves(["Qwen3ForCausalLM"], cfg).value


def test_parallel_layouts_atom_does_not_run_build_vllms_model(tiny_model):
    """vLLM resolves the model class before it knows the parallel layout, so atom decides when the
    class is constructed (``overrides.builds``, asked by ``ATOMModelBase.__new__``): on real vLLM
    configs of a tiny Qwen3-MoE, pipeline parallelism and expert parallelism across data-parallel
    ranks go to vLLM's own class (the one saved in the registry); one rank, TP + EP and DP without
    EP stay atom's. vLLM's config check for PP asks the registry, which answers for vLLM's own
    class there. (A real PP=2 engine: tests/models/test_qwen3.py; vLLM's CPU build runs no EP
    across DP ranks, stock included.)"""
    checkpoint = tiny_model("qwen3_moe", "float32")
    proc = run_python(f"""
        import json
        from vllm.engine.arg_utils import EngineArgs
        from atom.plugin.vllm import overrides

        out = {{}}
        for name, kw in {{"one": {{}}, "dp2_ep": {{"data_parallel_size": 2, "enable_expert_parallel": True}},
                          "tp2_ep": {{"tensor_parallel_size": 2, "enable_expert_parallel": True}},
                          "dp2": {{"data_parallel_size": 2}}, "pp2": {{"pipeline_parallel_size": 2}}}}.items():
            config = EngineArgs(model={str(checkpoint)!r}, max_model_len=256, **kw).create_engine_config()
            out[name] = list(overrides.builds(config)[:2])
        model_config = config.model_config  # pp2's: vLLM's config check passed
        registry = model_config.registry
        out["inspected"] = registry.inspect_model_cls(["Qwen3MoeForCausalLM"], model_config)[0].supports_pp
        out["pp_supported"] = registry.is_pp_supported_model(["Qwen3MoeForCausalLM"], model_config)
        stock = overrides.stock_class("Qwen3MoeForCausalLM")
        out["stock"] = stock.__module__ + ":" + stock.__qualname__
        print("RESULT", json.dumps(out))
    """, env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.split("RESULT ", 1)[1])
    assert out["one"][0] and out["tp2_ep"][0] and out["dp2"][0]
    assert out["dp2_ep"] == [False, "expert parallelism with data_parallel_size=2, prefill_context_parallel_size=1: "
                                    "atom's experts all-reduce over the tensor-parallel group, which holds every "
                                    "expert-parallel rank only when both are 1"]
    assert out["pp2"] == [False, "pipeline_parallel_size=2: atom's models do not run pipeline parallelism"]
    assert out["inspected"] is False  # atom's class, as vLLM resolves it
    assert out["pp_supported"] is True  # vLLM's own class, which builds under PP
    assert out["stock"] == "vllm.model_executor.models.qwen3_moe:Qwen3MoeForCausalLM"
