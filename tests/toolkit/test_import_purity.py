"""Declaring and arming patches must import neither vLLM nor torch; the entry-point functions
must be importable without importing vLLM."""

from tests.conftest import run_python


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


def test_arming_vllm_patches_does_not_import_vllm():
    proc = run_python("""
        import sys
        from atom.plugin.vllm import patches
        states = patches.arm_all()
        print("STATES", states)
        print("VLLM", "vllm" in sys.modules)
    """)
    assert proc.returncode == 0, proc.stderr
    assert "VLLM False" in proc.stdout and "armed" in proc.stdout


def test_entry_point_functions_import_without_vllm():
    proc = run_python("""
        import sys
        from atom.plugin.vllm.register import register_model, register_platform
        assert callable(register_model) and callable(register_platform)
        print("VLLM", "vllm" in sys.modules, "TORCH", "torch" in sys.modules)
    """)
    assert proc.returncode == 0, proc.stderr
    assert "VLLM False TORCH False" in proc.stdout
