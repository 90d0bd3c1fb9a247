"""The attention decorators: each record injects into an atom layer that imports no vLLM exactly
what its source defines; every injected member has the shape of the vLLM base member it stands
in for; the vLLM class vLLM is handed writes none of them itself; apply makes those classes
vLLM classes, revert leaves atom's layers as declared (the vLLM classes abstract again); and
the environment can switch them off (then atom's backend is not handed to vLLM)."""

from __future__ import annotations

import inspect

import pytest
import torch

from atom.models.attention import mha, mla
from atom.patches import REGISTRY, Injection, State, apply, is_applied, revert, status
from atom.patches.signatures import accepted, shape, unwrap_descriptor
from atom.plugin import catalog
from atom.plugin.vllm import attention, attention_mha, attention_mla
from atom.plugin.vllm.selection import attention_backend
from tests.attention.test_backend import _common_metadata, _compatible, _selector
from vllm.v1.attention.backend import AttentionBackend, AttentionImpl, AttentionMetadataBuilder, MLAAttentionImpl

catalog.load()
MHA = REGISTRY.select("vllm.attention.mha")
MLA = REGISTRY.select("vllm.attention.mla")
DECORATORS = tuple(r for r in MHA + MLA if isinstance(r, Injection))
#: record id -> (atom's layer it injects into, the vLLM class vLLM is handed, vLLM's base, source)
BASES = {
    "vllm.attention.mha_backend": (mha.PagedAttentionBackend, attention_mha.ATOMAttentionBackend,
                                   AttentionBackend, attention.VLLMBackendMethods),
    "vllm.attention.mha_builder": (mha.PagedAttentionMetadataBuilder, attention_mha.ATOMAttentionMetadataBuilder,
                                   AttentionMetadataBuilder, attention.VLLMBuilderMethods),
    "vllm.attention.mha_impl": (mha.PagedAttentionImpl, attention_mha.ATOMAttentionImpl, AttentionImpl,
                                attention.MHAImplMethods),
    "vllm.attention.mla_backend": (mla.MLABackend, attention_mla.ATOMMLABackend, AttentionBackend,
                                   attention.VLLMMLABackendMethods),
    "vllm.attention.mla_builder": (mla.MLAMetadataBuilder, attention_mla.ATOMMLAMetadataBuilder,
                                   AttentionMetadataBuilder, attention.VLLMBuilderMethods),
    "vllm.attention.mla_impl": (mla.MLAttentionImpl, attention_mla.ATOMMLAImpl, MLAAttentionImpl,
                                attention.MLAImplMethods),
}


def _source_members(source) -> set:
    """Every method a decorator source defines, its shared bases' included (the MLA backend's
    source extends the shared one)."""
    return {n for klass in source.__mro__[:-1] for n, v in vars(klass).items()
            if callable(unwrap_descriptor(v)) and not n.startswith("__")}


def select(cfg):
    return tuple(attention_backend(None, cfg)[:2])


def test_every_decorator_is_covered_and_targets_atoms_own_layer():
    assert {r.id for r in DECORATORS} == set(BASES)
    for record in DECORATORS:
        layer, vllm_cls, base, source = BASES[record.id]
        assert record.target == f"{layer.__module__}:{layer.__qualname__}"
        assert record.source == f"{source.__module__}:{source.__qualname__}"
        assert set(record.members) == _source_members(source), record.id  # exactly what the source defines
        # atom's layer is host-neutral: no vLLM class anywhere in its ancestry
        assert not any(k.__module__.startswith("vllm") for k in layer.__mro__), record.id
        # the vLLM class is atom's layer plus vLLM's base, and writes no injected member itself
        assert issubclass(vllm_cls, layer) and issubclass(vllm_cls, base)
        assert not set(record.members) & set(vars(vllm_cls)), record.id
    # MLA: the shared members plus is_mla and its page-size preference (FlashMLA's 64); its
    # overrides stay inside the shared member list
    backend_members = REGISTRY.get("vllm.attention.mha_backend").members
    assert REGISTRY.get("vllm.attention.mla_backend").members == backend_members + ("is_mla", "get_preferred_block_size")
    assert set(vars(attention.VLLMMLABackendMethods)) & _source_members(attention.VLLMMLABackendMethods) \
        == {"is_mla", "get_preferred_block_size", "supports_head_size", "supported_kv_cache_layouts"}


@pytest.mark.parametrize("record", DECORATORS, ids=lambda r: r.id)
def test_every_injected_member_fits_the_vllm_base(record):
    layer, vllm_cls, base, source = BASES[record.id]
    checked = []
    for name in record.members:
        ours = inspect.getattr_static(vllm_cls, name)
        assert ours is inspect.getattr_static(source, name)  # the injected object itself, seen by vLLM
        assert name in vars(layer), name  # installed on atom's layer
        theirs = inspect.getattr_static(base, name, None)
        if theirs is None:
            continue  # not on this release's base (get_kv_cache_shape from 0.29, do_kv_cache_update, MLA forward)
        if isinstance(theirs, staticmethod):
            # we inject a classmethod: vLLM calls both on the class, compare it bound (no ``cls``)
            ours, theirs = getattr(vllm_cls, name), theirs.__func__
        assert _compatible(ours, theirs) == [], (name, _compatible(ours, theirs))
        checked.append(name)
    assert checked
    for member, expected in record.signatures:  # the guards describe the installed vLLM
        assert shape(inspect.getattr_static(base, member)) in accepted(expected)


def test_do_kv_cache_update_fits_the_layer_call():
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

    assert _compatible(attention_mha.ATOMAttentionImpl.do_kv_cache_update,
                       CPUAttentionBackendImpl.do_kv_cache_update) == []


def test_revert_restores_the_classes_and_apply_makes_them_vllm_classes(tiny_model):
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    backend = attention_mha.ATOMAttentionBackend
    builder_cls = attention_mha.ATOMAttentionMetadataBuilder
    impl_cls = attention_mha.ATOMAttentionImpl
    records = [r for r in MHA if isinstance(r, Injection)]
    # (creating a config loads vLLM's plugins, whose register_model re-applies the records)
    config = EngineArgs(model=str(tiny_model("qwen3", "float32")), max_model_len=128,
                        dtype="float32").create_engine_config()
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float32)
    for record in records:
        assert is_applied(record)
    assert backend.get_name() == "CUSTOM" and backend.get_builder_cls() is builder_cls
    try:
        for record in records:
            assert revert(record) is True
        # As declared: no vLLM member on atom's layers, the vLLM builder and impl abstract again.
        for record in records:
            assert not set(record.members) & set(vars(BASES[record.id][0])), record.id
        assert backend.get_name is AttentionBackend.get_name  # vLLM's abstract one
        assert "build" in builder_cls.__abstractmethods__ and "forward" in impl_cls.__abstractmethods__
        with pytest.raises(TypeError, match="abstract"):
            builder_cls(spec, ["l"], config, torch.device("cpu"))
        with pytest.raises(TypeError, match="abstract"):
            impl_cls(4, 32, 0.1, 2)
        # atom's own layers still work on their own
        assert mha.PagedAttentionImpl(4, 32, 0.1, 2).num_kv_heads == 2
    finally:
        for record in records:
            assert apply(record, enabled=True).state is State.APPLIED
    assert not builder_cls.__abstractmethods__ and not impl_cls.__abstractmethods__
    assert backend.get_name() == "CUSTOM"
    builder = builder_cls(spec, ["l"], config, torch.device("cpu"))
    # build_for_cudagraph_capture on vLLM's own CommonAttentionMetadata
    md = builder.build_for_cudagraph_capture(_common_metadata("cpu"))
    assert md.max_seq_len == config.model_config.max_model_len and md.num_reqs == 3
    drafted = builder.build_for_drafting(_common_metadata("cpu"), draft_index=0)
    assert drafted.max_seq_len == 16


def test_disabled_decorators_keep_atoms_backend_from_vllm(monkeypatch):
    monkeypatch.delenv("ATOM_DISABLE_VLLM_PLUGIN_ATTENTION", raising=False)
    monkeypatch.setenv("ATOM_DISABLED_PATCHES", "vllm.attention.mha_builder")
    try:
        choice, why = select(_selector())
        assert choice is None
        assert why == "decorator vllm.attention.mha_builder is disabled: by ATOM_DISABLED_PATCHES"
        assert status(REGISTRY.get("vllm.attention.mha_builder")).state is State.DISABLED
    finally:
        monkeypatch.delenv("ATOM_DISABLED_PATCHES")
        for record in MHA:
            apply(record, enabled=True)
    assert select(_selector())[0] == attention_mha.BACKEND_QUALNAME


def test_registered_armed_and_listed():
    from atom.plugin.vllm.records import arm_all

    armed = arm_all()
    assert {r.id for r in MHA + MLA} <= set(armed)  # armed by register_model in every vLLM process
    assert {"vllm.attention.mha_backend", "vllm.attention.mha_builder", "vllm.attention.mha_impl"} == \
        {r.id for r in MHA}


def test_mla_revert_restores_the_classes_and_apply_makes_them_vllm_classes(tiny_model):
    """The MLA backend and builder get vLLM's members from the shared decorators: reverted, the
    classes hold only atom's declarations (the builder abstract again); applied, vLLM's own
    CommonAttentionMetadata goes through the injected build / build_for_cudagraph_capture /
    build_for_drafting into atom's MLA metadata."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    backend = attention_mla.ATOMMLABackend
    builder_cls = attention_mla.ATOMMLAMetadataBuilder
    records = [r for r in MLA if isinstance(r, Injection)]
    config = EngineArgs(model=str(tiny_model("deepseek_v3", "float32")), max_model_len=128,
                        dtype="float32").create_engine_config()
    spec = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=torch.float32)
    for record in records:
        apply(record, enabled=True)
        assert is_applied(record)
    assert backend.is_mla() and backend.get_name() == "ATOM_MLA" and backend.get_builder_cls() is builder_cls
    assert backend.get_impl_cls() is attention_mla.ATOMMLAImpl
    assert backend.supported_kv_cache_layouts() is None and backend.supports_head_size(576)
    try:
        for record in records:
            assert revert(record) is True
        for record in records:
            assert not set(record.members) & set(vars(BASES[record.id][0])), record.id
        assert backend.get_name is AttentionBackend.get_name and not backend.is_mla()  # vLLM's base
        assert "build" in builder_cls.__abstractmethods__
        assert "forward_mqa" in attention_mla.ATOMMLAImpl.__abstractmethods__
        with pytest.raises(TypeError, match="abstract"):
            builder_cls(spec, ["l"], config, torch.device("cpu"))
        assert "kv_cache_shape" in vars(mla.MLABackend)  # atom's own declarations stay
    finally:
        for record in records:
            assert apply(record, enabled=True).state is State.APPLIED
    assert not builder_cls.__abstractmethods__ and backend.is_mla()
    assert not attention_mla.ATOMMLAImpl.__abstractmethods__
    builder = builder_cls(spec, ["l"], config, torch.device("cpu"))
    decode = _common_metadata("cpu")
    decode.max_query_len = 1  # a decode-only batch (what full-graph capture builds)
    qsl = torch.arange(decode.num_reqs + 1, dtype=torch.int32)
    decode.query_start_loc, decode.query_start_loc_cpu = qsl, qsl
    decode.num_actual_tokens = decode.num_reqs
    md = builder.build_for_cudagraph_capture(decode)
    assert isinstance(md, mla.MLAMetadata)
    assert md.max_seq_len == config.model_config.max_model_len and md.num_decodes == decode.num_reqs
    mixed = _common_metadata("cpu")
    with pytest.raises(ValueError, match="single-token decode"):
        builder.build_for_cudagraph_capture(mixed)
    drafted = builder.build_for_drafting(mixed, draft_index=0)
    assert drafted.max_seq_len == mixed.max_seq_len and drafted.num_reqs == mixed.num_reqs
    built = builder.build(0, mixed)
    assert (built.num_decodes + built.num_extends + built.num_prefills) == mixed.num_reqs


def test_disabled_mla_decorator_keeps_atoms_mla_backend_from_vllm(monkeypatch):
    from tests.attention.test_mla_backend import _selector as mla_selector

    monkeypatch.delenv("ATOM_DISABLE_VLLM_PLUGIN_ATTENTION", raising=False)
    monkeypatch.setenv("ATOM_DISABLED_PATCHES", "vllm.attention.mla_backend")
    try:
        choice, why = select(mla_selector())
        assert choice is None
        assert why == "decorator vllm.attention.mla_backend is disabled: by ATOM_DISABLED_PATCHES"
    finally:
        monkeypatch.delenv("ATOM_DISABLED_PATCHES")
        for record in MLA:
            apply(record, enabled=True)
    assert select(mla_selector())[0] == attention_mla.BACKEND_QUALNAME
