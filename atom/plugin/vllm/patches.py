"""Every patch/injection atom applies to vLLM, declared as toolkit records.

Declared here (importing this module imports nothing of vLLM), armed by ``register_model`` in
every vLLM process through :func:`arm_all`, listed by ``python -m atom patches`` and in
``docs/patches.md``, and covered by the contract test over the registry.
"""

from __future__ import annotations

from typing import Any

from atom.patches import Injection, Patch, apply, register
from atom.plugin.moe import MOE_RECORDS

SUPPORTED = ">=0.26,<0.34"


def _default_act_dtype(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """Let ``process_weights_after_loading()`` be called without ``act_dtype`` (atom's models
    call it on their own attention layers); the layer's dtype is the activation dtype."""
    if not args and "act_dtype" not in kwargs:
        kwargs = dict(kwargs, act_dtype=instance.dtype)
    return wrapped(*args, **kwargs)


ATTENTION_PWAL_DEFAULT = register(Patch(
    id="vllm.attention.pwal_default_dtype",
    target="vllm.model_executor.layers.attention.attention:Attention.process_weights_after_loading",
    wrapper=_default_act_dtype,
    vllm=SUPPORTED,
    signature="(self, act_dtype)",
    reason="atom models call process_weights_after_loading() on vLLM Attention layers without act_dtype",
    upstream="vllm Attention.process_weights_after_loading(self, act_dtype) has no default",
    removal="when atom's model wrapper passes act_dtype itself everywhere",
))

# -- attention decorators (atom.plugin.attention / attention_mha / attention_mla) ------------------
# Member lists are spelled here (not imported from atom.plugin.attention, which imports vLLM);
# tests/attention/test_decorators.py checks they equal BACKEND_MEMBERS / BUILDER_MEMBERS.
BACKEND_MEMBERS = (
    "get_name", "get_impl_cls", "get_builder_cls", "get_supported_kernel_block_sizes",
    "get_kv_cache_shape", "supported_kv_cache_layouts", "get_supported_head_sizes",
    "supports_head_size", "supports_sink", "supports_sliding_window", "supports_kv_connector",
    "supports_device_cpu_query_lens_mismatch", "supports_combination", "validate_configuration",
)
BUILDER_MEMBERS = ("build", "build_for_cudagraph_capture", "build_for_drafting")
MHA_IMPL_MEMBERS = ("process_weights_after_loading", "do_kv_cache_update", "forward")

_VLLM_BACKEND = "vllm.v1.attention.backend"


def backend_decorator(record_id: str, target: str,
                      source: str = "atom.plugin.attention:VLLMBackendMethods",
                      extra_members: tuple[str, ...] = (),
                      extra_signatures: tuple[tuple[str, str], ...] = ()) -> Injection:
    """The backend decorator for one atom backend class (``"module:Class"``): vLLM's required
    classmethods, from ``atom.plugin.attention:VLLMBackendMethods`` or a per-backend subclass of
    it (``source``) that adds ``extra_members`` (MLA: ``is_mla``). Shared by MHA and MLA."""
    return Injection(
        id=record_id, target=target, members=BACKEND_MEMBERS + extra_members,
        source=source, base=f"{_VLLM_BACKEND}:AttentionBackend",
        # Only members every supported release declares with this shape are guarded
        # (get_kv_cache_shape is <= 0.28 only, supported_kv_cache_layouts >= 0.29, and
        # validate_configuration grows fields per release: atom's takes **newer_fields).
        signatures=(
            ("get_name", "()"), ("get_impl_cls", "()"), ("get_builder_cls", "()"),
            ("supports_head_size", "(cls, head_size)"), ("supports_sink", "(cls)"),
            ("supports_sliding_window", "(cls)"),
        ) + extra_signatures,
        vllm=SUPPORTED,
        reason="vLLM's selector, Attention layer and KV-cache manager call these on the backend class",
        upstream="vllm AttentionBackend (v1/attention/backend.py)",
        removal="never while atom's backend serves vLLM (this is the framework binding)",
    )


def builder_decorator(record_id: str, target: str) -> Injection:
    """The builder decorator for one atom metadata builder: ``build``,
    ``build_for_cudagraph_capture`` and ``build_for_drafting`` onto its ``build_metadata``."""
    return Injection(
        id=record_id, target=target, members=BUILDER_MEMBERS,
        source="atom.plugin.attention:VLLMBuilderMethods", base=f"{_VLLM_BACKEND}:AttentionMetadataBuilder",
        signatures=(
            ("build", "(self, common_prefix_len, common_attn_metadata, fast_build=...)"),
            ("build_for_cudagraph_capture", "(self, common_attn_metadata)"),
        ),
        vllm=SUPPORTED,
        reason="vLLM's model runner builds attention metadata through these every step / at graph capture",
        upstream="vllm AttentionMetadataBuilder (v1/attention/backend.py)",
        removal="never while atom's backend serves vLLM (this is the framework binding)",
    )


_MHA = "atom.plugin.attention_mha"

MHA_BACKEND = register(backend_decorator("vllm.attention.mha_backend", f"{_MHA}:ATOMAttentionBackend"))
MHA_BUILDER = register(builder_decorator("vllm.attention.mha_builder", f"{_MHA}:ATOMAttentionMetadataBuilder"))
MHA_IMPL = register(Injection(
    id="vllm.attention.mha_impl", target=f"{_MHA}:ATOMAttentionImpl", members=MHA_IMPL_MEMBERS,
    source=f"{_MHA}:VLLMMHAImplMethods", base=f"{_VLLM_BACKEND}:AttentionImpl",
    # do_kv_cache_update is duck-typed by vLLM's layer (not on the base): unguarded here, its
    # shape is tested against vLLM's own backends.
    signatures=(
        ("process_weights_after_loading", "(self, act_dtype)"),
        ("forward", "(self, layer, query, key, value, kv_cache, attn_metadata, output, "
                    "output_scale=..., output_block_scale=...)"),
    ),
    vllm=SUPPORTED,
    reason="plugin-mode forward / cache write / post-load hook of atom's paged attention impl",
    upstream="vllm AttentionImpl (v1/attention/backend.py) and Attention's unified_kv_cache_update",
    removal="never while atom's backend serves vLLM (this is the framework binding)",
))

#: The decorators of each atom backend kind, applied before the backend is handed to vLLM.
_MLA = "atom.plugin.attention_mla"
#: What only an MLA backend adds to the shared backend members.
MLA_BACKEND_EXTRA_MEMBERS = ("is_mla",)

MLA_BACKEND = register(backend_decorator(
    "vllm.attention.mla_backend", f"{_MLA}:ATOMMLABackend", source=f"{_MLA}:VLLMMLABackendMethods",
    extra_members=MLA_BACKEND_EXTRA_MEMBERS, extra_signatures=(("is_mla", "(cls)"),)))
MLA_BUILDER = register(builder_decorator("vllm.attention.mla_builder", f"{_MLA}:ATOMMLAMetadataBuilder"))
# The MLA impl decorator (atom.mla.impl_plugin_mode) is declared next to the impl in
# atom.plugin.attention_mla and applied by its enable_plugin_mode, with mla_patch.

ATTENTION_DECORATORS: dict[str, tuple[Injection, ...]] = {
    "mha": (MHA_BACKEND, MHA_BUILDER, MHA_IMPL),
    "mla": (MLA_BACKEND, MLA_BUILDER),
}

VLLM_RECORDS = (ATTENTION_PWAL_DEFAULT, MHA_BACKEND, MHA_BUILDER, MHA_IMPL, MLA_BACKEND, MLA_BUILDER,
                *MOE_RECORDS)


def arm_all() -> dict[str, str]:
    """Apply or arm every vLLM record (environment decides); id -> status text."""
    from atom.plugin.vllm import mla_patch

    records = dict.fromkeys(VLLM_RECORDS + mla_patch.RECORDS)  # ordered, each once
    return {rec.id: str(apply(rec)) for rec in records}
