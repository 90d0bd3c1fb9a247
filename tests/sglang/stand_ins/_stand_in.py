"""Test-only stand-ins (see README.md): objects that raise when called."""


class StandIn:
    """A named stand-in: attribute access gives more stand-ins (for module-level constants such
    as ``InterpolationMode.BILINEAR``), calling one raises."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> "StandIn":
        if attr.startswith("__"):
            raise AttributeError(attr)
        return StandIn(f"{self._name}.{attr}")

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"test stand-in {self._name} was called: the SGLang CPU tests assume it never is")

    def __repr__(self) -> str:
        return f"<test stand-in {self._name}>"


def module_getattr(module: str):
    """A module ``__getattr__`` that answers every public name with a stand-in."""

    def __getattr__(attr: str) -> StandIn:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return StandIn(f"{module}.{attr}")

    return __getattr__
