"""Tests for ``jaxattn.attention.mosaic``: Pallas Mosaic GPU attention for Hopper, forward and backward.

Oracle: ``reference.attention_reference`` (float32, ``Precision.HIGHEST``) and its autodiff gradients.

How the forward kernel works (hand-written, because JAX's own ``attention_mgpu`` op has no scale, no
bottom-right causal for ``Sq != Sk``, no padding and no causal backward): one CTA per (q head,
``2 * block_q`` query rows, batch) with three warpgroups.  Warpgroups 0 and 1 each own ``block_q`` query
rows: Q tile -> SMEM by TMA, then for every kv block ``S = Q K^T`` (wgmma, fp32), online softmax in
registers (exp2 with the scale folded into ``log2(e) * scale``), ``acc += P V`` (wgmma).  Warpgroup 2 is
the producer: it streams K/V blocks by TMA into a ring of ``max_concurrent_steps`` SMEM slots and re-fills
a slot once both consumers arrived on its "consumed" barrier.  A shared "schedule" barrier keeps the two
consumers in lock-step (ping-pong, FA3), which also makes it safe for the consumer that finished early
under causal masking to keep arriving on the consumed barriers (drain loop) until the producer has
streamed every block the other consumer needs.  The kv loop is split into an unmasked fast part and a
masked part.  Padding: q to a multiple of ``2 * block_q``, k/v to a multiple of ``block_kv``; padded keys
are masked (last kv block, or by the causal mask, which already hides them); padded query rows are sliced
off.  A row that sees no key (causal with ``Sq > Sk``) gives zeros and LSE ``-inf``: the running max
starts at a finite ``-1e30`` and ``l`` is clamped before the division.

The per-tile math (``_kv_bounds``, ``_tile_mask``, ``_softmax_update``, ``_finalize``) uses only operations
that exist both on Mosaic GPU register arrays and on ``jnp`` arrays, so the forward runs three ways:

* ``impl="mosaic"``: the real kernel (Hopper GPU; ``gpu`` tests), and, on CPU, a cross-platform export
  (``jax.export(platforms=["cuda"])``) runs the real Pallas -> Mosaic GPU lowering (wgmma, TMA, layouts),
  forward and backward (whose flash kernels go through the Triton lowering);
* ``impl="interpret"``: the same kernel body under JAX's Mosaic GPU *interpreter* on CPU (threads,
  barriers and TMA simulated, race detector on).  The interpreter lacks ``layout_cast``, layout-annotated
  iotas, ``wgmma`` on transposed refs and ``run_state``, so under it those four are replaced by plain
  equivalents (identity, ``lax.broadcasted_iota``, ``jnp.dot`` on SMEM values, ``acc + ...``) and the two
  scheduling hints (``set_max_registers``, ``optimization_barrier``) are skipped.  The ``jnp.dot`` loads go
  through the generic proxy where wgmma reads through the async proxy (as TMA writes), so each is followed
  by ``commit_smem`` (``fence.proxy.async``) before the consumed arrive lets TMA refill the slot;
* ``impl="emulate"``: a pure-jnp vmapped tile loop with the same bounds and tile math (also float32).

Backward (FlashAttention-2, alg. 2): the custom VJP saves ``out`` and the LSE; XLA computes the LSE in log2
units (``_LSE_EMPTY`` for rows that see no key and padded rows, so their ``p`` is 0) and ``delta = rowsum(dO * O) -
dLSE`` (the LSE cotangent folded in, since ``dLSE/dS = P``), then two Mosaic GPU kernels shaped like the forward
(two consumer warpgroups of 64 rows, a producer warpgroup filling a TMA ring, a "released" barrier per slot with two
arrivals). ``dkv``: a CTA owns ``2 * block_kv_dkv`` keys of one kv head, K/V resident in SMEM; the producer streams
Q / dO / LSE / delta blocks for every query head of the group in turn, only the query blocks ``[lo, nq)`` that see
the CTA's keys (``_q_bounds``, the transpose of ``_kv_bounds``); per block ``S^T = K Q^T``, ``P^T``, ``dV += P^T
dO``, ``dP^T = V dO^T``, ``dS^T = P^T (dP^T - delta)``, ``dK += dS^T Q``, masked only in ``[lo, full)``; warpgroup 1
(later keys) drains the blocks no query of it sees. ``dq``: a CTA owns ``2 * block_q_dq`` query rows, Q / dO / LSE /
delta resident, K/V streamed over the forward's kv bounds (the same unmasked / masked split, the same drain).
``p`` and ``dS`` enter their wgmmas in the input dtype. Head_dim 256 (or ``MosaicBlockSizes.backward`` a
``flash.BlockSizes``) runs ``flash.flash_backward`` instead. On CPU: ``impl="emulate"`` runs the same math on whole
matrices (``_emulated_backward``, also float32), ``impl="interpret"`` the kernels under the interpreter with its race
detector, and the cross-platform export lowers them for CUDA.

Tolerances (design §7): fp32 forward max-abs <= 1e-5, fp32 grads rtol = atol = 1e-3; bf16/fp16 error
vs the oracle <= 2x the error of a naive implementation in the same dtype (outputs and gradients).
``slow``: more interpreter configurations, forward and backward.
"""

import contextlib
import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxattn.attention import flash as F
from jaxattn.attention import mosaic as M
from jaxattn.attention import normalize, target_platform
from jaxattn.attention.reference import attention_reference


# ------------------------------------------------------------------------------------------ references
def _ref(q, k, v, causal, scale, do=None, dlse=None):
    """The oracle (float32): ``(out, lse)`` and, with ``do``, its gradients (``dlse``: LSE cotangent).  Jitted,
    forward and pullback: op by op, its vjp is ~66 compiles, each paid again on a GPU."""
    f32 = [jnp.asarray(x, jnp.float32) for x in (q, k, v)]
    fn = jax.jit(lambda q, k, v: attention_reference(q, k, v, causal=causal, scale=scale, return_lse=True))
    if do is None:
        return fn(*f32)
    (out, lse), pull = jax.vjp(fn, *f32)
    dlse = jnp.zeros_like(lse) if dlse is None else dlse
    return out, lse, pull((jnp.asarray(do, jnp.float32), dlse))


@functools.partial(jax.jit, static_argnums=(3, 4))
def _naive(q, k, v, causal, scale):
    """Naive attention computed entirely in the input dtype (the 2x rule's yardstick); one compiled program."""
    dt = q.dtype
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    g = hq // hkv
    kk, vv = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, kk, preferred_element_type=dt) * jnp.asarray(scale, dt)
    vis = jnp.ones((sq, sk), bool)
    if causal:
        vis = jnp.arange(sk)[None, :] <= jnp.arange(sq)[:, None] + (sk - sq)
    s = jnp.where(vis, s, jnp.asarray(-jnp.inf, dt))
    # rows that see no key give zeros (the contract), not softmax's NaN
    p = jnp.where(vis.any(-1, keepdims=True), jax.nn.softmax(s, axis=-1), 0).astype(dt)
    return jnp.einsum("bhqk,bkhd->bqhd", p, vv, preferred_element_type=dt)


def _inputs(seed, b, sq, sk, hq, hkv, d, dtype):
    ks = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(ks[0], (b, sq, hq, d), jnp.float32).astype(dtype)
    k = jax.random.normal(ks[1], (b, sk, hkv, d), jnp.float32).astype(dtype)
    v = jax.random.normal(ks[2], (b, sk, hkv, d), jnp.float32).astype(dtype)
    do = jax.random.normal(ks[3], (b, sq, hq, d), jnp.float32).astype(dtype)
    return q, k, v, do


def _maxabs(a, b):
    return float(
        np.max(
            np.abs(
                np.asarray(jnp.asarray(a, jnp.float32), np.float64)
                - np.asarray(jnp.asarray(b, jnp.float32), np.float64)
            )
        )
    )


def _grads(fn, q, k, v, do):
    out, vjp = jax.vjp(fn, q, k, v)
    return out, vjp(do)


# ------------------------------------------------------------------------------------------ CPU: API
def test_import_and_supports_reasons_on_cpu():
    q, k, v, _ = _inputs(0, 1, 8, 8, 2, 1, 64, jnp.bfloat16)
    ok = normalize(q, k, v, causal=True)
    reason = M.supports(q, k, v, ok)
    if not jax.devices()[0].platform == "gpu":
        assert reason is not None and "Hopper" in reason and "cpu" in reason
    seg = jnp.zeros((1, 8), jnp.int32)
    cases = [
        (normalize(q, k, v, segment_ids=seg), "segment_ids"),
        (normalize(q, k, v, window=(4, 0)), "window"),
        (normalize(q, k, v, softcap=30.0), "softcap"),
    ]
    for args, word in cases:
        assert word in M.supports(q, k, v, args)
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    assert "dtype" in M.supports(*f32, normalize(*f32))
    q80, k80, v80, _ = _inputs(0, 1, 8, 8, 2, 1, 80, jnp.float16)
    assert M.supports(q80, k80, v80, normalize(q80, k80, v80)) == "head_dim 80 not in (64, 128, 256)"
    with pytest.raises(ValueError, match="mosaic attention backend cannot serve"):
        M.attention(q80, k80, v80, normalize(q80, k80, v80))


def test_public_op_needs_gpu_with_clear_error():
    if jax.devices()[0].platform == "gpu":
        pytest.skip("a GPU is present")
    q, k, v, _ = _inputs(0, 1, 8, 8, 2, 1, 64, jnp.bfloat16)
    with pytest.raises(RuntimeError, match="Hopper GPU"):
        M.mosaic_attention(q, k, v)


def test_argument_validation():
    q, k, v, _ = _inputs(0, 1, 8, 8, 4, 2, 64, jnp.bfloat16)
    f = M.mosaic_attention
    with pytest.raises(ValueError, match="rank 4"):
        f(q[0], k, v)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        f(q[:, :, :3], k, v)
    with pytest.raises(ValueError, match="k and v must have the same shape"):
        f(q, k, v[:, :4])
    with pytest.raises(TypeError, match=r"dtype float32 not supported.*'bfloat16', 'float16'"):
        f(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32))
    with pytest.raises(TypeError, match="share one dtype"):
        f(q, k.astype(jnp.float16), v)
    q80, k80, v80, _ = _inputs(0, 1, 8, 8, 2, 1, 80, jnp.bfloat16)
    with pytest.raises(ValueError, match=r"head_dim 80 .*\(64, 128, 256\)"):
        f(q80, k80, v80)
    with pytest.raises(ValueError, match="scale"):
        f(q, k, v, scale=-1.0)
    with pytest.raises(TypeError, match="causal"):
        f(q, k, v, causal="yes")
    with pytest.raises(TypeError, match="block_sizes"):
        f(q, k, v, block_sizes=(64, 64))
    with pytest.raises(ValueError, match="shared memory"):
        f(q, k, v, block_sizes=M.MosaicBlockSizes(block_kv=512, max_concurrent_steps=4))
    big = M.MosaicBackwardBlockSizes(block_kv_dq=512, max_concurrent_steps=4)
    with pytest.raises(ValueError, match=r"block_sizes\.backward .* shared memory"):
        f(q, k, v, block_sizes=M.MosaicBlockSizes(backward=big))
    with pytest.raises(ValueError, match="impl"):
        M._mosaic_attention(q, k, v, impl="triton")


def test_block_sizes_validation():
    assert M.MosaicBlockSizes.default(256).block_kv == 64
    assert M.MosaicBlockSizes.default(128) == M.MosaicBlockSizes()
    with pytest.raises(ValueError, match="block_q"):
        M.MosaicBlockSizes(block_q=96)
    with pytest.raises(ValueError, match="block_kv"):
        M.MosaicBlockSizes(block_kv=0)
    with pytest.raises(ValueError, match="max_concurrent_steps"):
        M.MosaicBlockSizes(max_concurrent_steps=1)
    with pytest.raises(TypeError, match="block_q"):
        M.MosaicBlockSizes(block_q=64.0)
    with pytest.raises(TypeError, match="backward"):
        M.MosaicBlockSizes(backward=(16, 16))
    with pytest.raises(TypeError, match="overlap must be a bool"):
        M.MosaicBlockSizes(overlap=1)
    assert M.MosaicBlockSizes(backward=F.BlockSizes(16, 16, 16, 16, 16, 16)).backward.block_q == 16
    bwd = M.MosaicBackwardBlockSizes(block_kv_dq=128, max_concurrent_steps=3)
    assert M.MosaicBlockSizes(backward=bwd).backward is bwd
    for bad, err in (
        (dict(block_q_dq=96), "block_q_dq must be a positive multiple of 64"),
        (dict(block_kv_dkv=0), "block_kv_dkv must be a positive multiple of 64"),
        (dict(max_concurrent_steps=1), "max_concurrent_steps must be >= 2"),
    ):
        with pytest.raises(ValueError, match=err):
            M.MosaicBackwardBlockSizes(**bad)
    with pytest.raises(TypeError, match="block_q_dkv must be an int"):
        M.MosaicBackwardBlockSizes(block_q_dkv=64.0)
    with pytest.raises(dataclasses_FrozenError()):
        M.MosaicBlockSizes().block_q = 128  # frozen


def dataclasses_FrozenError():
    import dataclasses

    return dataclasses.FrozenInstanceError


# ------------------------------------------------------------------------------------------ CPU: numerics
# (b, sq, sk, hq, hkv, d, causal): padding on both sides, Sq != Sk both ways (bottom-right causal; Sq > Sk
# gives rows that see no key), GQA 2 and MQA, several kv blocks so the masked/unmasked split is exercised.
FP32_CASES = [
    (2, 100, 70, 4, 2, 64, False),  # GQA 2, both sides padded, masked last kv block
    (1, 70, 200, 4, 1, 64, True),  # MQA, Sq < Sk: unmasked + masked kv steps
    (1, 150, 40, 2, 2, 128, True),  # Sq > Sk: the first 110 rows see no key
]


_FLASH_BWD = F.BlockSizes(16, 16, 16, 32, 32, 16)  # the flash Pallas backward, small blocks that do not divide S


@pytest.mark.parametrize(
    "b,sq,sk,hq,hkv,d,causal,backward",
    [(*case, None) for case in FP32_CASES] + [pytest.param(*FP32_CASES[2], _FLASH_BWD, id="flash-bwd")],
)
def test_emulated_forward_and_grads_fp32(b, sq, sk, hq, hkv, d, causal, backward):
    """Kernel tile math + padding/masking (emulated forward) + custom_vjp + the backward's math in fp32, with
    cotangents on both the output and the LSE, against the oracle and its autodiff gradients.  The backward is
    the Mosaic kernels' math (``_emulated_backward``: log2 LSE, ``delta - dLSE``, ``_LSE_EMPTY`` rows), or, where
    ``MosaicBlockSizes.backward`` asks for it, the flash backward kernels in Pallas interpret mode."""
    q, k, v, do = _inputs(sq * 7 + sk, b, sq, sk, hq, hkv, d, jnp.float32)
    scale = 0.7 / math.sqrt(d)
    cfg = M.MosaicBlockSizes(block_kv=64, backward=backward)

    def fn(q, k, v):
        return M._mosaic_attention(
            q,
            k,
            v,
            causal=causal,
            scale=scale,
            block_sizes=cfg,
            impl="emulate",
            return_lse=True,
        )

    (out, lse), pull = jax.vjp(jax.jit(fn), q, k, v)
    dlse = jax.random.normal(jax.random.key(sq + sk), lse.shape, jnp.float32)
    dlse = jnp.where(jnp.isfinite(lse), dlse, 0.0)  # no cotangent on -inf rows
    dq, dk, dv = pull((do, dlse))
    r_out, r_lse, (r_dq, r_dk, r_dv) = _ref(q, k, v, causal, scale, do, dlse)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert _maxabs(out, r_out) <= 1e-5
    for got, want in ((dq, r_dq), (dk, r_dk), (dv, r_dv)):
        assert got.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-3, atol=1e-3)
    assert lse.shape == (b, hq, sq)
    lse, r_lse = np.asarray(lse, np.float64), np.asarray(r_lse, np.float64)
    np.testing.assert_array_equal(np.isinf(lse), np.isinf(r_lse))
    fin = np.isfinite(r_lse)
    np.testing.assert_allclose(lse[fin], r_lse[fin], rtol=0, atol=1e-5)
    if causal and sq > sk:  # rows that see no key: zeros, never NaN, zero dq
        empty = sq - sk
        assert np.all(np.asarray(out[:, :empty]) == 0) and np.all(np.asarray(out[:, empty:]) != 0)
        assert np.all(np.asarray(dq[:, :empty]) == 0)
        assert np.all(np.isinf(lse[:, :, :empty]))
        for x in (dq, dk, dv):
            assert np.all(np.isfinite(np.asarray(x)))


@pytest.mark.parametrize(
    "dtype,causal",
    [
        (jnp.bfloat16, False),  # GQA, padded keys masked in the last block
        (jnp.float16, True),
    ],
)
def test_emulated_low_precision_two_x_rule(dtype, causal):
    """Emulated forward + the Mosaic backward's math (``p`` and ``dS`` cast to the input dtype before their
    matmuls, as the kernels feed wgmma): outputs and grads, error vs the oracle <= 2x the error of naive attention
    in the same dtype."""
    q, k, v, do = _inputs(11, 1, 190, 250, 4, 2, 64, dtype)
    scale = 1 / 8
    fn = lambda q, k, v: M._mosaic_attention(q, k, v, causal=causal, impl="emulate")  # noqa: E731
    out, grads = _grads(jax.jit(fn), q, k, v, do)
    n_out, n_grads = _grads(jax.jit(lambda q, k, v: _naive(q, k, v, causal, scale)), q, k, v, do)
    r_out, _, r_grads = _ref(q, k, v, causal, scale, do)
    assert out.dtype == dtype
    assert _maxabs(out, r_out) <= 2 * _maxabs(n_out, r_out)
    for name, g, n, r in zip("qkv", grads, n_grads, r_grads):
        assert g.dtype == dtype
        assert _maxabs(g, r) <= 2 * _maxabs(n, r), f"d{name}"


@contextlib.contextmanager
def _race_detector():
    """Runs ``impl="interpret"`` kernels with the interpreter's happens-before race detector on; yields a
    ``check()`` to call after a kernel has run.  ``_forward``'s jit cache is cleared on both sides: the
    interpreter's options are read when the kernel is traced, so a trace made without the detector must
    not be reused.  jax 0.10.x already has the detector (one vector clock per thread); jax >= 0.11 also
    keeps a separate clock for the async proxy (TMA), so a generic-proxy SMEM read that TMA overwrites
    without a ``commit_smem`` (``fence.proxy.async``) in between is a race there too.  A race fails the
    test: jax >= 0.11 raises ``RACE DETECTED`` from the kernel, jax 0.10 sets ``races_found``."""
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks  # private, jax 0.10 - 0.12

    def check():
        races = gpu_callbacks.get_races()
        assert races.writes, "the race detector saw no SMEM writes: it did not run"
        assert not races.races_found, "race detected: see the RACE DETECTED report in the captured output"

    M._forward.clear_cache()
    M._INTERPRET_OPTIONS["detect_races"] = True
    try:
        yield check
    except BaseException:
        gpu_callbacks.reset_gpu_interpret_mode_state()  # a failed kernel may leave the interpreter's state behind
        raise
    finally:
        M._INTERPRET_OPTIONS.pop("detect_races", None)
        M._forward.clear_cache()


def _check_interpret_case(b, sq, sk, hq, hkv, d, causal, cfg=None, seed=5):
    """The kernel body under the Mosaic GPU interpreter with its race detector on (:func:`_race_detector`;
    a TMA write into a K/V slot that a consumer may still read is reported: checked by hand by swapping the
    producer's wait and copy, and on jax >= 0.11 by dropping the interpret branch's ``commit_smem``), which
    also poisons unwritten memory with NaN and raises if a thread leaves a barrier phase unobserved. Then:
    bf16 2x rule vs the oracle, agreement with the emulation (same tile math, so equal up to bf16
    rounding), lse, and no unwritten (NaN) blocks."""
    q, k, v, _ = _inputs(seed, b, sq, sk, hq, hkv, d, jnp.bfloat16)
    scale = 1 / math.sqrt(d)
    with _race_detector() as check_races:
        out, lse = M._mosaic_attention(q, k, v, causal=causal, block_sizes=cfg, impl="interpret", return_lse=True)
        jax.block_until_ready((out, lse))
        check_races()
    e_out, e_lse = M._mosaic_attention(q, k, v, causal=causal, block_sizes=cfg, impl="emulate", return_lse=True)
    r_out, r_lse = _ref(q, k, v, causal, scale)
    r_lse = np.asarray(r_lse, np.float64)
    out32 = np.asarray(out.astype(jnp.float32))
    assert not np.isnan(out32).any()
    assert _maxabs(out, r_out) <= 2 * _maxabs(_naive(q, k, v, causal, scale), r_out)
    np.testing.assert_allclose(out32, np.asarray(e_out.astype(jnp.float32)), rtol=0, atol=2**-7)
    lse = np.asarray(lse, np.float64)
    np.testing.assert_array_equal(np.isinf(lse), np.isinf(r_lse))
    fin = np.isfinite(r_lse)
    np.testing.assert_allclose(lse[fin], np.asarray(e_lse, np.float64)[fin], rtol=0, atol=1e-4)
    np.testing.assert_allclose(lse[fin], r_lse[fin], rtol=0, atol=5e-2)


def test_interpreted_kernel_causal_gqa_ragged():
    """Causal, Sq < Sk, GQA, kv ring refilled (3 kv blocks > 2 slots), warpgroup 0 (2 kv steps) drains
    the ring while warpgroup 1 (3 kv steps) still computes, padded q and k."""
    _check_interpret_case(1, 100, 150, 2, 1, 64, True, M.MosaicBlockSizes(block_kv=64))


_B64 = M.MosaicBlockSizes(block_kv=64)
_B64_OV = M.MosaicBlockSizes(block_kv=64, overlap=True)


@pytest.mark.parametrize(
    "b,sq,sk,hq,hkv,d,causal,cfg",
    [
        # non-causal, GQA (2 CTAs share a kv head), 5 kv blocks: slot 0 holds steps 0, 2, 4 (every barrier
        # phase parity reused), masked padded last block
        pytest.param(1, 70, 280, 2, 1, 64, False, _B64, id="noncausal-gqa-ring-wraps"),
        # causal, Sq > Sk: rows 0-69 see no key, warpgroup 0 has no kv step and only drains; one kv block,
        # fewer than the ring's slots
        pytest.param(1, 110, 40, 1, 1, 128, True, _B64, id="causal-nokey-wg0-drains-d128"),
        # the default block sizes (block_kv 128), causal Sq < Sk with unmasked and masked steps, a refill
        pytest.param(1, 100, 300, 1, 1, 128, True, None, id="causal-default-blocks-d128"),
        # overlap=True (FA3 §3.2: scores of block t issued with P V of t-1, the softmax while P V runs): its own
        # windows, the same ping-pong phases; the cases that stress its bounds and drains
        pytest.param(1, 100, 150, 2, 1, 64, True, _B64_OV, id="overlap-causal-gqa-wg0-drains"),
        pytest.param(1, 110, 40, 1, 1, 128, True, _B64_OV, id="overlap-causal-nokey-rows-d128"),
        pytest.param(1, 70, 280, 2, 1, 64, False, _B64_OV, id="overlap-noncausal-ring-wraps"),
    ],
)
def test_interpreted_kernel_race_free(b, sq, sk, hq, hkv, d, causal, cfg):
    """The race detector over the kernel's variants at tiny sizes, no race and the output checks of
    :func:`_check_interpret_case` (the causal Sq < Sk GQA case with warpgroup 0 draining while the ring is
    refilled is ``test_interpreted_kernel_causal_gqa_ragged``)."""
    _check_interpret_case(b, sq, sk, hq, hkv, d, causal, cfg)


@pytest.mark.slow
@pytest.mark.parametrize(
    "b,sq,sk,hq,hkv,d,causal",
    [
        (1, 100, 100, 2, 1, 64, False),
        (1, 300, 600, 2, 1, 64, True),
        (1, 600, 300, 2, 1, 64, True),  # rows with no key; warpgroup 0 drains
        (1, 333, 333, 2, 1, 128, True),
        (1, 129, 700, 2, 1, 64, False),
        (1, 200, 200, 2, 1, 256, True),
        (2, 256, 256, 4, 2, 128, False),
    ],
)
def test_interpreted_kernel_sweep(b, sq, sk, hq, hkv, d, causal):
    _check_interpret_case(b, sq, sk, hq, hkv, d, causal)


@pytest.mark.parametrize(
    "sq,sk", [(100, 165), (100, 162), (150, 90), (64, 200), (129, 66), (1, 300), (300, 1), (128, 256)]
)
def test_backward_query_bounds_match_the_causal_mask(sq, sk):
    """``_q_bounds`` against the brute-force bottom-right mask, for every key block the dkv kernel's warpgroups
    (and its CTAs) own, over the pairs that count (a real query row and a real key: a padded row's ``p`` is 0 by
    its LSE, a padded key's dK / dV row is sliced off): query blocks before ``lo`` see none of the block's keys,
    block ``lo`` sees one, blocks from ``full`` on see all of them, and a block in ``[lo, full)`` holding real
    rows misses one (masking no more than it must). The sizes put ``Sk - Sq`` one past and one short of a block
    boundary, and give key blocks no query sees."""
    bq = 64
    nq = -(-sq // (2 * bq)) * 2  # query blocks of a padded Sq (the kernels pad to a multiple of 128)
    q_pos = np.arange(nq * bq)
    for rows in (64, 128):
        for k_base in range(0, -(-sk // rows) * rows, rows):
            keys = np.arange(k_base, k_base + rows)
            counts = (q_pos[:, None] < sq) & (keys[None, :] < sk)
            vis = (keys[None, :] <= q_pos[:, None] + (sk - sq)) & counts
            some = vis.reshape(nq, bq, rows).any(axis=(1, 2))
            every = (vis | ~counts).reshape(nq, bq, rows).all(axis=(1, 2))
            real = counts.reshape(nq, bq, rows).any(axis=(1, 2))
            lo, full = (
                int(x) for x in M._q_bounds(jnp.int32(k_base), rows, sq=sq, sk=sk, nq=nq, block_q=bq, causal=True)
            )
            where = f"k_base {k_base} rows {rows}: lo {lo} full {full}, blocks seeing some {some}, all {every}"
            assert not some[:lo].any() and (lo == nq or some[lo] or not some.any()), where
            assert lo <= full and every[full:].all() and not (every & real)[lo:full].any(), where


def _check_interpret_backward(b, sq, sk, hq, hkv, d, causal, blocks=None, seed=3):
    """The Mosaic dq and dkv kernels under the interpreter, each with the race detector on (a race or a barrier
    phase left unobserved fails; unwritten output blocks come back NaN), from an emulated forward's ``out`` and
    LSE with a cotangent on both: the bf16 2x rule on every gradient, agreement with the emulated backward (same
    math: equal up to the order of fp32 sums and the bf16 rounding of the result), zero dq on rows that see no
    key."""
    q, k, v, do = _inputs(seed, b, sq, sk, hq, hkv, d, jnp.bfloat16)
    scale = 1 / math.sqrt(d)
    blocks = blocks or M.MosaicBackwardBlockSizes()
    out, lse = M._mosaic_attention(q, k, v, causal=causal, impl="emulate", return_lse=True)
    dlse = jnp.where(jnp.isfinite(lse), jax.random.normal(jax.random.key(seed), lse.shape, jnp.float32), 0.0)
    kw = dict(causal=causal, scale=scale, blocks=blocks)
    with _race_detector() as check_races, pytest.MonkeyPatch.context() as mp:
        for name in ("_mosaic_dq_padded", "_mosaic_dkv_padded"):  # the detector reports on the last kernel run

            def checked(*a, _kernel=getattr(M, name), **k):
                res = jax.block_until_ready(_kernel(*a, **k))
                check_races()
                return res

            mp.setattr(M, name, checked)
        got = M._mosaic_backward(q, k, v, out, lse, do, dlse, impl="interpret", **kw)
    emulated = M._mosaic_backward(q, k, v, out, lse, do, dlse, impl="emulate", **kw)
    _, _, r_grads = _ref(q, k, v, causal, scale, do, dlse)
    n_grads = _grads(jax.jit(lambda q, k, v: _naive(q, k, v, causal, scale)), q, k, v, do)[1]
    for name, g, e, n, r in zip("qkv", got, emulated, n_grads, r_grads):
        g32 = np.asarray(g.astype(jnp.float32))
        assert g.shape == e.shape and g.dtype == jnp.bfloat16 and not np.isnan(g32).any(), f"d{name}"
        np.testing.assert_allclose(g32, np.asarray(e.astype(jnp.float32)), rtol=2**-7, atol=2**-7, err_msg=f"d{name}")
        assert _maxabs(g, r) <= 2 * _maxabs(n, r) + 2**-7, f"d{name}"  # + the LSE cotangent's rounding
    if causal and sq > sk:
        assert np.all(np.asarray(got[0][:, : sq - sk].astype(jnp.float32)) == 0)


def test_interpreted_backward_causal_gqa_ragged():
    """Causal, Sq < Sk, GQA 2 (the dkv kernel sums both query heads of its kv head in registers), padded q and
    k; dkv: warpgroup 1's keys are seen by no query of the first query block, so it drains that ring step of
    every head while warpgroup 0 computes, and the ring (2 slots) wraps; dq: warpgroup 0 has fewer kv steps
    and drains."""
    _check_interpret_backward(1, 100, 150, 2, 1, 64, True)


@pytest.mark.slow
@pytest.mark.parametrize(
    "b,sq,sk,hq,hkv,d,causal,blocks",
    [
        # non-causal, MQA over 2 heads, both sides padded, dq's last kv block masked, 3-deep ring
        (1, 70, 130, 2, 1, 64, False, M.MosaicBackwardBlockSizes(max_concurrent_steps=3)),
        # causal, Sq > Sk: rows 0-59 see no key (LSE _LSE_EMPTY, zero dq), head_dim 128
        (1, 150, 90, 1, 1, 128, True, None),
        # causal, one dkv CTA of padded keys only (no query sees them: an empty ring), 128-key dq steps
        (1, 64, 200, 1, 1, 64, True, M.MosaicBackwardBlockSizes(block_kv_dq=128)),
    ],
)
def test_interpreted_backward_sweep(b, sq, sk, hq, hkv, d, causal, blocks):
    _check_interpret_backward(b, sq, sk, hq, hkv, d, causal, blocks)


# ------------------------------------------------------------------------------------------ CPU: lowering
def _export_for_cuda(fn, *shapes):
    """The StableHLO of ``fn`` exported for CUDA.  The flash backward's Triton custom calls carry no
    serialization-compatibility guarantee, so export's check for them is switched off (we only read
    the module, never store it)."""
    from jax import export

    checks = [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    with target_platform("gpu", compute_capability=(9, 0)):  # jax >= 0.11 lowers Triton only for a named GPU
        return export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=checks)(*shapes).mlir_module()


@pytest.mark.parametrize(
    "sq,sk,d,causal,dtype",
    [
        (1000, 1000, 128, True, jnp.bfloat16),
        (300, 777, 64, False, jnp.float16),
        (2048, 1000, 256, True, jnp.bfloat16),
        (1, 4096, 64, True, jnp.float16),
        (4096, 4096, 128, False, jnp.bfloat16),
        (200, 100, 64, True, jnp.float16),  # one kv block, fewer than the ring's slots
    ],
)
def test_real_kernel_lowers_for_cuda_on_cpu(sq, sk, d, causal, dtype):
    """Cross-platform export runs the real Pallas -> Mosaic GPU lowering (layouts, wgmma, TMA, mbarriers)
    without a GPU. Catches API/layout errors in the GPU-only code paths; ptxas and the run itself are not
    covered (the ``gpu`` tests do that)."""
    q = jax.ShapeDtypeStruct((2, sq, 8, d), dtype)
    k = jax.ShapeDtypeStruct((2, sk, 2, d), dtype)
    txt = _export_for_cuda(
        lambda q, k, v: M._mosaic_attention(q, k, v, causal=causal, impl="mosaic", return_lse=True), q, k, k
    )
    for needle in ("wgmma", "cp.async.bulk.tensor", "mbarrier"):
        assert needle in txt


@pytest.mark.parametrize(
    "d,backward,kernels",
    [
        (64, None, {"mosaic": 3, "triton": 0}),  # the Mosaic forward, dq and dkv kernels
        (256, None, {"mosaic": 1, "triton": 2}),  # head_dim 256: the flash backward
        (64, F.BlockSizes(), {"mosaic": 1, "triton": 2}),  # the flash backward on request
    ],
)
def test_real_kernel_with_backward_lowers_for_cuda_on_cpu(d, backward, kernels):
    """A training step's attention lowers to Pallas kernels both ways, nothing else doing attention math in XLA:
    the Mosaic GPU forward (wgmma) and backward (dq, dkv), or where it serves, the flash dkv and dq kernels
    (Triton custom calls)."""
    q = jax.ShapeDtypeStruct((1, 200, 4, d), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((1, 300, 2, d), jnp.bfloat16)
    cfg = M.MosaicBlockSizes(block_kv=64, backward=backward)

    def loss(q, k, v):
        out = M._mosaic_attention(q, k, v, causal=True, block_sizes=cfg, impl="mosaic")
        return jnp.sum(out.astype(jnp.float32) ** 2)

    txt = _export_for_cuda(jax.grad(loss, argnums=(0, 1, 2)), q, k, k)
    assert "wgmma" in txt
    got = {"mosaic": len(re.findall(r"custom_call @mosaic_gpu", txt)), "triton": txt.count("xla.gpu.triton")}
    assert got == kernels, txt[:2000]
    assert ("flash_bwd_dkv" in txt and "flash_bwd_dq" in txt) == (kernels["triton"] == 2)


# ------------------------------------------------------------------------------------------ GPU
@pytest.mark.gpu
@pytest.mark.parametrize("seq", [1000, pytest.param(2048, marks=pytest.mark.slow)])  # default GPU run: <= 90 s
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_kernel_bf16_two_x_rule(seq, d, causal):
    q, k, v, do = _inputs(seq + d, 2, seq, seq, 8, 2, d, jnp.bfloat16)
    args = normalize(q, k, v, causal=causal)
    reason = M.supports(q, k, v, args)
    if reason is not None and ("Hopper" in reason or "ptxas" in reason):
        pytest.skip(reason)
    assert reason is None
    scale = 1 / math.sqrt(d)
    fn = jax.jit(lambda q, k, v: M.attention(q, k, v, args))
    out, grads = _grads(fn, q, k, v, do)
    n_out, n_grads = _grads(jax.jit(lambda q, k, v: _naive(q, k, v, causal, scale)), q, k, v, do)
    r_out, _, r_grads = _ref(q, k, v, causal, scale, do)
    assert out.dtype == jnp.bfloat16 and not np.isnan(np.asarray(out.astype(jnp.float32))).any()
    assert _maxabs(out, r_out) <= 2 * _maxabs(n_out, r_out)
    for name, g, n, r in zip("qkv", grads, n_grads, r_grads):
        assert _maxabs(g, r) <= 2 * _maxabs(n, r), f"d{name}"


@pytest.mark.gpu
@pytest.mark.parametrize("sq,sk", [(1000, 2048), (2048, 1000), (1, 777)])
def test_gpu_kernel_bf16_unequal_lengths_causal(sq, sk):
    q, k, v, _ = _inputs(sq + sk, 2, sq, sk, 8, 2, 128, jnp.bfloat16)
    args = normalize(q, k, v, causal=True)
    reason = M.supports(q, k, v, args)
    if reason is not None and ("Hopper" in reason or "ptxas" in reason):
        pytest.skip(reason)
    out, lse = M._mosaic_attention(q, k, v, causal=True, impl="mosaic", return_lse=True)
    r_out, r_lse = _ref(q, k, v, True, 1 / math.sqrt(128))
    r_lse = np.asarray(r_lse, np.float64)
    assert not np.isnan(np.asarray(out.astype(jnp.float32))).any()
    assert _maxabs(out, r_out) <= 2 * _maxabs(_naive(q, k, v, True, 1 / math.sqrt(128)), r_out)
    lse = np.asarray(lse, np.float64)
    np.testing.assert_array_equal(np.isinf(lse), np.isinf(r_lse))


@pytest.mark.gpu
@pytest.mark.parametrize(
    "sq,sk,d,causal",
    [(1000, 1000, 128, False), (1000, 1000, 128, True), (2048, 1000, 64, True), (1000, 2048, 128, True)],
)
def test_gpu_overlap_forward_bf16(sq, sk, d, causal):
    """``MosaicBlockSizes(overlap=True)`` (FA3's intra-warpgroup overlap, not the default) on the GPU: out by the
    2x rule against the float64 reference, lse where the reference's is finite, -inf where a row sees no key
    (Sq > Sk, causal)."""
    q, k, v, _ = _inputs(sq + sk + d, 2, sq, sk, 8, 2, d, jnp.bfloat16)
    reason = M.supports(q, k, v, normalize(q, k, v, causal=causal))
    if reason is not None and ("Hopper" in reason or "ptxas" in reason):
        pytest.skip(reason)
    scale = 1 / math.sqrt(d)
    cfg = M.MosaicBlockSizes(overlap=True)
    out, lse = M._mosaic_attention(q, k, v, causal=causal, block_sizes=cfg, impl="mosaic", return_lse=True)
    r_out, r_lse = _ref(q, k, v, causal, scale)
    r_lse = np.asarray(r_lse, np.float64)
    assert not np.isnan(np.asarray(out.astype(jnp.float32))).any()
    assert _maxabs(out, r_out) <= 2 * _maxabs(_naive(q, k, v, causal, scale), r_out)
    lse = np.asarray(lse, np.float64)
    np.testing.assert_array_equal(np.isinf(lse), np.isinf(r_lse))
    fin = np.isfinite(r_lse)
    np.testing.assert_allclose(lse[fin], r_lse[fin], rtol=0, atol=5e-2)
