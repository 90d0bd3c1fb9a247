"""SGLang's entry point into atom (see pyproject.toml):

* ``sglang.srt.plugins: atom = atom.plugin.sglang.register:register``

SGLang calls ``register`` in its launcher before the arguments are parsed, in ``Engine.__init__``
and in every scheduler process (``sglang.srt.plugins.load_plugins``, once per process). It
registers atom's ``atom`` attention backend (a new name: SGLang's own backends stay as they
are), overrides the architectures of atom's one table (``atom.plugin.models.MODEL_TABLE``) in
SGLang's ``ModelRegistry`` when that module is imported (it imports every SGLang model, so not
before SGLang needs it), and arms the records of ``atom.plugin.sglang.records``. Importing this
module imports neither SGLang nor torch.
"""

from __future__ import annotations

from atom import _distribution, envs
from atom._logging import get_logger, info_once, warn_once
from atom.plugin import Decision, overrides_on
from atom.plugin.sglang.compat import BACKEND_NAME, SUPPORTED_SGLANG

logger = get_logger("atom.plugin")

#: The SGLang module that holds ``ModelRegistry`` (the override lands when it is imported).
REGISTRY_MODULE = "sglang.srt.models.registry"


def sglang_support() -> Decision:
    """Decision(activate?, reason, warn) for the installed SGLang."""
    from atom.patches.versions import installed_sglang, sglang_version_in

    if installed_sglang() is None:
        return Decision(False, "SGLang is not installed")
    ok, version = sglang_version_in(SUPPORTED_SGLANG)
    if ok:
        return Decision(True, f"SGLang {version} is supported ({SUPPORTED_SGLANG})")
    return Decision(False, f"SGLang {version} is outside the supported range {SUPPORTED_SGLANG}; atom "
                           "stays off under SGLang", warn=True)


def activation() -> Decision:
    """Decision(True/False, one-line reason, warn): does atom activate under SGLang? Shared by
    :func:`register` and doctor."""
    if envs.ATOM_DISABLE_SGLANG_PLUGIN:
        return Decision(False, "disabled by ATOM_DISABLE_SGLANG_PLUGIN=1")
    provenance = _distribution.check()  # another `atom` installed too: stay off, say what to do
    if not provenance.ok:
        return Decision(False, provenance.reason, warn=True)
    return sglang_support()


def overrides_in_effect() -> Decision:
    """Decision(use atom's models and attention backend?, reason): :func:`atom.plugin.overrides_on`
    for this machine (SGLang serves on a GPU when torch sees one). Shared by the model overrides,
    the attention decision and doctor."""
    import torch

    return overrides_on(not torch.cuda.is_available())


_registered = False


def register() -> None:
    """SGLang general-plugin hook (once per process). Raises :class:`atom.envs.EnvError` for a
    malformed ATOM_* value (SGLang logs a failing plugin and goes on without it)."""
    global _registered
    envs.set_values()
    on, why, warn = activation()
    if not on:
        (warn_once if warn else info_once)("sglang-off", f"atom not activated under SGLang: {why}", logger)
        return
    if _registered:
        return
    _registered = True

    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS, register_attention_backend
    from sglang.srt.server_args import ATTENTION_BACKEND_CHOICES, add_attention_backend_choices

    if BACKEND_NAME in ATTENTION_BACKENDS and getattr(ATTENTION_BACKENDS[BACKEND_NAME], "__module__", "") \
            != "atom.plugin.sglang.register":
        warn_once("sglang-name-taken", f"SGLang attention backend name {BACKEND_NAME!r} is taken by "
                  f"{ATTENTION_BACKENDS[BACKEND_NAME]!r}; atom's backend not registered", logger)
    else:
        register_attention_backend(BACKEND_NAME)(create_backend)
        if BACKEND_NAME not in ATTENTION_BACKEND_CHOICES:
            add_attention_backend_choices([BACKEND_NAME])

    import wrapt

    wrapt.register_post_import_hook(_override_models, REGISTRY_MODULE)

    from atom.plugin.sglang import records

    states = records.arm_all()
    summary = ", ".join(f"{pid} {st.split(':')[0]}" for pid, st in states.items()) or "none"
    logger.info("atom active under SGLang (%s): attention backend %r registered; patches: %s",
                why, BACKEND_NAME, summary)


def create_backend(model_runner):  # noqa: ANN001, ANN201 (SGLang's creator signature)
    """``--attention-backend atom``: imports atom's backend module only when SGLang builds one."""
    from atom.plugin.sglang.attention_mha import create_backend as create

    return create(model_runner)


def _override_models(module) -> None:  # noqa: ANN001
    """Post-import hook of ``sglang.srt.models.registry``: put atom's model classes in front of
    SGLang's for every architecture of the table that SGLang knows."""
    from atom.plugin.models import MODEL_TABLE

    use, why, _ = overrides_in_effect()
    if not use:
        info_once("sglang-models-off", f"atom model overrides not registered under SGLang: {why}", logger)
        return
    from atom.plugin.sglang import model_wrapper

    registry = module.ModelRegistry
    overridden = []
    for entry in MODEL_TABLE:
        if not entry.sglang_wrapper or entry.arch not in registry.models or not entry.implemented():
            continue
        wrapper = getattr(model_wrapper, entry.sglang_wrapper)
        if registry.models[entry.arch] is not wrapper:
            model_wrapper.adopt_stock(wrapper, registry.models[entry.arch])
        registry.models[entry.arch] = wrapper
        overridden.append(entry.arch)
        logger.info("Register model %s to SGLang with %s", entry.arch, entry.sglang_wrapper_ref)
    logger.info("atom active under SGLang: %d model override(s) (%s)", len(overridden), ", ".join(overridden) or "none")
