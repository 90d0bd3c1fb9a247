"""atom's multi-head latent attention (``atom.models.attention.mla``) as a vLLM MLA backend.

The **MLA decorators** are registered records (``atom.plugin.vllm.records``, group
``vllm.attention.mla``) that inject what vLLM calls into atom's host-neutral classes:

* ``vllm.attention.mla_backend`` -> ``MLABackend`` (``attention.VLLMMLABackendMethods``: the
  shared backend members plus ``is_mla`` and MLA's head-size and layout answers);
* ``vllm.attention.mla_builder`` -> ``MLAMetadataBuilder`` (``attention.VLLMBuilderMethods``);
* ``vllm.attention.mla_impl`` -> ``MLAttentionImpl`` (``attention.MLAImplMethods``: the
  post-load weight split, the latent cache write, ``forward_mqa`` / ``forward_mha`` and the
  plugin-mode ``forward`` that ``atom.plugin.vllm.mla_patch`` routes vLLM's layer to).

vLLM's ``MLAAttention`` layer is reached through ``mla_patch`` (its records are in the same
group, so atom's MLA backend is only selected while they are applied). How vLLM reaches each
piece (0.32; 0.26 differs where marked):

* ``ATOMPlatform.get_attn_backend_cls`` -> ``atom.plugin.vllm.selection.attention_backend``
  applies the group, registers the ``AttentionBackendEnum`` member ``ATOM_MLA`` (``CUSTOM``
  belongs to atom's MHA backend) and returns :data:`BACKEND_QUALNAME` for a ``use_mla`` layer.
* ``MLAAttention.__init__`` builds ``ATOMMLAImpl(num_heads, head_size, scale, num_kv_heads, ...,
  q_lora_rank, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, qk_head_dim, v_head_dim,
  kv_b_proj, indexer)``.
* The KV-cache manager asks ``MLAAttention.get_kv_cache_spec`` (checked for atom's layers by
  mla_patch) for the latent cache: one ``[kv_lora_rank | rope]`` row per token.
* The model runner builds one :class:`ATOMMLAMetadataBuilder` per KV-cache group, reorders the
  batch so decodes come first (``reorder_batch_threshold = 1``) and calls ``build`` every step.
* Per layer and step, ``MLAAttention`` calls ``impl.do_kv_cache_update`` and then its
  ``forward_impl``, which for atom's layers is ``impl.forward`` (routed once per layer by
  mla_patch when the layer's weights are processed).
* After weight loading, ``MLAAttention.process_weights_after_loading(act_dtype)`` ->
  ``impl.process_weights_after_loading(act_dtype)`` (mla_patch).
"""

from __future__ import annotations

from typing import Any, ClassVar, Optional

import torch

from atom import envs
from atom.models.attention.common import graph_safe
from atom.models.attention.mla import MLABackend, MLAMetadataBuilder, MLAttentionImpl, context_chunk_tokens
from atom.plugin.vllm import compat, mla_decode
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionMetadataBuilder,
    AttentionType,
    MLAAttentionImpl,
)

#: The ``AttentionBackendEnum`` member atom registers for this backend (a name of its own).
BACKEND_NAME = "ATOM_MLA"
#: What vLLM resolves by name (``resolve_obj_by_qualname``: dots only).
BACKEND_QUALNAME = "atom.plugin.vllm.attention_mla.ATOMMLABackend"


class ATOMMLAMetadataBuilder(MLAMetadataBuilder, AttentionMetadataBuilder):
    """vLLM's metadata builder for atom's MLA (``build`` & co. injected into
    :class:`MLAMetadataBuilder`). ``reorder_batch_threshold = 1``: vLLM's runner puts
    single-token decode rows first."""

    # Full CUDA graphs for uniform single-token decode batches only: the decode path is two
    # bmm's and the split-KV Triton kernel whose split count is fixed from max_seq_len at
    # capture; the prefill path sizes its gather by the step's max_seq_len. The torch reference
    # (CPU) reads device values on the host: no graphs.
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    reorder_batch_threshold: ClassVar[Optional[int]] = 1

    def __init__(self, kv_cache_spec: Any, layer_names: list[str], vllm_config: Any,
                 device: torch.device) -> None:
        AttentionMetadataBuilder.__init__(self, kv_cache_spec, layer_names, vllm_config, device)
        MLAMetadataBuilder.__init__(self, max_model_len=vllm_config.model_config.max_model_len)

    @classmethod
    def get_cudagraph_support(cls, vllm_config: Any, kv_cache_spec: Any) -> AttentionCGSupport:
        return cls._cudagraph_support if graph_safe(MLABackend.kernel_ops) else AttentionCGSupport.NEVER


class ATOMMLAImpl(MLAttentionImpl, MLAAttentionImpl):
    """vLLM's impl for atom's MLA (its vLLM members injected into :class:`MLAttentionImpl`);
    here: construction from what vLLM's ``MLAAttention`` passes."""

    supports_dcp: bool = False
    supports_pcp: bool = False
    can_return_lse_for_decode: bool = False
    supports_quant_query_input: bool = False

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        alibi_slopes: Optional[list[float]],
        sliding_window: Optional[int],
        kv_cache_dtype: str,
        logits_soft_cap: Optional[float],
        attn_type: str,
        kv_sharing_target_layer_name: Optional[str],
        q_lora_rank: Optional[int],
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        qk_head_dim: int,
        v_head_dim: int,
        kv_b_proj: Any,
        indexer: Optional[object] = None,
        q_pad_num_heads: Optional[int] = None,
        **unsupported: Any,
    ) -> None:
        # The selector cannot see these, so the layer that asks for them fails at model build.
        if alibi_slopes is not None or logits_soft_cap or sliding_window is not None:
            raise NotImplementedError("atom's MLA backend has no ALiBi, soft-cap or sliding window")
        if attn_type != AttentionType.DECODER:
            raise NotImplementedError(f"atom's MLA backend serves decoder attention, not {attn_type}")
        if kv_sharing_target_layer_name is not None:
            raise NotImplementedError("atom's MLA backend has no KV sharing")
        if indexer is not None or unsupported.get("topk_indices_buffer") is not None:
            raise NotImplementedError("atom's MLA backend has no sparse (indexer) attention")
        if head_size != kv_lora_rank + qk_rope_head_dim or qk_head_dim != qk_nope_head_dim + qk_rope_head_dim:
            raise NotImplementedError(f"atom's MLA backend does not support head size {head_size}")
        # vLLM builds the impl inside its config context (MLAAttention.__init__); forward runs
        # outside it, so the chunk size and the step's token bound are read now.
        config = compat.current_vllm_config()
        sched = None if config is None else config.scheduler_config
        block_size = compat.current_config_int("cache_config", "block_size") or 16  # vLLM's CUDA default
        mla_decode.install()  # vLLM's FlashMLA for the decode rows where it runs (chosen at absorb)
        if config is not None and not getattr(config.cache_config, "user_specified_block_size", True):
            # the page size vLLM will pick once the model is built (it asks the backend then)
            block_size = mla_decode.preferred_block_size(block_size, config.model_config)
        chunk = context_chunk_tokens(None if config is None else int(config.model_config.max_model_len),
                                     None if sched is None else int(sched.max_num_seqs), block_size,
                                     envs.ATOM_MLA_CONTEXT_CHUNK_TOKENS)
        super().__init__(num_heads, scale, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim,
                         self._up_proj, kv_cache_dtype, context_chunk_tokens=chunk,
                         max_step_tokens=None if sched is None else int(sched.max_num_batched_tokens),
                         block_size=block_size)
        self.num_kv_heads = num_kv_heads
        self.q_lora_rank = q_lora_rank
        self.kv_b_proj = kv_b_proj  # vLLM's LinearBase (or atom's view of its linear): split after loading
        self.indexer = None
        self.q_pad_num_heads = None

    def _up_proj(self, latent: torch.Tensor) -> torch.Tensor:
        return self.kv_b_proj(latent)[0]  # vLLM linears return (output, bias)

    def fused_output_quant_supported(self, quant_key: Any) -> bool:
        return False  # no fused output quantization: vLLM's fusion pass leaves our output alone


class ATOMMLABackend(MLABackend, AttentionBackend):
    """Latent-cache MLA for dense (non-sparse) DeepSeek-style decoder layers; vLLM's
    classmethods come from the MLA backend decorator."""

    backend_name: ClassVar[str] = BACKEND_NAME
    impl_cls: ClassVar[type] = ATOMMLAImpl
    builder_cls: ClassVar[type] = ATOMMLAMetadataBuilder
