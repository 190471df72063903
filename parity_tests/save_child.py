"""Checkpoint variants and a saver subprocess for ``test_save_safety.py``'s kill -9 tests.

    python -m parity_tests.save_child {spec,torch,jax} DIR LOG FIRST

saves ``variant(FIRST)``, ``variant(FIRST + 1)``, ... into ``DIR`` until killed, appending ``start i`` before
and ``done i`` after each save to ``LOG``. ``spec`` drives ``hf_format.write_checkpoint`` directly (numpy only,
starts in a fraction of a second); ``torch``/``jax`` call the package's ``save_pretrained``. The variants cycle
through every transition: single -> sharded, sharded -> sharded with the same shard names, a config whose
shapes change (tied embeddings), sharded -> single, single -> single with another config.
"""

from __future__ import annotations

import os
import sys

import numpy as np

from twincore import hf_format
from twincore.config import ModelConfig

# (ModelConfig.preset("tiny") overrides, max_shard_bytes or None for one file); a tiny model is ~460 KB
VARIANTS = (
    (dict(rope_theta=10000.0), None),
    (dict(rope_theta=20000.0), 120_000),
    (dict(rope_theta=10000.0), 120_000),
    (dict(rope_theta=10000.0, tie_embeddings=True), 200_000),
    (dict(rope_theta=40000.0, tie_embeddings=True), None),
)


def variant(i: int) -> tuple[ModelConfig, dict[str, np.ndarray], int]:
    """(config, HF-named float32 tensors, max_shard_bytes) of variant ``i % len(VARIANTS)``."""
    overrides, max_shard = VARIANTS[i % len(VARIANTS)]
    cfg = ModelConfig.preset("tiny", **overrides)
    rng = np.random.default_rng(1000 + i % len(VARIANTS))
    tensors = {k: rng.standard_normal(shape, dtype=np.float32) for k, shape in hf_format.expected_shapes(cfg).items()}
    return cfg, tensors, max_shard or hf_format.DEFAULT_MAX_SHARD_BYTES


def spec_save(path, i: int) -> None:
    """Save variant ``i`` with the shared writer and numpy's safetensors, as ``jaxattn.save_pretrained`` does."""
    import safetensors.numpy

    cfg, tensors, max_shard = variant(i)
    hf_config = {**cfg.to_hf(), "torch_dtype": "float32"}
    hf_format.write_checkpoint(
        path,
        hf_config,
        tensors,
        {k: v.nbytes for k, v in tensors.items()},
        lambda sub, fn, meta: safetensors.numpy.save_file(sub, fn, metadata=meta),
        max_shard,
    )


def _savers(mode: str):
    """One ``save(path)`` per variant, models built once up front."""
    if mode == "spec":
        return [lambda path, i=i: spec_save(path, i) for i in range(len(VARIANTS))]
    savers = []
    for i in range(len(VARIANTS)):
        cfg, tensors, max_shard = variant(i)
        if mode == "torch":
            import torch

            import torchref

            model = torchref.hf.from_state_dict(cfg, {k: torch.from_numpy(v) for k, v in tensors.items()})
            savers.append(lambda path, m=model, s=max_shard: torchref.save_pretrained(m, path, max_shard_bytes=s))
        elif mode == "jax":
            import jaxattn
            import jaxattn.hf

            model = jaxattn.hf.from_state_dict(cfg, tensors)
            savers.append(lambda path, m=model, s=max_shard: jaxattn.save_pretrained(m, path, max_shard_bytes=s))
        else:
            raise ValueError(f"mode={mode!r} is not supported; use spec, torch or jax")
    return savers


def main(argv: list[str]) -> None:
    mode, path, log, first = argv[0], argv[1], argv[2], int(argv[3])
    savers = _savers(mode)
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    i = first
    while True:
        os.write(fd, f"start {i}\n".encode())
        savers[i % len(VARIANTS)](path)
        os.write(fd, f"done {i}\n".encode())
        i += 1


if __name__ == "__main__":
    main(sys.argv[1:])
