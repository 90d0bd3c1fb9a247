"""atom's backend classes are vLLM classes only once the decorators are applied (as
``select_attention_backend`` does in a vLLM process); tests that use them directly apply them."""

import pytest


@pytest.fixture(autouse=True)
def attention_decorators():
    from atom.patches import apply
    from atom.plugin.vllm.patches import ATTENTION_DECORATORS

    for kind in ("mha", "mla"):
        for record in ATTENTION_DECORATORS[kind]:
            apply(record, enabled=True)
    yield
