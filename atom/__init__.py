"""atom: faster model execution for an unmodified vLLM (and SGLang), through their plugin entry points.

Importing ``atom`` imports neither host nor torch; the plugin hooks live in
``atom.plugin.vllm.register`` and ``atom.plugin.sglang.register`` and are found by each host
through the package's entry points.
"""

#: The one place the version is written: pyproject.toml reads it (``attr: atom.__version__``).
__version__ = "0.1.0"

#: The distribution that installs this package. Another project on PyPI (``atom``) installs an
#: import package named ``atom`` too; atom._distribution tells the two apart by this name.
__distribution__ = "atom-vllm"
