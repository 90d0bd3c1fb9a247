"""Plugin-mode behaviour of atom's FusedMoE (:class:`atom.models._moe.FusedMoE`) under vLLM,
injected by the :data:`FUSED_MOE_PLUGIN_MODE` record (no subclass, no global class renaming);
the same member goes into atom's fp8-capable linear layers (:data:`LINEAR_PLUGIN_MODE`,
:class:`atom.models._linear.Fp8Linear`).

Why through vLLM's per-layer loop and not only the model-level hook: vLLM calls a model's own
``process_weights_after_loading()`` only in recent releases (0.32 does; 0.26 has just the
per-layer ``quant_method`` loop and the attention loop, see shared/reference/vllm_interfaces.md
3.6), so on the H100's vLLM 0.26 the injected ``quant_method`` is what repacks atom's fp8 layers
at all.

What vLLM 0.32 does to MoE modules, and how atom's layer relates to each:

* Model loader (``vllm/model_executor/model_loader/utils.py:process_weights_after_loading``):
  for every module whose ``quant_method`` is a ``QuantizeMethodBase`` it calls
  ``quant_method.process_weights_after_loading(module)`` inside ``device_loading_context``
  (which moves the module's parameters to the target device and back when vLLM offloads
  weights to CPU). The injected ``quant_method`` (:class:`AtomMoEPostLoad`) is what it finds on
  atom's layer: it runs atom's own repack (:meth:`FusedMoE.process_weights_after_loading`: fp8
  weights dequantised or kept for the fp8 kernel), so that repack happens under vLLM's device
  handling like a vLLM layer's would. The model-level hook (``ATOMModelBase.
  process_weights_after_loading``) runs after it and finds the layer already processed.
* vLLM's own MoE set-up (``RoutedExperts.__init__``: quant-method selection, EPLB checks,
  ``static_forward_context`` registration for ``torch.ops.vllm.moe_forward``; the runner's and
  compile passes' ``isinstance(m, RoutedExperts)`` / ``FusedMoEMethodBase`` checks;
  ``get_layers_from_vllm_config(.., RoutedExperts)``) never reaches atom's layer: it is not a
  ``RoutedExperts``, it never registers in the forward context, and the injected method is a
  plain ``QuantizeMethodBase`` (not a ``FusedMoEMethodBase``), so code that looks for vLLM MoE
  kernels skips it.

Importing this module imports neither vLLM nor torch (it is a catalog module); the record is
applied by ``register_model`` (every vLLM process) through ``atom.plugin.vllm.patches.arm_all``.
"""

from __future__ import annotations

from typing import Any

from atom.patches import Injection, register

#: The vLLM layer class whose members the injected ones stand in for.
VLLM_MOE_BASE = "vllm.model_executor.layers.fused_moe.routed_experts:RoutedExperts"
#: The vLLM interface of the object vLLM's loader calls (``quant_method``).
VLLM_QUANT_METHOD_BASE = "vllm.model_executor.layers.quantization.base_config:QuantizeMethodBase"

_METHOD_CLASS: list[type] = []  # built once, on first use (it subclasses a vLLM class)


def post_load_method_class() -> type:
    """:class:`AtomMoEPostLoad`: a vLLM ``QuantizeMethodBase`` (defined on first use so that
    this module does not import vLLM)."""
    if not _METHOD_CLASS:
        from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

        class AtomMoEPostLoad(QuantizeMethodBase):
            """What vLLM's loader finds as ``quant_method`` on an atom FusedMoE / Fp8Linear:
            weights are created and applied by atom's layer itself; only the post-load hook
            does work."""

            def create_weights(self, layer: Any, *weight_args: Any, **extra_weight_attrs: Any) -> None:
                raise RuntimeError("atom's layers create their own weights")

            def apply(self, layer: Any, *args: Any, **kwargs: Any) -> Any:
                raise RuntimeError("atom's layers run their own forward")

            def process_weights_after_loading(self, layer: Any) -> None:
                layer.process_weights_after_loading()

        AtomMoEPostLoad.__qualname__ = "AtomMoEPostLoad"
        AtomMoEPostLoad.__module__ = __name__
        _METHOD_CLASS.append(AtomMoEPostLoad)
    return _METHOD_CLASS[0]


class PluginModePostLoad:
    """The member injected into atom's FusedMoE and Fp8Linear (source of both records)."""

    @property
    def quant_method(self) -> Any:
        """Stands in for ``RoutedExperts.quant_method`` / ``LinearBase.quant_method`` (what
        vLLM's loader calls after loading)."""
        method = self.__dict__.get("_vllm_quant_method")
        if method is None:
            method = self.__dict__["_vllm_quant_method"] = post_load_method_class()()
        return method


FUSED_MOE_PLUGIN_MODE = register(Injection(
    id="vllm.moe.atom_fused_moe_post_load",
    target="atom.models._moe:FusedMoE",
    members=("quant_method",),
    source="atom.plugin.moe:PluginModePostLoad",
    base=VLLM_MOE_BASE,
    vllm=">=0.26,<0.34",
    reason="vLLM's loader runs per-layer post-load hooks (under its device handling) through "
           "module.quant_method; atom's FusedMoE gets one that runs atom's own repack",
    upstream="vllm model_loader.utils.process_weights_after_loading -> "
             "QuantizeMethodBase.process_weights_after_loading(self, layer)",
    removal="when atom's layers are repacked by the model-level hook only",
))

LINEAR_PLUGIN_MODE = register(Injection(
    id="vllm.linear.atom_fp8_linear_post_load",
    target="atom.models._linear:Fp8Linear",
    members=("quant_method",),
    source="atom.plugin.moe:PluginModePostLoad",
    base="vllm.model_executor.layers.linear:LinearBase",
    vllm=">=0.26,<0.34",
    reason="vLLM 0.26 calls no model-level post-load hook (0.32 does); its per-layer quant_method loop "
           "is what repacks atom's fp8 column/row-parallel layers",
    upstream="vllm model_loader.utils.process_weights_after_loading -> "
             "QuantizeMethodBase.process_weights_after_loading(self, layer)",
    removal="when every supported vLLM release calls the model-level hook",
))

MOE_RECORDS = (FUSED_MOE_PLUGIN_MODE, LINEAR_PLUGIN_MODE)
