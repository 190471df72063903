"""Mixture of Experts in training: both CLIs on an MoE ``--init`` (losses, router metrics, resume) and expert
parallelism (JAX's ``expert`` mesh axis, torch's ``--parallel ep``) against one device / one process. The model,
block and checkpoint parities are ``test_moe.py``'s.

Tolerances: design §7 (docs/design.md; after optimizer steps rtol 1e-3, atol 2e-3; resume exactly equal);
expert-parallel = one device within 1e-5 (the issue's bound).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import torchref.hf as thf
from jaxattn.train_step import loss_fn as jloss_fn
from parity_tests.test_moe import moe_config, twins


@pytest.fixture(scope="module")
def moe_init(tmp_path_factory):
    """An MoE ``--init`` directory (Qwen3-MoE-shaped tiny, z-loss on) both CLIs start from."""
    cfg = moe_config("qwen3_moe-renorm", router_z_loss_coef=0.001)
    tm, _ = twins(cfg, seed=3)
    return thf.save_pretrained(tm, tmp_path_factory.mktemp("moe-init"))


def _train(framework: str, argv: list[str]) -> dict:
    from jaxattn import train as jtrain
    from torchref import train as ttrain

    if framework == "jax":
        return jtrain.run(argv)
    return ttrain.run(argv + ["--num-workers", "0"])


@pytest.mark.slow  # 15 s; the default run trains both MoE CLIs in the resume and other-flag tests
@pytest.mark.slow_feature
def test_both_clis_train_moe_20_steps_alike(moe_init, tmp_path):
    """20 steps from one --init with grad accumulation, save_dots remat and AdamW: every step's loss (cross-entropy
    plus the router terms) and load-balancing loss agree within §7's after-optimizer-steps rule, and the log holds
    the router metrics."""
    from parity_tests.twins import jsonl_losses
    from twincore.runlog import MOE_KEYS, read_log

    argv = ["--init", moe_init, "--steps", "20", "--batch-size", "4", "--seq-len", "32", "--grad-accum", "2"]
    argv += ["--remat", "save_dots", "--optimizer", "adamw", "--lr", "3e-3", "--warmup", "2", "--no-progress"]
    logs = {}
    for fw in ("jax", "torch"):
        logs[fw] = tmp_path / f"{fw}.jsonl"
        _train(fw, argv + ["--log-json", str(logs[fw])])
    j, t = jsonl_losses(logs["jax"]), jsonl_losses(logs["torch"])
    assert len(j) == len(t) == 20 and j[-1] < j[0]
    np.testing.assert_allclose(j, t, rtol=1e-3, atol=2e-3)
    jr, tr = read_log(str(logs["jax"])), read_log(str(logs["torch"]))
    for key in MOE_KEYS:
        assert all(key in r for r in jr + tr), key
    np.testing.assert_allclose([r["aux_loss"] for r in jr], [r["aux_loss"] for r in tr], rtol=1e-3, atol=2e-3)


@pytest.mark.parametrize(
    "framework", [pytest.param("jax", marks=(pytest.mark.slow, pytest.mark.slow_feature)), "torch"]
)
def test_moe_resume_equals_uninterrupted(framework, moe_init, tmp_path):
    """bucketed padded rows (segment id 0 outside the router statistics) in bf16 with a capacity factor: 3 steps,
    then --resume to 5 = 5 straight, exactly (§7: same framework, deterministic; a constant schedule, as the
    3-step run's would otherwise decay sooner)."""
    from parity_tests.twins import jsonl_losses

    argv = ["--init", moe_init, "--batch-size", "2", "--seq-len", "32", "--no-progress", "--precision", "bf16"]
    argv += ["--data", "benchmarks/data/train-example.txt", "--packing", "bucket", "--schedule", "constant"]
    _train(framework, argv + ["--steps", "5", "--log-json", str(tmp_path / "straight.jsonl")])
    run = argv + ["--checkpoint-dir", str(tmp_path / "ck"), "--log-json", str(tmp_path / "parts.jsonl")]
    _train(framework, run + ["--steps", "3"])
    _train(framework, run + ["--steps", "5", "--resume"])
    straight = jsonl_losses(tmp_path / "straight.jsonl")
    assert np.isfinite(straight).all()
    assert jsonl_losses(tmp_path / "parts.jsonl")[-2:] == straight[-2:]


_FLAGS = ["--steps", "6", "--batch-size", "2", "--seq-len", "32", "--lr", "3e-3", "--schedule", "constant"]
_FLAGS += ["--data", "benchmarks/data/train-example.txt", "--no-progress"]  # packed rows: segment ids, no padding


_SLOW = (pytest.mark.slow, pytest.mark.slow_feature)


@pytest.mark.parametrize(
    "flags, parity",
    [
        (["--optimizer", "adamw8bit", "--remat", "save_qkv_attn"], True),  # 8-bit blocks over 3-D expert weights
        pytest.param(["--optimizer", "adamw_fused", "--remat", "full"], True, marks=_SLOW),
        pytest.param(["--optimizer", "adafactor", "--lr", "3e-2"], True, marks=_SLOW),
        pytest.param(["--precision", "fp16", "--optimizer", "adafactor", "--lr", "3e-2"], False, marks=_SLOW),
    ],
    ids=["adamw8bit-save_qkv_attn", "adamw_fused-full", "adafactor", "fp16-adafactor"],
)
def test_moe_trains_with_the_other_flags(flags, parity, moe_init, tmp_path):
    """The MoE --init through both CLIs with the flags the 20-step test leaves out (optimizers, remat policies,
    fp16 loss scaling, packed documents): the loss falls in both, and in fp32 the per-step losses agree at §7's
    after-optimizer-steps rule (Adafactor too: per expert and per layer on both sides). The fp16 run is held to
    what the CLI tests hold every fp16 run to, that it trains (§7 has no rule for whole fp16 runs): the twins' fp16
    forwards round differently, and Adafactor's normalised steps carry that (measured: the losses 1e-6 apart in
    fp32, 0.011 in fp16 after 5 steps). Adafactor runs at
    lr 3e-2 (at 3e-3 its loss stays within 0.1 of the start over 6 steps, in both twins)."""
    from parity_tests.twins import jsonl_losses

    losses = {}
    for fw in ("jax", "torch"):
        _train(fw, ["--init", moe_init, *_FLAGS, *flags, "--log-json", str(tmp_path / f"{fw}.jsonl")])
        losses[fw] = jsonl_losses(tmp_path / f"{fw}.jsonl")
        assert len(losses[fw]) == 6 and np.isfinite(losses[fw]).all() and losses[fw][-1] < losses[fw][0] - 0.3
    if parity:
        np.testing.assert_allclose(losses["jax"], losses["torch"], rtol=1e-3, atol=2e-3)


@pytest.mark.slow  # torch.compile of the MoE step: ~30 s on 2 cores
@pytest.mark.slow_feature
def test_torch_compile_of_the_moe_step_equals_eager(moe_init, tmp_path):
    """``--compile`` traces the MoE block (fp32: the per-expert fallback, as ``torch._grouped_mm``'s fake kernel
    takes bf16 only) and trains as eager does, at §7's after-optimizer-steps rule."""
    from parity_tests.twins import jsonl_losses

    for name, extra in (("compiled", ["--compile"]), ("eager", [])):
        _train("torch", ["--init", moe_init, *_FLAGS, *extra, "--log-json", str(tmp_path / f"{name}.jsonl")])
    compiled, eager = jsonl_losses(tmp_path / "compiled.jsonl"), jsonl_losses(tmp_path / "eager.jsonl")
    np.testing.assert_allclose(compiled, eager, rtol=1e-3, atol=2e-3)


# ----------------------------------------------------------------------------------------------- expert parallelism


def _sub_mesh(spec: str):
    from jaxattn import sharding

    sizes = sharding.parse_mesh(spec)
    return sharding.make_mesh(spec, jax.devices()[: int(np.prod(list(sizes.values())))])


@pytest.mark.parametrize(
    "spec, capacity",
    [
        ("expert=4", None),
        ("data=2,expert=4", 1.0),
        pytest.param("expert=4", 1.0, marks=pytest.mark.slow),
        pytest.param("data=2,expert=4", None, marks=pytest.mark.slow),
        pytest.param("fsdp=2,expert=2,tensor=2", None, marks=(pytest.mark.slow, pytest.mark.slow_feature)),
        pytest.param("fsdp=2,expert=2,tensor=2", 1.0, marks=pytest.mark.slow),
    ],
)
def test_jax_expert_parallel_equals_one_device(spec, capacity, rng):
    """8 experts over an ``expert`` mesh axis (all-to-all inside shard_map; with data / fsdp / tensor beside it):
    the training loss and the router metrics equal one device's within 1e-5 and every gradient within §7's fp32
    gradient rule (rtol = atol = 1e-3; measured ~1e-5 of each tensor's largest: the sharded reductions and the
    exchanged rows' GEMMs add in another order)."""
    from jaxattn import sharding

    cfg = moe_config(n_experts=8, capacity_factor=capacity, router_z_loss_coef=0.01)
    _, jm = twins(cfg)
    graphdef, params, rest = nnx.split(jm, nnx.Param, ...)
    seg = np.ones((8, 13), np.int32)
    seg[5, 7:] = 0
    batch = {"tokens": jnp.asarray(rng.integers(0, cfg.vocab_size, (8, 13))), "segment_ids": jnp.asarray(seg)}

    def grads(p):
        return jax.value_and_grad(lambda p: jloss_fn(nnx.merge(graphdef, p, rest), batch, moe_scale=1.0), has_aux=True)(
            p
        )

    (want, want_m), want_g = jax.jit(grads)(params)
    mesh = _sub_mesh(spec)
    with sharding.activation_sharding(mesh):
        (got, got_m), got_g = jax.jit(grads)(sharding.shard_state(params, mesh))
    assert abs(float(got) - float(want)) <= 1e-5
    for k in want_m:
        assert abs(float(got_m[k]) - float(want_m[k])) <= 1e-5, k
    for a, b in zip(jax.tree.leaves(want_g), jax.tree.leaves(got_g)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-3, atol=1e-3)
    placed = sharding.shard_state(params, mesh)["layers"]
    # [layers, experts, embed, mlp]: really split by expert, its embed over fsdp only; a dense weight's embed over
    # fsdp and expert (ZeRO-3 over the expert-parallel devices too)
    assert tuple(placed["e_gate"].sharding.spec)[1:3] == ("expert", "fsdp")
    assert tuple(placed["wq"].sharding.spec)[1] == ("fsdp", "expert")
    per_device = placed["wq"].addressable_shards[0].data.shape[1]
    assert per_device == cfg.dim // (mesh.shape["fsdp"] * mesh.shape["expert"])


@pytest.mark.slow
@pytest.mark.slow_feature
def test_jax_cli_expert_mesh_trains_like_one_device(moe_init, tmp_path):
    """``jaxattn.train --mesh data=2,expert=4`` (4 experts, 1 per device) = one device, 4 steps (§7 steps rule)."""
    from parity_tests.twins import jsonl_losses

    argv = ["--init", moe_init, "--steps", "4", "--batch-size", "8", "--seq-len", "16", "--no-progress"]
    _train("jax", argv + ["--log-json", str(tmp_path / "one.jsonl")])
    _train("jax", argv + ["--mesh", "data=2,expert=4", "--log-json", str(tmp_path / "ep.jsonl")])
    np.testing.assert_allclose(jsonl_losses(tmp_path / "ep.jsonl"), jsonl_losses(tmp_path / "one.jsonl"), atol=1e-5)


def test_jax_expert_axis_must_divide_the_experts(moe_init, tmp_path):
    from jaxattn import sharding

    with pytest.raises(ValueError, match="n_experts=4 is not divisible by the mesh axis expert=8"):
        sharding.check_config(moe_config(), _sub_mesh("expert=8"))


@pytest.fixture(scope="module")
def moe_capacity_init(tmp_path_factory):
    """:func:`moe_init` with a capacity factor of 0.5: the static-buffer path, which drops assignments."""
    cfg = moe_config("qwen3_moe-renorm", router_z_loss_coef=0.001, capacity_factor=0.5)
    tm, _ = twins(cfg, seed=3)
    return thf.save_pretrained(tm, tmp_path_factory.mktemp("moe-capacity-init"))


@pytest.mark.parametrize(
    "mode, init",
    [
        ("ep", "moe_init"),
        ("ep", "moe_capacity_init"),
        *(pytest.param(m, "moe_init", marks=(pytest.mark.slow, pytest.mark.slow_feature)) for m in ("ep+fsdp", "ddp")),
    ],
    ids=["ep", "ep-capacity", "ep+fsdp", "ddp"],
)
def test_torchrun_expert_parallel_equals_one_process(mode, init, request, tmp_path):
    """torchrun 2 ranks, each holding 2 of the 4 experts (DTensors sharded by expert; tokens exchanged by
    all_to_all_single over gloo, dropless by exact split sizes or, with a capacity, as equal [B, E, C, dim]
    buffers; the router statistics all-reduced, so the balance loss is the whole batch's): the losses and grad
    norms of 4 steps equal one process's (§7 steps rule) — ddp too, which sums the statistics the same way. With
    ``--grad-accum 2``: each rank's block j is its share of the batch's block j, so the router terms of each block
    are one process's."""
    from parity_tests.twins import jsonl_losses, torchrun
    from twincore.runlog import read_log

    init = request.getfixturevalue(init)
    argv = ["--init", init, "--steps", "4", "--batch-size", "8", "--seq-len", "16", "--no-progress"]
    argv += ["--grad-accum", "2"]
    torchrun("-m", "torchref.train", "--parallel", mode, "--log-json", str(tmp_path / "ep.jsonl"), *argv)
    _train("torch", argv + ["--log-json", str(tmp_path / "one.jsonl")])
    np.testing.assert_allclose(jsonl_losses(tmp_path / "ep.jsonl"), jsonl_losses(tmp_path / "one.jsonl"), atol=1e-5)
    norms = [[r["grad_norm"] for r in read_log(str(tmp_path / f"{n}.jsonl"))] for n in ("ep", "one")]
    np.testing.assert_allclose(norms[0], norms[1], rtol=1e-5)
