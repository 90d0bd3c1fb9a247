"""atom's vLLM host: the only package that knows vLLM's classes. It binds atom's host-neutral
layers and models to vLLM (entry points, platform, decorators and patches, model wrapper);
importing this package imports nothing of vLLM (each module imports it where it is used)."""
