"""atom's platform on AMD GPUs: vLLM's RocmPlatform plus :class:`ATOMPlatform`."""

from vllm.platforms.rocm import RocmPlatform

from atom.plugin.vllm.platform import ATOMPlatform


class ATOMRocmPlatform(ATOMPlatform, RocmPlatform):
    pass
