#!/usr/bin/env python
"""bench/results/latest.json: the speed protocol's current numbers, and the docs table made from it.

    python bench/latest.py            # exit 1 (and say what) when latest.json or the docs table is stale
    python bench/latest.py --write    # rebuild latest.json from RECORDS, regenerate the docs table

``RECORDS`` names the bench/ab.py JSON records that are current. Records of the same cell (model
label, input/output length, concurrency, arrivals, engine arguments, reference) are pooled side by
side wherever a side name ran the same model class and attention impls (whichever other sides ran
next to it): every measurement window of every launch counts, a side's ratio is the ratio of its
pooled median to the reference's over the records it ran in, with a bootstrap 95% interval over the
windows (bench/ab.py's), and its ``launches`` say how many engine launches contributed (the cell's
``launches_per_side``: the reference's). Older records lack the GPU and package versions; a RECORDS entry
supplies them (``assumed``) and latest.json says which fields were supplied that way.

latest.json also judges issues #16 and #17's speed targets on those cells (``TARGETS``; ``WHY`` says why
one is not met). The two tables between the markers in docs/performance.md (cells, targets) are
generated from latest.json (tests/test_bench_latest.py keeps them in sync).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
from ab import bootstrap_ratio, verdict  # noqa: E402  (bench/ modules are imported as scripts)

LATEST = REPO / "bench" / "results" / "latest.json"
DOC = REPO / "docs" / "performance.md"
BEGIN = "<!-- generated from bench/results/latest.json by bench/latest.py: begin -->"
END = "<!-- generated from bench/results/latest.json by bench/latest.py: end -->"

_H100_0_26 = {"gpu": "NVIDIA H100 80GB HBM3",
              "versions": {"vllm": "0.26.0", "torch": "2.11.0+cu130", "triton": "3.6.0"}}
#: Why a record's cell is shown but decides nothing (a RECORDS entry's ``not_counted``): the stock side of
#: every Qwen3-MoE block-fp8 cell before 2026-12-01 ran a router that is not the release format's
#: (bench/NOTES.md 68). vLLM's Qwen3-MoE router takes the fp8 config; the bench's checkpoints did not list
#: it in ``modules_to_not_convert`` as Qwen3-30B-A3B-FP8 does, so vLLM quantised it: on random-weight
#: checkpoints (bf16 router in the file, no scale) with its placeholder scale (float32's minimum), on
#: dummy weights with dummy fp8 values, whose routing at 128 sequences reached about half the experts'
#: bytes per step. Weight memory counts from every record (the router's dtype moves it by 0.25 MB per
#: layer). Records from 2026-12-02 on carry each side's router facts, and bench/ab.py marks a mismatch itself.
STOCK_ROUTER_FP8_RANDOM = ("stock's Qwen3-MoE router ran in fp8 with vLLM's placeholder scale (the checkpoint "
                           "did not list it as unquantised, as the release does)")
STOCK_ROUTER_FP8_DUMMY = ("stock's Qwen3-MoE router ran in fp8 on dummy weights (the config did not list it as "
                          "unquantised, as the release does): its routing reached about half the experts per step")
#: The 2026-12-01 full-depth C=1 cell, counted until the same cell ran with both routers bf16 (2026-12-02,
#: bench/NOTES.md 72): the new records decide it, these stay shown.
STOCK_ROUTER_FP8_SUPERSEDED = ("stock's Qwen3-MoE router ran in fp8 on dummy weights; superseded by the same cell "
                               "with both sides' routers bf16 (2026-12-02)")
#: The 2026-12-02 full-depth fp8 MoE cell with atom's grouped fp8 expert tiles before they were swapped (A and B,
#: bench/NOTES.md 73): the same cell with the new tiles (2026-12-02b) decides it, these stay shown.
ATOM_FP8_TILES_SUPERSEDED = ("atom's fp8 expert tiles before the swapped-A/B change (bench/NOTES.md 73); superseded by "
                             "the same cell with the new tiles (2026-12-02b)")
#: The DeepSeek-V3 fp8 cell on vLLM's dummy weights before bench/ab.py drew the routers (2026-12-02d, bench/NOTES.md
#: 75): vLLM's dummy loader gives every parameter of one size and dtype the same values, and DeepSeek-V3's correction
#: bias (+-1e-3) outweighs the router logits (~1e-5), so every token went to the same 8 of 256 experts on both sides;
#: and the sides' routers held different values (drawn in bf16 by stock, in float32 by atom). bench/ab.py marked it.
DUMMY_ROUTING_COLLAPSED = ("vLLM's dummy routers sent every DeepSeek-V3 token to the same 8 of 256 experts (the "
                           "correction bias outweighs the logits), and the sides' routers held different values; "
                           "bench/ab.py now draws the routers itself")
#: The current records (paths relative to the repository) and what older records did not store.
RECORDS: list[dict[str, Any]] = [
    {"path": "bench/results/h100_2026-11-24/ab_dense.json", "assumed": _H100_0_26},
    {"path": "bench/results/h100_2026-11-24/ab_moe.json", "assumed": _H100_0_26},
    {"path": "bench/results/h100_2026-11-24/ab_moe_run2.json", "assumed": _H100_0_26},
    {"path": "bench/results/h100_2026-11-24/ab_mla.json", "assumed": _H100_0_26},
    # dense fp8 C=1 / C=64: re-measured with the fused activation quantisation (the C=256 cell and
    # the MoE cells are from the code before it)
    {"path": "bench/results/h100_2026-11-24d/ab_dense-fp8_c1.json"},
    {"path": "bench/results/h100_2026-11-24d/ab_dense-fp8_c64.json"},
    {"path": "bench/results/h100_2026-11-24b/ab_dense-fp8_c256.json"},
    # MoE fp8 (Qwen3-30B-A3B dims, 4 layers): two launches per side of 20-s windows after an
    # unmeasured warm-up window, stock with FlashInfer staged (2026-11-27b; replaces 2026-11-24b's
    # one launch of 8-s windows without FlashInfer)
    {"path": "bench/results/h100_2026-11-27b/ab_moe-fp8_launch1_c1.json", "not_counted": STOCK_ROUTER_FP8_RANDOM},
    {"path": "bench/results/h100_2026-11-27b/ab_moe-fp8_launch2_c1.json", "not_counted": STOCK_ROUTER_FP8_RANDOM},
    {"path": "bench/results/h100_2026-11-27b/ab_moe-fp8_launch1_c128.json", "not_counted": STOCK_ROUTER_FP8_RANDOM},
    {"path": "bench/results/h100_2026-11-27b/ab_moe-fp8_launch2_c128.json", "not_counted": STOCK_ROUTER_FP8_RANDOM},
    # fp8 at the issue's other dims (2026-11-24e): DeepSeek-V3 dims (two launches, pooled),
    # Qwen3-235B-A22B and Qwen3-32B dims
    {"path": "bench/results/h100_2026-11-24e/ab_mla-fp8_c1.json"},
    {"path": "bench/results/h100_2026-11-24e/ab_mla-fp8_run2_c1.json"},
    {"path": "bench/results/h100_2026-11-24e/ab_mla-fp8_c64.json"},
    {"path": "bench/results/h100_2026-11-24e/ab_mla-fp8_run2_c64.json"},
    {"path": "bench/results/h100_2026-11-24e/ab_moe235-fp8_c1.json", "not_counted": STOCK_ROUTER_FP8_RANDOM},
    {"path": "bench/results/h100_2026-11-24e/ab_moe235-fp8_c64.json", "not_counted": STOCK_ROUTER_FP8_RANDOM},
    {"path": "bench/results/h100_2026-11-24f/ab_dense32-fp8_run1_c1.json"},
    {"path": "bench/results/h100_2026-11-24f/ab_dense32-fp8_run2_c1.json"},
    {"path": "bench/results/h100_2026-11-24f/ab_dense32-fp8_run3_c1.json"},
    {"path": "bench/results/h100_2026-11-24f/ab_dense32-fp8_run1_c64.json"},
    {"path": "bench/results/h100_2026-11-24f/ab_dense32-fp8_run2_c64.json"},
    {"path": "bench/results/h100_2026-11-24f/ab_dense32-fp8_run3_c64.json"},
    # DeepSeek-V3 dims, bf16, 1024/1024, atom's decode rows on vLLM's FlashMLA (2026-11-24g)
    {"path": "bench/results/h100_2026-11-24g/ab_mla-1024_c1.json"},
    {"path": "bench/results/h100_2026-11-24g/ab_mla-1024_c64.json"},
    # issue #17 "Also": one quick throughput cell per architecture first run on a GPU (one launch,
    # 2 rounds of 10 s; Llama, Mixtral, GLM-4-MoE on the H100, GPT-OSS on the H200)
    {"path": "bench/results/h100_2026-11-27c/archs/ab_llama.json"},
    {"path": "bench/results/gpu_2026-11-27d/archs/ab_mixtral.json"},
    {"path": "bench/results/gpu_2026-11-27d/archs/ab_glm4moe.json"},
    {"path": "bench/results/gpu_2026-11-27d/archs/ab_gptoss.json"},
    # GPT-OSS again on an H200 (2026-11-27f): three more launches (5, 2 and 2 rounds of 15 s) in two
    # commands, pooled with the quick check above
    {"path": "bench/results/gpu_2026-11-27f/ab_gptoss_launch1.json"},
    {"path": "bench/results/gpu_2026-11-27f/ab_gptoss_launch2-3.json"},
    # ATOM_BF16_GEMV (atom with it vs atom without, the reference), Qwen3-8B dims at full depth,
    # batch 1, H200: three launches in two commands, pooled
    {"path": "bench/results/gpu_2026-11-27d/gemv_h200/ab_dense_L36_c1_a.json"},
    {"path": "bench/results/gpu_2026-11-27d/gemv_h200/ab_dense_L36_c1_b.json"},
    # Full depth against stock (2026-11-27h, H200): Qwen3-8B dims, all 36 layers, C=1 and C=64, three
    # launches in two commands (launches 2-3's C=64 record rebuilt from the command's text output,
    # bench/results/gpu_2026-11-27h/rebuild_c64.py: the device tool did not return that file)
    {"path": "bench/results/gpu_2026-11-27h/ab_dense_L36_launch1_c1.json"},
    {"path": "bench/results/gpu_2026-11-27h/ab_dense_L36_launch2-3_c1.json"},
    {"path": "bench/results/gpu_2026-11-27h/ab_dense_L36_launch1_c64.json"},
    {"path": "bench/results/gpu_2026-11-27h/ab_dense_L36_launch2-3_c64.json"},
    # Qwen3-30B-A3B dims, all 48 layers, bf16, vLLM's dummy weights (no checkpoint on disk), H200:
    # launch 1 (2026-11-27i), launches 2 and 3 (2026-11-27j, one command each, fresh H200s)
    {"path": "bench/results/gpu_2026-11-27i/ab_moe-dummy_L48_launch1_c1.json"},
    {"path": "bench/results/gpu_2026-11-27i/ab_moe-dummy_L48_launch1_c128.json"},
    {"path": "bench/results/gpu_2026-11-27j/ab_moe-dummy_L48_launch2_c1.json"},
    {"path": "bench/results/gpu_2026-11-27j/ab_moe-dummy_L48_launch2_c128.json"},
    {"path": "bench/results/gpu_2026-11-27j/ab_moe-dummy_L48_launch3_c1.json"},
    {"path": "bench/results/gpu_2026-11-27j/ab_moe-dummy_L48_launch3_c128.json"},
    # The online-serving cell (continuous arrivals, Qwen3-8B dims, 36 layers, dummy weights, C=64),
    # H200 (2026-11-28): stock vs atom with direct launches and the GEMV off ("lean") and the same with
    # ATOM_MHA_HOST_PREFILL=flash_attn ("fa"); two launches in two commands after a cold fill
    {"path": "bench/results/h200_2026-11-28/ab_dense-dummy-cont_launch1.json"},
    {"path": "bench/results/h200_2026-11-28/ab_dense-dummy-cont_launch2.json"},
    {"path": "bench/results/h200_2026-11-28e/ab_dense-dummy-cont_launch3.json"},
    # The same cell with vLLM serve's capture sizes (CUDA graphs up to 512 tokens: a prompt joining the
    # decodes runs in piecewise graphs), H200 (2026-11-28f): stock, atom's default and the default with
    # direct launches; one launch cut short by the command's limit (ab.py did not yet record --engine)
    {"path": "bench/results/h200_2026-11-28f/ab_dense-dummy-cont-cap512_launch1.json",
     "assumed": {"engine": {"compilation_config": {"max_cudagraph_capture_size": 512}}}},
    # The same capture-512 cell, H200 (2026-11-28h), one command per pair on one machine: stock vs
    # vattn (atom's model, vLLM's attention: ATOM_DISABLE_VLLM_PLUGIN_ATTENTION=1), then stock vs atom
    {"path": "bench/results/h200_2026-11-28h/ab_dense-dummy-cont-cap512_vattn.json"},
    {"path": "bench/results/h200_2026-11-28h/ab_dense-dummy-cont-cap512_atom.json"},
    # ... and on the next machine, stock vs atom's new default (atom's MHA backend steps aside on NVIDIA:
    # the atom side runs vLLM's FlashAttention, the same configuration as vattn; its own row, since
    # records pool only where each side ran the same classes)
    {"path": "bench/results/h200_2026-11-28h/ab_dense-dummy-cont-cap512_default.json"},
    # The same capture-512 cell, H200 (2026-11-29), three launches of three sides: stock; atom with its
    # dense Qwen3 stepping aside on NVIDIA (vLLM's Qwen3 and attention under atom's platform); amodel
    # (ATOM_ENABLE_ON_NVIDIA=Qwen3ForCausalLM: atom's model on vLLM's attention, the previous default)
    {"path": "bench/results/h200_2026-11-29/ab_dense-dummy-cont-cap512_launch1.json"},
    {"path": "bench/results/h200_2026-11-29/ab_dense-dummy-cont-cap512_launch2.json"},
    {"path": "bench/results/h200_2026-11-29/ab_dense-dummy-cont-cap512_launch3.json"},
    # The same capture-512 cell, H200 (2026-11-29b), an A/A control: stock, atom (the same default as
    # above) and stock2 (stock again with its own compile cache), four launches, start order rotated
    {"path": "bench/results/h200_2026-11-29b/ab_dense-dummy-cont-cap512_aa_launch1.json"},
    {"path": "bench/results/h200_2026-11-29b/ab_dense-dummy-cont-cap512_aa_launch2.json"},
    {"path": "bench/results/h200_2026-11-29b/ab_dense-dummy-cont-cap512_aa_launch3.json"},
    {"path": "bench/results/h200_2026-11-29b/ab_dense-dummy-cont-cap512_aa_launch4.json"},
    # fp8 MoE, H200 (2026-11-29c): Qwen3-30B-A3B dims, 4 layers, 128x128 block fp8, batch arrivals; stock
    # (vLLM's Triton fp8 MoE, FlashInfer/DeepGEMM block-fp8 linears) vs atom (its MoE model and fused fp8
    # experts); four launches over three commands, start order rotated
    {"path": "bench/results/h200_2026-11-29c/ab_moe-fp8_launch12_c1.json", "not_counted": STOCK_ROUTER_FP8_RANDOM},
    {"path": "bench/results/h200_2026-11-29c/ab_moe-fp8_launch3_c1.json", "not_counted": STOCK_ROUTER_FP8_RANDOM},
    {"path": "bench/results/h200_2026-11-29c/ab_moe-fp8_launch4_c1.json", "not_counted": STOCK_ROUTER_FP8_RANDOM},
    {"path": "bench/results/h200_2026-11-29c/ab_moe-fp8_launch12_c128.json", "not_counted": STOCK_ROUTER_FP8_RANDOM},
    {"path": "bench/results/h200_2026-11-29c/ab_moe-fp8_launch3_c128.json", "not_counted": STOCK_ROUTER_FP8_RANDOM},
    {"path": "bench/results/h200_2026-11-29c/ab_moe-fp8_launch4_c128.json", "not_counted": STOCK_ROUTER_FP8_RANDOM},
    # fp8 MoE at full depth, H200 (2026-12-01): Qwen3-30B-A3B dims, all 48 layers, 128x128 block fp8, vLLM's dummy
    # weights, batch arrivals, CUDA graphs up to 128; stock vs atom (its default: its MoE model, fused fp8 experts);
    # three launches over two commands, start order and first-measured side rotated, starts overlapped
    {"path": "bench/results/h200_2026-12-01/ab_moe-fp8-dummy_launch12_c1.json", "not_counted": STOCK_ROUTER_FP8_SUPERSEDED},
    {"path": "bench/results/h200_2026-12-01/ab_moe-fp8-dummy_launch3_c1.json", "not_counted": STOCK_ROUTER_FP8_SUPERSEDED},
    {"path": "bench/results/h200_2026-12-01/ab_moe-fp8-dummy_launch12_c128.json", "not_counted": STOCK_ROUTER_FP8_DUMMY},
    {"path": "bench/results/h200_2026-12-01/ab_moe-fp8-dummy_launch3_c128.json", "not_counted": STOCK_ROUTER_FP8_DUMMY},
    # The same cell again (2026-12-02, H200), the checkpoint listing every router unquantised as the release does:
    # both sides' routers bf16 (recorded per side); three launches over two commands after a cold fill
    {"path": "bench/results/h200_2026-12-02/ab_moe-fp8-dummy_c1_launch12.json", "not_counted": ATOM_FP8_TILES_SUPERSEDED},
    {"path": "bench/results/h200_2026-12-02/ab_moe-fp8-dummy_c1_launch3.json", "not_counted": ATOM_FP8_TILES_SUPERSEDED},
    {"path": "bench/results/h200_2026-12-02/ab_moe-fp8-dummy_c128_launch12.json", "not_counted": ATOM_FP8_TILES_SUPERSEDED},
    {"path": "bench/results/h200_2026-12-02/ab_moe-fp8-dummy_c128_launch3.json", "not_counted": ATOM_FP8_TILES_SUPERSEDED},
    # The same cell with atom's swapped-A/B fp8 expert tiles (2026-12-02b, H200, bench/NOTES.md 73; atom's wheel from
    # 668ad07): cold fill, then three launches over two commands
    {"path": "bench/results/h200_2026-12-02b/ab_moe-fp8-dummy_c1_launch12.json"},
    {"path": "bench/results/h200_2026-12-02b/ab_moe-fp8-dummy_c1_launch3.json"},
    {"path": "bench/results/h200_2026-12-02b/ab_moe-fp8-dummy_c128_launch12.json"},
    {"path": "bench/results/h200_2026-12-02b/ab_moe-fp8-dummy_c128_launch3.json"},
    # DeepSeek-V3 dims in block fp8 with its own 256 experts (1 dense + 3 MoE layers), vLLM's dummy weights, H200
    # (2026-12-02d, bench/NOTES.md 75; atom at 40200d8): cold fill, then two launches in one command
    {"path": "bench/results/h200_2026-12-02d/ab_mla-e256-fp8-dummy_c1.json", "not_counted": DUMMY_ROUTING_COLLAPSED},
    {"path": "bench/results/h200_2026-12-02d/ab_mla-e256-fp8-dummy_c64.json", "not_counted": DUMMY_ROUTING_COLLAPSED},
    # the same cell with the routers drawn by bench/ab.py, the same on both sides (bench/NOTES.md 77): three launches
    # per side over two commands (stock's first C=64 window held its first fused_moe_kernel compile of the machine)
    {"path": "bench/results/h200_2026-12-03/ab_mla-e256-fp8-dummy_launch1_c1.json"},
    {"path": "bench/results/h200_2026-12-03/ab_mla-e256-fp8-dummy_launch1_c64.json"},
    {"path": "bench/results/h200_2026-12-03/ab_mla-e256-fp8-dummy_launch23_c1.json"},
    {"path": "bench/results/h200_2026-12-03/ab_mla-e256-fp8-dummy_launch23_c64.json"},
    # DeepSeek-V3 at one TP-8 rank's shapes on one GPU (16 heads, expert intermediate 256, dense 2304; 256 experts
    # top-8, block fp8, routers drawn; 2026-12-03c, bench/NOTES.md 79): stock on its tuned E=256,N=256 H200 file;
    # cold fills one side per call, then three launches per side over two commands
    {"path": "bench/results/h200_2026-12-03c/ab_mla8-fp8-dummy_launch12_c1.json"},
    {"path": "bench/results/h200_2026-12-03c/ab_mla8-fp8-dummy_launch12_c64.json"},
    {"path": "bench/results/h200_2026-12-03c/ab_mla8-fp8-dummy_launch3_c1.json"},
    {"path": "bench/results/h200_2026-12-03c/ab_mla8-fp8-dummy_launch3_c64.json"},
]


#: The protocol's launches per side for a verdict that counts; below it the verdict says so, and a
#: ratio within +-SINGLE_RUN_TIE of 1 is a tie whatever its interval (the interval of one or two
#: launches does not hold the launch-to-launch spread).
MIN_LAUNCHES = 3
SINGLE_RUN_TIE = 0.10


def cell_verdict(point: float, low: float, high: float, launches: int) -> str:
    """The table's verdict: bench/ab.py's (win when the interval's low end is above 1, loss when its
    high end is below 1) from MIN_LAUNCHES launches per side; with fewer, suffixed
    ``(< 3 launches)``, and a tie when the ratio is within SINGLE_RUN_TIE of 1."""
    if launches >= MIN_LAUNCHES:
        return verdict(low, high)
    short = "tie" if abs(point - 1.0) <= SINGLE_RUN_TIE else verdict(low, high)
    return f"{short} (< {MIN_LAUNCHES} launches)"


def _engine(rec: dict, entry: dict) -> dict:
    """The engine arguments a record ran with (``bench/ab.py --engine``; records older than that
    field take them from the RECORDS entry's ``assumed``), less ``load_format`` (the label says
    dummy weights)."""
    engine = rec.get("engine", entry.get("assumed", {}).get("engine", {}))
    return {k: v for k, v in engine.items() if k != "load_format"}


def _cell(rec: dict, entry: dict) -> str:
    """IN/OUT@C; records whose windows kept C requests in flight (``bench/ab.py --arrivals
    continuous``) are cells of their own, never pooled with batch-arrival ones; so are records
    with other engine arguments (vLLM serve's capture sizes: ``capture 512``)."""
    cont = " continuous" if rec.get("arrivals") == "continuous" else ""
    engine = _engine(rec, entry)
    if list(engine) == ["compilation_config"] and list(engine["compilation_config"]) == ["max_cudagraph_capture_size"]:
        cont += f" capture {engine['compilation_config']['max_cudagraph_capture_size']}"
    elif engine:
        cont += " " + json.dumps(engine, sort_keys=True, separators=(",", ":"))
    return f"{rec['in']}/{rec['out']}@{rec['conc']}{cont}"


def _facts(rec: dict, entry: dict) -> tuple[str, dict, list[str]]:
    """(gpu, versions, names of fields taken from the RECORDS entry) of one record."""
    assumed = entry.get("assumed", {})
    supplied = []
    gpu = rec.get("gpu")
    if not gpu:
        gpu, supplied = assumed.get("gpu", "unknown"), supplied + ["gpu"]
    ref = rec["sides"][rec["reference"]]
    versions = {k: v for k, v in ref["facts"].get("versions", {}).items() if k != "atom_from"}
    if not versions:
        versions, supplied = dict(assumed.get("versions", {})), supplied + ["versions"]
    if "engine" not in rec and "engine" in assumed:
        supplied.append("engine")
    return gpu, versions, supplied


def _flashinfer(versions: dict) -> str:
    """The table's note that FlashInfer was staged (vLLM may select other kernels with it)."""
    return f" + FlashInfer {versions['flashinfer']}" if versions.get("flashinfer") else ""


def _side_configuration(rec: dict, name: str) -> tuple:
    """What a side ran: (model class, attention impls). Its name alone does not say it (``atom`` ran
    atom's attention before 2026-11-28h and vLLM's on NVIDIA after)."""
    facts = rec["sides"][name]["facts"]
    return facts.get("model_class"), tuple(facts.get("attention_impls") or ())


def _group(records: list[tuple[dict, dict]]) -> list[tuple[tuple, list[tuple[dict, dict]]]]:
    """Records of one cell (model label, lengths, concurrency, arrivals, engine arguments, reference
    side and what it ran) pool, whichever other sides ran next to them, as long as every side name
    they share ran the same classes: a side's ratio to the reference does not depend on which third
    side shared the GPU, so atom's windows from an A/B and from an A/B/C of the same cell count together.
    A side name that ran other classes (atom's attention before and after a step-aside) opens a cell
    of its own."""
    groups: list[tuple[tuple, dict[str, tuple], list[tuple[dict, dict]]]] = []
    for rec, entry in records:
        key = (rec["label"] or rec["model"], _cell(rec, entry), rec["reference"],
               _side_configuration(rec, rec["reference"]), entry.get("not_counted") or rec.get("not_counted", ""))
        configs = {n: _side_configuration(rec, n) for n in rec["sides"]}
        for gkey, gconfigs, members in groups:
            if gkey == key and all(gconfigs.get(n, c) == c for n, c in configs.items()):
                gconfigs.update(configs)
                members.append((rec, entry))
                break
        else:
            groups.append((key, dict(configs), [(rec, entry)]))
    return [(key, members) for key, _, members in groups]


#: Board power limits (W) by GPU name, for records made before bench/ab.py sampled ``power.limit``:
#: the SXM parts these cells ran on.
POWER_LIMIT_W = {"H100 80GB HBM3": 700.0, "H200": 700.0}
#: Below this share of the power limit (median over a side's windows, at full clocks) the GPU waited on
#: the host for much of each window: the cell times host work as much as kernels (docs/performance.md).
#: For scale: a memory-bound decode that keeps the GPU busy (Qwen3-8B dims, 36 layers, batch 1) drew
#: 70-73 % on the H200; the 4-layer fp8 MoE at batch 1, whose 2-ms tokens read under 0.1 ms of weights, 21-23 %.
HOST_BOUND_POWER_SHARE = 0.4
#: nvidia-smi's utilization.gpu (the share of time a kernel was running) from which a low-power side
#: is not waiting on the host: its GPU ran kernels throughout that were too small to draw power, so
#: the cell times kernel latency (a long chain of small launches), not host work: "latency-bound".
#: Records from 2026-11-29c on sample it; older ones keep the power mark alone. The full-depth fp8
#: MoE at batch 1 (2026-12-01) drew 30-36 % of the H200's 700 W at 100 % utilization.
BUSY_UTILIZATION = 90.0


def _power(windows: list[dict[str, Any]], gpu: str) -> dict[str, Any]:
    """A side's GPU power over its windows: the median of the windows' medians (W), its share of the
    limit (sampled, else :data:`POWER_LIMIT_W` by name) and the median utilization where sampled."""
    watts = [w["power_w_median"] for w in windows if w.get("power_w_median") is not None]
    if not watts:
        return {}
    out: dict[str, Any] = {"power_w_median": round(statistics.median(watts), 1)}
    limits = [w["power_limit_w"] for w in windows if w.get("power_limit_w")]
    limit = max(limits) if limits else next((v for k, v in POWER_LIMIT_W.items() if k in gpu), None)
    if limit:
        out["power_of_limit"] = round(out["power_w_median"] / limit, 3)
    util = [w["gpu_util_median"] for w in windows if w.get("gpu_util_median") is not None]
    if util:
        out["gpu_util_median"] = statistics.median(util)
    return out


def _low_power(side: dict[str, Any]) -> bool:
    return side.get("power_of_limit", 1.0) < HOST_BOUND_POWER_SHARE


def _host_bound(side: dict[str, Any]) -> bool:
    """Low power and (where sampled) the GPU idle for part of the time: waiting on the host."""
    return _low_power(side) and side.get("gpu_util_median", 0.0) < BUSY_UTILIZATION


def _latency_bound(side: dict[str, Any]) -> bool:
    """Low power with a kernel running nearly all the time: small kernels, not host work."""
    return _low_power(side) and side.get("gpu_util_median", 0.0) >= BUSY_UTILIZATION


def _power_cell(s: dict[str, Any]) -> str:
    if "power_w_median" not in s:
        return "-"
    text = f"{s['power_w_median']:,.0f} W"
    if "power_of_limit" in s:
        text += f" ({s['power_of_limit']:.0%})"
        if "gpu_util_median" in s:
            text += f", busy {s['gpu_util_median']:.0f}%"
        text += " host-bound" if _host_bound(s) else " latency-bound" if _latency_bound(s) else ""
    return text


def build(records: list[dict[str, Any]] | None = None, root: Path = REPO) -> dict[str, Any]:
    """latest.json's content from the records (pooled per cell: :func:`_group`). Each side's ratio is
    taken against the reference's windows of the records that side ran in (its interleaved partner
    windows), with that side's own launch count."""
    loaded = [(json.loads((root / entry["path"]).read_text()), entry) for entry in (RECORDS if records is None else records)]
    cells = []
    for (label, cell, ref, _, not_counted), members in _group(loaded):
        names = list(dict.fromkeys(n for rec, _ in members for n in rec["sides"]))
        facts = [_facts(rec, entry) for rec, entry in members]
        if len({(g, json.dumps(v, sort_keys=True)) for g, v, _ in facts}) > 1:
            raise ValueError(f"{label} {cell}: records from different GPUs or versions cannot be pooled: "
                             f"{[e['path'] for _, e in members]}")
        gpu, versions, _ = facts[0]
        sides = {}
        for n in names:
            runs = [rec for rec, _ in members if n in rec["sides"]]
            windows = [t for rec in runs for t in rec["sides"][n]["tok_s"]]
            last = runs[-1]["sides"][n]
            side = {
                "median_tok_s": round(statistics.median(windows), 1),
                "windows": len(windows),
                "launches": sum(rec.get("launches_per_side", 1) for rec in runs),
                "model_class": last["facts"].get("model_class"),
                "attention_impls": last["facts"].get("attention_impls"),
                "kernel_log_lines": sorted({k for rec in runs for k in rec["sides"][n]["kernel_log_lines"]}),
                "throttled_windows": sum(rec["sides"][n]["throttled_windows"] for rec in runs),
            }
            side.update(_power([w for rec in runs for w in rec["sides"][n].get("clocks") or []], gpu))
            gib = [rec["sides"][n]["facts"].get("weight_gib") for rec in runs]
            if any(g is not None for g in gib):  # vLLM's "Model loading took X GiB" (records since 2026-11-24e)
                side["weight_gib"] = [g for g in gib if g is not None][-1]
            if n != ref:
                partner = [t for rec in runs for t in rec["sides"][ref]["tok_s"]]
                point, low, high = bootstrap_ratio(windows, partner)
                side.update(ratio=round(point, 4), ratio_ci_low=round(low, 4), ratio_ci_high=round(high, 4),
                            verdict="not counted" if not_counted else cell_verdict(point, low, high, side["launches"]))
            sides[n] = side
        cells.append({
            "model": label, "cell": cell, "conc": members[0][0]["conc"], "reference": ref, "gpu": gpu,
            "versions": versions,
            "dates": sorted(rec["date"] for rec, _ in members),
            "launches_per_side": sides[ref]["launches"],
            "window_s_min": min(rec["window_s"] for rec, _ in members),
            "assumed_fields": sorted({f for _, _, s in facts for f in s}),
            "sources": [entry["path"] for _, entry in members],
            "sides": sides,
            **({"not_counted": not_counted} if not_counted else {}),
        })
    out = {"protocol": "bench/ab.py: sides alive at once on one GPU, interleaved windows, ratio of medians "
                       "with a bootstrap 95% interval; win only when the low end is above 1; with fewer than "
                       f"{MIN_LAUNCHES} launches per side the verdict says so, and a ratio within "
                       f"{SINGLE_RUN_TIE:.0%} of 1 is a tie",
           "cells": cells}
    out["targets"] = targets(out)
    return out


TARGETS_BEGIN = "<!-- targets generated from bench/results/latest.json by bench/latest.py: begin -->"
TARGETS_END = "<!-- targets generated from bench/results/latest.json by bench/latest.py: end -->"

#: The speed targets of issues #17 (bf16) and #16 (fp8), judged on latest.json's ``atom`` side (atom's
#: default when the cell ran): (id, issue, model family, fp8 checkpoint, kind, bound, wording). The
#: issues state them for the H100; cells of the H100 and the H200 both count.
#: ``batch1``: the C=1 cells, output tok/s ratio; the interval's low end must reach ``bound`` (TPOT
#: <= 0.90x stock is output tok/s >= 1/0.90 at one request in flight). ``throughput``: every cell at
#: C 32-256, the low end >= ``bound``. ``memory``: atom's weight memory after load over stock's
#: (vLLM's "Model loading took ... GiB"), <= ``bound``, from any record that has it (not a noisy number).
#: Only cells of MIN_LAUNCHES launches or more decide; the others are listed as such.
TARGETS = [
    ("dense-throughput", "#17", "dense", False, "throughput", 1.10, "output tok/s at C 32-256 >= 1.10x"),
    ("dense-batch1", "#17", "dense", False, "batch1", 1 / 0.90, "batch-1 TPOT <= 0.90x"),
    ("moe-throughput", "#17", "moe", False, "throughput", 1.05, "output tok/s at C 32-256 >= 1.05x"),
    ("moe-batch1", "#17", "moe", False, "batch1", 1 / 0.90, "batch-1 TPOT <= 0.90x"),
    ("mla-throughput", "#17", "mla", False, "throughput", 1.05, "output tok/s at C 32-256 >= 1.05x"),
    ("mla-batch1", "#17", "mla", False, "batch1", 1 / 0.90, "batch-1 TPOT <= 0.90x"),
    ("dense-fp8-batch1", "#16", "dense", True, "batch1", 1 / 0.90, "batch-1 TPOT <= 0.90x"),
    ("dense-fp8-throughput", "#16", "dense", True, "throughput", 1.15, "output tok/s at C 32-256 >= 1.15x"),
    ("dense-fp8-memory", "#16", "dense", True, "memory", 1.02, "weight memory <= 1.02x"),
    ("moe-fp8-batch1", "#16", "moe", True, "batch1", 1 / 0.90, "batch-1 TPOT <= 0.90x"),
    ("moe-fp8-throughput", "#16", "moe", True, "throughput", 1.15, "output tok/s at C 32-256 >= 1.15x"),
    ("moe-fp8-memory", "#16", "moe", True, "memory", 1.02, "weight memory <= 1.02x"),
    ("mla-fp8-batch1", "#16", "mla", True, "batch1", 1 / 0.90, "batch-1 TPOT <= 0.90x"),
    ("mla-fp8-throughput", "#16", "mla", True, "throughput", 1.15, "output tok/s at C 32-256 >= 1.15x"),
    ("mla-fp8-memory", "#16", "mla", True, "memory", 1.02, "weight memory <= 1.02x"),
]

#: Model labels (their first dash-separated word) per target family: Qwen3 dense (8B, 32B dims),
#: Qwen3 MoE (30B-A3B, 235B-A22B dims), DeepSeek-V3 dims (MLA; mla8: one TP-8 rank's shapes). The other
#: architectures have no target.
FAMILIES = {"dense": "dense", "dense32": "dense", "moe": "moe", "moe235": "moe", "mla": "mla", "mla8": "mla"}

#: Why a target is not met (or not decided), and where the profile or measurement that explains it
#: is (a docs/performance.md section in quotes, or a bench/NOTES.md entry); for a met target, what the
#: deciding cells ran where that is no longer atom's default. tests/test_bench_latest.py fails when a
#: target that is not met has no line.
WHY = {
    "dense-throughput": "By kernel time atom's C=64 step was 0.945x stock's (GEMMs 73 %, the same cuBLAS kernels on "
                        "both sides): at most ~1.06x (\"Full depth, atom vs stock\"). In online serving atom's model "
                        "lost (0.80x), so on NVIDIA atom now steps aside for dense Qwen3 and stock's model serves; "
                        "that default still measured 0.94x [0.86, 0.97] over 7 launches, a loss, where a second "
                        "stock engine measured 0.99x [0.90, 1.07] over 4 (\"An A/A control of the capture-512 "
                        "cell\"); the cause is not found (a CPU shows none: bench/NOTES.md 56-60).",
    "dense-batch1": "Missed by 0.01: atom's GEMV streams the weights at 83 % of HBM and the step's kernels take 0.894x "
                    "stock's; fewer, larger launches would be needed (\"Full depth, atom vs stock\"). The cell ran "
                    "atom's model, which on NVIDIA now serves dense Qwen3 only with "
                    "ATOM_ENABLE_ON_NVIDIA=Qwen3ForCausalLM.",
    "moe-throughput": "Explained by the MoE cell's kernel profile at C=256 (128/128, H100, 16 of 48 layers; \"Where "
                      "the time goes\"): the experts are 76-78 % of kernel time on both sides and atom's fused MoE "
                      "took 1.02x the time of vLLM's tuned fused_moe_kernel (1,010 vs 986 ms); only atom's attention "
                      "(0.72x) brought the total to 0.99x, and on NVIDIA atom now runs vLLM's FlashAttention. Decode "
                      "steps at C <= 256 route <= 16 tokens to an expert, which the later tile-edge change does not "
                      "touch, so atom's step is ~1.00-1.02x stock's kernel time, as the full-depth C=128 cell measured "
                      "(1.03x): 1.05x would need an expert kernel >= 7 % faster than vLLM's at these sizes, which no "
                      "tile sweep found (lever 3).",
    "moe-batch1": "Met with atom's attention (before its MHA backend stepped aside on NVIDIA, 2026-11-28h); today's "
                  "default (atom's MoE model on vLLM's FlashAttention) is not re-measured.",
    "mla-throughput": "A tie: atom's decode runs vLLM's FlashMLA (0.86-0.98x of FlashMLA's own time with the q_pe "
                      "copy), stock FlashAttention 3's MLA, which ties FlashMLA at this depth; the experts ~1.02x "
                      "(\"MLA decode on vLLM's FlashMLA\"). 4 layers of 61; no profile of the cell itself.",
    "mla-batch1": "As the throughput row: both sides' attention and expert kernels within a few % at one request "
                  "(\"MLA decode on vLLM's FlashMLA\"; \"MoE at small batches: the GEMV path\": the expert GEMV saves "
                  "0.4-1.2 % of a 4-layer step).",
    "dense-fp8-batch1": "Measured with atom's model (2026-11-24): 1.00x. Since then atom steps aside for dense block "
                        "fp8 on NVIDIA (vLLM's model serves, stock's number; ATOM_ENABLE_FP8_BLOCK_ON_NVIDIA=1 for "
                        "atom's); atom's fp8 dispatch has changed since (GEMV at 1 token, FlashInfer's swap-AB at "
                        "2-16) and is not re-measured end to end (\"Block fp8 at 2-16 tokens\").",
    "dense-fp8-throughput": "Measured with atom's model on DeepGEMM (17+ tokens): 0.98x at C=64 on Qwen3-32B dims, the "
                            "same kernel as stock's; the 8B dims' single launches (0.86x, 0.92x) ran the older Triton "
                            "W8A8 dispatch. So atom steps aside for dense block fp8 on NVIDIA (\"H100: block-fp8 "
                            "weights stay fp8\").",
    "moe-fp8-batch1": "Missed, a 1 % loss at full depth: 0.99x [0.990, 0.995] over 3 launches (Qwen3-30B-A3B dims, 48 "
                      "layers, H200, 2026-12-02b, both sides' routers bf16; the earlier 0.99x [0.98, 1.00] with "
                      "atom's older tiles and 2026-12-01's against stock's fp8 router agree). The step is "
                      "latency-bound on both sides (31-36 % of the board's power at 100 % busy: 3.6 ms per token, "
                      "where its ~2.8 GB of weights stream in ~0.6 ms); the expert GEMV's gain at the kernel "
                      "(~0.3 ms of the token) is not seen end to end; at one token the GEMV stays 1.17-1.24x faster "
                      "than the swapped grouped tiles on these experts (2-token batches now take the tiles, 1.08x: "
                      "bench/NOTES.md 74). "
                      "On NVIDIA atom steps aside for Qwen3-MoE block fp8 (\"fp8 MoE at full depth\").",
    "moe-fp8-throughput": "Missed, a win: 1.06x [1.05, 1.17] at C=128 over 3 launches (Qwen3-30B-A3B dims, 48 layers, "
                          "H200, 2026-12-02b, both routers bf16; per launch 1.14, 1.06, 1.08, the first against a low "
                          "stock launch). atom's fp8 expert tiles now swap A and B up to 16 pairs per expert "
                          "(bench/NOTES.md 73): 0.91-0.97x the old tiles' time at the kernel, the grouped GEMMs at "
                          "~3.7-3.8 TB/s of the H200's 4.2 TB/s measured read bandwidth; end to end atom went from "
                          "~9,260 to ~9,680 tok/s against stock's ~9,120. Before, 1.01x [1.00, 1.03] with both sides' "
                          "experts at ~3.5 TB/s (profile: bench/results/h200_2026-12-02/prof_*, kernel time 1,667 vs "
                          "1,684 ms). With the experts within ~10 % of the read bandwidth the rest of the step has to "
                          "give the other ~9 %. Earlier cells are not counted (stock's router was fp8: "
                          "bench/NOTES.md 68; atom's older tiles).",
    "mla-fp8-batch1": "Missed, a tie: 0.996x [0.986, 1.118] over 3 launches (DeepSeek-V3 dims with its 256 experts, "
                      "4 layers of 61, block fp8, dummy weights with the routers drawn by bench/ab.py, H200, "
                      "2026-12-03; per launch 1.12, 0.99, 0.99). Not profiled; both sides take ~1.6 ms a token where "
                      "the ~1.7 GB of weights one token reads stream in ~0.4 ms, at 71-84 % GPU busy and ~45 % of "
                      "the board's power: latency-bound on both, as the Qwen3-MoE fp8 batch-1 cell. atom's expert "
                      "GEMV does not take these experts (the grouped tiles are 1.27x faster at T=1 on them: "
                      "bench/NOTES.md 76). The earlier 1.14x [0.94, 1.23] (H100, 2 launches, atom's own MLA kernel, "
                      "stock without FlashInfer) and the 1.105x of 2026-12-02d (routing collapsed) are superseded. "
                      "At one TP-8 rank's shapes (2026-12-03c) 1.02x [0.96, 1.15] over 3 launches (per launch 0.97, "
                      "1.01, 1.15), a tie, host-bound on both sides (GPU busy 29-38 %, ~0.26 of the power). "
                      "Since these cells atom's MoE block holds the shared expert in the fused MoE's slot, 4 kernels "
                      "fewer per MoE layer (2026-12-04b, bench/NOTES.md 87). Measured at the block alone (H100, "
                      "2026-12-05b, bench/NOTES.md 88): 0.92-0.95x the separate MLP's time at 1-8 tokens on the "
                      "TP-8 shard, 0.98x at one token with whole experts; not yet measured end to end.",
    "mla-fp8-throughput": "Missed at one TP-8 rank's shapes, a tie: 1.14x [0.87, 1.26] over 3 launches (DeepSeek-V3 "
                          "with 16 heads, expert intermediate 256, dense 2304, 256 experts, 4 layers of 61, block "
                          "fp8, dummy weights, routers drawn, H200, 2026-12-03c; per launch 1.26, 1.00, 1.00; stock on "
                          "its tuned E=256,N=256 H200 fused-MoE file). Host-bound on both sides (GPU busy 37-47 %, "
                          "~0.38-0.40 of the board's power; a step ~4 ms for 64 tokens): at 4 layers of one rank's "
                          "small shards the GPU idles between steps, so the cell does not compare the kernels. Not "
                          "profiled. At whole-expert shapes (one GPU holding DeepSeek-V3's 256 experts, 4 layers, "
                          "2026-12-03) atom won 1.249x [1.202, 2.114]: 512 (token, expert) pairs a step reach ~220 "
                          "experts, ~29 GB per step; atom's steps ~8.4 ms (~3.5 TB/s of the H200's ~4.2 measured), "
                          "stock's ~10.5 ms (~2.8 TB/s) on vLLM's default tile config, for which vLLM ships no tuned "
                          "H200 file at N=2048; deployments run the N=256 / 512 shards of TP-8 / TP-4, where it "
                          "ships one (bench/NOTES.md 79). The H100 cell (3.02x, 2 launches, stock stalling) stays "
                          "shown. The shared expert in the fused MoE's slot (2026-12-04b, bench/NOTES.md 87), at the "
                          "block alone on the H100: 0.96-0.98x the separate MLP's time at 32-128 tokens on the TP-8 "
                          "shard, 1.03x at 512, so since 2026-12-07 it runs in the fused kernel up to 128 tokens "
                          "(ATOM_FUSE_SHARED_EXPERTS_MAX_TOKENS) and dense above (bench/NOTES.md 88); not yet "
                          "measured end to end.",
    "mla-fp8-memory": "Met; MLA's kv_b_proj stays dequantised for the absorbed decode: +16.8 MB per layer at "
                      "DeepSeek-V3 dims (1.02 GB over 61 layers).",
}


def _ran(side: dict) -> str:
    """``model class / attention impls`` of a side, short names."""
    return f"{(side['model_class'] or '?').rsplit('.', 1)[-1]} / {', '.join(side['attention_impls'] or [])}"


def targets(latest: dict[str, Any]) -> list[dict[str, Any]]:
    """Each of TARGETS with the atom-side cells that bear on it and a status: ``met`` (every deciding
    cell meets it, at least one), ``missed`` (a deciding cell does not), ``not decided`` (no cell of
    MIN_LAUNCHES launches; for memory: no record of it)."""
    rows = []
    for tid, issue, family, fp8, kind, bound, wording in TARGETS:
        evidence = []
        for c in latest["cells"]:
            atom, ref = c["sides"].get("atom"), c["sides"][c["reference"]]
            if (FAMILIES.get(c["model"].split("-", 1)[0]) != family or ("-fp8" in c["model"]) != fp8
                    or atom is None or c["reference"] != "stock"):
                continue
            if kind == "memory":  # one line per model: the engines of its cells loaded the same weights
                if "weight_gib" in atom and "weight_gib" in ref and c["model"] not in {e["model"] for e in evidence}:
                    ratio = atom["weight_gib"] / ref["weight_gib"]
                    evidence.append({"model": c["model"], "atom_gib": atom["weight_gib"], "stock_gib": ref["weight_gib"],
                                     "deciding": True, "meets": ratio <= bound})
                continue
            if (kind == "batch1" and c["conc"] != 1) or (kind == "throughput" and not 32 <= c["conc"] <= 256):
                continue
            evidence.append({"model": c["model"], "cell": c["cell"], "date": max(c["dates"])[:10], "ran": _ran(atom),
                             **{k: atom[k] for k in ("ratio", "ratio_ci_low", "ratio_ci_high", "launches")},
                             "deciding": atom["launches"] >= MIN_LAUNCHES and "not_counted" not in c,
                             "not_counted": "not_counted" in c, "meets": atom["ratio_ci_low"] >= bound,
                             "host_bound": _host_bound(atom) or _host_bound(ref),
                             "latency_bound": _latency_bound(atom) or _latency_bound(ref)})
        deciding = [e for e in evidence if e["deciding"]]
        status = ("not decided" if not deciding else "met" if all(e["meets"] for e in deciding) else "missed")
        rows.append({"id": tid, "issue": issue, "target": wording, "family": family, "fp8": fp8, "kind": kind,
                     "bound": round(bound, 4), "status": status, "evidence": evidence, "why": WHY.get(tid, "")})
    return rows


def _evidence(e: dict) -> str:
    if "atom_gib" in e:
        return f"{e['model']}: {e['atom_gib']:.2f} / {e['stock_gib']:.2f} GiB = {e['atom_gib'] / e['stock_gib']:.3f}x"
    text = (f"{e['model']} {e['cell']}: {e['ratio']:.2f}x [{e['ratio_ci_low']:.2f}, {e['ratio_ci_high']:.2f}], "
            f"{e['launches']} launch{'es' if e['launches'] > 1 else ''}, {e['ran']}, {e['date']}"
            f"{', host-bound' if e.get('host_bound') else ', latency-bound' if e.get('latency_bound') else ''}"
            f"{', not counted' if e.get('not_counted') else ''}")
    return f"**{text}**" if e["deciding"] else text


def render_targets(rows: list[dict[str, Any]]) -> str:
    """The targets table for docs/performance.md (between TARGETS_BEGIN and TARGETS_END)."""
    names = {"dense": "Qwen3 dense", "moe": "Qwen3 MoE", "mla": "DeepSeek-V3 dims"}
    need = {"batch1": "low end >= {:.2f}x tok/s", "throughput": "low end >= {:.2f}x", "memory": "<= {:.2f}x"}
    lines = ["| issue | model | target | needs | status | cells (atom vs stock; deciding ones in bold) | why not met; notes |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        cells = "; ".join(_evidence(e) for e in r["evidence"]) or "none"
        lines.append(f"| {r['issue']} | {names[r['family']]}{' fp8' if r['fp8'] else ''} | {r['target']} "
                     f"| {need[r['kind']].format(r['bound'])} | {r['status']} | {cells} | {r['why'] or '-'} |")
    return "\n".join(lines)


def render(latest: dict[str, Any]) -> str:
    """The markdown table for docs/performance.md (between BEGIN and END)."""
    lines = ["| model | cell IN/OUT@C | side | tok/s (median) | vs reference [95% CI] | verdict | launches x windows "
             "| throttled windows | GPU power (of limit) | model class / attention | GPU, vLLM | dates |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in latest["cells"]:
        for n, s in c["sides"].items():
            vs = (f"{s['ratio']:.2f}x [{s['ratio_ci_low']:.2f}, {s['ratio_ci_high']:.2f}]" if "ratio" in s
                  else "(reference)")
            lines.append(
                f"| {c['model']} | {c['cell']} | {n} | {s['median_tok_s']:,.0f} | {vs} | {s.get('verdict', '-')} "
                f"| {s['launches']} x {s['windows']} | {s['throttled_windows']} | {_power_cell(s)} | {_ran(s)} "
                f"| {c['gpu']}, {c['versions'].get('vllm', '?')}{_flashinfer(c['versions'])} | {', '.join(d[:10] for d in sorted(set(c['dates'])))} |")
    reasons = list(dict.fromkeys(c["not_counted"] for c in latest["cells"] if "not_counted" in c))
    if reasons:
        lines.append("")
        for r in reasons:
            which = ", ".join(f"{c['model']} {c['cell']}" for c in latest["cells"] if c.get("not_counted") == r)
            lines.append(f"Not counted ({which}): {r}.")
    return "\n".join(lines)


def spliced(doc: str, table: str, begin: str = BEGIN, end: str = END) -> str:
    if begin not in doc or end not in doc:
        raise ValueError(f"{DOC} lacks the markers {begin!r} / {end!r}")
    head, rest = doc.split(begin, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{begin}\n{table}\n{end}{tail}"


def generated_doc(doc: str, latest: dict[str, Any]) -> str:
    """docs/performance.md with both generated tables (the cells, the targets) rebuilt."""
    return spliced(spliced(doc, render(latest)), render_targets(latest["targets"]), TARGETS_BEGIN, TARGETS_END)


def dumps(latest: dict[str, Any]) -> str:
    return json.dumps(latest, indent=1, sort_keys=True) + "\n"


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--write", action="store_true")
    args = p.parse_args(argv)
    latest = build()
    doc = generated_doc(DOC.read_text(), latest)
    if args.write:
        LATEST.write_text(dumps(latest))
        DOC.write_text(doc)
        print(f"wrote {LATEST.relative_to(REPO)} ({len(latest['cells'])} cells) and the tables in {DOC.relative_to(REPO)}")
        return 0
    stale = [str(f.relative_to(REPO)) for f, want in ((LATEST, dumps(latest)), (DOC, doc))
             if not f.exists() or f.read_text() != want]
    if stale:
        print(f"stale: {', '.join(stale)}: run python bench/latest.py --write")
        return 1
    print("latest.json and the docs table are up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
