"""``python -m atom doctor`` explains every state atom can be in."""

import pytest
from packaging.version import Version

from atom import doctor
from atom.patches import revert
from tests.conftest import records_as_found, run_python


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    # Resolve vLLM's platform for this pytest process before any test here changes ATOM_* vars:
    # importing vLLM modules may resolve it, and it is then fixed for the whole process.
    from vllm.platforms import current_platform

    assert current_platform is not None
    for name in ("ATOM_DISABLE_VLLM_PLUGIN", "ATOM_DISABLE_VLLM_PLUGIN_ATTENTION",
                 "ATOM_DISABLED_PATCHES", "ATOM_ALLOW_UNSUPPORTED_VLLM", "ATOM_OPS_BACKEND"):
        monkeypatch.delenv(name, raising=False)
    from atom.patches import REGISTRY
    from atom.plugin import catalog

    catalog.load()
    # Each test starts with every record reverted (doctor's report then reflects its own checks)
    # and leaves the process as found: engines later in this process rely on vLLM's cached
    # backend choice, which does not re-apply atom's decorators.
    with records_as_found(*(rec.id for rec in REGISTRY.select("vllm"))) as vllm_records:
        for rec in vllm_records:
            revert(rec)
        yield
        monkeypatch.undo()  # the test's fakes (e.g. an old vLLM version) must not judge the restore


def _run(capsys):
    code = doctor.main()
    return code, capsys.readouterr().out


def test_active(capsys):
    code, out = _run(capsys)
    assert code == 0
    assert out.splitlines()[1].startswith("installed: atom-vllm ")  # atom._distribution's answer
    assert "platform with atom:    atom.plugin.vllm.platform_cpu.ATOMCpuPlatform" in out
    assert "platform without atom: vllm.platforms.cpu.CpuPlatform" in out
    assert "vLLM support: yes" in out and "device: cpu" in out
    assert "vllm.mla.process_weights_after_loading: applied" in out
    assert "vllm.attention.mha_impl: applied" in out
    assert "rms_norm" in out and "torch" in out  # per-op backend and why
    assert "  mha: atom.plugin.vllm.attention_mha.ATOMAttentionBackend (atom MHA backend)" in out
    assert "  mla: atom.plugin.vllm.attention_mla.ATOMMLABackend (atom MLA backend)" in out
    assert out.strip().splitlines()[-1].startswith("atom would activate")


def test_disabled_by_env(monkeypatch, capsys):
    monkeypatch.setenv("ATOM_DISABLE_VLLM_PLUGIN", "1")
    code, out = _run(capsys)
    assert code == 1
    assert "platform with atom:    vllm.platforms.cpu.CpuPlatform" in out
    assert "disabled (by ATOM_DISABLE_VLLM_PLUGIN=1)" in out
    assert "ATOM_DISABLE_VLLM_PLUGIN=True" in out
    assert out.strip().splitlines()[-1] == "atom would NOT activate: disabled by ATOM_DISABLE_VLLM_PLUGIN=1"


def test_unsupported_vllm(monkeypatch, capsys):
    import atom.patches.versions as versions

    monkeypatch.setattr(versions, "installed_vllm", lambda: ("vllm", Version("0.25.1")))
    code, out = _run(capsys)
    assert code == 1
    assert "vLLM support: NO" in out
    last = out.strip().splitlines()[-1]
    assert last.startswith("atom would NOT activate: vLLM 0.25.1 is outside the supported range >=0.26,<0.34")
    assert "ATOM_ALLOW_UNSUPPORTED_VLLM=1" in last
    # the patch record's own version guard refuses it too
    assert "vllm.mla.process_weights_after_loading: refused (installed vLLM 0.25.1 is outside" in out


def test_attention_disabled(monkeypatch, capsys):
    monkeypatch.setenv("ATOM_DISABLE_VLLM_PLUGIN_ATTENTION", "1")
    code, out = _run(capsys)
    assert code == 0
    assert "mha: vLLM default (disabled by ATOM_DISABLE_VLLM_PLUGIN_ATTENTION=1)" in out
    assert "ATOM_DISABLE_VLLM_PLUGIN_ATTENTION=True" in out


def test_malformed_variable(monkeypatch, capsys):
    monkeypatch.setenv("ATOM_DISABLE_VLLM_PLUGIN_ATTENTION", "sometimes")
    code, out = _run(capsys)
    assert code == 2
    assert "ATOM_DISABLE_VLLM_PLUGIN_ATTENTION='sometimes' is not a valid value" in out.splitlines()[-1]


def test_forced_ops_backend_shown(monkeypatch, capsys):
    monkeypatch.setenv("ATOM_OPS_BACKEND", "rms_norm=torch")
    code, out = _run(capsys)
    assert code == 0
    line = next(l for l in out.splitlines() if l.strip().startswith("rms_norm"))
    assert "forced by ATOM_OPS_BACKEND" in line


def test_cli_json():
    proc = run_python("import sys; from atom.__main__ import main; sys.exit(main(['doctor', '--json']))")
    assert proc.returncode == 0, proc.stderr[-2000:]
    import json

    report = json.loads(proc.stdout)
    assert report["active"] is True and report["platform"]["atom_active"] is True
    assert {p["id"] for p in report["patches"]} >= {"vllm.mla.process_weights_after_loading"}
