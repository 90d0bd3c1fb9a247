"""Test stand-in for torchvision.transforms (tests/sglang/stand_ins/README.md): every name raises if called."""

from _stand_in import module_getattr

__getattr__ = module_getattr("torchvision.transforms")
