"""The ``splash`` backend (jax's Pallas TPU splash attention behind our contract), interpreted on the CPU.

Against THE oracle (``attention/reference.py``): output and dq/dk/dv through ``dot_product_attention(...,
backend="splash")`` on shapes the contract allows: any sequence length (padding), Sq != Sk (bottom-right), GQA and
MQA (the MQA kernel per KV head), windows, softcap, shared and paired segment ids (paired ids with queries that see
no key: zero output, zero gradients), float32 at the flash tests' bar and bfloat16 within 2x of a naive bfloat16
attention. What splash cannot serve is declined with a reason; the TPU default order starts with it (pinned); a
tiny model's train step traced for a TPU lowers to Mosaic TPU custom calls (no TPU, no libtpu needed to lower) and,
interpreted on the CPU, equals the ``xla`` backend's.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxattn.attention as attn
from jaxattn.attention import splash as S
from jaxattn.attention.reference import attention_reference
from parity_tests.test_flash import Case, _finite_scale, _inputs, _maxabs
from twincore.attention import default_order

CASES = [
    Case(1, 128, 128, 4, 4, 64),  # aligned, MHA
    Case(3, 17, 17, 8, 2, 80, causal=True),  # GQA, D 80, S padded to 128
    Case(1, 255, 255, 8, 1, 32, causal=True, window=(40, None)),  # MQA, window
    Case(1, 1, 513, 4, 4, 128, causal=True),  # decode: Sq = 1, Sk padded
    Case(1, 300, 200, 4, 2, 64, window=(16, 128)),  # Sq > Sk, the band still reaches every query
    Case(3, 128, 128, 8, 2, 64, causal=True, segments="packed"),  # paired ids; a run of queries sees no key
    Case(1, 17, 128, 4, 4, 32, segments="random"),  # unsorted paired ids, Sq != Sk
    Case(2, 150, 150, 4, 2, 64, causal=True, segments="shared"),  # one [B, S] array (packed documents)
    Case(1, 128, 255, 8, 1, 80, window=(20, 7), softcap=4.0),
    Case(1, 1, 1, 4, 4, 32, causal=True),  # S = 1 both
    Case(3, 128, 128, 8, 2, 64, dtype="bfloat16", causal=True, segments="packed"),
    Case(1, 255, 255, 8, 1, 80, dtype="bfloat16", softcap=5.0),
]


def _ids(case, q_ids, kv_ids):
    """The ``segment_ids`` argument: ``[B, S]`` for "shared" (packed documents, every query in one), a pair else."""
    if case.segments is None:
        return None
    if case.segments == "shared":
        rng = np.random.default_rng(case.seed + 5)
        cuts = np.sort(rng.integers(1, case.sq, size=(case.b, 3)), axis=1)
        return jnp.asarray((np.arange(case.sq)[None, :, None] >= cuts[:, None, :]).sum(-1), jnp.int32)
    return (q_ids, kv_ids)


def _vjp(fn, q, k, v, do):
    out, pull = jax.vjp(fn, q, k, v)
    return out, pull(do.astype(out.dtype))


def _run(case, backend, q, k, v, do, seg, dtype=None):
    kw = dict(causal=case.causal, window=case.window, softcap=case.softcap, segment_ids=seg)
    cast = (lambda x: x.astype(dtype)) if dtype else (lambda x: x)

    @jax.jit
    def go(q, k, v, do, seg):
        if backend == "reference":
            fn = lambda q, k, v: attention_reference(q, k, v, **dict(kw, segment_ids=seg))  # noqa: E731
        else:
            fn = lambda q, k, v: attn.dot_product_attention(q, k, v, **dict(kw, segment_ids=seg), backend=backend)  # noqa: E731
        return _vjp(fn, q, k, v, do)

    return go(cast(q), cast(k), cast(v), cast(do), seg)


def _naive_bf16(case, q, k, v, do, seg):
    """Attention written naively in bfloat16 (scores, softmax, p @ v and autodiff): the 2x rule's baseline."""
    args = attn.normalize(q, k, v, causal=case.causal, window=case.window, softcap=case.softcap, segment_ids=seg)

    def fn(q, k, v):
        dt, (b, sq, hq, d), (sk, hkv) = q.dtype, q.shape, k.shape[1:3]
        s = jnp.einsum("bqhgd,bkhd->bhgqk", q.reshape(b, sq, hkv, hq // hkv, d), k) * jnp.asarray(args.scale, dt)
        if args.softcap is not None:
            s = jnp.asarray(args.softcap, dt) * jnp.tanh(s / jnp.asarray(args.softcap, dt))
        vis = attn.mask(sq, sk, args)
        vis = vis[:, None, None] if vis.ndim == 3 else vis[None, None, None]
        p = jax.nn.softmax(jnp.where(vis, s, jnp.asarray(-jnp.inf, dt)), axis=-1)
        p = jnp.where(vis.any(-1, keepdims=True), p, jnp.zeros((), dt))
        return jnp.einsum("bhgqk,bkhd->bqhgd", p, v).reshape(b, sq, hq, d)

    return jax.jit(lambda *a: _vjp(fn, *a))(q, k, v, do)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_splash_matches_the_oracle(case):
    q, k, v, do, _, q_ids, kv_ids = _inputs(case)
    seg = _ids(case, q_ids, kv_ids)
    assert attn.available_backends(q, k, v, causal=case.causal, window=case.window, segment_ids=seg)["splash"] is None
    out, grads = _run(case, "splash", q, k, v, do, seg)
    r_out, r_grads = _run(case, "reference", q, k, v, do, seg, jnp.float32)
    assert out.shape == q.shape and out.dtype == q.dtype
    for name, x in (("out", out), ("dq", grads[0]), ("dk", grads[1]), ("dv", grads[2])):
        assert bool(jnp.all(jnp.isfinite(x))), f"{name} has non-finite values"
    empty = ~np.asarray(
        attn.mask(
            case.sq, case.sk, attn.normalize(q, k, v, causal=case.causal, window=case.window, segment_ids=seg)
        ).any(-1)
    )
    empty = np.broadcast_to(empty, (case.b, case.sq))
    if empty.any():  # queries that see no key: exactly zero, and no gradient through them
        assert np.all(np.asarray(out, np.float32)[empty] == 0.0) and np.all(
            np.asarray(grads[0], np.float32)[empty] == 0
        )
    got, ref = (out,) + tuple(grads), (r_out,) + tuple(r_grads)
    names = ("out", "dq", "dk", "dv")
    if case.dtype == "float32":
        err, tol = _maxabs(out, r_out), 1e-5 * max(1.0, _finite_scale(r_out))
        assert err <= tol, f"out: max-abs error {err:.3g} > {tol:.3g}"
        for name, g, r in zip(names[1:], got[1:], ref[1:]):
            np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-3, atol=1e-3, err_msg=name)
    else:
        naive = _naive_bf16(case, q, k, v, do, seg)
        eps = float(jnp.finfo(jnp.dtype(case.dtype)).eps)
        for name, g, r, n in zip(names, got, ref, (naive[0],) + tuple(naive[1])):
            err, tol = _maxabs(g, r), 2.0 * _maxabs(n, r) + 0.5 * eps * _finite_scale(r)
            assert err <= tol, f"{name}: splash error {err:.3g} > 2x naive bf16 error bound {tol:.3g}"


@pytest.mark.parametrize(
    "shape, dtype, kw, words",
    [
        ((1, 513, 17), jnp.float32, dict(causal=True), "Sq=513 > Sk=17 leaves the first queries with no key"),
        ((1, 64, 32), jnp.float32, dict(window=(8, 4)), "leaves the first queries with no key"),
        ((1, 64, 64), jnp.float16, dict(), "float32/bfloat16"),
    ],
)
def test_splash_declines_what_it_cannot_serve_and_the_dispatcher_moves_on(shape, dtype, kw, words):
    b, sq, sk = shape
    q = jax.random.normal(jax.random.key(0), (b, sq, 4, 32), dtype)
    kv = jax.random.normal(jax.random.key(1), (b, sk, 4, 32), dtype)
    reason = attn.available_backends(q, kv, kv, **kw)["splash"]
    assert reason is not None and words in reason
    with pytest.raises(attn.AttentionBackendError, match="splash: .*" + words.split(" ")[0]):
        attn.dot_product_attention(q, kv, kv, **kw, backend="splash")
    with attn.attention_backend("splash", "xla"):  # the next backend serves it
        out = attn.dot_product_attention(q, kv, kv, **kw)
    np.testing.assert_allclose(
        np.asarray(out, np.float32), np.asarray(attn.dot_product_attention(q, kv, kv, **kw, backend="xla"), np.float32)
    )


def test_tpu_default_order_starts_with_splash_and_torch_has_no_twin():
    assert default_order("tpu") == ("splash", "chunked", "xla")
    with attn.target_platform("tpu"):
        assert attn.default_backends() == ("splash", "chunked", "xla")
    assert "splash" not in attn.default_backends()  # CPU: interpreted kernels are for tests
    from twincore.attention import check_backend_names

    with pytest.raises(ValueError, match="'splash'.*no torch twin"):
        check_backend_names("splash", "backend", "torch")


def test_block_size_is_the_largest_that_divides_the_padded_length():
    assert [S.block_size(n) for n in (128, 256, 384, 512, 640, 1024, 4096)] == [128, 256, 128, 512, 128, 512, 512]


def test_block_size_stays_within_the_generations_vmem_cap(monkeypatch):
    """A generation's cap (the deviceless search's largest fitting block) bounds the block; a head dim between two
    searched rows takes the larger row's cap; an unsearched generation or head dim has none."""
    monkeypatch.setitem(S.VMEM_CAPS, "TPU test", {(128, "float32"): 256, (256, "float32"): 128})
    assert S.vmem_cap(96, jnp.float32, "TPU test") == 256 and S.vmem_cap(200, jnp.float32, "TPU test") == 128
    assert S.vmem_cap(512, jnp.float32, "TPU test") is None and S.vmem_cap(128, jnp.bfloat16, "TPU test") is None
    assert S.vmem_cap(128, jnp.float32, "TPU v9") is None
    assert S.block_size(4096, 128, jnp.float32, "TPU test") == 256
    assert S.block_size(4096, 256, jnp.float32, "TPU test") == 128
    assert S.block_size(4096, 128, jnp.bfloat16, "TPU test") == 512
    q = jnp.zeros((1, 200, 2, 64), jnp.float32)
    with pytest.raises(ValueError, match="block must divide the padded lengths 256 and 256, got 512"):
        S.splash_attention(q, q, q, attn.normalize(q, q, q), block=512)


def test_vmem_caps_are_the_committed_searchs_findings():
    """``VMEM_CAPS`` equals what ``python -m benchmarks compile --target <chip> --search`` found, per generation
    (benchmarks/results/<chip>-compiled/splash_blocks.json): the table is the search's, not typed."""
    import json
    import os

    from jaxattn import tpu_target

    for chip in tpu_target.CHIPS.values():
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        path = os.path.join(root, "benchmarks", "results", f"{chip.name}-compiled", "splash_blocks.json")
        with open(path) as f:
            d = json.load(f)
        assert d["env"]["target_device"] == chip.device_kind, path
        found: dict = {}
        for r in d["records"]:
            if r["status"] == "ok":
                key = (r["head_dim"], {"bf16": "bfloat16", "fp32": "float32"}[r["dtype"]])
                found[key] = max(found.get(key, 0), r["block"])
        assert S.VMEM_CAPS[chip.device_kind] == found, chip.name


# ----------------------------------------------------------------------------------------------- the model
@pytest.fixture(scope="module")
def tiny():
    from flax import nnx

    from jaxattn.config import ModelConfig
    from jaxattn.model import Llama

    model = Llama(ModelConfig.preset("tiny"), rngs=nnx.Rngs(3))
    tok = jax.random.randint(jax.random.key(4), (2, 19), 0, model.config.vocab_size)  # odd length: padded
    ids = jnp.asarray(np.sort(np.random.default_rng(5).integers(0, 2, (2, 19)), axis=1), jnp.int32)
    return model, tok, ids


def _step(model, tok, ids):
    """The next-token loss and its gradients of a tiny model (fp32) — one train step's numbers."""
    from flax import nnx

    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(params):
        logits = nnx.merge(graphdef, params, rest)(tok[:, :-1], segment_ids=ids[:, :-1])
        logp = jax.nn.log_softmax(logits.astype(jnp.float32))
        return -jnp.take_along_axis(logp, tok[:, 1:, None], -1).mean()

    return jax.value_and_grad(loss), params


def test_tiny_train_step_with_splash_equals_xla(tiny):
    model, tok, ids = tiny
    fn, params = _step(model, tok, ids)
    results = {}
    for name in ("splash", "xla"):
        with attn.attention_backend(name):  # chosen at trace time: jit inside the block
            results[name] = jax.jit(fn)(params)
    (l_s, g_s), (l_x, g_x) = results["splash"], results["xla"]
    assert abs(float(l_s) - float(l_x)) <= 1e-5
    for a, b in zip(jax.tree.leaves(g_s), jax.tree.leaves(g_x)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


def test_tiny_train_step_traced_for_a_tpu_lowers_to_splash_kernels(tiny):
    """No TPU and no libtpu: the step traced for a TPU target takes the default order's first backend, splash, and
    lowers to Mosaic TPU custom calls (forward, dq and dkv per layer scan body)."""
    model, tok, ids = tiny
    fn, params = _step(model, tok, ids)
    with attn.target_platform("tpu"):
        text = jax.jit(fn).trace(params).lower(lowering_platforms=("tpu",)).as_text()
    assert text.count("tpu_custom_call") >= 3
    assert "splash" in text


@pytest.mark.parametrize(
    "case",
    [
        Case(2, 100, 150, 2, 1, 32, causal=True, segments="packed"),  # 150 keys: chunks 0-31, ..., 128-159
        Case(1, 60, 130, 2, 2, 32, window=(20, 10), segments="random"),  # the band, not only the ids, per chunk
    ],
    ids=str,
)
def test_rows_without_a_key_are_found_across_kv_chunks(monkeypatch, case):
    """Paired ids over several ``KV_CHUNK``-key chunks (the chunk cut to 32: every other paired case fits one
    chunk of 512): the queries that see a key are exactly the contract mask's (each chunk's keys at their own
    positions, the padding past Sk masked), and the output through the kernel equals the oracle's, zero on the
    rows without a key. Row 0's ids are set so that causality alone empties rows: id 0 for keys from 96 on (the
    fourth chunk), so under the causal band (offset 50) queries 0-45 of id 0 see none."""
    monkeypatch.setattr(S, "KV_CHUNK", 32)
    q, k, v, do, _, q_ids, kv_ids = _inputs(case)
    q_ids = q_ids.at[:, 40:44].set(99)  # a run of queries whose id no key has (the "packed" ids have one too)
    if case.causal:
        kv_ids = kv_ids.at[0].set(jnp.where(jnp.arange(case.sk) >= 96, 0, 1))
        q_ids = q_ids.at[0].set(jnp.where(jnp.arange(case.sq) < 60, 0, 1))
    args = attn.normalize(q, k, v, causal=case.causal, window=case.window, segment_ids=(q_ids, kv_ids))
    want = np.asarray(attn.mask(case.sq, case.sk, args).any(-1))
    assert not want.all() and want.any()  # some queries see no key, some do
    np.testing.assert_array_equal(np.asarray(S._rows_with_a_key(case.sq, case.sk, args)), want)
    kw = dict(causal=case.causal, window=case.window, segment_ids=(q_ids, kv_ids))
    out = jax.jit(lambda q, k, v: attn.dot_product_attention(q, k, v, **kw, backend="splash"))(q, k, v)
    ref = attention_reference(q, k, v, **kw)
    assert _maxabs(out, ref) <= 1e-5 * max(1.0, _finite_scale(ref))
    assert np.all(np.asarray(out)[~want] == 0.0)
