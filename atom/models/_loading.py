"""Loading checkpoint tensors (name, tensor) into an atom model, from the host's iterator.

Checkpoint names are HF names. A model declares which checkpoint matrices it fuses
(``q_proj`` -> ``qkv_proj`` shard ``"q"``, ...); each tensor is then handed to its module's
``load_weight(param_name, tensor, shard_id)`` (which cuts out this rank's slice), or copied as
is for modules without one (norm weights).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Optional

import torch
from torch import nn

#: (fused module name, checkpoint module name, shard id), e.g. ("qkv_proj", "q_proj", "q"), or
#: a whole tensor into a stacked parameter: ("experts.w13", "experts.3.gate_proj.weight", (3, 0)).
StackedParams = Sequence[tuple[str, str, Hashable]]


def load_checkpoint_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    stacked: StackedParams = (),
    skip: Optional[Callable[[str], bool]] = None,
) -> set[str]:
    """Load every tensor of ``weights`` into ``model``; returns the model's parameter names loaded.

    Raises ``ValueError`` for a checkpoint tensor the model has no place for (a silent skip would
    leave a parameter uninitialised or hide a naming mistake); ``skip(name)`` names the ones that
    are expected and unused.
    """
    params = dict(model.named_parameters())
    # A fused parameter counts as loaded only once every matrix fused into it has arrived.
    shards_of: dict[str, set[Hashable]] = {}
    for fused, _, sid in stacked:
        shards_of.setdefault(fused, set()).add(sid)
    # part -> (fused, shard id), looked up by windows of a name's dotted components (a scan of
    # every entry per tensor is ~7M substring tests for a 128-expert, 48-layer checkpoint).
    by_part: dict[str, tuple[str, Hashable]] = {}
    for fused, part, sid in stacked:
        by_part.setdefault(part, (fused, sid))
    longest = max((part.count(".") + 1 for part in by_part), default=0)
    pending: dict[str, set[Hashable]] = {}
    loaded: set[str] = set()
    with torch.no_grad():
        for name, tensor in _split_fused_experts(weights, params, by_part, longest):
            if skip is not None and skip(name):
                continue
            target, shard_id, fused_name = _stacked_target(name, by_part, longest)
            if target not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no matching parameter in {type(model).__name__}")
            module_name, _, param_name = target.rpartition(".")
            module = model.get_submodule(module_name)
            load = getattr(module, "load_weight", None)
            if load is not None:
                load(param_name, tensor, shard_id)
            else:
                param = params[target]
                if param.shape != tensor.shape:
                    raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != {tuple(param.shape)}")
                param.data.copy_(tensor)
            if fused_name is None:
                loaded.add(target)
                continue
            missing = pending.setdefault(target, set(shards_of[fused_name]))
            missing.discard(shard_id)
            if not missing:
                loaded.add(target)
    return loaded


#: transformers 5 keeps a MoE layer's experts fused in memory: ``experts.gate_up_proj``
#: ``[E, 2I, H]`` (gate rows first) and ``experts.down_proj`` ``[E, H, I]``; with block-fp8
#: weights (its ``FP8Experts``) also their tile scales ``experts.gate_up_proj_scale_inv``
#: ``[E, 2I / bn, H / bk]`` (gate tiles first) and ``experts.down_proj_scale_inv``. ``save_pretrained``
#: splits them into the published per-expert layout, but checkpoints written from the in-memory
#: state keep them fused, and vLLM loads those too (bf16).
_FUSED_EXPERTS = (".experts.gate_up_proj", ".experts.down_proj")
_FUSED_SCALES = tuple(f"{fused}_scale_inv" for fused in _FUSED_EXPERTS)


def _split_fused_experts(
    weights: Iterable[tuple[str, torch.Tensor]], params: dict, by_part: dict, longest: int
) -> Iterable[tuple[str, torch.Tensor]]:
    """``weights`` with transformers 5's fused expert tensors replaced by the per-expert tensors
    ``save_pretrained`` writes (``experts.<e>.{gate,up,down}_proj.weight`` and, block fp8,
    ``.weight_scale_inv``), for models that load per-expert names. A model that has a parameter of
    that name itself (GPT-OSS's fused experts) gets the tensor as it is."""
    for name, tensor in weights:
        scale = name.endswith(_FUSED_SCALES)
        if (not (scale or name.endswith(_FUSED_EXPERTS)) or tensor.dim() != 3
                or _stacked_target(name, by_part, longest)[0] in params):
            yield name, tensor
            continue
        base = name.removesuffix("_scale_inv")
        prefix, suffix = base[: base.rindex(".experts.") + len(".experts.")], "weight_scale_inv" if scale else "weight"
        if base.endswith("gate_up_proj"):
            rows = tensor.shape[1]
            if rows % 2:  # an odd count of tile rows: one tile holds gate and up rows
                raise ValueError(f"checkpoint tensor {name!r}: {rows} rows of fp8 tiles do not split between the "
                                 "gate and up halves (the expert intermediate size is not a multiple of the fp8 "
                                 "block); write the experts per expert (save_pretrained) instead")
            half = rows // 2
            for e in range(tensor.shape[0]):
                yield f"{prefix}{e}.gate_proj.{suffix}", tensor[e, :half]
                yield f"{prefix}{e}.up_proj.{suffix}", tensor[e, half:]
        else:
            for e in range(tensor.shape[0]):
                yield f"{prefix}{e}.down_proj.{suffix}", tensor[e]


def _stacked_target(
    name: str, by_part: dict[str, tuple[str, Hashable]], longest: int
) -> tuple[str, Optional[Hashable], Optional[str]]:
    """(parameter name, shard id, fused name) for checkpoint tensor ``name``.

    A part matches whole dotted components after the first one; the leftmost, then longest,
    match wins (``experts.3.gate_proj`` before a dense ``gate_proj``). A part may name the tensor
    itself (``experts.3.gate_proj.weight`` -> the stacked parameter ``experts.w13``).
    """
    comps = name.split(".")
    for i in range(1, len(comps)):
        for n in range(min(longest, len(comps) - i), 0, -1):
            hit = by_part.get(".".join(comps[i:i + n]))
            if hit is not None:
                fused, sid = hit
                return ".".join(comps[:i] + [fused] + comps[i + n:]), sid, fused
    return name, None, None
