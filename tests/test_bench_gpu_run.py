"""bench/gpu_run.sh, the GPU machine's steps (run there, by hand, one command at a time): it parses,
its header documents every step, and the ``archs`` step (issue #17) runs, for each architecture,
the checkpoint build, bench/agreement.py stock vs atom and then the ``ab`` step's cell with the
settings that make the cell's engines find the agreement engines' compiled graphs, within its
time budget. The step runs here with ``python3``, ``nvidia-smi`` and ``df`` replaced by stubs on
PATH that record each call (the GPU programs themselves have their own tests)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "bench" / "gpu_run.sh"

#: python3 stand-in: records its arguments and the environment the steps set, and answers the
#: MODELS look-up (bench/e2e_models.py, the real one); every other call does nothing.
PYTHON_STUB = f"""#!{sys.executable}
import json, os, sys
args = sys.argv[1:]
keep = ("AB_", "ARCHS", "OUT", "PYTHONPATH")
with open(os.environ["STUB_LOG"], "a") as f:
    f.write(json.dumps({{"argv": args, "env": {{k: v for k, v in os.environ.items() if k.startswith(keep)}}}}) + "\\n")
if args[:1] == ["-c"] and "MODELS[" in args[1]:
    exec(args[1])
"""


def test_script_parses():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


def test_header_documents_every_step():
    text = SCRIPT.read_text()
    header = text.split("\nset -uo pipefail", 1)[0]
    documented = set(re.findall(r"^#   ([a-z][a-z0-9-]*)\s", header, re.M))
    cases = set(re.findall(r"^        ([a-z][a-z0-9-]*)\)", text, re.M))
    assert "archs" in documented and "archs" in cases
    assert documented == cases


def _run_step(tmp_path: Path, step: str = "archs", **env: str) -> tuple[list[dict], str]:
    stubs = tmp_path / "stubs"
    stubs.mkdir(exist_ok=True)
    for name, body in {"python3": PYTHON_STUB, "nvidia-smi": "#!/bin/sh\necho 0\n",
                       "df": "#!/bin/sh\necho Avail\necho 100G\n"}.items():
        (stubs / name).write_text(body)
        (stubs / name).chmod(0o755)
    log = tmp_path / "calls.jsonl"
    log.unlink(missing_ok=True)
    # the caller's own ab settings must not reach the step
    full = {k: v for k, v in os.environ.items() if not k.startswith("AB_")}
    full.update(PATH=f"{stubs}:{os.environ['PATH']}", STUB_LOG=str(log), OUT=str(tmp_path / "out"), **env)
    proc = subprocess.run(["bash", str(SCRIPT), step], cwd=REPO, env=full, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    calls = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    return calls, proc.stdout


def _script_calls(calls: list[dict], script: str) -> list[dict]:
    return [c for c in calls if c["argv"][:1] == [script]]


def _opt(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_archs_step_runs_agreement_then_the_ab_cell_per_architecture(tmp_path):
    calls, out = _run_step(tmp_path, ARCHS="llama,gptoss", ARCHS_BUDGET="400")
    builds = [c["argv"][1] for c in calls if c["argv"][:1] == ["-c"] and "build_model(" in c["argv"][1]]
    assert any("build_model('llama', 4, Path('/tmp/atom-e2e-models/llama-L4-v32000'), 32000" in b for b in builds)
    assert any("build_model('gptoss', 4, Path('/tmp/atom-e2e-models/gptoss-L4-v32000'), 32000" in b for b in builds)
    agree, ab = _script_calls(calls, "bench/agreement.py"), _script_calls(calls, "bench/ab.py")
    assert [_opt(c["argv"], "--model") for c in agree] == [_opt(c["argv"], "--model") for c in ab] == \
        ["/tmp/atom-e2e-models/llama-L4-v32000", "/tmp/atom-e2e-models/gptoss-L4-v32000"]
    for name, a, b in zip(["llama", "gptoss"], agree, ab):
        # agreement: stock the reference, both bf16 with CUDA graphs (the plain config names),
        # the ab sides' atom and compile caches; bounded by the budget
        assert _opt(a["argv"], "--configs") == "stock,atom"
        assert _opt(a["argv"], "--out") == str(tmp_path / "out" / "archs" / f"{name}_agree.json")
        assert _opt(a["argv"], "--cache-root") == "/tmp/vcache-{side}"
        assert a["env"]["PYTHONPATH"] == "/tmp/atom-new:/tmp/site"
        assert _opt(a["argv"], "--timeout") == _opt(a["argv"], "--budget")
        # the cell: the same prompts count / lengths / max_logprobs as the agreement engines had
        # (same compile-cache key), stock and atom only, under $OUT/archs
        argv = b["argv"]
        assert _opt(a["argv"], "--prompts") == _opt(argv, "--conc") == "32"
        assert _opt(a["argv"], "--lengths") == f"{_opt(argv, '--in')}/{_opt(argv, '--out')}" == "128/128"
        assert json.loads(_opt(argv, "--engine")) == {"max_logprobs": 2}
        sides = [argv[i + 1].split(":")[0] for i, v in enumerate(argv) if v == "--side"]
        assert sides == ["stock", "atom"]
        assert "VLLM_CACHE_ROOT=/tmp/vcache-stock" in argv[argv.index("--side") + 1]
        assert (_opt(argv, "--rounds"), _opt(argv, "--window"), _opt(argv, "--launches")) == ("2", "10", "1")
        assert _opt(argv, "--json") == str(tmp_path / "out" / "archs" / f"ab_{name}.json")
        assert b["env"]["AB_MODEL"] == name and b["env"]["AB_LAYERS"] == "4"
    assert "=== ab" in out
    # each engine at most half of the architecture's budget; what the first architecture's stubs
    # left of theirs, the second gets
    first, second = (int(_opt(c["argv"], "--timeout")) for c in agree)
    assert 150 <= first <= (400 - 10) // 2 < second <= (800 - 10) // 2
    # in order: each architecture's agreement before its cell, the next architecture after both
    order = [c["argv"][0] for c in calls if c["argv"][:1] in (["bench/agreement.py"], ["bench/ab.py"])]
    assert order == ["bench/agreement.py", "bench/ab.py"] * 2


def test_archs_step_parts_and_budget(tmp_path):
    calls, _ = _run_step(tmp_path, ARCHS="mixtral", ARCHS_PARTS="ab")
    assert not _script_calls(calls, "bench/agreement.py") and len(_script_calls(calls, "bench/ab.py")) == 1
    calls, _ = _run_step(tmp_path, ARCHS="glm4moe", ARCHS_PARTS="agree")
    assert len(_script_calls(calls, "bench/agreement.py")) == 1 and not _script_calls(calls, "bench/ab.py")
    # too little of the budget left for the cell: not started, and the output says how to run it
    calls, out = _run_step(tmp_path, ARCHS="llama", ARCHS_BUDGET="120")
    assert len(_script_calls(calls, "bench/agreement.py")) == 1 and not _script_calls(calls, "bench/ab.py")
    assert "llama: ab cell not started" in out and "ARCHS=llama ARCHS_PARTS=ab" in out
    calls, out = _run_step(tmp_path, ARCHS="bogus,llama", ARCHS_PARTS="agree")
    assert "bogus: not a bench/e2e_models.py model" in out
    assert [_opt(c["argv"], "--model") for c in _script_calls(calls, "bench/agreement.py")] == \
        ["/tmp/atom-e2e-models/llama-L4-v32000"]



def test_ab_switch_side_is_the_new_wheel_with_its_variables(tmp_path):
    """AB_SWITCH_SIDE=NAME:KEY=VALUE,...: one more side next to stock and atom, atom's new wheel
    with those variables and its own compile cache; AB_SIDES picks among all three by name."""
    calls, _ = _run_step(tmp_path, "ab", AB_SWITCH_SIDE="cublas:ATOM_BF16_GEMV=0,X=1")
    argv = _script_calls(calls, "bench/ab.py")[0]["argv"]
    sides = {v.split(":")[0]: v.split(":", 1)[1] for i, v in enumerate(argv) if argv[i - 1] == "--side"}
    assert list(sides)[:2] == ["stock", "atom"] and "cublas" in sides
    assert sides["cublas"] == "PYTHONPATH=/tmp/atom-new:/tmp/site,VLLM_CACHE_ROOT=/tmp/vcache-cublas,ATOM_BF16_GEMV=0,X=1"
    assert sides["atom"] == "PYTHONPATH=/tmp/atom-new:/tmp/site,VLLM_CACHE_ROOT=/tmp/vcache-atom"
    calls, _ = _run_step(tmp_path, "ab", AB_SWITCH_SIDE="cublas:ATOM_BF16_GEMV=0", AB_SIDES="atom,cublas")
    argv = _script_calls(calls, "bench/ab.py")[0]["argv"]
    assert [argv[i + 1].split(":")[0] for i, v in enumerate(argv) if v == "--side"] == ["atom", "cublas"]


def test_ab_switch_sides_separated_by_semicolons(tmp_path):
    """Several switch sides (``;``), each with its own variables and compile cache, in order."""
    calls, _ = _run_step(tmp_path, "ab", AB_SIDES="stock,lean,fa",
                         AB_SWITCH_SIDE="lean:ATOM_BF16_GEMV=0;fa:ATOM_BF16_GEMV=0,ATOM_MHA_HOST_PREFILL=flash_attn")
    argv = _script_calls(calls, "bench/ab.py")[0]["argv"]
    sides = [argv[i + 1] for i, v in enumerate(argv) if v == "--side"]
    assert [x.split(":")[0] for x in sides] == ["stock", "lean", "fa"]
    assert sides[1] == "lean:PYTHONPATH=/tmp/atom-new:/tmp/site,VLLM_CACHE_ROOT=/tmp/vcache-lean,ATOM_BF16_GEMV=0"
    assert sides[2] == ("fa:PYTHONPATH=/tmp/atom-new:/tmp/site,VLLM_CACHE_ROOT=/tmp/vcache-fa,ATOM_BF16_GEMV=0,"
                        "ATOM_MHA_HOST_PREFILL=flash_attn")


def test_ab_arrivals_reach_ab_py_and_keep_the_model_label(tmp_path):
    """AB_ARRIVALS=continuous: ab.py keeps C requests in flight; the record's label stays the
    model's (latest.py tells the cells apart by their arrivals), the files get -cont."""
    calls, _ = _run_step(tmp_path, "ab", AB_ARRIVALS="continuous", AB_LAYERS="36")
    argv = _script_calls(calls, "bench/ab.py")[0]["argv"]
    assert _opt(argv, "--arrivals") == "continuous" and _opt(argv, "--label") == "dense-L36"
    assert _opt(argv, "--json").endswith("/ab_dense-cont.json")
    calls, _ = _run_step(tmp_path, "ab")
    argv = _script_calls(calls, "bench/ab.py")[0]["argv"]
    assert _opt(argv, "--arrivals") == "batch" and _opt(argv, "--json").endswith("/ab_dense.json")


def test_cache_pack_and_unpack_round_trip(tmp_path):
    """``cachepack`` puts the cache folders that exist into compressed parts under $OUT, and
    ``cacheunpack`` on another machine (here another root) restores them byte for byte; a pack
    over CACHE_MAX_MIB keeps nothing."""
    src, dest, out = tmp_path / "src", tmp_path / "dest", tmp_path / "out"
    files = {"tmp/vcache-stock/torch_compile_cache/a/graph.py": b"g" * 5000,
             "tmp/triton-cache/K/kernel.cubin": os.urandom(3000)}
    for rel, data in files.items():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_bytes(data)
    env = dict(os.environ, OUT=str(out), CACHE_ROOT=str(src),
               CACHE_DIRS="/tmp/vcache-* /tmp/triton-cache /tmp/absent")
    run = subprocess.run(["bash", str(SCRIPT), "cachepack"], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 0, run.stderr
    assert "tmp/vcache-stock tmp/triton-cache -> 1 MiB in 1 part(s)" in run.stdout
    assert [p.name for p in out.iterdir()] == ["cache.tar.xz.part00"]
    dest.mkdir()
    env.update(CACHE_ROOT=str(dest), CACHE_FROM=str(out))
    run = subprocess.run(["bash", str(SCRIPT), "cacheunpack"], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 0 and "cacheunpack:" in run.stdout, run.stderr
    assert {str(p.relative_to(dest)): p.read_bytes() for p in dest.rglob("*") if p.is_file()} == files
    env.update(CACHE_ROOT=str(src), CACHE_MAX_MIB="0")
    run = subprocess.run(["bash", str(SCRIPT), "cachepack"], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=60)
    assert "nothing kept" in run.stdout and not list(out.iterdir())


def _stage_call(tmp_path: Path, carried: list[Path], *steps: str) -> subprocess.CompletedProcess:
    """One device call of the staging steps: ``carried`` is what the call's tree holds under
    STAGE_FROM (the device tool carries one part per call); /tmp/stage and /tmp/site are tmp_path's."""
    fi = tmp_path / "carried"
    if fi.exists():
        for f in fi.iterdir():
            f.unlink()
    fi.mkdir(exist_ok=True)
    for f in carried:
        (fi / f.name).write_bytes(f.read_bytes())
    env = {**os.environ, "STAGE_FROM": str(fi), "STAGE_DIR": str(tmp_path / "stage"),
           "STAGE_SITE": str(tmp_path / "site"), "OUT": str(tmp_path / "out")}
    return subprocess.run(["bash", str(SCRIPT), *steps], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)


def test_staging_parts_travel_one_per_call_and_unpack_only_when_all_check(tmp_path):
    payload = tmp_path / "payload"
    (payload / "vllm").mkdir(parents=True)
    (payload / "vllm" / "__init__.py").write_text("__version__ = '0.26.0'\n" + "#" * 4000 + "\n")
    built = tmp_path / "built"
    built.mkdir()
    archive = subprocess.run(["tar", "-C", str(payload), "-cJf", "-", "vllm"], capture_output=True, check=True).stdout
    half = len(archive) // 2
    parts = [built / "v.tar.xz.part00", built / "v.tar.xz.part01"]
    parts[0].write_bytes(archive[:half])
    parts[1].write_bytes(archive[half:])
    sums = built / "v.SHA256SUMS"
    sums.write_text(subprocess.run(["sha256sum", *[p.name for p in parts]], cwd=built, capture_output=True,
                                   text=True, check=True).stdout)
    site = tmp_path / "site"
    # the first call carries the first part only: nothing to unpack yet, and unstage says so
    first = _stage_call(tmp_path, [parts[0]], "stagepart")
    assert first.returncode == 0 and "1 part(s)" in first.stdout
    early = _stage_call(tmp_path, [sums], "unstage")
    assert early.returncode == 3 and "missing or damaged" in early.stdout and not site.exists()
    # the last call carries the last part and the sums: both parts check, the site is unpacked
    last = _stage_call(tmp_path, [parts[1], sums], "stagepart", "unstage")
    assert last.returncode == 0, last.stdout + last.stderr
    assert (site / "vllm" / "__init__.py").read_text().startswith("__version__ = '0.26.0'")
    # a damaged part stops the command (later steps do not run) and loses nothing already unpacked
    damaged = tmp_path / "stage" / parts[0].name
    damaged.write_bytes(b"x" + damaged.read_bytes()[1:])
    again = _stage_call(tmp_path, [sums], "unstage", "facts")
    assert again.returncode == 3 and "left as it was" in again.stdout and "=== facts" not in again.stdout
    assert (site / "vllm" / "__init__.py").exists()
    # parts that check against their sums but do not unpack (a broken staging) lose nothing either
    bad = tmp_path / "bad"
    bad.mkdir()
    for p in parts:
        (bad / p.name).write_bytes(b"not xz" + p.read_bytes()[6:])
    (bad / sums.name).write_text(subprocess.run(["sha256sum", *[p.name for p in parts]], cwd=bad, capture_output=True,
                                                text=True, check=True).stdout)
    broken = _stage_call(tmp_path, sorted(bad.iterdir()), "stagepart", "unstage")
    assert broken.returncode == 3 and "unpacking failed" in broken.stdout, broken.stdout + broken.stderr
    assert (site / "vllm" / "__init__.py").exists() and not (tmp_path / "site.new").exists()


def test_profile_tag_and_first_shift_reach_the_scripts(tmp_path):
    """PROFILE_TAG keeps two profiles of one command apart; AB_FIRST_SHIFT continues the start-order
    rotation of an earlier command's launches (bench/ab.py --first-shift)."""
    for tag, folder in (("", "profile"), ("model", "profile_model")):
        calls, _ = _run_step(tmp_path, "profile", PROFILE_TAG=tag)
        (prof,) = _script_calls(calls, "bench/profile_e2e.py")
        assert _opt(prof["argv"], "--json") == str(tmp_path / "out" / folder / "profile.json")
    calls, _ = _run_step(tmp_path, "ab", AB_FIRST_SHIFT="2", AB_ROUNDS="1")
    (ab,) = _script_calls(calls, "bench/ab.py")
    assert _opt(ab["argv"], "--first-shift") == "2"


def test_parallel_fill_asks_ab_py_to_overlap_the_starts(tmp_path):
    """AB_FILL_PARALLEL=1: one bench/ab.py with --overlap-starts (the ordering is ab.py's, tested there)."""
    calls, _ = _run_step(tmp_path, "ab", AB_ROUNDS="0", AB_FILL_PARALLEL="1", AB_SIDES="stock,atom")
    (ab,) = _script_calls(calls, "bench/ab.py")
    assert "--overlap-starts" in ab["argv"] and ab["argv"].count("--side") == 2
    calls, _ = _run_step(tmp_path, "ab", AB_ROUNDS="0", AB_SIDES="stock,atom")
    assert "--overlap-starts" not in _script_calls(calls, "bench/ab.py")[0]["argv"]


def test_fresh_compile_reaches_ab_py_only_when_asked(tmp_path):
    calls, _ = _run_step(tmp_path, "ab", AB_FRESH_COMPILE="1")
    assert "--fresh-compile" in _script_calls(calls, "bench/ab.py")[0]["argv"]
    for value in ("0", None):
        calls, _ = _run_step(tmp_path, "ab", **({"AB_FRESH_COMPILE": value} if value else {}))
        assert "--fresh-compile" not in _script_calls(calls, "bench/ab.py")[0]["argv"]


def test_tests_step_still_says_why_a_test_failed_when_its_time_runs_out(tmp_path):
    """The ``tests`` step on real pytest: a failing GPU-marked test, then one that outlasts the step's
    limit (GPU_TESTS_TIMEOUT). pytest is interrupted, not killed, so $OUT/gpu_tests.txt still holds the
    failure's reason and what it printed (on 2026-12-02d a killed run left only ``..F``)."""
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "test_late.py").write_text(
        "import time\nimport pytest\n\n\n@pytest.mark.gpu\ndef test_fails():\n"
        "    print('atom 1.12 stock 0.31')\n    assert 1.12 <= 0.5, 'over the bound'\n\n\n"
        "@pytest.mark.gpu\ndef test_outlasts_the_limit():\n    time.sleep(120)\n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").symlink_to(sys.executable)
    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "OUT": str(out), "GPU_TESTS": str(suite),
           "GPU_TESTS_TIMEOUT": "25"}
    proc = subprocess.run(["bash", str(SCRIPT), "tests"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)
    text = (out / "gpu_tests.txt").read_text()
    assert "AssertionError: over the bound" in text and "atom 1.12 stock 0.31" in text, (text, proc.stderr)
    assert "FAILED" in text and "KeyboardInterrupt" in text, text
