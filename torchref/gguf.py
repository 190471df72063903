"""Load a llama.cpp GGUF Llama file into ``torchref.model.LlamaForCausalLM`` (twin of ``jaxattn/gguf.py``).

The file is read and dequantized by the framework-neutral ``jaxattn.spec.gguf`` (numpy + the ``gguf``
package); the model is built by ``torchref.hf.from_state_dict``. ``dtype=None`` keeps float32.

    model = torchref.gguf.from_gguf("SmolLM2-135M-Instruct.Q4_1.gguf", dtype="bfloat16")
"""
from __future__ import annotations

import os

import torch

from jaxattn.spec.gguf import read_gguf

from . import hf
from .model import LlamaForCausalLM


def from_gguf(path: str | os.PathLike, dtype=None) -> LlamaForCausalLM:
    """A ``LlamaForCausalLM`` holding the dequantized weights of the GGUF file ``path``."""
    dt = hf._resolve_dtype(dtype)  # a bad dtype fails before the file is read
    config, tensors, _ = read_gguf(path, "float16" if dt == torch.float16 else "float32", tokenizer=False)
    return hf.from_state_dict(config, {k: torch.from_numpy(v) for k, v in tensors.items()}, dtype=dtype)
