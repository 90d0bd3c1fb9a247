"""atom's backend classes are vLLM classes only once the decorators are applied (as
``select_attention_backend`` does in a vLLM process); tests that use them directly apply them."""

import pytest


@pytest.fixture(autouse=True)
def mha_decorators():
    from atom.patches import apply
    from atom.plugin.vllm.patches import ATTENTION_DECORATORS

    for record in ATTENTION_DECORATORS["mha"]:
        apply(record, enabled=True)
    yield
