"""Toolkit behaviour on tiny fixture modules: effects, env toggles, guards, precedence, hot path."""

from __future__ import annotations

import importlib
import logging
import sys

import pytest

from atom.patches import (
    Injection, Patch, PatchError, State, apply, as_decorator, is_applied, revert, status,
)
from tests.fixtures import patch_catalog as cat

T = "tests.fixtures.patch_targets"


@pytest.fixture
def fresh(monkeypatch):
    """Import the fixture modules fresh and revert every fixture record afterwards."""
    for name in [m for m in sys.modules if m.startswith(T)]:
        del sys.modules[name]
    for var in ("ATOM_DISABLED_PATCHES", "ATOM_DISABLE_VLLM_PLUGIN"):
        monkeypatch.delenv(var, raising=False)
    funcs = importlib.import_module(f"{T}.funcs")
    reexport = importlib.import_module(f"{T}.reexport")
    backend = importlib.import_module(f"{T}.backend")
    yield funcs, reexport, backend
    for rec in cat.FIXTURE_RECORDS:
        revert(rec)


def rec(record_id):
    return next(r for r in cat.FIXTURE_RECORDS if r.id == record_id)


def test_wrap_effect_on_every_binding_site_then_gone(fresh):
    funcs, reexport, _ = fresh
    original = funcs.greet
    assert apply(rec("fixture.greet")).state is State.APPLIED
    assert funcs.greet("x") == "hello x! [patched]"
    assert reexport.greet("y") == "hello y! [patched]"  # the re-export is covered
    assert funcs.greet.__wrapped__ is original
    revert(rec("fixture.greet"))
    assert funcs.greet is original and reexport.greet is original
    assert funcs.greet("x") == "hello x!"


def test_methods_classmethod_staticmethod(fresh):
    funcs, _, _ = fresh
    for rid in ("fixture.greeter_say", "fixture.greeter_make", "fixture.greeter_shout"):
        apply(rec(rid))
    g = funcs.Greeter()
    assert g.say("bob") == "HI BOB"
    assert funcs.Greeter.make("yo").prefix == "<yo>"
    assert funcs.Greeter.shout("a") == "A [patched]"
    assert g.shout("b") == "B [patched]"


def test_inherited_method_patched_on_subclass_only(fresh):
    funcs, _, _ = fresh
    assert "say" not in funcs.LoudGreeter.__dict__
    apply(rec("fixture.loud_say"))
    assert funcs.LoudGreeter().say("x") == "hi x [patched]"
    assert funcs.Greeter().say("x") == "hi x"
    revert(rec("fixture.loud_say"))
    assert "say" not in funcs.LoudGreeter.__dict__  # nothing left behind


def test_injection_members_are_plain_attributes(fresh):
    _, _, backend = fresh
    inj = rec("fixture.backend_methods")
    assert "build" not in backend.AtomBackend.__dict__
    apply(inj)
    for member in inj.members:
        # the very function/descriptor object: no proxy on a per-token path
        assert backend.AtomBackend.__dict__[member] is backend.PluginModeMethods.__dict__[member]
    b = backend.AtomBackend()
    assert backend.AtomBackend.get_name() == "CUSTOM"
    assert b.build(3, None) == ("built", 3)
    b.process_weights_after_loading("bf16")
    assert b.processed == "bf16"
    revert(inj)
    assert not any(m in backend.AtomBackend.__dict__ for m in inj.members)
    with pytest.raises(NotImplementedError):
        backend.AtomBackend().build(1, None)


@pytest.mark.parametrize("var,value", [
    ("ATOM_DISABLED_PATCHES", "fixture.greet"),
    ("ATOM_DISABLED_PATCHES", "other.id, fixture.greet"),
    ("ATOM_DISABLED_PATCHES", "*"),
    ("ATOM_DISABLE_VLLM_PLUGIN", "1"),
])
def test_disabled_by_environment(fresh, monkeypatch, var, value):
    funcs, _, _ = fresh
    original = funcs.greet
    monkeypatch.setenv(var, value)
    st = apply(rec("fixture.greet"))
    assert st.state is State.DISABLED and var in st.detail
    assert funcs.greet is original
    # explicit argument > environment
    assert apply(rec("fixture.greet"), enabled=True).state is State.APPLIED
    assert funcs.greet("x").endswith("[patched]")


def test_disabled_ids_not_matching_leave_it_on(fresh, monkeypatch):
    monkeypatch.setenv("ATOM_DISABLED_PATCHES", "fixture.greeter_say")
    assert apply(rec("fixture.greet")).state is State.APPLIED


def test_malformed_disabled_patches_value_is_an_error(fresh, monkeypatch):
    from atom.envs import EnvError

    monkeypatch.setenv("ATOM_DISABLED_PATCHES", "a b")
    with pytest.raises(EnvError, match="ATOM_DISABLED_PATCHES"):
        apply(rec("fixture.greet"))


class _Collect(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def test_signature_guard_refuses_one_and_the_rest_continue(fresh):
    funcs, _, _ = fresh
    bad = Patch(id="fixture.bad_sig", target=f"{T}.funcs:greet", wrapper=cat.exclaim,
                signature="(name)")
    handler = _Collect()
    logging.getLogger("atom").addHandler(handler)
    try:
        st = apply(bad)
        apply(bad)  # warned once only
    finally:
        logging.getLogger("atom").removeHandler(handler)
    assert st.state is State.REFUSED
    assert "fixture.bad_sig" in st.detail or "greet" in st.detail
    assert "(name, punctuation=...)" in st.detail and "(name)" in st.detail
    refusals = [m for m in handler.messages if "fixture.bad_sig" in m]
    assert len(refusals) == 1 and "refused" in refusals[0]
    assert funcs.greet("x") == "hello x!"
    assert apply(rec("fixture.greeter_say")).state is State.APPLIED  # others unaffected
    with pytest.raises(PatchError, match="fixture.bad_sig.*signature"):
        apply(bad, enabled=True)  # explicitly requested: raises


def test_injection_guard_accepts_each_listed_shape(fresh):
    """An injection's guard may list one shape per host release; any listed shape applies, any
    other refuses (naming every accepted shape)."""
    from dataclasses import replace

    _, _, backend = fresh
    base = rec("fixture.backend_methods")
    real = "(self, common_prefix_len, common_attn_metadata, fast_build=...)"
    older = "(self, common_prefix_len, common_attn_metadata)"
    for shapes in ((older, real), (real, older)):
        inj = replace(base, id="fixture.two_shapes", signatures=(("build", shapes),))
        assert apply(inj).state is State.APPLIED
        revert(inj)
    inj = replace(base, id="fixture.two_shapes", signatures=(("build", (older, "(self)")),))
    st = apply(inj)
    assert st.state is State.REFUSED and f"expected {older} or (self)" in st.detail
    assert "build" not in backend.AtomBackend.__dict__


def test_version_guard(fresh):
    old = Patch(id="fixture.old_vllm", target=f"{T}.funcs:greet", wrapper=cat.exclaim, vllm="<0.1")
    st = apply(old)
    assert st.state is State.REFUSED
    assert "outside the supported range <0.1" in st.detail and "vLLM" in st.detail
    with pytest.raises(PatchError, match="fixture.old_vllm"):
        apply(old, enabled=True)


def test_missing_target_is_refused_not_crashing(fresh):
    gone = Patch(id="fixture.gone", target=f"{T}.funcs:Greeter.vanished", wrapper=cat.exclaim)
    st = apply(gone)
    assert st.state is State.REFUSED and "vanished" in st.detail


def test_revert_leaves_someone_elses_attribute(fresh):
    funcs, _, _ = fresh
    apply(rec("fixture.greet"))

    def theirs(name, punctuation="!"):
        return "theirs"

    funcs.greet = theirs
    revert(rec("fixture.greet"))
    assert funcs.greet is theirs


def test_explicit_apply_imports_the_target(fresh):
    del sys.modules[f"{T}.funcs"]
    assert apply(rec("fixture.greeter_say"), enabled=True).state is State.APPLIED
    assert f"{T}.funcs" in sys.modules
    assert is_applied(rec("fixture.greeter_say"))


def test_armed_until_import(fresh):
    del sys.modules[f"{T}.funcs"]
    st = apply(rec("fixture.greeter_shout"))
    assert st.state is State.ARMED and f"{T}.funcs" not in sys.modules
    funcs = importlib.import_module(f"{T}.funcs")
    assert status(rec("fixture.greeter_shout")).state is State.APPLIED
    assert funcs.Greeter.shout("a") == "A [patched]"


def test_as_decorator_injects_at_class_definition():
    inj = Injection(
        id="fixture.decorated",
        target=f"{__name__}:test_as_decorator_injects_at_class_definition.<locals>.Decorated",
        members=("get_name",),
        source=f"{T}.backend:PluginModeMethods",
    )

    @as_decorator(inj)
    class Decorated:
        pass

    assert Decorated.get_name() == "CUSTOM"
    revert(inj)
    assert not hasattr(Decorated, "get_name")


def test_as_decorator_rejects_other_class():
    inj = rec("fixture.backend_methods")
    with pytest.raises(PatchError, match="targets"):
        as_decorator(inj)(type("Other", (), {}))


def test_record_validation():
    with pytest.raises(ValueError, match="exactly one"):
        Patch(id="x", target="m:f")
    with pytest.raises(ValueError, match="module:Name"):
        Patch(id="x", target="no_colon", wrapper=cat.exclaim)
    with pytest.raises(ValueError, match="undeclared"):
        Injection(id="x", target="m:C", members=("a",), source="m:S", signatures=(("b", "()"),))


def test_signature_guard_accepts_any_listed_shape(monkeypatch):
    """A wrapper written for several releases lists one signature shape per release."""
    import sys
    from types import ModuleType

    import pytest

    from atom.patches import Patch, PatchError, State, apply, revert

    mod = ModuleType("atom_sig_fixture")
    exec("class C:\n    def f(self, a, b=1):\n        return a + b\n", mod.__dict__)
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    ok = Patch(id="t.sig.any", target="atom_sig_fixture:C.f", replacement=lambda self, a, b=1: 0,
               signature=("(self, a)", "(self, a, b=...)"))
    assert apply(ok, enabled=True).state is State.APPLIED
    assert mod.C().f(1) == 0
    assert revert(ok) and mod.C().f(1) == 2
    bad = Patch(id="t.sig.none", target="atom_sig_fixture:C.f", replacement=lambda self, a: 0,
                signature=("(self, a)", "(self, x, b=...)"))
    with pytest.raises(PatchError, match=r"expected \(self, a\) or \(self, x, b=\.\.\.\)"):
        apply(bad, enabled=True)  # explicitly requested: a refusal raises


def test_injection_into_a_host_neutral_layer_refreshes_its_framework_subclass(fresh):
    """A decorator injects into atom's host-neutral layer; the framework's class (layer + the
    framework's abstract base) inherits the member: instantiable once applied, abstract again
    once reverted."""
    _, _, backend = fresh
    record = Injection(id="fixture.layer_forward", target=f"{T}.backend:HostNeutralLayer",
                       members=("forward",), source=f"{T}.backend:PluginModeForward",
                       base=f"{T}.backend:AbstractFrameworkImpl", signatures=(("forward", "(self, x)"),))
    with pytest.raises(TypeError, match="abstract"):
        backend.FrameworkImpl()
    assert apply(record, enabled=True).state is State.APPLIED
    assert not backend.FrameworkImpl.__abstractmethods__
    assert backend.FrameworkImpl().forward(3) == ("forward", 6)
    assert "forward" not in vars(backend.FrameworkImpl)  # inherited from the layer, not written there
    assert revert(record)
    assert backend.FrameworkImpl.__abstractmethods__ == frozenset({"forward"})
    with pytest.raises(TypeError, match="abstract"):
        backend.FrameworkImpl()
    assert backend.HostNeutralLayer().run(2) == 4  # the layer itself is untouched


def test_guards_check_the_other_attributes_a_wrapper_relies_on(fresh):
    funcs, _, _ = fresh
    ok = Patch(id="fixture.guarded", target=f"{T}.funcs:Greeter.say", wrapper=cat.upper_result,
               signature="(self, name)", guards=((f"{T}.funcs:greet", "(name, punctuation=...)"),))
    assert apply(ok).state is State.APPLIED
    revert(ok)
    bad = Patch(id="fixture.guarded_bad", target=f"{T}.funcs:Greeter.say", wrapper=cat.upper_result,
                signature="(self, name)", guards=((f"{T}.funcs:greet", ("(name)", "(who)")),))
    st = apply(bad)
    assert st.state is State.REFUSED
    assert f"signature of {T}.funcs:greet is (name, punctuation=...), expected (name) or (who)" in st.detail
    assert funcs.Greeter().say("x") == funcs.Greeter().say("x").lower()  # not applied
    missing = Patch(id="fixture.guarded_missing", target=f"{T}.funcs:Greeter.say", wrapper=cat.upper_result,
                    guards=((f"{T}.funcs:vanished", "()"),))
    assert apply(missing).state is State.REFUSED


def test_registry_selects_a_group_and_its_subgroups():
    from atom.patches import Registry

    reg = Registry()
    a = reg.add(Patch(id="g.a", target="m:f", wrapper=cat.exclaim, group="host.attention.mha"))
    b = reg.add(Patch(id="g.b", target="m:g", wrapper=cat.exclaim, group="host.attention"))
    c = reg.add(Patch(id="g.c", target="m:h", wrapper=cat.exclaim, group="host.layers"))
    reg.add(Patch(id="g.d", target="m:i", wrapper=cat.exclaim, group="hostile"))
    assert reg.select("host.attention.mha") == (a,)
    assert reg.select("host.attention") == (a, b)
    assert reg.select("host") == (a, b, c)  # not "hostile": a group is a dotted prefix
