"""atom's MHA attention backend vs vLLM's default backend, end to end, in one invocation.

vLLM's own Qwen3 model (atom's model override is replaced by vLLM's class in each engine
process, so only the attention backend differs) on a Qwen3-shaped random checkpoint
(Qwen3-8B dimensions, ``--layers`` decoder layers, bf16), under ``compilation_config=
{"cudagraph_mode": MODE}`` for each MODE in ``--modes`` (default PIECEWISE and
FULL_AND_PIECEWISE), with atom's backend and with vLLM's default (``ATOM_DISABLE_VLLM_PLUGIN_
ATTENTION=1``: the parent platform's choice, FLASH_ATTN on an H100). One engine per subprocess.

Per configuration: greedy tokens + logprobs of a fixed mixed-length prompt set, decode
throughput (``--prompts`` x ``--new-tokens`` output tokens, ignore_eos) and batch-1 ms/token.
Per mode: greedy-token agreement and max/mean |logprob difference| of atom vs default (over the
positions before the first differing token), and the atom/default throughput ratios. JSON to
``--out``; a summary table on stdout.

    python bench/attention_e2e.py --out /tmp/out/attn.json            # H100
    python bench/attention_e2e.py --smoke --out /tmp/attn_smoke.json  # CPU: tiny fp32, eager

The ``attn`` step of ``bench/gpu_run.sh`` runs the first line.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

QWEN3_8B = dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                intermediate_size=12288, vocab_size=32000)
TINY = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
            intermediate_size=256, vocab_size=1024)
VLLM_QWEN3 = "vllm.model_executor.models.qwen3:Qwen3ForCausalLM"
#: ``--arch deepseek``: DeepSeek-V3 attention (128-head MLA, q_lora 1536, kv_lora 512, rope 64)
#: with dense MLPs only (every layer below first_k_dense_replace), so only MLA is compared.
DEEPSEEK_V3 = dict(hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048, n_routed_experts=8,
                   num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1,
                   num_attention_heads=128, num_key_value_heads=128, q_lora_rank=1536, kv_lora_rank=512,
                   qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, vocab_size=32000)
TINY_DEEPSEEK = dict(DEEPSEEK_V3, hidden_size=128, intermediate_size=256, moe_intermediate_size=32,
                     num_attention_heads=4, num_key_value_heads=4, q_lora_rank=64, qk_nope_head_dim=32,
                     v_head_dim=32, vocab_size=1024)
VLLM_MODELS = {"qwen3": ("Qwen3ForCausalLM", VLLM_QWEN3),
               "deepseek": ("DeepseekV3ForCausalLM", "vllm.model_executor.models.deepseek_v2:DeepseekV3ForCausalLM")}
AGREE_LENGTHS = (3, 17, 64, 129, 300, 511, 5, 90)  # mixed prompt lengths, one batch


# ----------------------------------------------------------------------------- checkpoint
def build_checkpoint(out: Path, dims: dict, layers: int, dtype: str, arch: str = "qwen3") -> Path:
    """A random Qwen3 (or dense-MLP DeepSeek-V3) checkpoint (config + safetensors; no tokenizer:
    prompts are token ids)."""
    if (out / "config.json").exists():
        return out
    import torch
    import transformers

    common = dict(num_hidden_layers=layers, max_position_embeddings=4096, tie_word_embeddings=False,
                  torch_dtype=dtype, rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=1)
    if arch == "deepseek":
        cfg = transformers.DeepseekV3Config(first_k_dense_replace=layers, **common, **dims)
    else:
        cfg = transformers.Qwen3Config(**common, **dims)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).to(getattr(torch, dtype))
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    return out


# ----------------------------------------------------------------------------- one engine
def _use_vllm_model(arch: str) -> None:
    """Load vLLM's plugins now (atom registers its model overrides), then put vLLM's own class
    for ``arch`` back: the engine runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0), so
    the later plugin load is a no-op and vLLM's model is built."""
    from vllm import ModelRegistry
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    ModelRegistry.register_model(*VLLM_MODELS[arch])


def _rows(outputs: Any) -> list[dict]:
    rows = []
    for o in outputs:
        c = o.outputs[0]
        rows.append({"tokens": list(c.token_ids),
                     "logprobs": [float(e[t].logprob) for e, t in zip(c.logprobs, c.token_ids)]})
    return rows


def worker(args: argparse.Namespace) -> dict:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if args.backend == "default":
        os.environ["ATOM_DISABLE_VLLM_PLUGIN_ATTENTION"] = "1"
    if not args.atom_model:
        _use_vllm_model(args.arch)
    from vllm import LLM, SamplingParams

    kwargs: dict[str, Any] = dict(model=args.model, dtype=args.dtype, max_model_len=args.max_model_len,
                                  seed=0, skip_tokenizer_init=True, max_num_seqs=args.prompts,
                                  gpu_memory_utilization=args.gpu_memory_utilization)
    if args.mode == "eager":
        kwargs["enforce_eager"] = True
    else:
        kwargs["compilation_config"] = {"cudagraph_mode": args.mode}
    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    res: dict[str, Any] = {"backend": args.backend, "mode": args.mode, "init_s": round(time.perf_counter() - t0, 1)}

    def classes(model: Any) -> list[str]:
        return [type(model).__module__ + "." + type(model).__name__,
                *sorted({type(m.impl).__name__ for _, m in model.named_modules() if hasattr(m, "impl")})]

    res["model_class"], *res["attention_impls"] = llm.apply_model(classes)[0]
    import vllm

    res["vllm"] = vllm.__version__
    rng = random.Random(0)
    vocab = args.vocab

    def prompt(n: int) -> dict:
        return {"prompt_token_ids": [rng.randrange(10, vocab - 10) for _ in range(n)]}

    greedy = dict(temperature=0.0, ignore_eos=True, detokenize=False)
    agree_prompts = [prompt(min(n, args.max_model_len - args.agree_tokens - 1)) for n in AGREE_LENGTHS]
    outs = llm.generate(agree_prompts, SamplingParams(max_tokens=args.agree_tokens, logprobs=1, **greedy),
                        use_tqdm=False)
    res["agreement_rows"] = _rows(outs)

    batch = [prompt(args.prompt_len) for _ in range(args.prompts)]
    sp = SamplingParams(max_tokens=args.new_tokens, **greedy)
    llm.generate(batch, sp, use_tqdm=False)  # warm-up (Triton JIT, graphs for every batch size)
    runs = []
    for _ in range(args.reps):
        batch = [prompt(args.prompt_len) for _ in range(args.prompts)]
        t0 = time.perf_counter()
        outs = llm.generate(batch, sp, use_tqdm=False)
        dt = time.perf_counter() - t0
        n_out = sum(len(o.outputs[0].token_ids) for o in outs)
        runs.append({"wall_s": round(dt, 3), "out_tokens": n_out, "out_tok_per_s": round(n_out / dt, 1)})
    res["throughput"] = runs
    res["out_tok_per_s"] = max(r["out_tok_per_s"] for r in runs)

    b1 = SamplingParams(max_tokens=args.new_tokens, **greedy)
    llm.generate([prompt(args.prompt_len)], b1, use_tqdm=False)
    lat = []
    for _ in range(args.reps):
        t0 = time.perf_counter()
        o = llm.generate([prompt(args.prompt_len)], b1, use_tqdm=False)
        dt = time.perf_counter() - t0
        lat.append(round(1000 * dt / len(o[0].outputs[0].token_ids), 3))
    res["batch1_ms_per_token"] = min(lat)
    res["batch1_runs_ms_per_token"] = lat
    return res


# ----------------------------------------------------------------------------- compare
def compare(atom: dict, default: dict) -> dict:
    """Greedy agreement and logprob differences over the positions before the first mismatch."""
    same_seqs, agree_pos, total_pos, diffs = 0, 0, 0, []
    for a, d in zip(atom["agreement_rows"], default["agreement_rows"]):
        total_pos += len(d["tokens"])
        same_seqs += a["tokens"] == d["tokens"]
        for ta, td, la, ld in zip(a["tokens"], d["tokens"], a["logprobs"], d["logprobs"]):
            diffs.append(abs(la - ld))  # same context so far: comparable
            if ta != td:
                break
            agree_pos += 1
    return {
        "identical_sequences": f"{same_seqs}/{len(default['agreement_rows'])}",
        "tokens_before_first_divergence": f"{agree_pos}/{total_pos}",
        "max_abs_logprob_diff": max(diffs) if diffs else None,
        "mean_abs_logprob_diff": sum(diffs) / len(diffs) if diffs else None,
        "out_tok_per_s_ratio_atom_over_default": round(atom["out_tok_per_s"] / default["out_tok_per_s"], 3),
        "batch1_ms_per_token_ratio_atom_over_default":
            round(atom["batch1_ms_per_token"] / default["batch1_ms_per_token"], 3),
    }


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="JSON result path")
    p.add_argument("--smoke", action="store_true", help="tiny fp32 model, eager, on CPU")
    p.add_argument("--model", help="checkpoint dir (built when missing)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--modes", default="PIECEWISE,FULL_AND_PIECEWISE")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--agree-tokens", type=int, default=32)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.6)
    p.add_argument("--atom-model", action="store_true", help="keep atom's model (default: vLLM's)")
    p.add_argument("--arch", choices=sorted(VLLM_MODELS), default="qwen3",
                   help="qwen3: MHA (Qwen3-8B dims); deepseek: MLA (DeepSeek-V3 attention, dense MLPs)")
    p.add_argument("--timeout", type=int, default=900, help="seconds per configuration")
    # worker-only
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--backend", choices=("atom", "default"), help=argparse.SUPPRESS)
    p.add_argument("--mode", help=argparse.SUPPRESS)
    p.add_argument("--dtype", default="bfloat16", help=argparse.SUPPRESS)
    p.add_argument("--vocab", type=int, default=QWEN3_8B["vocab_size"], help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.worker:
        res = worker(args)
        Path(args.out).write_text(json.dumps(res))
        return 0

    if args.arch == "deepseek":
        dims, dtype = (TINY_DEEPSEEK, "float32") if args.smoke else (DEEPSEEK_V3, "bfloat16")
    else:
        dims, dtype = (TINY, "float32") if args.smoke else (QWEN3_8B, "bfloat16")
    modes = ["eager"] if args.smoke else args.modes.split(",")
    if args.smoke:
        args.layers = min(args.layers, 2)
        args.prompts, args.prompt_len, args.new_tokens, args.reps = 4, 16, 8, 1
        args.agree_tokens, args.max_model_len = 8, 640
    work = Path(tempfile.mkdtemp(prefix="attn_e2e_"))
    model = Path(args.model) if args.model else work / f"{args.arch}-{'tiny' if args.smoke else 'dims'}-{args.layers}l"
    t0 = time.perf_counter()
    build_checkpoint(model, dims, args.layers, dtype, args.arch)
    print(f"[attn-e2e] checkpoint {model} ({time.perf_counter() - t0:.0f}s)", flush=True)

    env = dict(os.environ)
    if args.smoke:
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    results: dict[str, Any] = {"arch": args.arch, "model": str(model), "dims": dims, "layers": args.layers, "dtype": dtype,
                               "prompts": args.prompts, "prompt_len": args.prompt_len,
                               "new_tokens": args.new_tokens, "runs": {}, "compare": {}}
    for mode in modes:
        for backend in ("atom", "default"):
            part = work / f"{mode}_{backend}.json"
            cmd = [sys.executable, __file__, "--worker", "--backend", backend, "--mode", mode,
                   "--model", str(model), "--out", str(part), "--dtype", dtype,
                   "--vocab", str(dims["vocab_size"]), "--prompts", str(args.prompts),
                   "--prompt-len", str(args.prompt_len), "--new-tokens", str(args.new_tokens),
                   "--agree-tokens", str(args.agree_tokens), "--reps", str(args.reps),
                   "--max-model-len", str(args.max_model_len),
                   "--gpu-memory-utilization", str(args.gpu_memory_utilization)]
            cmd += ["--arch", args.arch]
            if args.atom_model:
                cmd.append("--atom-model")
            t0 = time.perf_counter()
            try:
                proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
                rc, tail = proc.returncode, (proc.stdout + proc.stderr)[-3000:]
            except subprocess.TimeoutExpired as exc:
                rc, tail = -1, f"timed out after {args.timeout}s: {str(exc.stderr or '')[-2000:]}"
            key = f"{mode}/{backend}"
            if rc != 0 or not part.exists():
                results["runs"][key] = {"error": f"exit {rc}", "log_tail": tail}
                print(f"[attn-e2e] {key}: FAILED (exit {rc})\n{tail}", flush=True)
                continue
            res = json.loads(part.read_text())
            res["wall_s"] = round(time.perf_counter() - t0, 1)
            results["runs"][key] = res
            print(f"[attn-e2e] {key}: {res['attention_impls']} {res['model_class']} "
                  f"{res['out_tok_per_s']} out tok/s, batch-1 {res['batch1_ms_per_token']} ms/token "
                  f"({res['wall_s']}s)", flush=True)
        a, d = results["runs"].get(f"{mode}/atom", {}), results["runs"].get(f"{mode}/default", {})
        if "error" not in a and "error" not in d and a and d:
            results["compare"][mode] = compare(a, d)
            print(f"[attn-e2e] {mode}: {json.dumps(results['compare'][mode])}", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1))
    ok = all("error" not in r for r in results["runs"].values()) and len(results["compare"]) == len(modes)
    print(f"[attn-e2e] {'OK' if ok else 'INCOMPLETE'} -> {args.out}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
