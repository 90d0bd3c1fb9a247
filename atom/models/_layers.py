"""Elementwise building blocks of atom's models: RMSNorm, rotary embedding, SiLU-and-mul.

Each module's forward calls atom's dispatched op (:mod:`atom.ops`: AITER, Triton, or the torch
reference, chosen per call by device and dtype). RMSNorm and SiLU-and-mul in front of block-fp8
GEMMs also quantise their output for them (:class:`Fp8Producer`, :func:`link_fp8_producers`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Optional

import torch
from torch import nn

from atom import ops
from atom.ops.fused_quant import QuantizedActivation


# -- fp8 producers --------------------------------------------------------------------------------
class Fp8Producer:
    """A module whose output may feed block-fp8 GEMMs directly: once :func:`link_fp8_producers`
    sets ``quant_group``, its kernel also writes the output's 1 x ``quant_group`` fp8
    quantisation and it returns a :class:`~atom.ops.fused_quant.QuantizedActivation` (see
    :mod:`atom.ops.fused_quant`), which atom's fp8 linears and experts read without quantising."""

    quant_group: Optional[int] = None
    quant_column_major: bool = False

    def quantise_for(self, readers: Optional[Sequence[Any]]) -> bool:
        """Write the fp8 form when every reader takes it (``fp8_input_spec()``: ``(group, dense)``),
        all with the same group; column-major scales when every reader is a dense linear (the
        layout vLLM's CUTLASS GEMM reads). Returns whether it now does."""
        specs = [getattr(r, "fp8_input_spec", lambda: None)() for r in readers or ()]
        if not specs or any(s is None for s in specs) or len({s[0] for s in specs}) != 1:
            self.quant_group, self.quant_column_major = None, False
            return False
        self.quant_group, self.quant_column_major = int(specs[0][0]), all(s[1] for s in specs)
        return True


def fp8_input_readers(block: nn.Module) -> Optional[list[Any]]:
    """The modules that read ``block``'s input as a block-fp8 GEMM operand (its
    ``fp8_input_readers()``), or None when the block does not take a quantised activation."""
    readers = getattr(block, "fp8_input_readers", None)
    return None if readers is None else readers()


def link_fp8_producers(root: nn.Module) -> int:
    """Let every producer that feeds only block-fp8 readers write the fp8 form as well
    (unless ``ATOM_DISABLE_FP8_FUSED_ACT_QUANT``; the pairs come from each module's ``fp8_producer_links()``).
    Called when a model is built: the readers' specs depend on the quantisation config, the
    weights' device and ``ATOM_FP8_W8A8_MIN_TOKENS``. Returns the producers linked."""
    from atom import envs

    enabled = not envs.ATOM_DISABLE_FP8_FUSED_ACT_QUANT
    linked = 0
    for module in root.modules():
        links = getattr(module, "fp8_producer_links", None)
        for producer, readers in links() if links is not None else ():
            linked += producer.quantise_for(readers if enabled else None)
    return linked


class RMSNorm(Fp8Producer, nn.Module):
    """RMSNorm over the last dim; with ``residual`` it first adds it (fused) and returns
    ``(normed, x + residual)``, the new residual stream. Linked to fp8 readers
    (:class:`Fp8Producer`), ``normed`` is a :class:`~atom.ops.fused_quant.QuantizedActivation`."""

    def __init__(self, hidden_size: int, eps: float, dtype: Optional[torch.dtype] = None) -> None:
        super().__init__()
        self.eps = float(eps)
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None) -> Any:
        if self.quant_group is None or x.dim() != 2:
            return ops.rms_norm(x, self.weight, self.eps, residual)
        out = ops.rms_norm_quant_fp8(x, self.weight, self.eps, residual, self.quant_group, self.quant_column_major)
        if residual is None:
            return QuantizedActivation(*out)
        return QuantizedActivation(out[0], out[2], out[3]), out[1]

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


# -- SiLU and mul ---------------------------------------------------------------------------------
class SiluAndMul(Fp8Producer, nn.Module):
    """``silu(x[..., :d]) * x[..., d:]``; linked to fp8 readers (:class:`Fp8Producer`), a
    :class:`~atom.ops.fused_quant.QuantizedActivation`."""

    def forward(self, x: torch.Tensor) -> Any:
        if self.quant_group is None or x.dim() != 2:
            return ops.silu_and_mul(x)
        return QuantizedActivation(*ops.silu_and_mul_quant_fp8(x, self.quant_group, self.quant_column_major))


# -- Rotary embedding -----------------------------------------------------------------------------
def rope_parameters(hf_config: Any, default_theta: float) -> dict[str, Any]:
    """The RoPE settings of an HF config as one dict with at least ``rope_type`` and ``rope_theta``.

    transformers >= 5 keeps them in ``config.rope_parameters`` (possibly one dict per layer type);
    older releases in ``config.rope_theta`` + ``config.rope_scaling`` (whose type key was once
    ``type``). Both spellings are accepted so one model file serves every vLLM release atom
    supports.
    """
    params = getattr(hf_config, "rope_parameters", None)
    if isinstance(params, dict) and params and all(isinstance(v, dict) for v in params.values()):
        # Per layer type ({"full_attention": {...}, "sliding_attention": {...}}): atom's dense
        # models rotate every layer alike, with the full-attention settings.
        params = params.get("full_attention") or next(iter(params.values()))
    merged: dict[str, Any] = dict(params) if isinstance(params, dict) else {}
    scaling = getattr(hf_config, "rope_scaling", None)
    if isinstance(scaling, dict):
        merged = {**scaling, **merged}
    if "rope_type" not in merged:
        merged["rope_type"] = merged.pop("type", None) or "default"
    if merged.get("rope_theta") is None:
        merged["rope_theta"] = getattr(hf_config, "rope_theta", None) or default_theta
    if "partial_rotary_factor" not in merged and getattr(hf_config, "partial_rotary_factor", None):
        merged["partial_rotary_factor"] = hf_config.partial_rotary_factor
    return merged


def _default_inv_freq(theta: float, rotary_dim: int) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature for a context ``factor`` (DeepSeek's ``yarn_get_mscale``)."""
    return 1.0 if factor <= 1.0 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn(params: dict[str, Any], rotary_dim: int, max_position: int) -> tuple[torch.Tensor, float, int]:
    """YaRN (Peng et al. 2023): low frequencies are interpolated by ``factor``, high ones kept, a
    linear ramp in between (dims bounded by beta_fast / beta_slow rotations over the original
    context); cos/sin are scaled by the attention temperature ``mscale``."""
    factor = float(params["factor"])
    theta = float(params["rope_theta"])
    original = int(params.get("original_max_position_embeddings") or max_position)
    beta_fast = float(params.get("beta_fast") or 32)
    beta_slow = float(params.get("beta_slow") or 1)

    def dim_for(rotations: float) -> float:
        # The dim index whose wavelength fits ``rotations`` times into the original context.
        return rotary_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_for(beta_fast), dim_for(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    extrapolated = _default_inv_freq(theta, rotary_dim)
    inv_freq = extrapolated / factor * ramp + extrapolated * (1 - ramp)

    if params.get("attention_factor") is not None:
        mscale = float(params["attention_factor"])
    elif params.get("mscale") and params.get("mscale_all_dim"):
        mscale = (yarn_mscale(factor, float(params["mscale"]))
                  / yarn_mscale(factor, float(params["mscale_all_dim"])))
    else:
        mscale = yarn_mscale(factor)
    return inv_freq, mscale, int(original * factor)


def _llama3(params: dict[str, Any], rotary_dim: int) -> torch.Tensor:
    """Llama 3.1's frequency-dependent interpolation: wavelengths shorter than
    ``original / high_freq_factor`` are kept, longer than ``original / low_freq_factor`` divided
    by ``factor``, a smooth blend in between (HF ``_compute_llama3_parameters``, vLLM
    ``Llama3RotaryEmbedding``)."""
    factor = float(params["factor"])
    low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
    original = float(params["original_max_position_embeddings"])
    inv_freq = _default_inv_freq(float(params["rope_theta"]), rotary_dim)
    wavelen = 2 * math.pi / inv_freq
    smooth = (original / wavelen - low) / (high - low) if high != low else torch.zeros_like(inv_freq)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    return torch.where(wavelen < original / high, inv_freq,
                       torch.where(wavelen > original / low, inv_freq / factor, blended))


def _dynamic_ntk(params: dict[str, Any], rotary_dim: int, max_position: int) -> torch.Tensor:
    """Dynamic NTK scaling as vLLM computes it (``DynamicNTKScalingRotaryEmbedding``): one static
    table whose base is raised by ``(factor * max_position / max_trained - (factor - 1)) ^
    (d / (d - 2))``. With ``max_trained_positions`` absent (every HF config) that is the default
    table. HF transformers instead rescales per forward once a sequence outgrows
    ``max_position_embeddings``; the two agree on sequences within it."""
    factor = float(params["factor"])
    trained = int(params.get("max_trained_positions") or max_position)
    base = float(params["rope_theta"]) * (
        (factor * max_position / trained) - (factor - 1)) ** (rotary_dim / (rotary_dim - 2))
    return _default_inv_freq(base, rotary_dim)


def rope_inv_freq(
    params: dict[str, Any], rotary_dim: int, max_position: int
) -> tuple[torch.Tensor, float, int]:
    """(inverse frequencies [rotary_dim/2] fp64, cos/sin magnitude, positions the config covers)."""
    rope_type = params["rope_type"]
    theta = float(params["rope_theta"])
    if rope_type == "default":
        return _default_inv_freq(theta, rotary_dim), 1.0, max_position
    if rope_type == "linear":
        factor = float(params["factor"])
        return _default_inv_freq(theta, rotary_dim) / factor, 1.0, int(max_position * factor)
    if rope_type in ("yarn", "deepseek_yarn"):  # vLLM renames DeepSeek's yarn in its config
        return _yarn(params, rotary_dim, max_position)
    if rope_type == "llama3":
        return _llama3(params, rotary_dim), 1.0, max_position
    if rope_type == "dynamic":
        return _dynamic_ntk(params, rotary_dim, max_position), 1.0, max_position
    raise NotImplementedError(
        f"atom's rotary embedding does not implement rope_type={rope_type!r} "
        "(supported: default, linear, dynamic, llama3, yarn); set ATOM_DISABLE_VLLM_PLUGIN=1 to use vLLM's model"
    )


class RotaryEmbedding(nn.Module):
    """RoPE on query and key, in place, from a precomputed ``[positions, rotary_dim]`` fp32
    ``cat(cos, sin)`` table (the layout ``atom.ops.rotary_embedding`` takes).

    One instance serves every layer of a model (the table is the same), so it is built once.
    """

    def __init__(
        self,
        head_dim: int,
        params: dict[str, Any],
        max_position: int,
        is_neox_style: bool = True,
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.rotary_dim = int(head_dim * float(params.get("partial_rotary_factor", 1.0)))
        self.is_neox_style = is_neox_style
        inv_freq, mscale, covered = rope_inv_freq(params, self.rotary_dim, max_position)
        n = max(covered, max_position)
        freqs = torch.outer(torch.arange(n, dtype=torch.float64), inv_freq)
        cache = torch.cat((freqs.cos() * mscale, freqs.sin() * mscale), dim=-1).to(torch.float32)
        # Not a parameter and not saved: derived from the config, identical on every rank.
        self.register_buffer("cos_sin_cache", cache, persistent=False)

    def forward(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate ``query`` ``[T, Hq*D]`` / ``[T, Hq, D]`` and ``key`` likewise, in place."""
        return ops.rotary_embedding(positions, query, key, self.cos_sin_cache, self.head_dim,
                                    self.rotary_dim, self.is_neox_style)

    def extra_repr(self) -> str:
        return (f"head_dim={self.head_dim}, rotary_dim={self.rotary_dim}, "
                f"positions={self.cos_sin_cache.shape[0]}, neox={self.is_neox_style}")

