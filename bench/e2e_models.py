"""``bench/e2e.py``'s models: the random-weight checkpoints at realistic dims (and, with
``--smoke``, the tiny models of :mod:`atom.testing.tiny_models`)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Optional

from e2e_common import log

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
    # Qwen3-32B / Qwen3-235B-A22B dims (the fp8 issue's other two shapes; fewer layers)
    "dense32": ("Qwen3Config", dict(
        hidden_size=5120, intermediate_size=25600, num_attention_heads=64, num_key_value_heads=8,
        head_dim=128, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
    ), 4),
    "moe235": ("Qwen3MoeConfig", dict(
        hidden_size=4096, intermediate_size=12288, num_attention_heads=64, num_key_value_heads=4,
        head_dim=128, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=1536,
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
    # The architectures atom serves that had not run on a GPU (issue #17), at their released
    # models' dims, few layers (a quick cold start; each fits one H100 with room for a second side).
    # Llama-3.1-8B: GQA 32/8 and its llama3 RoPE scaling (the low frequencies interpolated).
    "llama": ("LlamaConfig", dict(
        hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
        head_dim=128, rms_norm_eps=1e-5, max_position_embeddings=131072,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500_000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    ), 4),
    # Mixtral-8x7B: 8 experts of 14336, top-2, no sliding window (as released)
    "mixtral": ("MixtralConfig", dict(
        hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
        head_dim=128, num_local_experts=8, num_experts_per_tok=2, sliding_window=None,
        rope_theta=1_000_000.0, rms_norm_eps=1e-5,
    ), 2),
    # GLM-4.5-Air: layer 0 dense, then 128 experts top-8 (sigmoid, one group) + a shared expert;
    # 96 query heads of 128 (wider than hidden), half of each head rotated, q/k/v biases
    "glm4moe": ("Glm4MoeConfig", dict(
        hidden_size=4096, intermediate_size=10944, num_attention_heads=96, num_key_value_heads=8,
        head_dim=128, moe_intermediate_size=1408, n_routed_experts=128, num_experts_per_tok=8,
        n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=1.0, n_group=1, topk_group=1,
        norm_topk_prob=True, use_qk_norm=False, attention_bias=True, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0, "partial_rotary_factor": 0.5},
    ), 3),
    # GPT-OSS-20B in bf16 (the release is MXFP4): 32 experts top-4 with biases and the clamped
    # SwiGLU, sinks, layers alternating a 128-token window and full attention, transformers'
    # default YaRN
    "gptoss": ("GptOssConfig", dict(
        hidden_size=2880, intermediate_size=2880, num_attention_heads=64, num_key_value_heads=8,
        head_dim=64, num_local_experts=32, num_experts_per_tok=4, sliding_window=128, rms_norm_eps=1e-5,
        max_position_embeddings=131072,
    ), 4),
}
#: The DeepSeek-V3 dims vLLM's tensor-parallel layers split across ranks: the attention heads (ColumnParallel
#: q_b / kv_b, RowParallel o_proj), the dense MLP and, without EP, every expert's intermediate (TP-sharded
#: FusedMoE). vLLM replicates q_a / kv_a, so the LoRA ranks and the hidden size stay whole.
TP_SPLIT_DIMS = ("num_attention_heads", "num_key_value_heads", "intermediate_size", "moe_intermediate_size")
# mla8: DeepSeek-V3 at one rank's shapes of TP-8, its deployed layout, with its own 256 experts (bench/NOTES.md 79).
# One GPU runs one rank's weights and kernels, without the all-reduces; stock's fused MoE then finds vLLM's tuned
# E=256, N=256 tile files.
MODELS["mla8"] = ("DeepseekV3Config", {**MODELS["mla"][1], "n_routed_experts": 256,
                                       **{k: MODELS["mla"][1][k] // 8 for k in TP_SPLIT_DIMS}}, 4)
#: --smoke: atom.testing.tiny_models kinds standing in for each model.
SMOKE_KINDS = {"dense": "qwen3", "moe": "qwen3_moe", "mla": "deepseek_v3", "llama": "llama",
               "mixtral": "mixtral", "glm4moe": "glm4_moe", "gptoss": "gpt_oss"}


def build_model(name: str, layers: int, out: Path, vocab: int, mla_experts: int, init_std: float,
                router_skew: float = 0.0, block_fp8: Optional[tuple[int, int]] = None, weights: bool = True) -> dict:
    """A random-weight bf16 checkpoint of model ``name`` in ``out`` (skipped when present);
    ``router_skew`` > 0: MoE routers with Zipf-like expert popularity (:func:`router_row_scales`).
    For MoE models the info records the skew and the load it gives (``router_load``).
    ``block_fp8``: the projections written in block fp8 as drawn (:func:`write_random_checkpoint`).
    ``weights=False``: the config and tokenizer only, for vLLM's ``load_format="dummy"`` (vLLM draws
    every weight itself, uniform in +-1e-3, so routing is about uniform): full-depth models of any
    size with no disk and no build time."""
    info_path = out / "e2e_model.json"
    if info_path.exists() and (out / "tokenizer.json").exists():
        if block_fp8 is not None:  # a checkpoint built before its quantization_config changed: the weights hold
            c = json.loads((out / "config.json").read_text())
            quant = fp8_quantization_config(block_fp8, c)
            if c.get("quantization_config") != quant:
                (out / "config.json").write_text(json.dumps({**c, "quantization_config": quant}, indent=2))
        return json.loads(info_path.read_text())
    import transformers

    from atom.testing.tiny_models import build_tokenizer

    t0 = time.time()
    out.mkdir(parents=True, exist_ok=True)
    # Byte-level BPE on transformers' sources, padded with added tokens to ``vocab`` so that every
    # id the model can emit decodes.
    build_tokenizer(out, min(vocab, 16000), pad_to=vocab, corpus=transformers_sources(4_000_000))
    cls_name, kwargs, _ = MODELS[name]
    kwargs = dict(kwargs, num_hidden_layers=layers)
    if name == "mla":  # (mla8: DeepSeek-V3's own 256)
        kwargs["n_routed_experts"] = mla_experts
    # a model's own max_position_embeddings (its RoPE scaling's context) over the default
    cfg = getattr(transformers, cls_name)(**{
        "max_position_embeddings": 8192, **kwargs, "vocab_size": vocab, "bos_token_id": 0, "eos_token_id": 0,
        "pad_token_id": 0, "tie_word_embeddings": False, "initializer_range": init_std, "torch_dtype": "bfloat16"})
    params = (write_random_checkpoint(cfg, out, init_std, router_skew=router_skew, block_fp8=block_fp8) if weights
              else write_config(cfg, out, block_fp8))
    if cls_name == "DeepseekV3Config":  # transformers 5 drops these; vLLM needs them for the correction bias
        c = json.loads((out / "config.json").read_text())
        c.update(topk_method="noaux_tc", scoring_func="sigmoid")
        (out / "config.json").write_text(json.dumps(c, indent=2))
    top_k = getattr(cfg, "num_experts_per_tok", None)
    if top_k and weights:
        kwargs.update(router_skew=router_skew, router_load=router_load(_first_router(out), top_k))
    info = {"name": name, "layers": layers, "vocab": vocab, "params": params, "init_std": init_std,
            "block_fp8": list(block_fp8) if block_fp8 else None, "weights": "random" if weights else "dummy",
            "config": {k: v for k, v in kwargs.items() if not isinstance(v, list)}, "build_s": round(time.time() - t0, 1)}
    info_path.write_text(json.dumps(info, indent=1))
    return info


def _one_d_init(name: str) -> float:
    """HF's init of a model's 1-D parameters in the e2e architectures: norm weights 1, the rest
    (DeepSeek's / GLM's ``e_score_correction_bias``, any bias) 0. GPT-OSS's attention sinks are
    drawn instead (:data:`SINKS_SUFFIX`)."""
    return 1.0 if name.endswith("norm.weight") else 0.0


#: GPT-OSS's per-head attention sinks (1-D), drawn N(0, 1) rather than set to a constant: O(1)
#: logits as in the released model, different per head, so that a sink dropped or applied to
#: the wrong head changes the agreement runs' logprobs (atom.testing.tiny_models draws them so too).
SINKS_SUFFIX = ".self_attn.sinks"

#: A MoE router's weight as the checkpoints name it: ``[experts, hidden]`` (Qwen3-MoE, DeepSeek-V3,
#: GLM-4-MoE: ``mlp.gate``; Mixtral: ``block_sparse_moe.gate``; GPT-OSS: ``mlp.router``, with a bias).
ROUTER_SUFFIXES = (".mlp.gate.weight", ".block_sparse_moe.gate.weight", ".mlp.router.weight")


def router_row_scales(num_experts: int, skew: float) -> Any:
    """Row scales of a router weight for Zipf-like expert popularity: expert ``e``'s row times
    ``(e + 1) ** -skew``, normalised to a mean square of 1 (the matrix keeps its std on average).

    A router logit is ``h . w_e``; with random hidden states its spread grows with the row's
    norm, so high-norm experts win the top-k more often. On Gaussian inputs, 128 experts, top-8:
    skew 0 gives the most popular expert 1.3x the mean load, 0.1 2.1x, 0.2 3.5x (the top 10 %
    of experts take 23 % of the slots, the least popular 0.37x the mean), 0.3 4.9x. Real routers'
    imbalance (a few hot experts at 2-5x the mean) is about skew 0.1-0.3; :func:`router_load`
    measures a built checkpoint's."""
    import torch

    scales = (torch.arange(num_experts, dtype=torch.float64) + 1.0) ** -float(skew)
    return (scales / scales.pow(2).mean().sqrt()).float()


def router_load(weight: Any, top_k: int, tokens: int = 8192, seed: int = 0) -> dict:
    """The expert load a router weight ``[E, H]`` gives Gaussian hidden states under top-k of the
    logits (softmax and sigmoid routers rank alike; DeepSeek's group limit is not applied):
    the most and least popular expert's load over the mean, and the share of the slots the top
    10 % of the experts take."""
    import torch

    w = weight.float().cpu()
    h = torch.randn(tokens, w.shape[1], generator=torch.Generator().manual_seed(seed))
    idx = (h @ w.T).topk(top_k, dim=-1).indices
    load = torch.bincount(idx.flatten(), minlength=w.shape[0]).double() / (tokens * top_k / w.shape[0])
    ranked = load.sort(descending=True).values
    top = max(1, w.shape[0] // 10)
    return {"max_over_mean": round(ranked[0].item(), 3), "min_over_mean": round(ranked[-1].item(), 3),
            "top10pct_share": round(ranked[:top].sum().item() / w.shape[0], 3)}


def _first_router(folder: Path) -> Any:
    """The first router weight in a checkpoint folder (in the index's order)."""
    from safetensors import safe_open

    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    name = next(n for n in index if n.endswith(ROUTER_SUFFIXES))
    with safe_open(str(folder / index[name]), "pt") as st:
        return st.get_tensor(name)


def write_random_checkpoint(cfg: Any, out: Path, init_std: float, shard_bytes: int = 4 << 30,
                            seed: int = 0, router_skew: float = 0.0,
                            block_fp8: Optional[tuple[int, int]] = None) -> int:
    """Save a random bf16 checkpoint of HF config ``cfg`` in ``out`` without materialising the
    HF model: parameter names and shapes come from a model built on the meta device; matrices
    are N(0, init_std) (drawn on the GPU when there is one: a 36-layer 8B model takes seconds,
    not the minutes of HF's own init), 1-D parameters HF's init (:func:`_one_d_init`); MoE routers'
    rows scaled by :func:`router_row_scales` when ``router_skew`` is set; sinks N(0, 1).
    ``block_fp8`` (e.g. ``(128, 128)``): every projection is written as it is drawn in HF's
    block-fp8 format instead (``weight`` float8_e4m3fn + ``weight_scale_inv``, the tensors
    :func:`quantize_block_fp8` would make of the bf16 checkpoint, with ``quantization_config`` in
    ``config.json``), so a model whose bf16 copy would not fit the disk next to its fp8 one is
    built in one pass. Written shard by shard (``model-0000i-of-0000n.safetensors`` + index, as
    ``save_pretrained`` does; its tensor names and layout: :func:`checkpoint_shapes`), holding one
    shard in memory, with ``config.json``. Returns the parameter count (of the bf16 model)."""
    import torch
    import transformers
    from safetensors.torch import save_file

    from atom.testing.tiny_models import _is_quantized, quantize_fp8

    shapes = checkpoint_shapes(_model_shapes(cfg), cfg.model_type)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=dev).manual_seed(seed)
    out.mkdir(parents=True, exist_ok=True)
    shard: dict[str, Any] = {}
    parts: list[list[str]] = []
    size = total = nbytes_all = 0

    def flush() -> None:
        save_file(shard, str(out / f"part-{len(parts):05d}.safetensors"), metadata={"format": "pt"})
        parts.append(list(shard))
        shard.clear()

    for name, shape in shapes.items():
        if len(shape) >= 2:
            t = torch.empty(shape, dtype=torch.bfloat16, device=dev).normal_(0.0, init_std, generator=gen)
            if router_skew and name.endswith(ROUTER_SUFFIXES) and len(shape) == 2:
                t = (t.float() * router_row_scales(shape[0], router_skew).to(dev)[:, None]).to(torch.bfloat16)
        elif name.endswith(SINKS_SUFFIX):
            t = torch.empty(shape, dtype=torch.bfloat16, device=dev).normal_(0.0, 1.0, generator=gen)
        else:
            t = torch.full(shape, _one_d_init(name), dtype=torch.bfloat16, device=dev)
        total += t.numel()
        tensors = {name: t}
        if block_fp8 is not None and t.dim() == 2 and _is_quantized(name, []):
            q, scale = quantize_fp8(t, list(block_fp8))
            tensors = {name: q, name.removesuffix(".weight") + ".weight_scale_inv": scale}
        nbytes = sum(v.numel() * v.element_size() for v in tensors.values())
        if size and size + nbytes > shard_bytes:
            flush()
            size = 0
        shard.update({k: v.cpu() for k, v in tensors.items()})
        size += nbytes
        nbytes_all += nbytes
    if shard:
        flush()
    index: dict[str, str] = {}
    for i, names in enumerate(parts):
        fname = f"model-{i + 1:05d}-of-{len(parts):05d}.safetensors"
        (out / f"part-{i:05d}.safetensors").rename(out / fname)
        index.update({n: fname for n in names})
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": nbytes_all}, "weight_map": index}, indent=1))
    _save_config(cfg, out, block_fp8)
    return total


def write_config(cfg: Any, out: Path, block_fp8: Optional[tuple[int, int]] = None) -> int:
    """``config.json`` of HF config ``cfg`` as :func:`write_random_checkpoint` writes it (its
    architecture, ``quantization_config`` with ``block_fp8``), no weights; returns the parameter
    count."""
    import math

    total = sum(math.prod(shape) for shape in _model_shapes(cfg).values())
    out.mkdir(parents=True, exist_ok=True)
    _save_config(cfg, out, block_fp8)
    return total


def _model_shapes(cfg: Any) -> dict[str, tuple]:
    """The state dict's shapes of the HF model ``cfg`` describes (built on the meta device), and
    ``cfg.architectures`` set as ``save_pretrained`` records it (vLLM reads it)."""
    import torch
    import transformers

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    cfg.architectures = [type(model).__name__]
    return {n: tuple(p.shape) for n, p in model.state_dict().items()}


def _save_config(cfg: Any, out: Path, block_fp8: Optional[tuple[int, int]]) -> None:
    cfg.save_pretrained(out)
    if block_fp8 is not None:
        c = json.loads((out / "config.json").read_text())
        c["quantization_config"] = fp8_quantization_config(block_fp8, c)
        (out / "config.json").write_text(json.dumps(c, indent=2))


def fp8_quantization_config(block: tuple[int, int], config: Optional[dict] = None) -> dict:
    """HF's block-fp8 ``quantization_config`` (Qwen3-FP8 / DeepSeek-V3's) for a model's ``config``
    (config.json's dict): Qwen3-MoE's releases (Qwen3-30B-A3B-FP8, Qwen3-235B-A22B-FP8) list their bf16
    routers in ``modules_to_not_convert`` (:func:`unconverted_modules`), which vLLM's Qwen3-MoE needs:
    its router takes the fp8 config, and without the list it quantises the router, whose checkpoint
    weight is bf16 with no scale (vLLM then keeps its placeholder scale, float32's minimum)."""
    quant = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": list(block)}
    unconverted = unconverted_modules(config or {})
    if unconverted:
        quant["modules_to_not_convert"] = unconverted
    return quant


def dummy_load_peak(folder: Path) -> dict[str, float]:
    """GiB one engine holds at the peak of a ``load_format="dummy"`` load of checkpoint ``folder``
    (its config.json): ``weights`` (block-fp8 projections and experts 1 byte per element, the rest
    bf16) and ``dummy_copy``, 3 bytes per element of the largest fp8 parameter: vLLM's
    ``initialize_single_dummy_weight`` draws an fp8 parameter through an fp16 copy and then an fp8
    one (bench/NOTES.md 75), which the engine's allocator keeps reserved while the load goes on.
    Parameters as transformers builds them (fused experts; vLLM also fuses some projections, which
    changes no byte count and only makes the largest parameter larger where it fuses two fp8 ones)."""
    import math

    import transformers

    from atom.testing.tiny_models import _is_quantized  # the rule the checkpoint writers quantise by

    config = json.loads((Path(folder) / "config.json").read_text())
    quant = config.get("quantization_config") or {}
    fp8 = quant.get("quant_method") == "fp8"
    kept = list(quant.get("modules_to_not_convert") or ())
    weights = largest = 0
    for name, shape in _model_shapes(transformers.AutoConfig.from_pretrained(folder)).items():
        # fused experts (``mlp.experts.gate_up_proj``) carry no ``.weight`` suffix in memory
        quantised = fp8 and len(shape) >= 2 and _is_quantized(
            name if name.endswith(".weight") else name + ".weight", kept)
        n = math.prod(shape)
        weights += n * (1 if quantised else 2)
        largest = max(largest, n if quantised else 0)
    return {"weights": weights / 2 ** 30, "dummy_copy": 3 * largest / 2 ** 30}


def unconverted_modules(config: dict) -> list[str]:
    """The modules a block-fp8 release of this architecture keeps unquantised and lists (Qwen3-MoE:
    ``lm_head`` and each sparse layer's ``mlp.gate``; the norms it also lists are not linear layers).
    Other architectures list none (DeepSeek-V3's release; vLLM builds their routers unquantised)."""
    if config.get("model_type") != "qwen3_moe":
        return []
    step = int(config.get("decoder_sparse_step") or 1)
    dense = set(config.get("mlp_only_layers") or [])
    experts = int(config.get("num_experts") or config.get("num_local_experts") or 0)  # (transformers 5's name)
    sparse = [i for i in range(int(config["num_hidden_layers"]))
              if i not in dense and experts > 0 and (i + 1) % step == 0]
    return ["lm_head", *(f"model.layers.{i}.mlp.gate" for i in sparse)]


#: model_type -> (the MoE block's name in the checkpoint, its experts' gate / up / down names)
#: where they differ from Qwen3-MoE's (``mlp``; ``gate_proj`` / ``up_proj`` / ``down_proj``).
EXPERT_NAMES = {"mixtral": ("block_sparse_moe", ("w1", "w3", "w2"))}
#: model_types whose checkpoints keep the experts fused, as in memory (GPT-OSS: ``gate_up_proj``
#: ``[E, H, 2I]`` with gate and up interleaved, ``down_proj`` ``[E, I, H]``, their biases).
FUSED_EXPERTS = ("gpt_oss",)


def checkpoint_shapes(shapes: dict[str, tuple], model_type: str = "") -> dict[str, tuple]:
    """The tensors ``save_pretrained`` writes for a model whose state dict is ``shapes``.

    transformers 5 keeps a MoE layer's experts fused in memory (``experts.gate_up_proj``
    ``[E, 2I, H]``, ``experts.down_proj`` ``[E, H, I]``) and splits them on save into the
    per-expert layout of the published checkpoints (``experts.<e>.{gate,up,down}_proj.weight``;
    Mixtral's ``block_sparse_moe.experts.<e>.w1/w3/w2`` and ``block_sparse_moe.gate``:
    :data:`EXPERT_NAMES`); written fused, atom's loaders refuse the checkpoint (vLLM 0.26's
    accept it). GPT-OSS's checkpoints are fused (:data:`FUSED_EXPERTS`), as vLLM's loader reads them."""
    if model_type in FUSED_EXPERTS:
        return dict(shapes)
    block, (gate, up, down) = EXPERT_NAMES.get(model_type, ("mlp", ("gate_proj", "up_proj", "down_proj")))

    def expert_prefix(name: str, suffix: str) -> str:  # "model.layers.3.<block>.experts."
        return name[: -len(suffix)].replace(".mlp.experts.", f".{block}.experts.")

    out: dict[str, tuple] = {}
    for name, shape in shapes.items():
        if name.endswith(".experts.gate_up_proj") and len(shape) == 3:
            prefix, (e, two_i, h) = expert_prefix(name, "gate_up_proj"), shape
            for i in range(e):
                out[f"{prefix}{i}.{gate}.weight"] = out[f"{prefix}{i}.{up}.weight"] = (two_i // 2, h)
        elif name.endswith(".experts.down_proj") and len(shape) == 3:
            prefix, (e, h, inter) = expert_prefix(name, "down_proj"), shape
            for i in range(e):
                out[f"{prefix}{i}.{down}.weight"] = (h, inter)
        elif name.endswith(".mlp.gate.weight") and block != "mlp":
            out[name.replace(".mlp.gate.weight", f".{block}.gate.weight")] = shape
        else:
            out[name] = shape
    return out


def quantize_block_fp8(src: Path, dst: Path, block: tuple[int, int] = (128, 128)) -> dict:
    """A copy of checkpoint ``src`` in HF's block-fp8 format (``weight`` float8_e4m3fn +
    ``weight_scale_inv`` per ``block`` tile, as Qwen3-FP8 / DeepSeek-V3 ship), every projection
    of attention, MLP and experts quantised (embeddings, head, norms, routers not); on the GPU
    when there is one. Kept when ``dst`` already holds it."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    from atom.testing.tiny_models import _is_quantized, quantize_fp8

    if (dst / "config.json").exists():
        return json.loads((dst / "config.json").read_text())["quantization_config"]
    tmp = dst.with_name(dst.name + ".part")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    quant = fp8_quantization_config(block, json.loads((src / "config.json").read_text()))
    index = {}
    for f in sorted(src.iterdir()):
        if f.suffix != ".safetensors":
            if f.is_file() and f.name != "model.safetensors.index.json":
                shutil.copy(f, tmp / f.name)
            continue
        out = {}
        for name, t in load_file(str(f), device=dev).items():
            if t.dim() == 2 and _is_quantized(name, []):
                q, scale = quantize_fp8(t, list(block))
                out[name], out[name.removesuffix(".weight") + ".weight_scale_inv"] = q.cpu(), scale.cpu()
            else:
                out[name] = t.cpu()
        save_file(out, str(tmp / f.name), metadata={"format": "pt"})
        index.update({n: f.name for n in out})
    if (src / "model.safetensors.index.json").exists():
        (tmp / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
    cfg = json.loads((tmp / "config.json").read_text())
    cfg["quantization_config"] = quant
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    tmp.rename(dst)
    return quant


def build_smoke_model(name: str, root: Path) -> dict:
    from atom.testing.tiny_models import VOCAB_SIZE, build

    path = build(SMOKE_KINDS[name], root / f"tiny-{SMOKE_KINDS[name]}-fp32", dtype="float32")
    return {"name": name, "kind": SMOKE_KINDS[name], "vocab": VOCAB_SIZE, "path": str(path)}


def prepare_model(name: str, args: Any) -> tuple[dict, str]:
    """The checkpoint of model ``name`` for this invocation (built, or found in ``--model-dir``):
    (its info, its path)."""
    if args.smoke:
        info = build_smoke_model(name, Path(args.model_dir))
        return info, info["path"]
    model_path = str(Path(args.model_dir) / f"{name}-L{args.layers_by_model[name]}-v{args.vocab}")
    log(f"{name}: building/using checkpoint {model_path}")
    info = build_model(name, args.layers_by_model[name], Path(model_path), args.vocab, args.mla_experts,
                       args.init_std)
    return info, model_path


def transformers_sources(max_chars: int) -> list[str]:
    """transformers' sources, in path order, until about ``max_chars`` characters: the corpus of
    the realistic-vocabulary tokenizers (transformers is always installed next to vLLM)."""
    import transformers

    corpus, total = [], 0
    for p in sorted(Path(transformers.__file__).parent.rglob("*.py")):
        text = p.read_text(errors="ignore")
        corpus.append(text)
        total += len(text)
        if total > max_chars:
            break
    return corpus
