"""atom's MLA impl against a dense torch reference of DeepSeek's attention (no absorption, no
cache), at small sizes: shuffled block tables, a cache view that is not contiguous, and one step
mixing decodes, a chunk over cached context (extend) and a fresh prefill -- metadata built by
atom's builder from vLLM's own ``CommonAttentionMetadata``."""

from __future__ import annotations

import math
import os

import pytest
import torch

from atom.ops.mla_prefill import mla_prefill_workspace_bytes
from atom.plugin.vllm.attention_mla import ATOMMLABackend, ATOMMLAImpl, ATOMMLAMetadataBuilder
from tests.conftest import record_applied
from vllm.v1.attention.backend import CommonAttentionMetadata

HEADS, NOPE, ROPE, VDIM = 4, 32, 64, 48
BLOCK, NUM_BLOCKS = 16, 24


class _KvBProj(torch.nn.Module):
    """What the impl needs of vLLM's ColumnParallelLinear kv_b_proj: ``(x @ W^T, None)``."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(HEADS * (NOPE + VDIM), rank) / math.sqrt(rank),
                                         requires_grad=False)
        self.quant_method = None

    def forward(self, x):
        return x @ self.weight.t(), None


@pytest.fixture(scope="module")
def vllm_config(tiny_model):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=str(tiny_model("deepseek_v3", "float32")), max_model_len=128,
                      dtype="float32").create_engine_config()


@pytest.fixture
def plugin_mode():
    with record_applied("vllm.attention.mla_impl"):
        yield


def _builder(vllm_config, rank):
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    spec = MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=rank + ROPE, dtype=torch.float32)
    return ATOMMLAMetadataBuilder(spec, ["model.layers.0.self_attn.attn"], vllm_config, torch.device("cpu"))


def _impl(rank, kv_b_proj):
    return ATOMMLAImpl(HEADS, rank + ROPE, 1 / math.sqrt(NOPE + ROPE), 1, None, None, "auto", None,
                       "decoder", None, q_lora_rank=None, kv_lora_rank=rank, qk_nope_head_dim=NOPE,
                       qk_rope_head_dim=ROPE, qk_head_dim=NOPE + ROPE, v_head_dim=VDIM,
                       kv_b_proj=kv_b_proj)


def _reference(q, c_kv, k_pe, context, w, scale):
    """DeepSeek MLA for one request, straight from the weights: q ``[n, H, nope+rope]`` of the
    last n positions, c_kv ``[ctx+n, rank]``, k_pe ``[ctx+n, rope]``."""
    kv = (c_kv @ w.t()).view(-1, HEADS, NOPE + VDIM)
    k_nope, v = kv.split([NOPE, VDIM], dim=-1)
    k = torch.cat([k_nope, k_pe.unsqueeze(1).expand(-1, HEADS, ROPE)], dim=-1)
    s = torch.einsum("qhd,khd->hqk", q, k) * scale
    n, total = q.shape[0], k.shape[0]
    mask = torch.arange(total)[None, :] > (context + torch.arange(n))[:, None]
    s = s.masked_fill(mask, float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(s, dim=-1), v).reshape(n, HEADS * VDIM)


# (cached context, new tokens) per request, in the order vLLM's reorder puts them:
# decodes, then an extend (a chunk over cached context), then a fresh prefill.
_STEP = [(9, 1), (20, 1), (13, 5), (0, 7)]


def _host_seq_lens(seq: torch.Tensor) -> dict:
    """The host copy of seq_lens under the installed release's field name (>= 0.29: an upper
    bound, exact for prefills; 0.26: ``_seq_lens_cpu`` behind the ``seq_lens_cpu`` property)."""
    fields = CommonAttentionMetadata.__dataclass_fields__
    name = "seq_lens_cpu_upper_bound" if "seq_lens_cpu_upper_bound" in fields else "_seq_lens_cpu"
    return {name: seq} if name in fields and fields[name].init else {}


def _common_metadata(block_table, seq_lens, q_lens, slots) -> CommonAttentionMetadata:
    qsl = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
    seq = torch.tensor(seq_lens, dtype=torch.int32)
    return CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=seq,
        num_reqs=len(q_lens), num_actual_tokens=int(qsl[-1]), max_query_len=max(q_lens),
        max_seq_len=max(seq_lens), block_table_tensor=block_table, slot_mapping=slots,
        **_host_seq_lens(seq),
    )


def _force_triton(monkeypatch) -> None:
    """Run the impl's MLA ops on their Triton kernels (a GPU, or Triton's CPU interpreter)."""
    from atom.ops._dispatch import triton_available

    if not torch.cuda.is_available() and (not triton_available() or os.environ.get("TRITON_INTERPRET") != "1"):
        pytest.skip("needs a GPU or Triton's interpreter")
    monkeypatch.setenv("ATOM_OPS_BACKEND", "mla_decode=triton,mla_write_latent_cache=triton,paged_attention=triton")


@pytest.mark.parametrize("rank,ops_backend", [(64, "auto"), (512, "auto"), (64, "triton")])
def test_impl_matches_dense_mla(vllm_config, plugin_mode, rank, ops_backend, monkeypatch):
    if ops_backend == "triton":
        _force_triton(monkeypatch)
    torch.manual_seed(0)
    kv_b_proj = _KvBProj(rank)
    impl = _impl(rank, kv_b_proj)
    impl.process_weights_after_loading(torch.float32)

    # vLLM's logical [blocks, 1 head, block_size, rank+rope] cache, squeezed as the layer does;
    # a wider allocation makes the view non-contiguous across blocks.
    storage = torch.full((NUM_BLOCKS, 1, BLOCK, rank + ROPE + 8), float("nan"))
    kv_cache = storage[..., : rank + ROPE].squeeze(1)
    assert not kv_cache.is_contiguous()

    blocks = torch.randperm(NUM_BLOCKS, dtype=torch.int32)
    block_table = torch.stack([blocks[i * 4:(i + 1) * 4] for i in range(len(_STEP))])
    c_kv = [torch.randn(c + n, rank) for c, n in _STEP]
    k_pe = [torch.randn(c + n, ROPE) for c, n in _STEP]

    def slots(r, positions):
        return torch.tensor([int(block_table[r, p // BLOCK]) * BLOCK + p % BLOCK for p in positions])

    # the cached context, written by the impl itself in an earlier "step"
    for r, (ctx, _) in enumerate(_STEP):
        if ctx:
            impl.do_kv_cache_update(c_kv[r][:ctx], k_pe[r][:ctx].unsqueeze(1), kv_cache,
                                    slots(r, range(ctx)), "auto", torch.tensor(1.0))
    # this step: its tokens, then attention
    new_slots = torch.cat([slots(r, range(ctx, ctx + n)) for r, (ctx, n) in enumerate(_STEP)])
    new_c = torch.cat([c_kv[r][ctx:] for r, (ctx, _) in enumerate(_STEP)])
    new_pe = torch.cat([k_pe[r][ctx:] for r, (ctx, _) in enumerate(_STEP)]).unsqueeze(1)
    impl.do_kv_cache_update(new_c, new_pe, kv_cache, new_slots, "auto", torch.tensor(1.0))

    q_lens = [n for _, n in _STEP]
    common = _common_metadata(block_table, [c + n for c, n in _STEP], q_lens, new_slots)
    md = _builder(vllm_config, rank).build(0, common)
    assert (md.num_decodes, md.num_decode_tokens, md.num_extends, md.num_prefills, md.num_prefill_tokens) == (2, 2, 1, 1, 12)

    q = torch.randn(sum(q_lens), HEADS, NOPE + ROPE)
    output = torch.full((sum(q_lens) + 3, HEADS * VDIM), float("nan"))  # padded as for graphs
    impl.forward(None, q, new_c, new_pe, kv_cache, md, output)

    start = 0
    for r, (ctx, n) in enumerate(_STEP):
        ref = _reference(q[start:start + n], c_kv[r], k_pe[r], ctx, kv_b_proj.weight, impl.scale)
        torch.testing.assert_close(output[start:start + n], ref, atol=2e-4, rtol=2e-4,
                                   msg=lambda m: f"request {r} (context {ctx}, {n} new): {m}")
        start += n
    assert torch.isnan(output[start:]).all()  # padding rows untouched


class _CountingKvBProj(_KvBProj):
    """kv_b_proj that records how many latent rows each call up-projects."""

    def __init__(self, rank: int) -> None:
        super().__init__(rank)
        self.calls: list[int] = []

    def forward(self, x):
        self.calls.append(x.shape[0])
        return super().forward(x)


def _run_chunked_step(vllm_config, rank, steps, chunk_tokens, kv_b_proj=None, seed=0):
    """One step of ``steps`` [(context, new)] with a shuffled paged cache written by the impl;
    returns (output, reference per request, impl)."""
    torch.manual_seed(seed)
    kv_b_proj = kv_b_proj or _KvBProj(rank)
    impl = _impl(rank, kv_b_proj)
    impl.context_chunk_tokens = chunk_tokens
    impl.process_weights_after_loading(torch.float32)
    per_req = max(-(-(c + n) // BLOCK) for c, n in steps) + 1
    num_blocks = per_req * len(steps) + 3
    kv_cache = torch.full((num_blocks, BLOCK, rank + ROPE), float("nan"))
    block_table = torch.randperm(num_blocks, dtype=torch.int32)[: per_req * len(steps)].view(len(steps), per_req)
    block_table[:, -1] = -1  # unused entries (vLLM pads with anything)
    c_kv = [torch.randn(c + n, rank) for c, n in steps]
    k_pe = [torch.randn(c + n, ROPE) for c, n in steps]

    def slots(r, positions):
        return torch.tensor([int(block_table[r, p // BLOCK]) * BLOCK + p % BLOCK for p in positions],
                            dtype=torch.long)

    for r, (ctx, _) in enumerate(steps):
        if ctx:
            impl.do_kv_cache_update(c_kv[r][:ctx], k_pe[r][:ctx].unsqueeze(1), kv_cache,
                                    slots(r, range(ctx)), "auto", torch.tensor(1.0))
    new_slots = torch.cat([slots(r, range(ctx, ctx + n)) for r, (ctx, n) in enumerate(steps)])
    new_c = torch.cat([c_kv[r][ctx:] for r, (ctx, _) in enumerate(steps)])
    new_pe = torch.cat([k_pe[r][ctx:] for r, (ctx, _) in enumerate(steps)]).unsqueeze(1)
    impl.do_kv_cache_update(new_c, new_pe, kv_cache, new_slots, "auto", torch.tensor(1.0))
    q_lens = [n for _, n in steps]
    md = _builder(vllm_config, rank).build(0, _common_metadata(block_table, [c + n for c, n in steps],
                                                               q_lens, new_slots))
    q = torch.randn(sum(q_lens), HEADS, NOPE + ROPE)
    output = torch.full((sum(q_lens), HEADS * VDIM), float("nan"))
    if isinstance(kv_b_proj, _CountingKvBProj):
        kv_b_proj.calls.clear()
    impl.forward(None, q, new_c, new_pe, kv_cache, md, output)
    refs, start = [], 0
    for r, (ctx, n) in enumerate(steps):
        refs.append(_reference(q[start:start + n], c_kv[r], k_pe[r], ctx, kv_b_proj.weight, impl.scale))
        start += n
    return output, refs, md


# decodes, extends with contexts of many chunks (one not a multiple of the block size), a fresh
# prefill, and an extend whose context is shorter than one chunk
_CHUNKED_STEP = [(70, 1), (5, 1), (150, 6), (0, 9), (83, 3), (10, 4)]


@pytest.mark.parametrize("chunk_tokens", [16, 64, 100, 4096])
@pytest.mark.parametrize("ops_backend", ["auto", "triton"])
def test_chunked_context_matches_dense_mla(vllm_config, plugin_mode, chunk_tokens, ops_backend, monkeypatch):
    """Context walked in chunks of W // rows tokens per row (1 .. 16 of them here; W=4096: one
    chunk), partial outputs merged by their LSEs: equal to dense MLA over the whole context."""
    if ops_backend == "triton":
        _force_triton(monkeypatch)
    output, refs, md = _run_chunked_step(vllm_config, 64, _CHUNKED_STEP, chunk_tokens, seed=chunk_tokens)
    assert (md.num_decodes, md.num_extends, md.num_prefills, md.max_context_len) == (2, 3, 1, 150)
    start = 0
    for r, ((ctx, n), ref) in enumerate(zip(_CHUNKED_STEP, refs)):
        torch.testing.assert_close(output[start:start + n], ref, atol=2e-4, rtol=2e-4,
                                   msg=lambda m: f"request {r} (context {ctx}, {n} new): {m}")
        start += n


def _largest_temporary(fn) -> int:
    """Bytes of the largest tensor any torch op creates while ``fn`` runs (a dispatch-mode
    tracker; CPU-only, deterministic)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Track(TorchDispatchMode):
        largest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in (out if isinstance(out, (tuple, list)) else (out,)):
                if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes():
                    Track.largest = max(Track.largest, t.untyped_storage().nbytes())
            return out

    with Track():
        fn()
    return Track.largest


@pytest.mark.parametrize("context", [200, 800, 3200])
def test_workspace_is_bounded_by_the_chunk_not_the_context(vllm_config, plugin_mode, context):
    """With W = 64: kv_b_proj never sees more than W context rows (or the step's new tokens) at
    once, whatever the context length, and no temporary of forward_mha outgrows what W and the
    step size bound (the whole-context gather would need ``context`` rows)."""
    steps = [(context, 5), (context // 2, 3)]
    proj = _CountingKvBProj(64)
    chunk = 64
    holder = {}

    def run():
        holder["res"] = _run_chunked_step(vllm_config, 64, steps, chunk, kv_b_proj=proj)

    run()  # the step itself (correctness below), then the same with the tracker
    calls = list(proj.calls)
    output, refs, md = holder["res"]
    assert max(calls) <= max(chunk, 8) and len(calls) == 1 + -(-context // (chunk // 2))
    torch.testing.assert_close(output, torch.cat(refs), atol=2e-4, rtol=2e-4)
    # forward alone under the tracker (cache setup excluded): rebuild the inputs first
    impl = _impl(64, proj)
    impl.context_chunk_tokens = chunk
    impl.process_weights_after_loading(torch.float32)
    cache = torch.randn(-(-context // BLOCK) * 2 + 4, BLOCK, 64 + ROPE)
    table = torch.randperm(cache.shape[0], dtype=torch.int32)[: 2 * (cache.shape[0] // 2)].view(2, -1)
    q_lens = [5, 3]
    common = _common_metadata(table, [context + 5, context // 2 + 3], q_lens,
                              torch.arange(8, dtype=torch.long))
    md = _builder(vllm_config, 64).build(0, common)
    q = torch.randn(8, HEADS, NOPE + ROPE)
    out = torch.empty(8, HEADS * VDIM)
    largest = _largest_temporary(lambda: impl.forward(None, q, None, None, cache, md, out))
    bound = mla_prefill_workspace_bytes(chunk, 8, HEADS, 64, ROPE, NOPE, VDIM, torch.float32)
    assert largest <= bound
    assert largest < context * HEADS * (NOPE + VDIM) * 4  # below one whole-context up-projection
    assert largest <= chunk * HEADS * (NOPE + ROPE + VDIM) * 4  # the chunk's key/value buffer


def test_context_chunk_size_from_vllm_config(vllm_config, monkeypatch):
    """W: vLLM's MLA workspace rule capped at 16k tokens, at least max_num_seqs;
    ATOM_MLA_CONTEXT_CHUNK_TOKENS overrides it (what vLLM's impl passes in)."""
    from vllm.config import set_current_vllm_config

    from atom.models.attention.mla import MAX_CONTEXT_CHUNK_TOKENS, context_chunk_tokens

    sched, model = vllm_config.scheduler_config, vllm_config.model_config
    block = vllm_config.cache_config.block_size or 16
    expected = max(min(max(8 * model.max_model_len, 4 * sched.max_num_seqs * block), MAX_CONTEXT_CHUNK_TOKENS),
                   sched.max_num_seqs)
    assert context_chunk_tokens(model.max_model_len, sched.max_num_seqs, block) == expected
    assert context_chunk_tokens(model.max_model_len, sched.max_num_seqs, block, 4096) == max(4096, sched.max_num_seqs)
    assert context_chunk_tokens(model.max_model_len, 8192, block, 4096) == 8192  # never below max_num_seqs
    assert context_chunk_tokens(None, None, 16, 4096) == 4096
    assert context_chunk_tokens(None, None, 16) == MAX_CONTEXT_CHUNK_TOKENS
    assert context_chunk_tokens(100_000, 1, 16) == MAX_CONTEXT_CHUNK_TOKENS  # the cap
    # what vLLM's impl reads: the config it is built in and the variable
    monkeypatch.setenv("ATOM_MLA_CONTEXT_CHUNK_TOKENS", "4096")
    with set_current_vllm_config(vllm_config):
        assert _impl(64, _KvBProj(64)).context_chunk_tokens == max(4096, sched.max_num_seqs)
    monkeypatch.delenv("ATOM_MLA_CONTEXT_CHUNK_TOKENS")
    with set_current_vllm_config(vllm_config):
        assert _impl(64, _KvBProj(64)).context_chunk_tokens == expected
    assert _impl(64, _KvBProj(64)).context_chunk_tokens == MAX_CONTEXT_CHUNK_TOKENS  # built by hand


def test_impl_built_in_vllms_config_sizes_its_workspace(vllm_config, plugin_mode):
    """Built inside vLLM's config context (as MLAAttention.__init__ builds it), the impl fixes W
    and the step bound from the config; the profiling-run branch (no metadata) allocates the
    bound on CUDA only and returns zeros."""
    from vllm.config import set_current_vllm_config

    from atom.models.attention.mla import context_chunk_tokens

    with set_current_vllm_config(vllm_config):
        impl = _impl(64, _KvBProj(64))
    sched = vllm_config.scheduler_config
    assert impl.context_chunk_tokens == context_chunk_tokens(
        vllm_config.model_config.max_model_len, sched.max_num_seqs, vllm_config.cache_config.block_size)
    tokens = vllm_config.scheduler_config.max_num_batched_tokens
    assert impl.workspace_bytes(torch.float32) == mla_prefill_workspace_bytes(
        impl.context_chunk_tokens, tokens, HEADS, 64, ROPE, NOPE, VDIM, torch.float32) > 0
    assert _impl(64, _KvBProj(64)).workspace_bytes(torch.float32) == 0  # built by hand: unknown
    out = torch.full((3, HEADS * VDIM), 7.0)
    impl.forward(None, torch.randn(3, HEADS, NOPE + ROPE), None, None, torch.empty(0), None, out)
    assert not out.any()


def test_latent_cache_holds_the_rows_as_given(plugin_mode):
    torch.manual_seed(0)
    impl = _impl(64, _KvBProj(64))
    cache = torch.zeros(4, BLOCK, 64 + ROPE)
    c, pe = torch.randn(3, 64), torch.randn(3, 1, ROPE)
    impl.do_kv_cache_update(c, pe, cache, torch.tensor([5, -1, 40]), "auto", torch.tensor(1.0))
    flat = cache.view(-1, 64 + ROPE)
    assert torch.equal(flat[5], torch.cat([c[0], pe[0, 0]])) and torch.equal(flat[40], torch.cat([c[2], pe[2, 0]]))
    assert flat.count_nonzero(dim=1).gt(0).sum() == 2  # the padding row (-1) wrote nothing


def test_profiling_run_without_metadata_returns_zeros(plugin_mode):
    impl = _impl(64, _KvBProj(64))
    out = torch.full((3, HEADS * VDIM), 7.0)
    assert impl.forward(None, torch.randn(3, HEADS, NOPE + ROPE), None, None, torch.empty(0), None, out) is out
    assert not out.any()


def test_warm_up_at_load_runs_every_mla_kernel_variant(vllm_config, plugin_mode, monkeypatch):
    """``warm_up_kernels`` launches the decode once per split-reduce bucket and forward_mha's two
    prefill launches (Triton interpreter, forced), once per shape; the layer computes the same
    afterwards; off a GPU the post-load hook launches nothing."""
    from atom.ops import attention_triton, mla_decode, paged_attention

    _force_triton(monkeypatch)
    monkeypatch.setattr(mla_decode, "_warmed", set())
    monkeypatch.setattr(paged_attention, "_warmed", set())
    torch.manual_seed(0)
    impl = _impl(64, _KvBProj(64))
    impl.process_weights_after_loading(torch.float32)  # CPU: no warm-up
    assert mla_decode._warmed == set() and paged_attention._warmed == set()
    w_uk, w_uv = impl.W_UK_T.clone(), impl.W_UV.clone()
    assert impl.warm_up_kernels(torch.float32, force=True) == len(attention_triton.WARM_UP_SPLITS) + 2
    assert impl.warm_up_kernels(torch.float32, force=True) == 0
    torch.testing.assert_close(impl.W_UK_T, w_uk)
    torch.testing.assert_close(impl.W_UV, w_uv)


def test_post_load_hook_warms_up_with_vllms_block_size(vllm_config, plugin_mode, monkeypatch):
    """The injected ``process_weights_after_loading`` calls the warm-up with vLLM's act dtype, and
    the decode warm-up gets the block size of the vLLM config the layer was built in."""
    import atom.ops as ops
    from vllm.config import set_current_vllm_config

    monkeypatch.setattr(vllm_config.cache_config, "block_size", 32)
    with set_current_vllm_config(vllm_config):
        impl = _impl(64, _KvBProj(64))
    monkeypatch.undo()
    calls = []
    monkeypatch.setattr(ATOMMLAImpl, "warm_up_kernels", lambda self, dt, **k: calls.append(dt) or 0)
    impl.process_weights_after_loading(torch.bfloat16)
    assert calls == [torch.bfloat16]
    monkeypatch.undo()
    seen = []
    monkeypatch.setattr(ops, "warm_up_mla_decode", lambda *a, **k: seen.append(a) or 0)
    monkeypatch.setattr(ops.paged_attention, "claim_warm_up", lambda *a, **k: False)
    impl.warm_up_kernels(torch.bfloat16, force=True)
    assert seen == [(HEADS, 64, ROPE, torch.bfloat16, 32, torch.device("cpu"))]


@pytest.mark.parametrize("kw,match", [
    ({"sliding_window": 8}, "sliding window"),
    ({"kv_cache_dtype": "fp8"}, "fp8"),
    ({"indexer": object()}, "sparse"),
    ({"kv_sharing_target_layer_name": "x"}, "KV sharing"),
])
def test_impl_refuses_what_the_selector_cannot_see(kw, match):
    args = dict(num_heads=HEADS, head_size=64 + ROPE, scale=1.0, num_kv_heads=1, alibi_slopes=None,
                sliding_window=None, kv_cache_dtype="auto", logits_soft_cap=None, attn_type="decoder",
                kv_sharing_target_layer_name=None, q_lora_rank=None, kv_lora_rank=64,
                qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE, qk_head_dim=NOPE + ROPE,
                v_head_dim=VDIM, kv_b_proj=None)
    with pytest.raises(NotImplementedError, match=match):
        ATOMMLAImpl(**{**args, **kw})


def test_kv_cache_geometry():
    assert ATOMMLABackend.get_kv_cache_shape(10, 16, 1, 576) == (10, 16, 576)
    assert ATOMMLABackend.supports_head_size(576) and ATOMMLABackend.supports_head_size(64 + 64)
    # head_size = kv_lora_rank + 64: ranks are multiples of 16 up to 512
    assert not any(ATOMMLABackend.supports_head_size(h) for h in (64, 64 + 40, 512 + 64 + 16))


# -- GPU: atom's Triton kernels through the impl at DeepSeek-V3 sizes, bf16 ---------------------------
G_HEADS, G_NOPE, G_ROPE, G_V, G_RANK = 16, 128, 64, 128, 512


class _BigKvBProj(torch.nn.Module):
    def __init__(self, dtype):
        super().__init__()
        w = torch.randn(G_HEADS * (G_NOPE + G_V), G_RANK, device="cuda") / math.sqrt(G_RANK)
        self.weight = torch.nn.Parameter(w.to(dtype), requires_grad=False)
        self.quant_method = None

    def forward(self, x):
        return x @ self.weight.t(), None


def _gpu_reference(q, c_kv, k_pe, context, w, scale):
    q, c_kv, k_pe, w = q.float(), c_kv.float(), k_pe.float(), w.float()
    kv = (c_kv @ w.t()).view(-1, G_HEADS, G_NOPE + G_V)
    k = torch.cat([kv[..., :G_NOPE], k_pe[:, None].expand(-1, G_HEADS, G_ROPE)], -1)
    s = torch.einsum("qhd,khd->hqk", q, k) * scale
    n, total = q.shape[0], k.shape[0]
    mask = torch.arange(total, device=q.device)[None] > (context + torch.arange(n, device=q.device))[:, None]
    p = s.masked_fill(mask, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", p, kv[..., G_NOPE:]).reshape(n, -1)


def _gpu_setup(vllm_config, steps, block=64, num_blocks=64):
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    torch.manual_seed(0)
    dt = torch.bfloat16
    proj = _BigKvBProj(dt)
    impl = ATOMMLAImpl(G_HEADS, G_RANK + G_ROPE, 1 / math.sqrt(G_NOPE + G_ROPE), 1, None, None, "auto",
                       None, "decoder", None, q_lora_rank=1536, kv_lora_rank=G_RANK, qk_nope_head_dim=G_NOPE,
                       qk_rope_head_dim=G_ROPE, qk_head_dim=G_NOPE + G_ROPE, v_head_dim=G_V, kv_b_proj=proj)
    impl.process_weights_after_loading(dt)
    cache = torch.zeros(num_blocks, 1, block, G_RANK + G_ROPE, device="cuda", dtype=dt).squeeze(1)
    per_req = -(-max(c + n for c, n in steps) // block)
    table = torch.randperm(num_blocks, device="cuda", dtype=torch.int32)[: len(steps) * per_req].view(len(steps), per_req)
    c_kv = [torch.randn(c + n, G_RANK, device="cuda", dtype=dt) for c, n in steps]
    k_pe = [torch.randn(c + n, G_ROPE, device="cuda", dtype=dt) for c, n in steps]

    def slots(r, positions):
        pos = torch.tensor(list(positions), device="cuda")
        return (table[r, pos // block].long() * block + pos % block)

    all_slots = [slots(r, range(c + n)) for r, (c, n) in enumerate(steps)]
    impl.do_kv_cache_update(torch.cat(c_kv), torch.cat(k_pe)[:, None], cache, torch.cat(all_slots), "auto",
                            torch.tensor(1.0, device="cuda"))
    spec = MLAAttentionSpec(block_size=block, num_kv_heads=1, head_size=G_RANK + G_ROPE, dtype=dt)
    builder = ATOMMLAMetadataBuilder(spec, ["l0"], vllm_config, torch.device("cuda"))
    q_lens = [n for _, n in steps]
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    seq = torch.tensor([c + n for c, n in steps], dtype=torch.int32)
    new_slots = torch.cat([s[c:] for s, (c, _) in zip(all_slots, steps)])
    common = CommonAttentionMetadata(
        query_start_loc=qsl.cuda(), query_start_loc_cpu=qsl, seq_lens=seq.cuda(), num_reqs=len(steps),
        num_actual_tokens=int(qsl[-1]), max_query_len=max(q_lens), max_seq_len=int(seq.max()),
        block_table_tensor=table, slot_mapping=new_slots, **_host_seq_lens(seq))
    return impl, proj, cache, builder, common, c_kv, k_pe


@pytest.fixture(params=["atom", "flashmla"])
def gpu_decode(request, monkeypatch):
    """The decode kernel of the GPU tests: atom's Triton kernel, or vLLM's FlashMLA (must be
    offered on a Hopper GPU: these are DeepSeek's latent sizes in 64-token pages)."""
    from atom.models.attention.mla import set_host_decode
    from atom.plugin.vllm import mla_decode

    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    if request.param == "flashmla" and torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("vLLM's FlashMLA dense decode runs on Hopper")
    monkeypatch.setenv("ATOM_MLA_HOST_DECODE", request.param)
    mla_decode.install.cache_clear()
    assert mla_decode.install() == (mla_decode.FLASHMLA if request.param == "flashmla" else None)
    yield request.param
    mla_decode.install.cache_clear()
    set_host_decode(None)


@pytest.mark.gpu
def test_gpu_triton_impl_at_deepseek_sizes_bf16(vllm_config, plugin_mode, gpu_decode):
    """Mixed step (decodes, an extend over 700 cached tokens, a prefill) through atom's Triton
    kernels vs dense fp32 MLA; every op must have run its Triton implementation, the decode rows
    on atom's kernel or on vLLM's FlashMLA (``gpu_decode``)."""
    import atom.ops as ops

    assert all(ops.OPS[n].backend_on("cuda")[0] == "triton" for n in ("mla_decode", "mla_write_latent_cache", "paged_attention"))
    steps = [(1000, 1), (37, 1), (700, 64), (0, 200)]
    impl, proj, cache, builder, common, c_kv, k_pe = _gpu_setup(vllm_config, steps)
    assert (impl.host_decode is not None) == (gpu_decode == "flashmla")
    md = builder.build(0, common)
    n = common.num_actual_tokens
    q = torch.randn(n, G_HEADS, G_NOPE + G_ROPE, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(n, G_HEADS * G_V, device="cuda", dtype=torch.bfloat16)
    impl.forward(None, q, None, None, cache, md, out)
    start = 0
    for r, (ctx, k) in enumerate(steps):
        ref = _gpu_reference(q[start:start + k], c_kv[r], k_pe[r], ctx, proj.weight, impl.scale)
        torch.testing.assert_close(out[start:start + k].float(), ref, atol=3e-2, rtol=3e-2)
        start += k


@pytest.mark.gpu
def test_gpu_decode_replays_in_a_cuda_graph(vllm_config, plugin_mode, gpu_decode):
    """build_for_cudagraph_capture + capture of the decode forward, then replay after the
    context lengths changed (written into vLLM's seq_lens buffer in place): no host reads, and the
    split count fixed at capture (atom's kernel) or FlashMLA's tile schedule computed inside the
    graph still covers the other lengths."""
    steps = [(300, 1), (5, 1), (1500, 1), (64, 1)]
    impl, proj, cache, builder, common, c_kv, k_pe = _gpu_setup(vllm_config, steps, num_blocks=160)
    assert (impl.host_decode is not None) == (gpu_decode == "flashmla")
    q = torch.randn(4, G_HEADS, G_NOPE + G_ROPE, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(4, G_HEADS * G_V, device="cuda", dtype=torch.bfloat16)
    # warm up (Triton compile) outside capture; the capture gets metadata of its own, as vLLM
    # builds it for each capture
    impl.forward(None, q, None, None, cache, builder.build_for_cudagraph_capture(common), out)
    md = builder.build_for_cudagraph_capture(common)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        impl.forward(None, q, None, None, cache, md, out)
    # replay at the captured lengths, then with shorter contexts, then about half of them (other
    # tile schedules)
    for lens in ([c + 1 for c, _ in steps], [c + 1 - (3 if c + 1 > 3 else 0) for c, _ in steps],
                 [c // 2 + 1 for c, _ in steps]):
        common.seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        for r, total in enumerate(lens):
            ref = _gpu_reference(q[r:r + 1], c_kv[r][:total], k_pe[r][:total], total - 1, proj.weight, impl.scale)
            torch.testing.assert_close(out[r:r + 1].float(), ref, atol=3e-2, rtol=3e-2)


def _chunked_torch_reference(q, c_kv, k_pe, context, w, scale, heads, nope, vdim, chunk=2048):
    """fp32 MLA of one request computed in key chunks with an online softmax (independent of
    atom's code; bounded memory at DeepSeek sizes): q ``[n, H, nope+rope]`` of the last n
    positions over c_kv ``[ctx+n, rank]`` / k_pe ``[ctx+n, rope]``."""
    q, w = q.float(), w.float()
    n, total = q.shape[0], c_kv.shape[0]
    m = torch.full((heads, n), float("-inf"), device=q.device)
    l = torch.zeros(heads, n, device=q.device)
    acc = torch.zeros(heads, n, vdim, device=q.device)
    qpos = context + torch.arange(n, device=q.device)
    for k0 in range(0, total, chunk):
        kv = (c_kv[k0:k0 + chunk].float() @ w.t()).view(-1, heads, nope + vdim)
        pe = k_pe[k0:k0 + chunk].float()[:, None].expand(-1, heads, -1)
        k = torch.cat([kv[..., :nope], pe], -1)
        s = torch.einsum("qhd,khd->hqk", q, k) * scale
        kpos = k0 + torch.arange(k.shape[0], device=q.device)
        s = s.masked_fill(kpos[None, None, :] > qpos[None, :, None], float("-inf"))
        m_new = torch.maximum(m, s.amax(-1))
        alpha = torch.exp(m - m_new)
        p = torch.exp(s - m_new[..., None])
        l = l * alpha + p.sum(-1)
        acc = acc * alpha[..., None] + torch.einsum("hqk,khd->hqd", p, kv[..., nope:])
        m = m_new
    return (acc / l[..., None]).transpose(0, 1).reshape(n, heads * vdim)


@pytest.mark.gpu
@pytest.mark.parametrize("chunk_tokens", [None, 4096])
def test_gpu_chunked_context_deepseek_v3_sizes_bf16(vllm_config, plugin_mode, chunk_tokens):
    """DeepSeek-V3's MLA geometry (128 heads, kv_lora 512, rope 64, nope 128, v 128), bf16,
    contexts of 8k-16k tokens: atom's chunked forward_mha (default W: 2-4 chunks per row;
    W=4096: 8-16 per row) vs an fp32 reference computed in chunks in torch; the CUDA memory peak
    of the step stays under the workspace bound (independent of the context length), and the
    profiling-run branch allocates that bound."""
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    heads, rank, rope, nope, vdim, block = 128, 512, 64, 128, 128, 64
    dt = torch.bfloat16
    # no decode row: the step is all forward_mha, so its peak is what the bound covers
    steps = [(12000, 2), (16000, 64), (8000, 128), (0, 256)]
    torch.manual_seed(0)

    class Proj(torch.nn.Module):
        def __init__(self):
            super().__init__()
            w = torch.randn(heads * (nope + vdim), rank, device="cuda") / math.sqrt(rank)
            self.weight = torch.nn.Parameter(w.to(dt), requires_grad=False)
            self.quant_method = None

        def forward(self, x):
            return x @ self.weight.t(), None

    proj = Proj()
    impl = ATOMMLAImpl(heads, rank + rope, 1 / math.sqrt(nope + rope), 1, None, None, "auto", None,
                       "decoder", None, q_lora_rank=1536, kv_lora_rank=rank, qk_nope_head_dim=nope,
                       qk_rope_head_dim=rope, qk_head_dim=nope + rope, v_head_dim=vdim, kv_b_proj=proj)
    if chunk_tokens:
        impl.context_chunk_tokens = chunk_tokens
    impl.process_weights_after_loading(dt)
    per_req = -(-max(c + n for c, n in steps) // block)
    num_blocks = per_req * len(steps) + 8
    cache = torch.zeros(num_blocks, block, rank + rope, device="cuda", dtype=dt)
    table = torch.randperm(num_blocks, device="cuda", dtype=torch.int32)[: len(steps) * per_req].view(len(steps), per_req)
    c_kv = [torch.randn(c + n, rank, device="cuda", dtype=dt) for c, n in steps]
    k_pe = [torch.randn(c + n, rope, device="cuda", dtype=dt) for c, n in steps]
    all_slots = []
    for r, (c, n) in enumerate(steps):
        pos = torch.arange(c + n, device="cuda")
        all_slots.append(table[r, pos // block].long() * block + pos % block)
    impl.do_kv_cache_update(torch.cat(c_kv), torch.cat(k_pe)[:, None], cache, torch.cat(all_slots), "auto",
                            torch.tensor(1.0, device="cuda"))
    spec = MLAAttentionSpec(block_size=block, num_kv_heads=1, head_size=rank + rope, dtype=dt)
    builder = ATOMMLAMetadataBuilder(spec, ["l0"], vllm_config, torch.device("cuda"))
    q_lens = [n for _, n in steps]
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    seq = torch.tensor([c + n for c, n in steps], dtype=torch.int32)
    new_slots = torch.cat([s[c:] for s, (c, _) in zip(all_slots, steps)])
    common = CommonAttentionMetadata(
        query_start_loc=qsl.cuda(), query_start_loc_cpu=qsl, seq_lens=seq.cuda(), num_reqs=len(steps),
        num_actual_tokens=int(qsl[-1]), max_query_len=max(q_lens), max_seq_len=int(seq.max()),
        block_table_tensor=table, slot_mapping=new_slots, **_host_seq_lens(seq))
    md = builder.build(0, common)
    n = common.num_actual_tokens
    q = torch.randn(n, heads, nope + rope, device="cuda", dtype=dt)
    out = torch.empty(n, heads * vdim, device="cuda", dtype=dt)
    impl.forward(None, q, None, None, cache, md, out)  # warm-up (Triton compile)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    impl.forward(None, q, None, None, cache, md, out)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    bound = mla_prefill_workspace_bytes(impl.context_chunk_tokens, n, heads, rank, rope, nope, vdim, dt)
    whole = max(c + k for c, k in steps) * len(steps) * heads * (nope + vdim) * 2  # the old whole-context gather
    print(f"W={impl.context_chunk_tokens}: peak {peak / 2**20:.0f} MiB, bound {bound / 2**20:.0f} MiB, "
          f"whole-context up-projection {whole / 2**20:.0f} MiB")
    assert peak <= bound
    # vLLM's profiling run (no metadata): the layer allocates the bound, so vLLM's peak sees it
    impl._max_step_tokens = n
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    impl.forward(None, q, None, None, torch.empty(0, device="cuda"), None, torch.empty_like(out))
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - base >= bound
    start = 0
    for r, (ctx, k) in enumerate(steps):
        ref = _chunked_torch_reference(q[start:start + k], c_kv[r], k_pe[r], ctx, proj.weight, impl.scale,
                                       heads, nope, vdim)
        torch.testing.assert_close(out[start:start + k].float(), ref, atol=3e-2, rtol=3e-2,
                                   msg=lambda m: f"request {r} (context {ctx}, {k} new): {m}")
        start += k
