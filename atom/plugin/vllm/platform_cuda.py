"""atom's platform on NVIDIA GPUs: vLLM's CudaPlatform plus :class:`ATOMPlatform`."""

from vllm.platforms.cuda import CudaPlatform

from atom.plugin.vllm.platform import ATOMPlatform


class ATOMCudaPlatform(ATOMPlatform, CudaPlatform):
    pass
