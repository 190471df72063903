"""Child of ``parity_tests/test_sharding.py``'s multi-process test: ``python jax_multiprocess_child.py PORT PID
NPROC OUT``. NPROC processes x (8 / NPROC) CPU devices train the tiny model 3 steps on the mesh
data=2,fsdp=2,tensor=2 (``jaxattn.sharding``); process 0 writes the losses to OUT (JSON)."""

import json
import os
import sys

import jaxattn  # noqa: F401 - before jax (it starts no jax): jaxattn.cuda_quiet's quiet start, no TPU client without a chip

port, pid, nproc, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={8 // nproc}"  # before jax starts

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from jaxattn import sharding  # noqa: E402

if nproc > 1:
    sharding.initialize_distributed(f"127.0.0.1:{port}", nproc, pid)
jax.config.update("jax_default_matmul_precision", "highest")

from jaxattn.config import ModelConfig  # noqa: E402
from jaxattn.model import Llama  # noqa: E402
from jaxattn.train_step import TrainState, make_train_step  # noqa: E402

cfg = ModelConfig.preset("tiny", n_kv_heads=4)
tx = optax.adamw(1e-3)
graphdef, state = TrainState.create(Llama(cfg, rngs=nnx.Rngs(0)), tx)
mesh = sharding.make_mesh("data=2,fsdp=2,tensor=2")
tx, state, sh = sharding.shard_train_state(graphdef, tx, state, mesh, batch_size=8)
step = make_train_step(graphdef, tx, sharding=sh)
rng = np.random.default_rng(0)
losses = []
for _ in range(3):
    state, m = step(state, {"tokens": rng.integers(0, cfg.vocab_size, (8, 17)).astype(np.int32)})
    losses.append(float(m["loss"]))
if pid == 0:
    with open(out, "w") as f:
        json.dump(
            {
                "losses": losses,
                "devices": jax.device_count(),
                "local": jax.local_device_count(),
                "processes": jax.process_count(),
            },
            f,
        )
