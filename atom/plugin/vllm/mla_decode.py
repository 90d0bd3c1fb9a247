"""vLLM's FlashMLA dense decode, offered to atom's MLA layers (:class:`atom.models.attention.mla.HostDecode`).

atom's Triton MLA decode kernel takes 2.7x FlashMLA's time on the H100 at b=128 x 2k context
(0.37x; docs/performance.md): with 128 heads sharing one 576-wide latent row, MLA decode is bound
by tensor-core throughput, and FlashMLA's Hopper kernel (64-head tiles, both warpgroups, split
KV) is the one vLLM ships for it. So, under vLLM on a Hopper GPU, atom's MLA backend runs its
decode rows on ``flash_mla_with_kvcache`` (``ATOM_MLA_HOST_DECODE``; auto: where vLLM's
``is_flashmla_dense_supported`` says it runs), called as vLLM's ``FlashMLAImpl.forward_mqa``
calls it, on atom's own latent cache (already FlashMLA's ``[blocks, 64, 576]`` row layout; a
head axis of 1 is added as a view) and atom's block table and sequence lengths.

What FlashMLA takes: DeepSeek's latent geometry (kv_lora_rank 512, rope 64), bf16/fp16 queries
and cache, 64-token pages. atom's MLA backend then asks vLLM for 64-token pages
(:func:`preferred_block_size`, unless ``--block-size`` was given); a layer or step outside that
(another rank, an fp32 model, a 16-token cache) runs atom's kernel. FlashMLA's tile scheduler is
per step: atom's builder makes an empty one per built step (``get_mla_metadata()``), the step's
first layer fills it on the GPU (inside a captured CUDA graph too) and the others reuse it, as in
vLLM's FlashMLA backend. Installed once per process, when vLLM builds the first atom MLA layer.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

from atom import envs
from atom._logging import get_logger, info_once, warn_once
from atom.models.attention.mla import HostDecode, set_host_decode
from atom.ops._common import nvidia_gpu

logger = get_logger("atom.plugin")

FLASHMLA = "vLLM FlashMLA flash_mla_with_kvcache (dense decode)"
#: FlashMLA's dense decode: the page size it reads and the latent geometry it is built for
FLASHMLA_PAGE = 64
FLASHMLA_RANK = 512
FLASHMLA_ROPE = 64


def _declines(num_heads: int, kv_lora_rank: int, rope_dim: int, dtype: Any, kv_cache_dtype: str) -> Optional[str]:
    import torch

    if kv_lora_rank != FLASHMLA_RANK or rope_dim != FLASHMLA_ROPE:
        return (f"FlashMLA's dense decode is built for kv_lora_rank {FLASHMLA_RANK} + rope {FLASHMLA_ROPE}, "
                f"not {kv_lora_rank} + {rope_dim}")
    if dtype not in (torch.bfloat16, torch.float16):
        return f"FlashMLA's dense decode takes bf16/fp16, not {dtype}"
    if kv_cache_dtype not in ("auto", "bfloat16", "float16"):
        return f"atom's MLA latent cache is not {kv_cache_dtype}"
    return None


def flashmla_decode() -> Optional[HostDecode]:
    """FlashMLA as a :class:`HostDecode`, or None (the reason logged once) where vLLM says it does
    not run here or its interface is not the one atom calls."""
    if not nvidia_gpu():
        return None
    try:
        from vllm.v1.attention.ops import flashmla as fm
    except ImportError as e:  # a changed target: atom's own kernel serves every decode row
        warn_once("mla-host-decode", f"vLLM's FlashMLA wrapper not found ({e}); atom's Triton MLA decode "
                                     "serves every decode row", logger)
        return None
    ok, why = fm.is_flashmla_dense_supported()
    if not ok:
        info_once("mla-host-decode", f"vLLM's FlashMLA does not run here ({why}); atom's Triton MLA decode "
                                     "serves every decode row", logger)
        return None
    sched_meta = getattr(fm, "FlashMLASchedMeta", None)
    if sched_meta is None or not isinstance(fm.get_mla_metadata()[0], sched_meta):
        # FlashMLA's older interface took precomputed (tile_scheduler_metadata, num_splits) tensors
        warn_once("mla-host-decode", "vLLM's FlashMLA has another scheduling interface than the one atom "
                                     "calls (FlashMLASchedMeta); atom's Triton MLA decode serves every "
                                     "decode row", logger)
        return None
    flash_mla_with_kvcache, get_mla_metadata = fm.flash_mla_with_kvcache, fm.get_mla_metadata

    def new_step() -> Any:
        return get_mla_metadata()[0]

    def run(q: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
            scale: float, state: Any) -> torch.Tensor:
        out, _ = flash_mla_with_kvcache(q.unsqueeze(1), cache.unsqueeze(-2), block_table, seq_lens,
                                        q.shape[-1] - FLASHMLA_ROPE, state, softmax_scale=scale, causal=True)
        return out.squeeze(1)

    return HostDecode(FLASHMLA, _declines, FLASHMLA_PAGE, new_step, run)


@functools.lru_cache(maxsize=None)
def install() -> Optional[str]:
    """Offer vLLM's decode kernel to atom's MLA layers (once per process); returns its name, or
    None (atom's kernel serves every decode row)."""
    choice = envs.ATOM_MLA_HOST_DECODE
    set_host_decode(None)
    if choice == "atom":
        info_once("mla-host-decode", "ATOM_MLA_HOST_DECODE=atom: atom's Triton MLA decode serves every decode row",
                  logger)
        return None
    decode = flashmla_decode()  # auto and flashmla: the one kernel offered
    if decode is None:
        if choice == "flashmla":
            warn_once("mla-host-decode-asked", "ATOM_MLA_HOST_DECODE=flashmla, but vLLM's FlashMLA does not "
                                               "run here (no NVIDIA GPU, or the reason logged before); atom's "
                                               "Triton MLA decode serves every decode row", logger)
        return None
    set_host_decode(decode)
    info_once("mla-host-decode", f"MLA decode rows: {decode.name} for kv_lora_rank {FLASHMLA_RANK} + rope "
                                 f"{FLASHMLA_ROPE} in {FLASHMLA_PAGE}-token pages, atom's Triton kernel otherwise",
              logger)
    return decode.name


def preferred_block_size(default_block_size: int, model_config: Any = None) -> int:
    """The KV-cache page size atom's MLA backend asks vLLM for: FlashMLA's 64 where it is offered
    and takes the model's latent geometry and dtype (``model_config``: vLLM's, or the current
    config's), else vLLM's default."""
    if model_config is None:
        from atom.plugin.vllm import compat

        config = compat.current_vllm_config()
        model_config = None if config is None else config.model_config
    if model_config is None or install() is None:
        return default_block_size
    text = getattr(model_config, "hf_text_config", None)
    rank, rope = getattr(text, "kv_lora_rank", None), getattr(text, "qk_rope_head_dim", None)
    if rank is None or rope is None or _declines(0, int(rank), int(rope), model_config.dtype, "auto"):
        return default_block_size
    return FLASHMLA_PAGE
