"""atom's attention layers become vLLM classes only once their decorators are applied (as the
platform's attention selection does in a vLLM process); tests that use the vLLM classes directly
apply them."""

import pytest


@pytest.fixture(autouse=True)
def attention_decorators():
    from atom.patches import REGISTRY, Injection, apply
    from atom.plugin import catalog

    catalog.load()
    for record in REGISTRY.select("vllm.attention"):
        if isinstance(record, Injection):
            apply(record, enabled=True)
    yield
