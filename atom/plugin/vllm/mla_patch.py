"""mla_patch: vLLM's ``MLAAttention`` layer routed to atom's MLA impl, **only for layers whose
impl is atom's**; every other layer runs vLLM's own code unchanged.

vLLM's ``MLAAttention`` is neither a CustomOp nor a PluggableLayer (no ``register_oot``), and its
``forward_impl`` orchestrates vLLM's MLA backends itself (``MLACommonMetadata``, ``W_UK_T`` on
the layer, a separate prefill backend). atom's MLA backend keeps its own metadata and weights,
so two of the layer's methods are wrapped (records in ``atom.plugin.vllm.records``, group
``vllm.attention.mla``); both run once per layer, never per step:

* ``MLAAttention.process_weights_after_loading(act_dtype)`` (vLLM's loader, after loading): for
  an atom layer, ``impl.process_weights_after_loading(act_dtype)`` (atom's absorbed weights;
  vLLM's ``W_UK_T`` / ``W_UV`` layer parameters are not built), vLLM's default quant scales,
  and the **per-layer route**: the layer's ``forward_impl`` becomes ``impl.forward`` with the
  layer bound (an instance attribute, ``functools.partial``). The decision is made here, once
  per layer; a step's call costs what a direct call of atom's impl costs
  (``bench/injection_overhead.py``).
* ``MLAAttention.get_kv_cache_spec(vllm_config)``: vLLM's latent spec, checked against atom's
  latent layout for atom's layers (refuses the sliding-window MLA spec).

The wrappers are resolved only when the records are applied, so importing this module is not
needed to arm them.
"""

from __future__ import annotations

import functools
from typing import Any

from atom.models.attention.mla import MLAttentionImpl


def is_atom_layer(layer: Any) -> bool:
    """True when ``layer.impl`` is atom's MLA impl (its host-neutral class)."""
    return isinstance(getattr(layer, "impl", None), MLAttentionImpl)


def process_weights_after_loading(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
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
    # The route, decided once for this layer: an instance attribute shadows the class method,
    # so a step calls atom's forward with nothing in between.
    instance.forward_impl = functools.partial(instance.impl.forward, instance)
    return None


def get_kv_cache_spec(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    spec = wrapped(*args, **kwargs)
    if not is_atom_layer(instance):
        return spec
    if type(spec).__name__ != "MLAAttentionSpec":
        raise NotImplementedError(f"atom's MLA backend has no {type(spec).__name__} latent cache")
    instance.impl.check_latent_cache(spec.head_size, spec.num_kv_heads)
    return spec
