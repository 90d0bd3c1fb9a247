"""bench/agreement.py's metrics (the engine runs themselves are GPU benchmarks; ``--smoke`` runs
them on CPU): free-running agreement, decode logprob differences before the first divergence, and
teacher-forced top-1 agreement on the reference's sequences."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests._bench import load_bench


@pytest.fixture(scope="module")
def agreement():
    return load_bench("agreement")


def _run(rows, tf):
    return {"rows": [{"tokens": t, "logprobs": lp} for t, lp in rows], "tf": [{"lp": lp, "top1": t} for lp, t in tf]}


def test_compare_counts_positions_prefix_and_teacher_forced_top1(agreement):
    ref = _run([([1, 2, 3, 4], [-1.0, -1.0, -1.0, -1.0]), ([5, 6], [-2.0, -2.0])],
               [([-1.0, -1.0, -1.0, -1.0], [1, 2, 3, 4]), ([-2.0, -2.0], [5, 6])])
    other = _run([([1, 2, 9, 4], [-1.5, -1.0, -3.0, -1.0]), ([5, 6], [-2.0, -2.25])],
                 [([-1.5, -1.0, -1.25, -1.0], [1, 2, 9, 4]), ([-2.0, -2.25], [5, 6])])
    c = agreement.compare(ref, other)
    assert c["agree"] == 5 / 6  # position 2 of the first row differs
    assert c["prefix"] == 4 / 6  # the first row diverges at 2 (its later 4 does not count)
    assert c["identical"] == 1 and c["n"] == 2
    # decode |dlp| only before the divergence: 0.5, 0.0 (row 1) and 0.0, 0.25 (row 2)
    assert c["dlp_mean"] == pytest.approx(0.75 / 4) and c["dlp_max"] == 0.5
    assert c["tf_top1"] == 5 / 6
    assert c["tf_dlp_max"] == 0.5 and c["tf_dlp_mean"] == pytest.approx(1.0 / 6)


def test_near_ties_is_the_reference_disagreeing_with_itself(agreement):
    ref = _run([([1, 2, 3, 4], [0.0] * 4)], [([0.0] * 4, [1, 2, 7, 4])])
    assert agreement.near_ties(ref) == 0.25


def test_config_names_map_to_env_and_unknown_names_fail(agreement):
    assert agreement.config_spec("stock-fp32")["side"] == "stock"
    assert agreement.config_spec("stock-fp32")["dtype"] == "float32"
    assert agreement.config_spec("atom")["eager"] is False
    # atom's configs run atom's own model and attention on NVIDIA GPUs too (its step-asides off)
    on = {"ATOM_ENABLE_ON_NVIDIA": "*", "ATOM_ENABLE_MHA_ON_NVIDIA": "1"}
    assert agreement.config_spec("atom")["env"] == on
    assert agreement.config_spec("atom-torch-rms_norm")["env"] == {"ATOM_OPS_BACKEND": "rms_norm=torch", **on}
    assert agreement.config_spec("atom-fa")["env"] == {"ATOM_DISABLE_VLLM_PLUGIN_ATTENTION": "1",
                                                       "ATOM_ENABLE_ON_NVIDIA": "*"}
    assert agreement.config_spec("stock")["env"] == {} and agreement.config_spec("hf-fp32")["env"] == {}
    assert agreement.config_spec("vllm-model-atom-attn")["vllm_model"] is True
    # any config in float32 (eager), and HF transformers' model as the second oracle
    fa32 = agreement.config_spec("atom-fa-fp32")
    assert fa32["dtype"] == "float32" and fa32["eager"] is True
    assert fa32["env"] == {"ATOM_DISABLE_VLLM_PLUGIN_ATTENTION": "1", "ATOM_ENABLE_ON_NVIDIA": "*"}
    assert agreement.config_spec("atom-torch-ops-fp32")["env"] == {"ATOM_OPS_BACKEND": "torch", **on}
    assert agreement.config_spec("atom-fp32")["eager"] is True and agreement.config_spec("stock")["eager"] is False
    hf = agreement.config_spec("hf-fp32")
    assert hf["hf"] is True and hf["dtype"] == "float32" and agreement.config_spec("atom")["hf"] is False
    with pytest.raises(SystemExit, match="unknown config 'atom-bogus'"):
        agreement.config_spec("atom-bogus")


def test_model_kinds_are_the_e2e_models(agreement, capsys):
    """--model-kind takes every bench/e2e_models.py model (the issue-#17 architectures included)."""
    with pytest.raises(SystemExit) as exit_info:
        agreement.main(["--help"])
    assert exit_info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "{" + ",".join(sorted(agreement.e2e_models.MODELS)) + "}" in text
    for name in ("llama", "mixtral", "glm4moe", "gptoss"):
        assert name in agreement.e2e_models.MODELS


def test_cache_root_is_per_side_and_off_by_default(agreement, tmp_path, monkeypatch):
    """--cache-root: each engine's VLLM_CACHE_ROOT with {side} its side (bench/gpu_run.sh archs: the
    ab step's per-side caches); without it the engines keep the environment's. The compile-cache key
    of an atom engine then matches the ab step's atom side's."""
    seen, switch = {}, {}

    def fake_run(argv, env, **kwargs):  # the engine subprocess: records its environment
        seen[Path(argv[-1]).stem] = env.get("VLLM_CACHE_ROOT")
        switch[Path(argv[-1]).stem] = env.get("ATOM_DISABLE_VLLM_PLUGIN")
        Path(argv[-1]).write_text(json.dumps({"config": Path(argv[-1]).stem}))
        return subprocess.CompletedProcess(argv, 0)

    monkeypatch.setattr(agreement.subprocess, "run", fake_run)
    monkeypatch.delenv("VLLM_CACHE_ROOT", raising=False)
    for name in ("stock", "atom"):
        agreement.run_config(name, {}, {}, tmp_path, 10, "/tmp/vcache-{side}")
    agreement.run_config("atom-eager", {}, {}, tmp_path, 10)
    assert seen == {"stock": "/tmp/vcache-stock", "atom": "/tmp/vcache-atom", "atom-eager": None}
    # atom on with the switch absent (even when the parent has it set), as ab.py's atom side: no
    # ATOM_* variable the ab side lacks enters atom's compile-cache key
    agreement.run_config("atom", {}, {"ATOM_DISABLE_VLLM_PLUGIN": "1"}, tmp_path, 10)
    assert switch == {"stock": "1", "atom": None, "atom-eager": None}


def test_hf_oracle_rows_and_teacher_forcing_agree_with_each_other(agreement, tmp_path):
    """The ``hf`` config on a tiny fp32 checkpoint (CPU): every row has the requested length, its
    logprobs are the chosen tokens' (<= 0), and teacher forcing its own greedy rows gives back
    the same top-1 tokens and logprobs (prefill and decode of one fp32 model)."""
    from atom.testing.tiny_models import build

    model = build("qwen3", tmp_path / "m", dtype="float32")
    prompts = [[5, 9, 13, 2, 7, 11], [3, 4, 8, 21, 17, 6]]
    spec = {"model": str(model), "prompts": prompts, "out_len": 5}
    out = tmp_path / "hf.json"
    agreement.hf_child(spec, agreement.config_spec("hf-fp32"), str(out))
    res = json.loads(out.read_text())
    assert res["model_class"].endswith("Qwen3ForCausalLM")
    assert [len(r["tokens"]) for r in res["rows"]] == [5, 5]
    assert all(lp <= 0 for r in res["rows"] for lp in r["logprobs"])
    for row, tf in zip(res["rows"], res["tf"]):
        assert tf["top1"] == row["tokens"]
        assert tf["lp"] == pytest.approx(row["logprobs"], abs=1e-4)
    assert agreement.compare(res, res)["tf_top1"] == 1.0
