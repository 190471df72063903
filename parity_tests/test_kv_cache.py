"""The KV caches of both twins (``jaxattn/kv_cache.py``, ``torchref/kv_cache.py``): decoding with a cache gives the
full forward's logits (fp32 1e-4, design §7's full-model rule) with ragged rows, in a sliding window and on a ring
past its slots; an appending cache (``append=True``) fed a few tokens a call does too, and refuses a call too long
for its ring; a plain cache folds into the ring alike in both twins; torch builds its decode mask once per step; a
prefill needs an empty cache. JAX's cache is checked both ways its programs write it: each layer's slots read and
every layer's keys written after the layer scan (the CPU's), and the stacked cache carried through the scan and
written per layer (``jax-carried``: the GPU's and TPU's). ``generate`` on these caches: ``test_generate.py``.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")

from jaxattn import kv_cache as jkv  # noqa: E402
from jaxattn.kv_cache import KVCache as JCache  # noqa: E402
from parity_tests.twins import decoding_twins, jitted, ragged, windowed_twins  # noqa: E402
from torchref.config import ModelConfig  # noqa: E402
from torchref.kv_cache import KVCache as TCache  # noqa: E402

LOGITS_TOL = 1e-4  # design §7, fp32 full-model logits


@pytest.fixture(scope="module")
def twins():
    return decoding_twins()


@pytest.fixture(scope="module")
def windowed(twins):
    return windowed_twins(twins)


@pytest.mark.parametrize("window, slots", [(None, 24), (4, 24), (4, 8)], ids=["full", "window", "ring"])
@pytest.mark.parametrize("framework", ["jax", "jax-carried", "torch"])
def test_cache_decode_equals_full_forward(monkeypatch, twins, windowed, framework, window, slots):
    """Ragged rows (right-padded prefill, then 10 one-token steps) vs each row's own full forward; with a sliding
    window shorter than the prompts of 5 and 8 tokens, the prefill and every step see only the window. ``ring``: a
    cache of 8 slots for the windowed model, which rows 0 and 2 pass (positions 8 .. 17 wrap to slots 0 .. 7)."""
    tmodel, jmodel = twins if window is None else windowed
    cfg = tmodel.config
    rng = np.random.default_rng(1)
    prompts = ragged(rng, cfg.vocab_size, [5, 2, 8])
    n = 10
    cont = rng.integers(0, cfg.vocab_size, (3, n))
    plen = np.asarray([len(p) for p in prompts])
    padded = np.zeros((3, 8), np.int64)
    for i, p in enumerate(prompts):
        padded[i, : len(p)] = p
    steps = []
    monkeypatch.setattr(jkv, "WRITE_AFTER_THE_SCAN_ON_CPU", framework == "jax")  # jax-carried: the GPU's way
    if framework.startswith("jax"):
        graphdef, state = nnx.split(jmodel)
        call = jax.jit(lambda st, t, c: nnx.merge(graphdef, st)(t, cache=c))  # one compile per shape
        cache = JCache.init(jmodel.config, 3, slots)
        logits, cache = call(state, jnp.asarray(padded, jnp.int32), cache)
        cache = cache.with_lengths(plen)
        steps.append(np.asarray(logits))
        for j in range(n):
            logits, cache = call(state, jnp.asarray(cont[:, j : j + 1], jnp.int32), cache)
            steps.append(np.asarray(logits))
        full = lambda ids: np.asarray(jitted(jmodel)(jnp.asarray(ids[None], jnp.int32)))[0]  # noqa: E731
    else:
        cache = TCache(cfg, 3, slots)
        with torch.no_grad():
            steps.append(tmodel(torch.from_numpy(padded), cache=cache).numpy())
            cache.set_lengths(plen)
            for j in range(n):
                steps.append(tmodel(torch.from_numpy(cont[:, j : j + 1]), cache=cache).numpy())
        full = lambda ids: tmodel(torch.from_numpy(ids[None])).detach().numpy()[0]  # noqa: E731
    assert np.asarray(cache.lengths).tolist() == (plen + n).tolist()
    assert cache.max_len == slots
    for i, p in enumerate(prompts):
        ref = full(np.concatenate([p, cont[i]]))
        got = np.concatenate([steps[0][i, : len(p)]] + [s[i] for s in steps[1:]])
        np.testing.assert_allclose(got, ref, atol=LOGITS_TOL, rtol=0, err_msg=f"{framework} row {i}")


@pytest.mark.parametrize(
    "window, slots, chunk, n",
    [(None, 18, 4, 10), (None, 10, 4, 2), (4, 6, 3, 10)],
    ids=["full", "drops-past-the-end", "ring"],
)
@pytest.mark.parametrize("framework", ["jax", "jax-carried", "torch"])
def test_appending_cache_equals_full_forward(monkeypatch, twins, windowed, framework, window, slots, chunk, n):
    """A cache made with ``append=True`` prefilled ``chunk`` tokens per call (each row's length set to what it holds
    before each call, as ``generate``'s ``prefill_chunk`` does), then ``n`` one-token steps, vs each row's own full
    forward. ``drops-past-the-end``: the last chunk's padding reaches slots 10 and 11 of a 10-slot cache (dropped).
    ``ring``: the windowed model (4 tokens) in a ring of 4 + 3 - 1 slots, which row 2 passes during the prefill."""
    tmodel, jmodel = twins if window is None else windowed
    cfg = tmodel.config
    rng = np.random.default_rng(2)
    prompts = ragged(rng, cfg.vocab_size, [5, 2, 8])
    cont = rng.integers(0, cfg.vocab_size, (3, n))
    plen = np.asarray([len(p) for p in prompts])
    padded = np.zeros((3, 12), np.int64)
    for i, p in enumerate(prompts):
        padded[i, : len(p)] = p
    chunks, steps = [], []
    monkeypatch.setattr(jkv, "WRITE_AFTER_THE_SCAN_ON_CPU", framework == "jax")  # jax-carried: the GPU's way
    if framework.startswith("jax"):
        graphdef, state = nnx.split(jmodel)
        call = jax.jit(lambda st, t, c: nnx.merge(graphdef, st)(t, cache=c))  # one compile per shape
        cache = JCache.init(jmodel.config, 3, slots, append=True)
        for c in range(0, 12, chunk):
            cache = cache.with_lengths(np.minimum(plen, c))
            logits, cache = call(state, jnp.asarray(padded[:, c : c + chunk], jnp.int32), cache)
            chunks.append(np.asarray(logits))
        cache = cache.with_lengths(plen)
        for j in range(n):
            logits, cache = call(state, jnp.asarray(cont[:, j : j + 1], jnp.int32), cache)
            steps.append(np.asarray(logits))
        full = lambda ids: np.asarray(jitted(jmodel)(jnp.asarray(ids[None], jnp.int32)))[0]  # noqa: E731
    else:
        cache = TCache(cfg, 3, slots, append=True)
        with torch.no_grad():
            for c in range(0, 12, chunk):
                cache.set_lengths(np.minimum(plen, c))
                chunks.append(tmodel(torch.from_numpy(padded[:, c : c + chunk]), cache=cache).numpy())
            cache.set_lengths(plen)
            for j in range(n):
                steps.append(tmodel(torch.from_numpy(cont[:, j : j + 1]), cache=cache).numpy())
        full = lambda ids: tmodel(torch.from_numpy(ids[None])).detach().numpy()[0]  # noqa: E731
    assert np.asarray(cache.lengths).tolist() == (plen + n).tolist()
    prefill = np.concatenate(chunks, axis=1)  # [3, 12, V]: a row's own positions, whoever called them
    for i, p in enumerate(prompts):
        ref = full(np.concatenate([p, cont[i]]))
        got = np.concatenate([prefill[i, : len(p)]] + [s[i] for s in steps])
        np.testing.assert_allclose(got, ref, atol=LOGITS_TOL, rtol=0, err_msg=f"{framework} row {i}")


@pytest.mark.parametrize("framework", ["jax", "torch"])
def test_an_appending_ring_refuses_a_call_longer_than_its_spare_slots(windowed, framework):
    """A ring of 6 slots for a window of 4 takes at most 6 - 4 + 1 = 3 tokens per appending call."""
    tmodel, jmodel = windowed
    tokens = np.ones((2, 4), np.int64)
    with pytest.raises(ValueError, match=r"a call of 4 tokens appends to a ring of max_len 6 .* at most .* = 3"):
        if framework == "jax":
            jmodel(jnp.asarray(tokens, jnp.int32), cache=JCache.init(jmodel.config, 2, 6, append=True))
        else:
            tmodel(torch.from_numpy(tokens), cache=TCache(tmodel.config, 2, 6, append=True))
    for bad in ("yes", 1):
        with pytest.raises(ValueError, match="append must be a bool"):
            JCache.init(jmodel.config, 2, 6, append=bad) if framework == "jax" else TCache(
                tmodel.config, 2, 6, append=bad
            )


def test_a_plain_cache_folds_into_the_ring_alike_in_both_twins():
    """``KVCache.ring`` (JAX) and ``ring_into`` (torch): each row's last 4 positions of a 12-slot cache, position p
    in slot p % 4 (row 2, 10 tokens: 8 9 6 7), a short row's first slots as they are (row 1, 3 tokens), the
    lengths kept; the two twins' layouts (slots on axis 2 / 3) give the same ring."""
    cfg = ModelConfig.preset("tiny").replace(model_type="mistral", sliding_window=4)
    lengths = np.asarray([0, 3, 10])
    jfull = JCache.init(cfg, 3, 12)
    pos = jnp.arange(12, dtype=jnp.float32)[None, None, :, None, None]  # a slot's value: its position (+ layer)
    layer = jnp.arange(cfg.n_layers, dtype=jnp.float32)[:, None, None, None, None] * 100
    jfull = JCache(jfull.k + pos + layer, jfull.v - pos - layer, jnp.asarray(lengths, jnp.int32))
    jring = jfull.ring(4)
    assert jring.max_len == 4 and np.asarray(jring.lengths).tolist() == [0, 3, 10]
    assert np.asarray(jring.k[1, 2, :, 0, 0]).tolist() == [108, 109, 106, 107]
    assert np.asarray(jring.k[0, 1, :3, 0, 0]).tolist() == [0, 1, 2]
    tfull = TCache(cfg, 3, 12)
    tfull.k.copy_(torch.from_numpy(np.asarray(jfull.k)).transpose(2, 3))
    tfull.v.copy_(torch.from_numpy(np.asarray(jfull.v)).transpose(2, 3))
    tfull.set_lengths(lengths)
    tring = TCache(cfg, 3, 4)
    assert tfull.ring_into(tring) is tring and tring.lengths.tolist() == [0, 3, 10]
    np.testing.assert_array_equal(tring.k.transpose(2, 3).numpy(), np.asarray(jring.k))
    np.testing.assert_array_equal(tring.v.transpose(2, 3).numpy(), np.asarray(jring.v))
    with pytest.raises(ValueError, match=r"KVCache.ring: slots must be an int >= 1, got 0"):
        jfull.ring(0)
    with pytest.raises(ValueError, match=r"ring must be a KVCache of this one's \[n_layers, B, Hkv, D\]"):
        tfull.ring_into(TCache(cfg, 2, 4))


def test_torch_decode_builds_its_mask_once_per_step(twins):
    """An eager decode step builds the cache's mask once for all layers (one ``aten::le``; per layer it was about a
    fifth of the step's dispatched ops) and gives what the segment-id path gives, bit for bit, at GQA."""
    from torchref.attention import dot_product_attention, masked_attention

    tmodel, _ = twins
    cfg = tmodel.config
    assert cfg.n_layers > 1 and cfg.n_heads != cfg.n_kv_heads
    cache = TCache(cfg, 3, 16).set_lengths([4, 0, 9])
    ids = torch.randint(0, cfg.vocab_size, (3, 1), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), torch.profiler.profile() as prof:
        tmodel(ids, cache=cache)
    les = sum(e.count for e in prof.key_averages() if e.key == "aten::le")
    assert les == 1, f"the decode mask was built {les} times in one step of {cfg.n_layers} layers"

    kvs = cache.layers(1)
    assert len(kvs) == cfg.n_layers and all(kv.visible is kvs[0].visible for kv in kvs)
    g = torch.Generator().manual_seed(1)
    d = cfg.resolved_head_dim
    q = torch.randn(3, cfg.n_heads, 1, d, generator=g)
    k, v = (torch.randn(3, cfg.n_kv_heads, 16, d, generator=g) for _ in range(2))
    kv_ids = (torch.arange(16)[None] <= cache.lengths[:, None]).int()
    want = dot_product_attention(q, k, v, segment_ids=(torch.ones(3, 1, dtype=torch.int32), kv_ids))
    torch.testing.assert_close(masked_attention(q, k, v, kvs[0].visible), want, rtol=0, atol=0)


def test_prefill_needs_an_empty_cache(twins):
    tmodel, jmodel = twins
    jc = JCache.init(jmodel.config, 1, 16).with_lengths([3])
    with pytest.raises(ValueError, match="prefill and needs an empty cache"):
        jmodel(jnp.asarray([[1, 2]], jnp.int32), cache=jc)
    tc = TCache(tmodel.config, 1, 16).set_lengths([3])
    with pytest.raises(ValueError, match="prefill and needs an empty cache"), torch.no_grad():
        tmodel(torch.tensor([[1, 2]]), cache=tc)
