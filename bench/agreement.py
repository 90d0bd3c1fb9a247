#!/usr/bin/env python
"""Greedy agreement and logprob closeness of several engine configurations against one reference,
on one random-weight checkpoint, in one invocation (the correctness side of ``bench/e2e.py``).

Why: with random weights every next-token distribution is nearly flat, so two bf16 runs that differ
only in rounding part ways after a few tokens and stay apart (every later token sees different
text). A low bf16-vs-bf16 agreement alone therefore cannot tell a bug from rounding. This script
measures each configuration against a higher-precision reference (default: stock vLLM in fp32)
three ways:

* ``agree`` / ``prefix``: free-running greedy tokens, the fraction of output positions equal to
  the reference's, and the fraction before each sequence's first divergence;
* ``dlp``: |logprob difference| of the chosen token over the positions before that divergence
  (same context on both sides, the decode path);
* ``tf``: teacher forcing: the reference's prompt + output scored with ``prompt_logprobs`` (the
  prefill path), so every position has the same context on every side: ``tf_top1`` is the fraction
  of output positions whose top-1 token is the reference's token, ``tf_dlp`` the mean |logprob
  difference| of the reference token. A rounding-only difference keeps ``tf_top1`` near the
  reference's own near-tie rate; a bug shows up as a lower ``tf_top1`` and a larger ``tf_dlp``.

Configurations (``--configs``, comma separated; the first is the reference):
``stock-fp32``, ``atom-fp32``, ``stock``, ``atom`` (bf16, CUDA graphs + compile), ``stock-eager``,
``atom-eager``, ``atom-torch-ops`` / ``atom-torch-<op>`` (atom eager with ``ATOM_OPS_BACKEND`` forcing
the torch reference for all ops / one op), ``atom-fa`` (atom's model on vLLM's default attention,
``ATOM_DISABLE_VLLM_PLUGIN_ATTENTION=1``), ``vllm-model-atom-attn`` (vLLM's own model class on
atom's attention backend), ``stock-triton`` (stock on vLLM's TRITON_ATTN: a second stock backend,
the rounding-noise floor between two correct implementations), ``hf`` (HF transformers' own model:
the second oracle, free-running greedy through ``generate`` and the teacher-forced scores of one
forward pass per sequence). Any of them with ``-fp32`` runs in float32 (eager). One engine per
subprocess. The atom configs run atom's own model and attention on NVIDIA GPUs as well
(``ATOM_ENABLE_ON_NVIDIA=*``, ``ATOM_ENABLE_MHA_ON_NVIDIA=1``), where atom's defaults step aside
for a dense Qwen3 and for MHA attention: this tool checks atom's code, not its defaults.

    python bench/agreement.py --model-kind dense --out /tmp/out/agree.json           # H100
    python bench/agreement.py --smoke --out /tmp/agree_smoke.json                    # CPU
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))

import e2e_common  # noqa: E402  (prompts, base env)
import e2e_models  # noqa: E402  (checkpoint builder)

VLLM_CLASSES = {
    "Qwen3ForCausalLM": "vllm.model_executor.models.qwen3:Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM": "vllm.model_executor.models.qwen3_moe:Qwen3MoeForCausalLM",
    "DeepseekV3ForCausalLM": "vllm.model_executor.models.deepseek_v2:DeepseekV3ForCausalLM",
    "LlamaForCausalLM": "vllm.model_executor.models.llama:LlamaForCausalLM",
    "MixtralForCausalLM": "vllm.model_executor.models.mixtral:MixtralForCausalLM",
    "Glm4MoeForCausalLM": "vllm.model_executor.models.glm4_moe:Glm4MoeForCausalLM",
    "GptOssForCausalLM": "vllm.model_executor.models.gpt_oss:GptOssForCausalLM",
}


def config_spec(name: str) -> dict:
    """(side, dtype, eager, extra env, vLLM's model class?, extra LLM kwargs) of a config name; a
    ``-fp32`` suffix runs any config in float32 (eager unless the base config compiles)."""
    spec: dict[str, Any] = {"name": name, "side": "atom", "dtype": "bfloat16", "eager": True, "env": {},
                            "vllm_model": False, "llm": {}, "hf": False}
    base = name[: -len("-fp32")] if name.endswith("-fp32") else name
    if base.startswith("stock"):
        spec["side"] = "stock"
    if name.endswith("-fp32"):
        spec["dtype"] = "float32"
    if base in ("stock", "atom") and not name.endswith("-fp32"):
        spec["eager"] = False
    if base == "atom-torch-ops":
        spec["env"]["ATOM_OPS_BACKEND"] = "torch"
    elif base.startswith("atom-torch-"):
        spec["env"]["ATOM_OPS_BACKEND"] = f"{base[len('atom-torch-'):]}=torch"
    if base == "atom-fa":
        spec["env"]["ATOM_DISABLE_VLLM_PLUGIN_ATTENTION"] = "1"
    if base == "vllm-model-atom-attn":
        spec["vllm_model"] = True
    if base == "stock-triton":
        spec["llm"]["attention_config"] = {"backend": "TRITON_ATTN"}
    if base == "hf":
        spec["hf"] = True
    if spec["side"] == "atom" and not spec["hf"]:
        # atom's own code on every device, as the suite's tests/conftest.py runs it: atom's NVIDIA
        # step-asides (vLLM's model for a dense Qwen3, vLLM's MHA attention) would make an atom
        # config vLLM's own there. atom-fa keeps vLLM's attention under atom's model.
        spec["env"]["ATOM_ENABLE_ON_NVIDIA"] = "*"
        if base != "atom-fa":
            spec["env"]["ATOM_ENABLE_MHA_ON_NVIDIA"] = "1"
    known = {"stock", "atom", "stock-eager", "atom-eager", "atom-torch-ops", "atom-fa", "vllm-model-atom-attn",
             "stock-triton", "hf"}
    if base not in known and not base.startswith("atom-torch-"):
        raise SystemExit(f"unknown config {name!r}; known: {', '.join(sorted(known))}, atom-torch-<op>, "
                         "each also with -fp32")
    return spec


def hf_child(spec: dict, cfg: dict, out_path: str) -> None:
    """The ``hf`` config: HF transformers' own model (the second oracle) on the GPU when there is
    one, greedy free-running rows and the teacher-forced scores, as the vLLM configs write them."""
    import torch
    import transformers

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, cfg["dtype"])
    t0 = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_pretrained(spec["model"], dtype=dtype).to(dev).eval()
    model.generation_config.eos_token_id = None  # as the engines' ignore_eos: every row n_out tokens
    res: dict[str, Any] = {"config": cfg["name"], "init_s": round(time.perf_counter() - t0, 1),
                           "model_class": type(model).__module__ + "." + type(model).__name__,
                           "attention_impls": [str(model.config._attn_implementation)]}
    prompts, n_out = spec["prompts"], spec["out_len"]
    rows: list[dict] = []
    with torch.no_grad():
        for i in range(0, len(prompts), 8):  # the prompts have one length: no padding
            ids = torch.tensor(prompts[i:i + 8], device=dev)
            g = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n_out,
                               do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
            new = g.sequences[:, ids.shape[1]:]
            lp = torch.stack([torch.log_softmax(step.float(), -1) for step in g.logits], 1)  # [b, n_out, V]
            chosen = lp.gather(-1, new[..., None])[..., 0]
            rows += [{"tokens": t.tolist(), "logprobs": c.tolist()} for t, c in zip(new, chosen)]
        res["rows"] = rows
        ref_path = spec.get("reference_rows")
        seqs = json.loads(Path(ref_path).read_text()) if ref_path else rows
        tf = []
        for p, r in zip(prompts, seqs):
            full = torch.tensor([p + r["tokens"]], device=dev)
            lp = torch.log_softmax(model(full).logits[0].float(), -1)  # position i predicts token i + 1
            pos = torch.arange(len(p), len(p) + len(r["tokens"]), device=dev)
            tf.append({"lp": lp[pos - 1].gather(-1, full[0, pos][:, None])[:, 0].tolist(),
                       "top1": lp[pos - 1].argmax(-1).tolist()})
    res["tf"] = tf
    Path(out_path).write_text(json.dumps(res))


# ----------------------------------------------------------------------------------- child
def child(spec_path: str, out_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    cfg = spec["config"]
    if cfg.get("hf"):
        return hf_child(spec, cfg, out_path)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # model-class override must reach the engine
    if cfg["vllm_model"]:
        # Load the plugins now (atom registers its model overrides), then put vLLM's own class
        # back; the engine runs in this process, so the later plugin load is a no-op.
        from vllm import ModelRegistry
        from vllm.plugins import load_general_plugins

        load_general_plugins()

        arch = json.loads((Path(spec["model"]) / "config.json").read_text())["architectures"][0]
        ModelRegistry.register_model(arch, VLLM_CLASSES[arch])
    from vllm import LLM, SamplingParams

    t0 = time.perf_counter()
    kwargs: dict[str, Any] = dict(model=spec["model"], dtype=cfg["dtype"], max_model_len=spec["max_model_len"],
                                  seed=0, skip_tokenizer_init=True, max_num_seqs=spec["max_num_seqs"],
                                  enable_prefix_caching=False, gpu_memory_utilization=spec["gpu_mem"],
                                  max_logprobs=2, **cfg["llm"])
    if cfg["eager"]:
        kwargs["enforce_eager"] = True
    res: dict[str, Any] = {"config": cfg["name"]}
    try:
        llm = LLM(**kwargs)
    except Exception as exc:
        res["error"] = f"LLM(): {type(exc).__name__}: {exc}"[:600]
        Path(out_path).write_text(json.dumps(res))
        return
    res["init_s"] = round(time.perf_counter() - t0, 1)

    def classes(model: Any) -> list[str]:
        return [type(model).__module__ + "." + type(model).__name__,
                *sorted({type(m.impl).__name__ for _, m in model.named_modules() if hasattr(m, "impl")})]

    try:
        res["model_class"], *res["attention_impls"] = llm.apply_model(classes)[0]
    except Exception as exc:  # informational only
        res["model_class"] = f"? ({type(exc).__name__})"
    prompts = spec["prompts"]
    greedy = dict(temperature=0.0, ignore_eos=True, detokenize=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=spec["out_len"], logprobs=1, **greedy), use_tqdm=False)
    rows = []
    for o in outs:
        c = o.outputs[0]
        rows.append({"tokens": list(c.token_ids),
                     "logprobs": [float(e[t].logprob) for e, t in zip(c.logprobs, c.token_ids)]})
    res["rows"] = rows
    ref_path = spec.get("reference_rows")
    seqs = json.loads(Path(ref_path).read_text()) if ref_path else rows
    # Teacher forcing: the reference's full sequences, scored position by position (prefill path).
    scored = llm.generate([{"prompt_token_ids": p + r["tokens"]} for p, r in zip(prompts, seqs)],
                          SamplingParams(max_tokens=1, prompt_logprobs=1, **greedy), use_tqdm=False)
    tf = []
    for p, r, o in zip(prompts, seqs, scored):
        plp = o.prompt_logprobs  # [None, {tok: Logprob}, ...] per prompt position
        pos = range(len(p), len(p) + len(r["tokens"]))
        lp_ref_tok, top1 = [], []
        for i in pos:
            d = plp[i]
            tok = (p + r["tokens"])[i]
            lp_ref_tok.append(float(d[tok].logprob))
            top1.append(int(min(d.items(), key=lambda kv: kv[1].rank)[0]))
        tf.append({"lp": lp_ref_tok, "top1": top1})
    res["tf"] = tf
    Path(out_path).write_text(json.dumps(res))


# ----------------------------------------------------------------------------------- parent
def compare(ref: dict, other: dict) -> dict:
    same = total = prefix = identical = 0
    dlp: list[float] = []
    for a, b in zip(ref["rows"], other["rows"]):
        x, y = a["tokens"], b["tokens"]
        n = min(len(x), len(y))
        total += n
        same += sum(1 for i in range(n) if x[i] == y[i])
        first = next((i for i in range(n) if x[i] != y[i]), n)
        prefix += first
        identical += int(x == y)
        dlp += [abs(a["logprobs"][i] - b["logprobs"][i]) for i in range(first)]
    out = {"agree": same / total, "prefix": prefix / total, "identical": identical, "n": len(ref["rows"]),
           "dlp_mean": statistics.fmean(dlp) if dlp else None, "dlp_max": max(dlp) if dlp else None}
    top1 = tf_total = 0
    tf_dlp: list[float] = []
    for a, b, r in zip(ref["tf"], other["tf"], ref["rows"]):
        top1 += sum(int(t == g) for t, g in zip(b["top1"], r["tokens"]))
        tf_total += len(r["tokens"])
        tf_dlp += [abs(u - v) for u, v in zip(a["lp"], b["lp"])]
    out.update(tf_top1=top1 / tf_total, tf_dlp_mean=statistics.fmean(tf_dlp), tf_dlp_max=max(tf_dlp),
               tf_dlp_p99=sorted(tf_dlp)[int(0.99 * (len(tf_dlp) - 1))])
    return out


def near_ties(ref: dict) -> float:
    """Fraction of the reference's teacher-forced positions whose top-1 token is not its own greedy
    token (fp32 prefill vs fp32 decode); the floor that rounding alone produces."""
    bad = total = 0
    for t, r in zip(ref["tf"], ref["rows"]):
        bad += sum(int(a != b) for a, b in zip(t["top1"], r["tokens"]))
        total += len(r["tokens"])
    return bad / total


def run_config(name: str, base: dict, env: dict[str, str], workdir: Path, timeout: float,
               cache_root: Optional[str] = None) -> dict:
    """One config's engine in a subprocess; ``cache_root``: its ``VLLM_CACHE_ROOT``, ``{side}``
    replaced by stock / atom (None: the environment's)."""
    cfg = config_spec(name)
    spec = dict(base, config=cfg)
    spec_path, out_path = workdir / f"{name}.spec.json", workdir / f"{name}.json"
    spec_path.write_text(json.dumps(spec))
    child_env = {**e2e_common.side_env(cfg["side"], env), **cfg["env"]}
    if cfg["side"] == "atom":
        # atom on is the switch absent, as bench/ab.py's atom side runs it: a set "0" would be one more
        # factor of atom's compile-cache key (atom.plugin.vllm.platform.compile_cache_factors)
        child_env.pop("ATOM_DISABLE_VLLM_PLUGIN", None)
    if cache_root:
        child_env["VLLM_CACHE_ROOT"] = cache_root.format(side=cfg["side"])
    t0 = time.time()
    log_path = workdir / f"{name}.log"
    with open(log_path, "w") as f:
        try:
            rc = subprocess.run([sys.executable, __file__, "_child", str(spec_path), str(out_path)], env=child_env,
                                stdout=f, stderr=subprocess.STDOUT, cwd=REPO, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    if not out_path.exists():
        tail = log_path.read_text(errors="replace").splitlines()[-15:]
        return {"config": name, "error": f"rc={rc} after {time.time() - t0:.0f} s", "log_tail": tail}
    res = json.loads(out_path.read_text())
    res["wall_s"] = round(time.time() - t0, 1)
    return res


def fmt(x: Optional[float], pct: bool = False) -> str:
    if x is None:
        return "-"
    return f"{100 * x:.1f}%" if pct else f"{x:.4f}"


def main(argv: list[str]) -> int:
    if argv and argv[0] == "_child":
        child(argv[1], argv[2])
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-kind", default="dense", choices=sorted(e2e_models.MODELS))
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--init-std", type=float, default=0.02)
    ap.add_argument("--mla-experts", type=int, default=32)
    ap.add_argument("--model-dir", default="/tmp/atom-e2e-models")
    ap.add_argument("--model", default=None, help="an existing checkpoint instead of building one")
    ap.add_argument("--configs", default="stock-fp32,atom-fp32,stock-eager,atom-eager,stock,atom")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--lengths", default="128/128")
    ap.add_argument("--gpu-mem", type=float, default=0.85)
    ap.add_argument("--timeout", type=float, default=240)
    ap.add_argument("--budget", type=float, default=560, help="seconds; no new config starts after this")
    ap.add_argument("--smoke", action="store_true", help="CPU: a tiny fp32 model, few prompts")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--cache-root", default=None,
                    help="VLLM_CACHE_ROOT per engine, '{side}' replaced by stock / atom (e.g. "
                         "/tmp/vcache-{side}: bench/gpu_run.sh ab's, whose engines then find these compiled "
                         "graphs when their settings hash alike)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    t_start = time.time()
    in_len, out_len = (int(v) for v in args.lengths.split("/"))
    env = e2e_common.base_env()
    if args.smoke:
        info = e2e_models.build_smoke_model(args.model_kind, Path(args.model_dir))
        model, vocab = info["path"], info["vocab"]
        args.prompts, in_len, out_len = min(args.prompts, 4), min(in_len, 16), min(out_len, 8)
    elif args.model:
        model, vocab = args.model, json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    else:
        layers = args.layers or e2e_models.MODELS[args.model_kind][2]
        std = f"-std{args.init_std}" if args.init_std != 0.02 else ""
        path = Path(args.model_dir) / f"{args.model_kind}-L{layers}-v{args.vocab}{std}"
        e2e_models.build_model(args.model_kind, layers, path, args.vocab, args.mla_experts, args.init_std)
        model, vocab = str(path), args.vocab
    workdir = Path(args.workdir or f"/tmp/atom-agreement-{os.getpid()}")
    workdir.mkdir(parents=True, exist_ok=True)
    prompts = [p["prompt_token_ids"] for p in e2e_common.prompts_for(random.Random(0), args.prompts, in_len, vocab)]
    base = {"model": model, "prompts": prompts, "out_len": out_len, "max_model_len": in_len + out_len + 16,
            "max_num_seqs": max(args.prompts, 1), "gpu_mem": args.gpu_mem}
    names = [c.strip() for c in args.configs.split(",") if c.strip()]
    for n in names:
        config_spec(n)  # unknown names fail before any engine starts
    results: dict[str, dict] = {}
    for i, name in enumerate(names):
        if time.time() - t_start > args.budget:
            results[name] = {"config": name, "error": "skipped (budget)"}
            continue
        spec = dict(base)
        if i > 0 and "rows" in results[names[0]]:
            ref_rows = workdir / "reference_rows.json"
            spec["reference_rows"] = str(ref_rows)
        print(f"[agree {time.strftime('%H:%M:%S')}] {name} ...", flush=True)
        results[name] = run_config(name, spec, env, workdir, args.timeout, args.cache_root)
        r = results[name]
        if i == 0 and "rows" in r:
            (workdir / "reference_rows.json").write_text(json.dumps(r["rows"]))
        print(f"[agree {time.strftime('%H:%M:%S')}] {name}: "
              f"{r.get('error') or (str(r.get('model_class')) + ' ' + str(r.get('attention_impls')) + ' ' + str(r.get('wall_s')) + ' s')}",
              flush=True)
    ref_name = names[0]
    ref = results[ref_name]
    table = []
    if "rows" in ref:
        table.append(f"reference: {ref_name}; its own teacher-forced top-1 != greedy on "
                     f"{100 * near_ties(ref):.2f}% of positions (near ties)")
        table.append("| config | agree | prefix | identical | dlp mean | dlp max | tf_top1 | tf_dlp mean | tf_dlp p99 | tf_dlp max |")
        table.append("|---|---|---|---|---|---|---|---|---|---|")
        for name in names[1:]:
            r = results[name]
            if "rows" not in r:
                table.append(f"| {name} | {r.get('error', '?')} |")
                continue
            c = compare(ref, r)
            r["vs_reference"] = c
            table.append(f"| {name} | {fmt(c['agree'], True)} | {fmt(c['prefix'], True)} | {c['identical']}/{c['n']} | "
                         f"{fmt(c['dlp_mean'])} | {fmt(c['dlp_max'])} | {fmt(c['tf_top1'], True)} | "
                         f"{fmt(c['tf_dlp_mean'])} | {fmt(c['tf_dlp_p99'])} | {fmt(c['tf_dlp_max'])} |")
        ok = [n for n in names if "rows" in results[n]]
        table.append("")
        table.append("pairwise free-running agreement (positions):")
        table.append("| | " + " | ".join(ok) + " |")
        table.append("|---" * (len(ok) + 1) + "|")
        for a in ok:
            cells = [fmt(compare(results[a], results[b])["agree"], True) if a != b else "-" for b in ok]
            table.append(f"| {a} | " + " | ".join(cells) + " |")
    text = "\n".join(table)
    print(text, flush=True)
    if args.out:
        slim = {n: {k: v for k, v in r.items() if k not in ("rows", "tf")} for n, r in results.items()}
        Path(args.out).write_text(json.dumps({"model": model, "prompts": args.prompts, "lengths": [in_len, out_len],
                                              "configs": names, "results": slim, "table": text,
                                              "elapsed_s": round(time.time() - t_start, 1)}, indent=1))
    return 0 if "rows" in ref else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
