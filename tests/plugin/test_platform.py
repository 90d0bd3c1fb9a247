"""Platform resolution through vLLM's own code, with atom on, off, and misconfigured."""

import json

from tests.conftest import run_python

RESOLVE = """
    import vllm, vllm.platforms as P
    print("UNRESOLVED_AFTER_IMPORT", P._current_platform is None)
    from vllm.platforms import current_platform
    mro = [f"{c.__module__}.{c.__qualname__}" for c in type(current_platform).__mro__]
    print("MRO", mro)
    print("ENUM", current_platform._enum.name, "DEVICE", current_platform.device_type)
"""


def test_import_vllm_does_not_resolve_platform_and_atom_wins():
    proc = run_python(RESOLVE)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "UNRESOLVED_AFTER_IMPORT True" in proc.stdout
    mro = proc.stdout.split("MRO ")[1].splitlines()[0]
    assert "atom.plugin.vllm.platform_cpu.ATOMCpuPlatform" in mro
    assert "atom.plugin.vllm.platform.ATOMPlatform" in mro
    assert "vllm.platforms.cpu.CpuPlatform" in mro
    assert "ENUM CPU DEVICE cpu" in proc.stdout  # the parent's identity is kept
    assert "atom platform ATOMCpuPlatform activated" in proc.stderr


def test_disabled_resolves_vllms_own_platform():
    proc = run_python(RESOLVE, env={"ATOM_DISABLE_VLLM_PLUGIN": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    mro = proc.stdout.split("MRO ")[1].splitlines()[0]
    assert mro.startswith("['vllm.platforms.cpu.CpuPlatform'") and "atom" not in mro


def test_bad_value_fails_with_a_clear_message():
    proc = run_python("""
        from vllm.plugins import load_general_plugins
        from vllm.platforms import current_platform
        print("PLATFORM", type(current_platform).__name__)
        load_general_plugins()
    """, env={"ATOM_DISABLE_VLLM_PLUGIN": "maybe"})
    assert proc.returncode != 0
    assert "PLATFORM CpuPlatform" in proc.stdout  # vLLM swallowed the platform hook's error...
    # ...which atom logged, and the general plugin raises it (vLLM does not swallow that).
    assert "ATOM_DISABLE_VLLM_PLUGIN='maybe' is not a valid value" in proc.stderr
    assert "accepted values" in proc.stderr and "EnvError" in proc.stderr


def test_hooks_are_idempotent_and_cheap_to_call_again():
    proc = run_python("""
        from atom.plugin.vllm.register import register_model, register_platform
        a, b = register_platform(), register_platform()
        from vllm import ModelRegistry
        register_model()
        before = dict(ModelRegistry.models)
        register_model(); register_platform()
        after = dict(ModelRegistry.models)
        print("SAME", a == b, a, all(before[k] is after[k] for k in before) and before.keys() == after.keys())
    """)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "SAME True atom.plugin.vllm.platform_cpu.ATOMCpuPlatform True" in proc.stdout
    assert proc.stderr.count("atom platform ATOMCpuPlatform activated") == 1  # one log line


def test_unsupported_vllm_version_warns_once_and_stays_off(monkeypatch):
    code = """
        from packaging.version import Version
        import atom.patches.versions as v
        v.installed_vllm.cache_clear()
        v.installed_vllm = lambda: ("vllm", Version("0.20.0"))
        from atom.plugin.vllm.register import register_platform, register_model
        print("RESULT", register_platform(), register_platform())
        register_model()
        from vllm import ModelRegistry
        print("OVERRIDDEN", any(m.__class__.__name__ == "_LazyRegisteredModel" and m.module_name.startswith("atom.")
                                for m in ModelRegistry.models.values()))
    """
    proc = run_python(code)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "RESULT None None" in proc.stdout and "OVERRIDDEN False" in proc.stdout
    assert proc.stderr.count("vLLM 0.20.0 is outside the supported range >=0.26,<0.34") == 2  # platform + models
    assert "ATOM_ALLOW_UNSUPPORTED_VLLM=1" in proc.stderr
    proc = run_python(code, env={"ATOM_ALLOW_UNSUPPORTED_VLLM": "1"})
    assert "RESULT atom.plugin.vllm.platform_cpu.ATOMCpuPlatform" in proc.stdout, proc.stderr[-2000:]


def test_attention_backend_choice_through_the_platform():
    proc = run_python("""
        import torch
        from vllm.platforms import current_platform
        from vllm.v1.attention.selector import AttentionSelectorConfig
        base = dict(head_size=64, dtype=torch.float32, kv_cache_dtype="auto", block_size=128)
        for name, cfg in (("decoder", AttentionSelectorConfig(**base)),
                          ("encoder", AttentionSelectorConfig(**base, attn_type="encoder_only"))):
            print("CHOICE", name, current_platform.get_attn_backend_cls(None, cfg))
        current_platform.get_attn_backend_cls(None, AttentionSelectorConfig(**base))  # logged once
        from vllm.v1.attention.backends.registry import AttentionBackendEnum as E
        print("CHOICE requested", current_platform.get_attn_backend_cls(E.CPU_ATTN, AttentionSelectorConfig(**base)))
    """)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "CHOICE decoder atom.plugin.vllm.attention_mha.ATOMAttentionBackend" in proc.stdout
    assert "CHOICE encoder vllm.v1.attention.backends.cpu_attn.CPUAttentionBackend" in proc.stdout
    assert proc.stderr.count("atom attention backend ATOMAttentionBackend selected") == 1
    # an explicit --attention-backend wins
    assert "CHOICE requested vllm.v1.attention.backends.cpu_attn.CPUAttentionBackend" in proc.stdout
    assert "atom attention not used (attention backend CPU_ATTN requested)" in proc.stderr
    assert ("atom attention not used (atom's MHA backend does not support this layer: "
            "attention type encoder_only not supported); vLLM's CPUAttentionBackend instead") in proc.stderr


def test_allow_unsupported_vllm_end_to_end(tiny_model):
    """ATOM_ALLOW_UNSUPPORTED_VLLM=1 on a vLLM outside the range (its version number faked to
    0.34.0 before vLLM loads the plugins: the toolkit's own mechanics): atom's platform and
    models activate with a warning, every record refuses itself (its own range), atom's
    attention is not used, and vLLM keeps serving the stock tokens (fp32)."""
    code = """
        import json, os
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        from packaging.version import Version
        import atom.patches.versions as v
        v.installed_vllm.cache_clear()
        v.installed_vllm = lambda: ("vllm", Version("0.34.0"))
        from vllm import LLM, SamplingParams
        llm = LLM(model={model!r}, dtype="float32", max_model_len=128, enforce_eager=True, seed=0,
                  gpu_memory_utilization=0.3)
        out = llm.generate(["hello world", "one two three"], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
        facts = llm.apply_model(lambda m: [type(m).__qualname__,
            sorted({{type(x.impl).__name__ for _, x in m.named_modules() if hasattr(x, "impl")}})])[0]
        from atom.patches import REGISTRY, status
        states = sorted({{status(r).state.value for r in REGISTRY.select("vllm") if r.module in __import__("sys").modules}})
        print("RESULT", json.dumps([facts, states, [list(o.outputs[0].token_ids) for o in out]]))
    """.format(model=str(tiny_model("qwen3", "float32")))
    ours = run_python(code, env={"ATOM_ALLOW_UNSUPPORTED_VLLM": "1"})
    assert ours.returncode == 0, ours.stderr[-3000:]
    (cls, impls), states, tokens = json.loads(next(ln for ln in ours.stdout.splitlines() if ln.startswith("RESULT"))[7:])
    assert cls == "ATOMForCausalLM" and impls == ["CPUAttentionBackendImpl"]
    assert states == ["refused"]
    assert "activating anyway because ATOM_ALLOW_UNSUPPORTED_VLLM=1" in ours.stderr
    assert "outside the supported range >=0.26,<0.34; the rest of atom continues without it" in ours.stderr
    assert "atom attention not used (decorator vllm.attention.mha_backend is refused" in ours.stderr
    stock = run_python(code, env={"ATOM_DISABLE_VLLM_PLUGIN": "1"})
    assert stock.returncode == 0, stock.stderr[-3000:]
    assert json.loads(next(ln for ln in stock.stdout.splitlines() if ln.startswith("RESULT"))[7:])[2] == tokens
