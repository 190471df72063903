"""The Hugging Face Llama checkpoint directory format, framework-neutral (no jax, no torch).

Shared by ``jaxattn.hf`` and ``torchref.hf`` so both read and write byte-identical layouts: ``config.json`` plus
``model.safetensors`` or ``model-0000i-of-0000n.safetensors`` shards with ``model.safetensors.index.json``.
The tensor files themselves are read and written by ``safetensors``; this module only knows names, shapes,
sharding and the safe replace of a directory (write to a temporary sibling, then rename, so an interrupted
save never destroys the previous checkpoint). It is written by hand because ``transformers``' own loader
needs its model classes; we only need the file layout.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
import uuid
from typing import Callable, Mapping, Sequence

CONFIG_NAME = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3
SAFETENSORS_METADATA = {"format": "pt"}  # transformers refuses files without a known format tag

_LAYER_KEYS = {  # HF name -> (rows, cols) as functions of the config; None cols = 1-D
    "self_attn.q_proj.weight": lambda c: (c.n_heads * c.resolved_head_dim, c.dim),
    "self_attn.k_proj.weight": lambda c: (c.n_kv_heads * c.resolved_head_dim, c.dim),
    "self_attn.v_proj.weight": lambda c: (c.n_kv_heads * c.resolved_head_dim, c.dim),
    "self_attn.o_proj.weight": lambda c: (c.dim, c.n_heads * c.resolved_head_dim),
    "mlp.gate_proj.weight": lambda c: (c.ffn_dim, c.dim),
    "mlp.up_proj.weight": lambda c: (c.ffn_dim, c.dim),
    "mlp.down_proj.weight": lambda c: (c.dim, c.ffn_dim),
    "input_layernorm.weight": lambda c: (c.dim,),
    "post_attention_layernorm.weight": lambda c: (c.dim,),
}
LAYER_KEYS = tuple(_LAYER_KEYS)


class CheckpointError(ValueError):
    """A checkpoint directory or state dict does not match the model configuration."""


def expected_shapes(cfg) -> dict[str, tuple[int, ...]]:
    """HF key -> shape for ``cfg`` (``lm_head.weight`` only when embeddings are not tied)."""
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, cfg.dim), "model.norm.weight": (cfg.dim,)}
    for i in range(cfg.n_layers):
        for key, shape in _LAYER_KEYS.items():
            shapes[f"model.layers.{i}.{key}"] = shape(cfg)
    if not cfg.tie_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, cfg.dim)
    return shapes


def check_state_shapes(cfg, shapes: Mapping[str, Sequence[int]], where: str = "state dict") -> None:
    """Raise ``CheckpointError`` listing every missing, unexpected and mis-shaped tensor.

    With tied embeddings a stored ``lm_head.weight`` is tolerated (HF writers differ); the embedding wins.
    Rotary ``inv_freq`` buffers written by old transformers versions are ignored.
    """
    want = expected_shapes(cfg)
    ignorable = {"lm_head.weight"} if cfg.tie_embeddings else set()
    have = {k: tuple(v) for k, v in shapes.items() if not k.endswith("rotary_emb.inv_freq")}
    missing = sorted(set(want) - set(have))
    unexpected = sorted(set(have) - set(want) - ignorable)
    wrong = sorted(f"{k}: expected {want[k]}, got {have[k]}" for k in set(want) & set(have) if want[k] != have[k])
    if cfg.tie_embeddings and "lm_head.weight" in have and have["lm_head.weight"] != want["model.embed_tokens.weight"]:
        wrong.append(f"lm_head.weight: expected {want['model.embed_tokens.weight']} (tied), "
                     f"got {have['lm_head.weight']}")
    if missing or unexpected or wrong:
        parts = [f"{where} does not match the model config:"]
        for title, items in (("missing", missing), ("unexpected", unexpected), ("wrong shape", wrong)):
            if items:
                parts.append(f"  {title} ({len(items)}): " + ", ".join(items[:20]) + (" ..." if len(items) > 20 else ""))
        raise CheckpointError("\n".join(parts))


def read_config(path: str | os.PathLike) -> dict:
    path = os.fspath(path)
    cfg_file = os.path.join(path, CONFIG_NAME)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"checkpoint path {path!r} is not a directory")
    if not os.path.isfile(cfg_file):
        raise FileNotFoundError(f"checkpoint directory {path!r} has no {CONFIG_NAME}")
    with open(cfg_file) as f:
        return json.load(f)


def weight_files(path: str | os.PathLike) -> list[str]:
    """The safetensors files of a checkpoint directory, from the index when sharded."""
    path = os.fspath(path)
    index = os.path.join(path, INDEX_FILE)
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index} has no 'weight_map'")
        files = sorted(set(weight_map.values()))
        absent = [f for f in files if not os.path.isfile(os.path.join(path, f))]
        if absent:
            raise CheckpointError(f"{index} names shard files that are missing: {absent}")
        return [os.path.join(path, f) for f in files]
    single = os.path.join(path, SINGLE_FILE)
    if os.path.isfile(single):
        return [single]
    raise FileNotFoundError(f"checkpoint directory {path!r} has neither {SINGLE_FILE} nor {INDEX_FILE} "
                            f"(found: {sorted(os.listdir(path))})")


def _natural_key(name: str):
    return [int(p) if p.isdigit() else p for p in name.split(".")]


def plan_shards(sizes: Mapping[str, int], max_shard_bytes: int) -> list[list[str]]:
    """Split tensor names, in natural order (layer 2 before layer 10), into shards of at most
    ``max_shard_bytes``; the order is canonical so both frameworks write identical files."""
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    shards: list[list[str]] = [[]]
    used = 0
    for name in sorted(sizes, key=_natural_key):
        size = sizes[name]
        if shards[-1] and used + size > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += size
    return shards


def write_checkpoint(path: str | os.PathLike, hf_config: dict, tensors: Mapping[str, object],
                     sizes: Mapping[str, int], save_file: Callable[[dict, str], None],
                     max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> str:
    """Write ``config.json`` and the safetensors file(s) to a temporary sibling, then rename it to ``path``.

    ``save_file(tensors_subset, filename)`` writes one safetensors file (framework-specific). An existing
    ``path`` is moved aside only after the new directory is complete, and removed after the rename.
    """
    path = os.path.abspath(os.fspath(path))
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(path)}.tmp-", dir=parent)
    try:
        with open(os.path.join(tmp, CONFIG_NAME), "w") as f:
            json.dump(hf_config, f, indent=2, sort_keys=True)
        shards = plan_shards(sizes, max_shard_bytes)
        if len(shards) == 1:
            save_file({k: tensors[k] for k in shards[0]}, os.path.join(tmp, SINGLE_FILE))
        else:
            weight_map = {}
            for i, names in enumerate(shards, 1):
                fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
                save_file({k: tensors[k] for k in names}, os.path.join(tmp, fname))
                weight_map.update({k: fname for k in names})
            with open(os.path.join(tmp, INDEX_FILE), "w") as f:
                json.dump({"metadata": {"total_size": int(sum(sizes.values()))}, "weight_map": weight_map}, f,
                          indent=2, sort_keys=True)
        old = None
        if os.path.exists(path):
            old = f"{path}.old-{uuid.uuid4().hex[:8]}"
            os.rename(path, old)
        os.rename(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return path
