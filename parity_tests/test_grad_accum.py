"""Gradient accumulation: ``make_train_step(..., grad_accum=k)`` in both frameworks (tiny preset, CPU, fp32).

The loss of a step is ``sum(w * nll) / sum(w)`` over the WHOLE batch (w: loss mask x same-segment), so k
microbatches must divide their weighted NLL sums by the whole batch's weight, not average per-microbatch
means. With microbatches of different padding the naive average differs (asserted below, so the equality test
can fail). Equal up to fp32 rounding (same framework: summation order of k partial gradients; rtol 1e-5,
atol 1e-6): the loss, the grad norm and all parameters after one AdamW step, k microbatches of b rows vs one
batch of k*b rows. torch vs JAX with accumulation: design §7's "fp32 after optimizer steps" tolerance.

AdamW's eps is 1e-4, not 1e-8: a first AdamW step moves each parameter by ``lr * g / (|g| + eps)``, whose
slope ``lr * eps / (|g| + eps)**2`` is ``lr / eps`` at a near-zero gradient. With eps=1e-8 a last-bit rounding
difference (from summing two microbatch gradients instead of one) in a gradient that cancels to ~1e-8 moved one
k_proj weight by 1.4e-6 (measured) — AdamW's amplification, not accumulation. eps=1e-4 bounds the slope at 30.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxattn import hf
from jaxattn import train_step as jtrain

torch = pytest.importorskip("torch")
from benchmarks.twins import twin_models  # noqa: E402
from torchref import train_step as ttrain  # noqa: E402
from torchref.config import ModelConfig as TorchModelConfig  # noqa: E402

HP = dict(lr=3e-3, b1=0.9, b2=0.95, eps=1e-4, weight_decay=0.1)  # eps: see the module docstring
TX = optax.adamw(HP["lr"], HP["b1"], HP["b2"], HP["eps"], weight_decay=HP["weight_decay"])
SAME_RTOL, SAME_ATOL = 1e-5, 1e-6
STEP_RTOL, STEP_ATOL = 1e-3, 2e-3  # design §7, fp32 after optimizer steps
K = 2


def _batch(seed=0, b=4, s=17):
    """4 rows, 2 microbatches of 2: the first microbatch unpadded (one row packs two documents), the second
    heavily padded, so the two microbatches hold very different numbers of real targets."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 256, (b, s)).astype(np.int64)
    seg = np.ones((b, s), np.int32)
    seg[0, 9:] = 2
    mask = np.ones((b, s), np.int32)
    mask[2, 5:] = 0
    mask[3, 3:] = 0
    return {"tokens": tokens, "segment_ids": seg, "loss_mask": mask}


def _jax(batch):
    return {k: jnp.asarray(v, jnp.int32) for k, v in batch.items()}


def _torch(batch):
    return {k: torch.from_numpy(v) for k, v in batch.items()}


@pytest.fixture(scope="module")
def twins():
    return twin_models(TorchModelConfig.preset("tiny"), seed=41)


@pytest.fixture(scope="module")
def jax_steps(twins):
    """{k: (graphdef, step)} for k = 1 and K, fp32, clipping on (the summed gradient is what gets clipped)."""
    _, jm = twins
    graphdef, _ = jtrain.TrainState.create(jm, TX, policy="fp32")
    return {
        k: jtrain.make_train_step(graphdef, TX, policy="fp32", max_grad_norm=1.0, donate=False, grad_accum=k)
        for k in (1, K)
    }


def _jax_run(twins, jax_steps, k, batch):
    _, jm = twins
    _, state = jtrain.TrainState.create(nnx.merge(*nnx.split(jm)), TX, policy="fp32")
    state, metrics = jax_steps[k](state, _jax(batch))
    return hf.to_state_dict(state.model(nnx.split(jm)[0])), {m: float(v) for m, v in metrics.items()}


def _torch_run(twins, k, batch):
    import copy

    tm = copy.deepcopy(twins[0])
    opt = torch.optim.AdamW(
        tm.parameters(), lr=HP["lr"], betas=(HP["b1"], HP["b2"]), eps=HP["eps"], weight_decay=HP["weight_decay"]
    )
    metrics = ttrain.make_train_step(tm, opt, policy="fp32", max_grad_norm=1.0, grad_accum=k)(_torch(batch))
    return {n: p.detach().numpy().copy() for n, p in tm.state_dict().items()}, {m: float(v) for m, v in metrics.items()}


@pytest.fixture(scope="module")
def jax_results(twins, jax_steps):
    batch = _batch()
    return {k: _jax_run(twins, jax_steps, k, batch) for k in (1, K)}


def _assert_same(a, b, rtol, atol, what):
    assert set(a) == set(b)
    for name in a:
        np.testing.assert_allclose(a[name], b[name], rtol=rtol, atol=atol, err_msg=f"{what}: {name}")


def test_naive_per_microbatch_average_would_differ(twins):
    """The batch is chosen so that averaging the microbatch means is NOT the batch mean (else the tests below
    could not tell the two normalisations apart)."""
    _, jm = twins
    graphdef, state = nnx.split(jm)
    loss = jax.jit(lambda st, b: jtrain.loss_fn(nnx.merge(graphdef, st), b))
    batch = _jax(_batch())
    full = float(loss(state, batch))
    halves = [float(loss(state, {k: v[i * 2 : (i + 1) * 2] for k, v in batch.items()})) for i in range(K)]
    assert abs(np.mean(halves) - full) > 100 * SAME_RTOL * full, (halves, full)


def test_jax_k_microbatches_equal_one_batch(jax_results):
    (p1, m1), (pk, mk) = jax_results[1], jax_results[K]
    assert mk["loss"] == pytest.approx(m1["loss"], rel=SAME_RTOL)
    assert mk["grad_norm"] == pytest.approx(m1["grad_norm"], rel=SAME_RTOL)
    assert m1["grad_norm"] > 1.0  # clipping is active, so the summed gradient is what got clipped
    assert mk["skipped"] == 0.0 and mk["loss_scale"] == 1.0
    _assert_same(pk, p1, SAME_RTOL, SAME_ATOL, f"jax grad_accum={K} vs 1")


def test_jax_accumulation_is_one_scan_in_one_jitted_step(twins, jax_steps):
    """One compiled step: the microbatches run in a ``lax.scan`` of length k inside it (a k=4 step's jaxpr
    has the same number of equations as a k=2 step's: the body is traced once)."""
    _, jm = twins
    graphdef, state = jtrain.TrainState.create(jm, TX, policy="fp32")
    sizes = {}
    for k in (2, 4):
        step = jtrain.make_train_step(graphdef, TX, policy="fp32", grad_accum=k)
        batch = _jax({key: np.concatenate([v] * (k // 2)) for key, v in _batch().items()})
        jaxpr = jax.make_jaxpr(step.jitted)(state, batch)
        text = str(jaxpr)
        assert f"length={k}" in text
        sizes[k] = len(text.splitlines())
    assert sizes[2] == sizes[4]


def test_torch_k_microbatches_equal_one_batch(twins):
    batch = _batch()
    (p1, m1), (pk, mk) = _torch_run(twins, 1, batch), _torch_run(twins, K, batch)
    assert mk["loss"] == pytest.approx(m1["loss"], rel=SAME_RTOL)
    assert mk["grad_norm"] == pytest.approx(m1["grad_norm"], rel=SAME_RTOL)
    assert mk["skipped"] == 0.0 and mk["loss_scale"] == 1.0
    _assert_same(pk, p1, SAME_RTOL, SAME_ATOL, f"torch grad_accum={K} vs 1")


def test_torch_vs_jax_with_accumulation(twins, jax_results):
    pj, mj = jax_results[K]
    pt, mt = _torch_run(twins, K, _batch())
    assert mj["loss"] == pytest.approx(mt["loss"], rel=STEP_RTOL, abs=STEP_ATOL)
    assert mj["grad_norm"] == pytest.approx(mt["grad_norm"], rel=STEP_RTOL, abs=STEP_ATOL)
    _assert_same(pj, pt, STEP_RTOL, STEP_ATOL, "jax vs torch")
    changed = max(float(np.abs(pt[n] - twins[0].state_dict()[n].numpy()).max()) for n in pt)
    assert changed > 1e-3  # the step moved the parameters: not vacuous


@pytest.mark.parametrize(
    "bad, exc, match",
    [
        (0, ValueError, r"grad_accum must be an int >= 1 \(microbatches per step\), got 0"),
        (-2, ValueError, r"grad_accum must be an int >= 1 \(microbatches per step\), got -2"),
        (1.5, TypeError, r"grad_accum must be an int >= 1 .*got 1.5 \(float\)"),
        (True, TypeError, r"grad_accum must be an int >= 1 .*got True \(bool\)"),
        ("2", TypeError, r"grad_accum must be an int >= 1 .*got '2' \(str\)"),
    ],
)
def test_bad_grad_accum_is_a_clear_error_in_both(twins, bad, exc, match):
    tm, jm = twins
    graphdef, _ = jtrain.TrainState.create(jm, TX, policy="fp32")
    with pytest.raises(exc, match=match):
        jtrain.make_train_step(graphdef, TX, grad_accum=bad)
    with pytest.raises(exc, match=match):
        ttrain.make_train_step(tm, torch.optim.AdamW(tm.parameters()), grad_accum=bad)


def test_grad_accum_not_dividing_the_batch_names_both(twins, jax_steps):
    tm, jm = twins
    batch = {k: v[:3] for k, v in _batch().items()}
    match = r"grad_accum=2 does not divide the batch size 3 \(batch\['tokens'\] has shape \(3, 17\)\)"
    _, state = jtrain.TrainState.create(jm, TX, policy="fp32")
    with pytest.raises(ValueError, match=match):
        jax_steps[K](state, _jax(batch))
    with pytest.raises(ValueError, match=match):  # the jitted pure function checks it too, at trace time
        jax_steps[K].jitted(state, _jax(batch))
    before = {n: p.detach().clone() for n, p in tm.state_dict().items()}
    step = ttrain.make_train_step(tm, torch.optim.AdamW(tm.parameters()), grad_accum=2)
    with pytest.raises(ValueError, match=match):
        step(_torch(batch))
    assert all(torch.equal(before[n], p) for n, p in tm.state_dict().items())  # nothing ran
