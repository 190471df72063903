"""Parity tests of the Pallas split-K decode kernel (``jaxattn.attention.decode``, backend ``flash_decode``).

The kernel is compared with the one attention oracle, ``reference.attention_reference`` (float32 at
``Precision.HIGHEST``), called with the KV cache's decode segment ids (``q_ids = 1``, ``kv_ids = slot <
length``), which is what "keys at slots >= length are masked" means in the contract:

* ``TestFlashDecodeInterpret`` runs the kernel in Pallas interpret mode on CPU (the same kernel code, masked
  loads included); ``TestFlashDecodeGPU`` (marker ``gpu``) runs the same test compiled with the Triton
  lowering, plus larger shapes.  Every run pre-fills the kernel's output buffers with NaN
  (``_poison_outputs``), so a split that forgets to write its partial result fails.
* Cases cover GQA groups 1, 3 and 4 (the group's heads are the rows of one q block, padded to 16), cache
  sizes and lengths that are odd and not multiples of ``block_k`` (the tail block is a masked load; no copy
  of the cache), rows of different lengths in one batch including a length-0 row (zeros, LSE ``-inf``) and a
  full row, one split and several (including more splits than a row has key blocks: empty splits), a cache
  shorter than 16 slots (padded to one 16-key block), a head dim that needs padding (24), softcap, fp32 and
  bf16.
* Tolerances (design §7): fp32 output and LSE max-abs <= ``1e-5 * max(1, max|ref|)``; bf16: error vs the
  fp32 oracle <= 2x the error of a naive attention computed entirely in bf16 plus half a bf16 ulp at the
  output's magnitude (the kernel rounds its fp32 result to bf16; see ``test_flash.py``); the LSE is fp32 by
  contract and held to the fp32 bar.
* Beyond ``Sq = 1``: a few query tokens with ``causal`` (query i at ``length - Sq + i``; the oracle sees each
  row's valid prefix rotated to the end of the cache), and the dispatcher path with the general contract (causal +
  window + softcap + unsorted segment ids, ``Sq = 2``).
* The backend in the model: ``cached_attention`` and greedy ``jaxattn.generate`` under
  ``attention_backend("flash_decode")`` match the default backend; gradients raise (forward only); bad block
  sizes, lengths and oversized calls raise or decline with the reason.
* Deviceless H100 compile (``gpu_compile``, with the CUDA plugin, helpers from ``test_gpu_compile.py``): the
  bf16 kernel at B=8, Hq=32, Hkv=8, D=128, cache 4096 lowers to one Triton kernel without spills.
"""

from __future__ import annotations

import dataclasses
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxattn import attention as attn
from jaxattn.attention import decode as DEC
from jaxattn.attention.reference import attention_reference
from parity_tests.test_gpu_compile import TRITON, _custom_calls, _devices, needs_plugin
from parity_tests.twins import normal_draws


@dataclasses.dataclass(frozen=True)
class Case:
    b: int
    hq: int
    hkv: int
    d: int
    t: int  # cache slots
    lengths: tuple[int, ...]  # valid slots per row
    dtype: str = "float32"
    block_k: int = 16
    num_splits: int | None = None
    softcap: float | None = None
    sq: int = 1
    seed: int = 0

    def __str__(self):
        parts = [
            f"b{self.b}",
            f"h{self.hq}-{self.hkv}",
            f"d{self.d}",
            f"t{self.t}",
            "len" + "-".join(map(str, self.lengths)),
            self.dtype,
            f"bk{self.block_k}",
            f"split{self.num_splits or 'auto'}",
        ]
        if self.softcap is not None:
            parts.append(f"cap{self.softcap:g}")
        return "_".join(parts)


DEFAULT_CASES = [
    Case(3, 4, 4, 32, 37, (37, 0, 20), num_splits=1),  # G = 1, one split
    Case(3, 6, 2, 24, 53, (0, 53, 17), num_splits=3),  # G = 3, D padded to 32
    # G = 4, heuristic splits (4 for 4 key blocks): row 0 has 1 block, so 3 of its splits are empty
    Case(4, 8, 2, 64, 100, (1, 100, 45, 0), block_k=32, softcap=3.0),
    Case(3, 8, 2, 64, 77, (77, 0, 31), dtype="bfloat16", num_splits=3),  # bf16, G = 4
    Case(2, 6, 2, 32, 11, (11, 5), dtype="bfloat16", block_k=64, num_splits=4),  # cache < 16 slots, G = 3
]

BIG_CASES = [
    Case(2, 32, 8, 128, 4096, (4096, 1537), dtype="bfloat16", block_k=64),
    Case(4, 16, 2, 128, 3001, (3001, 0, 1, 2048), dtype="bfloat16", block_k=64, num_splits=16),
    Case(1, 8, 8, 64, 777, (500,), block_k=64),
]


# ------------------------------------------------------------------------------------------------ helpers
def _inputs(case: Case):
    rnd = normal_draws(np.random.default_rng(case.seed + 7919 * case.t + 31 * case.hq + case.d), case.dtype)
    q = rnd(case.b, case.sq, case.hq, case.d)
    k = rnd(case.b, case.t, case.hkv, case.d)
    v = rnd(case.b, case.t, case.hkv, case.d)
    return q, k, v, jnp.asarray(case.lengths, jnp.int32)


def _decode_ids(lengths, b: int, sq: int, t: int):
    """The contract's form of "keys at slots >= length are invisible" (what ``kv_cache`` passes)."""
    return jnp.ones((b, sq), jnp.int32), (jnp.arange(t)[None, :] < lengths[:, None]).astype(jnp.int32)


def _naive_low_precision(q, k, v, seg, softcap):
    """Decode attention written naively in the inputs' dtype (scores, softmax, p@v in bf16): the 2x rule's
    baseline."""
    dt = q.dtype
    b, sq, hq, d = q.shape
    hkv = k.shape[2]
    s = jnp.einsum("bqhgd,bkhd->bhgqk", q.reshape(b, sq, hkv, hq // hkv, d), k) * jnp.asarray(d**-0.5, dt)
    if softcap is not None:
        s = jnp.asarray(softcap, dt) * jnp.tanh(s / jnp.asarray(softcap, dt))
    vis = (seg[0][:, :, None] == seg[1][:, None, :])[:, None, None]
    s = jnp.where(vis, s, jnp.asarray(-jnp.inf, dt))
    m = jnp.max(s, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, jnp.zeros_like(m))
    p = jnp.where(vis, jnp.exp(s - m), jnp.zeros_like(s))
    l = jnp.sum(p, axis=-1, keepdims=True)
    return jnp.einsum("bhgqk,bkhd->bqhgd", p / jnp.where(l > 0, l, jnp.ones_like(l)), v).reshape(b, sq, hq, d)


def _maxabs(a, b):
    a = np.asarray(jnp.asarray(a, jnp.float32))
    b = np.asarray(jnp.asarray(b, jnp.float32))
    both_inf = np.isinf(a) & np.isinf(b) & (np.sign(a) == np.sign(b))
    with np.errstate(invalid="ignore"):
        return float(np.max(np.where(both_inf, 0.0, np.abs(a - b))))


def _scale(x):
    x = np.asarray(jnp.asarray(x, jnp.float32))
    x = x[np.isfinite(x)]
    return float(np.max(np.abs(x))) if x.size else 0.0


def _assert_fp32_close(name, got, ref):
    err, tol = _maxabs(got, ref), 1e-5 * max(1.0, _scale(ref))
    assert err <= tol, f"{name}: max-abs error {err:.3g} > {tol:.3g}"


# ------------------------------------------------------------------------------------------------ parity
def pytest_generate_tests(metafunc):
    if "case" in metafunc.fixturenames and metafunc.cls is not None:
        metafunc.parametrize("case", metafunc.cls.CASES, ids=[str(c) for c in metafunc.cls.CASES])


class _DecodeSuite:
    """Kernel vs oracle for one case: output, LSE, zero rows, every split written."""

    INTERPRET = True
    CASES = DEFAULT_CASES

    def test_parity(self, case: Case):
        q, k, v, lengths = _inputs(case)
        bs = DEC.DecodeBlockSizes(block_k=case.block_k, num_splits=case.num_splits)
        run = jax.jit(
            lambda q, k, v, n: DEC.flash_decode(
                q,
                k,
                v,
                n,
                softcap=case.softcap,
                return_lse=True,
                block_sizes=bs,
                interpret=self.INTERPRET,
                _poison_outputs=True,
            )
        )
        out, lse = run(q, k, v, lengths)
        seg = _decode_ids(lengths, case.b, case.sq, case.t)
        f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
        r_out, r_lse = jax.jit(
            lambda q, k, v, seg: attention_reference(
                f32(q), f32(k), f32(v), segment_ids=seg, softcap=case.softcap, return_lse=True
            )
        )(q, k, v, seg)

        assert out.shape == q.shape and out.dtype == q.dtype
        assert lse.shape == (case.b, case.hq, case.sq) and lse.dtype == jnp.float32
        assert bool(jnp.all(jnp.isfinite(out))), "non-finite output (an unwritten split or a NaN row)"
        np.testing.assert_array_equal(np.isneginf(np.asarray(lse)), np.isneginf(np.asarray(r_lse)))
        empty = np.asarray(case.lengths) == 0
        if empty.any():
            assert np.all(np.asarray(out)[empty] == 0), "a length-0 row must return exactly zeros"
        _assert_fp32_close("lse", lse, r_lse)  # fp32 by contract, whatever the input dtype
        if case.dtype == "float32":
            _assert_fp32_close("out", out, r_out)
        else:
            naive = jax.jit(_naive_low_precision, static_argnums=4)(q, k, v, seg, case.softcap)
            eps = float(jnp.finfo(jnp.dtype(case.dtype)).eps)
            err, tol = _maxabs(out, r_out), 2.0 * _maxabs(naive, r_out) + 0.5 * eps * _scale(r_out)
            assert err <= tol, f"out: kernel error {err:.3g} > 2x naive {case.dtype} error bound {tol:.3g}"


class TestFlashDecodeInterpret(_DecodeSuite):
    INTERPRET = True
    CASES = DEFAULT_CASES


@pytest.mark.gpu
class TestFlashDecodeGPU(_DecodeSuite):  # the default GPU run: the contract cases plus one long cache
    INTERPRET = False
    CASES = DEFAULT_CASES + BIG_CASES[:1]


@pytest.mark.slow
@pytest.mark.gpu
class TestFlashDecodeBigGPU(_DecodeSuite):
    INTERPRET = False
    CASES = BIG_CASES[1:]


def test_few_query_tokens_causal_against_oracle():
    """Sq = 4 (speculative-decoding size), G = 4 (16 rows: no padding rows, plain stores): query i of row b
    sits at ``lengths[b] - 4 + i``.  The oracle sees the same thing when each row's valid prefix is rotated to
    the END of the cache (bottom-right causal is aligned to the key length) and the rotated-in slots get another
    segment id.  A row shorter than Sq has queries that see no key (zeros), a length-0 row is all zeros."""
    b, sq, hq, hkv, d, t = 4, 4, 8, 2, 32, 41
    rng = np.random.default_rng(5)
    q, k, v = (
        jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((b, sq, hq, d), (b, t, hkv, d), (b, t, hkv, d))
    )
    lengths = jnp.asarray([41, 2, 0, 26], jnp.int32)

    @jax.jit
    def run(q, k, v, lengths):
        out = DEC.flash_decode(
            q,
            k,
            v,
            lengths,
            causal=True,
            return_lse=True,
            _poison_outputs=True,
            block_sizes=DEC.DecodeBlockSizes(block_k=16, num_splits=2),
        )
        ref = DEC.flash_decode_reference(q, k, v, lengths, causal=True, return_lse=True)
        src = (jnp.arange(t)[None, :] + lengths[:, None] - t) % t  # slot j of the rotated row holds key src
        rot = jax.vmap(lambda x, i: x[i])
        kv_ids = (jnp.arange(t)[None, :] >= t - lengths[:, None]).astype(jnp.int32)
        oracle = attention_reference(
            q,
            rot(k, src),
            rot(v, src),
            causal=True,
            return_lse=True,
            segment_ids=(jnp.ones((b, sq), jnp.int32), kv_ids),
        )
        return out, ref, oracle

    (out, lse), (ref, ref_lse), (o_out, o_lse) = run(q, k, v, lengths)
    for name, r, r_lse in (("oracle", o_out, o_lse), ("flash_decode_reference", ref, ref_lse)):
        _assert_fp32_close(f"out vs {name}", out, r)
        _assert_fp32_close(f"lse vs {name}", lse, r_lse)
        np.testing.assert_array_equal(np.isneginf(np.asarray(lse)), np.isneginf(np.asarray(r_lse)))
    assert np.all(np.asarray(out[2]) == 0) and np.all(np.asarray(out[1, :2]) == 0)  # no key: zeros
    assert np.isneginf(np.asarray(lse[1, :, :2])).all() and np.isfinite(np.asarray(lse[1, :, 2:])).all()


def test_backend_serves_the_general_contract():
    """Through the dispatcher: Sq = 2, G = 3, causal + window + softcap + unsorted segment ids (with query rows
    that see no key), visibility aligned to the full key length as the contract says."""
    b, sq, hq, hkv, d, t = 2, 2, 6, 2, 32, 45
    rng = np.random.default_rng(6)
    q, k, v = (
        jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((b, sq, hq, d), (b, t, hkv, d), (b, t, hkv, d))
    )
    q_ids = jnp.asarray([[0, 1], [2, 7]], jnp.int32)  # id 7 appears in no key: that query sees nothing
    kv_ids = jnp.asarray(rng.integers(0, 3, (b, t)), jnp.int32)
    kw = dict(causal=True, window=(20, None), softcap=4.0, segment_ids=(q_ids, kv_ids))
    assert attn.available_backends(q, k, v, backends=("flash_decode",), **kw) == {"flash_decode": None}
    out = attn.dot_product_attention(q, k, v, backend="flash_decode", **kw)
    ref = attention_reference(q, k, v, **kw)
    _assert_fp32_close("out", out, ref)
    assert np.all(np.asarray(out[1, 1]) == 0)


def test_num_splits_heuristic():
    """FA2's rule on an H100 (2 x 132 CTA slots): split only when B * Hkv programs leave the GPU idle."""
    assert DEC.num_splits_heuristic(8 * 8, 4096 // 64) == 4  # B=8, Hkv=8: 256 programs
    assert DEC.num_splits_heuristic(1 * 8, 4096 // 64) == 32  # batch 1: 256 programs of 2 blocks
    assert DEC.num_splits_heuristic(64 * 8, 4096 // 64) == 1  # enough programs already
    assert DEC.num_splits_heuristic(1, 3) == 3  # never more splits than key blocks


# ------------------------------------------------------------------------------------------------ model
def test_kv_cache_decode_routes_through_the_kernel(monkeypatch):
    """``cached_attention`` (one decode step of one layer) under ``attention_backend("flash_decode")`` calls
    the kernel and matches the default backend; ragged lengths, one row about to fill the cache; both ways (the
    stacked cache written then the layer read, and the layer's slots read then written: the CPU's). The stacked
    cache's write after the layer scan (``KVCache.written``) puts each layer's keys at its rows' slots, keeps the
    rest."""
    from jaxattn.kv_cache import KVCache, cached_attention

    calls = []
    real = DEC.attention
    monkeypatch.setattr(DEC, "attention", lambda *a: calls.append(1) or real(*a))
    rng = np.random.default_rng(7)
    b, hq, hkv, d, t = 3, 4, 2, 16, 29
    q, k, v = (
        jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((b, 1, hq, d), (b, 1, hkv, d), (b, 1, hkv, d))
    )
    kc, vc = (jnp.asarray(rng.standard_normal((2, b, t, hkv, d)), jnp.float32) for _ in range(2))  # 2 layers
    lengths = jnp.asarray([0, 28, 13], jnp.int32)
    ref, _ = jax.jit(cached_attention)(q, k, v, kc, vc, 1, lengths)

    @jax.jit
    def step(*a):
        with attn.attention_backend("flash_decode"):
            return cached_attention(*a)

    out, (kc2, _) = step(q, k, v, kc, vc, 1, lengths)
    assert calls, "the decode step did not reach the flash_decode backend"
    _assert_fp32_close("decode step", out, ref)
    assert bool(jnp.all(kc2[1, 1, 28] == k[1, 0])) and bool(jnp.all(kc2[0] == kc[0]))  # layer 1 written, 0 kept
    # the CPU's way: the layer's slots read as they were, the call's keys returned for one write after the layer scan
    out_read, (k_out, _) = jax.jit(cached_attention, static_argnums=5)(q, k, v, kc[1], vc[1], None, lengths)
    _assert_fp32_close("decode step, slots read then written", out_read, ref)
    assert k_out is not None and bool(jnp.all(k_out == k))
    new_k, new_v = jnp.stack([k + 1, k]), jnp.stack([v + 1, v])  # [2, B, 1, Hkv, D]: the layers' differ
    w = KVCache(kc, vc, lengths).written(new_k, new_v)
    assert bool(jnp.all(w.k[1] == kc2[1])) and bool(jnp.all(w.k[0, 1, 28] == k[1, 0] + 1))
    assert bool(jnp.all(w.v[:, 2, 13] == new_v[:, 2, 0])) and w.lengths.tolist() == [1, 29, 14]
    kept = np.ones((2, b, t), bool)
    kept[:, [0, 1, 2], [0, 28, 13]] = False
    assert bool(jnp.all(w.k[kept] == kc[kept])) and bool(jnp.all(w.v[kept] == vc[kept]))  # every other slot kept


def test_generate_greedy_tokens_match_default_backend(monkeypatch):
    """Greedy ``jaxattn.generate`` on the tiny preset gives the same tokens with every attention call in the
    flash_decode kernel (interpret mode) as with the default backend.  ``generate`` caches its jitted programs
    per model and a jitted function keeps the backend of its first trace, so the cache is cleared around each
    run.  Embedding and head are scaled x4 (as in ``test_generate.py``) so greedy argmax is not decided by
    1e-7 roundings."""
    from flax import nnx

    from jaxattn import generate as jgen
    from jaxattn.config import ModelConfig
    from jaxattn.model import Llama

    calls = []
    real = DEC.attention
    monkeypatch.setattr(DEC, "attention", lambda *a: calls.append(a[0].shape) or real(*a))
    model = Llama(ModelConfig.preset("tiny"), rngs=nnx.Rngs(0))
    model.embed[...] = model.embed[...] * 4.0
    model.lm_head[...] = model.lm_head[...] * 4.0
    rng = np.random.default_rng(8)
    prompts = [rng.integers(0, 256, n).tolist() for n in (3, 9)]
    want = jgen.generate(model, prompts, 8)
    assert not calls
    with attn.attention_backend("flash_decode"):  # the programs are cached per backend block: no stale trace
        got = jgen.generate(model, prompts, 8)
    assert any(shape[1] == 1 for shape in calls), "no decode step reached the flash_decode backend"
    assert got == want and len(set(want[0])) > 2
    n = len(calls)
    assert jgen.generate(model, prompts, 8) == want and len(calls) == n  # back outside: the default programs


# ------------------------------------------------------------------------------------------------ errors
def _small():
    rng = np.random.default_rng(9)
    q = jnp.asarray(rng.standard_normal((2, 1, 4, 16)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((2, 20, 2, 16)), jnp.float32)
    return q, k, k + 1.0, jnp.asarray([20, 3], jnp.int32)


def test_gradient_raises_forward_only():
    q, k, v, lengths = _small()
    with pytest.raises(NotImplementedError, match="forward-only"):
        jax.grad(lambda q: DEC.flash_decode(q, k, v, lengths).sum())(q)
    with pytest.raises(NotImplementedError, match="forward-only"):
        jax.grad(lambda v: attn.dot_product_attention(q, k, v, backend="flash_decode").sum())(v)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(block_k=24), "block_k must be a power of two"),
        (dict(block_k=8), "block_k must be a power of two"),
        (dict(num_splits=0), "num_splits must be None"),
        (dict(num_splits=2.0), "num_splits must be None"),
        (dict(num_warps=3), "num_warps must be one of"),
        (dict(num_stages=0), "num_stages must be an int"),
    ],
)
def test_bad_block_sizes(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DEC.DecodeBlockSizes(**kwargs)


def test_bad_inputs():
    q, k, v, lengths = _small()
    with pytest.raises(ValueError, match=r"lengths must have shape \(B,\) = \(2,\).*got shape \(2, 1\)"):
        DEC.flash_decode(q, k, v, lengths[:, None])
    with pytest.raises(ValueError, match=r"lengths must have shape \(B,\) = \(2,\).*got shape \(3,\)"):
        DEC.flash_decode(q, k, v, jnp.asarray([1, 2, 3], jnp.int32))
    with pytest.raises(TypeError, match="lengths must have an integer dtype"):
        DEC.flash_decode(q, k, v, jnp.asarray([1.0, 2.0]))
    with pytest.raises(ValueError, match=r"lengths must lie in \[0, T\] = \[0, 20\]"):
        DEC.flash_decode(q, k, v, jnp.asarray([21, 0], jnp.int32))
    with pytest.raises(TypeError, match="block_sizes must be None or a decode.DecodeBlockSizes"):
        DEC.flash_decode(q, k, v, lengths, block_sizes=(16, 2))
    big_q = jnp.ones((2, 33, 4, 16), jnp.float32)  # 33 tokens x G=2 = 66 rows > 64
    with pytest.raises(ValueError, match="more than 64; use the 'flash' backend"):
        DEC.flash_decode(big_q, k, v, lengths)
    reasons = attn.available_backends(big_q, k, v, backends=("flash_decode", "xla"))
    assert "66 query rows" in reasons["flash_decode"] and reasons["xla"] is None
    with pytest.raises(attn.AttentionBackendError, match="flash_decode: flash_decode serves decoding"):
        attn.dot_product_attention(big_q, k, v, backend="flash_decode")


# ------------------------------------------------------------------------------------------------ GPU compile
H100_SHAPE = dict(b=8, hq=32, hkv=8, d=128, t=4096)  # Llama-3-8B heads, batch 8, a 4k cache


def _h100_args(devs=None):
    s = H100_SHAPE
    q = jax.ShapeDtypeStruct((s["b"], 1, s["hq"], s["d"]), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((s["b"], s["t"], s["hkv"], s["d"]), jnp.bfloat16)
    n = jax.ShapeDtypeStruct((s["b"],), jnp.int32)
    if devs is None:
        return q, kv, kv, n
    from jaxattn import gpu_target

    return gpu_target.place((q, kv, kv, n), devs)


def _kv_cache_step(q, k, v, lengths):
    """The kv_cache decode call: decode segment ids through the dispatcher."""
    kv_ids = (jnp.arange(k.shape[1])[None, :] <= lengths[:, None]).astype(jnp.int32)
    with attn.attention_backend("flash_decode"):
        return attn.dot_product_attention(q, k, v, segment_ids=(jnp.ones((q.shape[0], 1), jnp.int32), kv_ids))


def test_lowers_to_one_triton_kernel_for_cuda():
    """No plugin needed: lowering for a GPU target emits exactly one Triton custom call (phase 2 is XLA)."""
    with attn.target_platform("gpu", compute_capability=(9, 0)):
        assert _custom_calls(lambda q, k, v, n: DEC.flash_decode(q, k, v, n), *_h100_args()).count(TRITON) == 1
        assert _custom_calls(_kv_cache_step, *_h100_args()).count(TRITON) == 1


@pytest.mark.gpu_compile
@needs_plugin
@pytest.mark.parametrize("path", ["lengths", "kv_cache_ids"])
def test_h100_compile_no_spills(path):
    """Deviceless compile for an H100 (bf16, B=8, Hq=32, Hkv=8, D=128, cache 4096): one ``flash_decode``
    Triton kernel within the SM's limits, no spills.  Figures "compiled for H100, not run" (benchmarks/NOTES.md)."""
    from benchmarks.tools import kernel_stats
    from benchmarks.tools.kernel_stats import H100_LIMITS
    from jaxattn import gpu_target

    fn = (lambda q, k, v, n: DEC.flash_decode(q, k, v, n)) if path == "lengths" else _kv_cache_step
    with tempfile.TemporaryDirectory() as dump:
        gpu_target.compile(fn, *_h100_args(_devices()), compiler_options={"xla_dump_to": dump})
        recs = kernel_stats.from_xla_dump(dump, names=("flash_decode",))
    r = recs["flash_decode"]
    assert r["registers"] is not None and r["registers"] <= H100_LIMITS["max_regs_per_thread"], r
    assert r["registers"] * r["threads"] <= H100_LIMITS["registers"], r
    assert 0 < r["smem_bytes"] <= H100_LIMITS["smem_per_block"], r
    assert r["blocks_per_sm"] >= 1, r
    assert (r["spill_stores"], r["spill_loads"]) == (0, 0), r
