"""The seams outside code uses on the model, and the model's input rules, in both packages (tiny preset, CPU).

* Logical axis names: every JAX ``nnx.Param`` carries names of its rank from the Llama vocabulary, read back by
  ``nnx.get_partition_spec``, and a checkpoint loaded through ``jaxattn.hf`` keeps them.
* Remat: ``Llama.remat`` / ``LlamaForCausalLM.remat`` is a policy name, static in the graphdef; every tag a
  policy may keep is in the JAX model, and an unknown name is a ValueError listing the valid ones (the
  policies' gradients and what they save: ``test_remat.py``).
* Token ids (design §10): in an eager call an id outside the vocabulary is a ValueError naming the first
  bad position and value; lists are TypeErrors; empty batches and sequences are ValueErrors; bool ids are
  refused and uint8 accepted — the same rules in both packages. Under jit the ids cannot be read: an
  out-of-range id embeds to zeros and nothing turns NaN.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxattn import hf as jhf
from jaxattn import model as jm
from twincore.remat import REMAT_POLICIES

torch = pytest.importorskip("torch")
from benchmarks.twins import jitted, twin_models  # noqa: E402
from torchref.config import ModelConfig  # noqa: E402

AXIS_NAMES = {"vocab", "embed", "heads", "kv_heads", "head_dim", "mlp", "layers"}


@pytest.fixture(scope="module")
def twins():
    return twin_models(ModelConfig.preset("tiny"), seed=21)


def _params_with_paths(model):
    return jax.tree_util.tree_flatten_with_path(
        nnx.state(model, nnx.Param), is_leaf=lambda x: isinstance(x, nnx.Variable)
    )[0]


# ------------------------------------------------------------------------------------------------------------
# Logical axis names
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tied", [False, True])
def test_every_param_has_logical_axis_names_of_its_rank(tied, tmp_path):
    cfg = ModelConfig.preset("tiny", tie_embeddings=tied)
    tmodel, loaded = twin_models(cfg, seed=22)
    jhf.save_pretrained(loaded, tmp_path / "ckpt")
    models = {
        "init": jm.Llama(cfg, rngs=nnx.Rngs(0)),
        "from_state_dict": loaded,
        "from_pretrained": jhf.from_pretrained(tmp_path / "ckpt"),
        "eval_shape": nnx.eval_shape(lambda: jm.Llama(cfg, rngs=nnx.Rngs(0))),
    }
    for how, model in models.items():
        params = _params_with_paths(model)
        assert len(params) == (11 if tied else 12), how
        specs = nnx.get_partition_spec(nnx.state(model, nnx.Param))
        for path, var in params:
            name = path[-1].key
            names = jm.PARAM_AXES[name]
            assert len(names) == len(var.get_value().shape) and set(names) <= AXIS_NAMES, (how, name, names)
            spec = specs
            for p in path:
                spec = spec[p.key]
            pspec = spec.get_value() if isinstance(spec, nnx.Variable) else spec
            assert isinstance(pspec, jax.sharding.PartitionSpec) and tuple(pspec) == names, (how, name, spec)
    # the fused heads*head_dim axis is "heads" for q/o and "kv_heads" for k/v
    assert jm.PARAM_AXES["wq"] == ("layers", "embed", "heads") and jm.PARAM_AXES["wk"][-1] == "kv_heads"


# ------------------------------------------------------------------------------------------------------------
# Remat
# ------------------------------------------------------------------------------------------------------------


def test_remat_names_are_tagged_in_the_jax_model(twins):
    _, jmodel = twins
    jaxpr = str(jax.make_jaxpr(lambda t: jmodel(t))(jnp.ones((1, 4), jnp.int32)))
    for name in jm.REMAT_NAMES:
        assert f"name={name}" in jaxpr, name


def test_unknown_remat_name_is_a_value_error_in_both(twins):
    tmodel, jmodel = twins
    model = nnx.merge(*nnx.split(jmodel))
    model.remat = "dots"
    tmodel.remat = "dots"
    try:
        with pytest.raises(ValueError, match=r"Llama.remat='dots'.*none, full, save_dots, save_qkv_attn, offload"):
            model(jnp.ones((1, 4), jnp.int32))
        with pytest.raises(
            ValueError,
            match=r"LlamaForCausalLM.remat='dots'.*none, full, save_dots, save_qkv_attn, "
            r"offload",
        ):
            tmodel(torch.ones((1, 4), dtype=torch.long))
    finally:
        tmodel.remat = "none"
    from jaxattn import remat as jremat
    from torchref import remat as tremat

    assert tremat.POLICIES == jremat.POLICIES == REMAT_POLICIES


def test_remat_setting_is_hashable_and_in_the_graphdef(twins):
    """The remat name is static model state: it changes the graphdef (the jit cache key) and nothing else."""
    _, jmodel = twins
    model = nnx.merge(*nnx.split(jmodel))
    g0, s0 = nnx.split(model)
    model.remat = "full"
    g1, s1 = nnx.split(model)
    assert g0 != g1 and hash(g1) == hash(nnx.split(model)[0])
    assert jax.tree.structure(s0) == jax.tree.structure(s1)


# ------------------------------------------------------------------------------------------------------------
# Token ids and input rules, both packages
# ------------------------------------------------------------------------------------------------------------


def _both(twins, *arrays, np_dtype=np.int32, torch_dtype=None):
    """(jax call, torch call) on the same integer arrays."""
    tmodel, jmodel = twins
    dtype = torch_dtype or getattr(torch, np.dtype(np_dtype).name)

    def j():
        return jmodel(*(None if a is None else jnp.asarray(a, np_dtype) for a in arrays))

    def t():
        return tmodel(*(None if a is None else torch.from_numpy(np.asarray(a, np_dtype)).to(dtype) for a in arrays))

    return j, t


@pytest.mark.parametrize("bad, pos", [(256, (1, 2)), (-3, (0, 4)), (10**6, (1, 0))])
def test_eager_out_of_range_id_names_position_and_value(twins, bad, pos):
    tok = np.random.default_rng(26).integers(0, 256, (2, 5))
    tok[pos] = bad
    if pos != (1, 0):
        tok[1, 4] = bad  # a second bad id: the first one (row-major) is named
    for call, arg in zip(_both(twins, tok), ("tokens", "input_ids")):
        with pytest.raises(
            ValueError,
            match=rf"{arg} holds an id outside \[0, vocab_size=256\): {bad} at "
            rf"position \({pos[0]}, {pos[1]}\)",
        ):
            with torch.no_grad():
                call()


def test_lists_are_type_errors_in_both(twins):
    tmodel, jmodel = twins
    tok = [[1, 2, 3]]
    with pytest.raises(TypeError, match="tokens must be an integer array.*got list"):
        jmodel(tok)
    with pytest.raises(TypeError, match="input_ids must be an integer array.*got list"):
        tmodel(tok)
    with pytest.raises(TypeError, match="segment_ids must be an integer array.*got list"):
        jmodel(jnp.asarray(tok), segment_ids=[[0, 0, 1]])
    with pytest.raises(TypeError, match="segment_ids must be an integer array.*got list"):
        tmodel(torch.tensor(tok), segment_ids=[[0, 0, 1]])
    with pytest.raises(TypeError, match="positions must be an integer array.*got list"):
        tmodel(torch.tensor(tok), positions=[[0, 1, 2]])


@pytest.mark.parametrize("shape", [(0, 4), (2, 0), (4,)])
def test_empty_or_1d_tokens_are_value_errors_in_both(twins, shape):
    for call, arg in zip(_both(twins, np.zeros(shape, np.int32)), ("tokens", "input_ids")):
        with pytest.raises(ValueError, match=rf"{arg} must be an int array \[batch >= 1, seq >= 1\]"):
            call()


def test_id_dtype_rules_are_the_same_in_both(twins):
    tok = np.random.default_rng(27).integers(0, 256, (2, 6))
    for call, arg in zip(_both(twins, tok, np_dtype=np.bool_), ("tokens", "input_ids")):
        with pytest.raises(TypeError, match=rf"{arg} must have an integer dtype.*got bool"):
            call()
    with torch.no_grad():
        j8, t8 = (f() for f in _both(twins, tok, np_dtype=np.uint8))
        j32, t32 = (f() for f in _both(twins, tok, np_dtype=np.int32))
    np.testing.assert_array_equal(np.asarray(j8), np.asarray(j32))
    np.testing.assert_array_equal(t8.numpy(), t32.numpy())
    assert float(np.abs(np.asarray(j8) - t8.numpy()).max()) <= 1e-4


def test_under_jit_an_out_of_range_id_embeds_to_zeros_not_nan(twins):
    """Inside jit the check cannot run: the bad id's embedding is a zero vector, nothing becomes NaN, and a
    causal model's earlier positions are untouched."""
    _, jmodel = twins
    tok = np.random.default_rng(28).integers(1, 256, (1, 6)).astype(np.int32)  # no id 0: see below
    bad = tok.copy()
    bad[0, 3] = 256
    fwd = jitted(jmodel)
    out, ref = np.asarray(fwd(jnp.asarray(bad))), np.asarray(fwd(jnp.asarray(tok)))
    assert np.isfinite(out).all()
    np.testing.assert_array_equal(out[0, :3], ref[0, :3])
    # what the bad position saw: a zero embedding (compare with a model whose row 0 is zeroed, fed id 0)
    zeroed = nnx.merge(*nnx.split(jmodel))
    jm.set_value(zeroed.embed, zeroed.embed[...].at[0].set(0.0))
    as_zero = bad.copy()
    as_zero[0, 3] = 0
    np.testing.assert_allclose(out[0, 3], np.asarray(jitted(zeroed)(jnp.asarray(as_zero)))[0, 3], rtol=1e-6, atol=1e-6)
