"""One greedy vLLM run of **vLLM's own** DeepSeek-V3 model for the MLA backend comparison,
reduced to JSON-able results. In-process or as a script in a fresh interpreter (plugins read the
environment once per process)::

    python -m tests.attention._mla_runner MODEL_DIR PROMPTS.json OUT.json [ENGINE_KWARGS_JSON]

``PROMPTS.json`` holds ``[[token ids], max_tokens]`` pairs. With ``ENGINE_KWARGS["check_steps"]``
every step of atom's MLA impl is also checked against a dense torch reference computed from the
latent cache (see :func:`install_step_check`); with ``ENGINE_KWARGS["cpu_without_amx"]`` vLLM's
CPU platform is told the CPU has no AMX tiles (see ``CHUNKED_KWARGS``). A stock run (atom's attention
off) runs vLLM's CPU_MLA backend (``tests.models._engine_runner.stock_mla_kwargs``).
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import sys
from typing import Any

#: Identical scheduling on both sides: vLLM-CPU turns chunked prefill and prefix caching off for
#: its own MLA backend, so the comparison runs atom's backend that way too. max_num_seqs below the
#: number of prompts and per-prompt max_tokens make later prompts prefill while others decode.
ENGINE_KWARGS = dict(
    dtype="float32", enforce_eager=True, max_model_len=256, max_num_seqs=4, seed=0,
    gpu_memory_utilization=0.3, enable_chunked_prefill=False, enable_prefix_caching=False,
    max_num_batched_tokens=2048,
)
#: Chunked prefill (a 32-token budget) and prefix caching: atom's backend only. vLLM sees a CPU
#: without AMX tiles (``cpu_without_amx``): on one with them vLLM-CPU >= 0.32 expects its AMX MLA
#: backend and leaves chunked prefill on, so atom's platform would have nothing to keep there.
CHUNKED_KWARGS = dict(ENGINE_KWARGS, max_num_seqs=8, enable_chunked_prefill=True,
                      enable_prefix_caching=True, max_num_batched_tokens=32, cpu_without_amx=True)
ENGINE_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "HF_HUB_OFFLINE": "1",
}
VLLM_DEEPSEEK = "vllm.model_executor.models.deepseek_v2:DeepseekV3ForCausalLM"


def use_vllm_deepseek() -> None:
    """Load vLLM's general plugins (atom's model overrides) now, then point DeepseekV3ForCausalLM
    back at vLLM's own class: this test is about atom's attention under vLLM's model, whatever
    atom's model table holds. The engine core runs in this process, so it sees the same registry."""
    from vllm import ModelRegistry
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    ModelRegistry.register_model("DeepseekV3ForCausalLM", VLLM_DEEPSEEK)


def install_step_check(stats: dict[str, Any]) -> None:
    """Wrap atom's MLA impl ``forward`` (before the engine is built: mla_patch binds each layer to
    its impl's forward when the layer's weights are processed) so that, once ``stats["active"]``
    is set, every step's output is compared with dense MLA
    computed from the latent cache (weights straight from ``kv_b_proj``, causal over each
    request's whole context): the oracle for chunked prefill and prefix-cache hits, which
    vLLM's CPU_MLA cannot run. Records the worst difference and what kinds of steps ran."""
    import torch

    from atom.plugin.vllm.attention_mla import ATOMMLAImpl

    inner = ATOMMLAImpl.forward

    def forward(self, layer, q, kv_c, k_pe, kv_cache, md, output, *args, **kwargs):
        result = inner(self, layer, q, kv_c, k_pe, kv_cache, md, output, *args, **kwargs)
        if md is None or not stats["active"]:  # vLLM's own start-up runs are not the test's steps
            return result
        qsl, seq_lens = md.query_start_loc.tolist(), md.seq_lens.tolist()
        block = kv_cache.shape[1]
        w = self.kv_b_proj.weight.float()
        heads, nope, rope, vdim = self.num_heads, self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim
        for i in range(md.num_reqs):
            s, e, total = qsl[i], qsl[i + 1], seq_lens[i]
            n = e - s
            rows = kv_cache[md.block_table[i, : -(-total // block)].long()].reshape(-1, kv_cache.shape[-1])[:total].float()
            kv = (rows[:, : self.kv_lora_rank] @ w.t()).view(total, heads, nope + vdim)
            k = torch.cat([kv[..., :nope], rows[:, None, self.kv_lora_rank:].expand(total, heads, rope)], -1)
            scores = torch.einsum("qhd,khd->hqk", q[s:e].float().view(n, heads, -1), k) * self.scale
            dev = scores.device
            mask = torch.arange(total, device=dev)[None, :] > (total - n + torch.arange(n, device=dev))[:, None]
            probs = scores.masked_fill(mask, float("-inf")).softmax(-1)
            ref = torch.einsum("hqk,khd->qhd", probs, kv[..., nope:]).reshape(n, -1)
            stats["max_diff"] = max(stats["max_diff"], float((output[s:e].float() - ref).abs().max()))
        stats["steps"] += 1
        stats["mixed_steps"] += bool(md.num_decodes and md.num_reqs > md.num_decodes)
        stats["extend_steps"] += bool(md.num_extends)
        # context chunks forward_mha walked for this step (W // rows tokens per row, see there)
        rows = md.num_reqs - md.num_decodes
        if md.max_context_len and rows:
            per_row = max(self.context_chunk_tokens // rows, 1)
            per_row = per_row // 16 * 16 if per_row >= 16 else per_row
            stats["max_context_chunks"] = max(stats["max_context_chunks"], -(-md.max_context_len // per_row))
        stats["chunk_tokens"] = self.context_chunk_tokens
        return result

    stats.update(max_diff=0.0, steps=0, mixed_steps=0, extend_steps=0, max_context_chunks=0, chunk_tokens=None,
                 active=False)
    ATOMMLAImpl.forward = forward


def _model_info(llm: Any) -> dict[str, Any]:
    def info(model: Any) -> dict[str, Any]:
        layers = [m for _, m in model.named_modules() if hasattr(m, "impl")]
        return {
            "impls": sorted({type(m.impl).__name__ for m in layers}),
            "model": f"{type(model).__module__}.{type(model).__qualname__}",
            # set by the impl's process_weights_after_loading, reached from vLLM's loader
            "impl_weights": all(getattr(m.impl, "W_UK_T", None) is not None for m in layers),
            # vLLM's own MLAAttention.process_weights_after_loading puts these on the layer
            "layer_weights": any(hasattr(m, "W_UK_T") for m in layers),
        }

    return llm.apply_model(info)[0]


def run(model_dir: str, prompts: list, engine_kwargs: dict[str, Any] | None = None) -> dict[str, Any]:
    kwargs = dict(engine_kwargs or ENGINE_KWARGS)
    check = kwargs.pop("check_steps", False)
    without_amx = kwargs.pop("cpu_without_amx", False)
    use_vllm_deepseek()
    from vllm import LLM, SamplingParams

    stats: dict[str, Any] = {}
    if check:  # before the engine: each layer binds its impl's forward when its weights load
        install_step_check(stats)
    from tests.models._engine_runner import stock_mla_kwargs

    # vLLM's CPU platform asks while it builds the config; restored after (run may be called in-process)
    import torch
    from unittest import mock

    no_amx = mock.patch.object(torch.cpu, "_is_amx_tile_supported", lambda: False)
    with no_amx if without_amx else contextlib.nullcontext():
        llm = LLM(model=model_dir, **kwargs, **stock_mla_kwargs(model_dir, kwargs))
    stats["active"] = True
    try:
        out: dict[str, Any] = _model_info(llm)
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=1) for _, n in prompts]
        outputs = llm.generate([{"prompt_token_ids": p} for p, _ in prompts], params, use_tqdm=False)
        out["rows"] = [{
            "tokens": list(o.outputs[0].token_ids),
            "logprobs": [float(e[t].logprob) for e, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)],
        } for o in outputs]
        out["steps"] = stats
        from atom.patches import REGISTRY, status

        out["patches"] = {rec.id: status(rec).state.value for rec in REGISTRY.select("vllm.attention.mla")}
        sched = llm.llm_engine.vllm_config.scheduler_config
        out["chunked_prefill"] = bool(sched.enable_chunked_prefill)
        out["prefix_caching"] = bool(llm.llm_engine.vllm_config.cache_config.enable_prefix_caching)
        out["block_size"] = int(llm.llm_engine.vllm_config.cache_config.block_size)
        return out
    finally:
        del llm
        gc.collect()
        from vllm.distributed import cleanup_dist_env_and_memory

        cleanup_dist_env_and_memory()


def main(argv: list[str]) -> int:
    model_dir, prompts_path, out_path, *rest = argv
    for key, value in ENGINE_ENV.items():
        os.environ.setdefault(key, value)
    with open(prompts_path) as f:
        prompts = json.load(f)
    kwargs = json.loads(rest[0]) if rest else None
    with open(out_path, "w") as f:
        json.dump(run(model_dir, prompts, kwargs), f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
