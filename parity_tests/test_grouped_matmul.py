"""Parity tests of the Pallas grouped matmul (``jaxattn.grouped_matmul``: the MoE expert GEMM, forward + backward).

* The kernels run in Pallas interpret mode on CPU (the very same kernel code the Triton lowering compiles) and are
  compared with a float64 numpy reference on the same (already rounded) inputs: the output ``out[r] = lhs[r] @
  rhs[g(r)]`` (zero past ``sum(group_sizes)``), ``d_lhs[r] = dout[r] @ rhs[g(r)]^T`` and ``d_rhs[g] = lhs_g^T @
  dout_g``, with a random cotangent ``dout``.  float32 cases are also checked against ``jax.vjp`` of
  :func:`grouped_matmul_reference`.
* Shapes: odd M/K/N (padding inside), group boundaries inside tiles (16-blocks), every group in one tile (default
  blocks shrunk to a tiny M), an empty group, all rows in one group, rows past ``sum(group_sizes)``, G = 1.
* Tolerances (design §7): float32 outputs max-abs <= 1e-5 x max(1, max|ref|) (fp32 runs as three TF32 passes,
  ``tiling.dot_tf32x3``, ~2^-21 relative per product); float32 gradients ``rtol = atol = 1e-3``.  bf16/fp16:
  the kernel's max-abs error vs the float64 reference <= 2 x that of ``jax.lax.ragged_dot`` in the same dtype (the
  naive implementation: its output and autodiff gradients in bf16/fp16), plus half an ulp of the dtype at the
  reference's largest magnitude.  Why the half ulp (as in ``test_flash.py``): both round an fp32-accumulated
  result to bf16/fp16 once, so both errors are about half an ulp of the element's binade; the worst element of
  the naive result can sit in a binade below the largest one, where its ulp is half as large, and the ratio
  then reaches 2 by rounding alone.
* Outputs are poisoned (``_poison_outputs=True``: the output buffers are NaN-filled and aliased, the mechanism
  that works on a GPU too; interpret mode also starts them as NaN): a row the schedule forgets stays NaN.
  ``test_poison_catches_an_unwritten_tail`` shows it does catch one.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxattn import gpu_target
from jaxattn import grouped_matmul as GM


@dataclasses.dataclass(frozen=True)
class Case:
    m: int
    k: int
    n: int
    g: int
    sizes: str  # "random" (one empty group, rows past the sum) | "full" (sum == m) | "one" (all rows in one group)
    dtype: str = "float32"
    blocks: tuple[int, int, int] | None = (16, 16, 16)  # None: BlockSizes.default
    out_dtype: str | None = None

    def __str__(self):
        blk = "default" if self.blocks is None else "-".join(map(str, self.blocks))
        out = "" if self.out_dtype is None else f"_out-{self.out_dtype}"
        return f"m{self.m}_k{self.k}_n{self.n}_g{self.g}_{self.sizes}_{self.dtype}_blk{blk}{out}"


CASES = [
    Case(37, 48, 40, 4, "random"),  # odd sizes, boundaries inside 16-row tiles, an empty group, a tail
    Case(37, 48, 40, 4, "random", blocks=None),  # default blocks shrunk to M: every group shares one tile
    Case(64, 32, 48, 4, "one"),  # all rows in one group, the others empty
    Case(50, 40, 24, 1, "full"),  # G = 1
    Case(29, 24, 17, 1, "random"),  # G = 1 with rows past the sum
    Case(96, 64, 64, 6, "full", blocks=(32, 32, 32)),
    Case(83, 72, 56, 5, "random", dtype="bfloat16", blocks=(32, 16, 32)),
    Case(83, 72, 56, 5, "random", dtype="bfloat16", blocks=(32, 16, 32), out_dtype="float32"),
    Case(61, 40, 48, 3, "full", dtype="float16", blocks=None),
]


def _group_sizes(rng: np.random.Generator, case: Case) -> np.ndarray:
    if case.sizes == "one":
        sizes = np.zeros(case.g, np.int32)
        sizes[int(rng.integers(case.g))] = case.m
        return sizes
    total = case.m if case.sizes == "full" else int(rng.integers(case.m // 2, case.m - 2))
    cuts = np.sort(rng.integers(0, total + 1, size=case.g - 1))
    sizes = np.diff(np.concatenate([[0], cuts, [total]])).astype(np.int32)
    if case.sizes == "random" and case.g > 2:  # an empty group in the middle, its rows given to a neighbour
        e = int(rng.integers(1, case.g - 1))
        sizes[e + 1] += sizes[e]
        sizes[e] = 0
    assert sizes.sum() == total and (sizes >= 0).all()
    return sizes


def _inputs(rng: np.random.Generator, case: Case):
    dt = jnp.dtype(case.dtype)

    def rnd(*shape):
        return jnp.asarray(rng.standard_normal(shape), jnp.float32).astype(dt)

    out_dt = jnp.dtype(case.out_dtype or case.dtype)
    dout = jnp.asarray(rng.standard_normal((case.m, case.n)), jnp.float32).astype(out_dt)
    return rnd(case.m, case.k), rnd(case.g, case.k, case.n), jnp.asarray(_group_sizes(rng, case)), dout


def _reference_f64(lhs, rhs, sizes, dout):
    """``(out, d_lhs, d_rhs)`` in float64 numpy."""
    lhs, rhs, dout = (np.asarray(jnp.asarray(x, jnp.float32), np.float64) for x in (lhs, rhs, dout))
    out, d_lhs, d_rhs = np.zeros((lhs.shape[0], rhs.shape[2])), np.zeros_like(lhs), np.zeros_like(rhs)
    ends = np.cumsum(np.asarray(sizes))
    for g, (lo, hi) in enumerate(zip(ends - np.asarray(sizes), ends)):
        out[lo:hi] = lhs[lo:hi] @ rhs[g]
        d_lhs[lo:hi] = dout[lo:hi] @ rhs[g].T
        d_rhs[g] = lhs[lo:hi].T @ dout[lo:hi]
    return out, d_lhs, d_rhs


@functools.partial(jax.jit, static_argnames=("fn",))
def _vjp(lhs, rhs, sizes, dout, *, fn):
    out, pull = jax.vjp(lambda a, b: fn(a, b, sizes), lhs, rhs)
    return (out, *pull(dout.astype(out.dtype)))


def _kernel(case: Case, interpret: bool = True):
    bs = None if case.blocks is None else GM.BlockSizes(*case.blocks, num_warps=4, num_stages=2)
    return functools.partial(
        GM.grouped_matmul,
        block_sizes=bs,
        interpret=interpret,
        preferred_element_type=case.out_dtype,
        _poison_outputs=True,
    )


def _maxabs(a, ref) -> float:
    return float(np.max(np.abs(np.asarray(jnp.asarray(a, jnp.float32), np.float64) - ref), initial=0.0))


# the default run: odd sizes with an empty group and a tail, one group, bf16 with a float32 output; the rest (G = 1,
# fp16, ...) under slow
_DEFAULT = {0, 2, 7}


@pytest.mark.parametrize(
    "case", [c if i in _DEFAULT else pytest.param(c, marks=pytest.mark.slow) for i, c in enumerate(CASES)], ids=str
)
def test_kernel_matches_float64(case, rng):
    _check_case(case, rng, interpret=True)


# Larger shapes for the compiled run on a GPU (the interpreted cases run there too); the default GPU run takes the
# first, the others are `slow` (the default GPU selection fits 90 s).
BIG_GPU_CASES = [
    Case(4096, 512, 768, 8, "random", dtype="bfloat16", blocks=None),
    Case(2048 + 77, 1000, 1400, 8, "random", dtype="float16", blocks=None),
    Case(1500, 256, 384, 16, "full", blocks=None),
]
GPU_CASES = CASES + BIG_GPU_CASES[:1]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=str)
def test_compiled_kernel_matches_float64_on_gpu(case, rng):
    """The same checks with the Triton kernels compiled and run on a GPU (skipped without one)."""
    _check_case(case, rng, interpret=False)


@pytest.mark.slow
@pytest.mark.gpu
@pytest.mark.parametrize("case", BIG_GPU_CASES[1:], ids=str)
def test_compiled_kernel_big_shapes_on_gpu(case, rng):
    _check_case(case, rng, interpret=False)


def _check_case(case: Case, rng, *, interpret: bool):
    lhs, rhs, sizes, dout = _inputs(rng, case)
    got = _vjp(lhs, rhs, sizes, dout, fn=_kernel(case, interpret))
    refs = _reference_f64(lhs, rhs, sizes, dout)
    names = ("out", "d_lhs", "d_rhs")
    assert got[0].dtype == jnp.dtype(case.out_dtype or case.dtype)
    assert got[1].dtype == lhs.dtype and got[2].dtype == rhs.dtype
    assert got[0].shape == (case.m, case.n) and got[2].shape == rhs.shape
    for name, x in zip(names, got):
        assert np.isfinite(np.asarray(jnp.asarray(x, jnp.float32))).all(), f"{name}: NaN/inf (an unwritten row?)"
    past = int(np.sum(sizes))
    assert np.all(np.asarray(got[0], np.float32)[past:] == 0) and np.all(np.asarray(got[1], np.float32)[past:] == 0)
    for g in np.flatnonzero(np.asarray(sizes) == 0):  # an empty group's d_rhs is exact zeros
        assert np.all(np.asarray(got[2][g], np.float32) == 0)

    if case.dtype == "float32":
        tol = 1e-5 * max(1.0, float(np.max(np.abs(refs[0]))))
        assert _maxabs(got[0], refs[0]) <= tol, (_maxabs(got[0], refs[0]), tol)
        for name, x, r in zip(names[1:], got[1:], refs[1:]):
            np.testing.assert_allclose(np.asarray(x, np.float64), r, rtol=1e-3, atol=1e-3, err_msg=name)
        # and against autodiff of the pure-jnp reference (float32, Precision.HIGHEST)
        want = _vjp(lhs, rhs, sizes, dout, fn=GM.grouped_matmul_reference)
        for name, x, w in zip(names, got, want):
            np.testing.assert_allclose(np.asarray(x), np.asarray(w), rtol=1e-3, atol=1e-3, err_msg=name)
        return

    naive = _vjp(lhs, rhs, sizes, dout, fn=functools.partial(jax.lax.ragged_dot, preferred_element_type=case.out_dtype))
    for name, x, nv, r in zip(names, got, naive, refs):
        half_ulp = float(jnp.finfo(x.dtype).eps) / 2 * 2.0 ** np.floor(np.log2(max(np.max(np.abs(r)), 1e-30)))
        err, err_naive = _maxabs(x, r), _maxabs(nv, r)
        assert err <= 2 * err_naive + half_ulp, f"{name}: kernel {err:.3g} vs naive {case.dtype} {err_naive:.3g}"


def test_tile_schedule_covers_every_row_once(rng):
    """The forward's work list: each row of group g is stored by exactly one item of group g, the tail rows by one
    tail item (group G), nothing else stores, and the item count stays within ``cdiv(M, bm) + G``."""
    schedule = jax.jit(GM.tile_schedule, static_argnums=(1, 2))
    for m, g, bm in ((37, 4, 16), (256, 8, 32), (100, 1, 64), (64, 5, 16)):
        for _ in range(5):
            case = Case(m, 16, 16, g, str(rng.choice(["random", "full", "one"])))
            sizes = _group_sizes(rng, case)
            group, tile, lo, hi = (np.asarray(x) for x in schedule(jnp.asarray(sizes), m, bm))
            assert len(group) == -(-m // bm) + g
            owner = np.repeat(np.arange(g + 1), np.append(sizes, m - sizes.sum()))  # G: the tail
            hits = np.zeros(m, int)
            for it in range(len(group)):
                rows = np.arange(tile[it] * bm, (tile[it] + 1) * bm)
                rows = rows[(rows >= lo[it]) & (rows < hi[it])]
                assert np.all(owner[rows] == group[it]), (sizes, it)
                hits[rows] += 1
            assert np.all(hits == 1), (sizes, hits)


def test_swizzle_visits_every_program_once():
    """The forward's 1-D grid order (L2 super-rows of ``_GROUP_M`` work items): a bijection onto (item, n-tile)."""
    for n_w, n_j in ((1, 1), (7, 3), (9, 2), (17, 5), (72, 112)):
        w, j = jax.jit(jax.vmap(functools.partial(GM._swizzle, n_w=n_w, n_j=n_j)))(jnp.arange(n_w * n_j))
        assert sorted(zip(np.asarray(w).tolist(), np.asarray(j).tolist())) == [
            (a, b) for a in range(n_w) for b in range(n_j)
        ]


def test_poison_catches_an_unwritten_tail(rng, monkeypatch):
    """A schedule that forgets the tail item leaves the rows past ``sum(group_sizes)`` NaN when poisoned."""
    real = GM.tile_schedule

    def no_tail(group_sizes, m, bm):
        group, tile, lo, hi = real(group_sizes, m, bm)
        tail = group == group_sizes.shape[0]
        return group, tile, jnp.where(tail, 0, lo), jnp.where(tail, 0, hi)

    monkeypatch.setattr(GM, "tile_schedule", no_tail)
    lhs = jnp.asarray(rng.standard_normal((41, 16)), jnp.float32)
    rhs = jnp.asarray(rng.standard_normal((2, 16, 16)), jnp.float32)
    try:
        out = GM.grouped_matmul(
            lhs, rhs, jnp.asarray([10, 20], jnp.int32), block_sizes=GM.BlockSizes(16, 16, 16), interpret=True
        )
        out = np.asarray(out)
        assert np.isfinite(out[:30]).all() and np.isnan(out[30:]).all()
    finally:
        GM._run.clear_cache()  # the broken schedule must not serve a later call of the same shape


def test_groups_past_m_are_clipped(rng):
    """``sum(group_sizes) > M``: a group is cut at row M and the groups after it are empty (the reference's rule)."""
    lhs = jnp.asarray(rng.standard_normal((41, 24)), jnp.float32)
    rhs = jnp.asarray(rng.standard_normal((3, 24, 20)), jnp.float32)
    sizes = jnp.asarray([30, 30, 5], jnp.int32)
    out = GM.grouped_matmul(lhs, rhs, sizes, block_sizes=GM.BlockSizes(16, 16, 16), interpret=True)
    ref, _, _ = _reference_f64(lhs, rhs, np.asarray([30, 11, 0]), jnp.zeros((41, 20)))
    assert _maxabs(out, ref) <= 1e-5 * max(1.0, float(np.max(np.abs(ref))))


def test_degenerate_shapes_give_zeros(rng):
    lhs = jnp.asarray(rng.standard_normal((0, 8)), jnp.float32)
    rhs = jnp.asarray(rng.standard_normal((3, 8, 5)), jnp.float32)
    assert GM.grouped_matmul(lhs, rhs, jnp.zeros(3, jnp.int32), interpret=True).shape == (0, 5)
    out = GM.grouped_matmul(jnp.ones((4, 0)), jnp.ones((2, 0, 3)), jnp.asarray([2, 2]), interpret=True)
    assert out.shape == (4, 3) and np.all(np.asarray(out) == 0)


# ------------------------------------------------------------------------------------------------ errors
def _good():
    return jnp.ones((8, 4), jnp.float32), jnp.ones((2, 4, 3), jnp.float32), jnp.asarray([3, 5], jnp.int32)


@pytest.mark.parametrize(
    "change, exc, words",
    [
        (lambda a, b, s: (a[None], b, s), ValueError, "lhs must be a rank-2"),
        (lambda a, b, s: (a, b[0], s), ValueError, "rhs must be a rank-3"),
        (lambda a, b, s: (a, b, s[None]), ValueError, "group_sizes must be a rank-1"),
        (lambda a, b, s: (a[:, :3], b, s), ValueError, "must share K"),
        (lambda a, b, s: (a, b, jnp.asarray([8], jnp.int32)), ValueError, "group_sizes must have one entry per group"),
        (lambda a, b, s: (a, b, s.astype(jnp.float32)), TypeError, "group_sizes must be an integer"),
        (lambda a, b, s: (a, b.astype(jnp.bfloat16), s), TypeError, "rhs must have lhs's dtype"),
        (lambda a, b, s: (a.astype(jnp.int32), b.astype(jnp.int32), s), TypeError, "lhs must be float32"),
    ],
)
def test_bad_inputs_name_the_argument(change, exc, words):
    with pytest.raises(exc, match=re.escape(words)):
        GM.grouped_matmul(*change(*_good()), interpret=True)


def test_bad_options_name_the_argument():
    with pytest.raises(TypeError, match="block_sizes"):
        GM.grouped_matmul(*_good(), block_sizes=(16, 16, 16), interpret=True)
    with pytest.raises(TypeError, match="preferred_element_type"):
        GM.grouped_matmul(*_good(), preferred_element_type=jnp.int32, interpret=True)
    with pytest.raises(TypeError, match="interpret"):
        GM.grouped_matmul(*_good(), interpret="yes")
    for kwargs, words in ((dict(bm=48), "bm"), (dict(bk=8), "bk"), (dict(num_warps=3), "num_warps")):
        with pytest.raises(ValueError, match=words):
            GM.BlockSizes(**kwargs)


# ------------------------------------------------------------------------------------------------ deviceless H100
_REASON = gpu_target.unavailable_reason()
needs_plugin = pytest.mark.skipif(_REASON is not None, reason=f"deviceless GPU compile unavailable: {_REASON}")


def _compile(impl: str, *, backward: bool, dump: str | None = None) -> dict:
    """``benchmarks.tools.grouped_compile`` at the Mixtral shape, one deviceless H100: temp bytes and the lowering."""
    from benchmarks.tools import grouped_compile as gc
    from benchmarks.tools.deviceless import target_config

    devs = gpu_target.devices(target_config("h100"))
    _, compiled = gc.compile_grouped(devs, impl, gc.MIXTRAL, backward=backward, dump=dump)
    return dict(temp=compiled.memory_analysis().temp_size_in_bytes, **gc.lowering(compiled))


@pytest.mark.slow  # its figures are in benchmarks/NOTES.md; the MoE plan rows compile the kernel in whole steps
@pytest.mark.gpu_compile
@needs_plugin
def test_mixtral_shape_compiles_to_our_kernels_for_h100():
    """G=8, M=8192, K=4096, N=14336, bf16, compiled deviceless for an H100 ("compiled for H100, not run"): the
    forward is one Triton kernel, forward+backward three (gmm, gmm transposed for d_lhs, tgmm for d_rhs), no XLA dot
    at all (so no dense [M, G*K] operand), a few KB of temporary memory; every kernel within the H100's registers
    and shared memory, no spills, wgmma (HGMMA) only.  ``jax.lax.ragged_dot`` at the same shape for comparison."""
    from benchmarks.tools import kernel_stats
    from benchmarks.tools.kernel_stats import H100_LIMITS

    names = ("grouped_matmul", "grouped_matmul_t", "grouped_matmul_tgmm")
    fwd = _compile("pallas", backward=False)
    with tempfile.TemporaryDirectory() as dump:
        both = _compile("pallas", backward=True, dump=dump)
        recs = kernel_stats.from_xla_dump(dump, names=names)
    assert fwd["triton_calls"] == 1 and both["triton_calls"] == 3, (fwd, both)
    assert fwd["xla_dots"] == 0 and both["xla_dots"] == 0, (fwd, both)
    assert sorted(recs) == sorted(names)
    for name, r in recs.items():
        assert r["registers"] <= H100_LIMITS["max_regs_per_thread"] and r["blocks_per_sm"] >= 1, (name, r)
        assert 0 < r["smem_bytes"] <= H100_LIMITS["smem_per_block"], (name, r)
        assert r["spill_stores"] == 0 and r["spill_loads"] == 0, (name, r)
        wgmma, mma = (
            (r["sass"]["HGMMA"], r["sass"]["HMMA"])
            if r["sass"] is not None
            else (r["ptx_counts"]["wgmma"], r["ptx_counts"]["mma.sync"])
        )
        assert wgmma > 0 and mma == 0, (name, r["sass"] or r["ptx_counts"])
    assert both["temp"] < 2**20, both  # the tile schedule only: no padded or transposed copy of anything

    ragged = {b: _compile("ragged_dot", backward=b) for b in (False, True)}
    from benchmarks.tools.grouped_compile import MIXTRAL

    m, gk = MIXTRAL["m"], MIXTRAL["g"] * MIXTRAL["k"]
    print(
        f"\n[compiled for H100, not run] ours: fwd temp {fwd['temp']} B, fwd+bwd temp {both['temp']} B; "
        + "; ".join(
            f"{n}: {r['registers']} regs, {r['spill_stores']}/{r['spill_loads']} B spills, {r['smem_bytes']} B smem"
            for n, r in recs.items()
        )
        + f"\n[compiled for H100, not run] ragged_dot: fwd temp {ragged[False]['temp']} B, fwd+bwd temp "
        f"{ragged[True]['temp']} B, dot operands {ragged[True]['dot_operands']}"
    )
    assert ragged[True]["temp"] >= both["temp"]
    assert [m, gk] not in both["dot_operands"]
