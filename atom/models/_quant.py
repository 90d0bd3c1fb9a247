"""fp8 checkpoints: which layers are quantised, how their scales are laid out, and how a layer
turns its loaded fp8 weight into what its forward runs.

Read from the HF config's ``quantization_config`` (what vLLM also reads; atom needs no vLLM
object for it):

* ``{"quant_method": "fp8", "activation_scheme": "dynamic" | "static"}``: per-tensor. Each
  checkpoint matrix has ``weight`` (float8_e4m3fn) and a scalar ``weight_scale``; with static
  activations also a scalar ``input_scale``. ``w = weight * weight_scale``.
* ``... "weight_block_size": [bn, bk]``: block-scaled (Qwen3-FP8, DeepSeek-V3). ``weight_scale_inv``
  ``[ceil(N / bn), ceil(K / bk)]`` holds one multiplier per ``bn x bk`` tile (the name is
  DeepSeek's; it is not an inverse). Dynamic activations only.
* ``ignored_layers`` / ``modules_to_not_convert``: module names (``model.layers.1.mlp.down_proj``)
  that stay in the checkpoint's dtype; matched exactly, and for a fused atom module
  (``qkv_proj``) through the checkpoint names fused into it. Embedding, lm_head, norms and MoE
  routers are never quantised.

How a layer computes, decided once in ``process_weights_after_loading``:

* CUDA, per-tensor: ``torch._scaled_mm`` (fp8 x fp8 GEMM). Fused shards with different scales
  are requantised to their maximum scale (as vLLM does); activations are quantised per tensor,
  dynamically (``amax / 448``) or with the static ``input_scale`` (maximum over the shards).
* CUDA, block-scaled MoE experts: :func:`atom.ops.fused_moe` with fp8 block-scaled weights
  (activations quantised per token and group of ``bk`` channels inside the kernel).
* Everything else (CPU; block-scaled dense layers on CUDA, for which ``atom.ops`` has no
  block-scaled GEMM yet): weight-only. The fp8 weight is dequantised once, at load, to the
  activation dtype and the layer runs its unquantised path. This is what vLLM-CPU computes too
  (its ``CPUFp8BlockScaledMMKernel`` / ``CPUFp8PerTensorScaledMMLinearKernel`` are W8A16:
  activations stay bf16), so atom's CPU output is comparable to a stock vLLM-CPU run.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from atom.ops.fp8_gemm import dequant_block_fp8

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
#: Tile width along K when per-tensor scales are expressed as tile scales (Fp8Linear).
PER_TENSOR_BLOCK_K = 128

#: ``quant_method`` values atom's models load (``quantization_config`` of the HF config).
SUPPORTED_METHODS = ("fp8",)


@dataclass(frozen=True)
class Fp8Spec:
    """One fp8 checkpoint format. ``block`` None = per-tensor scales."""

    block: Optional[tuple[int, int]] = None
    static_activations: bool = False
    ignored: frozenset[str] = field(default_factory=frozenset)
    #: Load fp8, then dequantise once to the activation dtype (weight-only): for a layer whose
    #: weight is read as a plain matrix after loading (MLA's ``kv_b_proj``, which the absorbed
    #: decode splits per head). ``dataclasses.replace(spec, dequantize=True)`` per layer.
    dequantize: bool = False

    @property
    def scale_name(self) -> str:
        """The checkpoint name of a matrix's weight scale."""
        return "weight_scale" if self.block is None else "weight_scale_inv"

    def is_ignored(self, checkpoint_modules: Iterable[str]) -> bool:
        """Whether a module (given by the checkpoint module names fused into it) stays unquantised.
        A fused module must be all-ignored or all-quantised (one weight dtype)."""
        names = list(checkpoint_modules)
        hits = [n in self.ignored for n in names]
        if any(hits) and not all(hits):
            raise ValueError(f"fp8 ignored_layers lists only part of a fused module: {names}")
        return bool(names) and all(hits)


def fp8_spec(hf_config: Any) -> Optional[Fp8Spec]:
    """The fp8 format of ``hf_config.quantization_config``; None for an unquantised checkpoint.
    Raises ``NotImplementedError`` naming the method for any other quantisation."""
    quant = getattr(hf_config, "quantization_config", None)
    if not quant:
        return None
    if not isinstance(quant, dict):
        quant = quant.to_dict() if hasattr(quant, "to_dict") else dict(vars(quant))
    method = str(quant.get("quant_method", "?"))
    if method not in SUPPORTED_METHODS:
        raise NotImplementedError(
            f"atom's models do not load {method!r} checkpoints; supported quant_method: "
            f"{', '.join(SUPPORTED_METHODS)} (per-tensor or weight_block_size block-scaled)")
    fmt = quant.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise NotImplementedError(f"atom's fp8 layers load float8_e4m3fn weights, not fmt={fmt!r}")
    scheme = quant.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        raise ValueError(f"fp8 activation_scheme {scheme!r}: expected 'dynamic' or 'static'")
    block = quant.get("weight_block_size")
    if block is not None:
        if len(block) != 2:
            raise ValueError(f"fp8 weight_block_size must be [block_n, block_k], got {block}")
        if scheme != "dynamic":
            raise ValueError("block-scaled fp8 needs activation_scheme='dynamic'")
    ignored = quant.get("ignored_layers") or quant.get("modules_to_not_convert") or []
    return Fp8Spec(block=None if block is None else (int(block[0]), int(block[1])),
                   static_activations=scheme == "static", ignored=frozenset(ignored))


def layer_spec(spec: Optional[Fp8Spec], prefix: str, checkpoint_names: Iterable[str]) -> Optional[Fp8Spec]:
    """``spec`` for a layer whose checkpoint modules are ``prefix.<name>``; None if unquantised."""
    if spec is None:
        return None
    full = [f"{prefix}.{n}" if prefix else n for n in checkpoint_names]
    return None if spec.is_ignored(full) else spec


#: fp8 ``[..., N, K]`` with per-tile ``scale [..., ceil(N/bn), ceil(K/bk)]`` -> float32.
dequant_block = dequant_block_fp8


def fp8_w8a8_from(device: torch.device) -> Optional[int]:
    """Batch size (tokens) from which block-fp8 linears on ``device`` quantise activations and run
    the fp8 x fp8 GEMM (``ATOM_FP8_W8A8_MIN_TOKENS``; 0 = never, always W8A16). Unset, on a CPU:
    never (the torch reference gains nothing from it; vLLM-CPU's own kernel is W8A16 too)."""
    from atom import envs

    if device.type == "cpu" and not envs.is_set("ATOM_FP8_W8A8_MIN_TOKENS"):
        return None
    n = envs.ATOM_FP8_W8A8_MIN_TOKENS
    return n or None


def quantize_per_tensor(x: torch.Tensor, scale: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` -> (fp8, float32 scalar scale): ``scale`` given (static) or ``amax / 448`` (dynamic)."""
    if scale is None:
        scale = x.abs().amax().float().clamp(min=1e-12) / FP8_MAX
    q = (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale.reshape(()).float()


def scaled_mm_usable(weight: torch.Tensor) -> bool:
    """``torch._scaled_mm`` runs here: a CUDA device with fp8 GEMMs (sm89+) and dims that are
    multiples of 16."""
    if weight.device.type != "cuda" or not hasattr(torch, "_scaled_mm"):
        return False
    if torch.cuda.get_device_capability(weight.device) < (8, 9):
        return False
    n, k = weight.shape
    return n % 16 == 0 and k % 16 == 0
