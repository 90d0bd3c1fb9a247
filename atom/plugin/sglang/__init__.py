"""atom's SGLang host: the only package that knows SGLang's classes. It binds atom's host-neutral
layers and models to SGLang (the ``sglang.srt.plugins`` entry point, the ``atom`` attention
backend, the decorators of ``records``, the model classes SGLang's ``ModelRegistry`` serves);
importing this package imports nothing of SGLang (each module imports it where it is used).
"""
