"""Mutation check: break a fixed list of key spots one at a time and run the tests that must see
it; every mutant must be caught (the tests fail). Not run by CI (it takes a while); the closing
note of the work that changes these spots reports its result.

    python -m tests.mutants [--only NAME[,NAME]] [--list] [--keep WORKDIR]

First the union of the mutants' tests runs on the unmutated copy and must pass (else a "caught"
would mean nothing). Then each mutant edits one file of the scratch copy (one exact text
replacement, which must match once), runs its tests there with this interpreter (the copy's
``atom`` comes first on ``sys.path``, in subprocesses too), and restores the file. Prints one
line per mutant and exits non-zero when any survived (or its text no longer matches: the list
must follow the code).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Mutant:
    name: str
    path: str
    old: str
    new: str
    tests: tuple[str, ...]


OPS = "tests/ops/test_numerical_details.py"
DSV3_FP8 = "tests/models/test_deepseek_v3_fp8.py"
MLA_HOST = "tests/attention/test_mla_host_decode.py"
FP8_GEMM = "tests/ops/test_fp8_gemm.py"
MOE = "tests/ops/test_moe.py"

MUTANTS = (
    # norm epsilons
    Mutant("rmsnorm-triton-eps", "atom/ops/rmsnorm_triton.py",
           "rstd = tl.rsqrt(tl.sum(x * x, axis=0) / N + eps)", "rstd = tl.rsqrt(tl.sum(x * x, axis=0) / N)",
           (OPS + "::test_rms_norm_epsilon_on_tiny_and_zero_rows",)),
    Mutant("rmsnorm-reference-eps", "atom/ops/rmsnorm.py",
           "torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)", "torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True))",
           (OPS + "::test_rms_norm_epsilon_on_tiny_and_zero_rows",)),
    Mutant("qk-norm-triton-eps", "atom/ops/fused_qk_norm_rope_cache_triton.py",
           "rstd = tl.rsqrt(ss / HEAD_DIM + eps)[:, None]", "rstd = tl.rsqrt(ss / HEAD_DIM + 1e-2)[:, None]",
           (OPS + "::test_fused_qk_norm_epsilon_and_rope_boundaries",)),
    # rotary halves
    Mutant("rope-reference-halves", "atom/ops/rotary.py",
           "o1 = x1 * cos - x2 * sin", "o1 = x1 * cos + x2 * sin",
           (OPS + "::test_rope_at_the_first_and_last_positions",)),
    Mutant("rope-triton-halves", "atom/ops/fused_qk_norm_rope_cache_triton.py",
           "o2 = (x2 * cos[None, :] + x1 * sin[None, :]).to(dtype)", "o2 = (x2 * cos[None, :] - x1 * sin[None, :]).to(dtype)",
           (OPS + "::test_rope_at_the_first_and_last_positions",)),
    # routing bias and renormalisation
    Mutant("topk-softmax-renorm", "atom/ops/moe_routing.py",
           "    if renormalize:\n        w = w / w.sum(dim=-1, keepdim=True)\n    return w, ids.to(torch.int32)",
           "    return w, ids.to(torch.int32)",
           (OPS + "::test_routing_renormalisation_and_correction_bias_decide",)),
    Mutant("grouped-topk-bias-triton", "atom/ops/moe_routing_triton.py",
           "choice = score + tl.load(bias_ptr + offs_e).to(tl.float32)[None, :]", "choice = score + 0.0",
           (OPS + "::test_routing_renormalisation_and_correction_bias_decide",)),
    Mutant("grouped-topk-weights-with-bias", "atom/ops/moe_routing.py",
           "    w = score.gather(1, ids)", "    w = choice.gather(1, ids)",
           (OPS + "::test_routing_renormalisation_and_correction_bias_decide",)),
    # fp8 scale application
    Mutant("rmsnorm-fp8-scale", "atom/ops/rmsnorm.py",
           "y = (y / scale.float()).clamp(", "y = (y * scale.float()).clamp(",
           (OPS + "::test_rms_norm_static_fp8_scale_is_applied",)),
    Mutant("per-group-scale-triton", "atom/ops/quant_triton.py",
           "scale = tl.maximum(tl.max(tl.abs(x), axis=1), eps) / 448.0", "scale = tl.maximum(tl.max(tl.abs(x), axis=1), eps) / 224.0",
           (OPS + "::test_per_token_and_per_group_scales",)),
    Mutant("fp8-kv-cache-attention-scale", "atom/models/attention/mha.py",
           "scales = dict(k_scale=k_scale, v_scale=v_scale) if self.fp8_cache else {}",
           "scales = dict(k_scale=v_scale, v_scale=k_scale) if self.fp8_cache else {}",
           ("tests/attention/test_impl.py",)),
    # cache slot mapping
    Mutant("cache-slot-block-triton", "atom/ops/kv_cache_triton.py",
           "        blk = slot // block_size\n        off = slot - blk * block_size",
           "        blk = slot // block_size\n        off = slot - blk * block_size + (slot % block_size == block_size - 1)",
           (OPS + "::test_cache_slots_at_block_boundaries_and_padding",)),
    Mutant("cache-padding-written", "atom/ops/kv_cache_triton.py",
           "    if slot >= 0:", "    if slot >= -1:",
           (OPS + "::test_cache_slots_at_block_boundaries_and_padding",)),
    Mutant("fused-path-token-positions", "atom/models/attention/mha.py",
           "torch.add((b.seq_lens[:r].long() - q_lens)[req], token - qsl[:-1][req], out=out)",
           "torch.add((b.seq_lens[:r].long() - q_lens + 1)[req], token - qsl[:-1][req], out=out)",
           ("tests/layers/test_attention_layers.py::test_paged_attention_layer_matches_dense",)),
    # MLA: the LSE merge and the metadata split
    Mutant("mla-lse-merge", "atom/ops/mla_prefill.py",
           "acc.addcmul_(part, torch.exp(part_lse - total).unsqueeze(-1))",
           "acc.addcmul_(part, torch.exp(acc_lse - total).unsqueeze(-1))",
           ("tests/layers/test_attention_layers.py",)),
    Mutant("mla-fresh-prefill-count", "atom/models/attention/mla.py",
           "return int((b.seq_lens_cpu[num_decodes: b.num_reqs] == _rest_query_lens(b, num_decodes)).sum())",
           "return 0",
           ("tests/layers/test_attention_layers.py::test_mla_layer_matches_dense_mla",)),
    # environment parsing
    Mutant("env-nonneg-int", "atom/envs.py",
           "    if value < 0:\n        raise EnvError(f\"{name}={raw!r} is not a valid value; accepted values: an integer >= 0\")",
           "    if value < -100:\n        raise EnvError(f\"{name}={raw!r} is not a valid value; accepted values: an integer >= 0\")",
           ("tests/test_envs.py",)),
    Mutant("env-bool", "atom/envs.py",
           "    if value in _FALSE:\n        return False\n", "    if value in _FALSE or value:\n        return False\n",
           ("tests/test_envs.py",)),
    # the toolkit: revert and the abstract refresh of a host's subclasses
    Mutant("revert-keeps-patch", "atom/patches/core.py",
           "                else:\n                    setattr(site.owner, site.name, site.original)",
           "                else:\n                    pass",
           ("tests/toolkit/test_mechanics.py",)),
    Mutant("abstract-refresh-subclasses", "atom/patches/core.py",
           "        todo.extend(klass.__subclasses__())", "        pass",
           ("tests/toolkit/test_mechanics.py",)),
    # the host seam: the batch a step is built from, the step-aside rule
    Mutant("attention-batch-host-seq-lens", "atom/plugin/vllm/compat.py",
           "        seq_lens_cpu = getattr(m, \"_seq_lens_cpu\", None)\n",
           "        seq_lens_cpu = getattr(m, \"_seq_lens_cpu\", None)\n    seq_lens_cpu = None\n",
           ("tests/attention/test_mla_backend.py",)),
    Mutant("step-aside-runner", "atom/plugin/vllm/overrides.py",
           "    if runner != \"generate\":", "    if runner == \"never\":",
           ("tests/plugin/test_runners.py",)),
    # the supported vLLM range: what a version counts as, the upper edge, a release's accepted shape
    Mutant("version-prerelease-as-is", "atom/patches/versions.py",
           "return dist, Version(Version(raw).base_version)", "return dist, Version(raw)",
           ("tests/toolkit/test_versions.py",)),
    Mutant("version-upper-edge-inclusive", "atom/patches/versions.py",
           "return found[1] in SpecifierSet(spec), text", "return found[1] in SpecifierSet(spec.replace(\"<\", \"<=\")), text",
           ("tests/toolkit/test_versions.py",)),
    Mutant("mla-impl-0.33-shape-dropped", "atom/plugin/vllm/records.py",
           "                                \"skip_scale=...)\")),", "                                )),",
           ("tests/vllm_range/test_records.py::test_contract[0.33-vllm.attention.mla_impl]",)),
    # DeepSeek-V3 fp8: what each layer loads, what is skipped, kv_b_proj under vLLM's MLA
    Mutant("dsv3-fp8-shared-experts-unquantised", "atom/models/deepseek_v3.py",
           "parallel, dtype, quant=quant,\n", "parallel, dtype, quant=None,\n",
           (DSV3_FP8 + "::test_loaded_layers_are_fp8_except_ignored_and_kv_b_is_dequantized",)),
    Mutant("dsv3-fp8-kv-b-kept-fp8", "atom/models/deepseek_v3.py",
           "dataclasses.replace(kv_b_quant, dequantize=True)", "kv_b_quant",
           (DSV3_FP8 + "::test_loaded_layers_are_fp8_except_ignored_and_kv_b_is_dequantized",)),
    Mutant("dsv3-fp8-mtp-scales-loaded", "atom/models/deepseek_v3.py",
           ">= int(self.hf_config.num_hidden_layers))",
           ">= int(self.hf_config.num_hidden_layers) and not name.endswith(\"_scale_inv\"))",
           (DSV3_FP8 + "::test_mtp_layer_and_its_fp8_scales_are_skipped",)),
    Mutant("dsv3-fp8-q-a-kv-a-always-fused", "atom/models/deepseek_v3.py",
           "return quant is None or quant.block is None or int(q_lora_rank) % quant.block[0] == 0", "return True",
           (DSV3_FP8 + "::test_fused_q_a_kv_a_needs_q_lora_rank_on_tile_boundaries",)),
    Mutant("mla-kv-b-view-snapshot", "atom/plugin/vllm/model_wrapper.py",
           "self._rebound: Optional[torch.Tensor] = None", "self._rebound: Optional[torch.Tensor] = linear.weight",
           (DSV3_FP8 + "::test_vllm_mla_absorbs_the_dequantized_kv_b_proj_whatever_the_hook_order",)),
    Mutant("mla-kv-b-hook-order", "atom/plugin/vllm/attention.py",
           "        if prepare is not None:\n            prepare()", "        if False:\n            prepare()",
           (DSV3_FP8 + "::test_vllm_mla_absorbs_the_dequantized_kv_b_proj_whatever_the_hook_order",)),
    Mutant("mla-prefill-stand-in-off", "atom/plugin/vllm/mla_patch.py",
           "    if compat.platform_selects_mla_prefill() or current_platform.get_device_capability() is not None:",
           "    if True:",
           ("tests/vllm_range/test_lowest_engines.py::test_mla_deepseek_v3_through_atom_same_tokens_as_stock",)),
    # block-fp8 GEMM (issue #16)
    Mutant("fp8-gemm-triton-k-scale-column", "atom/ops/fp8_gemm_triton.py",
           "sw = tl.load(ws_ptrs + k0 // SCALE_BK, mask=nmask, other=0.0)",
           "sw = tl.load(ws_ptrs + 0 * k0, mask=nmask, other=0.0)", (FP8_GEMM,)),
    Mutant("fp8-gemm-triton-split-k-sum", "atom/ops/fp8_gemm_triton.py",
           "for s in tl.static_range(SPLIT_K):", "for s in tl.static_range(SPLIT_K - 1):", (FP8_GEMM,)),
    Mutant("fp8-gemv-scale-column", "atom/ops/fp8_gemm_triton.py",
           "x = x * tl.load(ws_row + k // SCALE_BK, mask=kmask, other=0.0)",
           "x = x * tl.load(ws_row + k // SCALE_BK + 1, mask=kmask, other=0.0)", (FP8_GEMM,)),
    Mutant("fp8-gemv-scale-row", "atom/ops/fp8_gemm_triton.py",
           "ws_row = ws_ptr + ((pid_n * BLOCK_N) // SCALE_BN) * stride_wsn",
           "ws_row = ws_ptr + (pid_n // SCALE_BN) * stride_wsn", (FP8_GEMM,)),
    Mutant("fp8-gemv-rows", "atom/ops/fp8_gemm_triton.py",
           "x_ptrs = x_ptr + m.to(tl.int64) * stride_xm + kt0 * BLOCK_K + offs_k",
           "x_ptrs = x_ptr + kt0 * BLOCK_K + offs_k", (FP8_GEMM,)),
    Mutant("bf16-gemv-ignores-its-switch", "atom/models/_linear.py",
           "if weight.dtype not in (torch.bfloat16, torch.float16) or not envs.ATOM_BF16_GEMV:",
           "if weight.dtype not in (torch.bfloat16, torch.float16):",
           ("tests/ops/test_linear.py",)),
    Mutant("bf16-gemv-off-by-default-on-nvidia", "atom/models/_linear.py",
           "return nvidia_gpu(weight) or envs.is_set(\"ATOM_BF16_GEMV\")",
           "return envs.is_set(\"ATOM_BF16_GEMV\")", ("tests/ops/test_linear.py",)),
    Mutant("bf16-gemv-takes-batches", "atom/ops/linear.py",
           "if x.dim() != 2 or x.shape[0] != 1:", "if x.dim() != 2:", ("tests/ops/test_linear.py",)),
    Mutant("fp8-gemm-reference-tile-rows", "atom/ops/fp8_gemm.py",
           "s = scale.float().repeat_interleave(bn, dim=-2)[..., :n, :]",
           "s = scale.float().repeat_interleave(bk, dim=-2)[..., :n, :]",
           (FP8_GEMM + "::test_reference_is_dequantise_then_matmul",)),
    Mutant("fp8-host-gemm-on-w8a16", "atom/ops/fp8_gemm.py",
           "return (w8a8 or self.w8a16_batches) and", "return",
           (FP8_GEMM + "::test_host_gemm_serves_only_batches_the_op_would_quantise",)),
    Mutant("fp8-host-gemm-on-asked-w8a16", "atom/ops/fp8_gemm.py",
           "x.dtype != FP8_DTYPE and w8a8_from is not None:", "x.dtype != FP8_DTYPE:",
           (FP8_GEMM + "::test_small_batch_host_gemm_takes_float_batches_in_its_range",)),
    Mutant("fp8-host-gemm-no-end", "atom/ops/fp8_gemm.py",
           "(self.max_tokens is None\n", "(True\n",
           (FP8_GEMM + "::test_small_batch_host_gemm_takes_float_batches_in_its_range",)),
    Mutant("fp8-host-gemm-warm-up-on-w8a16", "atom/ops/fp8_gemm.py",
           "for host in _HOST_GEMMS if w8a8_from is not None else ():", "for host in _HOST_GEMMS:",
           (FP8_GEMM + "::test_host_gemm_warm_up_runs_with_the_layers_warm_up",)),
    Mutant("fp8-linear-per-tensor-blocks", "atom/models/_linear.py",
           "per_tile = self._row_scales()[::bn].to(self.weight.device)",
           "per_tile = self._row_scales()[:1].expand(n // bn).to(self.weight.device)",
           ("tests/models/test_fp8.py::test_model_alone_matches_hf_on_dequantized_weights",)),
    Mutant("unloadable-quantization-served", "atom/plugin/vllm/overrides.py",
           "if quant is None or entry is None or quant in entry.quantization:",
           "if True:",
           ("tests/plugin/test_runners.py::test_unloadable_quantization_steps_aside",
            "tests/models/test_fp8.py::test_wrapper_names_unsupported_quantization_methods")),
    # layouts atom's models do not run: vLLM's own class built in place of atom's
    Mutant("pipeline-parallel-built-by-atom", "atom/plugin/vllm/overrides.py",
           "    if pp > 1:\n", "    if pp > 1 and False:\n",
           ("tests/plugin/test_runners.py::test_parallel_layouts_atom_does_not_run_build_vllms_model",
            "tests/models/test_qwen3.py::test_pipeline_parallel_is_served_by_vllms_model")),
    Mutant("ep-across-dp-built-by-atom", "atom/plugin/vllm/overrides.py",
           "        if dp > 1 or pcp > 1:\n", "        if pcp > 1:\n",
           ("tests/plugin/test_runners.py::test_parallel_layouts_atom_does_not_run_build_vllms_model",)),
    Mutant("pp-support-asked-of-atoms-class", "atom/plugin/vllm/overrides.py",
           "is_pp_supported_model = _on_stock_entries\n",
           "is_pp_supported_model = lambda wrapped, instance, args, kwargs: wrapped(*args, **kwargs)\n",
           ("tests/plugin/test_runners.py::test_parallel_layouts_atom_does_not_run_build_vllms_model",
            "tests/models/test_qwen3.py::test_pipeline_parallel_is_served_by_vllms_model")),
    Mutant("lora-built-by-atom", "atom/plugin/vllm/overrides.py",
           '    if getattr(vllm_config, "lora_config", None) is not None:\n',
           '    if False:\n',
           ("tests/plugin/test_engine_features.py::test_lora_is_served_by_vllms_model",)),
    Mutant("token-only-speculation-stepped-aside", "atom/plugin/vllm/overrides.py",
           'TOKEN_ONLY_SPECULATION = ("ngram", "suffix")', 'TOKEN_ONLY_SPECULATION = ("suffix",)',
           ("tests/plugin/test_engine_features.py::test_ngram_speculation_stays_atoms",)),
    Mutant("draft-speculation-built-by-atom", "atom/plugin/vllm/overrides.py",
           "    if method is not None and method not in TOKEN_ONLY_SPECULATION:\n",
           "    if method is not None and method not in TOKEN_ONLY_SPECULATION and method != 'eagle3':\n",
           ("tests/plugin/test_engine_features.py::test_draft_model_speculation_builds_vllms_model",)),
    Mutant("no-step-aside-at-build", "atom/plugin/vllm/model_wrapper.py",
           "        stock = overrides.stock_class(arch)\n", "        stock = None\n",
           ("tests/models/test_qwen3.py::test_pipeline_parallel_is_served_by_vllms_model",)),
    Mutant("nvidia-aside-ignores-its-switch", "atom/plugin/vllm/overrides.py",
           "if entry.nvidia_aside and on_nvidia() and not {archs[0], \"*\"} & set(envs.ATOM_ENABLE_ON_NVIDIA):",
           "if entry.nvidia_aside and on_nvidia():",
           ("tests/plugin/test_runners.py::test_architecture_measured_slower_on_nvidia_steps_aside_unless_enabled",)),
    Mutant("nvidia-aside-on-every-device", "atom/plugin/vllm/overrides.py",
           "if entry.nvidia_aside and on_nvidia() and not {archs[0], \"*\"} & set(envs.ATOM_ENABLE_ON_NVIDIA):",
           "if entry.nvidia_aside and not {archs[0], \"*\"} & set(envs.ATOM_ENABLE_ON_NVIDIA):",
           ("tests/plugin/test_runners.py::test_architecture_measured_slower_on_nvidia_steps_aside_unless_enabled",)),
    Mutant("mha-nvidia-step-aside-off", "atom/plugin/vllm/selection.py",
           '    if kind == "mha" and requested is None and not envs.ATOM_ENABLE_MHA_ON_NVIDIA:',
           '    if False:',
           ("tests/attention/test_backend.py::test_mha_steps_aside_on_nvidia_unless_asked_for",)),
    Mutant("mha-nvidia-step-aside-ignores-request", "atom/plugin/vllm/selection.py",
           '    if kind == "mha" and requested is None and not envs.ATOM_ENABLE_MHA_ON_NVIDIA:',
           '    if kind == "mha" and not envs.ATOM_ENABLE_MHA_ON_NVIDIA:',
           ("tests/attention/test_backend.py::test_mha_steps_aside_on_nvidia_unless_asked_for",)),
    Mutant("fp8-block-step-aside-off", "atom/plugin/vllm/overrides.py",
           "            and not envs.ATOM_ENABLE_FP8_BLOCK_ON_NVIDIA):", "            and False):",
           ("tests/plugin/test_runners.py::test_block_fp8_on_nvidia_steps_aside_unless_enabled",)),
    Mutant("fp8-block-step-aside-dense-only", "atom/plugin/vllm/overrides.py",
           "    if ((dense or entry.nvidia_fp8_block_aside) and block_fp8(model_config) and on_nvidia()",
           "    if (dense and block_fp8(model_config) and on_nvidia()",
           ("tests/plugin/test_runners.py::test_block_fp8_on_nvidia_steps_aside_unless_enabled",)),
    Mutant("fp8-block-step-aside-every-moe", "atom/plugin/vllm/overrides.py",
           "    if ((dense or entry.nvidia_fp8_block_aside) and block_fp8(model_config) and on_nvidia()",
           "    if (block_fp8(model_config) and on_nvidia()",
           ("tests/plugin/test_runners.py::test_block_fp8_on_nvidia_steps_aside_unless_enabled",)),
    Mutant("fp8-block-step-aside-moe-reason", "atom/plugin/vllm/overrides.py",
           "        why = FP8_DENSE_ON_NVIDIA if dense else f\"{FP8_MOE_ON_NVIDIA} {entry.nvidia_fp8_block_aside}\"",
           "        why = FP8_DENSE_ON_NVIDIA",
           ("tests/plugin/test_runners.py::test_block_fp8_on_nvidia_steps_aside_unless_enabled",)),
    # producers that quantise for the fp8 GEMMs (issue #16)
    Mutant("fused-quant-norm-amax-of-unrounded", "atom/ops/fused_quant_triton.py",
           "    _store_quantised(y.to(tl.float32), q_ptr + row * stride_q, s_ptr + row * stride_sm, cols, mask, g, "
           "num_groups,\n                     stride_sg, amax_eps, EXACT_FP8)\n\n\ndef rms_norm_quant_launch",
           "    _store_quantised(x * rstd * w, q_ptr + row * stride_q, s_ptr + row * stride_sm, cols, mask, g, "
           "num_groups,\n                     stride_sg, amax_eps, EXACT_FP8)\n\n\ndef rms_norm_quant_launch",
           ("tests/ops/test_fused_quant.py",)),
    Mutant("fused-quant-scale-group-stride", "atom/ops/fused_quant_triton.py",
           "tl.store(s_row + g * stride_sg, scale, mask=g < num_groups)",
           "tl.store(s_row + g, scale, mask=g < num_groups)", ("tests/ops/test_fused_quant.py",)),
    Mutant("fused-quant-linear-scale", "atom/models/_linear.py",
           "dict(x_fp8=act.q, x_fp8_scale=act.scale)", "dict(x_fp8=act.q, x_fp8_scale=act.scale * 1.01)",
           ("tests/models/test_fp8.py::test_norms_and_activations_quantise_for_the_fp8_gemms",)),
    Mutant("fused-quant-residual-handed-on", "atom/models/_layers.py",
           "return QuantizedActivation(out[0], out[2], out[3]), out[1]",
           "return QuantizedActivation(out[0], out[2], out[3]), out[0]",
           ("tests/models/test_fp8.py::test_norms_and_activations_quantise_for_the_fp8_gemms",)),
    Mutant("fused-quant-experts-ignore-it", "atom/ops/moe_triton.py",
           "    if fp8 and x_fp8 is not None:", "    if False:",
           ("tests/ops/test_fused_quant.py::test_fp8_experts_read_the_producers_quantisation",)),
    # the MLA prefill stand-in where vLLM has no prefill backend for the head dims (0.26 on a GPU)
    Mutant("mla-prefill-no-backend-raises", "atom/plugin/vllm/mla_patch.py",
           'if "prefill backend" not in str(exc):\n                raise', "raise",
           ("tests/attention/test_mla_patch.py::test_prefill_backend_is_vllms_where_vllm_has_one",)),
    # vLLM's DeepGEMM as the host GEMM: its hand-off size, and its JIT warm-up at the layer's warm-up
    Mutant("fp8-host-deepgemm-from-128", "atom/plugin/vllm/fp8_gemm.py",
           "Kernel(DEEPGEMM, deepgemm_block_gemm, 17,", "Kernel(DEEPGEMM, deepgemm_block_gemm, 128,",
           ("tests/plugin/test_fp8_host_gemm.py",)),
    Mutant("fp8-host-gemm-warm-up-skipped", "atom/ops/fp8_gemm.py",
           "        if host.warm_up is not None:\n", "        if False:\n",
           ("tests/ops/test_fp8_gemm.py::test_host_gemm_warm_up_runs_with_the_layers_warm_up",)),
    # FlashInfer's swap-AB kernel for small batches: its rows, batch range and warm-up
    Mutant("fp8-host-flashinfer-any-rows", "atom/plugin/vllm/fp8_gemm.py",
           "FLASHINFER_MIN_ROWS = 4096", "FLASHINFER_MIN_ROWS = 64", ("tests/plugin/test_fp8_host_gemm.py",)),
    Mutant("fp8-host-flashinfer-past-32", "atom/plugin/vllm/fp8_gemm.py",
           "top = min(large_from if large_from is not None else FLASHINFER_MAX_TOKENS, FLASHINFER_MAX_TOKENS)",
           "top = large_from if large_from is not None else FLASHINFER_MAX_TOKENS",
           ("tests/plugin/test_fp8_host_gemm.py",)),
    Mutant("fp8-host-flashinfer-takes-one-token", "atom/plugin/vllm/fp8_gemm.py",
           "FLASHINFER_MIN_TOKENS = 2", "FLASHINFER_MIN_TOKENS = 1", ("tests/plugin/test_fp8_host_gemm.py",)),
    Mutant("fp8-host-flashinfer-not-warmed", "atom/plugin/vllm/fp8_gemm.py",
           "warm_up_at(fn, lambda n, device: sizes), max_tokens=top", "None, max_tokens=top",
           ("tests/plugin/test_fp8_host_gemm.py",)),
    Mutant("fp8-host-auto-cutlass-first", "atom/plugin/vllm/fp8_gemm.py",
           'KERNELS.values() if choice == "auto"', 'reversed(KERNELS.values()) if choice == "auto"',
           ("tests/plugin/test_fp8_host_gemm.py",)),
    Mutant("mla-host-decode-q-pe-not-copied", "atom/models/attention/mla.py",
           "q_lat[..., rank:].copy_(q_pe)", "q_lat[..., rank:].zero_()", (MLA_HOST,)),
    Mutant("mla-host-decode-state-per-layer", "atom/models/attention/mla.py",
           "                                  md.host_decode_state)", "                                  self.host_decode.new_step())",
           (MLA_HOST,)),
    Mutant("mla-host-decode-any-page-size", "atom/models/attention/mla.py",
           "or cache.shape[1] != host.page_size:", ":", (MLA_HOST,)),
    Mutant("mla-host-decode-triton-warm-up-kept", "atom/models/attention/mla.py",
           "if self.host_decode is None or self.host_decode.page_size != self._block_size:", "if True:",
           (MLA_HOST,)),
    Mutant("mla-flashmla-pages-without-flashmla", "atom/plugin/vllm/mla_decode.py",
           "if model_config is None or install() is None:", "if model_config is None:", (MLA_HOST,)),
    # the MoE small-batch (GEMV) path
    Mutant("moe-gemv-up-scale-row", "atom/ops/moe_gemv_triton.py",
           "((offs_n + inter) // SCALE_BN)[:, None] * stride_wsn", "(offs_n // SCALE_BN)[:, None] * stride_wsn",
           (MOE + "::test_fused_moe_small_batch_fp8",)),
    Mutant("moe-gemv-no-activation-quant", "atom/ops/moe_gemv_triton.py",
           "                a = _qdq_groups(a, ROUND)\n", "                a = a\n",
           (MOE + "::test_fused_moe_small_batch_fp8",)),
    # the grouped path's tile bucket under EP counts pairs per local expert (measured: entry 22)
    Mutant("moe-tile-bucket-global-experts", "atom/ops/moe_triton.py",
           "cfg = config or moe_config(num_tokens, top_k, num_local,",
           "cfg = config or moe_config(num_tokens, top_k, num_global,",
           (MOE + "::test_fused_moe_tile_bucket_counts_the_local_experts",)),
    Mutant("moe-warm-up-counts-global-experts", "atom/ops/moe_triton.py",
           "counts = warm_up_token_counts(top_k, w13.shape[0])",
           "counts = warm_up_token_counts(top_k, num_experts)",
           ("tests/ops/test_warm_up.py::test_moe_layer_warm_up_keeps_its_output",)),
    Mutant("moe-gemv-never-taken", "atom/ops/moe_gemv_triton.py",
           "return num_tokens <= gemv_max_tokens(fp8, expert_bytes) and", "return num_tokens < 0 and",
           (MOE + "::test_fused_moe_small_batch_path",)),
    Mutant("moe-fp8-gemv-two-tokens", "atom/ops/moe_gemv_triton.py",
           "GEMV_AUTO_MAX_TOKENS = {False: 4, True: 1}", "GEMV_AUTO_MAX_TOKENS = {False: 4, True: 2}",
           (MOE + "::test_fused_moe_small_batch_auto_limits_and_override",
            MOE + "::test_fp8_gemv_limit_by_expert_size")),
    Mutant("moe-fp8-gemv-size-ignored", "atom/ops/moe_gemv_triton.py",
           "if fp8 and expert_bytes > FP8_GEMV_MAX_EXPERT_BYTES:", "if False:",
           (MOE + "::test_fused_moe_small_batch_auto_limits_and_override",
            MOE + "::test_fp8_gemv_limit_by_expert_size")),
    Mutant("moe-fp8-gemv-bytes-w13-only", "atom/ops/moe_gemv_triton.py",
           "w13.shape[1] * w13.shape[2] * w13.element_size() + w2.shape[1] * w2.shape[2] * w2.element_size()",
           "w13.shape[1] * w13.shape[2] * w13.element_size()",
           (MOE + "::test_fused_moe_small_batch_auto_limits_and_override",)),
    Mutant("moe-gemv-routing-weight", "atom/ops/moe_gemv_triton.py",
           "y = y * tl.load(topk_w_ptr + pair + offs_n * 0, mask=ok_n, other=0.0)",
           "y = y * ok_n.to(tl.float32)", (MOE + "::test_fused_moe_small_batch_path",)),
)


def _copy(dst: Path) -> None:
    ignore = shutil.ignore_patterns(".git", "__pycache__", ".stage", ".whl", "*.egg-info", "build", "dist")
    shutil.copytree(REPO, dst, ignore=ignore, dirs_exist_ok=True)


def _pytest(root: Path, tests: tuple[str, ...]) -> int:
    env = {**os.environ, "PYTHONPATH": str(root), "PYTHONDONTWRITEBYTECODE": "1"}
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-x", "-q", *tests],
                          cwd=root, env=env, capture_output=True, text=True, timeout=3600).returncode


def run_mutant(m: Mutant, root: Path) -> tuple[str, float]:
    """("caught" | "SURVIVED" | "NO MATCH", seconds)."""
    path = root / m.path
    original = path.read_text()
    if original.count(m.old) != 1:
        return "NO MATCH", 0.0
    path.write_text(original.replace(m.old, m.new))
    start = time.time()
    try:
        return ("caught" if _pytest(root, m.tests) != 0 else "SURVIVED"), time.time() - start
    finally:
        path.write_text(original)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default="")
    p.add_argument("--list", action="store_true")
    p.add_argument("--keep", help="use (and keep) this scratch folder")
    args = p.parse_args(argv)
    chosen = [m for m in MUTANTS if not args.only or m.name in args.only.split(",")]
    if args.list:
        for m in chosen:
            print(f"{m.name:<32} {m.path:<48} {' '.join(m.tests)}")
        return 0
    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="atom-mutants-"))
    _copy(root)
    baseline = tuple(dict.fromkeys(t for m in chosen for t in m.tests))
    if _pytest(root, baseline) != 0:
        print(f"the unmutated tests fail: {' '.join(baseline)}")
        return 2
    print(f"baseline: {len(baseline)} test targets pass unmutated", flush=True)
    bad = 0
    try:
        for m in chosen:
            verdict, seconds = run_mutant(m, root)
            bad += verdict != "caught"
            print(f"{verdict:<9} {m.name:<32} {seconds:6.1f} s  {m.path}", flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    print(f"{len(chosen) - bad} of {len(chosen)} mutants caught")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
