"""Checkpoint / resume of both trainers (``jaxattn.checkpoint`` with orbax, ``torchref.checkpoint`` with torch.save).

* SIGKILL: a CLI run (a subprocess, checkpoint every 5 steps) is killed with SIGKILL in the middle, then run
  again with ``--resume``: its per-step losses and grad norms are EXACTLY those of an uninterrupted run
  (design §7: same framework, deterministic, resume vs uninterrupted), and the log reads as one run.
* Every ``--optimizer``'s state through each writer: restored equal, leaf for leaf, the next update too (JAX's
  zero-size leaves, which orbax refuses to write, included).
* Crash safety of the writers: a write that dies before its commit leaves the previous checkpoints loadable
  and no new step visible; ``keep`` deletes only our own older checkpoints (a foreign file stays), and a dead
  process's temporary file is cleaned up; orbax ignores a half-written step directory.
"""

from __future__ import annotations

import copy
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from twincore.runlog import read_log

torch = pytest.importorskip("torch")
from jaxattn import train as jtrainer  # noqa: E402
from torchref import train as ttrainer  # noqa: E402
from torchref.checkpoint import Checkpointer as TorchCheckpointer  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS, EVERY, KILL_AFTER = 16, 5, 7
ARGS = [
    "--steps",
    str(STEPS),
    "--seq-len",
    "32",
    "--batch-size",
    "4",
    "--lr",
    "3e-3",
    "--warmup",
    "2",
    "--data",
    "README.md",
    "--no-progress",
    "--seed",
    "3",
]


def _lines(path) -> int:
    try:
        with open(path) as f:
            return sum(1 for line in f if line.strip())
    except FileNotFoundError:
        return 0


@pytest.mark.parametrize("module", ["jaxattn.train", "torchref.train"])
def test_sigkill_then_resume_equals_uninterrupted(tmp_path, module):
    ck, log = tmp_path / "ck", tmp_path / "log.jsonl"
    cmd = [
        sys.executable,
        "-m",
        module,
        *ARGS,
        "--checkpoint-dir",
        str(ck),
        "--checkpoint-every",
        str(EVERY),
        "--log-json",
        str(log),
    ]
    # the resumed run reuses the killed run's compiled step (jax's persistent cache; same HLO, same executable)
    env = {
        **os.environ,
        "JAX_SKIP_CUDA_CONSTRAINTS_CHECK": "1",
        "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "xla"),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
    }
    with open(tmp_path / "stderr.txt", "w") as err:
        p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=err)
        deadline = time.time() + 240
        while p.poll() is None and _lines(log) < KILL_AFTER and time.time() < deadline:
            time.sleep(0.005)
        os.kill(p.pid, signal.SIGKILL)
        p.wait()
    assert p.returncode == -signal.SIGKILL, (tmp_path / "stderr.txt").read_text()[-3000:]
    killed = read_log(log)
    assert KILL_AFTER <= len(killed) < STEPS

    resumed = subprocess.run(cmd + ["--resume"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    after = read_log(log)
    assert [r["step"] for r in after] == list(range(1, STEPS + 1))

    # the uninterrupted run, in this process (same flags, same 8-CPU-device XLA_FLAGS as the subprocesses)
    trainer = jtrainer if module.startswith("jax") else ttrainer
    extra = ["--num-workers", "0"] if trainer is ttrainer else []
    reference = trainer.run(ARGS + extra + ["--log-json", str(tmp_path / "ref.jsonl")])
    ref = read_log(tmp_path / "ref.jsonl")
    assert [r["loss"] for r in after] == reference["losses"]
    assert [r["grad_norm"] for r in after] == [r["grad_norm"] for r in ref]
    assert [r["lr"] for r in after] == [r["lr"] for r in ref]  # the schedule's position resumed too (warmup 2)
    assert [r["loss"] for r in killed] == reference["losses"][: len(killed)]


def test_torch_writer_crash_keeps_previous_checkpoint(tmp_path, monkeypatch):
    ck = TorchCheckpointer(str(tmp_path), keep=2)
    ck.save(1, {"w": torch.arange(3)})
    ck.save(2, {"w": torch.arange(3) * 2})
    (tmp_path / "notes.txt").write_text("not ours")

    def dies_mid_write(obj, f):
        f.write(b"partial bytes")
        raise KeyboardInterrupt  # stands for the kill: nothing after this line runs

    monkeypatch.setattr(torch, "save", dies_mid_write)
    with pytest.raises(KeyboardInterrupt):
        ck.save(3, {"w": torch.zeros(3)})
    monkeypatch.undo()
    assert ck.all_steps() == [1, 2]
    assert ck.load(2)["w"].tolist() == [0, 2, 4]
    # a temp file left by a process that no longer runs (a real SIGKILL skips the cleanup above)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f".torchref-step-00000003.pt.tmp-{dead.pid}-abcd"
    stale.write_bytes(b"half")
    ck.save(3, {"w": torch.ones(3)})
    ck.save(4, {"w": torch.ones(3)})
    assert ck.all_steps() == [3, 4]
    listing = [
        ".train-run.lock",
        "notes.txt",
        "torchref-step-00000003.pt",
        "torchref-step-00000004.pt",
        "train-run.json",
    ]
    assert sorted(os.listdir(tmp_path)) == listing


def test_orbax_ignores_a_half_written_step_and_keeps_foreign_files(tmp_path):
    import jax.numpy as jnp

    from jaxattn.checkpoint import Checkpointer

    ck = Checkpointer(str(tmp_path), keep=2)
    tree = {"w": jnp.arange(4.0)}
    for step in (1, 2, 3):
        ck.save(step, {"w": tree["w"] * step}, {"step": step})
    (tmp_path / "notes.txt").write_text("not ours")
    half = tmp_path / "step_4.orbax-checkpoint-tmp-1234"  # what a kill during orbax's write leaves
    half.mkdir()
    (half / "junk").write_bytes(b"half")
    ck.close()
    ck = Checkpointer(str(tmp_path), keep=2, resume=True)
    assert ck.all_steps() == [2, 3] and ck.latest_step() == 3
    restored, meta = ck.restore(3, tree)
    np.testing.assert_array_equal(restored["w"], np.arange(4.0) * 3)
    assert meta == {"step": 3}
    assert (tmp_path / "notes.txt").read_text() == "not ours"
    ck.close()


@pytest.mark.parametrize("name", ["adamw", "adamw_fused", "adafactor", "adamw8bit"])
def test_every_optimizer_state_saves_and_restores_exactly(name, tmp_path, seed):
    """One update of each optimizer on the tiny model (random gradients), through each framework's checkpointer and
    back: every leaf equal (shape, dtype, values), and the next update from the restored state equals the one from
    the live state. The JAX states of ``adamw8bit`` (absmax of a small param) and ``adafactor`` (the unused moment
    of each param) hold zero-size arrays, which orbax refuses to write; the checkpointer leaves them out and
    ``like`` gives them back."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jaxattn import optim as jopt
    from jaxattn.checkpoint import Checkpointer
    from jaxattn.config import ModelConfig
    from jaxattn.model import Llama
    from torchref import optim as topt
    from torchref.model import LlamaForCausalLM

    assert set(jopt.OPTIMIZER_NAMES) == {"adamw", "adamw_fused", "adafactor", "adamw8bit"}
    rng = np.random.default_rng(seed)
    params = nnx.state(Llama(ModelConfig.preset("tiny"), rngs=nnx.Rngs(0)), nnx.Param)
    draw = lambda: jax.tree.map(lambda p: jnp.asarray(rng.standard_normal(p.shape), p.dtype), params)  # noqa: E731
    tx = jopt.build(name, 1e-2)
    update = jax.jit(tx.update)
    _, opt_state = update(draw(), tx.init(params), params)
    tree = {"params": params, "opt": opt_state}
    if name in ("adafactor", "adamw8bit"):
        assert any(x.size == 0 for x in jax.tree.leaves(opt_state))  # what orbax cannot write is there
    ck = Checkpointer(str(tmp_path / "jax"), keep=1)
    ck.save(1, tree, {"step": 1})
    back, _ = ck.restore(1, tree)
    ck.close()
    assert jax.tree.structure(back) == jax.tree.structure(tree)
    for a, b in zip(jax.tree.leaves(tree), jax.tree.leaves(back)):
        assert (a.shape, a.dtype) == (b.shape, b.dtype)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    g = draw()
    live, restored = update(g, opt_state, params)[0], update(g, back["opt"], back["params"])[0]
    for a, b in zip(jax.tree.leaves(live), jax.tree.leaves(restored)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    model = LlamaForCausalLM(ModelConfig.preset("tiny"))
    opt, _ = topt.build(model, name, 1e-2)
    for p in model.parameters():
        p.grad = torch.from_numpy(rng.standard_normal(tuple(p.shape)).astype(np.float32))
    opt.step()
    tck = TorchCheckpointer(str(tmp_path / "torch"), keep=1)
    tck.save(1, {"optimizer": opt.state_dict(), "meta": {"step": 1}})
    state = tck.load(1)["optimizer"]
    tck.close()
    live = opt.state_dict()
    assert state["param_groups"] == live["param_groups"] and state["state"].keys() == live["state"].keys()
    for i, entry in live["state"].items():
        assert entry.keys() == state["state"][i].keys()
        for key, v in entry.items():
            w = state["state"][i][key]
            if not isinstance(v, torch.Tensor):
                assert w == v, (i, key)
                continue
            assert (tuple(v.shape), v.dtype) == (tuple(w.shape), w.dtype), (i, key)
            torch.testing.assert_close(w, v, rtol=0, atol=0)
    twin = copy.deepcopy(model)
    opt_twin, _ = topt.build(twin, name, 1e-2)
    opt_twin.load_state_dict(state)
    for p, q in zip(model.parameters(), twin.parameters()):
        p.grad = torch.from_numpy(rng.standard_normal(tuple(p.shape)).astype(np.float32))
        q.grad = p.grad.clone()
    opt.step()
    opt_twin.step()
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(q, p, rtol=0, atol=0)


def test_adamw8bit_flat_moments_resume_held_by_row(tmp_path, rng):
    """A JAX checkpoint whose 8-bit moments are flat ``[*lead, n_blocks, 256]`` (how they were held before rows
    that are a whole number of blocks kept their own) restores into the by-row layout, placed as ``like`` is:
    the same blocks, reshaped."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxattn import optim as jopt
    from jaxattn.checkpoint import Checkpointer

    params = {"layers.w": (2, 8, 512), "head": (16, 256), "small": (300, 100)}
    params = {k: jnp.asarray(rng.standard_normal(s), jnp.float32) for k, s in params.items()}
    tx = jopt.build("adamw8bit", 1e-2)
    _, state = tx.update(jax.tree.map(lambda p: p * 0.5, params), tx.init(params), params)
    adam = state[0]
    assert adam.mu["layers.w"].shape == (2, 8, 2, 256) and adam.mu["head"].shape == (16, 1, 256)
    assert adam.mu["small"].shape == (118, 256)  # 100 is not a whole number of blocks: flat, as before
    lead = {"layers.w": 1, "head": 0, "small": 0}

    def flat(tree, codes):
        return {k: x.reshape(*x.shape[: lead[k]], -1, *x.shape[x.ndim - 1 :] if codes else ()) for k, x in tree.items()}

    old = adam._replace(**{f: flat(getattr(adam, f), not f.endswith("absmax")) for f in adam._fields[1:]})
    assert old.mu["layers.w"].shape == (2, 16, 256) and old.nu_absmax["head"].shape == (16,)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]), ("x",))
    placed = NamedSharding(mesh, P(None, "x"))
    like = adam._replace(mu={**adam.mu, "layers.w": jax.device_put(adam.mu["layers.w"], placed)})
    ck = Checkpointer(str(tmp_path / "jax"), keep=1)
    ck.save(1, {"opt": old}, {"step": 1})
    back, _ = ck.restore(1, {"opt": like})
    ck.close()
    for a, b in zip(jax.tree.leaves(like), jax.tree.leaves(back["opt"])):
        assert (a.shape, a.dtype) == (b.shape, b.dtype)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert back["opt"].mu["layers.w"].sharding == placed
