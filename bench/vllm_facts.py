"""Print the vLLM interface facts atom's compat layer depends on, for the installed vLLM.

    python bench/vllm_facts.py

Run on each vLLM atom supports (CPU 0.32 here, 0.26 on the GPU machine) and compare: module
locations, signatures of the methods atom wraps or stands in for, and API presence checks.
"""

from __future__ import annotations

import importlib
import inspect


def _try(label, fn):
    try:
        print(f"{label}: {fn()}")
    except Exception as exc:  # a fact that does not exist on this version is itself the answer
        print(f"{label}: <{type(exc).__name__}: {exc}>")


def main() -> None:
    import vllm

    from atom.patches.signatures import shape

    print("vllm", vllm.__version__)
    for mod in ("vllm.model_executor.layers.attention.attention", "vllm.attention.layer",
                "vllm.model_executor.layers.attention.mla_attention", "vllm.v1.attention.backend",
                "vllm.v1.attention.backends.abstract", "vllm.v1.attention.selector",
                "vllm.model_executor.layers.fused_moe", "vllm.v1.attention.backends.registry"):
        _try(f"module {mod}", lambda m=mod: bool(importlib.import_module(m)))

    from vllm.model_executor.layers.attention.attention import Attention

    _try("Attention.process_weights_after_loading", lambda: shape(Attention.process_weights_after_loading))
    _try("Attention.__init__", lambda: shape(Attention.__init__))
    _try("Attention.forward", lambda: shape(Attention.forward))

    def mla():
        from vllm.model_executor.layers.attention.mla_attention import MLAAttention

        return {n: shape(getattr(MLAAttention, n)) for n in
                ("get_kv_cache_spec", "process_weights_after_loading", "forward_impl", "__init__")}

    _try("MLAAttention", mla)

    def backend():
        from vllm.v1.attention.backend import AttentionBackend, AttentionMetadataBuilder, CommonAttentionMetadata

        out = {
            "has get_kv_cache_shape": hasattr(AttentionBackend, "get_kv_cache_shape"),
            "has supported_kv_cache_layouts": hasattr(AttentionBackend, "supported_kv_cache_layouts"),
            "builder.build": shape(AttentionMetadataBuilder.build),
            "builder.build_for_cudagraph_capture": shape(AttentionMetadataBuilder.build_for_cudagraph_capture),
            "CommonAttentionMetadata fields": sorted(getattr(CommonAttentionMetadata, "__dataclass_fields__", {})),
        }
        return out

    _try("backend", backend)
    _try("FusedMoE kind", lambda: type(importlib.import_module("vllm.model_executor.layers.fused_moe").FusedMoE).__name__)
    _try("Platform.get_attn_backend_cls", lambda: shape(importlib.import_module("vllm.platforms.interface").Platform.get_attn_backend_cls))
    _try("AttentionSelectorConfig", lambda: importlib.import_module("vllm.v1.attention.selector").AttentionSelectorConfig._fields)
    _try("AttentionBackendEnum", lambda: [e.name for e in importlib.import_module("vllm.v1.attention.backends.registry").AttentionBackendEnum])
    _try("LogitsProcessor", lambda: shape(importlib.import_module("vllm.model_executor.layers.logits_processor").LogitsProcessor.__init__))


if __name__ == "__main__":
    main()
