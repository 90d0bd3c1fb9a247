"""atom's platform on CPU (what CI runs): vLLM's CpuPlatform plus :class:`ATOMPlatform`."""

from vllm.platforms.cpu import CpuPlatform

from atom.plugin.vllm.platform import ATOMPlatform


class ATOMCpuPlatform(ATOMPlatform, CpuPlatform):
    pass
