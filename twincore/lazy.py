"""Lazy package attributes (PEP 562) for both twins' ``__init__``: public names and submodules are imported on
first use, so ``import jaxattn`` / ``import torchref`` stays cheap.

    __getattr__, __all__ = lazy_attributes(__name__, {"Llama": "model"}, ("model", "hf"))
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from importlib import import_module
from typing import Any

__all__ = ["lazy_attributes"]


def lazy_attributes(
    package: str, exports: Mapping[str, str], submodules: Sequence[str]
) -> tuple[Callable[[str], Any], list[str]]:
    """``(__getattr__, __all__)`` for ``package``: ``exports`` maps a public name to its submodule;
    ``package.<submodule>`` works without importing the submodule first; anything else is an AttributeError."""

    def __getattr__(name: str) -> Any:
        if name in exports:
            return getattr(import_module(f".{exports[name]}", package), name)
        if name in submodules:
            return import_module(f".{name}", package)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__, sorted(exports)
