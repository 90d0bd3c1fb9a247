"""atom's paged attention (``atom.models.attention.mha``) as SGLang's ``atom`` attention backend
(``--attention-backend atom``).

The **SGLang MHA decorator** is one registered record (``atom.plugin.sglang.records``, group
``sglang.attention.mha``): ``sglang.attention.mha_backend`` injects what SGLang calls on a
backend (``attention.SGLangBackendMethods``) into atom's host-neutral
``PagedAttentionMetadataBuilder``. SGLang is handed :class:`ATOMSGLangAttnBackend`, which
subclasses that builder and SGLang's ``AttentionBackend`` and writes in its body only the
construction from SGLang's model runner. How SGLang reaches it (0.5.17):

* ``register()`` (atom's ``sglang.srt.plugins`` entry point) registers :func:`create_backend`
  under ``atom`` in SGLang's attention registry and adds ``atom`` to the accepted choices;
* the model runner calls ``create_backend(model_runner)`` once; it asks :func:`attention_backend`
  (the one decision: atom's backend, or why not) and builds atom's backend or, with the reason
  logged, SGLang's own (triton on GPUs, torch_native on CPU);
* per step ``init_forward_metadata`` (eager) or the CUDA-graph hooks, then per layer
  ``RadixAttention`` -> ``forward_extend`` / ``forward_decode`` -> the layer's atom impl.
"""

from __future__ import annotations

from typing import Any

from atom import envs
from atom._logging import get_logger, info_once
from atom.models.attention.mha import PagedAttentionBackend, PagedAttentionMetadataBuilder
from atom.plugin import Decision
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend

logger = get_logger("atom.plugin")


def attention_backend() -> Decision:
    """Decision(True or False, reason): does atom's backend serve ``--attention-backend atom``
    in this environment (switches and records)? Shared by :func:`create_backend`, the model
    classes (the fused QK-norm path needs atom's backend) and ``python -m atom doctor``."""
    if envs.ATOM_DISABLE_SGLANG_PLUGIN:
        return Decision(False, "disabled by ATOM_DISABLE_SGLANG_PLUGIN=1")
    if envs.ATOM_DISABLE_SGLANG_PLUGIN_ATTENTION:
        return Decision(False, "disabled by ATOM_DISABLE_SGLANG_PLUGIN_ATTENTION=1")
    from atom.plugin.sglang.register import overrides_in_effect

    use, why, _ = overrides_in_effect()
    if not use:
        return Decision(False, why)
    from atom.plugin import catalog

    blocked = catalog.group_blocked("sglang.attention.mha")
    if blocked is not None:
        return Decision(False, blocked)
    return Decision(True, "atom MHA backend")


def unsupported_reasons(model_runner: Any) -> list[str]:
    """What of this model runner's configuration atom's backend does not serve (empty: all)."""
    reasons = []
    page = int(model_runner.page_size)
    if page % PagedAttentionBackend.block_size_multiple:
        reasons.append(f"page size {page} is not a multiple of {PagedAttentionBackend.block_size_multiple} "
                       f"(pass --page-size {PagedAttentionBackend.block_size_multiple})")
    if model_runner.use_mla_backend:
        reasons.append("MLA models are not served by atom's SGLang backend yet")
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    pool = model_runner.token_to_kv_pool
    if type(pool) is not MHATokenToKVPool:
        reasons.append(f"KV pool {type(pool).__name__} (atom reads SGLang's plain MHA pool)")
    elif pool.dtype != model_runner.dtype:
        reasons.append(f"KV cache dtype {pool.dtype} differs from the model's {model_runner.dtype} "
                       "(no fp8 KV cache through SGLang yet)")
    elif getattr(pool, "kv_cache_layout", "nhd") != "nhd":
        reasons.append(f"KV cache layout {pool.kv_cache_layout}")
    return reasons


def create_backend(model_runner: Any) -> AttentionBackend:
    """SGLang's attention-registry creator for ``atom`` (called once per model runner): atom's
    backend; SGLang's own when atom's attention is switched off (logged); an error naming what
    is not served when the configuration is outside what atom's backend does."""
    use, why = attention_backend()[:2]
    if use:
        reasons = unsupported_reasons(model_runner)
        if reasons:
            raise ValueError("atom's SGLang attention backend does not serve this model: " + "; ".join(reasons))
        info_once("sglang-attention-on", f"atom attention backend ATOMSGLangAttnBackend selected ({why})", logger)
        return ATOMSGLangAttnBackend(model_runner)
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS

    fallback = "triton" if str(model_runner.device).startswith("cuda") else "torch_native"
    info_once("sglang-attention-off", f"atom attention not used ({why}); SGLang's {fallback} instead", logger)
    return ATTENTION_BACKENDS[fallback](model_runner)


class ATOMSGLangAttnBackend(PagedAttentionMetadataBuilder, AttentionBackend):
    """Paged MHA over SGLang's KV pool for decoder self-attention; SGLang's methods come from
    the decorator (``init_forward_metadata``, the CUDA-graph hooks, ``forward_extend`` /
    ``forward_decode``). Full CUDA graphs for decode batches where atom's kernels run Triton."""

    def __init__(self, model_runner: Any) -> None:
        AttentionBackend.__init__(self)
        self.device = model_runner.device
        self.page_size = int(model_runner.page_size)
        self.req_to_token = model_runner.req_to_token_pool.req_to_token
        self.token_to_kv_pool = model_runner.token_to_kv_pool
        self.max_num_seqs = int(model_runner.req_to_token_pool.size)
        #: impls of layers that did not bring one (SGLang's own models), by layer id
        self.impls: dict[int, Any] = {}
        self.forward_metadata: Any = None
        PagedAttentionMetadataBuilder.__init__(
            self, max_model_len=int(model_runner.model_config.context_len), max_num_batched_tokens=1,
            with_positions=False, device=self.device)
