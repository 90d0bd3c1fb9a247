"""Every record atom applies under SGLang, declared once (importing this imports neither SGLang
nor torch). One decorator today:

* ``sglang.attention.mha_backend`` -- an :class:`~atom.patches.Injection` that binds atom's
  host-neutral paged-attention builder (``atom.models.attention.mha``) to SGLang: it injects
  what SGLang calls on an attention backend (``attention.SGLangBackendMethods``); SGLang is
  handed ``attention_mha.ATOMSGLangAttnBackend``, which inherits them.

Records carry ``host="sglang"`` (``ATOM_DISABLE_SGLANG_PLUGIN=1`` disables them, the installed
SGLang is checked against :data:`~atom.plugin.sglang.compat.SUPPORTED_SGLANG`) and their group;
``register()`` arms the whole ``sglang`` group in every SGLang process (:func:`arm_all`).
``python -m atom patches`` and ``docs/patches.md`` list them; the contract test covers each
where SGLang is installed.
"""

from __future__ import annotations

from atom.patches import REGISTRY, Injection, apply, register
from atom.plugin.sglang.compat import SUPPORTED_SGLANG

_BASE = "sglang.srt.layers.attention.base_attn_backend:AttentionBackend"

register(Injection(
    id="sglang.attention.mha_backend", group="sglang.attention.mha", host="sglang",
    target="atom.models.attention.mha:PagedAttentionMetadataBuilder",
    members=("init_forward_metadata", "init_cuda_graph_state", "init_forward_metadata_out_graph",
             "get_cuda_graph_seq_len_fill_value", "forward_extend", "forward_decode"),
    source="atom.plugin.sglang.attention:SGLangBackendMethods", base=_BASE,
    # Every member SGLang calls, with the shape 0.5.17's base declares (the CUDA-graph hooks
    # changed shape in 0.5.11-0.5.16 and change again in 0.5.23).
    signatures=(
        ("init_forward_metadata", "(self, forward_batch)"),
        ("init_cuda_graph_state", "(self, max_bs, max_num_tokens)"),
        ("init_forward_metadata_out_graph", "(self, forward_batch, in_capture=...)"),
        ("get_cuda_graph_seq_len_fill_value", "(self)"),
        ("forward_extend", "(self, q, k, v, layer, forward_batch, save_kv_cache=..., **kwargs)"),
        ("forward_decode", "(self, q, k, v, layer, forward_batch, save_kv_cache=..., **kwargs)"),
    ),
    sglang=SUPPORTED_SGLANG,
    reason="SGLang's model runner, CUDA-graph runner and RadixAttention call these on the attention backend",
    upstream="sglang AttentionBackend (srt/layers/attention/base_attn_backend.py)",
    removal="never while atom's layer serves SGLang (this is the host binding)",
))


def arm_all() -> dict[str, str]:
    """Apply or arm every SGLang record (the environment decides); id -> status text."""
    return {rec.id: str(apply(rec)) for rec in REGISTRY.select("sglang")}
