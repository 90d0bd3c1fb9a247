"""Multi-head latent attention (DeepSeek-V2/V3 MLA): latent-cache write and absorbed decode.

Latent cache: ``[num_blocks, block_size, kv_lora_rank + rope_dim]`` (DeepSeek: 512 + 64); a
token's row is ``[c_kv | k_pe]``: the normalised latent then the roped key positional part.
Slot ``s`` is block ``s // block_size``, offset ``s % block_size``.

Decode works in the latent space ("weight absorption"): the caller folds ``W_UK`` into the
query (``q_nope_absorbed = q_nope @ W_UK``, ``[T, H, kv_lora_rank]``) and applies ``W_UV`` to
the output. Then for every head::

    score_j = (q_nope_absorbed . c_kv_j + q_pe . k_pe_j) * scale
    out     = softmax(score) @ c_kv                       # [T, H, kv_lora_rank]

One query token per sequence: row ``t`` of the queries is sequence ``t`` (``block_table[t]``,
``seq_lens[t]`` keys, all visible).

fp8 latent caches (float8_e4m3fn) store ``value / kv_scale``; reads multiply by ``kv_scale``.
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from atom.ops._common import FLOAT_DTYPES
from atom.ops._dispatch import declare
from atom.ops._warm import timed

__all__ = ["mla_write_latent_cache", "mla_decode", "mla_write_latent_cache_torch",
           "mla_decode_torch", "rope_torch", "warm_up_mla_decode"]

_FP8 = torch.float8_e4m3fn


def rope_torch(x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
               is_neox: bool) -> torch.Tensor:
    """RoPE on ``x [T, rope_dim]`` (float32 result).

    ``cos_sin_cache[pos] = [cos (rope_dim/2) | sin (rope_dim/2)]`` (vLLM's layout). neox style
    rotates the two halves of ``x``; GPT-J style (``is_neox=False``, DeepSeek) rotates
    interleaved (even, odd) pairs.
    """
    half = x.shape[-1] // 2
    cs = cos_sin_cache[positions.long()].float()
    cos, sin = cs[:, :half], cs[:, half:]
    xf = x.float()
    if is_neox:
        x1, x2 = xf[:, :half], xf[:, half:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    x1, x2 = xf[:, 0::2], xf[:, 1::2]
    return torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)


def _check_write(kv_c: torch.Tensor, k_pe: torch.Tensor, positions: torch.Tensor,
                 cos_sin_cache: torch.Tensor, latent_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
    if kv_c.dim() != 2:
        raise ValueError(f"kv_c must be [tokens, kv_lora_rank], got {tuple(kv_c.shape)}")
    t, rank = kv_c.shape
    rope = k_pe.shape[-1]
    if k_pe.numel() != t * rope or rope % 2:
        raise ValueError(f"k_pe must be [{t}, rope_dim] or [{t}, 1, rope_dim] with an even "
                         f"rope_dim, got {tuple(k_pe.shape)}")
    if latent_cache.dim() != 3 or latent_cache.shape[2] != rank + rope:
        raise ValueError(f"latent_cache must be [blocks, block_size, {rank + rope}], "
                         f"got {tuple(latent_cache.shape)}")
    if cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] != rope:
        raise ValueError(f"cos_sin_cache must be [max_pos, {rope}], got {tuple(cos_sin_cache.shape)}")
    if positions.shape != (t,) or slot_mapping.shape != (t,):
        raise ValueError(f"positions and slot_mapping must be [{t}]")


@declare("mla_write_latent_cache", doc="MLA: RoPE on k_pe and write [c_kv | k_pe] into the paged latent cache.")
def mla_write_latent_cache(kv_c: torch.Tensor, k_pe: torch.Tensor,
                                 positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                                 latent_cache: torch.Tensor, slot_mapping: torch.Tensor,
                                 is_neox: bool, kv_scale: Optional[torch.Tensor] = None) -> None:
    """Write ``[kv_c | rope(k_pe)]`` of each token into ``latent_cache`` at its slot (in place).

    ``kv_c [T, kv_lora_rank]``, ``k_pe [T, rope_dim]`` (or ``[T, 1, rope_dim]``), ``positions
    [T]``, ``slot_mapping [T]`` (-1 = padding, skipped). With an fp8 cache the stored values
    are ``value / kv_scale``.
    """
    _check_write(kv_c, k_pe, positions, cos_sin_cache, latent_cache, slot_mapping)
    t, rank = kv_c.shape
    rope = k_pe.shape[-1]
    keep = slot_mapping >= 0
    if not bool(keep.any()):
        return
    row = torch.cat([kv_c.float(), rope_torch(k_pe.reshape(t, rope), positions, cos_sin_cache,
                                              is_neox)], dim=-1)[keep]
    if kv_scale is not None:
        row = row / kv_scale.float().reshape(())
    if latent_cache.dtype == _FP8:
        row = row.clamp(-448.0, 448.0)
    slots = slot_mapping[keep].long()
    block_size = latent_cache.shape[1]
    latent_cache[slots // block_size, slots % block_size] = row.to(latent_cache.dtype)


mla_write_latent_cache_torch = mla_write_latent_cache.reference


def _check_decode(q_nope: torch.Tensor, q_pe: torch.Tensor, latent_cache: torch.Tensor,
                  block_table: torch.Tensor, seq_lens: torch.Tensor) -> None:
    if q_nope.dim() != 3 or q_pe.dim() != 3 or q_nope.shape[:2] != q_pe.shape[:2]:
        raise ValueError(f"q_nope [T, H, rank] and q_pe [T, H, rope] disagree: "
                         f"{tuple(q_nope.shape)} vs {tuple(q_pe.shape)}")
    if latent_cache.dim() != 3 or latent_cache.shape[2] != q_nope.shape[2] + q_pe.shape[2]:
        raise ValueError(f"latent_cache last dim must be {q_nope.shape[2] + q_pe.shape[2]}, "
                         f"got {tuple(latent_cache.shape)}")
    if seq_lens.shape != (q_nope.shape[0],) or block_table.shape[0] < q_nope.shape[0]:
        raise ValueError("one sequence per query token: seq_lens [T] and block_table [T, blocks]")


@declare("mla_decode", doc="MLA absorbed decode over the paged latent cache (split-KV in Triton).")
def mla_decode(q_nope_absorbed: torch.Tensor, q_pe: torch.Tensor,
                     latent_cache: torch.Tensor, block_table: torch.Tensor,
                     seq_lens: torch.Tensor, scale: float, *,
                     kv_scale: Optional[torch.Tensor] = None,
                     max_seq_len: Optional[int] = None,
                     out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Reference absorbed MLA decode, float32 math.

    ``q_nope_absorbed [T, H, kv_lora_rank]``, ``q_pe [T, H, rope_dim]`` -> ``[T, H,
    kv_lora_rank]`` in the query dtype (written into ``out`` when given). ``max_seq_len``
    (an upper bound of ``seq_lens``) only sizes the Triton split-KV; unused here.
    """
    _check_decode(q_nope_absorbed, q_pe, latent_cache, block_table, seq_lens)
    t, heads, rank = q_nope_absorbed.shape
    block_size = latent_cache.shape[1]
    if out is None:
        out = q_nope_absorbed.new_empty(t, heads, rank)
    ks = kv_scale.float().reshape(()) if kv_scale is not None else 1.0
    for i, seq_len in enumerate(seq_lens.tolist()):
        n_blocks = -(-seq_len // block_size)
        rows = latent_cache[block_table[i, :n_blocks].long()].reshape(-1, latent_cache.shape[2])
        rows = rows[:seq_len].float() * ks
        c_kv, k_pe = rows[:, :rank], rows[:, rank:]
        s = (q_nope_absorbed[i].float() @ c_kv.t() + q_pe[i].float() @ k_pe.t()) * scale
        out[i] = (torch.softmax(s, dim=-1) @ c_kv).to(out.dtype)
    return out


mla_decode_torch = mla_decode.reference


# -- Triton ------------------------------------------------------------------------------------


def _write_triton_supports(kv_c: torch.Tensor, k_pe: torch.Tensor, positions: torch.Tensor,
                           cos_sin_cache: torch.Tensor, latent_cache: torch.Tensor,
                           slot_mapping: torch.Tensor, is_neox: bool,
                           kv_scale: Optional[torch.Tensor] = None) -> Optional[str]:
    rope = k_pe.shape[-1]
    if rope & (rope - 1) or rope < 4:
        return f"rope_dim {rope} must be a power of two >= 4"
    if latent_cache.dtype not in (torch.float16, torch.bfloat16, torch.float32, _FP8):
        return f"latent cache dtype {latent_cache.dtype}"
    for t in (kv_c, k_pe, cos_sin_cache, latent_cache):
        if t.stride(-1) != 1:
            return "unit-stride last dims needed"
    if k_pe.dim() == 3 and k_pe.stride(1) != rope and k_pe.shape[1] != 1:
        return "k_pe must be [T, rope] or [T, 1, rope]"
    return None


@mla_write_latent_cache.triton(supports=_write_triton_supports)
def _write_triton(kv_c: torch.Tensor, k_pe: torch.Tensor, positions: torch.Tensor,
                  cos_sin_cache: torch.Tensor, latent_cache: torch.Tensor,
                  slot_mapping: torch.Tensor, is_neox: bool,
                  kv_scale: Optional[torch.Tensor] = None) -> None:
    _check_write(kv_c, k_pe, positions, cos_sin_cache, latent_cache, slot_mapping)
    from atom.ops.mla_triton import write_latent_cache_fwd

    write_latent_cache_fwd(kv_c, k_pe, positions, cos_sin_cache, latent_cache, slot_mapping,
                           is_neox, kv_scale)


def _decode_triton_supports(q_nope_absorbed: torch.Tensor, q_pe: torch.Tensor,
                            latent_cache: torch.Tensor, *args, out=None,
                            **kwargs) -> Optional[str]:
    if latent_cache.dtype != q_nope_absorbed.dtype and latent_cache.dtype != _FP8:
        return f"latent cache dtype {latent_cache.dtype} with query dtype {q_nope_absorbed.dtype}"
    for t in (q_nope_absorbed, q_pe, latent_cache, out):
        if t is not None and t.stride(-1) != 1:
            return "unit-stride last dims needed"
    return None


@mla_decode.triton(supports=_decode_triton_supports, dtypes=FLOAT_DTYPES)
def _decode_triton(q_nope_absorbed: torch.Tensor, q_pe: torch.Tensor,
                   latent_cache: torch.Tensor, block_table: torch.Tensor,
                   seq_lens: torch.Tensor, scale: float, *,
                   kv_scale: Optional[torch.Tensor] = None, max_seq_len: Optional[int] = None,
                   out: Optional[torch.Tensor] = None) -> torch.Tensor:
    _check_decode(q_nope_absorbed, q_pe, latent_cache, block_table, seq_lens)
    from atom.ops.mla_triton import mla_decode_fwd

    return mla_decode_fwd(q_nope_absorbed, q_pe, latent_cache, block_table, seq_lens, scale,
                          kv_scale=kv_scale, max_seq_len=max_seq_len, out=out)


# -- AITER (ROCm) ------------------------------------------------------------------------------


def _write_aiter_supports(kv_c: torch.Tensor, k_pe: torch.Tensor, positions: torch.Tensor,
                          cos_sin_cache: torch.Tensor, latent_cache: torch.Tensor,
                          slot_mapping: torch.Tensor, is_neox: bool,
                          kv_scale: Optional[torch.Tensor] = None) -> Optional[str]:
    if kv_scale is not None:
        return "fp8 latent caches are not covered by atom's aiter binding"
    return None


@mla_write_latent_cache.aiter(supports=_write_aiter_supports)
def _write_aiter(kv_c: torch.Tensor, k_pe: torch.Tensor, positions: torch.Tensor,
                 cos_sin_cache: torch.Tensor, latent_cache: torch.Tensor,
                 slot_mapping: torch.Tensor, is_neox: bool,
                 kv_scale: Optional[torch.Tensor] = None) -> None:
    """RoPE in torch, then aiter.concat_and_cache_mla (aiter's fused rope+write wants q too)."""
    import aiter  # noqa: deferred: ROCm only

    t = kv_c.shape[0]
    k_pe_r = rope_torch(k_pe.reshape(t, -1), positions, cos_sin_cache, is_neox).to(kv_c.dtype)
    one = torch.ones(1, dtype=torch.float32, device=kv_c.device)
    aiter.concat_and_cache_mla(kv_c, k_pe_r, latent_cache, slot_mapping, "auto", one)


def _decode_aiter_supports(q_nope_absorbed: torch.Tensor, q_pe: torch.Tensor,
                           latent_cache: torch.Tensor, *args, kv_scale=None,
                           **kwargs) -> Optional[str]:
    if kv_scale is not None or latent_cache.dtype == _FP8:
        return "fp8 latent caches are not covered by atom's aiter binding"
    return None


@mla_decode.aiter(supports=_decode_aiter_supports, dtypes=(torch.bfloat16,))
def _decode_aiter(q_nope_absorbed: torch.Tensor, q_pe: torch.Tensor,
                  latent_cache: torch.Tensor, block_table: torch.Tensor,
                  seq_lens: torch.Tensor, scale: float, *, kv_scale=None,
                  max_seq_len: Optional[int] = None,
                  out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """aiter.mla.mla_decode_fwd on the cache viewed as one-token pages.

    aiter's MLA kernels address the cache with page size 1, so the block table is expanded to
    per-token indices (``kv_indices``) with a CSR ``kv_indptr``.
    """
    from aiter.mla import mla_decode_fwd  # deferred: ROCm only

    t, heads, rank = q_nope_absorbed.shape
    block_size, width = latent_cache.shape[1:]
    dev = q_nope_absorbed.device
    lens = seq_lens.long()
    kv_indptr = torch.zeros(t + 1, dtype=torch.int32, device=dev)
    kv_indptr[1:] = torch.cumsum(lens, 0)
    seq_of = torch.repeat_interleave(torch.arange(t, device=dev), lens)
    pos = torch.arange(int(kv_indptr[-1]), device=dev) - kv_indptr[:-1].long()[seq_of]
    kv_indices = (block_table[seq_of, pos // block_size].long() * block_size
                  + pos % block_size).to(torch.int32)
    q = torch.cat([q_nope_absorbed, q_pe], dim=-1)
    if out is None:
        out = q_nope_absorbed.new_empty(t, heads, rank)
    qo_indptr = torch.arange(t + 1, dtype=torch.int32, device=dev)
    last_page = torch.ones(t, dtype=torch.int32, device=dev)
    mla_decode_fwd(q, latent_cache.view(-1, 1, 1, width), out, qo_indptr, kv_indptr, kv_indices,
                   last_page, 1, sm_scale=scale)
    return out


def warm_up_mla_decode(num_heads: int, kv_lora_rank: int, rope_dim: int, dtype: torch.dtype,
                       page: int, device: Union[torch.device, str], *, force: bool = False) -> int:
    """Compile, before the first request, the Triton variants that :func:`mla_decode` can launch
    for a layer of these shapes (see :func:`atom.ops.mla_triton.warm_up`); once per process and
    shape. Returns the launches made: 0 when the op would not run Triton on ``device`` (CPU,
    AITER, a forced backend) unless ``force`` (tests, under the Triton interpreter)."""
    device = torch.device(device)
    key = (num_heads, kv_lora_rank, rope_dim, dtype, page, str(device))
    if not mla_decode.claim_warm_up(key, device.type, force):
        return 0
    from atom.ops.mla_triton import warm_up  # lazy: Triton is optional

    return timed("mla_decode", f"{num_heads} heads, rank {kv_lora_rank} + {rope_dim}, page {page}",
                 lambda: warm_up(num_heads, kv_lora_rank, rope_dim, dtype, page, device), device)
