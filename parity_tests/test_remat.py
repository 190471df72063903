"""Remat policies (``jaxattn.remat`` / ``torchref.remat``) in both frameworks, tiny preset, CPU, fp32.

* Gradients with each policy equal the gradients without remat in the same framework (recomputation repeats
  the same float ops; only rounding from a different fusion or op order can differ: rtol 1e-5, atol 1e-6), and
  torch equals JAX at the fp32 gradient tolerance (rtol = atol = 1e-3, design §7) for every policy.
* The policies really change what is kept for the backward pass: in JAX the saved residuals, in torch the bytes
  the forward leaves alive (``benchmarks.suites.remat.torch_saved_bytes``), shrink none > save_dots > save_qkv_attn >
  full; torch's ``save_qkv_attn`` keeps exactly q/k/v and the attention output per layer call.
* Bad input: an unknown policy is a ValueError listing the names (both ``apply`` functions, the model setting);
  ``offload`` on a device with no host memory space is a ValueError saying why and what else to use.
"""

from __future__ import annotations

import contextlib
import io

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxattn import hf as jhf
from jaxattn import remat as jremat
from twincore.remat import REMAT_POLICIES

torch = pytest.importorskip("torch")
from benchmarks.suites.remat import torch_saved_bytes  # noqa: E402
from benchmarks.twins import twin_models  # noqa: E402
from torchref import remat as tremat  # noqa: E402
from torchref.config import ModelConfig  # noqa: E402

SAME_RTOL, SAME_ATOL = 1e-5, 1e-6  # fp32 rounding of one framework against itself
GRAD_TOL = 1e-3  # design §7, fp32 gradients, torch vs JAX
POLICIES = [p for p in REMAT_POLICIES if p != "none"]


def _batch(cfg, rng):
    tok = rng.integers(0, cfg.vocab_size, (2, 12))
    seg = np.repeat(np.array([[0] * 7 + [1] * 5]), 2, axis=0)  # packed: exercises the masked SDPA path
    return tok, seg


@pytest.fixture(scope="module")
def setup():
    tmodel, jmodel = twin_models(ModelConfig.preset("tiny"), seed=31)
    tok, seg = _batch(tmodel.config, np.random.default_rng(32))
    return tmodel, jmodel, tok, seg


def _jax_loss(graphdef, rest, tok, seg):
    def loss(params):
        logits = nnx.merge(graphdef, params, rest)(tok[:, :-1], segment_ids=seg[:, :-1])
        lp = jax.nn.log_softmax(logits, -1)
        return -jnp.take_along_axis(lp, tok[:, 1:, None], -1).mean()

    return loss


def _jax_grads(jmodel, policy, tok, seg):
    """HF-keyed numpy gradients of the JAX model with ``policy``, and the jaxpr of the gradient."""
    model = jremat.apply(nnx.merge(*nnx.split(jmodel)), policy)  # a copy: the fixture's model stays "none"
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    tok, seg = jnp.asarray(tok, jnp.int32), jnp.asarray(seg, jnp.int32)
    grad = jax.grad(_jax_loss(graphdef, rest, tok, seg))
    grads = jax.jit(grad)(params)
    return jhf.to_state_dict(nnx.merge(graphdef, grads, rest)), str(jax.make_jaxpr(grad)(params))


def _torch_grads(tmodel, policy, tok, seg):
    tremat.apply(tmodel, policy)
    try:
        tmodel.zero_grad(set_to_none=True)
        logits = tmodel(torch.from_numpy(tok[:, :-1]), segment_ids=torch.from_numpy(seg[:, :-1]))
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), torch.from_numpy(tok[:, 1:]).flatten()).backward()
        return {k: p.grad.numpy().copy() for k, p in tmodel.named_parameters()}
    finally:
        tremat.apply(tmodel, "none")


@pytest.fixture(scope="module")
def reference_grads(setup):
    tmodel, jmodel, tok, seg = setup
    return _jax_grads(jmodel, "none", tok, seg)[0], _torch_grads(tmodel, "none", tok, seg)


@pytest.mark.parametrize("policy", POLICIES)
def test_policy_gradients_equal_no_remat_and_match_across_frameworks(setup, reference_grads, policy):
    tmodel, jmodel, tok, seg = setup
    jref, tref = reference_grads
    jg, jaxpr = _jax_grads(jmodel, policy, tok, seg)
    assert "checkpoint" in jaxpr or "remat" in jaxpr  # the policy is really applied
    tg = _torch_grads(tmodel, policy, tok, seg)
    assert set(jg) == set(tg) == set(tref)
    for k in tref:
        np.testing.assert_allclose(jg[k], jref[k], rtol=SAME_RTOL, atol=SAME_ATOL, err_msg=f"jax {policy}: {k}")
        np.testing.assert_allclose(tg[k], tref[k], rtol=SAME_RTOL, atol=SAME_ATOL, err_msg=f"torch {policy}: {k}")
        np.testing.assert_allclose(jg[k], tg[k], rtol=GRAD_TOL, atol=GRAD_TOL, err_msg=f"jax vs torch {policy}: {k}")
    assert max(float(np.abs(g).max()) for g in tg.values()) > 1e-3  # not vacuous


def _saved_residuals(jmodel, name, tok, seg):
    model = jremat.apply(nnx.merge(*nnx.split(jmodel)), name)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        jax.ad_checkpoint.print_saved_residuals(
            _jax_loss(graphdef, rest, jnp.asarray(tok, jnp.int32), jnp.asarray(seg, jnp.int32)), params
        )
    return [line for line in out.getvalue().splitlines() if "from the argument" not in line]


def test_jax_policies_change_what_is_saved(setup):
    """The per-layer residuals shrink none > save_dots > save_qkv_attn > full; the selective policy keeps the
    k/v projections ([layers, B, S, n_kv_heads * head_dim]) and full keeps none of them."""
    _, jmodel, tok, seg = setup
    saved = {name: _saved_residuals(jmodel, name, tok, seg) for name in ("none", "save_dots", "save_qkv_attn", "full")}
    n = {name: len(lines) for name, lines in saved.items()}
    assert n["none"] > n["save_dots"] > n["save_qkv_attn"] > n["full"], n
    cfg = jmodel.config
    kv = f"f32[{cfg.n_layers},2,11,{cfg.n_kv_heads * cfg.resolved_head_dim}]"
    assert sum(kv in line for line in saved["save_qkv_attn"]) == 2, saved["save_qkv_attn"]  # k and v
    assert not any(kv in line for line in saved["full"])


def test_torch_policies_change_what_is_kept(setup):
    """Bytes the forward leaves alive for the backward, fp32: none > save_dots > save_qkv_attn > full."""
    tmodel, _, tok, _ = setup
    batch = {"tokens": torch.from_numpy(np.random.default_rng(33).integers(0, 256, (2, 65)))}
    saved = {}
    for policy in ("none", "save_dots", "save_qkv_attn", "full"):
        tremat.apply(tmodel, policy)
        saved[policy] = torch_saved_bytes(tmodel, batch, policy="fp32")["saved_bytes"]["cpu"]
    tremat.apply(tmodel, "none")
    assert saved["none"] > saved["save_dots"] > saved["save_qkv_attn"] > saved["full"] > 0, saved


def test_torch_save_qkv_attn_keeps_q_k_v_and_the_attention_output(setup):
    """Per layer call, :class:`torchref.remat.SaveQkvAttn` says MUST_SAVE to exactly three ``mm`` (the q, k, v
    projections: their output widths are n_heads*D, n_kv_heads*D, n_kv_heads*D) and one SDPA op. Where torch
    asks the policy again in the recompute (``ctx.is_recompute``), the separate counter gives the same answers."""
    tmodel, _, tok, seg = setup
    decisions = []

    class Spy(tremat.SaveQkvAttn):
        def __call__(self, ctx, op, *args, **kwargs):
            out = super().__call__(ctx, op, *args, **kwargs)
            if out == tremat.CheckpointPolicy.MUST_SAVE:
                width = args[1].shape[-1] if op in tremat.SaveDots.ops else "sdpa"
                decisions.append((ctx.is_recompute, width))
            return out

    orig = tremat._RUNNERS["save_qkv_attn"]
    tremat._RUNNERS["save_qkv_attn"] = tremat._selective(Spy)
    try:
        _torch_grads(tmodel, "save_qkv_attn", tok, seg)
    finally:
        tremat._RUNNERS["save_qkv_attn"] = orig
    cfg, d = tmodel.config, tmodel.config.resolved_head_dim
    per_layer = [cfg.n_heads * d, cfg.n_kv_heads * d, cfg.n_kv_heads * d, "sdpa"]
    fwd = [w for r, w in decisions if not r]
    assert fwd == per_layer * cfg.n_layers, decisions
    recompute = [w for r, w in decisions if r]
    assert recompute in ([], fwd)  # torch 2.13 replays the forward's decisions without asking the policy again


def test_torch_full_remat_recomputes_each_layer(setup):
    """With ``full`` each decoder layer's forward runs twice per training step (forward + recompute; a pre-hook,
    since non-reentrant checkpointing stops recomputing once the saved tensors it needs are rebuilt)."""
    tmodel, _, tok, seg = setup
    calls = []
    hook = tmodel.model.layers[0].mlp.register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        for name, want in (("none", 1), ("full", 2), ("offload", 1)):
            calls.clear()
            _torch_grads(tmodel, name, tok, seg)
            assert len(calls) == want, name
    finally:
        hook.remove()


def test_unknown_policy_is_a_value_error_listing_the_names(setup):
    tmodel, jmodel, _, _ = setup
    names = r"none, full, save_dots, save_qkv_attn, offload"
    for apply in (jremat.apply, tremat.apply):
        model = jmodel if apply is jremat.apply else tmodel
        with pytest.raises(ValueError, match=rf"policy='dots' is not a remat policy; valid names: {names}"):
            apply(model, "dots")
        with pytest.raises(ValueError, match=rf"policy=None is not a remat policy; valid names: {names}"):
            apply(model, None)
        assert model.remat == "none"  # unchanged
    with pytest.raises(TypeError, match="model must have a 'remat' setting"):
        jremat.apply(object(), "full")
    with pytest.raises(TypeError, match="model must have a 'remat' setting"):
        tremat.apply(torch.nn.Linear(2, 2), "full")
    assert jremat.POLICIES == tremat.POLICIES == REMAT_POLICIES


class _DeviceWithoutHost:
    """A device whose backend has only device memory (as a backend without host memory spaces reports)."""

    def addressable_memories(self):
        class M:
            kind = "device"

        return [M()]

    def __str__(self):
        return "FakeDevice(0)"


def test_offload_where_it_cannot_be_served_is_a_clear_error(setup):
    _, jmodel, _, _ = setup
    assert jremat.offload_unavailable_reason() is None  # jax's CPU backend has a pinned_host memory space
    model = nnx.merge(*nnx.split(jmodel))
    with pytest.raises(
        ValueError,
        match=r"policy='offload' cannot be served on this backend: FakeDevice\(0\) has "
        r"memory spaces \['device'\], no 'pinned_host'.*use one of none, full, "
        r"save_dots, save_qkv_attn",
    ):
        jremat.apply(model, "offload", device=_DeviceWithoutHost())
    assert model.remat == "none"
    assert jremat.apply(model, "offload") is model and model.remat == "offload"


@pytest.mark.slow
def test_benchmark_quick_run_smoke():
    """``python -m benchmarks run --suite remat --quick`` (about 100 s on 2 cores: 10 tiny compiles, CPU and
    deviceless H100 where the CUDA plugin is installed); the expected order holds in both frameworks."""
    from benchmarks.suites import remat as bremat

    recs = bremat.run(quick=True, log=lambda *a: None)
    ok = [r for r in recs if r["status"] == "ok"]
    assert {(r["framework"], r["target"]) for r in ok} >= {("jax", "cpu"), ("torch", "cpu")}
    for fw, target in (("jax", "cpu"), ("torch", "cpu")):
        base = next(r for r in ok if (r["framework"], r["target"], r["impl"]) == (fw, target, "none"))
        assert base["measured"]["order_holds"] is True, (fw, target)
        full = next(r for r in ok if (r["framework"], r["target"], r["impl"]) == (fw, target, "full"))
        assert full["measured"]["bytes_ratio"] < 0.6 and full["measured"]["flops_ratio"] > 1.05


def test_benchmark_records_small_run():
    """The remat suite's record format and report cells on its fastest run (torch, two policies; the JAX
    compiles are in the slow smoke test above)."""
    from benchmarks.report import tables
    from benchmarks.suites import remat as bremat

    recs = bremat.run(quick=True, policies=("none", "full"), frameworks=("torch",), log=lambda *a: None)
    assert [(r["framework"], r["impl"], r["status"]) for r in recs] == [
        ("torch", "none", "ok"),
        ("torch", "full", "ok"),
    ]
    for r in recs:
        m = r["measured"]
        assert m["bytes_ratio"] == (1.0 if r["impl"] == "none" else pytest.approx(m["bytes_ratio"]))
        assert m["flops"] > 0 and r["summary"].endswith("FLOPs")
    assert all(r["measured"]["bytes_ratio"] < 1.0 for r in recs if r["impl"] == "full")
    table = tables.report_table(recs)
    assert "torch:full" in table and "torch:none" in table and "MiB" in table
    with pytest.raises(ValueError, match="unknown policies/targets"):
        bremat.run(quick=True, policies=("dots",))


def test_one_tensor_vocabulary():
    """The remat tags, the policies' lists and the debugger's rows are one table's names (twincore.tensors), and
    every tag the table names as a remat tag is put on a value by the JAX model (test_model_seams checks each is
    in the traced program): a renamed tag in one place breaks here, not silently in a policy."""
    from jaxattn import model as jm
    from parity_tests import diff
    from twincore import remat as spec_remat
    from twincore import tensors

    names = [t.name for t in tensors.LAYER_TENSORS]
    assert jm.REMAT_NAMES == tensors.REMAT_TAGS and set(jm.REMAT_NAMES) <= set(names)
    assert set(spec_remat.OFFLOAD_NAMES) <= set(jm.REMAT_NAMES) and set(spec_remat.QKV_ATTN_NAMES) <= set(
        jm.REMAT_NAMES
    )
    assert list(diff.LAYER_KINDS) == names and diff.TORCH_HOOKS == tensors.TORCH_HOOKS
    assert {"q_proj", "o_proj", "gate_proj"} <= set(names)  # Hugging Face's module names where a user sees them
