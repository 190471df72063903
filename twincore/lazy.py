"""Lazy package attributes (PEP 562) for both twins' ``__init__``: public names and submodules are imported on
first use, so ``import jaxattn`` / ``import torchref`` stays cheap.

    __getattr__, __all__ = lazy_attributes(__name__, __path__, {"Llama": "model"})
"""

from __future__ import annotations

import pkgutil
from collections.abc import Callable, Mapping, Sequence
from importlib import import_module
from typing import Any

__all__ = ["lazy_attributes"]


def lazy_attributes(
    package: str, path: Sequence[str], exports: Mapping[str, str]
) -> tuple[Callable[[str], Any], list[str]]:
    """``(__getattr__, __all__)`` for ``package`` (its ``__path__``): ``exports`` maps a public name to its
    submodule; ``package.<submodule>`` works for every module and subpackage in it without importing it first;
    anything else is an AttributeError."""
    submodules = frozenset(m.name for m in pkgutil.iter_modules(path) if not m.name.startswith("_"))

    def __getattr__(name: str) -> Any:
        if name in exports:
            return getattr(import_module(f".{exports[name]}", package), name)
        if name in submodules:
            return import_module(f".{name}", package)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__, sorted(exports)
