"""One name and one version; atom._distribution in the (editable) test environment.

The installed cases (the wheel, PyPI's other ``atom`` beside it, uninstalling) are in
tests/test_install.py.
"""

import importlib.metadata
import tomllib

import atom
from atom import _distribution
from tests.conftest import REPO, run_python


def test_one_name_and_one_version():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert "version" not in project and "version" in project["dynamic"]  # atom/__init__.py holds it
    assert project["name"] == _distribution.DISTRIBUTION == atom.__distribution__
    assert atom.__version__ == importlib.metadata.version(_distribution.DISTRIBUTION)


def test_the_test_environment_runs_its_own_atom():
    found = _distribution.check()
    assert found == (True, f"atom-vllm {atom.__version__} (editable) from {REPO / 'atom'}", atom.__version__,
                     str(REPO / "atom"))


def test_check_imports_neither_vllm_nor_torch():
    proc = run_python("""
        import sys
        from atom import _distribution
        print("OK", _distribution.check().ok, [m for m in ("vllm", "torch") if m in sys.modules])
    """)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "OK True []" in proc.stdout
