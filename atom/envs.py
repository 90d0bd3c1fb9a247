"""Every ATOM_* environment variable, declared once.

Each variable is an :class:`EnvVar` record (name, type, default, one-line doc). Values are read
from ``os.environ`` every time they are accessed -- never frozen into module globals -- and parsed
strictly: a value outside the accepted set raises :class:`EnvError`, whose message names the
variable and the accepted values.

Access::

    from atom import envs
    if envs.ATOM_DISABLE_VLLM_PLUGIN: ...      # parsed value, read now
    envs.get("ATOM_DISABLED_PATCHES")           # the same, by name
    envs.VARIABLES                              # the declarations (docs/env_vars.md is made from them)

Precedence where a caller also takes an explicit argument: argument > environment > default.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Any, Callable

__all__ = ["EnvError", "EnvVar", "VARIABLES", "get", "is_set", "raw", "set_values", "OPS_BACKENDS",
           "COMPILE_ELEMENTWISE", "FP8_HOST_GEMMS", "FP8_HOST_GEMMS_SMALL", "MLA_HOST_DECODES"]


class EnvError(ValueError):
    """A malformed ATOM_* value. The message names the variable and what it accepts."""


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")

#: vLLM's block-fp8 GEMMs atom's linears can hand larger batches to (see ATOM_FP8_HOST_GEMM).
FP8_HOST_GEMMS = ("auto", "deepgemm", "cutlass")

#: Kernels for atom's block-fp8 linears' small batches (see ATOM_FP8_HOST_GEMM_SMALL).
FP8_HOST_GEMMS_SMALL = ("auto", "flashinfer", "atom")

#: Decode kernels atom's MLA backend can run its decode rows on (see ATOM_MLA_HOST_DECODE).
MLA_HOST_DECODES = ("auto", "flashmla", "atom")

#: Kernels atom's MHA backend can run its steps with multi-token rows on (see ATOM_MHA_HOST_PREFILL).
MHA_HOST_PREFILLS = ("atom", "flash_attn", "auto")

#: Kernel backends an op can be forced onto (see ATOM_OPS_BACKEND).
OPS_BACKENDS = ("auto", "aiter", "triton", "torch")


def _parse_bool(name: str, raw: str) -> bool:
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise EnvError(
        f"{name}={raw!r} is not a valid value; accepted values: "
        f"{', '.join(_FALSE[:2] + _TRUE[:2])} (also yes/no, on/off)"
    )


def _split_list(raw: str) -> tuple[str, ...]:
    """The non-empty entries of a comma-separated value, stripped."""
    return tuple(part.strip() for part in raw.split(",") if part.strip())


def _parse_id_list(name: str, raw: str) -> tuple[str, ...]:
    items = _split_list(raw)
    for item in items:
        if item != "*" and not all(c.isalnum() or c in "._-" for c in item):
            raise EnvError(
                f"{name}={raw!r}: {item!r} is not a valid entry; accepted values: a comma-separated "
                "list of patch ids (letters, digits, '.', '_', '-') or '*' for all"
            )
    return items


def _parse_arch_list(name: str, raw: str) -> tuple[str, ...]:
    """Architectures of atom's table (``atom.plugin.models``: strings only, no host import), or '*'."""
    from atom.plugin.models import BY_ARCH

    items = _split_list(raw)
    unknown = [item for item in items if item != "*" and item not in BY_ARCH]
    if unknown:
        raise EnvError(f"{name}={raw!r}: {', '.join(map(repr, unknown))} not atom's; accepted values: a "
                       f"comma-separated list of {', '.join(sorted(BY_ARCH))}, or '*' for all")
    return items


def _parse_ops_backend(name: str, raw: str) -> dict[str, str]:
    """``auto`` | ``triton`` | ... for every op, or ``op=backend,op=backend`` per op.

    Returns a mapping from op name (``"*"`` for the global choice) to backend.
    """
    result: dict[str, str] = {}
    for part in (p.strip() for p in raw.split(",")):
        if not part:
            continue
        op, sep, backend = part.partition("=")
        if not sep:
            op, backend = "*", op
        op, backend = op.strip(), backend.strip().lower()
        if backend not in OPS_BACKENDS or not op:
            raise EnvError(
                f"{name}={raw!r}: {part!r} is not valid; accepted values: one of "
                f"{', '.join(OPS_BACKENDS)}, or a comma list of op=backend "
                "(e.g. rms_norm=torch,rotary_embedding=triton)"
            )
        result[op] = backend
    return result


def _parse_auto_or_nonneg_int(name: str, raw: str) -> "int | None":
    """``auto`` -> None (the caller's per-case default), else an integer >= 0."""
    if raw.strip().lower() == "auto":
        return None
    try:
        return _parse_nonneg_int(name, raw)
    except EnvError:
        raise EnvError(f"{name}={raw!r} is not a valid value; accepted values: auto, or an integer >= 0") from None


def _parse_nonneg_int(name: str, raw: str) -> int:
    try:
        value = int(raw.strip())
    except ValueError:
        value = -1
    if value < 0:
        raise EnvError(f"{name}={raw!r} is not a valid value; accepted values: an integer >= 0")
    return value


_TILE_ACCEPTED = ("auto, or BLOCK_H,BLOCK_N,num_warps,num_stages: BLOCK_H and BLOCK_N powers of two "
                  "in 16..128, num_warps one of 1, 2, 4, 8, 16, num_stages 1..6")


def _parse_tile(name: str, raw: str) -> "tuple[int, int, int, int] | None":
    value = raw.strip().lower()
    if value == "auto":
        return None
    try:
        h, n, w, st = (int(x) for x in value.split(","))
    except ValueError:
        h = n = w = st = -1
    pow2 = (16, 32, 64, 128)
    if h not in pow2 or n not in pow2 or w not in (1, 2, 4, 8, 16) or not 1 <= st <= 6:
        raise EnvError(f"{name}={raw!r} is not a valid value; accepted values: {_TILE_ACCEPTED}")
    return h, n, w, st


def _choice(*choices: str) -> Callable[[str, str], str]:
    """A parser accepting exactly one of ``choices`` (case-insensitive)."""

    def parse(name: str, raw: str) -> str:
        value = raw.strip().lower()
        if value not in choices:
            raise EnvError(f"{name}={raw!r} is not a valid value; accepted values: {', '.join(choices)}")
        return value

    return parse


#: What atom's elementwise ops become while vLLM torch.compiles atom's models
#: (see ATOM_COMPILE_ELEMENTWISE).
COMPILE_ELEMENTWISE = ("inductor", "kernels")


@dataclass(frozen=True)
class EnvVar:
    """One environment variable: its name, type, default (as the raw string) and doc."""

    name: str
    type: str  # human-readable type, shown in docs
    default: str
    doc: str
    parse: Callable[[str, str], Any]
    accepted: str  # human-readable accepted values, shown in docs

    def read(self, environ: "os._Environ[str] | dict[str, str] | None" = None) -> Any:
        env = os.environ if environ is None else environ
        raw = env.get(self.name)
        if raw is None or raw.strip() == "":
            raw = self.default
        return _parsed(self, raw)


@functools.lru_cache(maxsize=256)
def _parsed(var: EnvVar, raw: str) -> Any:
    # The environment is read on every access (never frozen); only the parse of a given raw
    # string is memoised, because some variables (ATOM_OPS_BACKEND) are consulted per op call.
    # Parsed values are treated as read-only (tuples, and dicts nobody mutates).
    return var.parse(var.name, raw)


_BOOL = "0, 1, true, false, yes, no, on, off"

VARIABLES: dict[str, EnvVar] = {
    v.name: v
    for v in (
        EnvVar(
            "ATOM_DISABLE_VLLM_PLUGIN", "bool", "0",
            "Disable atom entirely (platform, model overrides, patches): vLLM runs as if atom "
            "were not installed.",
            _parse_bool, _BOOL,
        ),
        EnvVar(
            "ATOM_DISABLE_VLLM_PLUGIN_ATTENTION", "bool", "0",
            "Keep atom's platform and models but use the attention backend the parent vLLM "
            "platform would choose.",
            _parse_bool, _BOOL,
        ),
        EnvVar(
            "ATOM_DISABLE_SGLANG_PLUGIN", "bool", "0",
            "Disable atom under SGLang (model overrides, the `atom` attention backend, SGLang "
            "records): SGLang runs as if atom were not installed. vLLM is governed by "
            "ATOM_DISABLE_VLLM_PLUGIN alone (one switch per host, so an environment with both "
            "can keep atom in one).",
            _parse_bool, _BOOL,
        ),
        EnvVar(
            "ATOM_DISABLE_SGLANG_PLUGIN_ATTENTION", "bool", "0",
            "Keep atom's models under SGLang but serve `--attention-backend atom` with SGLang's "
            "own backend instead (triton on GPUs, torch_native on CPU).",
            _parse_bool, _BOOL,
        ),
        EnvVar(
            "ATOM_ENABLE_QK_NORM_ROPE_CACHE_QUANT_FUSION", "bool", "0",
            "Fuse QK-RMSNorm + RoPE + KV-cache write (+ fp8 quantisation) into one kernel in "
            "atom's attention impl, for atom's Qwen3 / Qwen3-MoE models on atom's MHA backend "
            "(vLLM's platform choice, on NVIDIA GPUs with ATOM_ENABLE_MHA_ON_NVIDIA=1; or SGLang's "
            "`--attention-backend atom`); no effect with the "
            "host's own attention backends or model classes.",
            _parse_bool, _BOOL,
        ),
        EnvVar(
            "ATOM_DISABLED_PATCHES", "list of patch ids", "",
            "Comma-separated ids of patches/injections to skip ('*' = all); `python -m atom "
            "patches` lists the ids.",
            _parse_id_list, "comma list of patch ids, or *",
        ),
        EnvVar(
            "ATOM_ENABLE_ON_CPU", "bool", "0",
            "On CPU atom has no fast path (its kernels there are the torch reference, slower than "
            "vLLM-CPU's own), so its model overrides and attention backend stay off unless this is "
            "set (atom's tests and the README's main job set it). No effect on GPUs.",
            _parse_bool, _BOOL,
        ),
        EnvVar(
            "ATOM_ALLOW_UNSUPPORTED_VLLM", "bool", "0",
            "Activate atom even when the installed vLLM is outside the supported range "
            "(untested; patches keep their own version guards).",
            _parse_bool, _BOOL,
        ),
        EnvVar(
            "ATOM_OPS_BACKEND", "backend or op=backend list", "auto",
            "Force the kernel backend of atom's ops: one of auto/aiter/triton/torch for all ops, "
            "or per op as op=backend pairs.",
            _parse_ops_backend, "auto, aiter, triton, torch, or op=backend,...",
        ),
        EnvVar(
            "ATOM_TRITON_DIRECT_LAUNCH", "bool", "0",
            "Launch the compiled Triton kernels of atom's eager attention (paged prefill/decode, "
            "split-KV reduce, KV-cache write) directly, keyed by what decides their compiled "
            "variant, instead of through Triton's launcher on every call: less host time per "
            "layer in steps that run attention outside CUDA graphs (mixed prefill + decode). "
            "Falls back to normal launches, with one warning, where Triton's API differs. No "
            "effect under TRITON_INTERPRET=1.",
            _parse_bool, _BOOL,
        ),
        EnvVar(
            "ATOM_DISABLE_TORCH_COMPILE", "bool", "0",
            "Run atom's models under vLLM without torch.compile (CUDA graphs only), as vLLM runs "
            "a model that lacks its support_torch_compile decorator; for A/B measurements and as "
            "an escape hatch if Dynamo cannot trace a model.",
            _parse_bool, _BOOL,
        ),
        EnvVar(
            "ATOM_COMPILE_ELEMENTWISE", "choice", "inductor",
            "While vLLM torch.compiles atom's models: `inductor` traces atom's elementwise ops "
            "(RMSNorm with/without residual add, RoPE, SiLU-and-mul) as plain torch so Inductor "
            "fuses them with neighbouring ops, as vLLM's own models are compiled; `kernels` keeps "
            "each as one opaque atom-kernel node (`torch.ops.atom.*`). No effect without "
            "torch.compile (eager / CUDA-graph-only runs always use atom's kernels); MoE routing "
            "and experts and attention are unaffected.",
            _choice(*COMPILE_ELEMENTWISE), ", ".join(COMPILE_ELEMENTWISE),
        ),
        EnvVar(
            "ATOM_FP8_W8A8_MIN_TOKENS", "int", "17",
            "Block-scaled fp8 linears (weights stay fp8) on GPUs: from this many tokens per step, "
            "quantise activations per token and 128-channel group and run the fp8 x fp8 GEMM (W8A8, "
            "vLLM's block-fp8 GEMM from ATOM_FP8_HOST_GEMM_MIN_TOKENS); below, keep activations in "
            "bf16 (W8A16: the dequantised layer's numbers, half the weight bytes), except the 2-16 "
            "token batches ATOM_FP8_HOST_GEMM_SMALL hands to FlashInfer's kernel (which quantises "
            "them, as stock's does); when 0, W8A16 always and no vLLM GEMM is called. On CPU W8A16 "
            "always unless this is set.",
            _parse_nonneg_int, "an integer >= 0",
        ),
        EnvVar(
            "ATOM_DISABLE_FP8_FUSED_ACT_QUANT", "bool", "0",
            "Block-scaled fp8 models with W8A8 enabled (GPUs, or ATOM_FP8_W8A8_MIN_TOKENS set): by "
            "default the RMSNorm (with its residual add) and SiLU-and-mul kernels in front of an fp8 "
            "linear or fp8 experts also write their output's per-token-group fp8 quantisation, so no "
            "separate quantisation kernel runs before the GEMM; 1 = quantise inside each GEMM call "
            "instead.",
            _parse_bool, _BOOL,
        ),
        EnvVar(
            "ATOM_FUSE_SHARED_EXPERTS", "bool", "1",
            "MoE models with shared experts (DeepSeek-V3 / Kimi-K2, DeepSeek-V2-Lite, GLM-4-MoE) under "
            "tensor parallelism: the shared experts are held as extra experts of the fused MoE, each "
            "token routed to them with weight 1, so one set of expert kernels computes both (no separate "
            "shared MLP, activation and add per layer). 0 = a separate shared MLP. Not under expert "
            "parallelism, nor when ignored_layers quantises the shared and routed experts differently.",
            _parse_bool, _BOOL,
        ),
        EnvVar(
            "ATOM_FUSE_SHARED_EXPERTS_MAX_TOKENS", "auto or int", "auto",
            "With ATOM_FUSE_SHARED_EXPERTS on: batches of at most this many tokens run the shared "
            "experts inside the fused MoE; larger ones run the routed experts there and the shared ones "
            "as a dense MLP (fp8: the block-fp8 GEMMs, vLLM's DeepGEMM where it serves), chosen per step "
            "inside the compiled graph; 0 = the fused MoE at every size; auto = 128 for experts of at most "
            "512 intermediate rows per GPU (DeepSeek-V3 at TP 8: 256), 1 for larger ones (whole "
            "DeepSeek-V3 experts: 2048), the sizes where the fused form measured faster on the H100 "
            "(bench/NOTES.md 88).",
            _parse_auto_or_nonneg_int, "auto, or an integer >= 0",
        ),
        EnvVar(
            "ATOM_BF16_GEMV", "bool", "1",
            "Unquantised (bf16 / fp16) linears of atom's models on NVIDIA GPUs: a step of one token "
            "runs atom's Triton GEMV instead of cuBLAS (0.73-0.93x cuBLAS's time per layer at Qwen3 / "
            "DeepSeek-V3 shapes on the H100; batch-1 output tok/s 1.07x at Qwen3-8B dims, 36 layers, on "
            "the H200; docs/performance.md), compiled at load; batches of two or more tokens stay on "
            "cuBLAS. 0 = cuBLAS for every step. On a CPU or ROCm only when set to 1. The output head "
            "is not included.",
            _parse_bool, _BOOL,
        ),
        EnvVar(
            "ATOM_ENABLE_MHA_ON_NVIDIA", "bool", "0",
            "Serve MHA attention layers with atom's MHA backend under vLLM on NVIDIA GPUs. Off by "
            "default: there atom steps aside and vLLM's own attention backend (FlashAttention) serves "
            "them, atom's models included, because atom's backend measured slower (0.71x stock in the "
            "online-serving cell on an H200, docs/performance.md). `--attention-backend CUSTOM` also "
            "selects it. MLA layers, CPU, ROCm and SGLang are unaffected.",
            _parse_bool, _BOOL,
        ),
        EnvVar(
            "ATOM_ENABLE_FP8_BLOCK_ON_NVIDIA", "bool", "0",
            "Serve 128x128 block-fp8 checkpoints of dense architectures (Qwen3-FP8, Llama) and of "
            "Qwen3-MoE (Qwen3-30B-A3B-FP8, Qwen3-235B-A22B-FP8) with atom's models on NVIDIA GPUs. Off by "
            "default: there atom steps aside and vLLM's own model serves them, because atom's fp8 path "
            "measured no faster than vLLM's (dense: vLLM's DeepGEMM from 17 tokens, a tie; Qwen3-MoE: a tie "
            "at one sequence at full depth; docs/performance.md). DeepSeek-V3 / Kimi-K2 fp8 is atom's "
            "either way; no effect on CPU, ROCm or per-tensor fp8.",
            _parse_bool, _BOOL,
        ),
        EnvVar(
            "ATOM_ENABLE_ON_NVIDIA", "list of architectures", "",
            "Architectures (HF names, e.g. Qwen3ForCausalLM; * for all) that atom's models serve on "
            "NVIDIA GPUs although atom steps aside for them there by default, because atom measured "
            "slower than vLLM's own model (docs/supported_models.md says which and why: Qwen3ForCausalLM).",
            _parse_arch_list, "comma list of atom's architecture names, or *",
        ),
        EnvVar(
            "ATOM_FP8_HOST_GEMM", "choice", "auto",
            "Block-scaled fp8 linears under vLLM on NVIDIA GPUs: which of vLLM's own block-fp8 GEMMs "
            "atom calls for larger batches (from ATOM_FP8_HOST_GEMM_MIN_TOKENS tokens per step): "
            "`deepgemm` (vLLM's DeepGEMM `fp8_gemm_nt`, on the checkpoint's own scales), `cutlass` "
            "(vLLM's `cutlass_scaled_mm`), `auto` = DeepGEMM where vLLM says it runs on a Hopper GPU "
            "(`deep_gemm` installed, VLLM_USE_DEEP_GEMM not 0), else CUTLASS (also on Blackwell, "
            "whose DeepGEMM kernel needs E8M0 scales).",
            _choice(*FP8_HOST_GEMMS), ", ".join(FP8_HOST_GEMMS),
        ),
        EnvVar(
            "ATOM_FP8_HOST_GEMM_MIN_TOKENS", "auto or int", "auto",
            "Block-scaled fp8 linears under vLLM on NVIDIA GPUs: from this many tokens per step, call "
            "vLLM's block-fp8 GEMM (ATOM_FP8_HOST_GEMM; 128x128 blocks) instead of atom's Triton "
            "kernel, and no sooner than ATOM_FP8_W8A8_MIN_TOKENS (vLLM's kernels quantise "
            "activations); 0 = never; auto = 17 for DeepGEMM, 128 for CUTLASS (where each measured "
            "faster than atom's kernel, docs/performance.md).",
            _parse_auto_or_nonneg_int, "auto, or an integer >= 0",
        ),
        EnvVar(
            "ATOM_FP8_HOST_GEMM_SMALL", "choice", "auto",
            "Block-scaled fp8 linears under vLLM on Hopper GPUs, batches of 2 tokens up to the "
            "larger-batch GEMM's first size (ATOM_FP8_HOST_GEMM_MIN_TOKENS) and below 32: `flashinfer` = "
            "FlashInfer's swap-AB block-fp8 GEMM (the kernel stock vLLM runs for these sizes with "
            "FlashInfer installed; it quantises the activations per 128-channel group itself) on "
            "weights of at least 4096 output rows, atom's Triton kernel on the others and for one "
            "token; `atom` = atom's Triton W8A16 kernel (the dequantised layer's numbers); `auto` "
            "= flashinfer where vLLM says FlashInfer's block-scale GEMM runs (FlashInfer installed, "
            "SM 9.0, VLLM_BLOCKSCALE_FP8_GEMM_FLASHINFER not 0), else atom (`flashinfer` where it does "
            "not run: atom, with a warning). Nothing changes with ATOM_FP8_W8A8_MIN_TOKENS=0 (W8A16 always).",
            _choice(*FP8_HOST_GEMMS_SMALL), ", ".join(FP8_HOST_GEMMS_SMALL),
        ),
        EnvVar(
            "ATOM_MOE_GEMV_MAX_TOKENS", "auto or int", "auto",
            "atom's fused MoE on GPUs: batches of at most this many tokens, with no more (token, "
            "expert) pairs than experts, run the small-batch path (two weight-streaming GEMV "
            "kernels, no expert-sort kernel) instead of the grouped GEMMs; 0 = never; auto = 4 "
            "for bf16/fp16 experts (measured faster on the H100), 1 for block-fp8 experts of at most "
            "11 MB each and 0 for larger ones (H200: the GEMV 1.2x faster than the grouped tiles at one "
            "token on Qwen3-30B-A3B's experts, 1.25x slower on DeepSeek-V3's; docs/performance.md).",
            _parse_auto_or_nonneg_int, "auto, or an integer >= 0",
        ),
        EnvVar(
            "ATOM_MLA_CONTEXT_CHUNK_TOKENS", "int", "0",
            "Tokens of cached context atom's MLA backend up-projects at a time for prefill/extend "
            "rows (its bounded workspace); 0 = sized from vLLM's config (see docs/attention.md).",
            _parse_nonneg_int, "an integer >= 0",
        ),
        EnvVar(
            "ATOM_MLA_HOST_DECODE", "choice", "auto",
            "MLA decode rows under vLLM on NVIDIA GPUs: `flashmla` = vLLM's FlashMLA dense decode "
            "(`flash_mla_with_kvcache`) for DeepSeek's latent geometry (kv_lora_rank 512, rope 64) in "
            "a bf16/fp16 cache of 64-token pages, atom's Triton kernel for anything else; `atom` = "
            "atom's Triton kernel always; `auto` = `flashmla` where vLLM says FlashMLA runs (Hopper). "
            "Where FlashMLA is used, atom's MLA backend asks vLLM for 64-token pages unless "
            "--block-size is given.",
            _choice(*MLA_HOST_DECODES), ", ".join(MLA_HOST_DECODES),
        ),
        EnvVar(
            "ATOM_MHA_HOST_PREFILL", "choice", "atom",
            "Attention steps with a multi-token row (prefill, chunked prefill, prefills next to decodes) "
            "in atom's MHA backend under vLLM on NVIDIA GPUs (which serves only with ATOM_ENABLE_MHA_ON_NVIDIA=1): "
            "`atom` = atom's Triton kernels; "
            "`flash_attn` = one call of vLLM's FlashAttention 3 (`flash_attn_varlen_func`, paged, on "
            "atom's cache) for every row of such a step, for bf16/fp16 layers with a bf16/fp16 cache and "
            "head sizes that are multiples of 8 up to 256 (with sinks: bf16 only; atom's kernels for "
            "others, for decode-only steps, and where FlashAttention 3 does not run); `auto` = the same "
            "as `flash_attn`. The default stays `atom`: measured on an H200, the online cell it targets "
            "was a tie (docs/performance.md).",
            _choice(*MHA_HOST_PREFILLS), ", ".join(MHA_HOST_PREFILLS),
        ),
        EnvVar(
            "ATOM_MLA_DECODE_TILE", "str", "auto",
            "Tile of atom's Triton MLA decode kernel on GPUs: heads per program, KV tokens per step, "
            "warps, pipeline stages (bench/mla_tiles.py measures the choices); auto = atom's default "
            "for the latent width and dtype.",
            _parse_tile, _TILE_ACCEPTED,
        ),
    )
}


def get(name: str, environ: "dict[str, str] | None" = None) -> Any:
    """The parsed value of ``name``, read from the environment now."""
    try:
        var = VARIABLES[name]
    except KeyError:
        raise AttributeError(f"unknown atom environment variable {name!r}") from None
    return var.read(environ)


_ENVIRON_TYPE = type(os.environ)
_ENCODED_NAMES: dict[str, Any] = {}
# CPython's os._Environ keeps the live environment in ``_data`` (encoded keys and values)
_FAST_READ = all(hasattr(os.environ, a) for a in ("_data", "encodekey", "decodevalue"))


def raw(name: str) -> "str | None":
    """The live value of any environment variable (None when unset), unparsed: ``os.environ.get``
    for hot paths. Reads the environment's own backing mapping, which every ``os.environ`` write
    updates, so a change is seen at the next call; an unset name costs ~0.07 us instead of the
    ~0.5 us of ``os.environ.get`` (its ``KeyError`` path). The dispatcher reads two per op call."""
    env = os.environ
    if not _FAST_READ or type(env) is not _ENVIRON_TYPE:  # replaced (by a test, say): the plain read
        return env.get(name)
    key = _ENCODED_NAMES.get(name)
    if key is None:
        key = _ENCODED_NAMES[name] = env.encodekey(name)
    value = env._data.get(key)
    return None if value is None else env.decodevalue(value)


def is_set(name: str) -> bool:
    """True when ``name`` is present (non-empty) in the environment, whatever its value."""
    if name not in VARIABLES:
        raise AttributeError(f"unknown atom environment variable {name!r}")
    return bool(os.environ.get(name, "").strip())


def set_values(environ: "dict[str, str] | None" = None) -> dict[str, Any]:
    """Every ATOM_* variable that is set, with its parsed value (malformed ones raise)."""
    env = os.environ if environ is None else environ
    return {n: v.read(env) for n, v in VARIABLES.items() if env.get(n, "").strip()}


def __getattr__(name: str) -> Any:
    # Module attribute access reads the environment at access time (PEP 562).
    if name in VARIABLES:
        return VARIABLES[name].read()
    raise AttributeError(f"module 'atom.envs' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + list(VARIABLES))
