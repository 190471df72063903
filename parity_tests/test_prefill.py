"""Prefill that computes only the logits it needs (``logits_at``, Hugging Face's ``logits_to_keep`` per row), both
frameworks: the kept logits are the full logits' rows (fp32, 1e-6: the same math on fewer rows; tied, untied and
int8 heads; ragged right-padded rows with and without a KV cache); ``generate`` gives the greedy tokens of the
old full-logits prefill (tiny twins and SmolLM2); JAX's prefill program holds no ``[B, P, vocab]`` buffer; bad
``logits_at`` raises naming it.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")

from jaxattn import generate as jgen  # noqa: E402
from jaxattn import hf as jhf  # noqa: E402
from jaxattn import quant as jquant  # noqa: E402
from jaxattn.kv_cache import KVCache as JCache  # noqa: E402
from jaxattn.model import Llama  # noqa: E402
from parity_tests.twins import jax_config, twin_models  # noqa: E402
from torchref import generate as tgen  # noqa: E402
from torchref import quant as tquant  # noqa: E402
from torchref.config import ModelConfig  # noqa: E402
from torchref.kv_cache import KVCache as TCache  # noqa: E402
from twincore.generate import prepare  # noqa: E402

KEPT_TOL = 1e-6  # fp32: the kept rows are the same dot products; only the GEMM's row count differs
HEADS = ["untied", "tied", "int8"]


def _twins(head: str, scale: float = 1.0):
    """Tiny twins from one fp32 state dict; ``int8``: untied, then both twins' ``quant.quantize`` (head included).
    ``scale`` multiplies the embedding and head (x4 makes greedy argmax gaps far above rounding, as in
    test_generate)."""
    tmodel, _ = twin_models(ModelConfig.preset("tiny", tie_embeddings=head == "tied"), seed=0)
    with torch.no_grad():
        tmodel.model.embed_tokens.weight.mul_(scale)
        if head != "tied":
            tmodel.lm_head.weight.mul_(scale)
    jmodel = jhf.from_state_dict(
        jax_config(tmodel.config), {k: v.detach().numpy() for k, v in tmodel.state_dict().items()}
    )
    if head == "int8":
        tmodel, jmodel = tquant.quantize(tmodel), jquant.quantize(jmodel)
        assert isinstance(tmodel.lm_head, tquant.Int8Linear) and isinstance(jmodel.lm_head[...], jquant.QArray)
    return tmodel.eval(), jmodel


def _ragged(rng, vocab, lens):
    return [rng.integers(0, vocab, n).tolist() for n in lens]


def _gather(full: np.ndarray, index: np.ndarray) -> np.ndarray:
    return np.take_along_axis(full, index[:, :, None], axis=1)  # [B, K, vocab]


@pytest.mark.parametrize("head", HEADS)
@pytest.mark.parametrize("framework", ["jax", "torch"])
def test_kept_logits_are_the_full_logits_rows(framework, head):
    """Several positions per row (repeats, any order) without a cache; each right-padded row's last real position
    with a cache (the prefill's call), whose filled cache is the full call's."""
    tmodel, jmodel = _twins(head)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 256, (3, 8))
    index = np.asarray([[7, 0, 3], [1, 1, 6], [2, 5, 4]])
    prompts = _ragged(rng, 256, [5, 1, 8])
    lengths = np.asarray([len(p) for p in prompts])
    padded = np.zeros((3, 8), np.int64)
    for i, p in enumerate(prompts):
        padded[i, : len(p)] = p
    last = (lengths - 1)[:, None]
    if framework == "jax":
        full = np.asarray(jmodel(jnp.asarray(tokens)))
        kept = np.asarray(jmodel(jnp.asarray(tokens), logits_at=jnp.asarray(index)))
        full_c, cache_full = jmodel(jnp.asarray(padded), cache=JCache.init(jmodel.config, 3, 16))
        kept_c, cache_kept = jmodel(jnp.asarray(padded), cache=JCache.init(jmodel.config, 3, 16), logits_at=last)
        np.testing.assert_array_equal(np.asarray(cache_kept.k), np.asarray(cache_full.k))
        full_c, kept_c = np.asarray(full_c), np.asarray(kept_c)
    else:
        with torch.no_grad():
            full = tmodel(torch.from_numpy(tokens)).numpy()
            kept = tmodel(torch.from_numpy(tokens), logits_at=torch.from_numpy(index)).numpy()
            cache_full, cache_kept = TCache(tmodel.config, 3, 16), TCache(tmodel.config, 3, 16)
            full_c = tmodel(torch.from_numpy(padded), cache=cache_full).numpy()
            kept_c = tmodel(torch.from_numpy(padded), cache=cache_kept, logits_at=torch.from_numpy(last)).numpy()
        torch.testing.assert_close(cache_kept.k, cache_full.k, rtol=0, atol=0)
    assert kept.shape == (3, 3, 256) and kept_c.shape == (3, 1, 256)
    np.testing.assert_allclose(kept, _gather(full, index), rtol=KEPT_TOL, atol=KEPT_TOL)
    np.testing.assert_allclose(kept_c, _gather(full_c, last), rtol=KEPT_TOL, atol=KEPT_TOL)


def test_kept_logits_agree_across_twins():
    """The same ``logits_at`` call in both twins: §7's fp32 1e-4, as the full logits."""
    tmodel, jmodel = _twins("untied")
    tokens = np.random.default_rng(1).integers(0, 256, (2, 6))
    index = np.asarray([[5, 2], [0, 4]])
    j = np.asarray(jmodel(jnp.asarray(tokens, jnp.int32), logits_at=jnp.asarray(index, jnp.int32)))
    with torch.no_grad():
        t = tmodel(torch.from_numpy(tokens), logits_at=torch.from_numpy(index)).numpy()
    np.testing.assert_allclose(j, t, rtol=0, atol=1e-4)


def test_logits_at_under_jit_and_default_unchanged():
    """jit traces ``logits_at`` (no value check on a tracer); ``logits_at=None`` is the full call."""
    _, jmodel = _twins("untied")
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, 256, (2, 8)), jnp.int32)
    graphdef, state = nnx.split(jmodel)
    kept = jax.jit(lambda st, t, i: nnx.merge(graphdef, st)(t, logits_at=i))(state, tokens, jnp.asarray([[3], [7]]))
    full = np.asarray(jmodel(tokens))
    np.testing.assert_array_equal(np.asarray(jmodel(tokens, logits_at=None)), full)
    np.testing.assert_allclose(np.asarray(kept), _gather(full, np.asarray([[3], [7]])), rtol=KEPT_TOL, atol=KEPT_TOL)


@pytest.mark.parametrize("framework", ["jax", "torch"])
def test_bad_logits_at_raises_naming_it(framework):
    tmodel, jmodel = _twins("untied")
    tokens = np.zeros((2, 4), np.int32)
    if framework == "jax":
        model, arr = jmodel, jnp.asarray
    else:
        model, arr = tmodel, torch.from_numpy
    cases = [
        (np.asarray([[0], [4]]), r"logits_at\[1, 0\] = 4 is outside the sequence \[0, 4\)"),
        (np.asarray([[-1], [0]]), r"logits_at\[0, 0\] = -1 is outside"),
        (np.asarray([0, 1]), r"logits_at must be an int array \[batch=2, K >= 1\]"),
        (np.zeros((3, 1), np.int64), r"batch=2"),
        (np.zeros((2, 0), np.int64), r"K >= 1"),
    ]
    for index, msg in cases:
        with pytest.raises(ValueError, match=msg):
            model(arr(tokens), logits_at=arr(index))
    with pytest.raises(TypeError, match="logits_at must have an integer dtype"):
        model(arr(tokens), logits_at=arr(np.zeros((2, 1), np.float32)))
    if framework == "torch":  # checked before the cache is written in place
        cache = TCache(tmodel.config, 2, 16)
        with pytest.raises(ValueError, match="outside the sequence"), torch.no_grad():
            tmodel(torch.from_numpy(tokens), cache=cache, logits_at=torch.tensor([[9], [0]]))
        assert cache.lengths.tolist() == [0, 0] and not cache.k.any()


# --------------------------------------------------------------------------- generate vs the old full-logits prefill
def full_logits_greedy_jax(model, prompts, n: int) -> list[list[int]]:
    """Greedy tokens with the prefill as it was: logits for every prompt position ``[B, P, vocab]``, then each
    row's last real one; decode with ``generate``'s own step program."""
    tokens, lengths, t, _ = prepare(prompts, n, 0.0, None, None, None, None, model.config)
    graphdef, state, dtype = *nnx.split(model), model.embed[...].dtype
    _, decode = jgen._programs(graphdef, 0.0, None, None, (), jgen._cache_spec(model.config, len(tokens), t, dtype))

    @jax.jit
    def prefill(state, tokens, lengths, cache):
        logits, cache = nnx.merge(graphdef, state)(tokens, cache=cache)  # [B, P, vocab]
        last = jnp.take_along_axis(logits, (lengths - 1)[:, None, None], axis=1)[:, 0]  # [B, vocab]
        return jnp.argmax(last, axis=-1).astype(jnp.int32), cache.with_lengths(lengths)

    cache = JCache.init(model.config, len(tokens), t, dtype=dtype)
    token, cache = prefill(state, jnp.asarray(tokens), jnp.asarray(lengths), cache)
    out, done = [np.asarray(token)], jnp.zeros(len(tokens), bool)
    for step in range(1, n):
        token, done, cache = decode(state, token, done, cache, jax.random.PRNGKey(0), step)
        out.append(np.asarray(token))
    return np.stack(out, axis=1).tolist()


@torch.no_grad()
def full_logits_greedy_torch(model, prompts, n: int) -> list[list[int]]:
    """The torch twin of :func:`full_logits_greedy_jax`."""
    tokens, lengths, t, _ = prepare(prompts, n, 0.0, None, None, None, None, model.config)
    cache = TCache(model.config, len(tokens), t, dtype=model.model.embed_tokens.weight.dtype)
    lengths = torch.from_numpy(lengths).long()
    logits = model(torch.from_numpy(tokens).long(), cache=cache)  # [B, P, vocab]
    cache.set_lengths(lengths)
    token = logits[torch.arange(len(tokens)), lengths - 1].argmax(-1)
    out = [token]
    for _ in range(n - 1):
        token = tgen._decode_step(model, token, cache).argmax(-1)
        out.append(token)
    return torch.stack(out, dim=1).tolist()


@pytest.mark.parametrize("head", ["untied", "int8"])
@pytest.mark.parametrize("framework", ["jax", "torch"])
def test_generate_equals_the_full_logits_prefill(framework, head):
    tmodel, jmodel = _twins(head, scale=4.0)
    prompts = _ragged(np.random.default_rng(3), 256, [7, 1, 12, 4])
    if framework == "jax":
        got, ref = jgen.generate(jmodel, prompts, 12, eos_id=None), full_logits_greedy_jax(jmodel, prompts, 12)
    else:
        got, ref = tgen.generate(tmodel, prompts, 12, eos_id=None), full_logits_greedy_torch(tmodel, prompts, 12)
    assert got == ref
    assert len({t for row in got for t in row}) > 3  # not a constant stream


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf):
    from torchref import hf as thf

    _, config, tensors, tok = smollm2_gguf
    tmodel = thf.from_state_dict(config, {k: torch.from_numpy(v) for k, v in tensors.items()}).eval()
    return tmodel, jhf.from_state_dict(config, tensors), tok


def _smollm2_prompts(tok):
    return [tok.encode("The capital of France is"), tok.encode("1, 2, 3, 4,")]


@pytest.mark.slow  # 18 s: test_kept_logits_are_the_full_logits_rows holds the case on tiny twins (tied head included)
def test_smollm2_kept_logits_are_the_full_logits_rows(smollm2):
    """SmolLM2-135M (tied head, 49152 tokens), a ragged right-padded batch of two (5 and 11 tokens, P = 16):
    each row's last-position logits are the full logits' rows in both twins. Tolerance 2e-6 x max|logit| (~7e-5):
    torch's head GEMM over 2 rows instead of 32 sums its 576 products in another order (2.9e-5 measured on logits
    up to 35; JAX 0 here, 2.3e-5 at P = 64)."""
    tmodel, jmodel, tok = smollm2
    tokens, lengths, _, _ = prepare(_smollm2_prompts(tok), 8, 0.0, None, None, None, None, jmodel.config)
    last = (lengths - 1)[:, None]
    full_j = np.asarray(jmodel(jnp.asarray(tokens)))
    kept_j = np.asarray(jmodel(jnp.asarray(tokens), logits_at=jnp.asarray(last)))
    with torch.no_grad():
        full_t = tmodel(torch.from_numpy(tokens)).numpy()
        kept_t = tmodel(torch.from_numpy(tokens), logits_at=torch.from_numpy(last)).numpy()
    for name, kept, full in (("jax", kept_j, full_j), ("torch", kept_t, full_t)):
        atol = 2e-6 * float(np.abs(full).max())
        np.testing.assert_allclose(kept, _gather(full, last), rtol=0, atol=atol, err_msg=name)


@pytest.mark.slow
def test_smollm2_generate_equals_the_full_logits_prefill(smollm2):
    """8 greedy tokens of the same ragged batch: ``generate`` = the full-logits prefill, in both twins (~40 s on
    the shared 2-core CPU: slow)."""
    tmodel, jmodel, tok = smollm2
    prompts = _smollm2_prompts(tok)
    out_j = jgen.generate(jmodel, prompts, 8, eos_id=None)
    out_t = tgen.generate(tmodel, prompts, 8, eos_id=None)
    assert out_j == full_logits_greedy_jax(jmodel, prompts, 8)
    assert out_t == full_logits_greedy_torch(tmodel, prompts, 8)
    assert "Paris" in tok.decode(out_j[0])


# ------------------------------------------------------------------------------ the JAX prefill program's buffers
def test_jax_prefill_program_holds_no_full_logits():
    """A large vocabulary (32768) on a 1-layer dim-64 model, B=2, P=128: the old prefill's ``[2, 128, 32768]``
    float32 logits (32 MiB) dominate its compiled temp memory; generate's prefill program lowers with no array of
    that shape and its temp memory is under a quarter of those logits."""
    cfg = ModelConfig(vocab_size=32768, dim=64, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=160, max_seq_len=256)
    model = Llama(jax_config(cfg), rngs=nnx.Rngs(0))
    b, p, t = 2, 128, 256
    full_bytes = b * p * cfg.vocab_size * 4
    graphdef, state = nnx.split(model)
    spec = jgen._cache_spec(model.config, b, t, jnp.float32)
    prefill, _ = jgen._programs_for(graphdef, 0.0, None, None, None, False, spec)  # jitted, its stop ids unbound

    @jax.jit
    def old_prefill(state, tokens, lengths, cache, key):  # the prefill before logits_at
        logits, cache = nnx.merge(graphdef, state)(tokens, cache=cache)  # [B, P, vocab]
        last = jnp.take_along_axis(logits, (lengths - 1)[:, None, None], axis=1)[:, 0]  # [B, vocab]
        return jgen.sample(last, key, 0.0, None, None), cache.with_lengths(lengths)

    args = (
        state,
        jnp.zeros((b, p), jnp.int32),
        jnp.asarray([p, 5], jnp.int32),
        JCache.init(model.config, b, t),
        jax.random.PRNGKey(0),
    )
    shape = f"tensor<{b}x{p}x{cfg.vocab_size}xf32>"  # StableHLO's spelling of a [B, P, vocab] float32 array
    new = prefill.lower(jgen._stop_ids(()), *args[:3], args[4])  # generate's makes its cache inside
    old = old_prefill.lower(*args)
    assert shape in old.as_text() and shape not in new.as_text()
    new_mem, old_mem = new.compile().memory_analysis(), old.compile().memory_analysis()
    assert old_mem.temp_size_in_bytes >= full_bytes, old_mem
    assert new_mem.temp_size_in_bytes < full_bytes / 4, (new_mem.temp_size_in_bytes, full_bytes)
