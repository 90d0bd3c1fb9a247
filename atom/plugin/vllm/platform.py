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
        when ATOM_DISABLE_VLLM_PLUGIN_ATTENTION=1, when the user asked for another backend, or
        when atom does not support the configuration (the reason is logged once)."""
        from atom.plugin.register import select_attention_backend

        requested = getattr(selected_backend, "name", None)
        if requested is not None and requested != "CUSTOM":
            # The user named a backend (--attention-backend / attention_config.backend): theirs.
            choice, why = None, f"attention backend {requested} requested"
        else:
            choice, why = select_attention_backend(attn_selector_config)
        if choice is not None:
            info_once(f"attn:{choice}", f"atom attention backend {choice.rpartition('.')[2]} selected", logger)
            return choice
        parent = super().get_attn_backend_cls(selected_backend, attn_selector_config, num_heads)  # type: ignore[misc]
        info_once(f"attn-parent:{why}", f"atom attention not used ({why}); vLLM's {parent.rpartition('.')[2]} instead", logger)
        return parent
