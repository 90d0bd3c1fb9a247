"""bench/sglang_bench.py's driver on CPU (``--smoke``: tiny fp32 Qwen3, both engines up at once,
cells interleaved), so the GPU step (bench/gpu_run.sh sglang) meets no argument SGLang rejects:
in fp32 the two sides agree on every token."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import REPO
from tests.sglang.conftest import sglang_env


def test_sglang_bench_smoke(tmp_path):
    out = tmp_path / "smoke.json"
    proc = subprocess.run(
        [sys.executable, "bench/sglang_bench.py", "--smoke", "--models", "dense", "--model-dir", str(tmp_path / "models"),
         "--workdir", str(tmp_path / "work"), "--out", str(out)],
        cwd=REPO, env=sglang_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    result = json.loads(out.read_text())["results"][0]
    assert result["agreement"]["agreement"] == 1.0 and result["agreement"]["identical_sequences"] == 4
    assert [c["cell"] for c in result["cells"]] == ["16/8@1", "16/8@4"]
    assert all(c["stock_tok_s"] > 0 and c["atom_tok_s"] > 0 for c in result["cells"])
    assert any("atom attention backend ATOMSGLangAttnBackend selected" in line for line in result["atom_log"])
    assert any("disabled by ATOM_DISABLE_SGLANG_PLUGIN=1" in line for line in result["stock_log"])
    assert "| dense | 16/8@1 |" in proc.stdout
