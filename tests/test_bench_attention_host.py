"""``bench/attention_host.py``: the batch it builds is a valid paged step, and atom's impl (the
torch reference on this CPU) computes the attention the script checks each side against."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import attention_host as ah  # noqa: E402


def test_batch_is_a_valid_paged_step():
    sc = ah.Scenario("t", decodes=3, ctx=21, prefills=2, prefill_len=7)
    b = ah.build_batch(sc, heads=4, kv_heads=2, head_dim=8, page=16, dtype=torch.float32, device="cpu")
    assert b.query_start_loc.tolist() == [0, 1, 2, 3, 10, 17]
    assert b.seq_lens.tolist() == [22, 22, 22, 7, 7]
    assert (b.max_query_len, b.max_seq_len) == (7, 22)
    ctx = [ah._ctx_slots(b, r) for r in range(5)]
    every = torch.cat([b.slot_mapping, *ctx])
    assert every.unique().numel() == every.numel() == 3 * 22 + 2 * 7  # no slot written twice
    assert int(every.max()) < b.num_blocks * 16
    # each request's slots lie in its own blocks, its new tokens after its context
    for r in range(5):
        lo, hi = int(b.query_start_loc[r]), int(b.query_start_loc[r + 1])
        own = set(b.block_table[r].tolist())
        assert {int(s) // 16 for s in torch.cat([ctx[r], b.slot_mapping[lo:hi]])} <= own
        positions = [int(s) % 16 + 16 * b.block_table[r].tolist().index(int(s) // 16) for s in b.slot_mapping[lo:hi]]
        assert positions == list(range(int(b.seq_lens[r]) - (hi - lo), int(b.seq_lens[r])))


def test_smoke_run_matches_the_reference(tmp_path):
    out = tmp_path / "host.json"
    assert ah.main(["--smoke", "--sides", "atom", "--iters", "2", "--repeats", "2", "--json", str(out)]) == 0
    cell = json.loads(out.read_text())["scenarios"]["mixed-smoke"]
    assert cell["tokens"] == 5 + 2 * 7 and cell["requests"] == 7
    assert cell["atom"]["max_abs_err"] < 1e-4
    assert cell["atom"]["host_us"] > 0 and cell["atom"]["synced_us"] >= cell["atom"]["host_us"]
    assert cell["atom"]["gpu_us"] is None  # GPU time: CUDA only


def test_gpu_time_queues_the_call_behind_a_gpu_sleep(monkeypatch):
    """``gpu_us``: per repeat, synchronise, sleep on the GPU, then the call between two events (its
    launches are all queued before the GPU reaches them); the median of the events' times in us."""
    log, elapsed = [], iter([0.05, 0.02, 0.03])

    class Event:
        def __init__(self, enable_timing):
            assert enable_timing

        def record(self):
            log.append("record")

        def elapsed_time(self, end):
            return next(elapsed)

    monkeypatch.setattr(ah.torch.cuda, "Event", Event)
    monkeypatch.setattr(ah.torch.cuda, "synchronize", lambda: log.append("sync"))
    monkeypatch.setattr(ah.torch.cuda, "_sleep", lambda cycles: log.append("sleep"))
    assert ah.gpu_time_us(lambda: log.append("call"), 3, "cuda") == 30.0
    assert log == ["sync", "sleep", "record", "call", "record", "sync"] * 3
    assert ah.gpu_time_us(lambda: None, 3, "cpu") is None


def test_reference_is_causal_attention():
    """The check the sides are held to: a one-token row sees its whole context; the first token
    of a prefill sees only itself (its output is its own value row)."""
    sc = ah.Scenario("t", decodes=1, ctx=5, prefills=1, prefill_len=3)
    b = ah.build_batch(sc, heads=2, kv_heads=1, head_dim=4, page=16, dtype=torch.float32, device="cpu")
    want = ah.reference(b)
    torch.testing.assert_close(want[1], b.v[1].expand(2, 4))
    k = torch.cat([b.ctx_k[0], b.k[:1]])[:, 0]
    v = torch.cat([b.ctx_v[0], b.v[:1]])[:, 0]
    p = torch.softmax(b.q[0] @ k.T * 0.5, -1)
    torch.testing.assert_close(want[0], p @ v)


def test_stubbed_kernels_launch_nothing(monkeypatch):
    """--stub-kernels: atom's attention and cache-write launches become no-ops, so what is timed is
    the Python around them (the output is left as it was)."""
    import importlib

    for module, name in ah.ATTENTION_KERNELS:
        mod = importlib.import_module(module)
        monkeypatch.setattr(mod, name, getattr(mod, name))  # put back after the test
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("ATOM_OPS_BACKEND", "paged_attention=triton,reshape_and_cache=triton")
    sc = ah.Scenario("t", decodes=2, ctx=5, prefills=1, prefill_len=3)
    b = ah.build_batch(sc, heads=4, kv_heads=2, head_dim=16, page=16, dtype=torch.float32, device="cpu")
    call = ah.atom_side(b, heads=4, kv_heads=2, head_dim=16, page=16, dtype=torch.float32, device="cpu")
    torch.testing.assert_close(call(), ah.reference(b), atol=1e-4, rtol=1e-4)  # the interpreted kernels
    ah.stub_atom_kernels()
    out = call()
    out.fill_(7.0)
    assert (call() == 7.0).all()  # nothing written any more


def test_sides_are_timed_interleaved_in_rotating_order(monkeypatch):
    """Each repeat times one loop of every side, the order rotated by one side per repeat, after
    every side's warm-up: a drift of the host's speed then reaches all sides alike."""
    log = []
    calls = {n: (lambda n=n: log.append(n)) for n in ("a", "b", "c")}
    ticks = iter(range(1000))
    monkeypatch.setattr(ah.time, "perf_counter", lambda: next(ticks))
    t = ah.time_interleaved(calls, 2, 3, lambda: log.append("|"))
    assert log == ["a"] * 3 + ["b"] * 3 + ["c"] * 3 + ["|"] + [
        x for order in ("abc", "bca", "cab") for side in order for x in (side, side, "|")]
    assert set(t) == {"a", "b", "c"} and t["a"]["repeats"] == 3 and t["a"]["interleaved"] == ["a", "b", "c"]
    # each loop of 2 calls spans 1 tick before the sync and 2 with it: 0.5 and 1.0 per call
    assert t["b"]["host_us"] == 0.5e6 and t["b"]["synced_us"] == 1e6


def test_atom_fa_side_runs_multi_token_steps_on_the_offer_in_the_same_process(monkeypatch, tmp_path):
    """``atom-fa``: atom's layer with vLLM's FlashAttention offered to it alone (here the test
    stand-in for the kernel), timed next to the plain atom side; both match the reference, only
    the atom-fa side calls the offer, and the process-wide offer is left as it was."""
    from atom.models.attention import mha
    from atom.plugin.vllm import mha_prefill
    from tests.attention.test_mha_host_prefill import StandIn, stand_in_offer

    fake = StandIn()
    monkeypatch.setattr(mha_prefill, "flash_attn_prefill", lambda: stand_in_offer(fake))
    monkeypatch.setattr(mha_prefill, "install", lambda: None)  # vLLM's own offer: none on this CPU
    mha.set_host_prefill(None)
    out = tmp_path / "host.json"
    assert ah.main(["--smoke", "--sides", "atom,atom-fa", "--iters", "2", "--repeats", "2", "--json", str(out)]) == 0
    cell = json.loads(out.read_text())["scenarios"]["mixed-smoke"]
    assert cell["atom"]["max_abs_err"] < 1e-4 and cell["atom-fa"]["max_abs_err"] < 1e-4
    # the atom-fa side's calls: its check, 3 warm-ups, 2 repeats x 2 iters; the atom side's none
    assert len(fake.calls) == 1 + 3 + 2 * 2 and {c["rows"] for c in fake.calls} == {5 + 2 * 7}
    assert mha.host_prefill() is None
