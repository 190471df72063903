"""``jaxattn.train.make_train_step`` vs ``torchref.train.make_train_step`` from identical weights (tiny, CPU).

* fp32: losses, grad norms and all parameters after 3 AdamW steps (clipping on, loss mask and packed segments
  on) agree within design §7's "fp32 after optimizer steps" tolerance (rtol 1e-3, atol 2e-3).
* fp16: a step whose scaled loss overflows (scale 2**126) is skipped in BOTH frameworks: params and optimizer
  state bit-for-bit unchanged, scale halved, growth tracker reset, and the two scalers' state dicts equal.
* token ids: an id outside the vocabulary is a ValueError naming it in both steps (host check; checkify inside
  jit on request), and a masked out-of-range pad id can no longer turn the parameters into NaN.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxattn import hf
from jaxattn import train_step as jtrain
from jaxattn.loss_scale import DynamicLossScale, NoOpLossScale
from jaxattn.precision import Policy

torch = pytest.importorskip("torch")
from benchmarks.twins import twin_models  # noqa: E402
from torchref import train_step as ttrain  # noqa: E402
from torchref.config import ModelConfig as TorchModelConfig  # noqa: E402
from torchref.precision import Policy as TorchPolicy  # noqa: E402

HP = dict(lr=3e-3, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1)
TX = optax.adamw(HP["lr"], HP["b1"], HP["b2"], HP["eps"], weight_decay=HP["weight_decay"])
VOCAB = 256


def _twins(seed=0):
    """(torch model, torch AdamW, jax model, optax AdamW) with identical weights and hyper-parameters."""
    tm, jm = twin_models(TorchModelConfig.preset("tiny"), seed=seed)
    topt = torch.optim.AdamW(
        tm.parameters(), lr=HP["lr"], betas=(HP["b1"], HP["b2"]), eps=HP["eps"], weight_decay=HP["weight_decay"]
    )
    return tm, topt, jm, TX


@pytest.fixture(scope="module")
def fp32_step():
    """The fp32 JAX step (clip 1.0), compiled once for the module's packed (2, 17) int32 batches."""
    _, _, jm, tx = _twins()
    graphdef, _ = jtrain.TrainState.create(jm, tx, policy="fp32")
    return graphdef, jtrain.make_train_step(graphdef, tx, policy="fp32", max_grad_norm=1.0, donate=True)


def _batch(rng, b=2, s=17, packed=True):
    tokens = rng.integers(0, 256, (b, s)).astype(np.int64)
    out = {"tokens": tokens}
    if packed:
        seg = np.ones((b, s), np.int32)
        seg[0, 9:] = 2  # two documents packed into row 0
        mask = np.ones((b, s), np.int32)
        mask[1, -4:] = 0  # padding at the end of row 1
        out.update(segment_ids=seg, loss_mask=mask)
    return out


def _to_jax(batch):
    return {k: jnp.asarray(v, jnp.int32) for k, v in batch.items()}


def _to_torch(batch):
    return {k: torch.from_numpy(v) for k, v in batch.items()}


def test_fp32_step_parity_three_adamw_steps(fp32_step):
    """AdamW equivalence: ``optax.adamw(lr, b1, b2, eps, weight_decay=wd)`` vs ``torch.optim.AdamW(lr, (b1, b2),
    eps, weight_decay=wd)``. torch computes ``p <- p*(1 - lr*wd)`` then ``p <- p - lr * m_hat / (sqrt(v_hat) +
    eps)``; optax computes ``u = m_hat / (sqrt(v_hat + eps_root) + eps) + wd*p`` then ``p <- p - lr*u``. With
    ``eps_root=0`` (optax's default) these are the same update: eps outside the square root, after bias
    correction, decoupled decay scaled by the (scheduled) learning rate, applied to every parameter (optax's
    ``mask=None`` = torch's single param group). Only float rounding differs: torch divides by
    ``sqrt(v)/sqrt(bc2)`` where optax takes ``sqrt(v/bc2)``, and decays ``p*(1-lr*wd)`` before the Adam update
    where optax adds ``wd*p`` to it. Defaults differ (torch wd=0.01, optax wd=1e-4): both get explicit values.
    """
    graphdef, step_fn = fp32_step
    tm, topt, jm, tx = _twins()
    init = {k: v.detach().numpy().copy() for k, v in tm.state_dict().items()}
    _, state = jtrain.TrainState.create(jm, tx, policy="fp32")
    assert isinstance(state.loss_scale, NoOpLossScale)
    t_step = ttrain.make_train_step(tm, topt, policy="fp32", max_grad_norm=1.0)
    rng = np.random.default_rng(0)
    for step in range(3):
        batch = _batch(rng)
        state, jm_ = step_fn(state, _to_jax(batch))
        tm_ = t_step(_to_torch(batch))
        _check_metric_types(jm_, tm_)
        np.testing.assert_allclose(
            float(jm_["loss"]), float(tm_["loss"]), rtol=1e-3, atol=2e-3, err_msg=f"loss at step {step}"
        )
        np.testing.assert_allclose(float(jm_["grad_norm"]), float(tm_["grad_norm"]), rtol=1e-3, atol=1e-3)
        assert float(jm_["grad_norm"]) > 1.0  # the clip really acted (norm above max_norm)
        assert not bool(jm_["skipped"]) and not bool(tm_["skipped"])
        assert float(jm_["loss_scale"]) == float(tm_["loss_scale"]) == 1.0
    jsd = hf.to_state_dict(state.model(graphdef))
    moved = 0.0
    for k, v in tm.state_dict().items():
        np.testing.assert_allclose(jsd[k], v.detach().numpy(), rtol=1e-3, atol=2e-3, err_msg=k)
        moved = max(moved, float(np.abs(v.detach().numpy() - init[k]).max()))
    assert moved > 5e-3  # the params really moved (3 steps of lr 3e-3), so the comparison is not vacuous
    assert int(state.step) == 3 and int(state.opt_state[0].count) == 3


def _check_metric_types(jm_, tm_):
    """Same keys, each a 0-d array/tensor: loss, grad_norm, loss_scale float32; skipped bool."""
    want = {"loss": "float32", "grad_norm": "float32", "loss_scale": "float32", "skipped": "bool"}
    assert set(jm_) == set(tm_) == set(want)
    for k, dt in want.items():
        assert isinstance(jm_[k], jax.Array) and jm_[k].shape == () and str(jm_[k].dtype) == dt, (k, jm_[k])
        assert torch.is_tensor(tm_[k]) and tm_[k].shape == () and str(tm_[k].dtype) == f"torch.{dt}", (k, tm_[k])


def test_loss_weights_mask_and_segments():
    """The loss ignores masked targets and targets across a segment boundary, identically in both packages."""
    rng = np.random.default_rng(1)
    batch = _batch(rng, packed=True)
    wj = np.asarray(jtrain.loss_weights(_to_jax(batch)))
    wt = ttrain.loss_weights(_to_torch(batch)).numpy()
    np.testing.assert_array_equal(wj, wt)
    assert wj[0, 8] == 0 and wj[0, 7] == 1 and wj[0, 9] == 1  # target 9 is the first token of document 2
    assert (wj[1, -4:] == 0).all() and wj[1, -5] == 1
    logits = rng.standard_normal((2, 16, 256)).astype(np.float32)
    targets = batch["tokens"][:, 1:]
    lj = float(jtrain.cross_entropy(jnp.asarray(logits), jnp.asarray(targets), jnp.asarray(wj)))
    lt = float(ttrain.cross_entropy(torch.from_numpy(logits), torch.from_numpy(targets), torch.from_numpy(wt)))
    lse = np.log(np.exp(logits.astype(np.float64)).sum(-1))
    nll = lse - np.take_along_axis(logits, targets[..., None], -1)[..., 0]
    ref = (nll * wj).sum() / wj.sum()
    assert abs(lj - ref) < 1e-5 and abs(lt - ref) < 1e-5


def test_fp16_overflow_step_is_skipped_in_both():
    tm, topt, jm, tx = _twins(seed=1)
    policy = "fp16"
    graphdef, state = jtrain.TrainState.create(
        jm, tx, policy=policy, loss_scale=DynamicLossScale.create(init_scale=2.0**8)
    )
    scaler = TorchPolicy.preset(policy).make_grad_scaler("cpu", init_scale=2.0**8)
    j_step = jtrain.make_train_step(graphdef, tx, policy=policy, max_grad_norm=1.0)
    t_step = ttrain.make_train_step(tm, topt, policy=policy, scaler=scaler, max_grad_norm=1.0)
    rng = np.random.default_rng(2)
    # one ordinary step so the optimizer state is not trivial
    batch = _batch(rng)
    state, jm_ = j_step(state, _to_jax(batch))
    tm_ = t_step(_to_torch(batch))
    _check_metric_types(jm_, tm_)
    assert not bool(jm_["skipped"]) and not bool(tm_["skipped"])
    assert float(jm_["loss_scale"]) == float(tm_["loss_scale"]) == 2.0**8
    assert state.loss_scale.state_dict() == scaler.state_dict()  # tracker 1 on both sides
    # force an overflow: the scaled float32 loss is ~5.5 * 2**126 > float32 max
    sd = dict(scaler.state_dict(), scale=2.0**126)
    scaler.load_state_dict(sd)
    state = state.replace(loss_scale=DynamicLossScale.from_state_dict(sd))
    j_before = jax.tree.map(np.asarray, (state.params, state.opt_state))
    t_params = {k: v.detach().clone() for k, v in tm.state_dict().items()}
    t_opt = {
        id_: {k: (v.clone() if torch.is_tensor(v) else v) for k, v in s.items()}
        for id_, s in enumerate(topt.state.values())
    }
    batch = _batch(rng)
    state, jm_ = j_step(state, _to_jax(batch))
    tm_ = t_step(_to_torch(batch))
    assert bool(jm_["skipped"]) and bool(tm_["skipped"])
    assert float(jm_["loss_scale"]) == float(tm_["loss_scale"]) == 2.0**126
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, (state.params, state.opt_state)), j_before)
    for k, v in tm.state_dict().items():
        assert torch.equal(v, t_params[k]), k
    for id_, s in enumerate(topt.state.values()):
        for k, v in s.items():
            assert torch.equal(v, t_opt[id_][k]) if torch.is_tensor(v) else v == t_opt[id_][k], k
    expected = dict(sd, scale=2.0**125, _growth_tracker=0)
    assert state.loss_scale.state_dict() == scaler.state_dict() == expected
    assert int(state.opt_state[0].count) == 1  # AdamW's step count did not advance either
    assert int(state.step) == 2


def test_fp16_without_loss_scale_warns_once():
    tm, topt, jm, tx = _twins()
    jtrain._warned.clear()
    ttrain._warned.clear()
    rng = np.random.default_rng(3)
    batch = _batch(rng, packed=False)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        graphdef, state = jtrain.TrainState.create(jm, tx, policy="fp16", loss_scale=NoOpLossScale())
        for _ in range(2):
            # eval_shape traces the step (where the warning is raised) without the slow CPU compile
            j_step = jtrain.make_train_step(graphdef, tx, policy="fp16")
            jax.eval_shape(j_step, state, _to_jax(batch))
            ttrain.make_train_step(tm, topt, policy="fp16")(_to_torch(batch))
    msgs = [str(w.message) for w in rec if "WITHOUT dynamic loss scaling" in str(w.message)]
    assert len(msgs) == 2, msgs  # one from each framework, not one per step
    assert any("DynamicLossScale" in m for m in msgs) and any("GradScaler" in m for m in msgs)


def test_bf16_policies_keep_param_dtypes():
    """bf16: fp32 master params, grads and AdamW moments; bf16-pure: bf16 everywhere (both frameworks).

    Checked on the traced step (``jax.eval_shape``), which fixes every output dtype, to stay clear of a slow
    CPU compile; the bf16 forward itself runs in test_precision.py (whole-model KL) and the policy mechanism
    runs end to end in the fp16 test above.
    """
    _, _, jm, tx = _twins()
    batch = _to_jax(_batch(np.random.default_rng(4)))
    for name, want in (("bf16", jnp.float32), ("bf16-pure", jnp.bfloat16)):
        graphdef, state = jtrain.TrainState.create(jm, tx, policy=name)
        new, m = jax.eval_shape(jtrain.make_train_step(graphdef, tx, policy=name), state, batch)
        assert {x.dtype for x in jax.tree.leaves(new.params)} == {jnp.dtype(want)}, name
        assert {x.dtype for x in jax.tree.leaves(new.opt_state) if jnp.issubdtype(x.dtype, jnp.floating)} == {
            jnp.dtype(want)
        }, name
        assert m["loss"].dtype == jnp.float32 and isinstance(new.loss_scale, NoOpLossScale)
    # the bf16 policy's traced forward really contains bf16 matmuls
    graphdef, state = jtrain.TrainState.create(jm, tx, policy="bf16")
    hlo = jtrain.make_train_step(graphdef, tx, policy=Policy.preset("bf16")).lower(state, batch).as_text()
    assert "bf16" in hlo and "dot_general" in hlo
    tm, _, _, _ = _twins()
    TorchPolicy.preset("bf16-pure").cast_model(tm)
    assert {p.dtype for p in tm.parameters()} == {torch.bfloat16} and tm.model.inv_freq.dtype == torch.float32
    topt = torch.optim.AdamW(tm.parameters(), lr=1e-3)
    mt = ttrain.make_train_step(tm, topt, policy="bf16-pure")(_to_torch(_batch(np.random.default_rng(4))))
    assert np.isfinite(float(mt["loss"])) and {p.dtype for p in tm.parameters()} == {torch.bfloat16}
    assert {v.dtype for s in topt.state.values() for v in s.values() if v.is_floating_point() and v.ndim} == {
        torch.bfloat16
    }


def test_bad_inputs_raise():
    tm, topt, jm, tx = _twins()
    graphdef, state = jtrain.TrainState.create(jm, tx)
    j_step, t_step = jtrain.make_train_step(graphdef, tx), ttrain.make_train_step(tm, topt)
    good = _batch(np.random.default_rng(5), packed=False)
    with pytest.raises(ValueError, match="batch keys"):
        j_step(state, {"input_ids": jnp.asarray(good["tokens"])})
    with pytest.raises(ValueError, match="batch keys"):
        t_step({"input_ids": torch.from_numpy(good["tokens"])})
    bad_mask = dict(_to_jax(good), loss_mask=jnp.ones((2, 16), jnp.int32))
    with pytest.raises(ValueError, match=r"loss_mask.*\(2, 17\)"):
        j_step(state, bad_mask)
    for mod, args in ((jtrain, (graphdef, tx)), (ttrain, (tm, topt))):
        with pytest.raises(ValueError, match="max_grad_norm"):
            mod.make_train_step(*args, max_grad_norm=-1.0)
        with pytest.raises(ValueError, match="max_grad_norm"):
            mod.make_train_step(*args, max_grad_norm=0)
        with pytest.raises(ValueError, match="unknown precision preset"):
            mod.make_train_step(*args, policy="fp8")
    with pytest.raises(TypeError, match="optax.GradientTransformation"):
        jtrain.TrainState.create(jm, "adamw")
    with pytest.raises(TypeError, match="optax.GradientTransformation"):
        jtrain.make_train_step(graphdef, "adamw")
    with pytest.raises(ValueError, match=r"check_ids=True.*'host', 'jit', 'off'"):
        jtrain.make_train_step(graphdef, tx, check_ids=True)
    with pytest.raises(TypeError, match="GradScaler"):
        ttrain.make_train_step(tm, topt, scaler="dynamic")
    for tokens, step in (
        (jnp.zeros((2, 1), jnp.int32), lambda b: j_step(state, b)),
        (torch.zeros((2, 1), dtype=torch.int64), t_step),
    ):
        with pytest.raises(ValueError, match="seq >= 2"):
            step({"tokens": tokens})
    for bad, step in (([[1, 2, 3]], lambda b: j_step(state, b)), ([[1, 2, 3]], t_step)):
        with pytest.raises(TypeError, match=r"batch\['tokens'\].*got list"):
            step({"tokens": bad})
    with pytest.raises(TypeError, match=r"batch\['segment_ids'\].*got list"):
        j_step(state, {"tokens": _to_jax(good)["tokens"], "segment_ids": [[0] * 17] * 2})
    with pytest.raises(TypeError, match=r"batch\['tokens'\].*got bool"):
        t_step({"tokens": torch.ones((2, 17), dtype=torch.bool)})
    assert isinstance(Policy.preset("fp16").make_loss_scale(), DynamicLossScale)


# ------------------------------------------------------------------------------------------------------------
# Token ids
# ------------------------------------------------------------------------------------------------------------


def _padded(rng, pad_id):
    """A right-padded batch: row 1's last 4 tokens are ``pad_id``, masked out of the loss."""
    batch = _batch(rng, packed=True)
    batch["tokens"][1, -4:] = pad_id
    return batch


def test_out_of_range_ids_raise_in_both_steps(fp32_step):
    graphdef, j_step = fp32_step
    tm, topt, jm, tx = _twins()
    _, state = jtrain.TrainState.create(jm, tx)
    t_step = ttrain.make_train_step(tm, topt)
    before = {k: v.clone() for k, v in tm.state_dict().items()}
    for pad_id in (VOCAB, -1):
        batch = _padded(np.random.default_rng(6), pad_id)
        msg = rf"batch\['tokens'\] holds an id outside \[0, vocab_size=256\): {pad_id} at position \(1, 13\)"
        for arrays in (_to_jax(batch), {k: np.asarray(v, np.int32) for k, v in batch.items()}):  # jax, numpy
            with pytest.raises(ValueError, match=msg):
                j_step(state, arrays)
        with pytest.raises(ValueError, match=msg):
            t_step(_to_torch(batch))
    assert all(torch.equal(v, before[k]) for k, v in tm.state_dict().items())  # nothing was stepped
    assert int(state.step) == 0 and np.isfinite(np.asarray(state.params["embed"][...])).all()  # not donated


def test_masked_out_of_range_pad_ids_cannot_poison_the_params(fp32_step):
    """The bug: one step on a right-padded batch whose pad id is ``vocab_size`` (masked out of the loss) turned
    every parameter into NaN: ``jnp.take`` fills an out-of-range row with NaN, and ``nll * 0`` stays NaN. Now
    the embedding fills zeros and the loss drops masked targets with ``where``. Run WITHOUT the host check
    (``step.jitted``, what ``check_ids="off"`` or a batch of tracers gets): the step equals the one on the same
    batch padded with id 0 (right padding is causal-invisible to the real tokens) and everything is finite."""
    graphdef, j_step = fp32_step
    _, _, jm, tx = _twins()
    _, state0 = jtrain.TrainState.create(jm, tx)
    out = {}
    for pad_id in (VOCAB, 0):
        state = jax.tree.map(jnp.copy, state0)  # the step donates its input
        out[pad_id] = j_step.jitted(state, _to_jax(_padded(np.random.default_rng(7), pad_id)))
    (s_bad, m_bad), (s_ok, m_ok) = out[VOCAB], out[0]
    leaves = jax.tree.leaves((s_bad.params, s_bad.opt_state))
    assert all(np.isfinite(np.asarray(x)).all() for x in leaves if jnp.issubdtype(x.dtype, jnp.floating))
    assert np.isfinite(float(m_bad["loss"])) and np.isfinite(float(m_bad["grad_norm"]))
    np.testing.assert_allclose(float(m_bad["loss"]), float(m_ok["loss"]), rtol=1e-6)
    np.testing.assert_allclose(float(m_bad["grad_norm"]), float(m_ok["grad_norm"]), rtol=1e-5)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7),
        s_bad.params,
        s_ok.params,
    )


def test_cross_entropy_drops_nan_at_masked_targets_in_both():
    """A NaN logit row and an out-of-range target at masked positions leave the loss and its gradient finite in
    both packages, and the gradient there exactly zero."""
    rng = np.random.default_rng(8)
    logits = rng.standard_normal((2, 5, 7)).astype(np.float32)
    logits[1, 3] = np.nan
    targets = rng.integers(0, 7, (2, 5))
    targets[0, 4] = 7
    w = np.ones((2, 5), np.float32)
    w[1, 3] = w[0, 4] = 0
    jl, jg = jax.value_and_grad(jtrain.cross_entropy)(jnp.asarray(logits), jnp.asarray(targets), jnp.asarray(w))
    tlog = torch.from_numpy(logits).requires_grad_()
    tl = ttrain.cross_entropy(tlog, torch.from_numpy(targets), torch.from_numpy(w))
    tl.backward()
    assert np.isfinite(float(jl)) and np.isfinite(np.asarray(jg)).all()
    assert np.isfinite(float(tl)) and torch.isfinite(tlog.grad).all()
    np.testing.assert_allclose(float(jl), float(tl), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(jg), tlog.grad.numpy(), rtol=1e-5, atol=1e-7)
    assert not np.asarray(jg)[1, 3].any() and not np.asarray(jg)[0, 4].any()
    keep = w > 0
    lse = np.log(np.exp(logits[keep].astype(np.float64)).sum(-1))
    ref = (lse - np.take_along_axis(logits[keep], targets[keep][:, None], -1)[:, 0]).mean()
    np.testing.assert_allclose(float(jl), ref, rtol=1e-6)


def test_checkify_reports_bad_ids_from_inside_jit():
    """``check_ids="jit"``: the check runs inside the compiled step (no host check), and the state passed in
    survives the error (no donation in this mode)."""
    _, _, jm, tx = _twins()
    graphdef, state = jtrain.TrainState.create(jm, tx)
    step = jtrain.make_train_step(graphdef, tx, max_grad_norm=1.0, check_ids="jit")
    batch = _to_jax(_padded(np.random.default_rng(9), VOCAB + 5))
    with pytest.raises(
        ValueError,
        match=r"id outside \[0, vocab_size=256\): 261 at position \(1, 13\) "
        r"\(4 bad ids in all\)",
    ):
        step(state, batch)
    new, m = step(state, _to_jax(_padded(np.random.default_rng(9), 0)))  # the same state is still usable
    assert int(new.step) == 1 and np.isfinite(float(m["loss"]))
    err, _ = step.jitted(state, batch)  # the raw checkified function: the error is a value
    assert "261 at position (1, 13)" in err.get()
