"""ONE decision: which attention backend serves a vLLM attention layer configuration, and why.

:func:`attention_backend` answers for one ``AttentionSelectorConfig`` (what vLLM's selector
asks); :func:`attention_backend_for_model` answers for a whole ``VllmConfig`` before the model is
built. ``ATOMPlatform.get_attn_backend_cls``, ``ATOMPlatform.check_and_update_config`` and
``python -m atom doctor`` all use them, so the log line, the scheduling decision and doctor's
report read the same answer. vLLM asks once per distinct layer configuration (it caches the
answer), so a model may mix atom's backend (decoder layers it supports) with vLLM's.
"""

from __future__ import annotations

import importlib
from typing import Any, Optional

from atom import envs
from atom.plugin import Decision

#: atom's attention backend for vLLM per kind: (qualname, the AttentionBackendEnum name it takes).
BACKENDS: dict[str, tuple[str, str]] = {
    "mha": ("atom.plugin.vllm.attention_mha.ATOMAttentionBackend", "CUSTOM"),
    "mla": ("atom.plugin.vllm.attention_mla.ATOMMLABackend", "ATOM_MLA"),
}


#: Why atom's MHA backend steps aside under vLLM on NVIDIA GPUs unless asked for (the log line and
#: doctor's report): in the online cell on an H200, atom's model with atom's attention ran at 0.71x
#: stock and with vLLM's attention at 1.00x, in consecutive calls on one machine (bench/NOTES.md 55).
MHA_NVIDIA_ASIDE = ("atom's MHA backend steps aside on NVIDIA GPUs, where it measured slower than vLLM's own "
                    "attention in the online-serving cell on an H200 (docs/performance.md); "
                    "ATOM_ENABLE_MHA_ON_NVIDIA=1 or --attention-backend CUSTOM serves MHA layers with it")


def _group_blocked(kind: str) -> Optional[str]:
    """Apply the records of ``kind`` (its decorators and patches, group ``vllm.attention.<kind>``);
    why one is not in effect, or None."""
    from atom.plugin import catalog

    return catalog.group_blocked(f"vllm.attention.{kind}")


def _mla_dims(vllm_config: Any) -> Optional[tuple[int, int]]:
    """(kv_lora_rank, qk_rope_head_dim) of the model, or None when unknown."""
    hf = getattr(getattr(vllm_config, "model_config", None), "hf_text_config", None)
    rank, rope = getattr(hf, "kv_lora_rank", None), getattr(hf, "qk_rope_head_dim", None)
    return None if rank is None or rope is None else (int(rank), int(rope))


def attention_backend(selected_backend: Any, attn_selector_config: Any, *, claim_name: bool = True,
                      vllm_config: Any = None) -> Decision:
    """Decision(atom backend qualname or None, reason) for one layer configuration.

    ``selected_backend``: what the user asked for (``--attention-backend``), None for vLLM's
    choice. Under vLLM on NVIDIA GPUs atom's MHA backend steps aside for vLLM's choice unless
    asked for (:data:`MHA_NVIDIA_ASIDE`). The backend's records are applied first (idempotent,
    what ``register_model``'s arming does on import anyway): its decorators are what answer
    ``validate_configuration``.
    ``claim_name``: also claim its ``AttentionBackendEnum`` name (what the platform does before
    handing the backend to vLLM). ``vllm_config``: the model's config, for what the selector
    does not carry (MLA's rank and rope split); default: the config vLLM is building.
    """
    if envs.ATOM_DISABLE_VLLM_PLUGIN_ATTENTION:
        return Decision(None, "disabled by ATOM_DISABLE_VLLM_PLUGIN_ATTENTION=1")
    from atom.plugin.vllm.register import overrides_in_effect

    in_effect = overrides_in_effect()
    if not in_effect.value:
        return Decision(None, in_effect.reason)
    requested = getattr(selected_backend, "name", None)
    if requested is not None and requested not in {name for _, name in BACKENDS.values()}:
        return Decision(None, f"attention backend {requested} requested")
    kind = "mla" if getattr(attn_selector_config, "use_mla", False) else "mha"
    if getattr(attn_selector_config, "use_sparse", False):
        return Decision(None, "sparse attention is not supported by atom")
    if kind == "mha" and requested is None and not envs.ATOM_ENABLE_MHA_ON_NVIDIA:
        from atom.plugin.vllm.overrides import on_nvidia

        if on_nvidia():
            return Decision(None, MHA_NVIDIA_ASIDE)
    qualname, name = BACKENDS[kind]
    module_name, _, cls_name = qualname.rpartition(".")
    try:
        backend = getattr(importlib.import_module(module_name), cls_name)
    except ImportError as exc:  # no (importable) vLLM: nothing to select for
        return Decision(None, f"atom's {kind.upper()} backend cannot be imported ({exc})")
    blocked = _group_blocked(kind)
    if blocked is not None:
        return Decision(None, blocked)

    from atom.plugin.vllm import compat
    from atom.plugin.vllm.attention import claim_backend_name, unsupported_reasons

    reasons = unsupported_reasons(backend, attn_selector_config)
    if kind == "mla":
        from atom.models.attention.mla import mla_geometry_reasons

        dims = _mla_dims(vllm_config if vllm_config is not None else compat.current_vllm_config())
        reasons += mla_geometry_reasons(*dims) if dims is not None else []
    if reasons:
        return Decision(None, f"atom's {kind.upper()} backend does not support this layer: {', '.join(reasons)}")
    if claim_name:
        taken = claim_backend_name(name, qualname)
        if taken is not None:
            return Decision(None, taken)
    return Decision(qualname, f"atom {kind.upper()} backend")


def attention_backend_for_model(vllm_config: Any) -> Decision:
    """The decision for the MLA layers of the model ``vllm_config`` describes (Decision(None,
    "not an MLA model") for others), from the config alone: what the selector will see when
    vLLM builds the model (no backend name is claimed)."""
    model = vllm_config.model_config
    if model is None or not getattr(model, "use_mla", False):
        return Decision(None, "not an MLA model")
    from atom.plugin.vllm import compat

    hf = model.hf_text_config
    rank = int(getattr(hf, "kv_lora_rank", 0) or 0)
    rope = int(getattr(hf, "qk_rope_head_dim", 0) or 0)
    selector = compat.selector_config_cls()(
        head_size=rank + rope, dtype=model.dtype, kv_cache_dtype=vllm_config.cache_config.cache_dtype,
        block_size=vllm_config.cache_config.block_size, use_mla=True,
        use_sparse=bool(getattr(hf, "index_topk", None)))
    requested = getattr(getattr(vllm_config, "attention_config", None), "backend", None)
    return attention_backend(requested, selector, claim_name=False, vllm_config=vllm_config)
