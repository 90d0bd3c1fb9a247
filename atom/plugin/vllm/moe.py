"""The FusedMoE decorator: atom's host-neutral FusedMoE (:class:`atom.models._moe.FusedMoE`)
and fp8 linear layers (:class:`atom.models._linear.Fp8Linear`) under vLLM's loader.

The records ``vllm.moe.atom_fused_moe_post_load`` and ``vllm.linear.atom_fp8_linear_post_load``
(``atom.plugin.vllm.records``, group ``vllm.layers``) inject one member, ``quant_method``
(:class:`PluginModePostLoad`), into those classes (no subclass, no renaming).

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
  weights to CPU). What it finds on atom's layer (:class:`AtomMoEPostLoad`) runs atom's own
  repack (``FusedMoE.process_weights_after_loading``: fp8 weights dequantised or kept for the
  fp8 kernel) under vLLM's device handling like a vLLM layer's would. The model-level hook
  (``ATOMModelBase.process_weights_after_loading``) runs after it and finds the layer done.
* vLLM's own MoE set-up (``RoutedExperts.__init__``: quant-method selection, EPLB checks,
  ``static_forward_context`` registration for ``torch.ops.vllm.moe_forward``; the runner's and
  compile passes' ``isinstance(m, RoutedExperts)`` / ``FusedMoEMethodBase`` checks) never
  reaches atom's layer: it is not a ``RoutedExperts``, and the injected method is a plain
  ``QuantizeMethodBase`` (not a ``FusedMoEMethodBase``), so code that looks for vLLM MoE kernels
  skips it.
"""

from __future__ import annotations

from typing import Any

from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase


class AtomMoEPostLoad(QuantizeMethodBase):
    """What vLLM's loader finds as ``quant_method`` on an atom FusedMoE / Fp8Linear: weights are
    created and applied by atom's layer itself; only the post-load hook does work."""

    def create_weights(self, layer: Any, *weight_args: Any, **extra_weight_attrs: Any) -> None:
        raise RuntimeError("atom's layers create their own weights")

    def apply(self, layer: Any, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("atom's layers run their own forward")

    def process_weights_after_loading(self, layer: Any) -> None:
        if getattr(layer, "quant", None) is not None and getattr(layer.quant, "block", None) is not None:
            from atom.plugin.vllm.fp8_gemm import install

            install()  # vLLM's block-fp8 GEMMs (small and larger batches), before the layer warms up
        layer.process_weights_after_loading()


class PluginModePostLoad:
    """The member injected into atom's FusedMoE and Fp8Linear (source of both records)."""

    @property
    def quant_method(self) -> Any:
        """Stands in for ``RoutedExperts.quant_method`` / ``LinearBase.quant_method`` (what
        vLLM's loader calls after loading)."""
        method = self.__dict__.get("_vllm_quant_method")
        if method is None:
            method = self.__dict__["_vllm_quant_method"] = AtomMoEPostLoad()
        return method
