"""bench/agreement.py's metrics (the engine runs themselves are GPU benchmarks; ``--smoke`` runs
them on CPU): free-running agreement, decode logprob differences before the first divergence, and
teacher-forced top-1 agreement on the reference's sequences."""

from __future__ import annotations

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
    assert agreement.config_spec("atom-torch-rms_norm")["env"] == {"ATOM_OPS_BACKEND": "rms_norm=torch"}
    assert agreement.config_spec("atom-fa")["env"] == {"ATOM_DISABLE_VLLM_PLUGIN_ATTENTION": "1"}
    assert agreement.config_spec("vllm-model-atom-attn")["vllm_model"] is True
    with pytest.raises(SystemExit, match="unknown config 'atom-bogus'"):
        agreement.config_spec("atom-bogus")
