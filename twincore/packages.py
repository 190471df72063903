"""Installed distributions: which version of a package pip installed here, None when it is not (the deviceless
compile targets' checks of their extras, ``jaxattn.gpu_target`` / ``tpu_target``, read it).

    installed_version("jaxlib")      # "0.10.2", or None
"""

from __future__ import annotations

import importlib.metadata

__all__ = ["installed_version"]


def installed_version(dist: str) -> str | None:
    """The version of the installed distribution ``dist`` (its pip name), None when it is not installed."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None
