"""``jaxattn.loss_scale.DynamicLossScale`` against the real ``torch.amp.GradScaler`` (CPU).

Torch's scaler is driven with a tiny ``nn.Linear`` whose gradients are overwritten each step with the same
random (scaled) values the JAX side sees, with inf / -inf / NaN injected at random steps. Every step must give
the same skip decision, the same scale (bit-exact float32), the same growth tracker and the same unscaled
gradients. State dicts move between the two mid-sequence and both continue identically.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxattn.loss_scale import DynamicLossScale, NoOpLossScale, all_finite, select_tree
from jaxattn.precision import Policy

torch = pytest.importorskip("torch")

SHAPES = {"weight": (3, 4), "bias": (3,)}


def _make_torch(**kwargs):
    lin = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", **kwargs)
    return lin, opt, scaler


def _grads_schedule(n_steps: int, seed: int, p_bad: float = 0.12):
    """Per step: dict name -> float32 array of UNSCALED gradients, with non-finite values injected."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n_steps):
        g = {k: rng.standard_normal(s).astype(np.float32) * np.float32(1e-3) for k, s in SHAPES.items()}
        if rng.random() < p_bad:
            name = rng.choice(list(SHAPES))
            flat = g[name].reshape(-1)
            flat[rng.integers(flat.size)] = rng.choice([np.inf, -np.inf, np.nan])
        out.append(g)
    return out


def _torch_step(lin, opt, scaler, grads):
    """One GradScaler iteration with the gradients overwritten; returns (skipped, unscaled grads, scale used)."""
    scaler.scale(torch.ones(()))  # lazily creates the scale tensor, as scaler.scale(loss) does
    scale = scaler.get_scale()
    params = dict(lin.named_parameters())
    for k, g in grads.items():
        params[k].grad = torch.from_numpy(g * np.float32(scale))  # the scaled gradient backward() would give
    before = {k: p.detach().clone() for k, p in params.items()}
    scaler.unscale_(opt)
    unscaled = {k: p.grad.detach().numpy().copy() for k, p in params.items()}
    scaler.step(opt)
    scaler.update()
    stepped = [not torch.equal(before[k], p.detach()) for k, p in params.items()]
    return not any(stepped), unscaled, scale


def _jax_step(ls: DynamicLossScale, grads):
    scaled = {k: jnp.asarray(g) * ls.loss_scale for k, g in grads.items()}
    return _jax_core(ls, scaled)


@jax.jit
def _jax_core(ls, scaled):
    finite = ls.all_finite(scaled)  # GradScaler checks the SCALED gradients
    return ls.update(finite), ~finite, ls.unscale(scaled)


def _assert_same(step, t_skip, t_unscaled, t_scaler, j_skip, j_unscaled, j_ls, scale_used):
    assert bool(j_skip) == t_skip, f"step {step}: skip torch={t_skip} jax={bool(j_skip)}"
    sd_t, sd_j = t_scaler.state_dict(), j_ls.state_dict()
    assert sd_j == sd_t, f"step {step}: torch {sd_t} != jax {sd_j}"
    assert np.float32(sd_j["scale"]) == np.asarray(j_ls.loss_scale)  # float32 bit pattern round-trips
    if scale_used > 2.0**126:
        # 1/scale is a float32 subnormal: torch keeps it, XLA flushes subnormals to zero (FTZ), so the
        # unscaled gradients differ. Scale, tracker and skip decisions above still match exactly.
        return
    for k in SHAPES:
        np.testing.assert_array_equal(np.asarray(j_unscaled[k]), t_unscaled[k], err_msg=f"step {step} grad {k}")


def _run_both(n_steps, seed, torch_kwargs, *, handover_at=None, direction="torch->jax"):
    grads = _grads_schedule(n_steps, seed)
    lin, opt, scaler = _make_torch(**torch_kwargs)
    ls = DynamicLossScale.create(**torch_kwargs)
    n_skips = n_growths = 0
    last_scale = scaler.get_scale()
    for i, g in enumerate(grads):
        if handover_at is not None and i == handover_at:
            if direction == "torch->jax":
                ls = DynamicLossScale.from_state_dict(scaler.state_dict())
            else:
                _, _, scaler = _make_torch(**torch_kwargs)
                scaler.load_state_dict(ls.state_dict())
                opt = torch.optim.SGD(lin.parameters(), lr=0.1)
        t_skip, t_unscaled, scale_used = _torch_step(lin, opt, scaler, g)
        ls, j_skip, j_unscaled = _jax_step(ls, g)
        _assert_same(i, t_skip, t_unscaled, scaler, j_skip, j_unscaled, ls, scale_used)
        n_skips += t_skip
        n_growths += scaler.get_scale() > last_scale
        last_scale = scaler.get_scale()
    return n_skips, n_growths


def test_trajectory_matches_gradscaler_interval_7():
    """300 steps, growth_interval=7, ~12% of steps with an inf/-inf/NaN gradient: every decision identical.

    The rule being checked, step for step the same as GradScaler (``torch/amp/grad_scaler.py`` and the
    ``_amp_update_scale_`` and ``_amp_foreach_non_finite_check_and_unscale_`` kernels):

    * ``scale(loss)`` multiplies by the scale (GradScaler.scale).
    * non-finite detection looks at the SCALED gradients (the kernel checks each value before unscaling);
      ``unscale(grads)`` multiplies by ``1/scale`` computed in float32 (torch computes the reciprocal in float64
      and rounds to float32; IEEE division makes the two identical, double rounding being innocuous for 53 >=
      2*24+2 bits), in float32 for half-precision gradients, like torch's opmath.
    * ``update(finite)``: on a non-finite step ``scale *= backoff_factor`` and the tracker resets to 0; otherwise
      the tracker is incremented and, when it reaches ``growth_interval``, ``scale *= growth_factor`` (only if
      the result is finite; torch never grows to inf) and the tracker resets to 0.
    * the caller skips the optimizer step on a non-finite step (``select``), leaving params and optimizer state
      untouched.
    """
    n_skips, n_growths = _run_both(300, seed=0, torch_kwargs=dict(growth_interval=7))
    assert n_skips >= 20 and n_growths >= 5  # the sequence exercised both branches many times


def test_trajectory_matches_gradscaler_other_factors():
    """Non-default (float32-representable) factors and init scale.

    Exactness note: torch multiplies the float32 scale by the factor in float64 and rounds to float32;
    ``DynamicLossScale`` rounds the factor to float32 first. The results are bit-identical whenever the factor
    is representable in float32 (the defaults 2.0 and 0.5, any power of two; most short decimals are NOT —
    e.g. 0.3 can differ by one float32 ulp of the scale), hence the factors chosen here.
    """
    n_skips, n_growths = _run_both(
        120, seed=1, torch_kwargs=dict(init_scale=1024.0, growth_factor=4.0, backoff_factor=0.25, growth_interval=3)
    )
    assert n_skips >= 5 and n_growths >= 5


def test_growth_never_overflows_to_inf():
    """Near float32 max torch keeps the scale when growing would give inf, yet resets the tracker."""
    n_skips, n_growths = _run_both(40, seed=2, torch_kwargs=dict(init_scale=2.0**126, growth_interval=2))
    assert n_growths >= 1


@pytest.mark.parametrize("direction", ["torch->jax", "jax->torch"])
def test_state_dict_handover_mid_sequence(direction):
    """Hand the scaler state across frameworks at step 57 (tracker mid-interval); both continue identically."""
    n_skips, n_growths = _run_both(
        150, seed=3, torch_kwargs=dict(growth_interval=7), handover_at=57, direction=direction
    )
    assert n_skips >= 5 and n_growths >= 3


def test_default_interval_sees_one_growth():
    """Defaults (2**16, 2.0, 0.5, 2000): two skips, then 2000 finite steps -> one growth at exactly step 2000."""
    n = 2012
    finite = np.ones(n, bool)
    finite[[3, 10]] = False  # two backoffs early; the growth run starts after step 10
    lin, opt, scaler = _make_torch()
    torch_scales = []
    for ok in finite:
        scaler.scale(torch.ones(()))
        lin.weight.grad = torch.full((3, 4), 1.0 if ok else float("inf"))
        lin.bias.grad = torch.ones(3)
        scaler.step(opt)
        scaler.update()
        torch_scales.append(scaler.get_scale())

    def body(ls, ok):
        ls = ls.update(ok)
        return ls, (ls.loss_scale, ls.growth_tracker)

    ls0 = DynamicLossScale.create()
    ls_end, (scales, _) = jax.jit(lambda ls, f: jax.lax.scan(body, ls, f))(ls0, jnp.asarray(finite))
    np.testing.assert_array_equal(np.asarray(scales), np.asarray(torch_scales, np.float32))
    assert ls_end.state_dict() == scaler.state_dict()
    # after the update of step 10 the scale is 2**14; steps 11..2010 are the 2000 finite ones
    assert torch_scales[10] == 2.0**14 and torch_scales[10 + 1999] == 2.0**14
    assert torch_scales[10 + 2000] == 2.0**15  # the growth happened, exactly there


def test_state_dict_keys_and_errors():
    ls = DynamicLossScale.create()
    lin, opt, scaler = _make_torch()
    assert ls.state_dict() == scaler.state_dict()  # a fresh scaler: same keys, values and Python types
    assert [type(v) for v in ls.state_dict().values()] == [type(v) for v in scaler.state_dict().values()]
    sd = ls.state_dict()
    del sd["_growth_tracker"], sd["backoff_factor"]
    with pytest.raises(ValueError, match=r"missing keys \['backoff_factor', '_growth_tracker'\]"):
        ls.load_state_dict(sd)
    with pytest.raises(ValueError, match="empty"):
        DynamicLossScale.from_state_dict({})
    with pytest.raises(ValueError, match="unexpected keys \\['extra'\\]"):
        DynamicLossScale.from_state_dict({**ls.state_dict(), "extra": 1})
    with pytest.raises(TypeError, match="mapping"):
        DynamicLossScale.from_state_dict([("scale", 1.0)])
    with pytest.raises(TypeError, match="_growth_tracker"):
        DynamicLossScale.from_state_dict({**ls.state_dict(), "_growth_tracker": "3"})
    for bad in (dict(growth_factor=1.0), dict(backoff_factor=1.0), dict(growth_interval=0), dict(init_scale=-1.0)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            DynamicLossScale.create(**bad)
    with pytest.raises(ValueError, match="NoOpLossScale has no state"):
        NoOpLossScale().load_state_dict({"scale": 1.0})
    assert NoOpLossScale().state_dict() == torch.amp.GradScaler("cpu", enabled=False).state_dict() == {}


def test_loss_scale_inside_jit_and_select():
    """scale/unscale/select compose under jit; a skipped step keeps the old tree (ints included) bit-for-bit."""
    ls = Policy.preset("fp16").make_loss_scale(growth_interval=5)
    assert isinstance(ls, DynamicLossScale) and isinstance(Policy.preset("bf16").make_loss_scale(), NoOpLossScale)
    old = {"w": jnp.arange(4.0), "count": jnp.asarray(3, jnp.int32)}
    new = {"w": jnp.arange(4.0) + 1, "count": jnp.asarray(4, jnp.int32)}

    @jax.jit
    def f(ls, g):
        finite = ls.all_finite(g)
        return ls.update(finite), ls.select(finite, new, old)

    ls1, kept = f(ls, {"g": jnp.asarray([1.0, jnp.nan])})
    assert float(ls1.loss_scale) == 2.0**15 and int(ls1.growth_tracker) == 0
    jax.tree.map(np.testing.assert_array_equal, kept, old)
    ls2, taken = f(ls, {"g": jnp.asarray([1.0, 2.0])})
    assert float(ls2.loss_scale) == 2.0**16 and int(ls2.growth_tracker) == 1
    jax.tree.map(np.testing.assert_array_equal, taken, new)
    assert bool(all_finite({"i": jnp.asarray([1, 2])}))  # integer leaves are ignored
    with pytest.raises(ValueError, match="scalar"):
        select_tree(jnp.asarray([True, False]), new, old)
    # fp16 gradients are unscaled in float32 and cast back (torch's opmath)
    g16 = {"g": jnp.asarray([3.0, 65504.0], jnp.float16)}
    np.testing.assert_array_equal(
        np.asarray(ls.unscale(g16)["g"]), (np.asarray([3.0, 65504.0], np.float32) / 65536.0).astype(np.float16)
    )


BAD_SCALES = [
    0.0,
    -1.0,
    float("nan"),
    float("inf"),
    -float("inf"),
    1e40,
    1e-50,
    np.float64(1e40),
    np.asarray(float("nan")),
]


@pytest.mark.parametrize("bad", BAD_SCALES, ids=repr)
def test_bad_scale_refused_by_create_and_state_dict(bad):
    """A scale that is not finite and > 0 in float32 (1e40 overflows to inf, 1e-50 underflows to 0) is refused
    the same way by ``create`` and by ``load_state_dict`` / ``from_state_dict``, naming the field."""
    with pytest.raises(ValueError, match=r"init_scale must be a finite float > 0"):
        DynamicLossScale.create(init_scale=bad)
    ls = DynamicLossScale.create()
    sd = {**ls.state_dict(), "scale": bad}
    with pytest.raises(ValueError, match=r"state_dict\['scale'\] must be a finite float > 0"):
        ls.load_state_dict(sd)
    with pytest.raises(ValueError, match=r"state_dict\['scale'\]"):
        DynamicLossScale.from_state_dict(sd)


def test_numpy_scalars_and_0d_arrays_accepted_bools_refused():
    """Every numeric field takes numpy scalars and 0-d arrays (numpy, jax, torch) like Python numbers."""
    want = DynamicLossScale.create(init_scale=2.0, growth_factor=4.0, backoff_factor=0.25, growth_interval=3)
    variants = [
        dict(
            init_scale=np.float32(2.0),
            growth_factor=np.float64(4.0),
            backoff_factor=np.float16(0.25),
            growth_interval=np.int64(3),
        ),
        dict(
            init_scale=np.asarray(2.0),
            growth_factor=jnp.asarray(4.0),
            backoff_factor=torch.tensor(0.25),
            growth_interval=np.asarray(3, np.int32),
        ),
        dict(init_scale=2, growth_factor=np.int8(4), backoff_factor=0.25, growth_interval=np.uint16(3)),
    ]
    for kw in variants:
        got = DynamicLossScale.create(**kw)
        assert got.state_dict() == want.state_dict(), kw
        assert type(got.growth_factor) is float and type(got.growth_interval) is int
    sd = {
        "scale": np.float32(2.0),
        "growth_factor": jnp.asarray(4.0),
        "backoff_factor": torch.tensor(0.25),
        "growth_interval": np.int64(3),
        "_growth_tracker": torch.tensor(2),
    }
    got = DynamicLossScale.from_state_dict(sd)
    assert got.state_dict() == {**want.state_dict(), "_growth_tracker": 2}
    assert [type(v) for v in got.state_dict().values()] == [float, float, float, int, int]
    # bools and bool arrays are refused everywhere (TypeError naming the field)
    for field, bad in (
        ("init_scale", True),
        ("growth_factor", np.bool_(True)),
        ("growth_interval", True),
        ("backoff_factor", np.asarray(False)),
        ("init_scale", "2.0"),
        ("init_scale", np.asarray([2.0])),
    ):
        with pytest.raises(TypeError, match=field):
            DynamicLossScale.create(**{field: bad})
    for key, bad in (
        ("scale", True),
        ("growth_interval", np.bool_(True)),
        ("_growth_tracker", torch.tensor(True)),
        ("growth_factor", np.ones(2)),
        ("backoff_factor", None),
    ):
        with pytest.raises(TypeError, match=rf"state_dict\['{key}'\]"):
            DynamicLossScale.from_state_dict({**want.state_dict(), key: bad})


@pytest.mark.parametrize(
    "key, bad",
    [
        ("growth_factor", 1.0),
        ("growth_factor", 1e40),
        ("growth_factor", float("nan")),
        ("growth_factor", 1.00000001),
        ("backoff_factor", 0.0),
        ("backoff_factor", 1.0),
        ("backoff_factor", 1e-50),
        ("growth_interval", 0),
        ("growth_interval", 2**31),
        ("growth_interval", 2.5),
        ("_growth_tracker", -1),
        ("_growth_tracker", 2000),
    ],
)
def test_bad_state_dict_fields_refused(key, bad):
    """Factors are checked after rounding to float32 (1.00000001 -> 1.0 would never grow); the tracker must be
    in [0, growth_interval), the only states GradScaler reaches (it never grows from a tracker past it)."""
    ls = DynamicLossScale.create()
    with pytest.raises((ValueError, TypeError), match=rf"state_dict\['{key}'\]"):
        ls.load_state_dict({**ls.state_dict(), key: bad})
    # a state dict that went through a float (e.g. JSON from another tool) still loads integral values
    assert (
        DynamicLossScale.from_state_dict(
            {**ls.state_dict(), "growth_interval": 7.0, "_growth_tracker": 3.0}
        ).state_dict()["_growth_tracker"]
        == 3
    )
