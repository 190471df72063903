"""``jaxattn.train.train_step`` vs ``torchref.train.train_step`` from identical weights (tiny preset, CPU).

* fp32: losses, grad norms and all parameters after 3 AdamW steps (clipping on, loss mask and packed segments
  on) agree within CONVENTIONS §7's "fp32 after optimizer steps" tolerance (rtol 1e-3, atol 2e-3). Differences
  are float rounding only: torch's AdamW divides by ``sqrt(v)/sqrt(bc2)`` where optax takes ``sqrt(v/bc2)``, and
  decays ``p*(1-lr*wd)`` before the Adam update where optax adds ``wd*p`` to it.
* fp16: a step whose scaled loss overflows (scale 2**126) is skipped in BOTH frameworks: params and optimizer
  state bit-for-bit unchanged, scale halved, growth tracker reset, and the two scalers' state dicts equal.
"""
from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxattn import hf
from jaxattn import train as jtrain
from jaxattn.config import ModelConfig
from jaxattn.precision import DynamicLossScale, NoOpLossScale, Policy

torch = pytest.importorskip("torch")
from torchref import train as ttrain  # noqa: E402
from torchref.config import ModelConfig as TorchModelConfig  # noqa: E402
from torchref.model import LlamaForCausalLM  # noqa: E402
from torchref.precision import Policy as TorchPolicy  # noqa: E402

HP = dict(lr=3e-3, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1)
# One optax transformation for the module: it is a static argument of the jitted step (hashed by identity).
TX = optax.adamw(HP["lr"], HP["b1"], HP["b2"], HP["eps"], weight_decay=HP["weight_decay"])


def _twins(seed=0):
    torch.manual_seed(seed)
    tm = LlamaForCausalLM(TorchModelConfig.preset("tiny"))
    jm = hf.from_state_dict(ModelConfig.preset("tiny"), {k: v.detach().numpy() for k, v in tm.state_dict().items()})
    topt = torch.optim.AdamW(tm.parameters(), lr=HP["lr"], betas=(HP["b1"], HP["b2"]), eps=HP["eps"],
                             weight_decay=HP["weight_decay"])
    return tm, topt, jm, TX


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


def _jax_params_as_hf(graphdef, state):
    return hf.to_state_dict(state.model(graphdef))


def test_fp32_step_parity_three_adamw_steps():
    tm, topt, jm, tx = _twins()
    init = {k: v.detach().numpy().copy() for k, v in tm.state_dict().items()}
    graphdef, state = jtrain.TrainState.create(jm, tx, policy="fp32")
    assert isinstance(state.loss_scale, NoOpLossScale)
    # the loop form (jitted once, state donated); the fp16 test below exercises ``train_step`` itself
    step_fn = jtrain.make_train_step(graphdef, tx, policy="fp32", max_grad_norm=1.0, donate=True)
    rng = np.random.default_rng(0)
    for step in range(3):
        batch = _batch(rng)
        state, jm_ = step_fn(state, _to_jax(batch))
        tm_ = ttrain.train_step(tm, topt, _to_torch(batch), policy="fp32", max_grad_norm=1.0)
        np.testing.assert_allclose(float(jm_["loss"]), float(tm_["loss"]), rtol=1e-3, atol=2e-3,
                                   err_msg=f"loss at step {step}")
        np.testing.assert_allclose(float(jm_["grad_norm"]), float(tm_["grad_norm"]), rtol=1e-3, atol=1e-3)
        assert float(jm_["grad_norm"]) > 1.0  # the clip really acted (norm above max_norm)
        assert not bool(jm_["skipped"]) and not tm_["skipped"] and float(jm_["loss_scale"]) == 1.0
    jsd = _jax_params_as_hf(graphdef, state)
    moved = 0.0
    for k, v in tm.state_dict().items():
        np.testing.assert_allclose(jsd[k], v.detach().numpy(), rtol=1e-3, atol=2e-3, err_msg=k)
        moved = max(moved, float(np.abs(v.detach().numpy() - init[k]).max()))
    assert moved > 5e-3  # the params really moved (3 steps of lr 3e-3), so the comparison is not vacuous
    assert int(state.step) == 3 and int(state.opt_state[0].count) == 3


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
    graphdef, state = jtrain.TrainState.create(jm, tx, policy=policy,
                                               loss_scale=DynamicLossScale.create(init_scale=2.0 ** 8))
    scaler = TorchPolicy.preset(policy).make_grad_scaler("cpu", init_scale=2.0 ** 8)
    rng = np.random.default_rng(2)
    # one ordinary step so the optimizer state is not trivial
    batch = _batch(rng)
    state, jm_ = jtrain.train_step(graphdef, state, _to_jax(batch), tx=tx, policy=policy, max_grad_norm=1.0)
    tm_ = ttrain.train_step(tm, topt, _to_torch(batch), policy=policy, scaler=scaler, max_grad_norm=1.0)
    assert not bool(jm_["skipped"]) and not tm_["skipped"]
    assert jm_["loss_scale"] == tm_["loss_scale"] == 2.0 ** 8
    assert state.loss_scale.state_dict() == scaler.state_dict()  # tracker 1 on both sides
    # force an overflow: the scaled float32 loss is ~5.5 * 2**126 > float32 max
    sd = dict(scaler.state_dict(), scale=2.0 ** 126)
    scaler.load_state_dict(sd)
    state = state.replace(loss_scale=DynamicLossScale.from_state_dict(sd))
    j_before = jax.tree.map(np.asarray, (state.params, state.opt_state))
    t_params = {k: v.detach().clone() for k, v in tm.state_dict().items()}
    t_opt = {id_: {k: (v.clone() if torch.is_tensor(v) else v) for k, v in s.items()}
             for id_, s in enumerate(topt.state.values())}
    batch = _batch(rng)
    state, jm_ = jtrain.train_step(graphdef, state, _to_jax(batch), tx=tx, policy=policy, max_grad_norm=1.0)
    tm_ = ttrain.train_step(tm, topt, _to_torch(batch), policy=policy, scaler=scaler, max_grad_norm=1.0)
    assert bool(jm_["skipped"]) and tm_["skipped"]
    assert jm_["loss_scale"] == tm_["loss_scale"] == 2.0 ** 126
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, (state.params, state.opt_state)), j_before)
    for k, v in tm.state_dict().items():
        assert torch.equal(v, t_params[k]), k
    for id_, s in enumerate(topt.state.values()):
        for k, v in s.items():
            assert torch.equal(v, t_opt[id_][k]) if torch.is_tensor(v) else v == t_opt[id_][k], k
    expected = dict(sd, scale=2.0 ** 125, _growth_tracker=0)
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
            _, m = jax.eval_shape(lambda st, b: jtrain.train_step(graphdef, st, b, tx=tx, policy="fp16"),
                                  state, _to_jax(batch))
            ttrain.train_step(tm, topt, _to_torch(batch), policy="fp16")
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
        new, m = jax.eval_shape(lambda st, b: jtrain.train_step(graphdef, st, b, tx=tx, policy=name), state, batch)
        assert {x.dtype for x in jax.tree.leaves(new.params)} == {jnp.dtype(want)}, name
        assert {x.dtype for x in jax.tree.leaves(new.opt_state) if jnp.issubdtype(x.dtype, jnp.floating)} \
            == {jnp.dtype(want)}, name
        assert m["loss"].dtype == jnp.float32 and isinstance(new.loss_scale, NoOpLossScale)
    # the bf16 policy's traced forward really contains bf16 matmuls
    graphdef, state = jtrain.TrainState.create(jm, tx, policy="bf16")
    hlo = jax.jit(lambda st, b: jtrain._train_step(graphdef, st, b, tx=tx, policy=Policy.preset("bf16"),
                                                    max_grad_norm=None)).lower(state, batch).as_text()
    assert "bf16" in hlo and "dot_general" in hlo
    tm, _, _, _ = _twins()
    TorchPolicy.preset("bf16-pure").cast_model(tm)
    assert {p.dtype for p in tm.parameters()} == {torch.bfloat16} and tm.model.inv_freq.dtype == torch.float32
    topt = torch.optim.AdamW(tm.parameters(), lr=1e-3)
    mt = ttrain.train_step(tm, topt, _to_torch(_batch(np.random.default_rng(4))), policy="bf16-pure")
    assert np.isfinite(float(mt["loss"])) and {p.dtype for p in tm.parameters()} == {torch.bfloat16}
    assert {v.dtype for s in topt.state.values() for v in s.values() if v.is_floating_point() and v.ndim} \
        == {torch.bfloat16}


def test_bad_inputs_raise():
    tm, topt, jm, tx = _twins()
    graphdef, state = jtrain.TrainState.create(jm, tx)
    good = _batch(np.random.default_rng(5), packed=False)
    with pytest.raises(ValueError, match="batch keys"):
        jtrain.train_step(graphdef, state, {"input_ids": jnp.asarray(good["tokens"])}, tx=tx)
    with pytest.raises(ValueError, match="batch keys"):
        ttrain.train_step(tm, topt, {"input_ids": torch.from_numpy(good["tokens"])})
    bad_mask = dict(_to_jax(good), loss_mask=jnp.ones((2, 16), jnp.int32))
    with pytest.raises(ValueError, match=r"loss_mask.*\(2, 17\)"):
        jtrain.train_step(graphdef, state, bad_mask, tx=tx)
    with pytest.raises(ValueError, match="max_grad_norm"):
        jtrain.train_step(graphdef, state, _to_jax(good), tx=tx, max_grad_norm=-1.0)
    with pytest.raises(ValueError, match="max_grad_norm"):
        ttrain.train_step(tm, topt, _to_torch(good), max_grad_norm=0)
    with pytest.raises(ValueError, match="unknown precision preset"):
        jtrain.train_step(graphdef, state, _to_jax(good), tx=tx, policy="fp8")
    with pytest.raises(TypeError, match="optax.GradientTransformation"):
        jtrain.TrainState.create(jm, "adamw")
    with pytest.raises(ValueError, match="seq >= 2"):
        jtrain.train_step(graphdef, state, {"tokens": jnp.zeros((2, 1), jnp.int32)}, tx=tx)
    assert isinstance(Policy.preset("fp16").make_loss_scale(), DynamicLossScale)
