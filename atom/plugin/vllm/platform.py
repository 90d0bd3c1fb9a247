"""ATOMPlatform: atom's behaviour on top of the platform vLLM would pick.

``ATOMPlatform`` is a mixin; the concrete classes subclass it and vLLM's own platform for the
device, keeping that platform's enum and behaviour (``is_cuda()``, CustomOp dispatch, ...):

* ``platform_cpu.ATOMCpuPlatform(ATOMPlatform, CpuPlatform)``
* ``platform_cuda.ATOMCudaPlatform(ATOMPlatform, CudaPlatform)``
* ``platform_rocm.ATOMRocmPlatform(ATOMPlatform, RocmPlatform)``

Each lives in its own module because importing ``vllm.platforms.cuda`` loads vLLM's CUDA
extension, which a CPU build does not have.
"""

from __future__ import annotations

import os
from typing import Any, Optional

from atom._logging import get_logger, info_once

logger = get_logger("atom.plugin")


class ATOMPlatform:
    """Mixin overriding vLLM's attention-backend selection; everything else is the parent's."""

    @classmethod
    def get_attn_backend_cls(
        cls,
        selected_backend: Any,
        attn_selector_config: Any,
        num_heads: Optional[int] = None,
    ) -> str:
        """atom's MLA backend when ``use_mla``, atom's MHA backend otherwise; the parent's answer
        when atom's does not serve the layer (:func:`atom.plugin.vllm.selection.
        attention_backend` says why; logged once per reason)."""
        from atom.plugin.vllm.selection import attention_backend

        choice, why, _ = attention_backend(selected_backend, attn_selector_config)
        if choice is not None:
            info_once(f"attn:{choice}", f"atom attention backend {choice.rpartition('.')[2]} selected", logger)
            return choice
        parent = super().get_attn_backend_cls(selected_backend, attn_selector_config, num_heads)  # type: ignore[misc]
        info_once(f"attn-parent:{why}", f"atom attention not used ({why}); vLLM's {parent.rpartition('.')[2]} instead", logger)
        return parent

    @classmethod
    def check_and_update_config(cls, vllm_config: Any) -> None:
        """The parent's, plus atom's compile-cache factors (:func:`add_compile_cache_factors`);
        and an MLA model served by atom's MLA backend keeps the user's chunked prefill, prefix
        caching and token budget (vLLM-CPU turns them off for MLA because its own CPU MLA
        backend cannot attend over cached context; atom's can)."""
        sched, cache = vllm_config.scheduler_config, vllm_config.cache_config
        before = (sched.enable_chunked_prefill, cache.enable_prefix_caching, sched.max_num_batched_tokens)
        super().check_and_update_config(vllm_config)  # type: ignore[misc]
        add_compile_cache_factors(vllm_config)
        after = (sched.enable_chunked_prefill, cache.enable_prefix_caching, sched.max_num_batched_tokens)
        if after == before or vllm_config.model_config is None or not vllm_config.model_config.use_mla:
            return
        from atom.plugin.vllm.selection import attention_backend_for_model

        if attention_backend_for_model(vllm_config).value is not None:
            sched.enable_chunked_prefill, cache.enable_prefix_caching, sched.max_num_batched_tokens = before
            info_once("mla-scheduling", "atom MLA backend: chunked prefill and prefix caching kept as configured", logger)


def compile_cache_factors() -> dict[str, str]:
    """What of atom shapes the graphs vLLM compiles: atom's version and every ATOM_* variable
    that is set (raw strings). E.g. ATOM_ENABLE_QK_NORM_ROPE_CACHE_QUANT_FUSION moves QK-norm and
    RoPE out of the model's traced graph into the attention impl."""
    import atom
    from atom import envs

    return {"version": atom.__version__,
            **{n: os.environ[n].strip() for n in envs.VARIABLES if os.environ.get(n, "").strip()}}


def add_compile_cache_factors(vllm_config: Any) -> None:
    """Put :func:`compile_cache_factors` into ``vllm_config.additional_config["atom"]``, which
    ``VllmConfig.compute_hash`` hashes (vLLM's field for out-of-tree platforms), so vLLM's
    torch.compile cache (keyed by that hash, the traced source files and vLLM's own env vars,
    not by ours) never hands a graph compiled under one ATOM_* setting to a process running
    another. Without it, toggling the QK-norm fusion reused the unfused graph while the impl
    also normed: q/k normed and rotated twice (found on the H100, vLLM 0.26)."""
    extra = getattr(vllm_config, "additional_config", None)
    if isinstance(extra, dict):
        extra["atom"] = compile_cache_factors()
    else:  # a SupportsHash object of the user's: leave it alone, say so once
        info_once("compile-cache-factors", "additional_config is not a dict: atom's settings are not part of "
                  "vLLM's compile-cache key; clear the cache (VLLM_CACHE_ROOT) after changing ATOM_* variables",
                  logger)
