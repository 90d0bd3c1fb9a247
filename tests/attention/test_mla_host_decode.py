"""A host's MLA decode kernel (:class:`atom.models.attention.mla.HostDecode`; vLLM's FlashMLA on
Hopper) as atom's MLA layers use it: the decode rows' ``[q_nope @ W_UK | q_pe]`` query handed to
it, one state per built step shared by the step's layers, atom's kernel for the layers and steps
it does not take, atom's Triton decode warm-up skipped only where it serves; and the FlashMLA
offer itself: what it declines, the ``ATOM_MLA_HOST_DECODE`` switch, and the 64-token pages
atom's MLA backend then asks vLLM for.

The host kernel here is a stand-in (the toolkit's own mechanics): atom's torch reference decode
behind the hook, recording its calls. FlashMLA itself runs in the GPU tests
(tests/attention/test_mla_impl.py, parametrised over ATOM_MLA_HOST_DECODE, and the engine test
below)."""

from __future__ import annotations

import math

import pytest
import torch

import atom.ops as ops
from atom.ops.mla import mla_decode_torch
from atom.models.attention import mla
from atom.plugin.vllm import mla_decode
from atom.plugin.vllm.attention_mla import ATOMMLABackend, ATOMMLAImpl
from tests.attention.test_mla_impl import (  # noqa: F401 - fixtures
    BLOCK, HEADS, NOPE, ROPE, VDIM, _builder, _common_metadata, _KvBProj, _reference, plugin_mode, vllm_config,
)

# decodes first (as vLLM's reorder puts them), then an extend and a fresh prefill
STEP = [(9, 1), (20, 1), (37, 1), (13, 5), (0, 7)]
RANK = 64


class _StandIn:
    """A HostDecode over atom's torch decode reference that records what it was given."""

    def __init__(self, page_size=BLOCK, declines=None):
        self.calls, self.states = [], []
        self.hook = mla.HostDecode("stand-in", declines or (lambda *a: None), page_size, self.new_step, self.run)

    def new_step(self):
        state = object()
        self.states.append(state)
        return state

    def run(self, q, cache, block_table, seq_lens, scale, state):
        assert q.is_contiguous()
        self.calls.append({"q": q.clone(), "rows": q.shape[0], "state": state, "seq_lens": seq_lens.tolist()})
        rank = q.shape[-1] - ROPE
        return mla_decode_torch(q[..., :rank], q[..., rank:], cache, block_table, seq_lens, scale)


@pytest.fixture
def host(monkeypatch):
    # the vLLM impl offers vLLM's own decode kernel when built (install: none on this CPU, and
    # it withdraws any other); the stand-in is offered instead
    monkeypatch.setattr(mla_decode, "install", lambda: None)
    yield lambda **kw: _install(_StandIn(**kw))
    mla.set_host_decode(None)


def _install(stand_in):
    mla.set_host_decode(stand_in.hook)
    return stand_in


def _impl(kv_b_proj, rank=RANK):
    return ATOMMLAImpl(HEADS, rank + ROPE, 1 / math.sqrt(NOPE + ROPE), 1, None, None, "auto", None,
                       "decoder", None, q_lora_rank=None, kv_lora_rank=rank, qk_nope_head_dim=NOPE,
                       qk_rope_head_dim=ROPE, qk_head_dim=NOPE + ROPE, v_head_dim=VDIM, kv_b_proj=kv_b_proj)


def _step(vllm_config, impls, seed=0, rank=RANK):
    """One step of STEP through every impl in ``impls`` (one shared cache layout, one metadata
    build, as the layers of one KV-cache group): per impl (output, reference rows)."""
    torch.manual_seed(seed)
    per_req = max(-(-(c + n) // BLOCK) for c, n in STEP)
    num_blocks = per_req * len(STEP) + 2
    block_table = torch.randperm(num_blocks, dtype=torch.int32)[: per_req * len(STEP)].view(len(STEP), per_req)

    def slots(r, positions):
        return torch.tensor([int(block_table[r, p // BLOCK]) * BLOCK + p % BLOCK for p in positions])

    all_slots = torch.cat([slots(r, range(c + n)) for r, (c, n) in enumerate(STEP)])
    new_slots = torch.cat([slots(r, range(c, c + n)) for r, (c, n) in enumerate(STEP)])
    q_lens = [n for _, n in STEP]
    md = _builder(vllm_config, rank).build(0, _common_metadata(block_table, [c + n for c, n in STEP], q_lens,
                                                                new_slots))
    results = []
    for impl in impls:
        c_kv = [torch.randn(c + n, rank) for c, n in STEP]
        k_pe = [torch.randn(c + n, ROPE) for c, n in STEP]
        cache = torch.full((num_blocks, BLOCK, rank + ROPE), float("nan"))
        impl.do_kv_cache_update(torch.cat(c_kv), torch.cat(k_pe).unsqueeze(1), cache, all_slots, "auto",
                                torch.tensor(1.0))
        q = torch.randn(sum(q_lens), HEADS, NOPE + ROPE)
        out = torch.full((sum(q_lens), HEADS * VDIM), float("nan"))
        impl.forward(None, q, None, None, cache, md, out)
        refs, start = [], 0
        for r, (ctx, n) in enumerate(STEP):
            refs.append(_reference(q[start:start + n], c_kv[r], k_pe[r], ctx, impl.kv_b_proj.weight, impl.scale))
            start += n
        results.append((out, torch.cat(refs), q))
    return md, results


def test_decode_rows_run_on_the_host_kernel_with_the_absorbed_query(vllm_config, plugin_mode, host):
    """Two layers of one step: the host kernel gets the three decode rows of each, as
    ``[q_nope @ W_UK | q_pe]``, with the step's one state; outputs equal dense MLA (the extend and
    prefill rows stay on atom's path)."""
    stand_in = host()
    impls = [_impl(_KvBProj(RANK)) for _ in range(2)]
    for impl in impls:
        impl.process_weights_after_loading(torch.float32)
        assert impl.host_decode is stand_in.hook and impl.host_decode_declined is None
    md, results = _step(vllm_config, impls)
    assert len(stand_in.states) == 1 and md.host_decode_state is stand_in.states[0]
    assert [c["rows"] for c in stand_in.calls] == [3, 3]
    assert all(c["state"] is md.host_decode_state for c in stand_in.calls)
    assert stand_in.calls[0]["seq_lens"] == [10, 21, 38]
    for impl, call, (out, ref, q) in zip(impls, stand_in.calls, results):
        torch.testing.assert_close(out, ref, atol=2e-4, rtol=2e-4)
        q_nope, q_pe = q[:3].split([NOPE, ROPE], -1)
        expected = torch.cat([torch.bmm(q_nope.transpose(0, 1), impl.W_UK_T).transpose(0, 1), q_pe], -1)
        torch.testing.assert_close(call["q"], expected)


def test_each_build_makes_a_fresh_state_and_steps_without_decodes_none(vllm_config, plugin_mode, host):
    stand_in = host()
    builder = _builder(vllm_config, RANK)
    table = torch.arange(8, dtype=torch.int32).view(2, 4)
    decodes = _common_metadata(table, [5, 9], [1, 1], torch.tensor([4, 24]))
    first, second = builder.build(0, decodes), builder.build_for_cudagraph_capture(decodes)
    assert first.host_decode_state is not second.host_decode_state
    assert stand_in.states == [first.host_decode_state, second.host_decode_state]
    prefill = _common_metadata(table, [5, 9], [5, 9], torch.arange(14))
    assert builder.build(0, prefill).host_decode_state is None
    mla.set_host_decode(None)
    assert builder.build(0, decodes).host_decode_state is None


def test_atoms_kernel_where_the_host_declines_the_layer_or_the_page_size(vllm_config, plugin_mode, host):
    """A layer the host declines (its reason kept), and a step whose cache pages are not the
    host's size, run atom's decode: outputs still equal dense MLA, the host never called."""
    declined = host(declines=lambda heads, rank, rope, dtype, cache: f"rank {rank}")
    impl = _impl(_KvBProj(RANK))
    impl.process_weights_after_loading(torch.float32)
    assert impl.host_decode is None and impl.host_decode_declined == f"rank {RANK}"
    (out, ref, _), = _step(vllm_config, [impl])[1]
    torch.testing.assert_close(out, ref, atol=2e-4, rtol=2e-4)
    assert declined.calls == []

    other_page = host(page_size=64)
    impl = _impl(_KvBProj(RANK))
    impl.process_weights_after_loading(torch.float32)
    assert impl.host_decode is other_page.hook
    (out, ref, _), = _step(vllm_config, [impl])[1]
    torch.testing.assert_close(out, ref, atol=2e-4, rtol=2e-4)
    assert other_page.calls == []


@pytest.mark.parametrize("page_size,warms", [(BLOCK, False), (64, True)])
def test_triton_decode_warm_up_only_where_atoms_kernel_serves(vllm_config, plugin_mode, host, monkeypatch,
                                                               page_size, warms):
    calls = []
    monkeypatch.setattr(ops, "warm_up_mla_decode", lambda *a, **k: calls.append(a) or 7)
    monkeypatch.setattr(ops.paged_attention, "claim_warm_up", lambda *a: False)
    host(page_size=page_size)
    impl = _impl(_KvBProj(RANK))
    impl.process_weights_after_loading(torch.float32)
    assert impl._block_size == BLOCK
    assert impl.warm_up_kernels(torch.float32, force=True) == (7 if warms else 0)
    assert bool(calls) == warms


# -- the FlashMLA offer (atom.plugin.vllm.mla_decode) ----------------------------------------------------


@pytest.mark.parametrize("args,why", [
    ((128, 512, 64, torch.bfloat16, "auto"), None),
    ((16, 512, 64, torch.float16, "float16"), None),
    ((128, 256, 64, torch.bfloat16, "auto"), "kv_lora_rank 512 + rope 64, not 256 + 64"),
    ((128, 512, 32, torch.bfloat16, "auto"), "not 512 + 32"),
    ((128, 512, 64, torch.float32, "auto"), "bf16/fp16, not torch.float32"),
    ((128, 512, 64, torch.bfloat16, "fp8"), "not fp8"),
])
def test_flashmla_declines(args, why):
    got = mla_decode._declines(*args)
    assert (got is None) if why is None else (why in got), got


@pytest.fixture
def fresh_install():
    mla_decode.install.cache_clear()
    yield
    mla_decode.install.cache_clear()
    mla.set_host_decode(None)


def test_install_off_and_where_flashmla_does_not_run(fresh_install, monkeypatch, caplog):
    """``atom``: never offered. ``auto`` / ``flashmla`` on a machine where vLLM's FlashMLA does
    not run (this CPU): not offered either, the decode rows stay on atom's kernel; the explicit
    ``flashmla`` says so in a warning."""
    monkeypatch.setenv("ATOM_MLA_HOST_DECODE", "atom")
    assert mla_decode.install() is None and mla.host_decode() is None
    if torch.cuda.is_available():
        pytest.skip("a GPU: whether FlashMLA runs is vLLM's answer (the GPU tests' gpu_decode fixture)")
    for choice in ("auto", "flashmla"):
        mla_decode.install.cache_clear()
        monkeypatch.setenv("ATOM_MLA_HOST_DECODE", choice)
        assert mla_decode.flashmla_decode() is None
        with caplog.at_level("WARNING", logger="atom.plugin"):
            assert mla_decode.install() is None and mla.host_decode() is None
        asked = [r for r in caplog.records if "ATOM_MLA_HOST_DECODE=flashmla, but" in r.getMessage()]
        assert len(asked) == (choice == "flashmla")


def _model_config(rank=512, rope=64, dtype=torch.bfloat16):
    from types import SimpleNamespace

    return SimpleNamespace(hf_text_config=SimpleNamespace(kv_lora_rank=rank, qk_rope_head_dim=rope), dtype=dtype)


@pytest.mark.parametrize("offered,config,page", [
    (True, _model_config(), 64),
    (True, _model_config(rank=256), 16),
    (True, _model_config(dtype=torch.float32), 16),
    (False, _model_config(), 16),
])
def test_preferred_page_size(fresh_install, monkeypatch, offered, config, page):
    monkeypatch.setattr(mla_decode, "install", lambda: "FlashMLA" if offered else None)
    assert mla_decode.preferred_block_size(16, config) == page


def test_backend_and_impl_ask_for_flashmlas_pages_unless_the_block_size_was_given(vllm_config, monkeypatch):
    """vLLM asks the backend (under its config) once the model is built; the impl, built before,
    sizes its chunks and warm-up for the same answer, unless ``--block-size`` was given."""
    from vllm.config import set_current_vllm_config

    monkeypatch.setattr(mla_decode, "install", lambda: "FlashMLA")
    monkeypatch.setattr(vllm_config.model_config, "dtype", torch.bfloat16)
    assert vllm_config.model_config.hf_text_config.kv_lora_rank == 512  # the tiny deepseek_v3
    with set_current_vllm_config(vllm_config):
        assert ATOMMLABackend.get_preferred_block_size(16) == 64
        monkeypatch.setattr(vllm_config.cache_config, "user_specified_block_size", False)
        assert _impl(_KvBProj(512), rank=512)._block_size == 64
        monkeypatch.setattr(vllm_config.cache_config, "user_specified_block_size", True)
        assert _impl(_KvBProj(512), rank=512)._block_size == vllm_config.cache_config.block_size
    monkeypatch.setattr(mla_decode, "install", lambda: None)
    with set_current_vllm_config(vllm_config):
        assert ATOMMLABackend.get_preferred_block_size(16) == 16
