"""register_model: the one table's overrides land in vLLM's ModelRegistry, and only those."""

from tests.conftest import run_python

CODE = """
    import json
    from vllm import ModelRegistry
    from vllm.plugins import load_general_plugins
    load_general_plugins()   # vLLM's own path to atom.plugin.vllm.register:register_model
    rows = {}
    for arch, m in ModelRegistry.models.items():
        rows[arch] = [type(m).__name__, getattr(m, "module_name", ""), getattr(m, "class_name", "")]
    print("ROWS", json.dumps(rows))
"""


def _rows(proc):
    import json

    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.split("ROWS ", 1)[1].splitlines()[0])


def test_overrides_land_for_each_supported_arch_and_only_those():
    from atom.plugin.models import MODEL_TABLE, WRAPPER_MODULE

    proc = run_python(CODE)
    rows = _rows(proc)
    expected = {e.arch: e for e in MODEL_TABLE if e.arch in rows and e.implemented()}
    for arch, (kind, module, cls) in rows.items():
        if arch in expected:
            assert (kind, module, cls) == ("_LazyRegisteredModel", WRAPPER_MODULE, expected[arch].wrapper)
            assert f"Register model {arch} to vLLM with {WRAPPER_MODULE}:{expected[arch].wrapper}" in proc.stderr
        else:
            assert not module.startswith("atom."), arch
    assert proc.stderr.count("Register model ") == len(expected)


def test_disabled_overrides_nothing():
    rows = _rows(run_python(CODE, env={"ATOM_DISABLE_VLLM_PLUGIN": "1"}))
    assert not any(module.startswith("atom.") for _, module, _ in rows.values())
    assert rows["Qwen3ForCausalLM"][1].startswith("vllm.")


def test_register_model_arms_vllm_patches():
    proc = run_python("""
        from vllm.plugins import load_general_plugins
        load_general_plugins()
        from atom.plugin.vllm.patches import VLLM_RECORDS
        from atom.patches import status
        import vllm.model_executor.layers.attention.attention as A
        print("STATES", [str(status(r)) for r in VLLM_RECORDS])
        print("WRAPPED", hasattr(A.Attention.__dict__["process_weights_after_loading"], "__wrapped__"))
        import atom.plugin.attention_mha  # what vLLM imports by qualname once atom's backend is chosen
        import atom.plugin.attention_mla  # (the MLA backend, for MLA layers)
        import atom.models.qwen3_moe  # what the model wrapper imports: the armed injections land
        print("LANDED", [str(status(r)) for r in VLLM_RECORDS])
    """)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "WRAPPED True" in proc.stdout
    # The attention patch lands at once (vLLM imported); the attention decorators wait for atom's
    # backend module (imported only when vLLM picks it), the FusedMoE / Fp8Linear injections for
    # atom's model modules, which only the model wrapper imports.
    armed = "armed: waiting for import of atom.plugin.attention_mha"
    armed_mla = "armed: waiting for import of atom.plugin.attention_mla"
    assert (f"STATES ['applied', '{armed}', '{armed}', '{armed}', '{armed_mla}', '{armed_mla}', "
            "'armed: waiting for import of atom.models._moe', "
            "'armed: waiting for import of atom.models._linear']") in proc.stdout, proc.stdout
    assert f"LANDED {['applied'] * 8}" in proc.stdout, proc.stdout


def test_disabled_patch_is_not_applied():
    proc = run_python("""
        from vllm.plugins import load_general_plugins
        load_general_plugins()
        from atom.plugin.vllm.patches import VLLM_RECORDS
        from atom.patches import status
        import vllm.model_executor.layers.attention.attention as A
        print("STATES", [str(status(r)) for r in VLLM_RECORDS])
        print("WRAPPED", hasattr(A.Attention.__dict__["process_weights_after_loading"], "__wrapped__"))
    """, env={"ATOM_DISABLED_PATCHES": "vllm.attention.pwal_default_dtype"})
    assert "disabled: by ATOM_DISABLED_PATCHES" in proc.stdout, proc.stderr[-3000:]
    assert "WRAPPED False" in proc.stdout
