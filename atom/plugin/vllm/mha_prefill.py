"""vLLM's FlashAttention, offered to atom's MHA layers for the steps with multi-token rows
(:class:`atom.models.attention.mha.HostPrefill`).

Why: atom's Triton prefill kernel reaches about half of FlashAttention 3's throughput on the H100
(docs/performance.md, prefill attention 0.49x), and a step with a prefill row runs attention outside
CUDA graphs, where atom's launches (prefill kernel, decode kernel, split-KV reduce) cost about twice
stock's host time per layer (bench/NOTES.md entries 42-46). vLLM's ``flash_attn_varlen_func`` serves
every row of such a step in one call, on atom's own cache: atom's NHD halves
``[blocks, page, kv_heads, head_size]`` are the paged layout it reads, with atom's block table,
sequence lengths and query offsets. Decode-only steps (captured in full CUDA graphs) keep atom's
kernels.

``ATOM_MHA_HOST_PREFILL``: ``atom`` (the default: on an H200 the online cell it targets was a tie at
3 launches, bench/NOTES.md entries 51-52) = atom's kernels always; ``flash_attn`` = vLLM's FlashAttention 3 where it
runs (Hopper); ``auto`` = the same. Where it does not run (no NVIDIA GPU, another FlashAttention
version than 3, a changed interface) or does not take a layer (fp32, an fp8 cache, head size above
256 or not a multiple of 8, sinks with fp16 activations), atom's kernels serve, and one line says
why. Installed once per process, when vLLM builds the first atom MHA layer.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

from atom import envs
from atom._logging import get_logger, info_once, warn_once
from atom.models.attention.mha import HostPrefill, set_host_prefill
from atom.ops._common import nvidia_gpu

logger = get_logger("atom.plugin")

FLASH_ATTN = "vLLM FlashAttention 3 flash_attn_varlen_func (paged)"
#: the only FlashAttention version atom hands steps to (measured on Hopper)
FA_VERSION = 3
#: head sizes FlashAttention 3 compiles
MAX_HEAD_SIZE = 256


def _declines(num_heads: int, num_kv_heads: int, head_size: int, dtype: Any, kv_cache_dtype: str,
              has_sinks: bool) -> Optional[str]:
    import torch

    if dtype not in (torch.bfloat16, torch.float16):
        return f"FlashAttention takes bf16/fp16, not {dtype}"
    if kv_cache_dtype not in ("auto", "bfloat16", "float16"):
        return f"KV cache dtype {kv_cache_dtype} (FlashAttention would need fp8 queries)"
    if head_size > MAX_HEAD_SIZE or head_size % 8:
        return f"head size {head_size} (FlashAttention 3: a multiple of 8 up to {MAX_HEAD_SIZE})"
    if has_sinks and dtype != torch.bfloat16:
        return f"sinks with {dtype} activations (FlashAttention 3 takes sinks, s_aux, in bf16 only)"
    return None  # GQA and sinks (``s_aux``, bf16) are FlashAttention 3's own


def host_prefill_from(varlen: Callable[..., Any], fa_version: int) -> HostPrefill:
    """The :class:`HostPrefill` calling ``varlen`` (vLLM's ``flash_attn_varlen_func``) as vLLM's
    ``FlashAttentionImpl.forward`` calls it for a decoder layer: atom's sliding window ``W`` (the
    last ``W`` keys, the query's own included) is FlashAttention's ``(W - 1, 0)``; sinks in bf16,
    the only dtype FlashAttention 3 takes them in ("We only support bf16 dtype for S aux", measured
    on the H200; GPT-OSS checkpoints store them in bf16, so the copy is exact there)."""
    import torch

    def run(q: Any, key_cache: Any, value_cache: Any, out: Any, md: Any, scale: float,
            sliding_window: Optional[int], sinks: Any) -> Any:
        varlen(q=q, k=key_cache, v=value_cache, out=out, cu_seqlens_q=md.query_start_loc,
               max_seqlen_q=md.max_query_len, seqused_k=md.seq_lens, max_seqlen_k=md.max_seq_len,
               softmax_scale=scale, causal=md.causal,
               window_size=[int(sliding_window) - 1, 0] if sliding_window else None,
               block_table=md.block_table, fa_version=fa_version, s_aux=sinks)
        return out

    return HostPrefill(FLASH_ATTN, _declines, run, sinks_dtype=torch.bfloat16)


def flash_attn_prefill() -> Optional[HostPrefill]:
    """vLLM's FlashAttention 3 as a :class:`HostPrefill`, or None (the reason logged once) where
    it does not run here or its interface is not the one atom calls."""
    if not nvidia_gpu():
        return None
    try:
        from vllm.v1.attention.backends import fa_utils
    except ImportError as e:  # a changed target: atom's kernels serve every step
        warn_once("mha-host-prefill", f"vLLM's FlashAttention helpers not found ({e}); atom's Triton attention "
                                      "serves every step", logger)
        return None
    if not fa_utils.is_flash_attn_varlen_func_available():
        info_once("mha-host-prefill", "vLLM's FlashAttention is not available here; atom's Triton attention "
                                      "serves every step", logger)
        return None
    version = fa_utils.get_flash_attn_version()
    if version != FA_VERSION:
        info_once("mha-host-prefill", f"vLLM would run FlashAttention {version} here, atom hands steps only to "
                                      f"FlashAttention {FA_VERSION} (Hopper); atom's Triton attention serves "
                                      "every step", logger)
        return None
    varlen = getattr(fa_utils, "flash_attn_varlen_func", None)
    if varlen is None:
        warn_once("mha-host-prefill", "vLLM's fa_utils has no flash_attn_varlen_func; atom's Triton attention "
                                      "serves every step", logger)
        return None
    return host_prefill_from(varlen, version)


@functools.lru_cache(maxsize=None)
def install() -> Optional[str]:
    """Offer vLLM's FlashAttention to atom's MHA layers (once per process, inside vLLM's config
    context, which FlashAttention's version choice reads); returns its name, or None (atom's
    kernels serve every step)."""
    choice = envs.ATOM_MHA_HOST_PREFILL
    set_host_prefill(None)
    if choice == "atom":
        return None
    prefill = flash_attn_prefill()
    if prefill is None:
        if choice == "flash_attn":
            warn_once("mha-host-prefill-asked", "ATOM_MHA_HOST_PREFILL=flash_attn, but vLLM's FlashAttention 3 "
                                                "does not run here (no NVIDIA GPU, or the reason logged before); "
                                                "atom's Triton attention serves every step", logger)
        return None
    set_host_prefill(prefill)
    info_once("mha-host-prefill", f"MHA steps with multi-token rows: {prefill.name} (bf16/fp16 caches), atom's "
                                  "Triton attention for decode-only steps and other layers", logger)
    return prefill.name
