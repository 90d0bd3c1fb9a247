"""atom's MHA backend against the real vLLM it runs on: the methods vLLM calls have the shapes
vLLM calls them with, the selector accepts and refuses what it should, and the builder turns a
real ``CommonAttentionMetadata`` into atom's metadata without reading device values."""

from __future__ import annotations

import inspect

import pytest
import torch

from atom.models.attention.mha import PagedAttentionMetadata
from atom.patches.signatures import unwrap_descriptor
from atom.plugin.vllm.attention_mha import (
    BACKEND_QUALNAME,
    ATOMAttentionBackend,
    ATOMAttentionImpl,
    ATOMAttentionMetadataBuilder,
)
from atom.plugin.vllm.selection import attention_backend
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
)


# -- (a) signatures --------------------------------------------------------------------------------
def _compatible(ours, base) -> list[str]:
    """Problems calling ``ours`` the ways ``base`` can be called (by position and by name)."""
    o = inspect.signature(unwrap_descriptor(ours))
    b = inspect.signature(unwrap_descriptor(base))
    o_params, b_params = list(o.parameters.values()), list(b.parameters.values())
    var_kw = any(p.kind is p.VAR_KEYWORD for p in o_params)
    problems = []
    for i, p in enumerate(b_params):
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            if not any(q.kind is p.kind for q in o_params):
                problems.append(f"missing {p}")
            continue
        q = o.parameters.get(p.name)
        if q is None:
            if not var_kw:
                problems.append(f"missing parameter {p.name}")
            continue
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and o_params.index(q) != i:
            problems.append(f"{p.name} at position {o_params.index(q)}, vLLM's at {i}")
        if p.default is not p.empty and q.default is q.empty:
            problems.append(f"{p.name} needs a default")
    for q in o_params:
        if q.name not in b.parameters and q.kind not in (q.VAR_POSITIONAL, q.VAR_KEYWORD) and q.default is q.empty:
            problems.append(f"extra required parameter {q.name}")
    return problems


def _overrides(cls, base):
    """Every method vLLM finds on ``cls`` before its own base: written in the vLLM class or
    injected into the atom layer it subclasses."""
    seen = set()
    for klass in cls.__mro__[: cls.__mro__.index(base)]:
        for name, member in vars(klass).items():
            if name in seen or not (callable(unwrap_descriptor(member)) and not name.startswith("__")
                                    or name == "__init__"):
                continue
            seen.add(name)
            yield name, member, inspect.getattr_static(base, name, None)


def select(cfg):
    """(qualname or None, reason) of the one attention decision, as the platform asks it."""
    return tuple(attention_backend(None, cfg)[:2])


@pytest.mark.parametrize("cls,base", [
    (ATOMAttentionBackend, AttentionBackend),
    (ATOMAttentionMetadataBuilder, AttentionMetadataBuilder),
    (ATOMAttentionImpl, AttentionImpl),
], ids=["backend", "builder", "impl"])
def test_overrides_match_vllm_base(cls, base):
    from atom.plugin.vllm import compat

    checked = []
    for name, member, base_member in _overrides(cls, base):
        if base_member is None:
            # Called by vLLM without being on the base in every release: get_kv_cache_shape
            # (<= 0.28 only), do_kv_cache_update (duck-typed by the layer), or atom's own helper.
            continue
        # The backend decorator injects classmethods where vLLM's base declares staticmethods
        # (get_name, ...): vLLM calls both on the class, with the same arguments.
        kinds = {type(base_member)} | ({classmethod} if isinstance(base_member, staticmethod) else set())
        assert type(member) in kinds, f"{name}: {type(member).__name__} vs vLLM's {type(base_member).__name__}"
        if isinstance(member, classmethod) and isinstance(base_member, staticmethod):
            member = getattr(cls, name)  # bound to the class: compare without ``cls``
        assert _compatible(member, base_member) == [], (name, _compatible(member, base_member))
        checked.append(name)
    assert checked  # the comparison really ran
    if cls is ATOMAttentionBackend and compat.has_get_kv_cache_shape():
        assert "get_kv_cache_shape" in checked


def test_do_kv_cache_update_matches_the_layer_call():
    # unified_kv_cache_update calls impl.do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

    assert _compatible(ATOMAttentionImpl.do_kv_cache_update, CPUAttentionBackendImpl.do_kv_cache_update) == []


def test_impl_init_takes_what_the_layer_passes():
    # Attention.__init__ passes 10 positional arguments and extra_impl_args (sinks) by name.
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

    assert _compatible(ATOMAttentionImpl.__init__, AttentionImpl.__init__) == []
    assert "sinks" in inspect.signature(ATOMAttentionImpl.__init__).parameters
    assert _compatible(ATOMAttentionImpl.__init__, CPUAttentionBackendImpl.__init__) == []


def test_validate_configuration_accepts_every_selector_field():
    from atom.plugin.vllm import compat

    fields = set(compat.selector_config_cls()._fields)
    params = set(inspect.signature(ATOMAttentionBackend.validate_configuration).parameters)
    assert fields <= params


# -- selection -------------------------------------------------------------------------------------
def _selector(**kw):
    from atom.plugin.vllm import compat

    base = dict(head_size=128, dtype=torch.bfloat16, kv_cache_dtype="auto", block_size=16)
    return compat.selector_config_cls()(**{**base, **kw})


@pytest.fixture
def attention_on(monkeypatch):
    monkeypatch.delenv("ATOM_DISABLE_VLLM_PLUGIN_ATTENTION", raising=False)


@pytest.mark.parametrize("kw", [
    {}, {"dtype": torch.float32}, {"dtype": torch.float16, "head_size": 64}, {"has_sink": True},
    {"has_sliding_window": True}, {"head_size": 256}, {"block_size": 128},
    {"kv_cache_dtype": "bfloat16"}, {"kv_cache_dtype": "fp8"}, {"kv_cache_dtype": "fp8_e4m3"},
])
def test_selected(attention_on, kw):
    assert select(_selector(**kw)) == (BACKEND_QUALNAME, "atom MHA backend")


@pytest.mark.parametrize("kw,why", [
    ({"attn_type": "encoder"}, "attention type encoder not supported"),
    ({"attn_type": "encoder_decoder"}, "attention type encoder_decoder not supported"),
    ({"head_size": 512}, "head_size not supported"),
    ({"kv_cache_dtype": "fp8_e5m2"}, "kv_cache_dtype not supported"),
    ({"kv_cache_dtype": "float16"}, "kv_cache_dtype float16 differs from the model dtype"),
    ({"block_size": 8}, "block_size not supported"),
    ({"use_non_causal": True}, "non-causal attention not supported"),
    ({"use_mm_prefix": True}, "partial multimodal token full attention not supported"),
    ({"use_kv_connector": True}, "KV connector not supported"),
    ({"use_pcp": True}, "PCP not supported"),
])
def test_refused_with_reason(attention_on, kw, why):
    choice, reason = select(_selector(**kw))
    assert choice is None
    assert reason.startswith("atom's MHA backend does not support this layer: ") and why in reason


def test_mla_and_sparse_and_disabled(attention_on, monkeypatch):
    # MLA layers go to atom's MLA backend (tests/attention/test_mla_backend.py)
    assert select(_selector(use_mla=True, head_size=576))[1] == "atom MLA backend"
    assert select(_selector(use_sparse=True))[0] is None
    monkeypatch.setenv("ATOM_DISABLE_VLLM_PLUGIN_ATTENTION", "1")
    assert select(_selector()) == (
        None, "disabled by ATOM_DISABLE_VLLM_PLUGIN_ATTENTION=1")


def test_mha_steps_aside_on_nvidia_unless_asked_for(attention_on, monkeypatch):
    """Under vLLM on an NVIDIA GPU atom's MHA backend steps aside for vLLM's choice (measured
    slower there, bench/NOTES.md 55) unless ATOM_ENABLE_MHA_ON_NVIDIA=1 or --attention-backend
    CUSTOM asks for it; MLA layers and other devices keep atom's backend. (The engine-level check
    is the GPU test in tests/attention/test_nvidia_default.py.)"""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from atom.plugin.vllm import overrides
    from atom.plugin.vllm.selection import MHA_NVIDIA_ASIDE

    monkeypatch.setattr(overrides, "on_nvidia", lambda: True)
    monkeypatch.setenv("ATOM_ENABLE_MHA_ON_NVIDIA", "0")
    assert select(_selector()) == (None, MHA_NVIDIA_ASIDE)
    assert "ATOM_ENABLE_MHA_ON_NVIDIA=1" in MHA_NVIDIA_ASIDE and "--attention-backend CUSTOM" in MHA_NVIDIA_ASIDE
    assert select(_selector(use_mla=True, head_size=576))[1] == "atom MLA backend"
    asked = attention_backend(AttentionBackendEnum.CUSTOM, _selector())
    assert (asked.value, asked.reason) == (BACKEND_QUALNAME, "atom MHA backend")
    monkeypatch.setenv("ATOM_ENABLE_MHA_ON_NVIDIA", "1")
    assert select(_selector()) == (BACKEND_QUALNAME, "atom MHA backend")
    monkeypatch.setenv("ATOM_ENABLE_MHA_ON_NVIDIA", "0")
    monkeypatch.setattr(overrides, "on_nvidia", lambda: False)
    assert select(_selector()) == (BACKEND_QUALNAME, "atom MHA backend")


def test_unknown_newer_selector_field_is_refused():
    assert ATOMAttentionBackend.validate_configuration(
        128, torch.bfloat16, "auto", 16, False, False, False, False, False, None, "decoder",
        use_some_future_thing=True) == ["use_some_future_thing=True is unknown to atom"]


def test_registers_custom_idempotently_and_never_takes_it_from_another_plugin(attention_on):
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    custom = AttentionBackendEnum.CUSTOM
    assert select(_selector())[0] == BACKEND_QUALNAME
    assert custom.get_path() == BACKEND_QUALNAME and custom.get_class() is ATOMAttentionBackend
    assert select(_selector())[0] == BACKEND_QUALNAME
    assert AttentionBackendEnum[ATOMAttentionBackend.get_name()] is custom
    try:
        register_backend(custom, "other.plugin.Backend")
        assert select(_selector()) == (
            None, "AttentionBackendEnum.CUSTOM is already registered to other.plugin.Backend")
    finally:
        register_backend(custom, BACKEND_QUALNAME)


def test_kv_cache_geometry():
    from atom.plugin.vllm import compat

    assert ATOMAttentionBackend.get_kv_cache_shape(10, 16, 4, 64) == (2, 10, 16, 4, 64)
    if not compat.has_get_kv_cache_shape():
        from vllm.v1.kv_cache_layout import KVCacheLayout

        layouts = ATOMAttentionBackend.supported_kv_cache_layouts()
        assert layouts[0] is KVCacheLayout.LBNHC and set(layouts) == set(KVCacheLayout)


# -- (b) metadata builder on a real CommonAttentionMetadata ------------------------------------------
@pytest.fixture(scope="module")
def vllm_config(tiny_model):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=str(tiny_model("qwen3", "float32")), max_model_len=128,
                      dtype="float32").create_engine_config()


def _common_metadata(device: str) -> CommonAttentionMetadata:
    """Three requests: a 5-token prefill, a 1-token decode at 9 tokens, a 3-token chunk after 13.

    The device-side tensors may be on the ``meta`` device: any read of their values (a host
    sync on a GPU) then fails, while the CPU copies vLLM also provides stay readable."""
    q_lens, seq_lens = [5, 1, 3], [5, 9, 16]
    qsl = torch.tensor([0, 5, 6, 9], dtype=torch.int32)
    block_table = torch.arange(3 * 8, dtype=torch.int32).reshape(3, 8)
    slots = torch.arange(sum(q_lens), dtype=torch.int64)
    return CommonAttentionMetadata(
        query_start_loc=qsl.to(device), query_start_loc_cpu=qsl,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32).to(device),
        num_reqs=3, num_actual_tokens=9, max_query_len=max(q_lens), max_seq_len=max(seq_lens),
        block_table_tensor=block_table.to(device), slot_mapping=slots.to(device),
    )


def _builder(vllm_config):
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float32)
    return ATOMAttentionMetadataBuilder(spec, ["model.layers.0.self_attn.attn"], vllm_config, torch.device("cpu"))


def test_build_passes_vllm_tensors_through(vllm_config):
    common = _common_metadata("cpu")
    md = _builder(vllm_config).build(0, common)
    assert isinstance(md, PagedAttentionMetadata)
    assert (md.num_actual_tokens, md.num_reqs, md.max_query_len, md.max_seq_len, md.causal) == (9, 3, 5, 16, True)
    assert md.query_start_loc is common.query_start_loc and md.seq_lens is common.seq_lens
    assert md.block_table is common.block_table_tensor and md.slot_mapping is common.slot_mapping


def test_build_reads_no_device_values(vllm_config):
    builder = _builder(vllm_config)
    md = builder.build(0, _common_metadata("meta"), fast_build=True)
    assert md.query_start_loc.is_meta and md.max_query_len == 5
    captured = builder.build_for_cudagraph_capture(_common_metadata("meta"))
    # the decode kernel's split count is fixed at capture: size it for the longest context
    assert captured.max_seq_len == vllm_config.model_config.max_model_len


def test_build_refuses_per_request_causal(vllm_config):
    common = _common_metadata("cpu").replace(causal=torch.ones(3, dtype=torch.bool))
    with pytest.raises(NotImplementedError, match="per-request causal"):
        _builder(vllm_config).build(0, common)


def test_cudagraph_support_is_honest(vllm_config):
    import atom.ops as ops

    spec = _builder(vllm_config).kv_cache_spec
    support = ATOMAttentionMetadataBuilder.get_cudagraph_support(vllm_config, spec)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    triton = all(ops.OPS[n].backend_on(device)[0] == "triton" for n in ("paged_attention", "reshape_and_cache"))
    assert support is (AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE if triton else AttentionCGSupport.NEVER)
    if device == "cpu":
        assert support is AttentionCGSupport.NEVER  # the torch reference reads lengths on the host
    assert ATOMAttentionMetadataBuilder.reorder_batch_threshold is None
