"""The FusedMoE plugin-mode injection (atom/plugin/vllm/moe.py): what it injects stands in for vLLM's
``RoutedExperts.quant_method`` with vLLM's ``QuantizeMethodBase`` signatures, vLLM's own
post-load loop drives it, vLLM's MoE-specific checks skip it, and apply/revert restore the
class. (The generic contract runs in tests/toolkit/test_contract.py; the call on vLLM's path in
a real engine is recorded in tests/models/test_fp8.py.)"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.conftest import record_applied, records_as_found


def _fp8_layer():
    from atom.models._moe import FusedMoE
    from atom.models._quant import Fp8Spec
    from atom.models.interfaces import ModelParallel
    from atom.testing.tiny_models import quantize_fp8

    torch.manual_seed(0)
    layer = FusedMoE(2, 1, 32, 32, ModelParallel(), renormalize=True, dtype=torch.float32,
                     quant=Fp8Spec(block=(16, 16)))
    for e in range(2):
        for which, shape in enumerate(((32, 32), (32, 32), (32, 32))):
            w, s = quantize_fp8(torch.randn(shape), [16, 16])
            param = "w2" if which == 2 else "w13"
            layer.load_weight(param, w, (e, which))
            layer.load_weight(f"{param}_weight_scale_inv", s, (e, which))
    return layer


def _record(record_id):
    from atom.patches import REGISTRY
    from atom.plugin import catalog

    catalog.load()
    return REGISTRY.get(record_id)


@pytest.fixture
def applied():
    with record_applied("vllm.moe.atom_fused_moe_post_load") as record:
        yield record


def test_record_lists_exactly_the_injected_members(applied):
    from atom.models._moe import FusedMoE
    from atom.plugin.vllm.moe import PluginModePostLoad

    assert applied.members == ("quant_method",)
    assert applied.target == "atom.models._moe:FusedMoE"
    assert FusedMoE.__dict__["quant_method"] is PluginModePostLoad.__dict__["quant_method"]
    own = {k for k in vars(PluginModePostLoad) if not k.startswith("__")}
    assert own == set(applied.members)


def test_injected_method_has_vllm_quantize_method_signatures(applied):
    from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

    from atom.patches.signatures import shape

    method = _fp8_layer().quant_method
    assert isinstance(method, QuantizeMethodBase)
    # Not a vLLM MoE method: vLLM code that looks for its MoE kernels (EPLB, modular kernels,
    # LoRA) skips atom's layer.
    assert not isinstance(method, FusedMoEMethodBase)
    for name in ("process_weights_after_loading", "create_weights", "apply"):
        assert shape(getattr(type(method), name)) == shape(getattr(QuantizeMethodBase, name)), name


def test_vllm_loader_post_processing_runs_atom_repack(applied):
    """vLLM's own ``process_weights_after_loading(model, model_config, device)`` loop finds the
    injected quant_method and dequantises the fp8 experts (CPU path); the model-level hook after
    it is then a no-op."""
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    model = torch.nn.Module()
    model.experts = _fp8_layer()
    assert model.experts.w13.dtype == torch.float8_e4m3fn
    process_weights_after_loading(model, SimpleNamespace(dtype=torch.float32, quantization=None,
                                                         word_embeddings_untied_by_checkpoint=False),
                                  torch.device("cpu"))
    assert model.experts.w13.dtype == torch.float32 and model.experts.w2.dtype == torch.float32
    w13 = model.experts.w13
    model.experts.process_weights_after_loading()
    assert model.experts.w13 is w13


def test_revert_restores_the_class():
    from atom.models._moe import FusedMoE
    from atom.patches import apply, is_applied, revert
    FUSED_MOE_PLUGIN_MODE = _record("vllm.moe.atom_fused_moe_post_load")

    with records_as_found(FUSED_MOE_PLUGIN_MODE.id):
        revert(FUSED_MOE_PLUGIN_MODE)
        before = dict(FusedMoE.__dict__)
        assert "quant_method" not in before
        apply(FUSED_MOE_PLUGIN_MODE)
        assert is_applied(FUSED_MOE_PLUGIN_MODE) and "quant_method" in FusedMoE.__dict__
        assert revert(FUSED_MOE_PLUGIN_MODE)
        assert dict(FusedMoE.__dict__) == before
        assert not hasattr(_fp8_layer(), "quant_method")


def test_register_model_arms_them(monkeypatch):
    from atom.plugin.vllm import records

    monkeypatch.delenv("ATOM_DISABLE_VLLM_PLUGIN", raising=False)
    states = records.arm_all()
    for record_id in ("vllm.moe.atom_fused_moe_post_load", "vllm.linear.atom_fp8_linear_post_load"):
        assert states[record_id].startswith(("applied", "armed")), states


def test_vllm_loader_post_processing_runs_fp8_linear_repack():
    """The linear record: vLLM's per-layer loop repacks an fp8 column-parallel layer for the block
    GEMM (the only post-load call vLLM 0.26 makes; the weight stays fp8 and the layer computes
    the dequantised product), and revert removes the member again."""
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    from atom.models._linear import ColumnParallelLinear, Fp8Linear
    from atom.models._quant import Fp8Spec
    from atom.models.interfaces import ModelParallel
    from atom.patches import apply, revert
    LINEAR_PLUGIN_MODE = _record("vllm.linear.atom_fp8_linear_post_load")
    from atom.testing.tiny_models import quantize_fp8

    with records_as_found(LINEAR_PLUGIN_MODE.id):
        apply(LINEAR_PLUGIN_MODE)
        try:
            layer = ColumnParallelLinear.merged(32, [32, 32], ModelParallel(), dtype=torch.float32,
                                                quant=Fp8Spec(block=(16, 16)))
            exact = []
            for shard in (0, 1):
                w, s = quantize_fp8(torch.randn(32, 32), [16, 16])
                layer.load_weight("weight", w, shard)
                layer.load_weight("weight_scale_inv", s, shard)
                exact.append(w.float() * s.repeat_interleave(16, 0).repeat_interleave(16, 1))
            model = torch.nn.Module()
            model.proj = layer
            process_weights_after_loading(model, SimpleNamespace(dtype=torch.float32, quantization=None,
                                                                 word_embeddings_untied_by_checkpoint=False),
                                          torch.device("cpu"))
            assert layer.weight.dtype == torch.float8_e4m3fn and layer.fp8_block == (16, 16)
            x = torch.randn(3, 32)
            torch.testing.assert_close(layer(x), x @ torch.cat(exact).t(), atol=1e-4, rtol=1e-4)
        finally:
            revert(LINEAR_PLUGIN_MODE)
        assert "quant_method" not in Fp8Linear.__dict__
