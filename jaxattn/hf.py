"""Checkpoints in and out of ``jaxattn.model.Llama``: Hugging Face directories and llama.cpp GGUF files (twin of
``torchref/hf.py``).

``from_pretrained(path, dtype=None)`` reads a directory written by ``transformers`` (or by either package here), or a
``.gguf`` file; ``save_pretrained(model, path)`` writes a directory ``transformers`` loads. The HF names, shapes and
transposes come from the parameter table (``twincore.params``): HF stores linear weights ``[out, in]``, our
model ``[in, out]`` with layers stacked, so conversion transposes and stacks — exactly (an fp32 round trip is
bit-exact). ``dtype=None`` keeps the stored dtype (layers stored in mixed dtypes are stacked in the widest, so each
is held exactly as stored); names are ``MODEL_DTYPES`` or their short names ``bf16``, ``fp16``, ``fp32``
(``twincore.dtypes.DTYPE_ALIASES``), or jnp dtypes. Saving writes into the directory crash-safely and touches only our
files (``twincore.hf_format``).

    jaxattn.hf.save_pretrained(model, "ckpt"); model = jaxattn.hf.from_pretrained("ckpt", dtype="bfloat16")
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping

import jax.numpy as jnp
import numpy as np
import safetensors.numpy
from flax import nnx

from twincore import hf_format, params
from twincore.dtypes import DTYPE_ALIASES, MODEL_DTYPES, check_model_dtype
from twincore.gguf import read_gguf

from .config import ModelConfig
from .model import Llama, set_value
from .quant import QArray


def _resolve_dtype(dtype):
    if dtype is None:
        return None
    if isinstance(dtype, str):
        return jnp.dtype(check_model_dtype(dtype))
    try:
        dt = jnp.dtype(dtype)
    except TypeError:
        raise ValueError(
            f"dtype={dtype!r} is not a dtype; use one of {', '.join(MODEL_DTYPES)} (or {', '.join(DTYPE_ALIASES)})"
        ) from None
    check_model_dtype(dt.name)
    return dt


def _owner(model: Llama, row: params.ParamRow):
    return model.layers if row.per_layer else model


def to_state_dict(model: Llama) -> dict[str, np.ndarray]:
    """HF-named numpy arrays (``[out, in]`` layout); ``lm_head.weight`` only when embeddings are untied."""
    out = {}
    for row in params.rows(model.config):
        value = np.asarray(getattr(_owner(model, row), row.name)[...])
        for key, index in params.hf_keys(row, model.config):
            w = value[index]
            out[key] = np.ascontiguousarray(np.swapaxes(w, -1, -2) if row.transposed else w)
    return out


def from_state_dict(config: ModelConfig, tensors: Mapping[str, np.ndarray], dtype=None) -> Llama:
    """Build a ``Llama`` from HF-named arrays (numpy, or anything ``np.asarray`` takes); checks every key."""
    hf_format.check_state_shapes(config, {k: np.shape(v) for k, v in tensors.items()})
    hf_format.check_state_dtypes(
        {k: v.dtype if hasattr(v, "dtype") else np.asarray(v).dtype for k, v in tensors.items()}
    )
    dt = _resolve_dtype(dtype)
    # Build without running the random initialisers, then fill every parameter (stacked per layer / expert).
    model = nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(0)))
    for row in params.rows(config):
        keys = params.hf_keys(row, config)
        # the widest dtype of the group (bf16 + fp16 -> fp32, as torch.stack): each tensor is held exactly as stored
        stored = functools.reduce(jnp.promote_types, [np.asarray(tensors[k]).dtype for k, _ in keys])
        value = np.empty(row.jax_shape(config), dtype=stored)
        for key, index in keys:
            w = np.asarray(tensors[key])
            value[index] = np.swapaxes(w, -1, -2) if row.transposed else w
        value = jnp.asarray(value)
        set_value(getattr(_owner(model, row), row.name), value if dt is None else value.astype(dt))
    set_value(model.inv_freq, jnp.asarray(config.rope_inv_freq()))
    return model


def from_gguf(path: str | os.PathLike, dtype=None) -> Llama:
    """A ``Llama`` holding the dequantized weights of a llama.cpp GGUF file (read by ``twincore.gguf``);
    ``dtype=None`` keeps float32 (the dequantized values)."""
    dt = _resolve_dtype(dtype)  # a bad dtype fails before the file is read
    config, tensors, _ = read_gguf(
        path, "float16" if dt is not None and dt.name == "float16" else "float32", tokenizer=False
    )
    return from_state_dict(config, tensors, dtype=dtype)


def from_pretrained(path: str | os.PathLike, dtype=None) -> Llama:
    """Load a Hugging Face Llama directory (``config.json`` + safetensors, single or sharded)."""
    _resolve_dtype(dtype)  # a bad dtype fails before any file is read
    if str(path).endswith(".gguf") and os.path.isfile(path):  # a llama.cpp file
        return from_gguf(path, dtype)
    config, tensors = hf_format.load_checked(path, safetensors.numpy.load_file)
    return from_state_dict(config, tensors, dtype=dtype)


def save_pretrained(
    model: Llama,
    path: str | os.PathLike,
    max_shard_bytes: int = hf_format.DEFAULT_MAX_SHARD_BYTES,
    dtype: object | None = None,
) -> str:
    """Write ``model`` into the HF Llama directory ``path`` (created if needed; other files are kept).

    Crash-safe: a kill at any instant leaves the old or the new checkpoint. Returns the absolute path. A model
    int8-quantized by ``jaxattn.quant.quantize`` is refused (TypeError) before the directory is touched.
    """
    if not isinstance(model, Llama):
        raise TypeError(f"save_pretrained expects a jaxattn.model.Llama, got {type(model).__name__}")
    if any(isinstance(getattr(_owner(model, r), r.name)[...], QArray) for r in params.quantizable_rows(model.config)):
        raise hf_format.quantized_model_error("jaxattn")
    hf_format.check_max_shard_bytes(max_shard_bytes)
    dt = _resolve_dtype(dtype)
    tensors = to_state_dict(model)
    if dt is not None:
        tensors = {k: v.astype(dt) for k, v in tensors.items()}
    hf_config = model.config.to_hf()
    hf_config["torch_dtype"] = str(next(iter(tensors.values())).dtype)

    def save(subset, filename, metadata):
        safetensors.numpy.save_file(subset, filename, metadata=metadata)

    return hf_format.write_checkpoint(
        path, hf_config, tensors, {k: v.nbytes for k, v in tensors.items()}, save, max_shard_bytes
    )
