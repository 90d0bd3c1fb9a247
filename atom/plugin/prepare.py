"""Which framework hosts atom.

There is no process-global "current framework" flag: the host is decided where it is known --
by the entry point that vLLM calls, or by the wrapper constructing a model -- and passed down
explicitly (``PluginConfig.host``). SGLang would add a member here and its own entry module.
"""

from __future__ import annotations

import enum


class Host(str, enum.Enum):
    VLLM = "vllm"
    # SGLANG = "sglang"  -- the seam: add the member and an atom.plugin.sglang entry module.

    @property
    def is_vllm(self) -> bool:
        return self is Host.VLLM
