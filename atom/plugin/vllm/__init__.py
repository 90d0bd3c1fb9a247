"""atom's vLLM integration. Only ``atom.plugin`` knows vLLM internals; importing this package
imports nothing of vLLM (the entry points in ``register`` import it lazily)."""
