"""The installed distribution exposes both entry points and vLLM's own loader finds them."""

import importlib.metadata

from tests.conftest import run_python

PLATFORM = ("vllm.platform_plugins", "atom", "atom.plugin.vllm.register:register_platform")
GENERAL = ("vllm.general_plugins", "atom_model_registry", "atom.plugin.vllm.register:register_model")


def test_distribution_declares_entry_points():
    dist = importlib.metadata.distribution("atom-vllm")
    eps = {(ep.group, ep.name, ep.value) for ep in dist.entry_points}
    assert PLATFORM in eps and GENERAL in eps


def test_vllm_loader_finds_both_and_respects_vllm_plugins():
    code = """
        from vllm.plugins import load_plugins_by_group, PLATFORM_PLUGINS_GROUP, DEFAULT_PLUGINS_GROUP
        from atom.plugin.vllm.register import register_model, register_platform
        p = load_plugins_by_group(PLATFORM_PLUGINS_GROUP)
        g = load_plugins_by_group(DEFAULT_PLUGINS_GROUP)
        print("PLATFORM", p.get("atom") is register_platform, "GENERAL", g.get("atom_model_registry") is register_model)
    """
    proc = run_python(code, env={"VLLM_PLUGINS": None})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "PLATFORM True GENERAL True" in proc.stdout
    # VLLM_PLUGINS is an allow-list of entry-point names: "" loads none, a name loads just it.
    proc = run_python(code, env={"VLLM_PLUGINS": ""})
    assert "PLATFORM False GENERAL False" in proc.stdout, proc.stderr[-3000:]
    proc = run_python(code, env={"VLLM_PLUGINS": "atom"})
    assert "PLATFORM True GENERAL False" in proc.stdout, proc.stderr[-3000:]
