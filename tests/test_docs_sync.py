"""The generated docs match the code they are generated from."""

from atom import _docs


def test_generated_docs_in_sync():
    stale = _docs.check()
    assert not stale, f"regenerate with `python -m atom docs --write`: {stale}"


def test_env_doc_lists_every_variable():
    from atom.envs import VARIABLES

    text = _docs.render_env_vars()
    for name in VARIABLES:
        assert f"`{name}`" in text


def test_patch_doc_lists_every_vllm_record():
    from atom.patches import REGISTRY
    from atom.plugin import catalog

    catalog.load()
    text = _docs.render_patches()
    for rec in REGISTRY:
        if not rec.id.startswith("fixture."):
            assert f"`{rec.id}`" in text
