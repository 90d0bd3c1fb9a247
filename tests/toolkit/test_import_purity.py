"""The layering the architecture promises, checked on the code as it is:

* declaring and arming records imports neither vLLM, SGLang nor torch, and the entry-point
  functions import without their host;
* atom's ops, models and host-neutral layers (``atom.ops``, ``atom.models`` with its attention
  layers, ``atom.config``, ``atom.envs``, and ``atom.plugin``'s host-neutral modules) import no
  vLLM: only ``atom.plugin.<host>`` knows a host;
* no import cycle among atom's modules (module-level imports);
* no module in ``atom/`` is much over 600 lines.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.conftest import REPO, run_python

ATOM = REPO / "atom"
MAX_LINES = 600


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {_module_name(p): p for p in sorted(ATOM.rglob("*.py"))}


def test_patches_package_imports_no_vllm_or_torch():
    proc = run_python("""
        import sys
        import atom, atom.envs, atom.patches
        from atom.plugin import catalog
        catalog.load(include_test_fixtures=True)
        bad = [m for m in ("vllm", "torch") if m in sys.modules]
        print("LOADED", bad)
    """)
    assert proc.returncode == 0, proc.stderr
    assert "LOADED []" in proc.stdout


def test_arming_vllm_records_does_not_import_vllm():
    proc = run_python("""
        import sys
        from atom.plugin.vllm import records
        states = records.arm_all()
        print("STATES", states)
        print("VLLM", "vllm" in sys.modules)
    """)
    assert proc.returncode == 0, proc.stderr
    assert "VLLM False" in proc.stdout and "armed" in proc.stdout


def test_arming_sglang_records_imports_neither_sglang_nor_torch():
    proc = run_python("""
        import sys
        from atom.plugin.sglang import records
        states = records.arm_all()
        print("STATES", states)
        print("LOADED", [m for m in ("sglang", "torch", "vllm") if m in sys.modules])
    """)
    assert proc.returncode == 0, proc.stderr
    assert "LOADED []" in proc.stdout
    assert "sglang.attention.mha_backend': 'armed" in proc.stdout, proc.stdout


def test_sglang_entry_point_imports_without_sglang():
    proc = run_python("""
        import sys
        from atom.plugin.sglang.register import register
        assert callable(register)
        print("LOADED", [m for m in ("sglang", "torch", "vllm") if m in sys.modules])
    """)
    assert proc.returncode == 0, proc.stderr
    assert "LOADED []" in proc.stdout


def test_entry_point_functions_import_without_vllm():
    proc = run_python("""
        import sys
        from atom.plugin.vllm.register import register_model, register_platform
        assert callable(register_model) and callable(register_platform)
        print("VLLM", "vllm" in sys.modules, "TORCH", "torch" in sys.modules)
    """)
    assert proc.returncode == 0, proc.stderr
    assert "VLLM False TORCH False" in proc.stdout


#: What must never import a host framework.
HOST_NEUTRAL = sorted(m for m in MODULES if m.startswith(("atom.ops", "atom.models"))
                      or m in ("atom.config", "atom.envs", "atom.plugin", "atom.plugin.models",
                               "atom.plugin.catalog", "atom.testing.tiny_models"))


def test_host_neutral_modules_import_no_host():
    assert {"atom.models.attention.mha", "atom.models.attention.mla", "atom.models._moe",
            "atom.ops.mla_prefill"} <= set(HOST_NEUTRAL)
    proc = run_python(f"""
        import importlib, sys
        for name in {HOST_NEUTRAL!r}:
            importlib.import_module(name)
        print("HOSTS", sorted(m for m in ("vllm", "sglang") if m in sys.modules))
    """)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "HOSTS []" in proc.stdout, proc.stdout


def _module_level_imports(name: str, path: Path) -> set[str]:
    """atom modules ``name`` imports at module level (imports inside functions run later and
    cannot form an import-time cycle; ``if TYPE_CHECKING:`` blocks never run)."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in tree.body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        stmts = [node] + (list(ast.walk(node)) if isinstance(node, (ast.If, ast.Try)) else [])
        for stmt in stmts:
            if isinstance(stmt, ast.Import):
                found |= {a.name for a in stmt.names}
            elif isinstance(stmt, ast.ImportFrom):
                base = stmt.module or ""
                if stmt.level:
                    base = ".".join(package.split(".")[: len(package.split(".")) - stmt.level + 1] + [base]).strip(".")
                for alias in stmt.names:  # ``from pkg import submodule`` imports the submodule
                    found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base)
    return {m for m in found if m in MODULES and m != name}


def test_no_import_cycle_inside_atom():
    graph = {name: _module_level_imports(name, path) for name, path in MODULES.items()}
    # A module importing its own package's __init__ (atom.ops.x -> atom.ops) is how packages
    # work, not a cycle: parent packages are initialised first anyway.
    for name, deps in graph.items():
        deps -= {d for d in deps if name.startswith(d + ".")}
    cycles, state = [], {}

    def visit(node, stack):
        state[node] = "open"
        for dep in sorted(graph[node]):
            if state.get(dep) == "open":
                cycles.append(stack[stack.index(dep):] + [dep])
            elif dep not in state:
                visit(dep, stack + [dep])
        state[node] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert cycles == [], cycles


@pytest.mark.parametrize("name", sorted(MODULES))
def test_module_size(name):
    lines = MODULES[name].read_text().count("\n")
    assert lines <= MAX_LINES, f"{name} has {lines} lines (> {MAX_LINES}): split it by purpose"
