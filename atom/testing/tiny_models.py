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
    # Llama 3.1-style: llama3 RoPE scaling (original context 64, so most frequencies are
    # interpolated), biases on attention and MLP, tied head.
    "llama": ("LlamaConfig", dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
        rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
        attention_bias=True, mlp_bias=True, tie_word_embeddings=True,
    )),
    "mixtral": ("MixtralConfig", dict(
        hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=512, rope_theta=10000.0,
        num_local_experts=8, num_experts_per_tok=2, sliding_window=None, tie_word_embeddings=False,
    )),
    # Layer 0 dense, layer 1 sparse (8 experts in 2 groups, top-2 from the best group, a shared
    # expert); partial rotary (half of each head), QK-norm, q/k/v biases; one MTP layer's
    # tensors after the last layer (see _add_mtp_layer), which loaders must skip.
    "glm4_moe": ("Glm4MoeConfig", dict(
        hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, n_group=2, topk_group=1,
        routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=1, attention_bias=True,
        use_qk_norm=True, num_nextn_predict_layers=1, tie_word_embeddings=False,
    )),
    # Layer 0 slides over the last 8 tokens (prompts cross it), layer 1 attends fully; YaRN with
    # an original context of 64 so positions past it are interpolated; swiglu alpha/limit are
    # GPT-OSS's (vLLM's kernels hard-code them); intermediate 64: vLLM-CPU's MoE kernel wants
    # multiples of 32 (per TP rank too), and 2 * 64 != hidden keeps the expert layout unambiguous.
    "gpt_oss": ("GptOssConfig", dict(
        hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, num_local_experts=4, num_experts_per_tok=2,
        sliding_window=8, layer_types=["sliding_attention", "full_attention"],
        max_position_embeddings=512, rms_norm_eps=1e-5, swiglu_alpha=1.702, swiglu_limit=7.0,
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 8.0,
                         "original_max_position_embeddings": 64, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False},
        tie_word_embeddings=False,
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
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                # A buffer in HF (zero-initialised): drawn so that the routing correction counts.
                b.normal_(0.0, 0.05)
        if kind == "gpt_oss":
            for name, p in model.named_parameters():
                if name.endswith("sinks"):
                    p.normal_(0.0, 1.0)  # sinks that visibly change every softmax
                elif name.endswith("experts.gate_up_proj"):
                    p.normal_(0.0, 0.5)  # gate/up values reach the SwiGLU clamp at +-7
    model = model.to(getattr(torch, dtype))
    model.save_pretrained(out, safe_serialization=True)
    if kind == "deepseek_v3":
        # transformers 5 neither keeps nor saves these; vLLM only creates the routing
        # correction bias (present in the checkpoint) when topk_method == "noaux_tc".
        cfg = json.loads((out / "config.json").read_text())
        cfg.update(topk_method="noaux_tc", scoring_func="sigmoid")
        (out / "config.json").write_text(json.dumps(cfg, indent=2))
    if kind == "glm4_moe":
        _add_mtp_layer(out, int(kwargs["num_hidden_layers"]))
    return out


def _add_mtp_layer(out: Path, num_layers: int) -> None:
    """Append tensors of one multi-token-prediction layer (``model.layers.{num_layers}.*``: the
    last decoder layer's weights plus MTP's own projection and norms), as GLM-4.5 checkpoints
    ship them; transformers' model neither builds nor saves it."""
    import torch
    from safetensors.torch import load_file, save_file

    path = out / "model.safetensors"
    tensors = load_file(str(path))
    last, mtp = f"model.layers.{num_layers - 1}.", f"model.layers.{num_layers}."
    extra = {mtp + name[len(last):]: t.clone() for name, t in tensors.items() if name.startswith(last)}
    hidden = tensors["model.norm.weight"].shape[0]
    dtype = tensors["model.norm.weight"].dtype
    g = torch.Generator().manual_seed(1)
    extra[mtp + "eh_proj.weight"] = (torch.randn(hidden, 2 * hidden, generator=g) * 0.08).to(dtype)
    for norm in ("enorm", "hnorm", "shared_head.norm"):
        extra[mtp + f"{norm}.weight"] = torch.ones(hidden, dtype=dtype)
    save_file({**tensors, **extra}, str(path), metadata={"format": "pt"})


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
