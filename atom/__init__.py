"""atom: faster model execution for an unmodified vLLM, through vLLM's plugin entry points.

Importing ``atom`` imports neither vLLM nor torch; the plugin hooks live in
``atom.plugin.vllm.register`` and are found by vLLM through the package's entry points.
"""

__version__ = "0.1.0"
