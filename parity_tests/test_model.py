"""fp32 parity of the Llama twins, module by module and end to end (design §7: module max-abs <= 1e-5,
full-model logits <= 1e-4, gradients rtol = atol = 1e-3), plus agreement with ``transformers``' own Llama.

Both sides run at highest matmul precision (conftest), RoPE tables are computed once in float64 numpy
(``ModelConfig.rope_inv_freq``), and RMSNorm follows HF (float32 statistics, weight applied after the cast back).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from jaxattn import model as jm  # noqa: E402
from parity_tests.twins import jitted, layer_params, tokens, twin_models  # noqa: E402
from torchref import model as tm  # noqa: E402
from torchref.config import ModelConfig  # noqa: E402

MODULE_TOL, LOGITS_TOL, GRAD_TOL = 1e-5, 1e-4, 1e-3
CONFIGS = {
    "tiny-gqa": ModelConfig.preset("tiny"),
    "mha-tied-headdim": ModelConfig.preset("tiny", n_heads=2, n_kv_heads=2, head_dim=24, tie_embeddings=True),
    # Llama 3.1's RoPE scaling, its original context shrunk to 16 so the tiny sequences cross it
    "mqa-llama3-rope": ModelConfig.preset(
        "tiny",
        n_kv_heads=1,
        rope_theta=5e5,
        rope_scaling={**ModelConfig.preset("8b").rope_scaling, "original_max_position_embeddings": 16},
    ),
    # Mistral's sliding window, 6 tokens, so the 17- and 64-token rows and the packed segments cross it
    "mistral-window": ModelConfig.preset("tiny", model_type="mistral", sliding_window=6),
    "qwen2-qkv-bias": ModelConfig.preset("tiny", model_type="qwen2"),  # biased q / k / v (perturbed from 0)
}


@pytest.fixture(params=list(CONFIGS), scope="module")
def twins(request):
    return twin_models(CONFIGS[request.param], seed=hash(request.param) % 1000)


def maxdiff(j, t):
    return float(np.abs(np.asarray(j, dtype=np.float64) - t.detach().double().numpy()).max())


def rand(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


def test_rmsnorm(twins):
    tmodel, jmodel = twins
    rng = np.random.default_rng(1)
    x = rand(rng, 3, 17, tmodel.config.dim) * 3
    norm = tmodel.model.layers[0].input_layernorm
    out_j = jm.rms_norm(jnp.asarray(x), layer_params(jmodel)["attn_norm"], tmodel.config.norm_eps)
    assert maxdiff(out_j, norm(torch.from_numpy(x))) <= MODULE_TOL


def test_rope_with_position_offsets(twins):
    tmodel, jmodel = twins
    cfg, rng = tmodel.config, np.random.default_rng(2)
    x = rand(rng, 2, 13, 3, cfg.resolved_head_dim)  # [B, S, H, D] (jax layout)
    pos = (np.arange(13)[None] + np.array([[0], [1000]])).astype(np.int32)  # second row starts at offset 1000
    cos_j, sin_j = jm.rope_cos_sin(jmodel.inv_freq[...], jnp.asarray(pos))
    cos_t, sin_t = tm.rope_cos_sin(tmodel.model.inv_freq, torch.from_numpy(pos))
    out_j = jm.apply_rope(jnp.asarray(x), cos_j, sin_j)
    out_t = tm.apply_rope(torch.from_numpy(x).transpose(1, 2), cos_t, sin_t).transpose(1, 2)
    assert maxdiff(out_j, out_t) <= MODULE_TOL
    # RoPE is a rotation: it keeps the norm of every pair.
    np.testing.assert_allclose(np.linalg.norm(np.asarray(out_j), axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-5)


def test_mlp(twins):
    tmodel, jmodel = twins
    x = rand(np.random.default_rng(3), 3, 17, tmodel.config.dim)
    out_j = jm.mlp_block(jnp.asarray(x), layer_params(jmodel))
    assert maxdiff(out_j, tmodel.model.layers[0].mlp(torch.from_numpy(x))) <= MODULE_TOL


@pytest.mark.parametrize("use_segments", [False, True])
def test_attention_block_and_decoder_layer(twins, use_segments):
    tmodel, jmodel = twins
    cfg, rng = tmodel.config, np.random.default_rng(4)
    b, s = 3, 19
    x = rand(rng, b, s, cfg.dim)
    pos = np.broadcast_to(np.arange(s) + 5, (b, s)).astype(np.int32)
    seg = np.sort(rng.integers(0, 3, (b, s)), axis=1).astype(np.int32) if use_segments else None
    cos_j, sin_j = jm.rope_cos_sin(jmodel.inv_freq[...], jnp.asarray(pos))
    cos_t, sin_t = tm.rope_cos_sin(tmodel.model.inv_freq, torch.from_numpy(pos))
    seg_j, seg_t = (None, None) if seg is None else (jnp.asarray(seg), torch.from_numpy(seg))
    p, layer = layer_params(jmodel), tmodel.model.layers[0]
    xt = torch.from_numpy(x)
    out_j = jm.attention_block(jnp.asarray(x), p, cos_j, sin_j, jmodel.config, seg_j)
    assert maxdiff(out_j, layer.self_attn(xt, cos_t, sin_t, seg_t)) <= MODULE_TOL
    out_j = jm.decoder_layer(jnp.asarray(x), p, cos_j, sin_j, jmodel.config, seg_j)
    assert maxdiff(out_j, layer(xt, cos_t, sin_t, seg_t)) <= MODULE_TOL


@pytest.mark.parametrize("b, s", [(1, 1), (3, 17), (2, 64)])
def test_full_model_logits(twins, b, s):
    tmodel, jmodel = twins
    tok = tokens(np.random.default_rng(b * 100 + s), tmodel.config.vocab_size, b, s)
    with torch.no_grad():
        out_t = tmodel(torch.from_numpy(tok))
    out_j = jitted(jmodel)(jnp.asarray(tok, dtype=jnp.int32))
    assert out_j.dtype == jnp.float32 and out_t.dtype == torch.float32
    assert maxdiff(out_j, out_t) <= LOGITS_TOL


def test_packed_segments_equal_separate_sequences(twins):
    """Packing two sequences with segment ids and restarted positions gives each one's own logits, both sides."""
    tmodel, jmodel = twins
    rng = np.random.default_rng(5)
    a, c = tokens(rng, tmodel.config.vocab_size, 1, 7), tokens(rng, tmodel.config.vocab_size, 1, 10)
    packed = np.concatenate([a, c], axis=1)
    seg = np.array([[0] * 7 + [1] * 10])
    pos = np.array([list(range(7)) + list(range(10))])
    with torch.no_grad():
        t_packed = tmodel(torch.from_numpy(packed), torch.from_numpy(pos), torch.from_numpy(seg))
        t_sep = torch.cat([tmodel(torch.from_numpy(a)), tmodel(torch.from_numpy(c))], dim=1)
    j_packed = jitted(jmodel)(jnp.asarray(packed, jnp.int32), jnp.asarray(pos, jnp.int32), jnp.asarray(seg, jnp.int32))
    assert maxdiff(j_packed, t_packed) <= LOGITS_TOL
    assert maxdiff(j_packed, t_sep) <= LOGITS_TOL
    assert float((t_packed - t_sep).abs().max()) <= LOGITS_TOL


def test_gradients_match(twins):
    """Gradients of the mean next-token cross-entropy w.r.t. every weight, compared in HF layout."""
    import optax
    from flax import nnx

    from jaxattn import hf as jhf

    tmodel, jmodel = twins
    tok = tokens(np.random.default_rng(6), tmodel.config.vocab_size, 2, 24)
    tmodel.zero_grad()
    logits = tmodel(torch.from_numpy(tok[:, :-1]))
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), torch.from_numpy(tok[:, 1:]).flatten()).backward()

    graphdef, params, rest = nnx.split(jmodel, nnx.Param, ...)

    def loss(params):
        out = nnx.merge(graphdef, params, rest)(jnp.asarray(tok[:, :-1], jnp.int32))
        return optax.softmax_cross_entropy_with_integer_labels(out, jnp.asarray(tok[:, 1:], jnp.int32)).mean()

    grads = jax.jit(jax.grad(loss))(params)
    gmodel = nnx.merge(graphdef, grads, rest)
    jgrads = jhf.to_state_dict(gmodel)
    tgrads = {k: p.grad for k, p in tmodel.named_parameters()}
    assert set(jgrads) == set(tgrads) - ({"lm_head.weight"} if tmodel.config.tie_embeddings else set())
    for k, g in jgrads.items():
        np.testing.assert_allclose(g, tgrads[k].numpy(), rtol=GRAD_TOL, atol=GRAD_TOL, err_msg=k)
        assert np.abs(g).max() > 0, k  # every weight gets a gradient


def test_jit_and_scan_compile_once(twins):
    """The NNX model runs under jit as a pure function of its split state; the layer stack is one scan."""
    from flax import nnx

    _, jmodel = twins
    graphdef, state = nnx.split(jmodel)
    fwd = jax.jit(lambda st, t: nnx.merge(graphdef, st)(t))
    tok = jnp.ones((1, 8), jnp.int32) * 3
    np.testing.assert_allclose(np.asarray(fwd(state, tok)), np.asarray(jmodel(tok)), atol=1e-6)
    hlo = fwd.lower(state, tok).as_text()
    assert hlo.count("stablehlo.while") + hlo.count(" while(") >= 1


@pytest.mark.parametrize("field, value", [("positions", (2, 5)), ("segment_ids", (1, 3))])
def test_model_bad_inputs(twins, field, value):
    tmodel, jmodel = twins
    tok = np.zeros((2, 4), np.int64) + 1
    with pytest.raises(ValueError, match=field):
        jmodel(jnp.asarray(tok, jnp.int32), **{field: jnp.zeros(value, jnp.int32)})
    with pytest.raises(ValueError, match=field):
        tmodel(torch.from_numpy(tok), **{field: torch.zeros(value, dtype=torch.long)})
    with pytest.raises(TypeError, match="tokens.*integer dtype.*float32"):  # dtype rules: twincore.dtypes
        jmodel(jnp.ones((2, 4), jnp.float32))
    with pytest.raises(TypeError, match="input_ids.*integer dtype.*float32"):
        tmodel(torch.ones(2, 4))


def test_configs_are_the_same_dataclass_values(twins):
    tmodel, jmodel = twins
    assert dataclasses.asdict(tmodel.config) == dataclasses.asdict(jmodel.config)


def test_hidden_states_match_torch_and_transformers_and_feed_the_head(twins):
    """``jaxattn`` ``Llama.features`` = torchref ``LlamaForCausalLM.model(...)`` (HF's ``LlamaModel``) = transformers'
    ``LlamaModel`` last_hidden_state, with restarted positions and segment ids (the full-model 1e-4 rule), and each
    twin's logits are its LM head applied to those hidden states."""
    from jaxattn import hf as jhf
    from parity_tests.twins import hf_llama

    tmodel, jmodel = twins
    cfg, rng = tmodel.config, np.random.default_rng(7)
    b, s = 3, 17
    tok = tokens(rng, cfg.vocab_size, b, s)
    seg = np.sort(rng.integers(0, 3, (b, s)), axis=1)
    pos = np.concatenate([np.arange(9), np.arange(8)])[None].repeat(b, 0)
    with torch.no_grad():
        h_t = tmodel.model(torch.from_numpy(tok), torch.from_numpy(pos), torch.from_numpy(seg))
        assert torch.equal(tmodel.features(torch.from_numpy(tok)), tmodel.model(torch.from_numpy(tok)))
        assert torch.equal(tmodel.lm_head(h_t).float(), tmodel(*map(torch.from_numpy, (tok, pos, seg))))
    args = (jnp.asarray(tok, jnp.int32), jnp.asarray(pos, jnp.int32), jnp.asarray(seg, jnp.int32))
    h_j = jmodel.features(*args)
    assert h_t.shape == h_j.shape == (b, s, cfg.dim) and h_j.dtype == jnp.float32
    assert maxdiff(h_j, h_t) <= LOGITS_TOL
    head = jmodel.embed[...] if cfg.tie_embeddings else jmodel.lm_head[...].T  # [vocab, dim]
    np.testing.assert_allclose(np.asarray(h_j @ head.T), np.asarray(jmodel(*args)), rtol=0, atol=1e-5)

    plain = tok[:1]  # transformers knows no segment ids: one plain row against its LlamaModel
    hf = hf_llama(cfg, jhf.to_state_dict(jmodel))
    with torch.no_grad():
        want = hf.model(torch.from_numpy(plain)).last_hidden_state
    assert maxdiff(jmodel.features(jnp.asarray(plain, jnp.int32)), want) <= LOGITS_TOL
    assert float((tmodel.model(torch.from_numpy(plain)) - want).abs().max()) <= LOGITS_TOL
    with pytest.raises(TypeError, match="input_ids.*integer dtype"):
        tmodel.model(torch.ones(2, 4))
    with pytest.raises(TypeError, match="tokens.*integer dtype"):
        jmodel.features(jnp.ones((2, 4), jnp.float32))
    with pytest.raises(ValueError, match="input_ids"):
        tmodel.model(torch.tensor([[1, cfg.vocab_size]]))


def test_sliding_window_reaches_exactly_layers_times_window_minus_one_back():
    """Mistral's window w: a token sees itself and the w - 1 before it, so through L layers token j reaches
    positions j .. j + L(w - 1) and no later one. Changing one token moves exactly those logits, in both twins."""
    cfg = CONFIGS["mistral-window"]
    w, n, j, s = cfg.sliding_window, cfg.n_layers, 3, 24
    reach = j + n * (w - 1)  # the last position token j reaches
    tmodel, jmodel = twin_models(cfg, seed=11)
    tok = tokens(np.random.default_rng(8), cfg.vocab_size, 1, s)
    other = tok.copy()
    other[0, j] = (tok[0, j] + 1) % cfg.vocab_size
    with torch.no_grad():
        t = [tmodel(torch.from_numpy(x))[0].numpy() for x in (tok, other)]
    jfn = jitted(jmodel)
    jx = [np.asarray(jfn(jnp.asarray(x, jnp.int32)))[0] for x in (tok, other)]
    for name, (a, b) in (("torch", t), ("jax", jx)):
        moved = np.abs(a - b).max(axis=-1)  # [s]
        assert (moved[:j] <= 1e-6).all() and (moved[reach + 1 :] <= 1e-6).all(), (name, moved)
        assert (moved[j : reach + 1] > 1e-4).all(), (name, moved)
