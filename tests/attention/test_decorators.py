"""The attention decorators: each record lists exactly what it injects, every injected member has
the shape of the vLLM base member it stands in for, apply makes atom's classes a vLLM backend,
revert restores the classes as declared, and the environment can switch them off (then atom's
backend is not handed to vLLM)."""

from __future__ import annotations

import inspect

import pytest
import torch

from atom.patches import State, apply, is_applied, revert, status
from atom.patches.signatures import shape, unwrap_descriptor
from atom.plugin import attention, attention_mha
from atom.plugin import register as plugin_register
from atom.plugin.vllm import patches
from tests.attention.test_backend import _common_metadata, _compatible, _selector
from vllm.v1.attention.backend import AttentionBackend, AttentionImpl, AttentionMetadataBuilder

MHA = patches.ATTENTION_DECORATORS["mha"]
BASES = {
    "vllm.attention.mha_backend": (attention_mha.ATOMAttentionBackend, AttentionBackend, attention.VLLMBackendMethods),
    "vllm.attention.mha_builder": (attention_mha.ATOMAttentionMetadataBuilder, AttentionMetadataBuilder,
                                   attention.VLLMBuilderMethods),
    "vllm.attention.mha_impl": (attention_mha.ATOMAttentionImpl, AttentionImpl, attention_mha.VLLMMHAImplMethods),
}


def test_member_lists_are_the_decorators_sources():
    assert patches.BACKEND_MEMBERS == attention.BACKEND_MEMBERS
    assert patches.BUILDER_MEMBERS == attention.BUILDER_MEMBERS
    for record in MHA:
        cls, _, source = BASES[record.id]
        assert record.target == f"{cls.__module__}:{cls.__qualname__}"
        declared = {n for n, v in vars(source).items() if callable(unwrap_descriptor(v)) and not n.startswith("__")}
        assert set(record.members) == declared, record.id  # exactly what the source defines


@pytest.mark.parametrize("record", MHA, ids=lambda r: r.id)
def test_every_injected_member_fits_the_vllm_base(record):
    cls, base, _ = BASES[record.id]
    checked = []
    for name in record.members:
        theirs = inspect.getattr_static(base, name, None)
        if theirs is None:
            continue  # not on this release's base (get_kv_cache_shape from 0.29, do_kv_cache_update)
        ours = inspect.getattr_static(cls, name)
        assert ours is inspect.getattr_static(BASES[record.id][2], name)  # the injected object itself
        if isinstance(theirs, staticmethod):
            # we inject a classmethod: vLLM calls both on the class, compare it bound (no ``cls``)
            ours, theirs = getattr(cls, name), theirs.__func__
        assert _compatible(ours, theirs) == [], (name, _compatible(ours, theirs))
        checked.append(name)
    assert checked
    for member, expected in record.signatures:  # the guards describe the installed vLLM
        assert shape(inspect.getattr_static(base, member)) == expected


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
    # (creating a config loads vLLM's plugins, whose register_model re-applies the records)
    config = EngineArgs(model=str(tiny_model("qwen3", "float32")), max_model_len=128,
                        dtype="float32").create_engine_config()
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float32)
    for record in MHA:
        assert is_applied(record)
    assert backend.get_name() == "CUSTOM" and backend.get_builder_cls() is builder_cls
    try:
        for record in MHA:
            assert revert(record) is True
        # As declared: no vLLM member of atom's own, the builder and impl abstract again.
        for record in MHA:
            cls = BASES[record.id][0]
            assert not set(record.members) & set(vars(cls)), record.id
        assert backend.get_name is AttentionBackend.get_name  # vLLM's abstract one
        assert "build" in builder_cls.__abstractmethods__ and "forward" in impl_cls.__abstractmethods__
        with pytest.raises(TypeError, match="abstract"):
            builder_cls(spec, ["l"], config, torch.device("cpu"))
        with pytest.raises(TypeError, match="abstract"):
            impl_cls(4, 32, 0.1, 2)
    finally:
        for record in MHA:
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
        choice, why = plugin_register.select_attention_backend(_selector())
        assert choice is None
        assert why == "attention decorator vllm.attention.mha_builder is disabled: by ATOM_DISABLED_PATCHES"
        assert status(patches.MHA_BUILDER).state is State.DISABLED
    finally:
        monkeypatch.delenv("ATOM_DISABLED_PATCHES")
        for record in MHA:
            apply(record, enabled=True)
    assert plugin_register.select_attention_backend(_selector())[0] == attention_mha.BACKEND_QUALNAME


def test_registered_and_listed():
    from atom.patches import REGISTRY

    ids = {r.id for r in REGISTRY}
    assert {r.id for r in MHA} <= ids
    assert set(MHA) <= set(patches.VLLM_RECORDS)  # armed by register_model in every vLLM process
