"""Elementwise building blocks of atom's models: RMSNorm, rotary embedding, SiLU-and-mul.

Each module's forward calls atom's dispatched op (:mod:`atom.ops`: torch reference, Triton,
AITER) when this installation has it, and otherwise an equivalent torch computation defined
here. The op is looked up by name in atom's op registry, so a newly added op is picked up with no
change to the models; the torch fallbacks follow the ops' documented semantics exactly (fp32
math, one rounding to the input dtype).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import math
from typing import Any, Callable, Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

#: op name -> the atom.ops module that declares it (importing it registers the op).
OP_MODULES: dict[str, str] = {
    "rms_norm": "atom.ops.rmsnorm",
    "rotary_embedding": "atom.ops.rotary",
    "silu_and_mul": "atom.ops.activation",
}


@functools.lru_cache(maxsize=None)
def atom_op(name: str) -> Optional[Callable[..., Any]]:
    """atom's dispatched op ``name``, or None when this installation does not have it.

    Cached per process: whether a module exists does not change while the process runs (which
    backend the op picks is still decided per call by the dispatcher).
    """
    module = OP_MODULES.get(name)
    if module is None or importlib.util.find_spec(module) is None:
        return None
    importlib.import_module(module)
    from atom.ops import OPS

    return OPS.get(name)


# -- RMSNorm --------------------------------------------------------------------------------------
def rms_norm_torch(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: Optional[torch.Tensor] = None
) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """``atom.ops.rms_norm`` semantics in plain torch (the fallback when the op is absent)."""
    xf = x.float()
    new_residual = None
    if residual is not None:
        new_residual = (xf + residual.float()).to(x.dtype)
        xf = new_residual.float()
    y = (xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps) * weight.float()).to(x.dtype)
    return y if new_residual is None else (y, new_residual)


class RMSNorm(nn.Module):
    """RMSNorm over the last dim; with ``residual`` it first adds it (fused) and returns
    ``(normed, x + residual)``, the new residual stream."""

    def __init__(self, hidden_size: int, eps: float, dtype: Optional[torch.dtype] = None) -> None:
        super().__init__()
        self.eps = float(eps)
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)

    def forward(
        self, x: torch.Tensor, residual: Optional[torch.Tensor] = None
    ) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        op = atom_op("rms_norm")
        if op is not None:
            return op(x, self.weight, self.eps, residual)
        return rms_norm_torch(x, self.weight, self.eps, residual)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


# -- SiLU and mul ---------------------------------------------------------------------------------
def silu_and_mul_torch(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :d]) * x[..., d:]`` for ``x`` ``[..., 2d]`` (SwiGLU after a fused gate_up)."""
    d = x.shape[-1] // 2
    return (F.silu(x[..., :d].float()) * x[..., d:].float()).to(x.dtype)


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        op = atom_op("silu_and_mul")
        if op is not None:
            return op(x)
        return silu_and_mul_torch(x)


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


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
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
        mscale = (_yarn_mscale(factor, float(params["mscale"]))
                  / _yarn_mscale(factor, float(params["mscale_all_dim"])))
    else:
        mscale = _yarn_mscale(factor)
    return inv_freq, mscale, int(original * factor)


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
    if rope_type == "yarn":
        return _yarn(params, rotary_dim, max_position)
    raise NotImplementedError(
        f"atom's rotary embedding does not implement rope_type={rope_type!r} "
        "(supported: default, linear, yarn); set ATOM_DISABLE_VLLM_PLUGIN=1 to use vLLM's model"
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
        cache, dim, neox = self.cos_sin_cache, self.rotary_dim, self.is_neox_style
        op = atom_op("rotary_embedding")
        if op is not None:
            return op(positions, query, key, cache, self.head_dim, dim, neox)
        t = positions.shape[0]
        _rope_torch_(positions, query.view(t, -1, self.head_dim), cache, dim, neox)
        _rope_torch_(positions, key.view(t, -1, self.head_dim), cache, dim, neox)
        return query, key

    def extra_repr(self) -> str:
        return (f"head_dim={self.head_dim}, rotary_dim={self.rotary_dim}, "
                f"positions={self.cos_sin_cache.shape[0]}, neox={self.is_neox_style}")


def _rope_torch_(
    positions: torch.Tensor, x: torch.Tensor, cos_sin_cache: torch.Tensor, rotary_dim: int, is_neox: bool
) -> None:
    """Rotate the first ``rotary_dim`` dims of each head of ``x`` ``[T, H, D]`` in place (fp32)."""
    half = rotary_dim // 2
    cos, sin = cos_sin_cache.index_select(0, positions.long()).split(half, dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    rot = x[..., :rotary_dim].float()
    if is_neox:
        x1, x2 = rot[..., :half], rot[..., half:]
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    else:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    x[..., :rotary_dim] = out.to(x.dtype)
