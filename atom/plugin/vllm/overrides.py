"""Which vLLM models atom's classes serve: the overrides ``register_model`` puts in vLLM's
``ModelRegistry``, and the rule by which atom steps aside for a model it does not serve.

atom's model classes serve text generation (``--runner generate``, no ``--convert``) of the
architectures in atom's table (``atom.plugin.models``). vLLM resolves a model class through
its registry for every runner, though: pooling (``--runner pooling``: embed, classify, score),
a ``--convert`` adapter, or an architecture name vLLM maps onto a generative one
(``Qwen3Model`` -> ``Qwen3ForCausalLM``). For those atom steps aside: the records
``vllm.models.resolve_model_cls`` / ``inspect_model_cls`` (group ``vllm.models``) answer with
vLLM's own registry entries, saved here when atom overrides them, and one INFO line says so.

atom also steps aside, by default, for 128x128-style block-fp8 checkpoints on NVIDIA GPUs, unless
``ATOM_ENABLE_FP8_BLOCK_ON_NVIDIA=1``: of dense architectures, because atom's fp8 model measured no
faster than vLLM's own path (DeepGEMM; docs/performance.md, "block-fp8 weights stay fp8"); of a MoE
architecture whose table entry says atom measured no gain there (``ModelEntry.nvidia_fp8_block_aside``:
Qwen3-MoE; DeepSeek-V3's fp8 model stays atom's). Per-tensor fp8, CPU and ROCm are unaffected.
Likewise for an architecture whose table entry says atom measured slower than vLLM's model on NVIDIA
GPUs (``ModelEntry.nvidia_aside``: the dense Qwen3), unless ``ATOM_ENABLE_ON_NVIDIA`` names it.

And atom steps aside for a checkpoint in a quantization format its model does not load (MXFP4
GPT-OSS, AWQ, GPTQ, compressed-tensors, ...: ``ModelEntry.quantization``), which vLLM's own model
serves; the wrapper's refusal stays as the backstop where vLLM resolves a class without the
registry.

Some of what atom's models do not run is known only when vLLM builds the class: the parallel
layout (pipeline parallelism, expert parallelism across data-parallel ranks), LoRA adapters,
speculative decoding that hands the target model to a draft. There the wrapper
asks :func:`builds` and constructs vLLM's own class (:func:`stock_class`) instead; vLLM's check
whether the model runs pipeline parallelism (``is_pp_supported_model``, asked only for PP > 1)
is answered by vLLM's own entries.
"""

from __future__ import annotations

from typing import Any

from atom import envs
from atom._logging import get_logger, info_once
from atom.plugin import Decision
from atom.plugin.models import BY_ARCH

logger = get_logger("atom.plugin")

#: The wrapper of atom's dense (non-MoE) architectures.
DENSE_WRAPPER = "ATOMForCausalLM"
#: Why atom steps aside for block-fp8 checkpoints of dense architectures on NVIDIA GPUs.
FP8_DENSE_ON_NVIDIA = ("a dense block-fp8 checkpoint on an NVIDIA GPU, where atom's fp8 path measured no faster "
                       "than vLLM's own (docs/performance.md)")
#: The head of the reason for a MoE architecture's block-fp8 step-aside on NVIDIA GPUs (its table
#: entry's ``nvidia_fp8_block_aside`` follows).
FP8_MOE_ON_NVIDIA = "a block-fp8 MoE checkpoint on an NVIDIA GPU, where"
#: arch -> vLLM's own registry entry, saved when atom overrides the arch (this process).
STOCK: dict[str, Any] = {}


def override(registry: Any, arch: str, ref: str) -> None:
    """Register atom's class ``ref`` for ``arch`` in vLLM's ``registry``, keeping vLLM's own."""
    STOCK.setdefault(arch, registry.models[arch])
    registry.register_model(arch, ref)


def serves(architectures: Any, model_config: Any) -> Decision:
    """Decision(True/False, reason): does atom's class serve this model? Only text generation of
    an architecture atom implements; until vLLM has resolved the runner (it inspects classes to
    choose one), vLLM's own classes answer, so the runner is chosen as without atom."""
    archs = [architectures] if isinstance(architectures, str) else list(architectures or [])
    runner = getattr(model_config, "runner_type", None)
    convert = getattr(model_config, "convert_type", None)
    if not archs or archs[0] not in BY_ARCH:
        return Decision(False, f"atom has no model for architecture {archs[0] if archs else None!r}")
    if runner != "generate":
        return Decision(False, f"runner {runner}: atom's models serve text generation only")
    if convert not in (None, "none"):
        return Decision(False, f"--convert {convert}: atom's models serve text generation only")
    entry = BY_ARCH[archs[0]]
    unloadable = unloadable_quantization(archs[0], quant_method(model_config))
    if unloadable:
        return Decision(False, unloadable)
    dense = entry.wrapper == DENSE_WRAPPER
    if ((dense or entry.nvidia_fp8_block_aside) and block_fp8(model_config) and on_nvidia()
            and not envs.ATOM_ENABLE_FP8_BLOCK_ON_NVIDIA):
        why = FP8_DENSE_ON_NVIDIA if dense else f"{FP8_MOE_ON_NVIDIA} {entry.nvidia_fp8_block_aside}"
        return Decision(False, f"{why}; ATOM_ENABLE_FP8_BLOCK_ON_NVIDIA=1 serves it with atom's model")
    if entry.nvidia_aside and on_nvidia() and not {archs[0], "*"} & set(envs.ATOM_ENABLE_ON_NVIDIA):
        return Decision(False, f"on an NVIDIA GPU: {entry.nvidia_aside}; ATOM_ENABLE_ON_NVIDIA={archs[0]} "
                               "serves it with atom's model")
    return Decision(True, "text generation of an architecture atom implements")


def unloadable_quantization(arch: str, quant: "str | None") -> str:
    """Why atom's model of ``arch`` does not load a ``quant`` checkpoint ("" when it does: an
    unquantized one, or a method in its table entry's ``quantization``). The one rule behind the
    step-aside at resolution (:func:`serves`), at build (:func:`builds`) and the wrapper's refusal."""
    entry = BY_ARCH.get(arch)
    if quant is None or entry is None or quant in entry.quantization:
        return ""
    loads = " or ".join(["unquantized", *entry.quantization])
    return f"a {quant!r} checkpoint, and atom's {arch} loads {loads} checkpoints only"


#: Speculative-decoding methods that propose from token ids alone (no draft model reads the
#: target's hidden states, embeddings or head): atom's models serve them (ngram: tested on CPU).
TOKEN_ONLY_SPECULATION = ("ngram", "suffix")


def builds(vllm_config: Any) -> Decision:
    """Decision(True/False, reason): does atom's class, which vLLM's registry chose (:func:`serves`),
    build the model for this engine (its parallel layout, LoRA, speculative decoding and
    quantization)? Asked when vLLM constructs
    the class (``ATOMModelBase.__new__``), the first point that sees the whole ``VllmConfig``: vLLM
    resolves the class from the model's config alone (once in the engine process, again in each
    worker), so a layout atom's models do not run is only known here. Where the answer is False,
    vLLM's own class for the architecture (:func:`stock_class`) is built instead.

    atom's models do not run pipeline parallelism, nor expert parallelism across data-parallel
    ranks (their experts all-reduce over the TP group, which holds every EP rank only when
    ``data_parallel_size`` and the prefill context-parallel size are 1); they take no LoRA
    adapters; and of speculative decoding they serve only the methods that read token ids alone
    (:data:`TOKEN_ONLY_SPECULATION`), not those that hand the target model to a draft (EAGLE's
    hidden states, MTP, a draft model sharing its embeddings)."""
    model_config = vllm_config.model_config
    if getattr(vllm_config, "lora_config", None) is not None:
        return Decision(False, "LoRA adapters enabled: atom's models take none")
    spec = getattr(vllm_config, "speculative_config", None)
    method = getattr(spec, "method", None) if spec is not None else None
    if method is not None and method not in TOKEN_ONLY_SPECULATION:
        return Decision(False, f"speculative decoding by {method!r}: atom's models serve "
                               f"{' and '.join(TOKEN_ONLY_SPECULATION)} speculation only")
    par = vllm_config.parallel_config
    pp = int(getattr(par, "pipeline_parallel_size", 1) or 1)
    if pp > 1:
        return Decision(False, f"pipeline_parallel_size={pp}: atom's models do not run pipeline parallelism")
    if getattr(par, "enable_expert_parallel", False):
        dp = int(getattr(par, "data_parallel_size", 1) or 1)
        pcp = int(getattr(par, "prefill_context_parallel_size", 1) or 1)
        if dp > 1 or pcp > 1:
            return Decision(False, f"expert parallelism with data_parallel_size={dp}, prefill_context_parallel_size="
                                   f"{pcp}: atom's experts all-reduce over the tensor-parallel group, which holds "
                                   "every expert-parallel rank only when both are 1")
    arch = (getattr(model_config.hf_config, "architectures", None) or ["?"])[0]
    if getattr(vllm_config, "quant_config", None) is not None:
        unloadable = unloadable_quantization(arch, getattr(model_config, "quantization", None) or "?")
        if unloadable:
            return Decision(False, unloadable)
    return Decision(True, "a layout and checkpoint atom's model runs")


def stock_class(arch: str) -> Any:
    """vLLM's own model class for ``arch`` (the registry entry :func:`override` saved in this
    process), or None where atom did not override it here."""
    entry = STOCK.get(arch)
    return None if entry is None else entry.load_model_cls()


def quant_method(model_config: Any) -> "str | None":
    """The checkpoint's quantization method as vLLM names it (``--quantization`` or the HF
    config's ``quant_method``: fp8, mxfp4, awq, ...), or None for an unquantized one."""
    method = getattr(model_config, "quantization", None)
    if method:
        return str(method)
    quant = _hf_quant(model_config)
    return str(quant["quant_method"]) if quant and quant.get("quant_method") else None


def _hf_quant(model_config: Any) -> "dict | None":
    quant = getattr(getattr(model_config, "hf_config", None), "quantization_config", None)
    if quant is not None and not isinstance(quant, dict):
        quant = quant.to_dict() if hasattr(quant, "to_dict") else dict(vars(quant))
    return quant


def block_fp8(model_config: Any) -> bool:
    """Whether the checkpoint is HF ``fp8`` with ``weight_block_size`` (Qwen3-FP8, DeepSeek-V3)."""
    quant = _hf_quant(model_config)
    return bool(quant) and quant.get("quant_method") == "fp8" and quant.get("weight_block_size") is not None


def on_nvidia() -> bool:
    """Whether vLLM's platform in this process is CUDA (not ROCm, not CPU)."""
    from vllm.platforms import current_platform

    return bool(current_platform.is_cuda())


def _with_stock_entries(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """The wrapper of both records: vLLM's own registry entries for a model atom does not serve."""
    architectures = args[0] if args else kwargs["architectures"]
    model_config = args[1] if len(args) > 1 else kwargs["model_config"]
    decision = serves(architectures, model_config)
    if decision.value or not STOCK:
        return wrapped(*args, **kwargs)
    if getattr(model_config, "runner_type", None) is not None:
        archs = [architectures] if isinstance(architectures, str) else list(architectures)
        step_aside_once(", ".join(archs), decision.reason)
    return _on_stock_entries(wrapped, instance, args, kwargs)


def _on_stock_entries(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """``wrapped`` called with vLLM's own entries in the registry for every architecture atom
    overrides (atom's put back after)."""
    models = instance.models
    ours = {arch: models[arch] for arch in STOCK if arch in models}
    models.update(STOCK)
    try:
        return wrapped(*args, **kwargs)
    finally:
        models.update(ours)


def step_aside_once(arch: str, reason: str) -> None:
    """The one INFO line of a step-aside (once per architecture and reason in a process)."""
    info_once(f"step-aside:{arch}:{reason}",
              f"atom steps aside for {arch} ({reason}): vLLM's own model serves it", logger)


resolve_model_cls = inspect_model_cls = _with_stock_entries
#: vLLM asks ``is_pp_supported_model`` only for ``pipeline_parallel_size > 1``, where atom's class
#: builds vLLM's own (:func:`builds`): vLLM's own entries answer it.
is_pp_supported_model = _on_stock_entries
