"""Every patch/injection atom applies to vLLM, declared as toolkit records.

Declared here (importing this module imports nothing of vLLM), armed by ``register_model`` in
every vLLM process through :func:`arm_all`, listed by ``python -m atom patches`` and in
``docs/patches.md``, and covered by the contract test over the registry.
"""

from __future__ import annotations

from typing import Any

from atom.patches import Patch, apply, register

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

VLLM_RECORDS = (ATTENTION_PWAL_DEFAULT,)


def arm_all() -> dict[str, str]:
    """Apply or arm every vLLM record (environment decides); id -> status text."""
    from atom.plugin.vllm import mla_patch

    records = dict.fromkeys(VLLM_RECORDS + mla_patch.RECORDS)  # ordered, each once
    return {rec.id: str(apply(rec)) for rec in records}
