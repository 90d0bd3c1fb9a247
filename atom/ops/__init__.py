"""atom's kernels. Each op: declared once by its plain-torch reference, with a Triton kernel and
an AITER binding (ROCm) registered against it, and one dispatcher (:mod:`atom.ops._dispatch`).
Kernel modules are named ``<op module>_triton.py``. Never imports vLLM."""

from atom.ops._dispatch import BACKENDS, OPS, BackendUnavailable, Op, declare, register

__all__ = ["BACKENDS", "OPS", "BackendUnavailable", "Op", "declare", "register"]

# Memory-bound ops (norm, RoPE, KV-cache write, fused QK-norm+RoPE+cache, activation, fp8 quant).
from atom.ops.rmsnorm import rms_norm  # noqa: E402
from atom.ops.rotary import rotary_embedding  # noqa: E402
from atom.ops.kv_cache import reshape_and_cache  # noqa: E402
from atom.ops.fused_qk_norm_rope_cache import fused_qk_norm_rope_cache, split_qkv  # noqa: E402
from atom.ops.activation import silu_and_mul  # noqa: E402
from atom.ops.quant import per_block_quant_fp8, per_token_quant_fp8  # noqa: E402
from atom.ops.fused_quant import rms_norm_quant_fp8, silu_and_mul_quant_fp8  # noqa: E402

__all__ += [
    "rms_norm",
    "rotary_embedding",
    "reshape_and_cache",
    "fused_qk_norm_rope_cache",
    "split_qkv",
    "silu_and_mul",
    "per_token_quant_fp8",
    "per_block_quant_fp8",
    "rms_norm_quant_fp8",
    "silu_and_mul_quant_fp8",
]

# Compute ops (paged attention, MLA, fused MoE): importing the modules registers them in OPS.
# They import only torch; their Triton kernels load on the first Triton call.
from atom.ops import attention, fp8_gemm, mla, moe, moe_routing  # noqa: E402,F401
from atom.ops.attention import paged_attention, warm_up_paged_attention  # noqa: E402
from atom.ops.mla import mla_decode, mla_write_latent_cache, warm_up_mla_decode  # noqa: E402
from atom.ops.fp8_gemm import fp8_block_gemm, warm_up_fp8_block_gemm  # noqa: E402
from atom.ops.linear import linear, warm_up_linear  # noqa: E402
from atom.ops.moe import fused_moe, warm_up_fused_moe  # noqa: E402
from atom.ops.moe_routing import grouped_topk_sigmoid, topk_softmax  # noqa: E402

__all__ += ["paged_attention", "mla_decode", "mla_write_latent_cache", "fused_moe",
            "grouped_topk_sigmoid", "topk_softmax", "warm_up_paged_attention", "warm_up_fused_moe",
            "fp8_block_gemm", "warm_up_fp8_block_gemm", "linear", "warm_up_linear",
            "warm_up_mla_decode"]

# While torch.compile traces, the ops above become torch.ops.atom.* custom-op nodes (importing
# the module registers each op's graph form).
from atom.ops import _graph  # noqa: E402,F401
