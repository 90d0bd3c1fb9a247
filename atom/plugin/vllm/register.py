"""vLLM's two entry points into atom (see pyproject.toml):

* ``vllm.platform_plugins: atom = atom.plugin.vllm.register:register_platform``
* ``vllm.general_plugins: atom_model_registry = atom.plugin.vllm.register:register_model``

Importing this module imports neither vLLM nor torch. vLLM calls ``register_platform`` twice in
every process and ``register_model`` once per process; both are cheap and idempotent.
"""

from __future__ import annotations

import functools
from typing import Optional

from atom import _distribution, envs
from atom._logging import get_logger, info_once, warn_once
from atom.plugin import Decision, overrides_on
from atom.plugin.vllm.compat import SUPPORTED_VLLM

logger = get_logger("atom.plugin")

#: vLLM's builtin platform detector name -> atom platform class (a subclass of vLLM's platform).
PLATFORM_CLASSES = {
    "cpu": "atom.plugin.vllm.platform_cpu.ATOMCpuPlatform",
    "cuda": "atom.plugin.vllm.platform_cuda.ATOMCudaPlatform",
    "rocm": "atom.plugin.vllm.platform_rocm.ATOMRocmPlatform",
}


def vllm_support() -> Decision:
    """Decision(activate?, reason, warn) for the installed vLLM, honouring ATOM_ALLOW_UNSUPPORTED_VLLM."""
    from atom.patches.versions import installed_vllm, vllm_version_in

    found = installed_vllm()
    if found is None:
        return Decision(False, "vLLM is not installed")
    ok, version = vllm_version_in(SUPPORTED_VLLM)
    if ok:
        return Decision(True, f"vLLM {version} is supported ({SUPPORTED_VLLM})")
    if envs.ATOM_ALLOW_UNSUPPORTED_VLLM:
        return Decision(True, f"vLLM {version} is outside the supported range {SUPPORTED_VLLM}; "
                              "activating anyway because ATOM_ALLOW_UNSUPPORTED_VLLM=1", warn=True)
    return Decision(False, f"vLLM {version} is outside the supported range {SUPPORTED_VLLM}; atom "
                           "stays off (set ATOM_ALLOW_UNSUPPORTED_VLLM=1 to try it anyway)", warn=True)


@functools.lru_cache(maxsize=None)
def detect_device() -> Optional[str]:
    """The builtin platform vLLM itself would pick ("cuda", "rocm", "cpu", ...), or None.

    Runs vLLM's own detectors once per process (cached): vLLM calls our hook twice per process.
    """
    from vllm import envs as vllm_envs
    from vllm.platforms import builtin_platform_plugins, cpu_platform_plugin

    if vllm_envs.VLLM_TARGET_DEVICE == "cpu":
        return "cpu"
    found = []
    for name, detect in builtin_platform_plugins.items():
        try:
            if detect() is not None:
                found.append(name)
        except Exception:  # vLLM's loop treats a failing detector as "not this device" too
            continue
    if len(found) == 1:
        return found[0]
    if not found and cpu_platform_plugin() is not None:
        return "cpu"
    return None


def activation() -> Decision:
    """Decision(platform qualname or None, one-line reason, warn). Shared by register_platform
    and doctor."""
    if envs.ATOM_DISABLE_VLLM_PLUGIN:
        return Decision(None, "disabled by ATOM_DISABLE_VLLM_PLUGIN=1")
    provenance = _distribution.check()  # another `atom` installed too: stay off, say what to do
    if not provenance.ok:
        return Decision(None, provenance.reason, warn=True)
    support = vllm_support()
    if not support.value:
        return Decision(None, support.reason, support.warn)
    device = detect_device()
    if device not in PLATFORM_CLASSES:
        return Decision(None, f"no supported device (vLLM would use {device or 'no platform'})", warn=True)
    return Decision(PLATFORM_CLASSES[device], f"{support.reason}; device {device}", support.warn)


def overrides_in_effect() -> Decision:
    """Decision(use atom's model overrides and attention backend?, reason): :func:`atom.plugin.overrides_on`
    for the device vLLM picks. Shared by ``register_model``, the attention decision and doctor."""
    return overrides_on(detect_device() == "cpu")


def register_platform() -> Optional[str]:
    """vLLM platform hook: the qualname of atom's platform for this device, or None.

    None when ATOM_DISABLE_VLLM_PLUGIN=1, when the installed vLLM is outside the supported range
    (one warning), or when there is no supported device. vLLM swallows exceptions from platform
    hooks, so a malformed ATOM_* value is logged here as an error (``register_model`` then raises
    it, which vLLM does not swallow).
    """
    try:
        qualname, why, warn = activation()
    except envs.EnvError as exc:
        warn_once("platform-env-error", f"atom platform not activated: {exc}", logger)
        return None
    if qualname is None:
        (warn_once if warn else info_once)("platform-off", f"atom platform not activated: {why}", logger)
        return None
    if warn:
        warn_once("platform-untested", f"atom: {why}", logger)
    info_once("platform-on", f"atom platform {qualname.rpartition('.')[2]} activated ({why})", logger)
    return qualname


_models_registered = False


def register_model() -> None:
    """vLLM general-plugin hook (once per process): model overrides + arming atom's patches.

    Overrides the architectures of atom's one table (``atom.plugin.models.MODEL_TABLE``) that
    both atom implements and this vLLM knows, with lazy ``"module:Class"`` strings, then arms the
    records of ``atom.plugin.vllm.records`` through the toolkit. Raises :class:`atom.envs.EnvError`
    for malformed ATOM_* values (vLLM does not swallow general-plugin errors).
    """
    global _models_registered
    envs.set_values()  # parse every ATOM_* variable now: a malformed one stops here, clearly
    if envs.ATOM_DISABLE_VLLM_PLUGIN:
        info_once("models-off", "atom model overrides not registered: ATOM_DISABLE_VLLM_PLUGIN=1", logger)
        return
    provenance = _distribution.check()  # the same check as activation(): another `atom` installed too
    if not provenance.ok:
        warn_once("models-off", f"atom model overrides not registered: {provenance.reason}", logger)
        return
    ok, why, warn = vllm_support()
    if not ok:
        (warn_once if warn else info_once)("models-off", f"atom model overrides not registered: {why}", logger)
        return
    if _models_registered:
        return
    _models_registered = True
    in_effect = overrides_in_effect()
    if not in_effect.value:
        info_once("models-off", f"atom model overrides and attention {in_effect.reason}", logger)
        return
    from atom.plugin.vllm import compat
    from vllm import envs as vllm_envs

    if vllm_envs.VLLM_TARGET_DEVICE == "cpu" and compat.target_device_short_circuits_plugins():
        # vLLM resolves its CPU platform without asking plugins: atom's models still serve (they
        # run on any platform), with vLLM's own CPU attention.
        info_once("target-device", "VLLM_TARGET_DEVICE=cpu: vLLM picks its CPU platform without asking "
                  "plugins, so atom's attention backend is not used; atom's models still are", logger)

    from vllm import ModelRegistry

    from atom.plugin.models import MODEL_TABLE

    from atom.plugin.vllm import overrides

    known = set(ModelRegistry.get_supported_archs())
    overridden = []
    for entry in MODEL_TABLE:
        if entry.arch not in known:
            logger.debug("atom: vLLM %s does not know %s; not overridden", why, entry.arch)
            continue
        if not entry.implemented():
            logger.debug("atom: no atom model module for %s; not overridden", entry.arch)
            continue
        overrides.override(ModelRegistry, entry.arch, entry.wrapper_ref)
        overridden.append(entry.arch)
        logger.info("Register model %s to vLLM with %s", entry.arch, entry.wrapper_ref)

    from atom.plugin.vllm import records

    states = records.arm_all()
    # The banner: one line a user can grep for to see what atom did in this process.
    summary = ", ".join(f"{pid} {st.split(':')[0]}" for pid, st in states.items()) or "none"
    logger.info("atom active: %d model override(s) (%s); patches: %s", len(overridden),
                ", ".join(overridden) or "none", summary)
