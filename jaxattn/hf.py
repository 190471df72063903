"""Hugging Face Llama checkpoints <-> ``jaxattn.model.Llama`` (twin of ``torchref/hf.py``).

``from_pretrained(path, dtype=None)`` reads a directory written by ``transformers`` (or by either package here);
``save_pretrained(model, path)`` writes one that ``transformers`` loads. HF stores linear weights ``[out, in]``;
our model keeps ``[in, out]`` with layers stacked, so conversion transposes and stacks — exactly, so an fp32
round trip is bit-exact. ``dtype=None`` keeps the dtype stored in the files; names are ``MODEL_DTYPES``.
Saving writes into the directory crash-safely and touches only our files (``jaxattn.spec.hf_format``).

    jaxattn.hf.save_pretrained(model, "ckpt"); model = jaxattn.hf.from_pretrained("ckpt", dtype="bfloat16")
"""
from __future__ import annotations

import os
from typing import Mapping, Optional

import jax.numpy as jnp
import numpy as np
import safetensors.numpy
from flax import nnx

from .spec import hf_format
from .spec.dtypes import MODEL_DTYPES, check_model_dtype
from .config import ModelConfig
from .model import Llama, set_value

# (our stacked name, HF per-layer name, transposed?)
_LAYER_MAP = (
    ("wq", "self_attn.q_proj.weight", True), ("wk", "self_attn.k_proj.weight", True),
    ("wv", "self_attn.v_proj.weight", True), ("wo", "self_attn.o_proj.weight", True),
    ("w_gate", "mlp.gate_proj.weight", True), ("w_up", "mlp.up_proj.weight", True),
    ("w_down", "mlp.down_proj.weight", True), ("attn_norm", "input_layernorm.weight", False),
    ("mlp_norm", "post_attention_layernorm.weight", False),
)


def _resolve_dtype(dtype):
    if dtype is None:
        return None
    if isinstance(dtype, str):
        return jnp.dtype(check_model_dtype(dtype))
    try:
        dt = jnp.dtype(dtype)
    except TypeError:
        raise ValueError(f"dtype={dtype!r} is not a dtype; use one of {', '.join(MODEL_DTYPES)}") from None
    check_model_dtype(dt.name)
    return dt


def to_state_dict(model: Llama) -> dict[str, np.ndarray]:
    """HF-named numpy arrays (``[out, in]`` layout); ``lm_head.weight`` only when embeddings are untied."""
    cfg = model.config
    out = {"model.embed_tokens.weight": np.asarray(model.embed[...]), "model.norm.weight": np.asarray(model.norm[...])}
    for ours, theirs, transpose in _LAYER_MAP:
        stacked = np.asarray(getattr(model.layers, ours)[...])
        for i in range(cfg.n_layers):
            out[f"model.layers.{i}.{theirs}"] = np.ascontiguousarray(stacked[i].T if transpose else stacked[i])
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = np.ascontiguousarray(np.asarray(model.lm_head[...]).T)
    return out


def from_state_dict(config: ModelConfig, tensors: Mapping[str, np.ndarray], dtype=None) -> Llama:
    """Build a ``Llama`` from HF-named arrays (numpy, or anything ``np.asarray`` takes); checks every key."""
    hf_format.check_state_shapes(config, {k: np.shape(v) for k, v in tensors.items()})
    hf_format.check_state_dtypes({k: v.dtype if hasattr(v, "dtype") else np.asarray(v).dtype
                                  for k, v in tensors.items()})
    dt = _resolve_dtype(dtype)

    def arr(x):
        x = jnp.asarray(np.asarray(x))
        return x if dt is None else x.astype(dt)

    # Build without running the random initialisers, then fill every parameter.
    model = nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(0)))
    set_value(model.embed, arr(tensors["model.embed_tokens.weight"]))
    set_value(model.norm, arr(tensors["model.norm.weight"]))
    for ours, theirs, transpose in _LAYER_MAP:
        per_layer = [np.asarray(tensors[f"model.layers.{i}.{theirs}"]) for i in range(config.n_layers)]
        set_value(getattr(model.layers, ours), arr(np.stack([p.T if transpose else p for p in per_layer])))
    if not config.tie_embeddings:
        set_value(model.lm_head, arr(np.asarray(tensors["lm_head.weight"]).T))
    set_value(model.inv_freq, jnp.asarray(config.rope_inv_freq()))
    return model


def from_pretrained(path: str | os.PathLike, dtype=None) -> Llama:
    """Load a Hugging Face Llama directory (``config.json`` + safetensors, single or sharded)."""
    _resolve_dtype(dtype)  # a bad dtype fails before any file is read
    if str(path).endswith(".gguf") and os.path.isfile(path):  # a llama.cpp file: see jaxattn/gguf.py
        from .gguf import from_gguf
        return from_gguf(path, dtype)
    hf_config, tensors = hf_format.read_checkpoint(path, safetensors.numpy.load_file)
    config = ModelConfig.from_hf(hf_config)
    where = f"checkpoint {os.fspath(path)!r}"
    hf_format.check_state_shapes(config, {k: v.shape for k, v in tensors.items()}, where)
    hf_format.check_state_dtypes({k: v.dtype for k, v in tensors.items()}, where)
    return from_state_dict(config, tensors, dtype=dtype)


def save_pretrained(model: Llama, path: str | os.PathLike,
                    max_shard_bytes: int = hf_format.DEFAULT_MAX_SHARD_BYTES,
                    dtype: Optional[object] = None) -> str:
    """Write ``model`` into the HF Llama directory ``path`` (created if needed; other files are kept).

    Crash-safe: a kill at any instant leaves the old or the new checkpoint. Returns the absolute path.
    """
    if not isinstance(model, Llama):
        raise TypeError(f"save_pretrained expects a jaxattn.model.Llama, got {type(model).__name__}")
    hf_format.check_max_shard_bytes(max_shard_bytes)
    dt = _resolve_dtype(dtype)
    tensors = to_state_dict(model)
    if dt is not None:
        tensors = {k: v.astype(dt) for k, v in tensors.items()}
    hf_config = model.config.to_hf()
    hf_config["torch_dtype"] = str(next(iter(tensors.values())).dtype)

    def save(subset, filename, metadata):
        safetensors.numpy.save_file(subset, filename, metadata=metadata)

    return hf_format.write_checkpoint(path, hf_config, tensors, {k: v.nbytes for k, v in tensors.items()}, save,
                                      max_shard_bytes)
