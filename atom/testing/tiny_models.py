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
    # fp8 checkpoints (see FP8 below): the tiny models' weights quantised after the random init.
    # Per-tensor: the qwen3 dims. Block-scaled [128, 128] (as Qwen3-FP8 / DeepSeek-V3 ship):
    # every fused output (q, k, v, gate, up, expert gate/up) and every reduction dim a multiple
    # of 128, which vLLM's block-shape validation requires.
    "qwen3_fp8": ("Qwen3Config", dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=512, rope_theta=10000.0,
        tie_word_embeddings=False,
    )),
    "qwen3_fp8_block": ("Qwen3Config", dict(
        hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, max_position_embeddings=512, rope_theta=10000.0,
        tie_word_embeddings=False,
    )),
    "qwen3_moe_fp8_block": ("Qwen3MoeConfig", dict(
        hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, max_position_embeddings=512, rope_theta=10000.0,
        moe_intermediate_size=128, num_experts=8, num_experts_per_tok=2, decoder_sparse_step=1,
        mlp_only_layers=[], norm_topk_prob=True, tie_word_embeddings=False,
    )),
    # DeepSeek-V3's release format at tiny size: layer 0 dense, layer 1 MoE (8 experts in 2
    # groups, top-2 from the best group, a shared expert), MLA with q-LoRA, one MTP layer's
    # tensors (fp8 too) after the last layer. Tiles, as in the real model: q_a_proj (128 rows)
    # then kv_a_proj_with_mqa (512 + 64 = 576 rows: 4.5 tiles, a partial last one) fused; hidden
    # 192 = 1.5 tiles, so every projection reading the hidden state has a partial input tile and
    # o_proj / down_proj / the experts' down a partial output tile.
    "deepseek_v3_fp8_block": ("DeepseekV3Config", dict(
        hidden_size=192, intermediate_size=256, moe_intermediate_size=128, n_routed_experts=8,
        num_experts_per_tok=2, n_shared_experts=1, n_group=2, topk_group=1, routed_scaling_factor=2.5,
        first_k_dense_replace=1, topk_method="noaux_tc", scoring_func="sigmoid",
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=128,
        kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32,
        max_position_embeddings=512, tie_word_embeddings=False,
    )),
}

#: kind -> HF ``quantization_config`` written into config.json. Quantised: every decoder
#: projection (attention, MLP, experts) except the ``ignored_layers`` (kept in the checkpoint's
#: dtype); never the embedding, lm_head, norms or the MoE router. Qwen3-MoE's routers are listed
#: too, as Qwen3-30B-A3B-FP8 lists them (``modules_to_not_convert``): vLLM's Qwen3-MoE router takes
#: the fp8 config and would otherwise quantise the bf16 router, keeping a placeholder scale.
FP8: dict[str, dict[str, Any]] = {
    "qwen3_fp8": dict(quant_method="fp8", activation_scheme="static",
                      ignored_layers=["model.layers.1.mlp.down_proj"]),
    "qwen3_fp8_block": dict(quant_method="fp8", activation_scheme="dynamic", weight_block_size=[128, 128],
                            ignored_layers=["model.layers.1.mlp.down_proj"]),
    "qwen3_moe_fp8_block": dict(quant_method="fp8", activation_scheme="dynamic", weight_block_size=[128, 128],
                                ignored_layers=["model.layers.1.self_attn.o_proj", "model.layers.0.mlp.gate",
                                                "model.layers.1.mlp.gate"]),
    # DeepSeek-V3's config.json spells it so ("fmt"); no ignored layers there, two here.
    "deepseek_v3_fp8_block": dict(quant_method="fp8", activation_scheme="dynamic", fmt="e4m3",
                                  weight_block_size=[128, 128],
                                  ignored_layers=["model.layers.1.mlp.shared_experts.down_proj",
                                                  "model.layers.0.self_attn.o_proj"]),
}
FP8_MAX = 448.0
#: Kinds whose checkpoint carries one multi-token-prediction layer after the last decoder layer
#: (:func:`_add_mtp_layer`; quantised with the rest in an fp8 kind).
MTP_KINDS = ("glm4_moe", "deepseek_v3_fp8_block")

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


def build_tokenizer(out_dir: str | Path, vocab_size: int = VOCAB_SIZE - 24, *, pad_to: int | None = None,
                    corpus: list[str] | None = None) -> None:
    """Write a byte-level BPE tokenizer (HF ``PreTrainedTokenizerFast`` files, chat template
    included) into ``out_dir``.

    Args:
        vocab_size: tokens the BPE is trained to (special tokens included). The default leaves
            room below :data:`VOCAB_SIZE`, so every id the tokenizer produces is < the tiny
            models' ``config.vocab_size``.
        pad_to: when given, added tokens ``<|pad_i|>`` fill the ids up to it, so that every id a
            model of that vocabulary can emit decodes (bench/e2e.py's realistic vocabularies).
        corpus: training text; default: transformers' own sources (:func:`_corpus`).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus() if corpus is None else corpus, trainer=trainer)
    if pad_to is not None and tok.get_vocab_size() < pad_to:
        tok.add_tokens([f"<|pad_{i}|>" for i in range(pad_to - tok.get_vocab_size())])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|endoftext|>",
        pad_token="<|endoftext|>", unk_token=None,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)


def build(kind: str, out_dir: str | Path, seed: int = 0, dtype: str = "bfloat16", **overrides: Any) -> Path:
    """Write a tiny random checkpoint of ``kind`` (see :data:`KINDS`) into ``out_dir``; ``overrides``
    replace entries of the kind's config (e.g. ``num_hidden_layers=36``)."""
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
        torch_dtype=dtype, **{**kwargs, **overrides},
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
    if cls_name == "DeepseekV3Config":
        # transformers 5 neither keeps nor saves these; vLLM only creates the routing
        # correction bias (present in the checkpoint) when topk_method == "noaux_tc".
        cfg = json.loads((out / "config.json").read_text())
        cfg.update(topk_method="noaux_tc", scoring_func="sigmoid")
        if kind in MTP_KINDS:
            cfg["num_nextn_predict_layers"] = 1  # how vLLM's DeepSeek loader knows to skip them
        (out / "config.json").write_text(json.dumps(cfg, indent=2))
    if kind in MTP_KINDS:
        _add_mtp_layer(out, int(kwargs["num_hidden_layers"]))
    if kind in FP8:
        quantize_checkpoint(out, FP8[kind])
    return out


def _is_quantized(name: str, ignored: list[str]) -> bool:
    """A decoder layer's projection (``*_proj``, DeepSeek's ``kv_a_proj_with_mqa`` too)."""
    module = name.removesuffix(".weight")
    leaf = module.rpartition(".")[2]
    return (name.endswith(".weight") and "_proj" in leaf and ".layers." in name and module not in ignored)


def quantize_fp8(weight: "torch.Tensor", block: list[int] | None) -> tuple["torch.Tensor", "torch.Tensor"]:
    """``weight [N, K]`` -> (float8_e4m3fn values, float32 scale): one scale (a 0-d tensor) per
    tensor, or ``[ceil(N / bn), ceil(K / bk)]`` per block; ``weight ~= value * scale``."""
    import torch

    w = weight.float()
    if block is None:
        scale = (w.abs().amax().clamp(min=1e-12) / FP8_MAX)
        return (w / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale.reshape(())
    bn, bk = block
    n, k = w.shape
    gn, gk = -(-n // bn), -(-k // bk)
    padded = torch.nn.functional.pad(w, (0, gk * bk - k, 0, gn * bn - n))
    tiles = padded.view(gn, bn, gk, bk)
    scale = tiles.abs().amax(dim=(1, 3)).clamp(min=1e-12) / FP8_MAX
    q = (tiles / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).view(gn * bn, gk * bk)[:n, :k]
    return q.to(torch.float8_e4m3fn), scale


def quantize_checkpoint(out: Path, quant: dict[str, Any]) -> None:
    """Rewrite ``out``'s model.safetensors as an fp8 checkpoint in HF's ``fp8`` format:
    ``weight`` (float8_e4m3fn) plus ``weight_scale`` (per tensor; with ``input_scale`` when
    activations are static) or ``weight_scale_inv`` (per block, the DeepSeek-V3 name, still the
    multiplier: ``w = value * scale``)."""
    import torch
    from safetensors.torch import load_file, save_file

    block = quant.get("weight_block_size")
    ignored = list(quant.get("ignored_layers") or [])
    tensors = load_file(str(out / "model.safetensors"))
    gen = torch.Generator().manual_seed(1)
    result: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if not _is_quantized(name, ignored):
            result[name] = t
            continue
        module = name.removesuffix(".weight")
        q, scale = quantize_fp8(t, block)
        result[name] = q
        if block is None:
            result[f"{module}.weight_scale"] = scale
            if quant.get("activation_scheme") == "static":
                # A calibrated-looking static scale: activations here are O(1) (normed inputs).
                result[f"{module}.input_scale"] = torch.tensor(
                    (4.0 + torch.rand((), generator=gen).item()) / FP8_MAX, dtype=torch.float32)
        else:
            result[f"{module}.weight_scale_inv"] = scale
    save_file(result, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = quant
    (out / "config.json").write_text(json.dumps(cfg, indent=2))


def dequantized_tensors(model_dir: str | Path, dtype: str = "float32") -> dict[str, "torch.Tensor"]:
    """An fp8 checkpoint's tensors with every quantised weight replaced by ``value * scale``
    (computed in float32, then cast to ``dtype``) and the scales dropped: the unquantised model
    that a weight-only fp8 path computes with."""
    import torch
    from safetensors.torch import load_file

    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    block = cfg["quantization_config"].get("weight_block_size")
    tensors = load_file(str(Path(model_dir) / "model.safetensors"))
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if name.endswith((".weight_scale", ".weight_scale_inv", ".input_scale")):
            continue
        if t.dtype == torch.float8_e4m3fn:
            module = name.removesuffix(".weight")
            if block is None:
                w = t.float() * tensors[f"{module}.weight_scale"].float()
            else:
                bn, bk = block
                s = tensors[f"{module}.weight_scale_inv"].float()
                s = s.repeat_interleave(bn, 0)[: t.shape[0]].repeat_interleave(bk, 1)[:, : t.shape[1]]
                w = t.float() * s
            t = w
        out[name] = t.to(getattr(torch, dtype))
    return out


def write_dequantized(model_dir: str | Path, out_dir: str | Path, dtype: str = "bfloat16") -> Path:
    """A copy of fp8 checkpoint ``model_dir`` with :func:`dequantized_tensors` weights in
    ``dtype`` and no ``quantization_config``: what stock vLLM / HF run as the reference."""
    import shutil

    from safetensors.torch import save_file

    src, out = Path(model_dir), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name not in ("model.safetensors", "config.json"):
            shutil.copy(f, out / f.name)
    cfg = json.loads((src / "config.json").read_text())
    cfg.pop("quantization_config")
    cfg["dtype"] = dtype
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file(dequantized_tensors(src, dtype), str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def write_fused_experts(src: str | Path, dst: str | Path) -> int:
    """A copy of checkpoint ``src`` with every layer's per-expert tensors fused the way
    transformers 5 holds them in memory: ``experts.gate_up_proj`` [E, 2I, H] (gate rows first) and
    ``experts.down_proj`` [E, H, I], and for block fp8 their tile scales ``experts.gate_up_proj_scale_inv``
    [E, 2I / bn, H / bk] (gate tiles first) and ``experts.down_proj_scale_inv``; returns the number of
    fused tensors written. Shared experts (``shared_experts.*``) stay as they are."""
    import re
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    src, dst = Path(src), Path(dst)
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors", "*.safetensors.index.json"))
    tensors = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    experts: dict[tuple[str, str], dict[int, dict[str, torch.Tensor]]] = {}
    out = {}
    for name, t in tensors.items():
        m = re.fullmatch(r"(.*\.experts\.)(\d+)\.(gate_proj|up_proj|down_proj)\.(weight|weight_scale_inv)", name)
        if m:
            experts.setdefault((m[1], m[4]), {}).setdefault(int(m[2]), {})[m[3]] = t
        else:
            out[name] = t
    for (prefix, tensor), by_e in experts.items():
        sfx = "" if tensor == "weight" else "_scale_inv"
        order = sorted(by_e)
        out[f"{prefix}gate_up_proj{sfx}"] = torch.stack([torch.cat([by_e[e]["gate_proj"], by_e[e]["up_proj"]])
                                                       for e in order])
        out[f"{prefix}down_proj{sfx}"] = torch.stack([by_e[e]["down_proj"] for e in order])
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return 2 * len(experts)


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
