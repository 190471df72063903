"""Precision policies and matmul flags, ``jaxattn.precision`` vs ``torchref.precision``.

* Policy casts touch only floating leaves; the preset names and dtypes are identical in both packages.
* ``set_matmul_precision`` really sets (and restores) torch's five flags and ``jax_default_matmul_precision``.
* Low precision (design §7): for the MLP and attention blocks in bf16 and fp16, the error of the
  policy-driven JAX output (params cast by the policy) and of torch autocast, both against a float64 reference,
  is at most 2x the error of a naive low-precision implementation (the torch module cast wholesale to the low
  dtype). The bf16 whole model: per-token KL(p_torch_autocast || p_jax_policy) <= 0.02, on weights scaled up so
  the next-token distributions are peaked (at the default 0.02 init the logits are nearly uniform and any KL
  would be vacuously small).
* ``gpu``: the error of each matmul setting vs float64, both frameworks side by side (skipped without a GPU).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxattn import precision as jp
from twincore import params

torch = pytest.importorskip("torch")
from torchref import precision as tp  # noqa: E402

# ------------------------------------------------------------------------------------------------------------
# Policies
# ------------------------------------------------------------------------------------------------------------


def test_policy_casts_only_floating_leaves():
    rng = np.random.default_rng(0)
    tree = {
        "w": jnp.asarray(rng.standard_normal((3, 4)), jnp.float32),
        "ids": jnp.arange(3, dtype=jnp.int32),
        "flag": jnp.asarray([True, False]),
        "h": jnp.asarray(rng.standard_normal(2), jnp.float16),
        "none": None,
    }
    pol = jp.Policy.preset("bf16")
    low = pol.cast_to_compute(tree)
    assert low["w"].dtype == jnp.bfloat16 and low["h"].dtype == jnp.bfloat16
    assert low["ids"].dtype == jnp.int32 and low["flag"].dtype == jnp.bool_ and low["none"] is None
    back = pol.cast_to_param(low)
    assert back["w"].dtype == jnp.float32 and back["ids"].dtype == jnp.int32
    np.testing.assert_allclose(np.asarray(back["w"]), np.asarray(tree["w"]), rtol=2**-8)
    assert pol.cast_to_output(low["w"]).dtype == jnp.float32
    # an nnx.State (what the train step casts): Params cast, structure kept
    state = nnx.state(nnx.Linear(4, 3, rngs=nnx.Rngs(0)), nnx.Param)
    cast = jp.Policy.preset("fp16").cast_to_compute(state)
    assert jax.tree.structure(cast) == jax.tree.structure(state)
    assert {x.dtype for x in jax.tree.leaves(cast)} == {jnp.dtype(jnp.float16)}
    # custom policies and bad dtypes
    assert jp.Policy(jnp.float32, "bfloat16", np.float32) == jp.Policy.preset("bf16")
    assert jp.Policy(jnp.float32, jnp.float16, jnp.float16).name is None
    with pytest.raises(TypeError, match="compute_dtype.*int32"):
        jp.Policy(jnp.float32, jnp.int32, jnp.float32)
    with pytest.raises(TypeError, match="param_dtype"):
        tp.Policy(torch.int64, torch.float32, torch.float32)
    assert hash(jp.Policy.preset("fp16")) == hash(jp.get_policy("fp16"))  # usable as a static jit argument


def test_preset_names_and_dtypes_identical_in_both_packages():
    assert jp.PRESETS == tp.PRESETS == ("fp32", "bf16", "fp16", "bf16-pure")
    for name in jp.PRESETS:
        j, t = jp.Policy.preset(name), tp.get_policy(name)
        jd = [str(j.param_dtype), str(j.compute_dtype), str(j.output_dtype)]
        td = [str(d).replace("torch.", "") for d in (t.param_dtype, t.compute_dtype, t.output_dtype)]
        assert jd == td, name
        assert j.name == t.name == name and j.uses_loss_scaling == t.uses_loss_scaling == (name == "fp16")
    assert tp.get_policy("fp32").autocast_dtype is None and tp.get_policy("bf16-pure").autocast_dtype is None
    assert tp.get_policy("bf16").autocast_dtype == torch.bfloat16
    assert tp.get_policy("fp16").make_grad_scaler("cpu").is_enabled()
    assert not tp.get_policy("bf16").make_grad_scaler("cpu").is_enabled()
    for mod in (jp, tp):
        with pytest.raises(ValueError, match=r"name='fp8'.*fp32, bf16, fp16, bf16-pure"):
            mod.Policy.preset("fp8")
        with pytest.raises(ValueError, match="valid names"):
            mod.get_policy("BF16")


# ------------------------------------------------------------------------------------------------------------
# Matmul flags
# ------------------------------------------------------------------------------------------------------------


def _torch_flags():
    m = torch.backends.cuda.matmul
    return (
        torch.get_float32_matmul_precision(),
        m.allow_tf32,
        torch.backends.cudnn.allow_tf32,
        m.allow_fp16_reduced_precision_reduction,
        m.allow_bf16_reduced_precision_reduction,
    )


EXPECTED = {  # name -> (jax value, torch precision, matmul.allow_tf32, cudnn.allow_tf32)
    "highest": ("highest", "highest", False, False),
    "high": ("high", "high", True, True),
    "medium": ("default", "medium", True, True),
}


@pytest.mark.parametrize("name", list(EXPECTED))
def test_matmul_flags_are_set_and_restored(name):
    jax_before, torch_before = jax.config.jax_default_matmul_precision, _torch_flags()
    jax_val, t_prec, t_tf32, t_cudnn = EXPECTED[name]
    flip16 = not torch_before[3]
    with (
        jp.set_matmul_precision(name, allow_fp16_reduced_precision_reduction=False),
        tp.set_matmul_precision(
            name, allow_fp16_reduced_precision_reduction=flip16, allow_bf16_reduced_precision_reduction=False
        ),
    ):
        assert jax.config.jax_default_matmul_precision == jax_val
        assert _torch_flags() == (t_prec, t_tf32, t_cudnn, flip16, False)
    assert jax.config.jax_default_matmul_precision == jax_before
    assert _torch_flags() == torch_before
    # plain-call form + explicit restore, and the context-manager helpers
    prev_j, prev_t = jp.set_matmul_precision(name), tp.set_matmul_precision(name)
    assert jax.config.jax_default_matmul_precision == jax_val and _torch_flags()[0] == t_prec
    prev_j.restore()
    prev_t.restore()
    assert jax.config.jax_default_matmul_precision == jax_before and _torch_flags() == torch_before
    with jp.matmul_precision(name), tp.matmul_precision(name):
        assert jax.config.jax_default_matmul_precision == jax_val and _torch_flags()[0] == t_prec
    assert jax.config.jax_default_matmul_precision == jax_before and _torch_flags() == torch_before


def test_matmul_flag_errors():
    for mod in (jp, tp):
        with pytest.raises(ValueError, match=r"name='fastest'.*highest, high, medium"):
            mod.set_matmul_precision("fastest")
        with pytest.raises(TypeError, match="allow_bf16_reduced_precision_reduction"):
            mod.set_matmul_precision("high", allow_bf16_reduced_precision_reduction="yes")
    before = jax.config.jax_default_matmul_precision
    with pytest.raises(ValueError, match="no JAX equivalent.*F16_F16_F16"):
        jp.set_matmul_precision("high", allow_fp16_reduced_precision_reduction=True)
    assert jax.config.jax_default_matmul_precision == before  # nothing was changed by the failed call


# ------------------------------------------------------------------------------------------------------------
# Low-precision modules: the 2x rule
# ------------------------------------------------------------------------------------------------------------

LOW = {"bf16": (jnp.bfloat16, torch.bfloat16), "fp16": (jnp.float16, torch.float16)}


def _tiny_cfgs():
    from jaxattn.config import ModelConfig as JC
    from torchref.config import ModelConfig as TC

    return JC.preset("tiny"), TC.preset("tiny")


def _max_err(a, ref):
    return float(np.abs(np.asarray(a, np.float64) - ref).max())


def _random_module(cls, cfg, seed: int, std: float):
    """``cls(cfg)`` with every parameter drawn from N(0, std), after ``torch.manual_seed(seed)``."""
    torch.manual_seed(seed)
    mod = cls(cfg)
    with torch.no_grad():
        for p in mod.parameters():
            p.normal_(0, std)
    return mod


def _assert_2x_rule(what: str, low: str, naive, jax_policy, autocast, ref):
    """JAX's policy and torch's autocast are each within 2x the error (vs the float64 ``ref``) of ``naive``, the
    module run with everything in the low dtype."""
    e_naive, e_jax, e_auto = _max_err(naive, ref), _max_err(jax_policy, ref), _max_err(autocast, ref)
    print(f"{what} {low}: naive {e_naive:.3e} jax policy {e_jax:.3e} torch autocast {e_auto:.3e}")
    assert e_naive > 0
    assert e_jax <= 2 * e_naive, (low, e_jax, e_naive)
    assert e_auto <= 2 * e_naive, (low, e_auto, e_naive)


@pytest.mark.parametrize("low", list(LOW))
def test_mlp_block_low_precision_2x_rule(low):
    from jaxattn.model import mlp_block
    from torchref.model import LlamaMLP

    jcfg, tcfg = _tiny_cfgs()
    mod = _random_module(LlamaMLP, tcfg, seed=1, std=0.1)
    x = torch.randn(2, 16, tcfg.dim)
    jdt, tdt = LOW[low]
    ref = mod.double()(x.double()).detach().numpy()
    mod.float()
    naive = _clone(mod).to(tdt)(x.to(tdt)).detach().float().numpy()  # everything in the low dtype
    with tp.get_policy(low).autocast("cpu"):
        autocast = mod(x).detach().float().numpy()
    p = _jax_params(mod, "mlp.", tcfg)
    pol = jp.Policy.preset(low)
    out = jax.jit(lambda x, p: pol.cast_to_output(mlp_block(pol.cast_to_compute(x), pol.cast_to_compute(p))))(
        jnp.asarray(x.numpy()), jax.tree.map(jnp.asarray, p)
    )
    assert out.dtype == jnp.float32
    _assert_2x_rule("mlp", low, naive, out, autocast, ref)


@pytest.mark.parametrize("low", list(LOW))
def test_attention_block_low_precision_2x_rule(low):
    from jaxattn.model import attention_block
    from jaxattn.model import rope_cos_sin as j_rope
    from torchref.model import LlamaAttention
    from torchref.model import rope_cos_sin as t_rope

    jcfg, tcfg = _tiny_cfgs()
    mod = _random_module(LlamaAttention, tcfg, seed=2, std=0.15)
    b, s = 2, 16
    x = torch.randn(b, s, tcfg.dim)
    pos = torch.arange(s).expand(b, s)
    inv = torch.from_numpy(tcfg.rope_inv_freq())
    cos, sin = t_rope(inv, pos)
    jdt, tdt = LOW[low]
    ref = _attention_ref64(x.numpy(), mod, cos.numpy(), sin.numpy(), tcfg)
    assert _max_err(mod(x, cos, sin).detach().numpy(), ref) < 1e-5  # the float64 reference is the same function
    naive = _clone(mod).to(tdt)(x.to(tdt), cos, sin).detach().float().numpy()
    with tp.get_policy(low).autocast("cpu"):
        autocast = mod(x, cos, sin).detach().float().numpy()
    p = {k: jnp.asarray(v) for k, v in _jax_params(mod, "self_attn.", tcfg).items()}
    jcos, jsin = j_rope(jnp.asarray(jcfg.rope_inv_freq()), jnp.broadcast_to(jnp.arange(s), (b, s)))
    pol = jp.Policy.preset(low)
    out = jax.jit(
        lambda x, p: pol.cast_to_output(
            attention_block(pol.cast_to_compute(x), pol.cast_to_compute(p), jcos, jsin, jcfg)
        )
    )(jnp.asarray(x.numpy()), p)
    _assert_2x_rule("attention", low, naive, out, autocast, ref)


def _jax_params(mod, prefix: str, cfg) -> dict:
    """A torch block's weights as the JAX block's parameters, from the parameter table: each linear row of a layer
    whose torch module is under ``prefix`` (``mlp.``: w_gate / w_up / w_down), transposed to JAX's ``[in, out]``."""
    rows = [r for r in params.layer_rows(cfg) if r.kind == "linear" and r.module.startswith(prefix)]
    return {r.name: getattr(mod, r.module.removeprefix(prefix)).weight.detach().numpy().T for r in rows}


def _attention_ref64(x, mod, cos, sin, cfg):
    """float64 numpy causal GQA attention block with HF rotate_half RoPE (torchref's attention rejects float64)."""
    w = {
        n: getattr(mod, n).weight.detach().numpy().astype(np.float64) for n in ("q_proj", "k_proj", "v_proj", "o_proj")
    }
    b, s, _ = x.shape
    d, hq, hk = cfg.resolved_head_dim, cfg.n_heads, cfg.n_kv_heads
    x = x.astype(np.float64)
    q = (x @ w["q_proj"].T).reshape(b, s, hq, d).transpose(0, 2, 1, 3)
    k = (x @ w["k_proj"].T).reshape(b, s, hk, d).transpose(0, 2, 1, 3)
    v = (x @ w["v_proj"].T).reshape(b, s, hk, d).transpose(0, 2, 1, 3)
    cos, sin = cos.astype(np.float64), sin.astype(np.float64)  # [B, 1, S, D]

    def rope(t):
        t1, t2 = t[..., : d // 2], t[..., d // 2 :]
        return t * cos + np.concatenate([-t2, t1], -1) * sin

    q, k = rope(q), rope(k)
    k, v = np.repeat(k, hq // hk, axis=1), np.repeat(v, hq // hk, axis=1)
    scores = q @ k.transpose(0, 1, 3, 2) / np.sqrt(d)
    scores = np.where(np.tril(np.ones((s, s), bool)), scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    o = (probs @ v).transpose(0, 2, 1, 3).reshape(b, s, hq * d)
    return o @ w["o_proj"].T


def _clone(mod):
    import copy

    return copy.deepcopy(mod)


# ------------------------------------------------------------------------------------------------------------
# bf16 whole model: KL
# ------------------------------------------------------------------------------------------------------------


def _kl(p_logits, q_logits):
    lp = torch.log_softmax(torch.from_numpy(np.asarray(p_logits, np.float64)), -1)
    lq = torch.log_softmax(torch.from_numpy(np.asarray(q_logits, np.float64)), -1)
    return (lp.exp() * (lp - lq)).sum(-1).numpy()  # per token


def test_bf16_model_kl_torch_autocast_vs_jax_policy():
    from jaxattn import hf
    from torchref.model import LlamaForCausalLM

    jcfg, tcfg = _tiny_cfgs()
    torch.manual_seed(3)
    tm = LlamaForCausalLM(tcfg)
    with torch.no_grad():  # peaked distributions: weights std 0.1, LM head std 0.5 (logit std of a few units)
        for name, p in tm.named_parameters():
            if "norm" not in name:
                p.mul_(5.0)
        tm.lm_head.weight.mul_(5.0)
    jm = hf.from_state_dict(jcfg, {k: v.detach().numpy() for k, v in tm.state_dict().items()})
    tokens = np.random.default_rng(4).integers(0, tcfg.vocab_size, (2, 32))
    with torch.no_grad():
        t32 = tm(torch.from_numpy(tokens)).numpy()
        with tp.get_policy("bf16").autocast("cpu"):
            t16 = tm(torch.from_numpy(tokens)).numpy()
    graphdef, params, rest = nnx.split(jm, nnx.Param, ...)
    pol = jp.Policy.preset("bf16")

    @jax.jit
    def fwd(params, tokens):
        return nnx.merge(graphdef, pol.cast_to_compute(params), rest)(tokens)

    j16 = fwd(params, jnp.asarray(tokens, jnp.int32))
    assert j16.dtype == jnp.float32
    assert float(np.std(t32)) > 2.0  # the distributions are peaked, so the KL below is meaningful
    kl = _kl(t16, np.asarray(j16))
    print(f"bf16 model: per-token KL max {kl.max():.3e} mean {kl.mean():.3e}; logit std {np.std(t32):.2f}")
    assert kl.max() <= 0.02, kl.max()
    # the bf16 runs really are low precision: both differ measurably from the fp32 logits
    assert _kl(t32, np.asarray(j16)).mean() > 1e-6 and _kl(t32, t16).mean() > 1e-6


# ------------------------------------------------------------------------------------------------------------
# GPU: error of each matmul setting against float64, both frameworks side by side
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_matmul_precision_settings_error_on_gpu():
    """Relative error of a float32 [512x2048]@[2048x512] matmul at each setting, and of float16 matmuls with and
    without torch's reduced-precision reduction, vs float64. Prints the table (run with -s to see it).

    Expected on Ampere/Hopper: "highest" ~1e-7 relative in both; "high"/"medium" both TF32 (~1e-4, 10-bit
    mantissa) in both, so the JAX error at each level is within 2x of torch's. fp16: XLA always reduces in float32,
    so JAX's fp16 error is within 2x of torch's with the reduced-precision-reduction flag OFF. Without a CUDA
    build of torch on the machine only the JAX column is measured and checked.
    """
    torch_cuda = torch.cuda.is_available()
    rng = np.random.default_rng(0)
    a = rng.standard_normal((512, 2048)).astype(np.float32)
    b = rng.standard_normal((2048, 512)).astype(np.float32)
    ref = a.astype(np.float64) @ b.astype(np.float64)
    scale = np.abs(ref).max()
    gpu = jax.devices("gpu")[0]
    ja, jb = jax.device_put(a, gpu), jax.device_put(b, gpu)
    if torch_cuda:
        ta, tb = torch.from_numpy(a).cuda(), torch.from_numpy(b).cuda()
    errs, rows = {}, []
    for name in jp.MATMUL_PRECISIONS:
        with jp.matmul_precision(name), tp.matmul_precision(name):
            jout = np.asarray(jax.jit(jnp.matmul)(ja, jb))  # a fresh jit: the flag is read at trace time
            tout = (ta @ tb).cpu().numpy() if torch_cuda else None
        ej = np.abs(jout - ref).max() / scale
        et = np.abs(tout - ref).max() / scale if torch_cuda else float("nan")
        errs[name] = (ej, et)
        rows.append(f"fp32 {name:8s} jax {ej:.3e}  torch {et:.3e}")
    a16, b16 = a.astype(np.float16), b.astype(np.float16)
    ref16 = a16.astype(np.float64) @ b16.astype(np.float64)
    s16 = np.abs(ref16).max()
    j16 = (
        np.abs(
            np.asarray(jax.jit(jnp.matmul)(ja.astype(jnp.float16), jb.astype(jnp.float16)), np.float64) - ref16
        ).max()
        / s16
    )
    t16 = {}
    if torch_cuda:
        for flag in (True, False):
            with tp.matmul_precision("highest", allow_fp16_reduced_precision_reduction=flag):
                t16[flag] = np.abs((ta.half() @ tb.half()).double().cpu().numpy() - ref16).max() / s16
    rows.append(
        f"fp16 jax {j16:.3e}  torch reduced-precision-reduction on {t16.get(True, float('nan')):.3e} "
        f"off {t16.get(False, float('nan')):.3e}"
    )
    print("\n" + "\n".join(rows))
    assert errs["highest"][0] < 1e-5
    assert j16 < 2e-3  # float16 output rounding (2**-11) dominates; float32 accumulation keeps it there
    if torch_cuda:
        assert errs["highest"][1] < 1e-5
        for name, (ej, et) in errs.items():
            assert ej <= 2 * et + 1e-7, (name, ej, et)
        assert j16 <= 2 * t16[False] + 1e-7
