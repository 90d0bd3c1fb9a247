"""atom's Triton kernels inside a real vLLM-CPU engine (``ATOM_OPS_BACKEND=triton`` under
Triton's interpreter), on a dense, an MoE and an MLA checkpoint, against stock vLLM in fp32
(issue #19): on CPU the dispatcher otherwise picks the torch references, so without this run an
engine-level bug in a kernel's calling convention (strides of vLLM's tensors, padding rows, the
KV-cache views) would stay invisible until the GPU. Forced, every op call runs its Triton kernel
or raises: the run completing means the kernels served every step."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO
from tests.models import _engine_runner as runner
from tests.models._harness import assert_same_greedy_run, mixed_prompts

#: Engine arguments per checkpoint kind, on both sides. DeepSeek-V3: vLLM-CPU's rotary custom op
#: mis-rotates its 3-D query, so both sides use vLLM's torch rotary (see test_deepseek_v3.py).
KINDS = {
    "qwen3": {},
    "qwen3_moe": {},
    "deepseek_v3": {"compilation_config": {"custom_ops": ["all", "-rotary_embedding"]}},
}
PROMPTS = mixed_prompts()[2:6]  # 5-28 tokens: interpreted kernels are slow
#: More atom-side runs: (checkpoint kind, atom's extra variables). The shared expert's two paths in
#: one engine: prefill steps (> 4 tokens) run it dense, decode steps (4 sequences) in the fused kernel.
VARIANTS = {"deepseek_v3-shared-dense": ("deepseek_v3", {"ATOM_FUSE_SHARED_EXPERTS_MAX_TOKENS": "4"})}


def _run(checkpoint, tmp_path, name: str, engine: dict, env: dict) -> dict:
    (tmp_path / "prompts.json").write_text(json.dumps(PROMPTS))
    out = tmp_path / f"{name}.json"
    proc = subprocess.run(
        [sys.executable, "-m", "tests.models._engine_runner", str(checkpoint), str(tmp_path / "prompts.json"),
         str(out), "--engine", json.dumps(engine), "float32"],
        cwd=REPO, env={**__import__("os").environ, **runner.ENGINE_ENV, **env}, capture_output=True, text=True,
        timeout=1200,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())[0]


@pytest.mark.parametrize("name", [*sorted(KINDS), *sorted(VARIANTS)])
def test_triton_kernels_in_the_engine_give_stock_tokens(tiny_model, tmp_path, name):
    kind, extra = VARIANTS.get(name, (name, {}))
    checkpoint = tiny_model(kind, "float32")
    ours = _run(checkpoint, tmp_path, "atom", KINDS[kind],
                {"ATOM_OPS_BACKEND": "triton", "TRITON_INTERPRET": "1", **extra})
    stock = _run(checkpoint, tmp_path, "stock", KINDS[kind], {"ATOM_DISABLE_VLLM_PLUGIN": "1"})
    assert_same_greedy_run(ours, stock, 1e-3)
