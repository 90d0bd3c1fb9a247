"""mla_patch: vLLM's ``MLAAttention`` (and ``Attention``) layer methods routed to atom's impl,
**only for layers whose impl is atom's**; every other layer runs vLLM's own code unchanged.

vLLM's ``MLAAttention`` is neither a CustomOp nor a PluggableLayer (no ``register_oot``), and its
``forward_impl`` orchestrates vLLM's MLA backends itself (``MLACommonMetadata``, ``W_UK_T`` on
the layer, a separate prefill backend). atom's MLA backend keeps its own metadata and weights, so
these class attributes are wrapped (wrapt, revertible) and each wrapper first checks
``isinstance(layer.impl, ATOMMLAImpl)``:

* ``MLAAttention.forward_impl`` -> ``impl.forward(layer, q, k_c_normed, k_pe, kv_cache,
  attn_metadata, output, ...)`` (reached from ``MLAAttention.forward`` and vLLM's
  ``unified_mla_attention_with_output`` op).
* ``MLAAttention.process_weights_after_loading(act_dtype)`` (called by vLLM's loader) ->
  ``impl.process_weights_after_loading(act_dtype)`` (atom's absorbed weights; vLLM's
  ``W_UK_T``/``W_UV`` layer parameters are not created) and vLLM's default quant scales.
* ``MLAAttention.get_kv_cache_spec(vllm_config)`` -> ``impl.get_kv_cache_spec(layer, spec)``:
  the stock latent spec, checked against atom's latent layout (refuses sliding-window MLA).
* ``Attention.process_weights_after_loading``: the existing record
  ``vllm.attention.pwal_default_dtype`` (``atom.plugin.vllm.patches``) lets atom's models call it
  without ``act_dtype``; the impl's own ``process_weights_after_loading`` is vLLM's hook already,
  so no routing is needed there (calls that pass ``act_dtype`` run stock code unchanged).

Declared here (importing this module imports neither vLLM nor torch), armed by
``atom.plugin.vllm.patches.arm_all``; atom's MLA backend is only selected while the three MLA
records are applied (``atom.plugin.attention_mla.enable_plugin_mode``).
"""

from __future__ import annotations

import sys
from typing import Any

from atom.patches import Patch, register
from atom.plugin.vllm.patches import ATTENTION_PWAL_DEFAULT, SUPPORTED

MLA_MODULE = "vllm.model_executor.layers.attention.mla_attention"
_IMPL_MODULE = "atom.plugin.attention_mla"


def is_atom_layer(layer: Any) -> bool:
    """True when ``layer.impl`` is atom's MLA impl (never imports atom's backend module: a
    process that has not imported it has no atom MLA layers)."""
    module = sys.modules.get(_IMPL_MODULE)
    return module is not None and isinstance(getattr(layer, "impl", None), module.ATOMMLAImpl)


def _forward_impl(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    if not is_atom_layer(instance):
        return wrapped(*args, **kwargs)
    return _atom_forward_impl(instance, *args, **kwargs)


def _atom_forward_impl(layer: Any, q: Any, k_c_normed: Any, k_pe: Any, kv_cache: Any,
                       attn_metadata: Any, output: Any, output_scale: Any = None,
                       output_block_scale: Any = None, **rest: Any) -> Any:
    # rest: vLLM's fused-quant and DCP arguments (quant_group_size, q_dcp_replicated, ...).
    # atom's impl declines fused quantization and DCP, so vLLM passes them as None.
    given = sorted(k for k, v in rest.items() if v is not None)
    if given:
        raise NotImplementedError(f"atom's MLA backend does not take {', '.join(given)}")
    return layer.impl.forward(layer, q, k_c_normed, k_pe, kv_cache, attn_metadata, output,
                              output_scale, output_block_scale)


def _process_weights_after_loading(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    if not is_atom_layer(instance):
        return wrapped(*args, **kwargs)
    act_dtype = args[0] if args else kwargs["act_dtype"]
    instance.impl.process_weights_after_loading(act_dtype)
    # vLLM's default q/k/v scales when the checkpoint has none (as its own method ends).
    from vllm.model_executor.layers.attention import mla_attention as m

    quant_method = (m.resolve_quant_method(instance.quant_config, instance, prefix=instance.layer_name)
                    if instance.quant_config else None)
    if not m.should_load_quant_weights(quant_method):
        m.set_default_quant_scales(instance, register_buffer=False)
    return None


def _get_kv_cache_spec(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    spec = wrapped(*args, **kwargs)
    if not is_atom_layer(instance):
        return spec
    return instance.impl.get_kv_cache_spec(instance, spec)


MLA_FORWARD_IMPL = register(Patch(
    id="vllm.mla.forward_impl",
    target=f"{MLA_MODULE}:MLAAttention.forward_impl",
    wrapper=_forward_impl,
    vllm=SUPPORTED,
    # 0.32 (q_dcp_replicated added) and 0.26 (measured on the H100); the wrapper takes both.
    signature=("(self, q, k_c_normed, k_pe, kv_cache, attn_metadata, output, output_scale=..., "
               "output_block_scale=..., quant_group_size=..., quant_scale_ue8m0=..., "
               "quant_col_major=..., quant_tma_aligned=..., q_dcp_replicated=...)",
               "(self, q, k_c_normed, k_pe, kv_cache, attn_metadata, output, output_scale=..., "
               "output_block_scale=..., quant_group_size=..., quant_scale_ue8m0=..., "
               "quant_col_major=..., quant_tma_aligned=...)"),
    reason="vLLM's MLA forward_impl drives vLLM's MLA impls (MLACommonMetadata, layer W_UK_T, "
           "prefill backend); atom's layers run atom's decode/prefill instead",
    upstream="no backend hook replaces MLAAttention.forward_impl (MLAAttention is not a CustomOp)",
    removal="when vLLM lets an MLA backend own the whole forward",
))

MLA_PWAL = register(Patch(
    id="vllm.mla.process_weights_after_loading",
    target=f"{MLA_MODULE}:MLAAttention.process_weights_after_loading",
    wrapper=_process_weights_after_loading,
    vllm=SUPPORTED,
    signature="(self, act_dtype)",
    reason="atom's MLA impl keeps its own absorbed weights; vLLM's version would also build "
           "W_UK_T/W_UV layer parameters (and aiter/AMX variants) atom never reads",
    upstream="vllm MLAAttention.process_weights_after_loading",
    removal="when vLLM's layer leaves the kv_b_proj split to the impl",
))

MLA_KV_CACHE_SPEC = register(Patch(
    id="vllm.mla.get_kv_cache_spec",
    target=f"{MLA_MODULE}:MLAAttention.get_kv_cache_spec",
    wrapper=_get_kv_cache_spec,
    vllm=SUPPORTED,
    signature="(self, vllm_config)",
    reason="vLLM's latent spec is atom's layout; the route checks it (rank + rope, one head) and "
           "refuses the sliding-window MLA spec atom's kernels do not serve",
    upstream="vllm MLAAttention.get_kv_cache_spec / AttentionBackend.customize_spec",
    removal="when the backend builds its spec itself (vllm-project/vllm#42449)",
))

#: The records atom's MLA backend needs applied to be selected.
REQUIRED = (MLA_FORWARD_IMPL, MLA_PWAL, MLA_KV_CACHE_SPEC)
#: Everything mla_patch covers (the Attention record is declared in patches.py and reused).
RECORDS = REQUIRED + (ATTENTION_PWAL_DEFAULT,)
