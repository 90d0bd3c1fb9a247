"""atom's Qwen3-MoE end to end: vLLM (CPU, real engine) runs atom's model and agrees with stock
vLLM and with HF transformers; the model alone agrees with HF (dense-layer selection, tied head,
unnormalised top-k) and with itself across tensor-parallel and expert-parallel ranks. The engine
fixtures are in ``tests/models/conftest.py``; the checkpoint is the shared tiny one (8 experts,
top-2, both layers sparse).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import pytest
import torch
from torch import nn

from tests.models import _engine_runner as runner
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

NUM_LAYERS = 2  # atom.testing.tiny_models.KINDS["qwen3_moe"]
# Measured atom vs stock vLLM on the tiny checkpoint, 8 prompts: fp32 tokens identical, logprobs
# equal to ~1e-6. bf16 (157 teacher-forced positions): mean |d logprob| 0.008, max 0.18 at the
# one position where a near-tie in the router flips an expert (stock bf16 is itself 0.14 from
# fp32 there, atom bf16 0.19); sampled logprobs while the continuations agree: 0.016. Greedy
# bf16 continuations agree on 67% of tokens before diverging (stock bf16 vs stock fp32: 63%),
# so the agreement floor is lower than the dense model's 75%.
FP32_LOGPROB_ATOL = 1e-3
BF16_LOGPROB_ATOL = 0.15
BF16_PROMPT_MAX_ATOL = 0.5
BF16_PROMPT_MEAN_ATOL = 0.03
BF16_MIN_AGREEING = 0.5


@pytest.fixture(scope="module")
def checkpoint(tiny_model) -> Path:
    return tiny_model("qwen3_moe")


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return mixed_prompts()


# -- vLLM runs atom's model -------------------------------------------------------------------------
def test_vllm_registry_resolves_qwen3_moe_to_atom_moe_wrapper(monkeypatch):
    from vllm import ModelRegistry

    from atom.plugin.vllm.model_wrapper import ATOMMoEForCausalLM
    from atom.plugin.vllm.register import register_model

    monkeypatch.delenv("ATOM_DISABLE_VLLM_PLUGIN", raising=False)
    register_model()
    assert ModelRegistry._try_load_model_cls("Qwen3MoeForCausalLM") is ATOMMoEForCausalLM


def test_vllm_builds_atom_moe_model(atom_runs):
    facts = atom_runs["float32"]["facts"]
    assert facts["wrapper"] == "atom.plugin.vllm.model_wrapper:ATOMMoEForCausalLM"
    assert facts["atom_model"] == "atom.models.qwen3_moe:Qwen3MoeForCausalLM"
    assert "atom.models._moe:FusedMoE" in facts["modules"]
    # vLLM's layers in the tree: its Attention (KV cache) and the wrapper's LogitsProcessor only,
    # no vLLM FusedMoE or linear layers.
    vllm_layers = [m for m in facts["modules"] if m.startswith("vllm.model_executor.layers")]
    assert vllm_layers == sorted([*facts["attention"], "vllm.model_executor.layers.logits_processor:LogitsProcessor"])
    assert facts["registered"] == [f"model.layers.{i}.self_attn.attn" for i in range(NUM_LAYERS)]


def test_fp32_greedy_tokens_equal_stock_vllm(atom_runs, stock_runs):
    assert_same_greedy_run(atom_runs["float32"], stock_runs["float32"], FP32_LOGPROB_ATOL)


def test_fused_expert_checkpoint_loads_like_the_per_expert_one(checkpoint, prompts, engine_kwargs, stock_runs,
                                                               tmp_path):
    """A checkpoint written from transformers 5's in-memory state keeps each layer's experts
    fused (vLLM 0.26 loads it; the H100 benchmark's first writer produced one): atom's loader
    splits them into the per-expert tensors, and the fp32 tokens equal stock vLLM's on the
    per-expert original."""
    from atom.testing.tiny_models import write_fused_experts

    fused = tmp_path / "fused"
    assert write_fused_experts(checkpoint, fused) == 2 * NUM_LAYERS
    with pytest.MonkeyPatch.context() as mp:
        for key, value in runner.ENGINE_ENV.items():
            mp.setenv(key, value)
        ours = runner.run_engine(str(fused), prompts, "float32", **engine_kwargs)
    assert_same_greedy_run(ours, stock_runs["float32"], FP32_LOGPROB_ATOL)


def test_fp32_greedy_tokens_equal_hf_transformers(atom_runs, hf_fp32_tokens):
    assert [r["tokens"] for r in atom_runs["float32"]["rows"]] == hf_fp32_tokens


def test_bf16_logprobs_close_to_stock_vllm(atom_runs, stock_runs):
    """See the measured values at the top: a router near-tie may flip one expert in either
    engine's bf16, so the per-position maximum is looser than the mean."""
    assert_close_greedy_run(atom_runs["bfloat16"], stock_runs["bfloat16"], BF16_LOGPROB_ATOL,
                            prompt_atol=BF16_PROMPT_MAX_ATOL, prompt_mean_atol=BF16_PROMPT_MEAN_ATOL,
                            min_agreeing=BF16_MIN_AGREEING)


def test_multiprocess_tp2_expert_parallel_tokens_equal_stock_vllm(checkpoint, prompts, stock_runs, tmp_path):
    """Two real vLLM worker processes (TP=2 with enable_expert_parallel, so each builds its
    FusedMoE layers with 4 of the 8 experts and reduces over vLLM's EP group) give stock
    single-rank vLLM's fp32 tokens and logprobs."""
    ours = run_tp2_engine(checkpoint, prompts, tmp_path, {"enable_expert_parallel": True},
                          "atom.models.qwen3_moe:Qwen3MoeForCausalLM", "ATOMMoEForCausalLM", "Qwen3MoeForCausalLM")
    assert_same_greedy_run(ours, stock_runs["float32"], FP32_LOGPROB_ATOL)


# -- atom's model alone (no vLLM) -------------------------------------------------------------------
VARIANTS = {
    "sparse": {},
    # layers 0 and 2 dense (mlp_only_layers), 1 sparse, 3 dense (decoder_sparse_step=2)
    "mixed": {"num_hidden_layers": 4, "mlp_only_layers": [0, 2], "decoder_sparse_step": 2},
    "tied_unnormalised": {"tie_word_embeddings": True, "norm_topk_prob": False},
}


@pytest.fixture(scope="module")
def hf_checkpoints(tmp_path_factory):
    """``get(variant) -> (HF model, {HF checkpoint name: tensor})``; the tensors are read back from
    ``save_pretrained`` because that (not transformers' in-memory fused experts) is what a host's
    weight iterator yields: one matrix per expert and projection."""
    import transformers
    from safetensors.torch import load_file

    from atom.testing.tiny_models import KINDS, VOCAB_SIZE

    cache: dict[str, tuple[nn.Module, dict[str, torch.Tensor]]] = {}

    def get(variant: str) -> tuple[nn.Module, dict[str, torch.Tensor]]:
        if variant not in cache:
            kwargs = {**KINDS["qwen3_moe"][1], "vocab_size": VOCAB_SIZE, **VARIANTS[variant]}
            torch.manual_seed(0)
            model = widen_init(transformers.AutoModelForCausalLM.from_config(
                transformers.Qwen3MoeConfig(**kwargs), dtype=torch.float32))
            out = tmp_path_factory.mktemp(f"hf-{variant}")
            model.save_pretrained(out, safe_serialization=True)
            cache[variant] = (model, load_file(str(out / "model.safetensors")))
        return cache[variant]

    return get


def _atom_model(hf_model: nn.Module, tensors: dict[str, torch.Tensor], parallel: Any = None,
                expert_parallel: bool = False) -> nn.Module:
    from atom.models.qwen3_moe import Qwen3MoeForCausalLM

    return build_atom_model(Qwen3MoeForCausalLM, hf_model.config, tensors.items(), parallel,
                            enable_expert_parallel=expert_parallel)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_atom_qwen3_moe_logits_match_hf_transformers(variant, hf_checkpoints):
    from atom.models._moe import FusedMoE

    hf, tensors = hf_checkpoints(variant)
    atom = _atom_model(hf, tensors)
    sparse = [isinstance(getattr(layer.mlp, "experts", None), FusedMoE) for layer in atom.model.layers]
    hf_sparse = [hasattr(layer.mlp, "gate") for layer in hf.model.layers]
    assert sparse == hf_sparse and any(sparse)
    assert (atom.lm_head.weight is atom.model.embed_tokens.weight) == hf.config.tie_word_embeddings
    ids = torch.tensor(mixed_prompts()[-1])
    with torch.no_grad():
        theirs = hf(ids[None]).logits[0]
    torch.testing.assert_close(full_logits(atom, ids), theirs, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("tp,ep", [(2, None), (2, 2), (1, 4)], ids=["tp2", "tp2-ep2", "ep4"])
def test_parallel_ranks_match_single_rank(tp: int, ep: Optional[int], hf_checkpoints):
    """TP splits each expert's intermediate dim; EP (vLLM: EP group = the TP ranks) gives each
    rank whole experts. Every rank's logits must equal the single-rank model's."""
    from atom.models.interfaces import ModelParallel

    hf, tensors = hf_checkpoints("mixed")
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
    if tp == 1:
        # EP without TP: one model per rank; attention and head need no collectives.
        results = run_ranks(ep_group, lambda r: full_logits(models[r], ids))
    else:
        results = run_ranks(tp_group, lambda r: full_logits(models[r], ids))

    experts = models[-1].model.layers[1].mlp.experts
    n, inter = hf.config.num_experts, hf.config.moe_intermediate_size
    if ep is None:
        assert experts.w13.shape == (n, 2 * inter // tp, hf.config.hidden_size) and experts.expert_map is None
    else:
        local = n // ep
        assert experts.w2.shape == (local, hf.config.hidden_size, inter)
        expected_map = [-1] * n
        expected_map[n - local:] = range(local)
        assert experts.expert_map.tolist() == expected_map
    for rank, logits in enumerate(results):
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4, msg=f"rank {rank}")


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_fused_moe_layer_expert_parallel_partial_sums(backend, monkeypatch):
    """The layer alone on each atom.ops backend (Triton through its interpreter on CPU): loading
    per-expert matrices and the EP ranks' expert_map partial sums add up to the one-rank output."""
    from atom.models._moe import DOWN, GATE, UP, FusedMoE
    from atom.models.interfaces import ModelParallel

    monkeypatch.setenv("ATOM_OPS_BACKEND", backend)
    n, hidden, inter = 8, 64, 32
    torch.manual_seed(0)
    w13, w2 = torch.randn(n, 2 * inter, hidden) * 0.1, torch.randn(n, hidden, inter) * 0.1
    x, router_logits = torch.randn(37, hidden), torch.randn(37, n)

    def layer(rank: int, size: int) -> FusedMoE:
        group = ThreadGroup(size).rank(rank) if size > 1 else None  # unused: see reduce_group below
        moe = FusedMoE(n, 2, hidden, inter, ModelParallel(ep_rank=rank, ep_size=size, ep_group=group),
                       renormalize=True, use_expert_parallel=True)
        for e in range(n):
            moe.load_weight("w13", w13[e, :inter], (e, GATE))
            moe.load_weight("w13", w13[e, inter:], (e, UP))
            moe.load_weight("w2", w2[e], (e, DOWN))
        return moe

    with torch.no_grad():
        expected = layer(0, 1)(x, router_logits)
        partial = [layer(r, 2) for r in range(2)]
        for moe in partial:
            moe.reduce_group = None  # each rank's own partial sum, before the all-reduce
        got = sum(moe(x, router_logits) for moe in partial)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_wrapper_passes_vllm_ep_group():
    from types import SimpleNamespace

    from atom.plugin.vllm.model_wrapper import model_parallel

    tp, ep = object(), SimpleNamespace(rank_in_group=1, world_size=2, all_reduce=None, all_gather=None)
    dense = model_parallel(SimpleNamespace(tp_rank=1, tp_size=2, tp_group=tp, ep_group=None))
    assert (dense.tp_rank, dense.tp_size, dense.tp_group, dense.ep_size, dense.ep_group) == (1, 2, tp, 1, None)
    moe = model_parallel(SimpleNamespace(tp_rank=1, tp_size=2, tp_group=tp, ep_group=ep))
    assert (moe.tp_rank, moe.ep_rank, moe.ep_size, moe.ep_group) == (1, 1, 2, ep)


def test_wrapper_reduces_experts_over_the_tp_group_when_it_is_the_ep_group():
    """vLLM captures CUDA graphs with only its TP (and PP) group in capture mode: with DP=1 the
    EP group holds the TP group's ranks, and the experts' all-reduce must go over the TP
    group (an EP-group all-reduce in a captured graph crashed TP2+EP serving on the H200)."""
    from types import SimpleNamespace

    from atom.plugin.vllm.model_wrapper import model_parallel

    tp = SimpleNamespace(rank_in_group=1, world_size=2, ranks=[0, 1])
    same = SimpleNamespace(rank_in_group=1, world_size=2, ranks=[0, 1])
    moe = model_parallel(SimpleNamespace(tp_rank=1, tp_size=2, tp_group=tp, ep_group=same))
    assert (moe.ep_rank, moe.ep_size) == (1, 2) and moe.ep_group is tp
    wider = SimpleNamespace(rank_in_group=3, world_size=4, ranks=[0, 1, 2, 3])  # EP over TP x DP
    moe = model_parallel(SimpleNamespace(tp_rank=1, tp_size=2, tp_group=tp, ep_group=wider))
    assert (moe.ep_rank, moe.ep_size) == (3, 4) and moe.ep_group is wider
