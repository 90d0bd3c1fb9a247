"""bench/startup_phases.py reads vLLM's start-up log lines (issue #17 lever 5): these are the
lines vLLM 0.26 wrote on the H200 (bench/results/gpu_2026-11-27g/stock.log.txt)."""

from __future__ import annotations

from tests._bench import load_bench

LOG = """\
INFO 11-27 13:01:43 [default_loader.py:430] Loading weights took 1.15 seconds
INFO 11-27 13:01:44 [gpu_model_runner.py:5347] Model loading took 4.89 GiB memory and 1.667685 seconds
INFO 11-27 13:01:47 [backends.py:1155] Dynamo bytecode transform time: 2.83 s
INFO 11-27 13:02:04 [backends.py:393] Compiling a graph for compile range (1, 16384) takes 16.50 s
INFO 11-27 13:04:07 [gpu_model_runner.py:6844] Graph capturing finished in 8 secs, took 0.11 GiB
INFO 11-27 13:04:08 [core.py:340] init engine (profile, create kv cache, warmup model) took 143.56 s (compilation: 20.34 s)
"""


def test_phases_of_a_vllm_026_log():
    mod = load_bench("startup_phases")
    assert mod.phases(LOG) == {"weights_s": 1.15, "model_loading_s": 1.67, "dynamo_s": 2.83, "inductor_s": 16.5,
                               "torch_compile_s": None, "graph_capture_s": 8.0, "init_engine_s": 143.56,
                               "init_compilation_s": 20.34}
    # an older release's wording (seconds, no compilation part) and repeated compile ranges add up
    older = ("init engine (profile, create kv cache, warmup model) took 61.20 seconds\n"
             "Compiling a graph for compile range (1, 8) takes 3.00 s\nCompiling a graph for compile range (9, 512) takes 4.50 s\n")
    got = mod.phases(older)
    assert got["init_engine_s"] == 61.2 and got["inductor_s"] == 7.5 and got["init_compilation_s"] is None
