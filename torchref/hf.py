"""Hugging Face Llama checkpoints <-> ``torchref.model.LlamaForCausalLM`` (twin of ``jaxattn/hf.py``).

Our module names are HF's, so this is ``load_state_dict`` plus the directory format, which is shared with the
JAX side through ``jaxattn.spec.hf_format`` (pure Python: importing it pulls in no jax). ``dtype=None`` keeps the
dtype stored in the files. The model is built on the ``meta`` device and the tensors are assigned, so loading a
large checkpoint allocates its weights once.
"""
from __future__ import annotations

import os
from typing import Mapping, Optional

import torch
import safetensors.torch

from jaxattn.spec import hf_format

from .config import ModelConfig
from .model import LlamaForCausalLM

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _resolve_dtype(dtype) -> Optional[torch.dtype]:
    if dtype is None:
        return None
    if isinstance(dtype, str) and dtype in _DTYPES:
        return _DTYPES[dtype]
    if dtype in _DTYPES.values():
        return dtype
    raise ValueError(f"dtype={dtype!r} is not supported; use one of {sorted(_DTYPES)} or the torch dtypes")


def to_state_dict(model: LlamaForCausalLM) -> dict[str, torch.Tensor]:
    """HF-named tensors as HF writes them: ``lm_head.weight`` dropped when embeddings are tied."""
    sd = model.state_dict()
    if model.config.tie_embeddings:
        sd.pop("lm_head.weight", None)
    return {k: v.detach().contiguous() for k, v in sd.items()}


def from_state_dict(config: ModelConfig, tensors: Mapping[str, torch.Tensor], dtype=None) -> LlamaForCausalLM:
    """Build a model from HF-named tensors; every key and shape is checked first."""
    hf_format.check_state_shapes(config, {k: tuple(v.shape) for k, v in tensors.items()})
    dt = _resolve_dtype(dtype)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    wanted = hf_format.expected_shapes(config)
    sd = {k: (v if dt is None else v.to(dt)) for k, v in tensors.items() if k in wanted}
    if config.tie_embeddings:
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
    model.load_state_dict(sd, strict=True, assign=True)
    if config.tie_embeddings:  # assign=True replaced the shared Parameter: tie again
        model.lm_head.weight = model.model.embed_tokens.weight
    model.model.inv_freq = torch.from_numpy(config.rope_inv_freq())
    return model


def from_pretrained(path: str | os.PathLike, dtype=None) -> LlamaForCausalLM:
    """Load a Hugging Face Llama directory (``config.json`` + safetensors, single or sharded)."""
    config = ModelConfig.from_hf(hf_format.read_config(path))
    tensors: dict[str, torch.Tensor] = {}
    for file in hf_format.weight_files(path):
        tensors.update(safetensors.torch.load_file(file))
    return from_state_dict(config, tensors, dtype=dtype)


def save_pretrained(model: LlamaForCausalLM, path: str | os.PathLike,
                    max_shard_bytes: int = hf_format.DEFAULT_MAX_SHARD_BYTES, dtype=None) -> str:
    """Write ``model`` as a HF Llama directory (temp dir + rename). Returns the absolute path."""
    if not isinstance(model, LlamaForCausalLM):
        raise TypeError(f"save_pretrained expects a torchref.model.LlamaForCausalLM, got {type(model).__name__}")
    dt = _resolve_dtype(dtype)
    tensors = {k: (v if dt is None else v.to(dt)).cpu() for k, v in to_state_dict(model).items()}
    hf_config = model.config.to_hf()
    hf_config["torch_dtype"] = str(next(iter(tensors.values())).dtype).removeprefix("torch.")

    def save(subset, filename):
        safetensors.torch.save_file(subset, filename, metadata=hf_format.SAFETENSORS_METADATA)

    sizes = {k: v.numel() * v.element_size() for k, v in tensors.items()}
    return hf_format.write_checkpoint(path, hf_config, tensors, sizes, save, max_shard_bytes)
