"""atom's SGLang entry point and decorator, on the installed SGLang: the entry point registers
what it says (the ``atom`` backend and choice, the model overrides named after their
architectures), switching atom off registers nothing, and every member the decorator injects
has the shape of the SGLang base-class member it stands in for."""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys

import pytest

from tests.conftest import REPO
from tests.sglang.conftest import sglang_env

PROBE = """
import sys
from sglang.srt.plugins import load_plugins
load_plugins()
from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
from sglang.srt.server_args import ATTENTION_BACKEND_CHOICES
from sglang.srt.models.registry import ModelRegistry
print("BACKEND", getattr(ATTENTION_BACKENDS.get("atom"), "__module__", None), "atom" in ATTENTION_BACKEND_CHOICES)
for arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "LlamaForCausalLM", "MixtralForCausalLM"):
    cls = ModelRegistry.models[arch]
    print("MODEL", arch, cls.__module__, cls.__name__)
"""


def _probe(**env):
    proc = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, env=sglang_env(**env), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-5000:]
    return proc.stdout


def test_entry_point_is_installed():
    eps = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="sglang.srt.plugins")}
    assert eps.get("atom") == "atom.plugin.sglang.register:register"


def test_entry_point_registers_backend_and_models():
    out = _probe()
    assert "BACKEND atom.plugin.sglang.register True" in out
    for arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "LlamaForCausalLM"):
        assert f"MODEL {arch} atom.plugin.sglang.model_wrapper {arch}" in out
    assert "MODEL MixtralForCausalLM sglang.srt.models.mixtral MixtralForCausalLM" in out  # not in the table for SGLang


STOCK_PROBE = """
import json
from types import SimpleNamespace
from sglang.srt.plugins import load_plugins
load_plugins()
from sglang.srt.layers.quantization.fp8 import Fp8Config
from sglang.srt.models.registry import ModelRegistry
from atom.plugin.sglang import model_wrapper
out = {}
for arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "LlamaForCausalLM"):
    cls = ModelRegistry.models[arch]
    stock = cls.stock_class
    out[arch] = {"wrapper": cls.__module__, "stock": stock.__module__ + ":" + stock.__name__,
                 "presented": {name: hasattr(stock, name) and getattr(cls, name) == getattr(stock, name)
                               for name in model_wrapper.STOCK_CLASS_ATTRIBUTES},
                 "stock_has": {name: hasattr(stock, name) for name in model_wrapper.STOCK_CLASS_ATTRIBUTES}}
one = SimpleNamespace(tp_size=1, pp_size=1, ep_size=1, dp_size=1, enable_lora=None, lora_paths=None,
                      speculative_algorithm=None)
def but(**kw):
    return SimpleNamespace(**{**vars(one), **kw})
decisions = {"one": model_wrapper.builds(None, one),
             "fp8": model_wrapper.builds(Fp8Config(is_checkpoint_fp8_serialized=True), one),
             "ep_dp": model_wrapper.builds(None, but(tp_size=2, ep_size=2, dp_size=2)),
             "pp": model_wrapper.builds(None, but(pp_size=2)),
             "lora": model_wrapper.builds(None, but(lora_paths=["a=/tmp/a"])),
             "eagle": model_wrapper.builds(None, but(speculative_algorithm="EAGLE3"))}
out["builds"] = {k: list(v[:2]) for k, v in decisions.items()}
print("RESULT", json.dumps(out))
"""


def test_wrappers_stand_in_for_the_classes_they_replace():
    """Where atom steps aside at build (a quantized checkpoint, more than one rank, LoRA adapters,
    speculative decoding), SGLang's own
    class is built: atom's wrapper keeps the class it replaced and presents what SGLang reads of
    the registry's class before building it (module mappings for the quantization config, the
    MoE expert-location hook), so SGLang prepares that build as without atom. (A real TP=2
    engine: tests/sglang/test_engine.py; a quantized one needs SGLang's GPU kernels.)"""
    proc = subprocess.run([sys.executable, "-c", STOCK_PROBE], cwd=REPO, env=sglang_env(), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-5000:]
    out = json.loads(proc.stdout.split("RESULT ", 1)[1])
    for arch, module in (("Qwen3ForCausalLM", "qwen3"), ("Qwen3MoeForCausalLM", "qwen3_moe"), ("LlamaForCausalLM", "llama")):
        assert out[arch]["wrapper"] == "atom.plugin.sglang.model_wrapper"
        assert out[arch]["stock"] == f"sglang.srt.models.{module}:{arch}"
        assert out[arch]["presented"] == out[arch]["stock_has"], out[arch]
    assert out["Qwen3MoeForCausalLM"]["stock_has"]["packed_modules_mapping"]
    assert out["Qwen3MoeForCausalLM"]["stock_has"]["get_model_config_for_expert_location"]
    assert out["builds"] == {
        "one": [True, "an unquantized checkpoint on one rank"],
        "fp8": [False, "a 'fp8' checkpoint: atom's models under SGLang load unquantized checkpoints only"],
        "ep_dp": [False, "tp_size=2, ep_size=2, dp_size=2: atom's models under SGLang run on one rank for now"],
        "pp": [False, "pp_size=2: atom's models under SGLang run on one rank for now"],
        "lora": [False, "LoRA adapters enabled: atom's models under SGLang take none"],
        "eagle": [False, "speculative decoding (EAGLE3): atom's models under SGLang have no draft hooks"],
    }


def test_off_on_cpu_by_default():
    """As under vLLM: on CPU atom's models stay SGLang's unless ATOM_ENABLE_ON_CPU=1 (the backend
    name stays registered; asked for, it falls back to SGLang's, logged)."""
    out = _probe(ATOM_ENABLE_ON_CPU="0")
    assert "BACKEND atom.plugin.sglang.register True" in out
    assert "MODEL Qwen3ForCausalLM sglang.srt.models.qwen3 Qwen3ForCausalLM" in out


def test_switched_off_registers_nothing():
    out = _probe(ATOM_DISABLE_SGLANG_PLUGIN="1")
    assert "BACKEND None False" in out
    assert "atom.plugin" not in out


def test_decorator_members_match_sglang_base():
    from atom.patches import REGISTRY, State, apply, revert, resolve
    from atom.patches.signatures import shape
    from atom.plugin import catalog

    catalog.load()
    record = REGISTRY.get("sglang.attention.mha_backend")
    base, source = resolve(record.base), resolve(record.source)
    for member in record.members:
        assert shape(source.__dict__[member]) == shape(getattr(base, member)), member
        assert (member, shape(getattr(base, member))) in record.signatures
    from atom.plugin.sglang.attention_mha import ATOMSGLangAttnBackend

    assert apply(record).state is State.APPLIED
    try:
        for member in record.members:
            assert getattr(ATOMSGLangAttnBackend, member) is source.__dict__[member]
    finally:
        revert(record)
    # Reverted: atom's builder as declared, SGLang's class back on its base's members.
    for member in record.members:
        assert getattr(ATOMSGLangAttnBackend, member) is getattr(base, member)


@pytest.mark.parametrize("member", ["init_forward_metadata", "forward_extend"])
def test_decorator_refused_on_a_changed_base(member, monkeypatch):
    """A base whose member changed shape refuses the decorator (one warning), and atom's backend
    is then not handed to SGLang."""
    from atom.patches import REGISTRY, State, apply, resolve, revert
    from atom.plugin import catalog
    from atom.plugin.sglang import attention_mha

    catalog.load()
    record = REGISTRY.get("sglang.attention.mha_backend")
    base = resolve(record.base)
    revert(record)
    monkeypatch.setattr(base, member, lambda self, changed: None)
    assert apply(record).state is State.REFUSED
    decision = attention_mha.attention_backend()
    assert decision.value is False and "sglang.attention.mha_backend is refused" in decision.reason
    monkeypatch.undo()
    revert(record)


@pytest.mark.parametrize("off", [False, True])
def test_doctor_reports_sglang(off):
    env = sglang_env(**({"ATOM_DISABLE_SGLANG_PLUGIN": "1"} if off else {}))
    proc = subprocess.run([sys.executable, "-m", "atom", "doctor"], cwd="/", env=env, capture_output=True,
                          text=True, timeout=300)
    version = importlib.metadata.version("sglang")
    if off:
        assert proc.returncode == 1, proc.stdout[-2000:]
        assert f"SGLang: {version}; atom stays off (disabled by ATOM_DISABLE_SGLANG_PLUGIN=1)" in proc.stdout
    else:
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        assert f"SGLang: {version}; atom activates" in proc.stdout
        assert "models: Qwen3ForCausalLM, Qwen3MoeForCausalLM, LlamaForCausalLM" in proc.stdout
        assert "attention: atom (atom MHA backend; with --attention-backend atom)" in proc.stdout
        assert "sglang.attention.mha_backend: applied" in proc.stdout
