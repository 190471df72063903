"""Load a llama.cpp GGUF Llama file into ``jaxattn.model.Llama`` (twin of ``torchref/gguf.py``).

The file is read and dequantized by the framework-neutral ``jaxattn.spec.gguf``; the model is built by
``jaxattn.hf.from_state_dict``. ``dtype=None`` keeps float32 (the dequantized values); names are ``MODEL_DTYPES``.

    model = jaxattn.gguf.from_gguf("SmolLM2-135M-Instruct.Q4_1.gguf", dtype="bfloat16")
"""
from __future__ import annotations

import os

from . import hf
from .model import Llama
from .spec.gguf import read_gguf


def from_gguf(path: str | os.PathLike, dtype=None) -> Llama:
    """A ``Llama`` holding the dequantized weights of the GGUF file ``path`` (tokenizer: ``read_gguf``)."""
    dt = hf._resolve_dtype(dtype)  # a bad dtype fails before the file is read
    config, tensors, _ = read_gguf(path, "float16" if dt is not None and dt.name == "float16" else "float32",
                                   tokenizer=False)
    return hf.from_state_dict(config, tensors, dtype=dtype)
