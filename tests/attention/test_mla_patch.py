"""mla_patch against the installed vLLM: each record's guard matches the method it wraps, the
wrappers route atom's layers to atom's impl and pass every other layer straight through, and
each record can be switched off (ATOM_DISABLED_PATCHES) and reverted -- after which atom's MLA
backend is no longer selected (vLLM's own serves the layer).

(The toolkit contract -- arm, land on import, no double wrap, identical originals on revert --
runs for these records in tests/toolkit/test_contract.py; the routing in a real engine, with
vLLM's loader and forward, in test_mla_e2e.py.)"""

from __future__ import annotations

import pytest
import torch

from atom.patches import State, apply, is_applied, revert, status
from atom.patches.core import resolve
from atom.patches.signatures import shape
from atom.plugin import register as plugin_register
from atom.plugin.attention_mla import BACKEND_QUALNAME, MLA_IMPL_INJECTION, ATOMMLAImpl
from atom.plugin.vllm import mla_patch
from atom.plugin.vllm.patches import ATTENTION_PWAL_DEFAULT
from vllm.model_executor.layers.attention.attention import set_default_quant_scales
from vllm.model_executor.layers.attention.mla_attention import MLAAttention

ORIGINALS = {name: MLAAttention.__dict__[name] for name in
             ("forward_impl", "process_weights_after_loading", "get_kv_cache_spec")}


@pytest.fixture(autouse=True)
def clean(monkeypatch):
    monkeypatch.delenv("ATOM_DISABLED_PATCHES", raising=False)
    monkeypatch.delenv("ATOM_DISABLE_VLLM_PLUGIN_ATTENTION", raising=False)
    yield
    for rec in mla_patch.REQUIRED:
        apply(rec)  # leave the process as register_model would (applied)


def _selector():
    from atom.plugin.vllm import compat

    return compat.selector_config_cls()(head_size=576, dtype=torch.bfloat16, kv_cache_dtype="auto",
                                        block_size=16, use_mla=True)


def _layer(impl):
    """A real MLAAttention instance carrying ``impl`` (construction needs a TP group and a
    kv_b_proj; the wrappers only look at ``layer.impl``)."""
    layer = MLAAttention.__new__(MLAAttention)
    torch.nn.Module.__init__(layer)
    layer.impl = impl
    return layer


def _atom_impl():
    impl = ATOMMLAImpl.__new__(ATOMMLAImpl)  # attributes are not read on these paths
    return impl


def test_records_cover_the_four_methods_of_the_issue():
    targets = {rec.target.rpartition(":")[2] for rec in mla_patch.RECORDS}
    assert targets == {"MLAAttention.forward_impl", "MLAAttention.process_weights_after_loading",
                       "MLAAttention.get_kv_cache_spec", "Attention.process_weights_after_loading"}
    assert ATTENTION_PWAL_DEFAULT in mla_patch.RECORDS  # reused, not declared twice
    for rec in mla_patch.RECORDS:
        assert rec.vllm and rec.reason and rec.upstream and rec.removal and rec.signature


@pytest.mark.parametrize("rec", mla_patch.RECORDS, ids=lambda r: r.id)
def test_signature_guard_matches_installed_vllm(rec):
    revert(rec)
    original = resolve(rec.target)
    accepted = (rec.signature,) if isinstance(rec.signature, str) else rec.signature
    assert shape(original) in accepted
    assert apply(rec).state is State.APPLIED


def test_arm_all_applies_every_mla_record():
    from atom.plugin.vllm.patches import arm_all

    states = arm_all()
    for rec in mla_patch.RECORDS:
        assert states[rec.id].startswith("applied"), states


def test_atom_layer_routes_to_atom_impl(monkeypatch):
    calls = []
    monkeypatch.setattr(ATOMMLAImpl, "forward", lambda self, *a: calls.append(("forward", a)) or "out",
                        raising=False)
    monkeypatch.setattr(ATOMMLAImpl, "process_weights_after_loading",
                        lambda self, act_dtype: calls.append(("pwal", act_dtype)), raising=False)
    for rec in mla_patch.REQUIRED:
        apply(rec)
    layer = _layer(_atom_impl())
    layer.quant_config, layer.layer_name = None, "model.layers.0.self_attn.mla_attn"
    set_default_quant_scales(layer, register_buffer=True)  # as MLAAttention.__init__ does
    layer._k_scale.fill_(0.5)
    assert layer.forward_impl("q", "c", "pe", "cache", "md", output="o") == "out"
    assert calls[-1] == ("forward", (layer, "q", "c", "pe", "cache", "md", "o", None, None))
    with pytest.raises(NotImplementedError, match="q_dcp_replicated"):
        layer.forward_impl("q", "c", "pe", "cache", "md", output="o", q_dcp_replicated="x")
    layer.process_weights_after_loading(torch.float32)
    assert calls[-1] == ("pwal", torch.float32)
    assert not hasattr(layer, "W_UK_T")  # vLLM's own split did not run
    assert float(layer._k_scale) == 1.0  # vLLM's default quant scales did


def test_non_atom_layer_is_passed_straight_through():
    """What the wrappers do with any other impl: call vLLM's method with the same arguments and
    return its result unchanged."""
    from vllm.v1.attention.backends.mla.cpu_mla import CPUMLAImpl

    layer = _layer(CPUMLAImpl.__new__(CPUMLAImpl))
    seen = []

    def original(*args, **kwargs):
        seen.append((args, kwargs))
        return "stock"

    for wrapper in (mla_patch._forward_impl, mla_patch._process_weights_after_loading,
                    mla_patch._get_kv_cache_spec):
        assert wrapper(original, layer, (1, 2), {"output": 3}) == "stock"
        assert seen.pop() == ((1, 2), {"output": 3})
    assert not mla_patch.is_atom_layer(layer) and mla_patch.is_atom_layer(_layer(_atom_impl()))


def test_kv_cache_spec_is_vllms_latent_spec_checked_by_atom():
    from vllm.v1.kv_cache_interface import MLAAttentionSpec, SlidingWindowMLASpec

    impl = _atom_impl()
    impl.kv_lora_rank, impl.qk_rope_head_dim = 512, 64
    spec = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    assert mla_patch._get_kv_cache_spec(lambda *a: spec, _layer(impl), (None,), {}) is spec
    window = SlidingWindowMLASpec(block_size=16, num_kv_heads=1, head_size=576, dtype=torch.bfloat16,
                                  sliding_window=128)
    with pytest.raises(NotImplementedError, match="SlidingWindowMLASpec"):
        mla_patch._get_kv_cache_spec(lambda *a: window, _layer(impl), (None,), {})


@pytest.mark.parametrize("rec", mla_patch.REQUIRED, ids=lambda r: r.id)
def test_off_by_env_leaves_vllm_and_keeps_vllms_backend(rec, monkeypatch):
    revert(rec)
    monkeypatch.setenv("ATOM_DISABLED_PATCHES", rec.id)
    assert apply(rec).state is State.DISABLED
    name = rec.target.rpartition(".")[2]
    assert MLAAttention.__dict__[name] is ORIGINALS[name]
    choice, why = plugin_register.select_attention_backend(_selector())
    assert choice is None and why == f"patch {rec.id} is not applied (disabled: by ATOM_DISABLED_PATCHES)"


@pytest.mark.parametrize("rec", mla_patch.REQUIRED, ids=lambda r: r.id)
def test_reverted_restores_vllm_and_selection_reapplies(rec):
    apply(rec)
    assert is_applied(rec)
    assert revert(rec) is True
    name = rec.target.rpartition(".")[2]
    assert MLAAttention.__dict__[name] is ORIGINALS[name]
    assert not is_applied(rec)
    # choosing atom's MLA backend applies what it needs again (environment permitting)
    assert plugin_register.select_attention_backend(_selector()) == (BACKEND_QUALNAME, "atom MLA backend")
    assert is_applied(rec) and is_applied(MLA_IMPL_INJECTION)


def test_mla_decorator_injects_and_reverts():
    revert(MLA_IMPL_INJECTION)
    assert "forward" not in ATOMMLAImpl.__dict__ and "process_weights_after_loading" not in ATOMMLAImpl.__dict__
    apply(MLA_IMPL_INJECTION, enabled=True)
    assert status(MLA_IMPL_INJECTION).state is State.APPLIED
    assert {"forward", "process_weights_after_loading"} <= set(ATOMMLAImpl.__dict__)
    revert(MLA_IMPL_INJECTION)
    assert "forward" not in ATOMMLAImpl.__dict__
