"""torch.compile for atom's models under vLLM, the way vLLM compiles its own models.

vLLM compiles a model when its class carries ``vllm.compilation.decorators.support_torch_compile``:
the decorator's ``__init__`` counts the model (``compilation_counter.num_models_seen``) and its
``__call__`` runs the forward through Dynamo (``fullgraph=True``) into vLLM's backend, which splits
the graph at the attention op (piecewise CUDA graphs between the attention calls) and compiles the
pieces with Inductor, under vLLM's default compilation config (``-O``/``compilation_config``).
Without the decorator vLLM logs "torch.compile is turned on, but the model ... does not support
it" and runs the model eagerly (inside CUDA graphs on GPUs).

:func:`compiled_model_class` applies that decorator to atom's wrapper (``ATOMModelBase`` in
``atom.plugin.vllm.model_wrapper``), so it is vLLM-side only: ``atom.models`` stays free of vLLM.
While Dynamo traces, atom's RMSNorm, RoPE and SiLU-and-mul are plain torch for Inductor to fuse
(``ATOM_COMPILE_ELEMENTWISE=inductor``, the default; ``=kernels`` makes them custom-op nodes too),
and its other ops become ``torch.ops.atom.*`` custom-op nodes (``atom.ops._graph``).

``ATOM_DISABLE_TORCH_COMPILE=1`` keeps the decorator but switches it off per model build
(``enable_if``), as for a model without it.
"""

from __future__ import annotations

from typing import Any, TypeVar

from atom import envs

T = TypeVar("T")

#: forward argument -> the dims whose size changes between steps (the token count). ``positions``
#: counts from the end, as vLLM's Qwen3 does (M-RoPE positions are ``[3, T]``).
DYNAMIC_ARG_DIMS = {"input_ids": 0, "positions": -1, "inputs_embeds": 0}


def compile_enabled(vllm_config: Any = None) -> bool:
    """``enable_if`` of the decorator: False when ATOM_DISABLE_TORCH_COMPILE is set."""
    return not envs.ATOM_DISABLE_TORCH_COMPILE


def compiled_model_class(cls: type[T]) -> type[T]:
    """``cls`` with vLLM's ``support_torch_compile`` applied (in place, as the decorator does)."""
    from vllm.compilation.decorators import support_torch_compile

    return support_torch_compile(dynamic_arg_dims=DYNAMIC_ARG_DIMS, enable_if=compile_enabled)(cls)
