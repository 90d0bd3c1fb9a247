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
        import sys
        from atom.patches import REGISTRY, status
        records = REGISTRY.select("vllm")
        print("STATES", [str(status(r)) for r in records])
        print("MLA_MODULE", "vllm.model_executor.layers.attention.mla_attention" in sys.modules)
        import vllm.model_executor.layers.attention.mla_attention as M  # vLLM imports it for MLA models
        print("WRAPPED", hasattr(M.MLAAttention.__dict__["process_weights_after_loading"], "__wrapped__"))
        import atom.models.attention.mha  # atom's layers, imported with the backend vLLM picks
        import atom.models.qwen3_moe  # what the model wrapper imports: the armed injections land
        print("LANDED", [str(status(r)) for r in records])
    """)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "WRAPPED True" in proc.stdout
    # Arming imports nothing: the decorators wait for atom's layers (imported only when vLLM
    # builds an atom model or picks atom's backend), the MLA patches for vLLM's MLA module.
    armed = "armed: waiting for import of atom.models.attention.mha"
    armed_mla = "armed: waiting for import of atom.models.attention.mla"
    mla_module = "vllm.model_executor.layers.attention.mla_attention"
    from atom.patches import REGISTRY, Patch
    from atom.plugin import catalog

    catalog.load()
    mla_patches = sum(isinstance(r, Patch) for r in REGISTRY.select("vllm.attention.mla"))  # mla_patch's
    states = [armed] * 3 + [armed_mla] * 3
    if "MLA_MODULE True" in proc.stdout:  # this vLLM imports its MLA layer at start-up
        states = [armed] * 3 + ["applied"] * (3 + mla_patches)
    else:
        states += [f"armed: waiting for import of {mla_module}"] * mla_patches
    # vLLM's model registry (resolve_model_cls, inspect_model_cls, is_pp_supported_model): imported
    # by register_model itself
    states += ["applied"] * 3
    states += ["armed: waiting for import of atom.models._moe", "armed: waiting for import of atom.models._linear"]
    assert f"STATES {states}" in proc.stdout, proc.stdout
    assert f"LANDED {['applied'] * len(REGISTRY.select('vllm'))}" in proc.stdout, proc.stdout


def test_disabled_patch_is_not_applied():
    proc = run_python("""
        from vllm.plugins import load_general_plugins
        load_general_plugins()
        from atom.patches import REGISTRY, status
        import vllm.model_executor.layers.attention.mla_attention as M
        print("STATES", [str(status(r)) for r in REGISTRY.select("vllm")])
        print("WRAPPED", hasattr(M.MLAAttention.__dict__["process_weights_after_loading"], "__wrapped__"))
    """, env={"ATOM_DISABLED_PATCHES": "vllm.mla.process_weights_after_loading"})
    assert "disabled: by ATOM_DISABLED_PATCHES" in proc.stdout, proc.stderr[-3000:]
    assert "WRAPPED False" in proc.stdout


def test_armed_decorators_land_when_vllm_imports_atoms_backend_first():
    """What a vLLM worker does: records armed by register_model, then vLLM imports atom's backend
    by its qualname (which imports atom's layer, landing the decorators while that module is
    still being imported): every record of both groups applies and vLLM's classes are concrete."""
    proc = run_python("""
        from vllm.plugins import load_general_plugins
        load_general_plugins()
        from vllm.utils.import_utils import resolve_obj_by_qualname
        from atom.patches import REGISTRY, status
        import vllm.model_executor.layers.attention.mla_attention  # a worker building an MLA model
        mla = resolve_obj_by_qualname("atom.plugin.vllm.attention_mla.ATOMMLABackend")
        mha = resolve_obj_by_qualname("atom.plugin.vllm.attention_mha.ATOMAttentionBackend")
        print("STATES", sorted({str(status(r)) for r in REGISTRY.select("vllm.attention")}))
        print("ABSTRACT", [sorted(c.__abstractmethods__) for c in
                           (mla, mla.get_impl_cls(), mla.get_builder_cls(), mha, mha.get_impl_cls(),
                            mha.get_builder_cls())])
    """)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "STATES ['applied']" in proc.stdout, proc.stdout + proc.stderr[-2000:]
    assert "ABSTRACT [[], [], [], [], [], []]" in proc.stdout, proc.stdout
