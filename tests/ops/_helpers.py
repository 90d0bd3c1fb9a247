"""Shared helpers for the ops tests: devices, tolerances, poisoning, paged-cache builders."""

from __future__ import annotations

import torch

#: Small cases run on the GPU when there is one, else on CPU under the Triton interpreter.
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

#: (dtype, atol, rtol). bf16 allows ~2 ulps: the Triton interpreter rounds fp32 -> bf16 by
#: truncation (GPUs round to nearest even), and references round at different points.
FP32 = (torch.float32, 2e-5, 2e-5)
BF16 = (torch.bfloat16, 3e-2, 2e-2)
FP16 = (torch.float16, 4e-3, 4e-3)
DTYPE_TOLS = [FP32, BF16, FP16]
DTYPE_IDS = ["fp32", "bf16", "fp16"]

FP8 = torch.float8_e4m3fn


def poison_(t: torch.Tensor) -> torch.Tensor:
    """Fill ``t`` with NaN (fp8: its NaN byte 0x7F) so any element a kernel skips shows up."""
    if t.dtype == FP8:
        t.view(torch.uint8).fill_(0x7F)
    elif t.is_floating_point():
        t.fill_(float("nan"))
    else:
        t.fill_(-12345)
    return t


def garbage_(t: torch.Tensor) -> torch.Tensor:
    """Fill ``t`` with random finite values (fp8: random non-NaN bytes): a used-looking cache."""
    if t.dtype == FP8:
        b = torch.randint(0, 0x7F, t.shape, dtype=torch.uint8, device=t.device)
        sign = torch.randint(0, 2, t.shape, dtype=torch.uint8, device=t.device) << 7
        t.view(torch.uint8).copy_(b | sign)
    else:
        t.copy_(torch.randn(t.shape, device=t.device) * 3)
    return t


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit equality (NaN-safe, dtype-agnostic)."""
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def assert_close(actual: torch.Tensor, expected: torch.Tensor, atol: float, rtol: float) -> None:
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=rtol, equal_nan=False)


def assert_fp8_close(actual: torch.Tensor, expected: torch.Tensor, max_mismatch: float = 0.05,
                     atol: float = 2.0**-9) -> None:
    """fp8 values agree to within one e4m3 step, no NaN anywhere, and at most ``max_mismatch``
    of them differ at all. ``atol`` (in quantised units) covers inputs that differ by the
    source dtype's rounding, e.g. ``source_atol / scale``."""
    assert actual.dtype == FP8 and expected.dtype == FP8
    a, e = actual.float(), expected.float()
    assert not torch.isnan(a).any(), "fp8 output has NaN (unwritten or overflow)"
    torch.testing.assert_close(a, e, atol=atol, rtol=0.126)
    frac = (a != e).float().mean().item() if a.numel() else 0.0
    assert frac <= max_mismatch, f"{frac:.3%} of fp8 values differ"


def rows_view(t: int, width: int, pad: int, dtype: torch.dtype) -> torch.Tensor:
    """A ``[t, width]`` row-strided view (row stride ``width + pad``) of a poisoned buffer."""
    base = poison_(torch.empty(t, width + pad, dtype=dtype, device=DEVICE))
    view = base[:, :width]
    view.copy_(torch.randn(t, width, device=DEVICE))
    return view


def make_cos_sin_cache(max_pos: int, rotary_dim: int, dtype: torch.dtype = torch.float32,
                       base: float = 10000.0) -> torch.Tensor:
    """vLLM-convention cache ``[max_pos, rotary_dim] = cat(cos, sin)`` from standard RoPE freqs."""
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
    freqs = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(dtype).to(DEVICE)


def make_kv_cache(num_blocks: int, block_size: int, heads: int, head_size: int,
                  dtype: torch.dtype, layout: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(kv, key_cache, value_cache)`` filled with garbage; caches are ``[nb, bs, H, D]`` views.

    layout ``"nhd"``: ``kv = [2, nb, bs, H, D]`` contiguous, caches ``kv[0]``, ``kv[1]``;
    ``"hnd"``: physically ``[2, nb, H, bs, D]``, exposed permuted (non-contiguous caches);
    ``"blocks_outer"``: physically ``[nb, 2, bs, H, D]`` (caches strided by block).
    """
    if layout == "nhd":
        kv = torch.empty(2, num_blocks, block_size, heads, head_size, dtype=dtype, device=DEVICE)
        garbage_(kv)
        return kv, kv[0], kv[1]
    if layout == "hnd":
        phys = torch.empty(2, num_blocks, heads, block_size, head_size, dtype=dtype, device=DEVICE)
        garbage_(phys)
        kv = phys.permute(0, 1, 3, 2, 4)
        return phys, kv[0], kv[1]
    if layout == "blocks_outer":
        phys = torch.empty(num_blocks, 2, block_size, heads, head_size, dtype=dtype, device=DEVICE)
        garbage_(phys)
        return phys, phys[:, 0], phys[:, 1]
    raise ValueError(layout)


def make_slot_mapping(num_tokens: int, num_blocks: int, block_size: int, num_pad: int = 0,
                      dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """Distinct slots for ``num_tokens`` tokens laid out like a batch of sequences with shuffled
    block tables (each sequence fills its blocks in order, sequences may start mid-block, some
    slots are left unused), with ``num_pad`` tokens replaced by -1 padding at random positions."""
    real = num_tokens - num_pad
    capacity = num_blocks * block_size
    assert real <= capacity
    # Physical blocks in shuffled order, each filled front to back.
    order = [b * block_size + o for b in torch.randperm(num_blocks).tolist() for o in range(block_size)]
    slots: list[int] = []
    cursor = 0
    spare = capacity - real
    while len(slots) < real:
        gap = int(torch.randint(0, min(spare, block_size) + 1, ()).item())  # unused slots
        spare -= gap
        cursor += gap
        seq_len = min(real - len(slots), int(torch.randint(1, 2 * block_size + 2, ()).item()))
        slots += order[cursor: cursor + seq_len]
        cursor += seq_len
    out = torch.tensor(slots, dtype=torch.int64)
    if num_pad:
        mask = torch.zeros(num_tokens, dtype=torch.bool)
        mask[torch.randperm(num_tokens)[:num_pad]] = True
        full = torch.full((num_tokens,), -1, dtype=torch.int64)
        full[~mask] = out
        out = full
    return out.to(dtype).to(DEVICE)


def written_mask(slot_mapping: torch.Tensor, num_blocks: int, block_size: int) -> torch.Tensor:
    """``[nb, bs]`` bool: the cache rows a slot mapping writes."""
    mask = torch.zeros(num_blocks * block_size, dtype=torch.bool, device=slot_mapping.device)
    valid = slot_mapping[slot_mapping >= 0].long()
    mask[valid] = True
    return mask.view(num_blocks, block_size)


def fp8_scale(value: float) -> torch.Tensor:
    return torch.tensor([value], dtype=torch.float32, device=DEVICE)
