"""Argument checks and constants shared by atom's memory-bound ops (no Triton, no vLLM).

Every backend of an op calls the same checks, so a malformed call fails the same way whichever
backend the dispatcher picks (a ``ValueError`` naming the argument), and the ``*_supports``
predicates only have to speak about what one backend cannot do.
"""

from __future__ import annotations

from typing import Optional

import torch

#: Largest finite float8_e4m3fn value; dynamic scales are amax / FP8_E4M3_MAX.
FP8_E4M3_MAX = 448.0
FP8_DTYPE = torch.float8_e4m3fn
#: amax floor for dynamic fp8 scales: an all-zero row/group gets a tiny finite scale (and zero
#: values) instead of 0/0.
FP8_AMAX_EPS = 1e-10

#: Activation dtypes the Triton kernels are written for.
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

#: ``kv_cache_dtype`` strings (vLLM's spelling) that mean "fp8 e4m3 with per-tensor scales".
FP8_KV_CACHE_DTYPES = ("fp8", "fp8_e4m3")


def nvidia_gpu(t: Optional[torch.Tensor] = None) -> bool:
    """Whether ``t`` lives on an NVIDIA GPU (CUDA, not ROCm's HIP); without ``t``, whether this
    process sees one."""
    on_cuda = t.is_cuda if t is not None else torch.cuda.is_available()
    return bool(on_cuda) and getattr(torch.version, "hip", None) is None


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative ints, for launch grids on the host. (Recent Triton makes
    ``triton.cdiv`` a ``ConstexprFunction``, ~1.7 us a call on this machine's Triton 3.9 against
    ~0.02 us for this; grids are sized on every launch, and outside CUDA graphs, as attention runs
    in mixed steps, that is host time per layer.)"""
    return -(-int(a) // int(b))


def next_pow2(n: int) -> int:
    """Smallest power of two >= max(n, 1) (tile sizes of every Triton kernel)."""
    return 1 << max(0, int(n) - 1).bit_length()


def check_float(name: str, t: torch.Tensor) -> None:
    if t.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name} must be float16, bfloat16 or float32, got {t.dtype}")


def check_scale(name: str, scale: Optional[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    """A per-tensor scale: a float32 tensor of one element on ``like``'s device."""
    if scale is None:
        raise ValueError(f"{name} is required for fp8 (a float32 tensor of one element)")
    if not isinstance(scale, torch.Tensor) or scale.numel() != 1 or scale.dtype != torch.float32:
        raise ValueError(f"{name} must be a float32 tensor of one element, got {scale!r}")
    if scale.device != like.device:
        raise ValueError(f"{name} is on {scale.device}, expected {like.device}")
    return scale


def kv_cache_is_fp8(kv_cache_dtype: str, key_cache: torch.Tensor, value_cache: torch.Tensor) -> bool:
    """Validate ``kv_cache_dtype`` against the cache tensors; True for an fp8 cache.

    ``"auto"`` stores the activation dtype converted to the cache's dtype; ``"fp8"`` /
    ``"fp8_e4m3"`` stores ``value / scale`` as float8_e4m3fn. An fp8 cache tensor with
    ``"auto"`` is refused: storing unscaled values into fp8 silently loses range.
    """
    fp8_tensors = key_cache.dtype == FP8_DTYPE, value_cache.dtype == FP8_DTYPE
    if kv_cache_dtype == "auto":
        if any(fp8_tensors):
            raise ValueError("kv_cache_dtype='auto' but the cache is float8_e4m3fn; pass kv_cache_dtype='fp8'")
        return False
    if kv_cache_dtype in FP8_KV_CACHE_DTYPES:
        if not all(fp8_tensors):
            raise ValueError(
                f"kv_cache_dtype={kv_cache_dtype!r} needs float8_e4m3fn caches, got "
                f"{key_cache.dtype} / {value_cache.dtype}"
            )
        return True
    raise ValueError(
        f"kv_cache_dtype={kv_cache_dtype!r} is not supported; accepted: auto, "
        + ", ".join(FP8_KV_CACHE_DTYPES)
    )


def check_paged_cache(
    key_cache: torch.Tensor, value_cache: torch.Tensor, num_kv_heads: int, head_size: int
) -> None:
    """Caches are ``[num_blocks, block_size, num_kv_heads, head_size]`` (NHD), any strides."""
    for name, cache in (("key_cache", key_cache), ("value_cache", value_cache)):
        if cache.dim() != 4 or tuple(cache.shape[2:]) != (num_kv_heads, head_size):
            raise ValueError(
                f"{name} must be [num_blocks, block_size, {num_kv_heads}, {head_size}], "
                f"got {tuple(cache.shape)}"
            )
    if key_cache.shape[:2] != value_cache.shape[:2]:
        raise ValueError(
            f"key_cache {tuple(key_cache.shape)} and value_cache {tuple(value_cache.shape)} differ"
        )


def check_slot_mapping(slot_mapping: torch.Tensor, num_tokens: int) -> None:
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != num_tokens:
        raise ValueError(f"slot_mapping must be [{num_tokens}], got {tuple(slot_mapping.shape)}")
    if slot_mapping.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"slot_mapping must be int64 (or int32), got {slot_mapping.dtype}")


def last_dim_contiguous(*tensors: Optional[torch.Tensor]) -> Optional[str]:
    """Reason string when any tensor's last dim is strided (kernels address it as unit-stride)."""
    for t in tensors:
        if t is not None and t.dim() > 0 and t.shape[-1] > 1 and t.stride(-1) != 1:
            return f"a tensor of shape {tuple(t.shape)} has last-dim stride {t.stride(-1)} (needs 1)"
    return None
