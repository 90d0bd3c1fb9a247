"""bench/NOTES.md 68: on vLLM-CPU, how many experts a decode step of 128 sequences reaches with stock vLLM's
Qwen3-MoE (Qwen3-30B-A3B dims, N layers, vLLM's dummy weights, bf16, eager): forward hooks on each router."""
import json, os, random, sys
from pathlib import Path
sys.path[:0] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parents[3])]  # bench/, the repo
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
RECORD = []
def main():
    from e2e_models import build_model
    layers = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    d = Path(f"/tmp/route-probe/moe-L{layers}-dummy")
    build_model("moe", layers, d, 32000, 64, 0.02, weights=False)
    from vllm import LLM, SamplingParams
    llm = LLM(model=str(d), dtype="bfloat16", max_model_len=256, max_num_seqs=128, enforce_eager=True, seed=0,
              load_format="dummy")
    def hook(model):
        import torch
        gates = [m for n, m in model.named_modules() if n.endswith("mlp.gate")]
        def rec(mod, inp, out):
            logits = out[0] if isinstance(out, tuple) else out
            if logits.shape[0] <= 128:  # decode steps
                top = logits.float().topk(8, dim=-1).indices
                RECORD.append((logits.shape[0], int(torch.unique(top).numel()),
                               int(torch.bincount(top.flatten(), minlength=logits.shape[1]).max())))
        for g in gates:
            g.register_forward_hook(rec)
        return len(gates)
    print("gates", llm.apply_model(hook))
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(10, 31990) for _ in range(64)]} for _ in range(128)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    toks = [o.outputs[0].token_ids for o in outs]
    print("distinct tokens per step", [len({t[j] for t in toks}) for j in range(12)])
    print("decode router records (tokens, distinct experts, max load):", RECORD[:12], "...", RECORD[-4:])
if __name__ == "__main__":
    main()
