"""atom's model implementations, built from :mod:`atom.ops`.

A model never imports its host framework. Whatever the host owns -- the attention layer that
reads and writes its KV cache, the tensor-parallel process group -- is handed to the model's
constructor explicitly (see :mod:`atom.models.interfaces`); ``atom.plugin`` does the handing.
"""
