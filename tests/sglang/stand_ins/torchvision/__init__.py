"""Test stand-in for torchvision (tests/sglang/stand_ins/README.md): every name raises if called."""

from _stand_in import module_getattr

__getattr__ = module_getattr("torchvision")
__version__ = "0.0.0"  # not a real torchvision
