"""``jaxattn.sharding`` on the 8 CPU devices: every mesh gives the single-device step, parameters really sharded.

Parameters are compared after SGD with momentum (linear in the gradient, and its momentum buffer is optimizer
state sharded like its parameter): a sharded step sums the same products in another order, so gradients differ
by float rounding (~1e-8 here) and SGD keeps that difference at that size. Adam is NOT used for the 1e-5
parameter check: its first update is ``lr * g / (|g| + eps)``, so a gradient entry within rounding of zero can
flip sign between the two reduction orders and move a weight by up to ``2 * lr`` (measured: 5e-5 at lr 1e-3).
The AdamW run (the CLI's default) checks losses within 1e-5 and that ``mu``/``nu`` are sharded like the params.
The tensor=4 meshes use ``ModelConfig.preset("tiny", n_kv_heads=4)``: tiny's 2 KV heads do not divide by 4.
"""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxattn import sharding
from jaxattn.config import ModelConfig
from jaxattn.model import Llama
from jaxattn.train_step import TrainState, make_train_step

CFG = ModelConfig.preset("tiny", n_kv_heads=4)  # 4 heads / 4 kv heads / ffn 160 / vocab 256 / dim 64
BATCH, SEQ, STEPS = 8, 16, 3
MESHES = {"8,1,1": "data=8", "2,4,1": "data=2,fsdp=4", "2,2,2": "data=2,fsdp=2,tensor=2", "1,2,4": "fsdp=2,tensor=4"}


def _tx():
    return optax.sgd(0.5, momentum=0.9)


def _sharded(graphdef, tx, state, mesh, *, batch_size, **kw):
    """``(step, state)`` laid out on ``mesh``: ``shard_train_state`` hands its sharding to ``make_train_step``."""
    tx, state, sh = sharding.shard_train_state(
        graphdef, tx, state, mesh, batch_size=batch_size, offload_optimizer=kw.pop("offload_optimizer", False)
    )
    return make_train_step(graphdef, tx, sharding=sh, **kw), state


def _batches():
    rng = np.random.default_rng(0)
    return [{"tokens": rng.integers(0, CFG.vocab_size, (BATCH, SEQ + 1)).astype(np.int32)} for _ in range(STEPS)]


def _run(step, state):
    losses = []
    for b in _batches():
        state, m = step(state, b)
        losses.append(float(m["loss"]))
    return losses, state


@pytest.fixture(scope="module")
def reference():
    graphdef, state = TrainState.create(Llama(CFG, rngs=nnx.Rngs(0)), _tx())
    state = jax.device_put(state, jax.devices()[0])
    return _run(make_train_step(graphdef, _tx()), state)


def _meshes(*slow):
    """MESHES as parameters, those named in ``slow`` moved to CI's ``slow_feature`` run (their axes are covered by the
    default's 2,2,2 and 8,1,1: rows per device, fsdp and tensor at once)."""
    return [pytest.param(n, marks=(pytest.mark.slow, pytest.mark.slow_feature)) if n in slow else n for n in MESHES]


@pytest.mark.parametrize("name", _meshes("2,4,1"))
def test_mesh_gives_single_device_losses_and_params(name, reference):
    ref_losses, ref_state = reference
    mesh = sharding.make_mesh(MESHES[name])
    graphdef, state = TrainState.create(Llama(CFG, rngs=nnx.Rngs(0)), _tx())
    step, state = _sharded(graphdef, _tx(), state, mesh, batch_size=BATCH)
    losses, state = _run(step, state)
    np.testing.assert_allclose(losses, ref_losses, rtol=0, atol=1e-5)
    for (path, a), b in zip(jax.tree.leaves_with_path(ref_state.params), jax.tree.leaves(state.params)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=0, atol=1e-5, err_msg=jax.tree_util.keystr(path))
    assert step.jitted._cache_size() == 1
    d, f, t = (int(x) for x in name.split(","))
    p = state.params

    def spec(x):
        return x[...].sharding.spec

    fs, ts = ("fsdp" if f > 1 else None), ("tensor" if t > 1 else None)
    # jax drops size-1 mesh axes from nothing: the spec is what the rules say; check the real shard shapes too
    zero = ("fsdp", "expert")  # embed: ZeRO-3 over fsdp and the expert-parallel devices
    assert spec(p["layers"]["wq"]) == P(None, zero, "tensor")  # column-parallel, FSDP on embed, layers whole
    assert spec(p["layers"]["wo"]) == P(None, "tensor", zero)  # row-parallel
    assert spec(p["layers"]["w_down"]) == P(None, "tensor", zero)
    assert spec(p["embed"]) == P("tensor", zero) and spec(p["lm_head"]) == P(zero, "tensor")  # vocab-split
    shard = p["layers"]["w_up"][...].addressable_shards[0].data.shape
    assert shard == (CFG.n_layers, CFG.dim // f, CFG.ffn_dim // t), (shard, fs, ts)
    momentum = state.opt_state[0].trace  # ZeRO-3: optimizer state sharded like its parameter
    assert momentum["layers"]["w_up"][...].addressable_shards[0].data.shape == shard
    assert state.step.sharding.is_fully_replicated


def test_adamw_cli_mesh_matches_single_device(tmp_path):
    """The JAX CLI with ``--mesh data=2,fsdp=2,tensor=2`` (AdamW, the default optimizer) gives the one-device
    losses within 1e-5, with the Adam moments sharded like the parameters."""
    from jaxattn import train as trainer

    argv = ["--preset", "tiny", "--steps", "2", "--seq-len", "16", "--batch-size", "4", "--no-progress", "--lr", "1e-3"]
    single = trainer.run(argv)["losses"]
    r = trainer.Trainer.from_argv(argv + ["--mesh", "data=2,fsdp=2,tensor=2"])
    assert r.state.opt_state[0].mu["layers"]["wq"][...].sharding.spec == P(None, ("fsdp", "expert"), "tensor")
    assert r.state.opt_state[0].nu["embed"][...].sharding.spec == P("tensor", ("fsdp", "expert"))
    out = r.fit()
    np.testing.assert_allclose(out["losses"], single, rtol=0, atol=1e-5)
    assert out["compiles"] == 1


def test_activation_constraints_applied_under_mesh_only():
    """The model's ``constrain`` seam: the sharded step's lowered program constrains the hidden states to rows on
    (data, fsdp) with ``embed`` whole, the float32 logits to (data, fsdp) x vocab on tensor and the embedding
    table to vocab on tensor (embed whole); the plain step
    (and the model outside ``activation_sharding``) has no constraint at all."""
    import re

    from jaxattn.model import constrain

    tokens = {"tokens": np.zeros((BATCH, SEQ + 1), np.int32)}
    graphdef, state = TrainState.create(Llama(CFG, rngs=nnx.Rngs(0)), _tx())
    plain = make_train_step(graphdef, _tx()).lower(state, tokens).as_text()
    assert not re.search(r"sharding_constraint|@Sharding", plain)
    x = jax.numpy.ones((BATCH, SEQ, CFG.dim))
    assert constrain(x, ("batch", "seq", "embed")) is x
    step, state = _sharded(graphdef, _tx(), state, sharding.make_mesh("data=2,fsdp=2,tensor=2"), batch_size=BATCH)
    text = step.lower(state, tokens).as_text()
    lines = [ln for ln in text.splitlines() if re.search(r"sharding_constraint|@Sharding", ln)]
    logits = f"tensor<{BATCH}x{SEQ}x{CFG.vocab_size}xf32>"
    hidden = f"tensor<{BATCH}x{SEQ}x{CFG.dim}xf32>"
    rows = '{"data", "fsdp", "expert"}'  # the batch's axes (expert parallelism splits the tokens too)
    assert any(logits in ln and f'[{rows}, {{}}, {{"tensor"}}]' in ln for ln in lines), lines
    assert any(hidden in ln and f"[{rows}, {{}}, {{}}]" in ln for ln in lines), lines
    # the embedding table is gathered over fsdp before the lookup (vocab stays on tensor): without it XLA's
    # partitioner falls back to replicating the lookup's gradient ("Involuntary full rematerialization")
    table = f"tensor<{CFG.vocab_size}x{CFG.dim}xf32>"
    assert any(table in ln and '[{"tensor"}, {}]' in ln for ln in lines), lines
    assert constrain(x, ("batch", "seq", "embed")) is x  # the context is gone after the step


@pytest.mark.parametrize("name", _meshes("2,4,1", "1,2,4"))
def test_fused_loss_per_device_rows_equals_single_device_dense(name, reference, monkeypatch):
    """``loss="fused"`` on a mesh: each device's fused loss sees only its own rows (``per_shard``: the head gathered
    once and its gradient reduced once, not per chunk) and the losses and parameters equal the single-device dense
    step's."""
    import jaxattn.train_step as ts

    seen = []
    real = ts.fused_cross_entropy

    def spy(hidden, head, *args, **kw):
        seen.append((hidden.shape, head.shape))
        return real(hidden, head, *args, **kw)

    monkeypatch.setattr(ts, "fused_cross_entropy", spy)
    mesh = sharding.make_mesh(MESHES[name])
    rows = BATCH // (mesh.shape["data"] * mesh.shape["fsdp"])
    graphdef, state = TrainState.create(Llama(CFG, rngs=nnx.Rngs(0)), _tx())
    step, state = _sharded(graphdef, _tx(), state, mesh, batch_size=BATCH, loss="fused", loss_chunk=5)
    losses, state = _run(step, state)
    assert set(seen) == {((rows * SEQ, CFG.dim), (CFG.dim, CFG.vocab_size))}, seen  # rows per device, whole head
    np.testing.assert_allclose(losses, reference[0], rtol=0, atol=1e-5)
    for (path, a), b in zip(jax.tree.leaves_with_path(reference[1].params), jax.tree.leaves(state.params)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=0, atol=1e-5, err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize(  # 2,2,2 splits rows and heads at once; 1,2,4 (heads over 4) in CI's slow_feature
    "name", ["2,2,2", pytest.param("1,2,4", marks=(pytest.mark.slow, pytest.mark.slow_feature))]
)
def test_attention_runs_per_device_block_under_mesh(name, reference, monkeypatch):
    """Attention goes through ``shard_map`` (``jaxattn.model.per_shard``): each device's kernel sees its own rows
    (batch / (data*fsdp)) and heads (heads / tensor), never the gathered batch, so a Pallas kernel XLA cannot
    partition is not replicated. With the ``flash`` Pallas kernel (interpreted on CPU) the sharded losses equal
    the single-device XLA-attention losses of ``reference``."""
    import jaxattn.model as jm
    from jaxattn.attention import attention_backend

    seen = []

    def spy(q, k, v, segment_ids, window=None):
        seen.append((q.shape, k.shape))
        return jm.dot_product_attention(q, k, v, causal=True, segment_ids=segment_ids, window=window)

    monkeypatch.setattr(jm, "_self_attention", spy)
    mesh = sharding.make_mesh(MESHES[name])
    rows = BATCH // (mesh.shape["data"] * mesh.shape["fsdp"])
    t = mesh.shape["tensor"]
    graphdef, state = TrainState.create(Llama(CFG, rngs=nnx.Rngs(0)), _tx())
    step, state = _sharded(graphdef, _tx(), state, mesh, batch_size=BATCH)
    with attention_backend("flash"):
        losses, _ = _run(step, state)
    d = CFG.resolved_head_dim
    assert seen and set(seen) == {((rows, SEQ, CFG.n_heads // t, d), (rows, SEQ, CFG.n_kv_heads // t, d))}, seen
    np.testing.assert_allclose(losses, reference[0], rtol=0, atol=1e-5)
    seen.clear()
    x = jax.numpy.ones((2, SEQ, CFG.n_heads, d))
    assert jm.per_shard(lambda a: a + 1, (x,), (jm.Q_AXES,), jm.Q_AXES).shape == x.shape


def test_per_shard_map_drops_an_axis_that_does_not_divide():
    """q heads (4) split on tensor=4 but kv heads (2) cannot: the tensor axis is dropped for BOTH (GQA's groups
    stay whole) and the result still equals the unsharded call; rows still split over (data, fsdp)."""
    import jaxattn.model as jm
    from jaxattn.attention import dot_product_attention

    mesh = sharding.make_mesh("fsdp=2,tensor=4")
    rng = np.random.default_rng(1)
    q = rng.standard_normal((4, 8, 4, 16)).astype(np.float32)
    k, v = (rng.standard_normal((4, 8, 2, 16)).astype(np.float32) for _ in range(2))
    shapes = []

    def fn(q, k, v, seg):
        shapes.append((q.shape, k.shape, seg))
        return dot_product_attention(q, k, v, causal=True)

    out = jax.jit(
        lambda q, k, v: sharding.per_shard_map(
            fn, (q, k, v, None), (jm.Q_AXES, jm.KV_AXES, jm.KV_AXES, jm.SEGMENT_AXES), jm.Q_AXES, mesh
        )
    )(q, k, v)
    assert shapes == [((2, 8, 4, 16), (2, 8, 2, 16), None)]
    np.testing.assert_allclose(out, dot_product_attention(q, k, v, causal=True), rtol=0, atol=1e-6)


BAD_MESH = [
    (
        "data=4",
        r"stage\*data\*fsdp\*expert\*tensor = 4 but there are 8 devices; .* \(on a CPU, simulate 4 devices with "
        r"XLA_FLAGS=--xla_force_host_platform_device_count=4 set before jax starts\)",
    ),
    ("data=2,pipe=4", r"unknown axis 'pipe'; the axes are \('stage', 'data', 'fsdp', 'expert', 'tensor'\)"),
    ("data=2,data=4", r"expected comma-separated, non-repeated AXIS=N"),
    ("data=0,fsdp=8", r"axis 'data' has size 0"),
    ("data", r"expected comma-separated, non-repeated AXIS=N"),
]


@pytest.mark.parametrize("spec,message", BAD_MESH, ids=[b[0] for b in BAD_MESH])
def test_bad_mesh_spec(spec, message):
    with pytest.raises(ValueError, match=message):
        sharding.make_mesh(spec)


def test_mesh_falls_back_to_split_physical_axes_when_make_mesh_cannot_place_an_axis(monkeypatch):
    """jax.make_mesh refuses a mesh axis no physical axis of a TPU torus can hold (NotImplementedError: data=8 on a
    4x4x4 v5p; test_tpu_compile.py checks the real one); make_mesh then builds it with physical axes split. Here
    the refusal is simulated on the 8 CPU devices."""

    def refuse(*a, **k):
        raise NotImplementedError("Failed to find assignment for logical_axis_index 1 of size 8")

    monkeypatch.setattr(jax, "make_mesh", refuse)
    mesh = sharding.make_mesh("data=2,fsdp=4")
    assert dict(mesh.shape) == {"stage": 1, "data": 2, "fsdp": 4, "expert": 1, "tensor": 1}
    assert sorted(d.id for d in mesh.devices.flat) == sorted(d.id for d in jax.devices())


BAD_CONFIG = [
    ("tensor=8", dict(), r"ModelConfig.n_heads=4 is not divisible by the mesh axis tensor=8"),
    ("data=2,tensor=4", dict(), r"ModelConfig.n_kv_heads=2 is not divisible by the mesh axis tensor=4"),
    ("data=4,tensor=2", dict(ffn_dim=161), r"ModelConfig.ffn_dim=161 is not divisible by the mesh axis tensor=2"),
    ("data=4,tensor=2", dict(vocab_size=255), r"ModelConfig.vocab_size=255 is not divisible by .* tensor=2"),
    ("fsdp=8", dict(dim=52, n_heads=2), r"ModelConfig.dim=52 is not divisible by the mesh axis fsdp=8"),
    ("fsdp=2,expert=4", dict(dim=52, n_heads=2), r"ModelConfig.dim=52 is not divisible by .* fsdp\*expert=8"),
]


@pytest.mark.parametrize("spec,overrides,message", BAD_CONFIG, ids=[b[2][12:26] for b in BAD_CONFIG])
def test_bad_config_for_mesh(spec, overrides, message):
    with pytest.raises(ValueError, match=message):
        sharding.check_config(ModelConfig.preset("tiny", **overrides), sharding.make_mesh(spec))


def test_bad_batch_raises_before_any_compile():
    mesh = sharding.make_mesh("data=2,fsdp=2,tensor=2")
    graphdef, state = TrainState.create(Llama(ModelConfig.preset("tiny"), rngs=nnx.Rngs(0)), _tx())
    with pytest.raises(ValueError, match=r"batch_size=6 .* not divisible by the data axes data\*fsdp\*expert=4"):
        _sharded(graphdef, _tx(), state, mesh, batch_size=6)
    with pytest.raises(ValueError, match=r"ModelConfig.n_kv_heads=2 is not divisible by the mesh axis tensor=4"):
        _sharded(graphdef, _tx(), state, sharding.make_mesh("data=2,tensor=4"), batch_size=8)
    step, state = _sharded(graphdef, _tx(), state, mesh, batch_size=8)
    with pytest.raises(ValueError, match=r"batch_size=2 .* not divisible by the data axes data\*fsdp\*expert=4"):
        step(state, {"tokens": np.zeros((2, 9), np.int32) + 1})
    assert step.jitted._cache_size() == 0


def test_cli_mesh_errors_before_any_compile():
    from jaxattn import train as trainer
    from twincore.cli import CLIError

    with pytest.raises(
        CLIError, match=r"--mesh 'data=2,fsdp=2': stage\*data\*fsdp\*expert\*tensor = 4 but there are 8 devices"
    ):
        trainer.Trainer.from_argv(["--mesh", "data=2,fsdp=2", "--steps", "1"])
    with pytest.raises(CLIError, match=r"--mesh 'data=8': batch_size=4 .* data\*fsdp\*expert=8"):
        trainer.Trainer.from_argv(["--mesh", "data=8", "--batch-size", "4", "--steps", "1"])
    with pytest.raises(CLIError, match=r"--mesh 'tensor=8': ModelConfig.n_heads=4 is not divisible"):
        trainer.Trainer.from_argv(["--mesh", "tensor=8", "--steps", "1"])


@pytest.mark.slow
def test_two_processes_of_four_devices_match_one_of_eight(tmp_path):
    """``jax.distributed`` (gloo CPU collectives, ``sharding.initialize_distributed``): 2 processes x 4 CPU devices
    on the mesh data=2,fsdp=2,tensor=2 give this process's 8-device losses within 1e-5 (AdamW, 3 steps;
    ``parity_tests/jax_multiprocess_child.py``; each process builds the same global batch, ``global_batch``)."""
    import json
    import os
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    child = os.path.join(os.path.dirname(os.path.abspath(__file__)), "jax_multiprocess_child.py")
    out = tmp_path / "out.json"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    procs = [
        subprocess.Popen(
            [sys.executable, child, port, str(pid), "2", str(out)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for pid in (0, 1)
    ]
    tx = optax.adamw(1e-3)  # the same run in this process, 8 devices
    graphdef, state = TrainState.create(Llama(CFG, rngs=nnx.Rngs(0)), tx)
    step, state = _sharded(graphdef, tx, state, sharding.make_mesh("data=2,fsdp=2,tensor=2"), batch_size=8)
    rng, ref = np.random.default_rng(0), []
    for _ in range(3):
        state, m = step(state, {"tokens": rng.integers(0, CFG.vocab_size, (8, 17)).astype(np.int32)})
        ref.append(float(m["loss"]))
    logs = [p.communicate(timeout=240)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(log[-3000:] for log in logs)
    got = json.loads(out.read_text())
    assert (got["processes"], got["devices"], got["local"]) == (2, 8, 4)
    np.testing.assert_allclose(got["losses"], ref, rtol=0, atol=1e-5)


def _launch(runs):
    """Start ``python -m jaxattn.train`` once per ``(argv, extra_env)`` in ``runs``, all at once, 4 CPU devices
    each; returns their ``(returncode, output)`` in order."""
    import os
    import subprocess
    import sys

    base = {
        **{
            k: v
            for k, v in os.environ.items()
            if k not in ("XLA_FLAGS", "JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")
        },
        "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
    }
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "jaxattn.train", *argv],
            env={**base, **env},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for argv, env in runs
    ]
    return [(p.wait(timeout=300), p.stdout.read()) for p in procs]


def _trainer_flags(seed: int) -> list[str]:
    """8 rows of 16 tokens, a constant lr (the same lr whatever --steps says), no progress lines."""
    return f"--batch-size 8 --seq-len 16 --no-progress --seed {seed} --lr 1e-3 --schedule constant".split()


def _process_flags(port: str, i: int) -> list[str]:
    """Process ``i`` of 2, whose coordinator is at 127.0.0.1:``port``."""
    return ["--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(i)]


def _port() -> str:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def _two_process_cli(tmp_path, resume: bool, mesh: str = "data=2,fsdp=2,tensor=2", extra: tuple = ()):
    """2 processes x 4 CPU devices (gloo) train 3 steps through the CLI; with ``resume``, 2 steps with an orbax
    checkpoint per step first, then ``--resume`` to step 3 configured by the ``JAX_*`` variables instead of the
    flags. Compared with one in-process run on 8 devices: losses within 1e-5; only process 0 writes the log and the
    Hugging Face export, whose weights equal the 8-device run's within AdamW's rounding bound
    (``twins.assert_exports_agree``). ``mesh`` / ``extra``: another mesh and flags for both runs."""
    import json

    from jaxattn import train as trainer
    from parity_tests.twins import assert_exports_agree

    common = [*extra, "--mesh", mesh, *_trainer_flags(seed=3)]
    mp = common + ["--checkpoint-dir", str(tmp_path / "ck"), "--checkpoint-every", "1"]
    port = _port()
    first = _launch(
        [
            (
                [*mp, "--steps", "2" if resume else "3", "--log-json", str(tmp_path / f"log{i}.jsonl")]
                + _process_flags(port, i),
                {},
            )
            for i in (0, 1)
        ]
    )
    assert all(rc == 0 for rc, _ in first), "\n".join(out[-3000:] for _, out in first)
    if resume:
        env = {"JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{_port()}", "JAX_NUM_PROCESSES": "2"}
        second = _launch(
            [
                (
                    mp + ["--steps", "3", "--resume", "--log-json", str(tmp_path / f"log{i}.jsonl")],
                    {**env, "JAX_PROCESS_ID": str(i)},
                )
                for i in (0, 1)
            ]
        )
        assert all(rc == 0 for rc, _ in second), "\n".join(out[-3000:] for _, out in second)
    ref = trainer.run(common + ["--steps", "3", "--checkpoint-dir", str(tmp_path / "ref")])
    logs = [json.loads(line) for line in (tmp_path / "log0.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logs] == [1, 2, 3]
    assert not (tmp_path / "log1.jsonl").exists()  # only process 0 logs
    np.testing.assert_allclose([r["loss"] for r in logs], ref["losses"], rtol=0, atol=1e-5)
    assert_exports_agree(tmp_path / "ck" / "final", tmp_path / "ref" / "final", lr=1e-3, steps=3)


@pytest.mark.slow  # 21 s; the default run keeps test_two_processes_of_four_devices_match_one_of_eight
@pytest.mark.slow_feature
def test_cli_two_processes_train_and_export_like_one_of_eight(tmp_path):
    _two_process_cli(tmp_path, resume=False)


@pytest.mark.slow
@pytest.mark.slow_feature
def test_cli_two_processes_resume_like_one_of_eight(tmp_path):
    _two_process_cli(tmp_path, resume=True)


@pytest.mark.slow
@pytest.mark.slow_feature
def test_cli_processes_that_disagree_on_the_mesh_fail_before_compiling():
    """Two processes started with different ``--mesh`` (same device count) both exit 2 with a message naming
    ``--mesh``, before the train step compiles."""
    port = _port()
    meshes = ("data=2,fsdp=2,tensor=2", "data=4,fsdp=2")
    runs = _launch(
        [(["--mesh", m, "--steps", "1", "--no-progress", *_process_flags(port, i)], {}) for i, m in enumerate(meshes)]
    )
    for rc, out in runs:
        assert rc == 2 and "processes disagree on --mesh" in out, out[-3000:]


@pytest.mark.slow  # 9 s; CI runs it with the slow_feature set
@pytest.mark.slow_feature
def test_checkpoint_of_one_mesh_resumes_on_another(tmp_path):
    """orbax restores a ``--mesh data=2,fsdp=2,tensor=2`` checkpoint onto ``--mesh fsdp=8`` (the restore target is
    the new run's sharded state) and onto one device; both continue the uninterrupted run's losses within 1e-5."""
    from jaxattn import train as trainer

    flags = _trainer_flags(seed=5)
    ref = trainer.run(flags + ["--steps", "3"])["losses"]
    ck = str(tmp_path / "ck")
    first = trainer.run(
        flags + ["--mesh", "data=2,fsdp=2,tensor=2", "--steps", "2", "--checkpoint-dir", ck, "--keep-checkpoints", "5"]
    )
    np.testing.assert_allclose(first["losses"], ref[:2], rtol=0, atol=1e-5)
    import shutil

    shutil.copytree(ck, tmp_path / "ck1", ignore=shutil.ignore_patterns("final"))
    resumed = trainer.run(flags + ["--mesh", "fsdp=8", "--steps", "3", "--resume", "--checkpoint-dir", ck])
    single = trainer.run(flags + ["--steps", "3", "--resume", "--checkpoint-dir", str(tmp_path / "ck1")])
    assert resumed["start"] == single["start"] == 2
    np.testing.assert_allclose(resumed["losses"], ref[2:], rtol=0, atol=1e-5)
    np.testing.assert_allclose(single["losses"], ref[2:], rtol=0, atol=1e-5)


def test_optimizer_state_offloaded_to_pinned_host(reference):
    """``offload_optimizer=True``: the optimizer moments live in ``pinned_host`` memory between steps (and stay
    sharded like their parameters), the parameters in device memory, and the losses are the single-device ones."""
    mesh = sharding.make_mesh("data=2,fsdp=2,tensor=2")
    graphdef, state = TrainState.create(Llama(CFG, rngs=nnx.Rngs(0)), _tx())
    step, state = _sharded(graphdef, _tx(), state, mesh, batch_size=BATCH, offload_optimizer=True)
    losses, state = _run(step, state)
    np.testing.assert_allclose(losses, reference[0], rtol=0, atol=1e-5)
    moments = [x for x in jax.tree.leaves(state.opt_state) if getattr(x, "ndim", 0) >= 2]
    assert moments and {x.sharding.memory_kind for x in moments} == {"pinned_host"}
    assert {x.sharding.memory_kind for x in jax.tree.leaves(state.params)} == {"device"}
    assert moments[0].sharding.spec != P()  # still sharded like its parameter


def test_optimizer_offload_refused_without_pinned_host(monkeypatch):
    import jaxattn.remat as remat

    monkeypatch.setattr(remat, "offload_unavailable_reason", lambda d=None: f"{d} has memory spaces ['device']")
    graphdef, state = TrainState.create(Llama(CFG, rngs=nnx.Rngs(0)), _tx())
    with pytest.raises(ValueError, match=r"offload_optimizer=True cannot be served on this backend: .* \['device'\]"):
        _sharded(graphdef, _tx(), state, sharding.make_mesh("data=8"), batch_size=BATCH, offload_optimizer=True)


def test_cli_offload_optimizer_trains_like_device_state():
    """``python -m jaxattn.train --mesh data=N --offload-optimizer``: the optimizer moments are placed in
    ``pinned_host`` memory and the run logs the losses of the run without the flag."""
    import jax as _jax

    from jaxattn import train as trainer

    flags = ["--batch-size", "8", "--seq-len", "16", "--no-progress", "--steps", "2"]
    mesh = f"data={_jax.device_count()}"
    plain = trainer.run(flags + ["--mesh", mesh])["losses"]
    r = trainer.Trainer.from_argv(flags + ["--mesh", mesh, "--offload-optimizer"])
    assert {x.sharding.memory_kind for x in _jax.tree.leaves(r.state.opt_state) if x.ndim >= 2} == {"pinned_host"}
    np.testing.assert_allclose(r.fit()["losses"], plain, rtol=0, atol=1e-6)


# Every row a whole number of 256-element blocks per device on data=2,fsdp=2,tensor=2 (dim 512 and vocab 512 split
# in two, 128-wide heads): 8-bit AdamW's moments held by row
CFG8 = ModelConfig.preset("tiny", dim=512, ffn_dim=1024, vocab_size=512, n_kv_heads=4)


def _slices(index, shape):
    return [sl.indices(n)[:2] for sl, n in zip(index, shape)]


def test_adamw8bit_moments_split_as_their_params():
    """8-bit AdamW on ``data=2,fsdp=2,tensor=2`` gives the one-device losses, and each device holds the 8-bit blocks
    (and absmaxes) of exactly the elements it holds of their parameter: its update reads and writes its own memory
    only (the plan suite's compiled steps: no collective beyond AdamW's)."""
    from jaxattn import optim

    def tx():
        return optim.build("adamw8bit", 1e-3)

    rng = np.random.default_rng(0)
    batches = [{"tokens": rng.integers(0, CFG8.vocab_size, (BATCH, SEQ + 1)).astype(np.int32)} for _ in range(2)]

    def run(step, state):
        losses = []
        for b in batches:
            state, m = step(state, b)
            losses.append(float(m["loss"]))
        return losses, state

    graphdef, state = TrainState.create(Llama(CFG8, rngs=nnx.Rngs(0)), tx())
    single, _ = run(make_train_step(graphdef, tx()), jax.device_put(state, jax.devices()[0]))
    graphdef, state = TrainState.create(Llama(CFG8, rngs=nnx.Rngs(0)), tx())
    losses, state = run(
        *_sharded(graphdef, tx(), state, sharding.make_mesh("data=2,fsdp=2,tensor=2"), batch_size=BATCH)
    )
    np.testing.assert_allclose(losses, single, rtol=0, atol=1e-5)
    adam = state.opt_state[0]
    checked = 0
    for p, codes, absmax in zip(*(jax.tree.leaves(t) for t in (state.params, adam.nu, adam.nu_absmax))):
        if codes.dtype != np.uint8:
            continue
        assert codes.shape == (*p.shape[:-1], p.shape[-1] // 256, 256) and absmax.shape == codes.shape[:-1]
        own = {s.device: _slices(s.index, p.shape) for s in p.addressable_shards}
        for c, a in zip(codes.addressable_shards, absmax.addressable_shards):
            rows, (lo, hi) = own[c.device][:-1], own[c.device][-1]
            assert _slices(c.index, codes.shape) == [*rows, (lo // 256, hi // 256), (0, 256)]
            assert _slices(a.index, absmax.shape) == [*rows, (lo // 256, hi // 256)]
        assert codes.addressable_shards[0].data.size * 4 == codes.size  # fsdp x tensor: a quarter per device
        checked += 1
    assert checked == 9  # every weight but the norms
    # dim 256 on fsdp=2: a device's half of a 256-wide row is under a block, so fsdp splits the rows instead, and
    # every 8-bit moment is still a quarter per device (the flat ones, wk / wv's 128-wide rows, too)
    narrow = ModelConfig.preset("tiny", dim=256, ffn_dim=512)
    graphdef, state = TrainState.create(Llama(narrow, rngs=nnx.Rngs(0)), tx())
    _, state = _sharded(graphdef, tx(), state, sharding.make_mesh("data=2,fsdp=2,tensor=2"), batch_size=BATCH)
    codes = {k: v[...] for k, v in state.opt_state[0].mu["layers"].items() if v[...].dtype == np.uint8}
    assert codes["wo"].sharding.spec == P(None, ("tensor", "fsdp", "expert"), None, None)
    assert codes["wk"].shape == (2, 128, 256)  # flat: n_blocks over the param's fsdp and tensor
    assert all(c.addressable_shards[0].data.size * 4 == c.size for c in codes.values()), codes.keys()


def test_adamw8bit_walks_each_pipeline_stages_layers():
    """With a ``stage`` axis the 8-bit update loops over the layers of every stage at once (``LAYER_SHARDS``, set
    while a sharded step traces), so that no device reads another stage's layers; the numbers are the ones of
    the loop over all layers."""
    from jaxattn import optim

    assert optim.LAYER_SHARDS.get() == 1
    with sharding.activation_sharding(sharding.make_mesh("stage=2,data=4")):
        assert optim.LAYER_SHARDS.get() == 2
    assert optim.LAYER_SHARDS.get() == 1
    rng = np.random.default_rng(1)
    params = {"layers": {"w": jax.numpy.asarray(rng.standard_normal((4, 8, 512)), np.float32)}}
    grads = [jax.tree.map(lambda x: x * 0 + rng.standard_normal(x.shape).astype(np.float32), params) for _ in range(2)]
    out = []
    for shares in (1, 2):
        tx = optim.scale_by_adam_8bit(stacked=lambda t: jax.tree.map(lambda _: 1, t))
        state = tx.init(params)
        token = optim.LAYER_SHARDS.set(shares)
        try:
            update = jax.jit(tx.update)
            for g in grads:
                u, state = update(g, state)
        finally:
            optim.LAYER_SHARDS.reset(token)
        out.append((u, state))
    (u1, s1), (u2, s2) = out
    assert s1.nu["layers"]["w"].shape == (4, 8, 2, 256)
    for a, b in zip(jax.tree.leaves((u1, s1)), jax.tree.leaves((u2, s2))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
