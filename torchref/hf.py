"""Checkpoints in and out of ``torchref.model.LlamaForCausalLM``: Hugging Face directories and llama.cpp GGUF files
(twin of ``jaxattn/hf.py``).

Our module names are HF's, so this is ``load_state_dict`` plus the directory format (and, for an MoE, the renames
of the parameter table: stacked experts <-> one HF tensor per expert, Mixtral's ``block_sparse_moe`` names), which
is shared with the JAX side through ``twincore.hf_format`` (pure Python: importing it pulls in no jax); a
``.gguf`` file is read and dequantized by ``twincore.gguf``. ``dtype=None`` keeps the dtype stored in the
files; names are ``MODEL_DTYPES`` or their short names ``bf16``, ``fp16``, ``fp32``
(``twincore.dtypes.DTYPE_ALIASES``), or torch dtypes. The model is built on the ``meta`` device and the tensors are
assigned, so loading a large checkpoint allocates its weights once. Saving writes into the directory crash-safely
and touches only our files (see ``twincore.hf_format``).

    torchref.hf.save_pretrained(model, "ckpt"); model = torchref.hf.from_pretrained("ckpt", dtype="bfloat16")
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import safetensors.torch
import torch

from twincore import hf_format, params
from twincore.dtypes import DTYPE_ALIASES, MODEL_DTYPES, check_model_dtype
from twincore.gguf import read_gguf

from .config import ModelConfig
from .model import LlamaForCausalLM
from .quant import QUANTIZED


def _resolve_dtype(dtype) -> torch.dtype | None:
    if dtype is None:
        return None
    if isinstance(dtype, str):
        return getattr(torch, check_model_dtype(dtype))
    if isinstance(dtype, torch.dtype):
        check_model_dtype(hf_format.dtype_name(dtype))
        return dtype
    raise ValueError(
        f"dtype={dtype!r} is not supported; use one of {', '.join(MODEL_DTYPES)} "
        f"(or {', '.join(DTYPE_ALIASES)}) or those torch dtypes"
    )


def _renames(config: ModelConfig):
    """``(torch key, [(HF key, expert index or None)])`` for every parameter whose HF name differs from ours."""
    for row in params.rows(config):
        if row.hf_pattern(config) == row.hf and not row.expert:
            continue
        for i in range(config.n_layers) if row.per_layer else (None,):
            at = {} if i is None else {"i": i}
            experts = range(config.n_experts) if row.expert else (None,)
            yield row.torch.format(**at), [(row.hf_pattern(config).format(**at, e=e), e) for e in experts]


def to_state_dict(model: LlamaForCausalLM) -> dict[str, torch.Tensor]:
    """HF-named tensors as HF writes them: ``lm_head.weight`` dropped when embeddings are tied; stacked experts as
    one tensor per expert."""
    sd = model.state_dict()
    if model.config.tie_embeddings:
        sd.pop("lm_head.weight", None)
    for key, names in _renames(model.config):
        w = sd.pop(key)
        sd.update({name: w if e is None else w[e] for name, e in names})
    return {k: v.detach().contiguous() for k, v in sd.items()}


def from_state_dict(config: ModelConfig, tensors: Mapping[str, torch.Tensor], dtype=None) -> LlamaForCausalLM:
    """Build a model from HF-named tensors; every key and shape is checked first."""
    hf_format.check_state_shapes(config, {k: tuple(v.shape) for k, v in tensors.items()})
    hf_format.check_state_dtypes({k: v.dtype for k, v in tensors.items()})
    dt = _resolve_dtype(dtype)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    wanted = hf_format.expected_shapes(config)
    sd = {k: (v if dt is None else v.to(dt)) for k, v in tensors.items() if k in wanted}
    for key, names in _renames(config):
        parts = [sd.pop(name) for name, _ in names]
        sd[key] = parts[0] if names[0][1] is None else torch.stack(parts)
    if config.tie_embeddings:
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
    model.load_state_dict(sd, strict=True, assign=True)
    if config.tie_embeddings:  # assign=True replaced the shared Parameter: tie again
        model.lm_head.weight = model.model.embed_tokens.weight
    model.model.inv_freq = torch.from_numpy(config.rope_inv_freq())
    return model


def from_gguf(path: str | os.PathLike, dtype=None) -> LlamaForCausalLM:
    """A ``LlamaForCausalLM`` holding the dequantized weights of a llama.cpp GGUF file; ``dtype=None`` keeps
    float32."""
    dt = _resolve_dtype(dtype)  # a bad dtype fails before the file is read
    config, tensors, _ = read_gguf(path, "float16" if dt == torch.float16 else "float32", tokenizer=False)
    return from_state_dict(config, {k: torch.from_numpy(v) for k, v in tensors.items()}, dtype=dtype)


def from_pretrained(path: str | os.PathLike, dtype=None) -> LlamaForCausalLM:
    """Load a Hugging Face Llama directory (``config.json`` + safetensors, single or sharded)."""
    _resolve_dtype(dtype)  # a bad dtype fails before any file is read
    if str(path).endswith(".gguf") and os.path.isfile(path):  # a llama.cpp file
        return from_gguf(path, dtype)
    config, tensors = hf_format.load_checked(path, safetensors.torch.load_file)
    return from_state_dict(config, tensors, dtype=dtype)


def save_pretrained(
    model: LlamaForCausalLM,
    path: str | os.PathLike,
    max_shard_bytes: int = hf_format.DEFAULT_MAX_SHARD_BYTES,
    dtype=None,
) -> str:
    """Write ``model`` into the HF Llama directory ``path`` (created if needed; other files are kept).

    Crash-safe: a kill at any instant leaves the old or the new checkpoint. Returns the absolute path. A model
    int8-quantized by ``torchref.quant.quantize`` is refused (TypeError) before the directory is touched.
    """
    if not isinstance(model, LlamaForCausalLM):
        raise TypeError(f"save_pretrained expects a torchref.model.LlamaForCausalLM, got {type(model).__name__}")
    if any(isinstance(m, QUANTIZED) for m in model.modules()):
        raise hf_format.quantized_model_error("torchref")
    hf_format.check_max_shard_bytes(max_shard_bytes)
    dt = _resolve_dtype(dtype)
    tensors = {k: (v if dt is None else v.to(dt)).cpu() for k, v in to_state_dict(model).items()}
    hf_config = model.config.to_hf()
    hf_config["torch_dtype"] = str(next(iter(tensors.values())).dtype).removeprefix("torch.")

    def save(subset, filename, metadata):
        safetensors.torch.save_file(subset, filename, metadata=metadata)

    sizes = {k: v.numel() * v.element_size() for k, v in tensors.items()}
    return hf_format.write_checkpoint(path, hf_config, tensors, sizes, save, max_shard_bytes)
