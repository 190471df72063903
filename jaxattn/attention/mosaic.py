"""``mosaic`` backend: flash attention for Hopper GPUs, forward and backward in Pallas Mosaic GPU.

q ``[B, Sq, Hq, D]``, k/v ``[B, Sk, Hkv, D]``, bf16 or fp16, ``D`` in ``HEAD_DIMS``; bottom-right causal,
GQA/MQA, any sequence length (padded inside; a row that sees no key gives zeros).  The forward is a
FlashAttention-3 kernel (Shah et al. 2024, §3.1: wgmma + TMA, two consumer warpgroups in ping-pong and a
producer warpgroup streaming K/V) that saves ``out`` and the log-sum-exp; ``MosaicBlockSizes(overlap=True)``
adds its intra-warpgroup overlap (§3.2: a warpgroup's softmax runs while its own ``P V`` wgmma is in flight).
The backward is FlashAttention-2's (Dao 2023, Alg. 2) as two kernels of the same shape: ``dkv`` keeps a key
block in SMEM and streams the query blocks of every query head that shares it (GQA summed in registers),
``dq`` keeps a query block and streams K/V; at head_dim 256 (two fp32 accumulators too many for a warpgroup's
registers) it is :func:`jaxattn.attention.flash.flash_backward`.  No segment ids, window or softcap
(``supports`` declines)::

    out = mosaic_attention(q, k, v, causal=True)            # needs a Hopper GPU

Tests run the same kernel bodies on CPU (``impl="interpret"``: the Mosaic GPU interpreter; ``"emulate"``:
a pure-jnp twin of the forward's tile loop and of the backward's math); how the kernels, their barrier
protocol and the interpreter substitutions work is written out in ``parity_tests/test_mosaic.py``.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from . import flash
from .args import AttnArgs, normalize
from .target import Target, current_target
from .tiling import LN2, LOG2E, cdiv, tile_mask

__all__ = [
    "HEAD_DIMS",
    "BACKWARD_HEAD_DIMS",
    "MosaicBlockSizes",
    "MosaicBackwardBlockSizes",
    "supports",
    "attention",
    "mosaic_attention",
]

HEAD_DIMS = (64, 128, 256)
DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_IMPLS = ("mosaic", "interpret", "emulate")
_M_INIT = -1e30  # finite "minus infinity" for the running max (log2 units): no inf - inf = NaN
_L_MIN = 1e-30  # clamp for the softmax denominator: an empty row gives 0 / 1e-30 = 0
_SMEM_BYTES = 227 * 1024  # usable shared memory per CTA on H100/H200


# ------------------------------------------------------------------------------------------ config
def _check_tiles(sizes, tiles: tuple[str, ...]) -> None:
    """``tiles`` of a block-size dataclass are ints, multiples of 64 (the wgmma M); its ``max_concurrent_steps`` (the
    depth of a TMA ring) an int >= 2."""
    cls = type(sizes).__name__
    for name in (*tiles, "max_concurrent_steps"):
        val = getattr(sizes, name)
        if not isinstance(val, (int, np.integer)) or isinstance(val, bool):
            raise TypeError(f"{cls}.{name} must be an int, got {val!r} of type {type(val).__name__}")
        if name in tiles and (val < 64 or val % 64):
            raise ValueError(f"{cls}.{name} must be a positive multiple of 64 (wgmma tile), got {val}")
    if sizes.max_concurrent_steps < 2:
        raise ValueError(f"{cls}.max_concurrent_steps must be >= 2, got {sizes.max_concurrent_steps}")


@dataclasses.dataclass(frozen=True)
class MosaicBlockSizes:
    """Tile sizes and pipeline depth of the Mosaic forward kernel, and the backward's block sizes.

    * ``block_q``: query rows per compute warpgroup (a CTA has two, so it covers ``2 * block_q`` rows);
      a multiple of 64 (wgmma M).
    * ``block_kv``: keys per pipeline step; a multiple of 64.
    * ``max_concurrent_steps``: depth of the K/V TMA ring (SMEM slots), >= 2.
    * ``overlap``: FlashAttention-3's intra-warpgroup overlap (Shah et al. 2024, §3.2): a warpgroup issues the
      scores of key block ``t`` and the ``P V`` of block ``t - 1`` together and computes the softmax of ``t``
      while the second is in flight (one more fp32 tile in registers: 240 per consumer thread, 24 for the
      producer). False: a warpgroup's softmax waits for its own matmuls (ping-pong between warpgroups only).
    * ``backward``: the backward's tiles: a :class:`MosaicBackwardBlockSizes` for the Mosaic backward kernels,
      a :class:`flash.BlockSizes` to run the flash Pallas backward instead, None for the Mosaic backward's
      defaults (head_dim 256, which it cannot hold in registers: flash's defaults).
    """

    block_q: int = 64
    block_kv: int = 128
    max_concurrent_steps: int = 2
    backward: MosaicBackwardBlockSizes | flash.BlockSizes | None = None
    overlap: bool = False

    def __post_init__(self):
        _check_tiles(self, ("block_q", "block_kv"))
        if not isinstance(self.overlap, (bool, np.bool_)):
            raise TypeError(f"MosaicBlockSizes.overlap must be a bool, got {self.overlap!r}")
        if self.backward is not None and not isinstance(self.backward, (MosaicBackwardBlockSizes, flash.BlockSizes)):
            raise TypeError(
                "MosaicBlockSizes.backward must be None, a MosaicBackwardBlockSizes or a flash.BlockSizes, "
                f"got {type(self.backward).__name__}"
            )

    @classmethod
    def default(cls, head_dim: int) -> MosaicBlockSizes:
        """Defaults that fit in shared memory and registers: 64x128 tiles, 64x64 for head_dim 256. At D=128 bf16
        the fastest forward tile timed on one H200 (``benchmarks/results/nvidia-h200/block_search.json``)."""
        return cls(block_kv=64) if head_dim > 128 else cls()

    def smem_bytes(self, head_dim: int, itemsize: int = 2) -> int:
        """Shared memory the forward kernel allocates for this config (Q/O tiles, K/V ring, lse)."""
        qo = 2 * self.block_q * head_dim * itemsize
        kv = 2 * self.max_concurrent_steps * self.block_kv * head_dim * itemsize
        return qo + kv + 2 * self.block_q * 4 + 1024  # + barriers / alignment slack


# ------------------------------------------------------------------------------------------ support
def _mosaic_import_error() -> str | None:
    try:
        import jax.experimental.pallas.mosaic_gpu  # noqa: F401
    except Exception as e:  # ImportError, or anything a half-installed jax raises
        return f"jax {jax.__version__} has no usable jax.experimental.pallas.mosaic_gpu ({type(e).__name__}: {e})"
    return None


def _device_reason(target: Target) -> str | None:
    """None when ``target`` (:func:`current_target`) is a Hopper GPU (compute capability 9.x)."""
    plat = target.platform
    if plat != "gpu":
        return f"needs a Hopper GPU (compute capability 9.x), found platform {plat!r}"
    cc = target.compute_capability
    if cc is None:
        return "needs a Hopper GPU (compute capability 9.x), found a GPU of unknown compute capability"
    if cc[0] != 9:
        return f"needs a Hopper GPU (compute capability 9.x, wgmma), found compute capability {cc[0]}.{cc[1]}"
    return None


def _cuda_causal_reason(causal: bool) -> str | None:
    """JAX's own Mosaic FA3 op refuses causal masking on CUDA runtimes 12.8.0 <= v < 12.9.1
    (a ptxas miscompilation); decline the same way."""
    if not causal:
        return None
    try:
        from jax._src.lib import cuda_versions

        ver = cuda_versions.cuda_runtime_get_version() if cuda_versions is not None else None
    except Exception:
        return None
    if ver is not None and 12080 <= ver < 12091:
        return f"causal masking is miscompiled by ptxas on CUDA runtime {ver} (12.8.0 <= version < 12.9.1)"
    return None


def _limit(q, args: AttnArgs, *, allow_fp32: bool = False):
    """``(exception type, reason)`` for the first kernel limit a normalized call breaks, else None
    (``normalize`` has already checked shapes, dtypes, GQA and the options themselves)."""
    if args.has_segment_ids:
        return ValueError, "segment_ids are not supported by the mosaic kernel"
    if args.window is not None:
        return ValueError, f"window={args.window!r} is not supported by the mosaic kernel (only window=None)"
    if args.softcap is not None:
        return ValueError, f"softcap={args.softcap!r} is not supported by the mosaic kernel (only softcap=None)"
    dtypes = DTYPES + ((jnp.dtype(jnp.float32),) if allow_fp32 else ())
    if jnp.dtype(q.dtype) not in dtypes:
        return TypeError, (
            f"dtype {jnp.dtype(q.dtype).name} not supported (q, k, v must all be one of "
            f"{tuple(t.name for t in dtypes)})"
        )
    d = q.shape[-1]
    if d not in HEAD_DIMS:
        return ValueError, f"head_dim {d} not in {HEAD_DIMS}"
    return None


def supports(q, k, v, args: AttnArgs) -> str | None:
    """None when the Mosaic kernel can serve this call, else a one-line reason.

    Declines: segment ids, a sliding window, softcap, dtype other than bf16/fp16, head_dim not in
    ``HEAD_DIMS``, a jax without ``jax.experimental.pallas.mosaic_gpu``, no GPU or a GPU that is not
    compute capability 9.x, causal on a CUDA runtime with the known ptxas bug, and, at head_dim 256 (whose
    backward is the flash kernels), a call those decline.
    """
    target = current_target(q)  # read once, handed to the flash backward's check
    limit = _limit(q, args)
    reason = (
        (limit[1] if limit else None)
        or _mosaic_import_error()
        or _device_reason(target)
        or _cuda_causal_reason(args.causal)
    )
    if reason is None and _backward_blocks(MosaicBlockSizes.default(q.shape[-1]), q.shape[-1]) is None:
        bwd = flash.supports(q, k, v, args, target=target)
        reason = None if bwd is None else f"its backward (the flash kernels, head_dim {q.shape[-1]}) declines: {bwd}"
    return reason


def attention(q, k, v, args: AttnArgs):
    """Backend entry point (``jaxattn.attention`` contract): out ``[B, Sq, Hq, D]`` in ``q.dtype``."""
    reason = supports(q, k, v, args)
    if reason is not None:
        raise ValueError(f"mosaic attention backend cannot serve this call: {reason}")
    cfg = _block_sizes(None, q.shape[-1])
    return _attention_vjp(q, k, v, args.causal, float(args.scale), cfg, "mosaic")[0]


# ------------------------------------------------------------------------------------------ validation
def _block_sizes(block_sizes, d: int) -> MosaicBlockSizes:
    if block_sizes is None:
        return MosaicBlockSizes.default(d)
    if not isinstance(block_sizes, MosaicBlockSizes):
        raise TypeError(f"block_sizes must be a MosaicBlockSizes or None, got {type(block_sizes).__name__}")
    for what, sizes in (("", block_sizes), (".backward", block_sizes.backward)):
        need = sizes.smem_bytes(d, 2) if isinstance(sizes, (MosaicBlockSizes, MosaicBackwardBlockSizes)) else 0
        if need > _SMEM_BYTES:
            raise ValueError(
                f"block_sizes{what} {sizes} need {need} bytes of shared memory for head_dim {d}, "
                f"more than the {_SMEM_BYTES} available; use smaller blocks or max_concurrent_steps"
            )
    return block_sizes


def _validate(q, k, v, causal, scale, block_sizes, *, allow_fp32: bool):
    """``normalize`` (shapes, dtypes, GQA, causal, scale) plus this kernel's limits; returns (args, cfg)."""
    args = normalize(q, k, v, causal=causal, scale=scale)
    limit = _limit(q, args, allow_fp32=allow_fp32)
    if limit is not None:
        exc, reason = limit
        raise exc(f"mosaic attention: {reason}")
    return args, _block_sizes(block_sizes, q.shape[-1])


# ------------------------------------------------------------------------------------------ tile math
# Shared by the Mosaic kernel and the jnp emulation: only ops that Mosaic GPU lowers on register arrays.
def _rem(a, b: int):
    return lax.rem(a, jnp.asarray(b, jnp.asarray(a).dtype))


def _kv_bounds(q_base, rows: int, *, sq: int, sk: int, block_kv: int, causal: bool):
    """(steps, full) for query rows ``[q_base, q_base + rows)``: kv blocks ``[0, steps)`` hold every key
    any of these rows may see, blocks ``[0, full)`` are visible to all of them without a mask.
    ``q_base`` may be a traced int32 scalar."""
    nkv = cdiv(sk, block_kv)
    if not causal:
        return nkv, sk // block_kv  # only the last block can hold padded keys
    offset = sk - sq  # bottom-right: row i sees keys j <= i + offset
    hi = jnp.maximum(q_base + (rows + offset), 0)  # exclusive end of the keys the last row sees
    steps = jnp.minimum(cdiv(hi, block_kv), nkv)
    lo = jnp.maximum(q_base + (offset + 1), 0)  # exclusive end of the keys the first row sees
    full = jnp.minimum(lax.div(lo, jnp.asarray(block_kv, lo.dtype)), steps)
    return steps, full


def _q_block(n_blocks: int, causal: bool):
    """This CTA's query block along the ``q_seq`` grid axis. A causal block's work grows with its index and the
    hardware hands CTAs out in grid order in practice (``heads`` varies fastest), so under ``causal`` the first CTAs
    take the last (longest) blocks and the launch's last wave holds short ones: longest-first, as FlashAttention's
    causal tile schedulers order them. The dkv kernel needs no turn: its first kv blocks are the longest."""
    i = lax.axis_index("q_seq")
    return n_blocks - 1 - i if causal else i


def _tile_mask(iota, q_start, kv_start, shape, *, sq: int, sk: int, causal: bool):
    """Visibility of a ``shape = (rows, block_kv)`` score tile (:func:`tiling.tile_mask`). With causal the
    bottom-right mask already hides padded keys from every real query row, so one comparison suffices."""
    kv_pos = iota(shape, 1) + kv_start
    if causal:
        return tile_mask(iota(shape, 0) + (q_start + (sk - sq)), kv_pos, right=0)  # q_pos: absolute positions
    return tile_mask(None, kv_pos, k_len=sk)


def _softmax_stats(qk, m_i, l_i, c: float, dtype):
    """One online-softmax step on an fp32 score tile ``qk`` (masked entries ``-inf``): ``(p, m, l, alpha)``, the
    accumulator's rescale ``alpha`` left to the caller. ``m_i`` is kept in log2 units scaled by
    ``c = scale * log2(e)`` so that ``p = exp2(qk * c - m)`` is one FMA."""
    m_new = jnp.maximum(m_i, qk.max(axis=1) * c)
    alpha = jnp.exp2(m_i - m_new)
    p = jnp.exp2(qk * c - lax.broadcast_in_dim(m_new, qk.shape, [0]))
    l_i = l_i * alpha + p.sum(axis=1)
    return p.astype(dtype), m_new, l_i, alpha


def _rescale(acc, alpha):
    return acc * lax.broadcast_in_dim(alpha, acc.shape, [0])


def _softmax_update(qk, m_i, l_i, acc, c: float, dtype):
    """:func:`_softmax_stats` and the accumulator rescaled: ``(p, m, l, acc * alpha)``."""
    p, m_new, l_i, alpha = _softmax_stats(qk, m_i, l_i, c, dtype)
    return p, m_new, l_i, _rescale(acc, alpha)


def _finalize(acc, m_i, l_i):
    """out = acc / l and lse (log2 units); rows that saw no key give 0 and about -1e30."""
    l_safe = jnp.maximum(l_i, _L_MIN)
    out = acc / lax.broadcast_in_dim(l_safe, acc.shape, [0])
    lse2 = m_i + jnp.log(l_safe) * (1.0 / LN2)
    return out, lse2


# ------------------------------------------------------------------------------------------ kernel
def _when(cond, f):
    import jax.experimental.pallas as pl

    if isinstance(cond, (bool, np.bool_)):
        if cond:
            f()
    else:
        pl.when(cond)(f)


def _interpret_params():
    try:  # private in jax 0.10.x / 0.11.x: Mosaic GPU interpreter (CPU simulation of threads/barriers/TMA)
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
    except ImportError as e:  # pragma: no cover
        raise NotImplementedError(f"this jax ({jax.__version__}) has no Mosaic GPU interpreter: {e}") from e
    return InterpretGPUParams(**_INTERPRET_OPTIONS)


# Extra InterpretGPUParams fields for impl="interpret" (tests set e.g. detect_races=True).
_INTERPRET_OPTIONS: dict = {}


def _mosaic_forward_padded(qp, kp, vp, *, sq, sk, causal, scale, cfg, interpret):
    """Runs the kernel on padded inputs; returns (out_padded [B,Sqp,Hq,D], lse2 [B,Hq,Sqp] in log2 units)."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    b, sqp, hq, d = qp.shape
    hkv = kp.shape[2]
    group = hq // hkv
    bq, bkv, mcs, overlap = cfg.block_q, cfg.block_kv, cfg.max_concurrent_steps, bool(cfg.overlap)
    dtype = qp.dtype
    c = scale * LOG2E
    bounds = functools.partial(_kv_bounds, sq=sq, sk=sk, block_kv=bkv, causal=causal)
    tmask = functools.partial(_tile_mask, sq=sq, sk=sk, causal=causal)

    if interpret:  # substitutes for what the interpreter lacks (see module docstring)
        layout_cast = lambda x, layout: x  # noqa: E731
        iota = lambda shape, dim: lax.broadcasted_iota(jnp.int32, shape, dim)  # noqa: E731
    else:
        layout_cast = plgpu.layout_cast
        iota = lambda shape, dim: plgpu.broadcasted_iota(  # noqa: E731
            jnp.int32, shape, dim, layout=plgpu.Layout.WGMMA
        )

    def qk_matmul(q_smem, k_smem, during):
        if interpret:
            during()
            qk = jnp.dot(q_smem[...], k_smem[...].T, preferred_element_type=jnp.float32)
            # These loads go through the generic proxy (wgmma reads SMEM through the async proxy, as TMA
            # writes it): fence them (fence.proxy.async) before the consumed arrive hands the slot to TMA.
            plgpu.commit_smem()
            return qk

        def body(acc_ref):
            plgpu.wgmma(acc_ref, q_smem, plgpu.transpose_ref(k_smem, (1, 0)))
            during()  # runs while the wgmma is in flight
            return acc_ref[...]

        return pl.run_scoped(body, plgpu.ACC((bq, bkv), jnp.float32))

    def pv_matmul(acc, p16, v_smem, during):
        if interpret:
            during()
            acc = acc + jnp.dot(p16, v_smem[...], preferred_element_type=jnp.float32)
            plgpu.commit_smem()  # generic-proxy loads before the TMA refill: see qk_matmul
            return acc

        def body(acc_ref):
            plgpu.wgmma(acc_ref, p16, v_smem)
            during()

        return pl.run_state(body)(plgpu.ACC.init(acc))

    def kernel(
        q_ref,
        k_ref,
        v_ref,
        o_ref,
        lse_ref,
        qo_smem2,
        k_smem,
        v_smem,
        lse_smem2,
        k_bars,
        v_bars,
        q_bars,
        k_consumed,
        v_consumed,
        sched,
    ):
        batch = lax.axis_index("batch")
        head = lax.axis_index("heads")
        wg = lax.axis_index("wg")
        cta_base = _q_block(sqp // (2 * bq), causal) * (2 * bq)
        cta_steps, _ = bounds(cta_base, 2 * bq)  # = steps of warpgroup 1, >= steps of warpgroup 0
        if overlap:  # >= 1 step everywhere: a row that sees no key meets a fully masked block 0 (p = 0, same result)
            cta_steps = jnp.maximum(cta_steps, 1)

        def sched_sync():
            plgpu.barrier_arrive(sched)
            plgpu.barrier_wait(sched)

        def overlapped(qo_smem, q_base, steps, full, acc, m_i, l_i):
            """FlashAttention-3's intra-warpgroup overlap (§3.2): window ``t`` issues the scores of key block
            ``t`` and ``P V`` of block ``t - 1``, then runs the softmax of ``t`` while the second is in flight.
            Window 0 has only the scores, window ``steps`` only the last ``P V``. Each window keeps the ping-pong
            protocol: issue, arrive, work, wait, sync (two barrier phases, as a step of the plain loop)."""
            mask = functools.partial(tmask, iota, q_base, shape=(bq, bkv))

            def mask_from_full(t, qk):  # one loop over every window, the mask only where it masks (t >= full)
                return lax.cond(t >= full, lambda x: jnp.where(mask(t * bkv), x, -jnp.inf), lambda x: x, qk)

            def end_window():
                plgpu.barrier_wait(sched)
                sched_sync()

            plgpu.barrier_wait(k_bars.at[0])  # window 0: scores only
            qk = qk_matmul(qo_smem, k_smem.at[0], lambda: plgpu.barrier_arrive(sched))
            plgpu.barrier_arrive(k_consumed.at[0])
            p16, m_i, l_i, _ = _softmax_stats(jnp.where(mask(0), qk, -jnp.inf), m_i, l_i, c, dtype)
            end_window()

            def window(t, carry, masked):
                acc, p16, m_i, l_i = carry
                slot, prev = _rem(t, mcs), _rem(t - 1, mcs)
                plgpu.barrier_wait(k_bars.at[slot])
                if interpret:
                    qk = jnp.dot(qo_smem[...], k_smem.at[slot][...].T, preferred_element_type=jnp.float32)
                    plgpu.barrier_wait(v_bars.at[prev])
                    pv = jnp.dot(p16, v_smem.at[prev][...], preferred_element_type=jnp.float32)
                    plgpu.commit_smem()  # generic-proxy loads before the TMA refill: see qk_matmul
                    plgpu.barrier_arrive(sched)
                    plgpu.barrier_arrive(k_consumed.at[slot])
                    qk = mask_from_full(t, qk) if masked else qk
                    p16, m_i, l_i, alpha = _softmax_stats(qk, m_i, l_i, c, dtype)
                    acc = acc + pv
                else:

                    def body(refs):
                        o_ref, s_ref, m_ref, l_ref, p_ref, a_ref = refs
                        plgpu.wgmma(s_ref, qo_smem, plgpu.transpose_ref(k_smem.at[slot], (1, 0)))
                        plgpu.barrier_wait(v_bars.at[prev])
                        plgpu.wgmma(o_ref, p16, v_smem.at[prev])
                        plgpu.barrier_arrive(sched)
                        qk = plgpu.wgmma_accumulator_load(s_ref, wait_n=1)  # the scores; P V still in flight
                        plgpu.barrier_arrive(k_consumed.at[slot])
                        qk = mask_from_full(t, qk) if masked else qk
                        p_new, m_new, l_new, alpha = _softmax_stats(qk, m_ref[...], l_ref[...], c, dtype)
                        m_ref[...], l_ref[...], p_ref[...], a_ref[...] = m_new, l_new, p_new, alpha

                    zero = layout_cast(jnp.full((bq, bkv), 0.0, jnp.float32), plgpu.Layout.WGMMA)
                    init = (plgpu.ACC.init(acc), plgpu.ACC.init(zero), m_i, l_i, p16, m_i)
                    acc, _, m_i, l_i, p16, alpha = pl.run_state(body)(init)  # waits for P V
                plgpu.barrier_arrive(v_consumed.at[prev])
                acc = _rescale(acc, alpha)
                end_window()
                return acc, p16, m_i, l_i

            # One loop: two (unmasked, masked) with a traced boundary make ptxas serialize every wgmma (C7513).
            masked = causal or sk % bkv != 0
            carry = (acc, p16, m_i, l_i)
            acc, p16, m_i, l_i = lax.fori_loop(1, steps, functools.partial(window, masked=masked), carry)
            last = _rem(steps - 1, mcs)  # window `steps`: the last P V only
            plgpu.barrier_wait(v_bars.at[last])
            acc = pv_matmul(acc, p16, v_smem.at[last], lambda: plgpu.barrier_arrive(sched))
            plgpu.barrier_arrive(v_consumed.at[last])
            end_window()
            return acc, m_i, l_i

        @pl.when(wg < 2)
        def _consumer():
            if not interpret:
                plgpu.set_max_registers(240 if overlap else 232, action="increase")
            qo_smem = qo_smem2.at[wg]
            lse_smem = lse_smem2.at[wg]
            q_base = cta_base + wg * bq
            steps, full = bounds(q_base, bq)
            if overlap:
                steps = jnp.maximum(steps, 1)

            plgpu.copy_gmem_to_smem(q_ref.at[batch, pl.ds(q_base, bq), head], qo_smem, q_bars.at[wg])
            plgpu.barrier_wait(q_bars.at[wg])
            m_i = layout_cast(jnp.full((bq,), _M_INIT, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
            l_i = layout_cast(jnp.full((bq,), 0.0, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
            acc = layout_cast(jnp.full((bq, d), 0.0, jnp.float32), plgpu.Layout.WGMMA)

            if not overlap:
                _when(steps > 0, lambda: plgpu.barrier_wait(k_bars.at[0]))
            pl.when(wg == 1)(sched_sync)  # offset warpgroup 1 by half a step (ping-pong)

            def step(t, carry, masked):
                acc, m_i, l_i = carry
                slot = _rem(t, mcs)
                qk = qk_matmul(qo_smem, k_smem.at[slot], sched_sync)
                plgpu.barrier_arrive(k_consumed.at[slot])
                if masked:
                    qk = jnp.where(tmask(iota, q_base, t * bkv, (bq, bkv)), qk, -jnp.inf)
                p16, m_i, l_i, acc = _softmax_update(qk, m_i, l_i, acc, c, dtype)
                if not interpret and d <= 128:
                    acc, l_i, m_i, p16 = lax.optimization_barrier((acc, l_i, m_i, p16))
                plgpu.barrier_arrive(sched)  # softmax done
                plgpu.barrier_wait(v_bars.at[slot])
                plgpu.barrier_wait(sched)  # tensor core free

                def wait_next_k():
                    nxt = t + 1
                    _when(nxt < steps, lambda: plgpu.barrier_wait(k_bars.at[_rem(nxt, mcs)]))

                acc = pv_matmul(acc, p16, v_smem.at[slot], wait_next_k)
                plgpu.barrier_arrive(v_consumed.at[slot])
                return acc, m_i, l_i

            if overlap:
                carry = overlapped(qo_smem, q_base, steps, full, acc, m_i, l_i)
            else:
                carry = (acc, m_i, l_i)
                carry = lax.fori_loop(0, full, functools.partial(step, masked=False), carry)
                carry = lax.fori_loop(full, steps, functools.partial(step, masked=True), carry)
            if causal:

                def drain(t, _):  # keep the producer's ring moving for the other warpgroup
                    slot = _rem(t, mcs)
                    # Observe the loads (needed by the other warpgroup) so that no barrier phase is
                    # left unobserved: keeps per-thread phase tracking exact and the interpreter happy.
                    plgpu.barrier_wait(k_bars.at[slot])
                    plgpu.barrier_wait(v_bars.at[slot])
                    plgpu.barrier_arrive(k_consumed.at[slot])
                    plgpu.barrier_arrive(v_consumed.at[slot])
                    sched_sync()
                    sched_sync()
                    return _

                lax.fori_loop(steps, cta_steps, drain, None)
            pl.when(wg == 0)(sched_sync)

            acc, m_i, l_i = carry
            out, lse2 = _finalize(acc, m_i, l_i)
            qo_smem[...] = out.astype(dtype)
            lse_smem[...] = lse2
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(qo_smem, o_ref.at[batch, pl.ds(q_base, bq), head])
            plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[batch, head, pl.ds(q_base, bq)])
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == 2)
        def _producer():
            if not interpret:
                plgpu.set_max_registers(24 if overlap else 40, action="decrease")
            kv_head = lax.div(head, jnp.array(group, head.dtype))

            def load(t, slot):
                s = (batch, pl.ds(t * bkv, bkv), kv_head)
                plgpu.copy_gmem_to_smem(k_ref.at[s], k_smem.at[slot], k_bars.at[slot])
                plgpu.copy_gmem_to_smem(v_ref.at[s], v_smem.at[slot], v_bars.at[slot])

            for i in range(min(mcs, kp.shape[1] // bkv)):  # none past the last kv block: a static OOB slice
                _when(i < cta_steps, functools.partial(load, i, i))

            def refill(t, _):
                slot = _rem(t, mcs)
                s = (batch, pl.ds((t + mcs) * bkv, bkv), kv_head)
                plgpu.barrier_wait(k_consumed.at[slot])
                plgpu.copy_gmem_to_smem(k_ref.at[s], k_smem.at[slot], k_bars.at[slot])
                plgpu.barrier_wait(v_consumed.at[slot])
                plgpu.copy_gmem_to_smem(v_ref.at[s], v_smem.at[slot], v_bars.at[slot])
                return _

            lax.fori_loop(0, cta_steps - mcs, refill, None)

            def settle(t, _):  # observe the consumers' last arrivals before the barriers go away
                slot = _rem(t, mcs)
                plgpu.barrier_wait(k_consumed.at[slot])
                plgpu.barrier_wait(v_consumed.at[slot])
                return _

            lax.fori_loop(jnp.maximum(cta_steps - mcs, 0), cta_steps, settle, None)

    tiles = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    scratch = [
        plgpu.SMEM((2, bq, d), dtype, transforms=tiles),  # Q tile, reused for O
        plgpu.SMEM((mcs, bkv, d), dtype, transforms=tiles),  # K ring
        plgpu.SMEM((mcs, bkv, d), dtype, transforms=tiles),  # V ring
        plgpu.SMEM((2, bq), jnp.float32),  # lse
        plgpu.Barrier(num_barriers=mcs),  # K landed
        plgpu.Barrier(num_barriers=mcs),  # V landed
        plgpu.Barrier(num_barriers=2),  # Q landed
        plgpu.Barrier(num_arrivals=2, num_barriers=mcs),  # K slot consumed
        plgpu.Barrier(num_arrivals=2, num_barriers=mcs),  # V slot consumed
        plgpu.Barrier(num_arrivals=2),  # schedule (ping-pong)
    ]
    kwargs = (
        dict(interpret=_interpret_params())
        if interpret
        else dict(compiler_params=plgpu.CompilerParams(approx_math=True))
    )
    out, lse2 = plgpu.kernel(
        kernel,
        out_type=(jax.ShapeDtypeStruct(qp.shape, dtype), jax.ShapeDtypeStruct((b, hq, sqp), jnp.float32)),
        scratch_types=scratch,
        grid=(hq, sqp // (2 * bq), b),
        grid_names=("heads", "q_seq", "batch"),
        num_threads=3,
        thread_name="wg",
        **kwargs,
    )(qp, kp, vp)
    return out, lse2


def _emulated_forward_padded(qp, kp, vp, *, sq, sk, causal, scale, cfg):
    """Pure-jnp twin of the kernel: same tiles, bounds, masks and tile math; one (batch, head, q block)
    per vmap lane, a fori_loop over the masked and unmasked kv steps."""
    b, sqp, hq, d = qp.shape
    hkv = kp.shape[2]
    group = hq // hkv
    bq, bkv = cfg.block_q, cfg.block_kv
    dtype = qp.dtype
    c = scale * LOG2E
    iota = lambda shape, dim: lax.broadcasted_iota(jnp.int32, shape, dim)  # noqa: E731

    def one(bi, h, qi):
        q_base = qi * bq
        q_t = lax.dynamic_slice(qp, (bi, q_base, h, 0), (1, bq, 1, d))[0, :, 0]
        steps, full = _kv_bounds(q_base, bq, sq=sq, sk=sk, block_kv=bkv, causal=causal)

        def step(t, carry, masked):
            acc, m_i, l_i = carry
            k_t = lax.dynamic_slice(kp, (bi, t * bkv, h // group, 0), (1, bkv, 1, d))[0, :, 0]
            v_t = lax.dynamic_slice(vp, (bi, t * bkv, h // group, 0), (1, bkv, 1, d))[0, :, 0]
            qk = jnp.dot(q_t, k_t.T, preferred_element_type=jnp.float32)
            if masked:
                qk = jnp.where(_tile_mask(iota, q_base, t * bkv, (bq, bkv), sq=sq, sk=sk, causal=causal), qk, -jnp.inf)
            p16, m_i, l_i, acc = _softmax_update(qk, m_i, l_i, acc, c, dtype)
            return acc + jnp.dot(p16, v_t, preferred_element_type=jnp.float32), m_i, l_i

        carry = (jnp.zeros((bq, d), jnp.float32), jnp.full((bq,), _M_INIT, jnp.float32), jnp.zeros((bq,), jnp.float32))
        carry = lax.fori_loop(0, full, functools.partial(step, masked=False), carry)
        carry = lax.fori_loop(full, steps, functools.partial(step, masked=True), carry)
        out, lse2 = _finalize(*carry)
        return out.astype(dtype), lse2

    bi, h, qi = jnp.meshgrid(jnp.arange(b), jnp.arange(hq), jnp.arange(sqp // bq), indexing="ij")
    out, lse2 = jax.vmap(one)(bi.ravel(), h.ravel(), qi.ravel())
    out = out.reshape(b, hq, sqp, d).transpose(0, 2, 1, 3)
    return out, lse2.reshape(b, hq, sqp)


@functools.partial(jax.jit, static_argnums=(3, 4, 5, 6))
def _forward(q, k, v, causal, scale, cfg, impl):
    """Pads, runs the kernel (or its emulation), slices. Returns out [B,Sq,Hq,D] and lse [B,Hq,Sq]
    (natural log, -inf for rows that see no key)."""
    b, sq, hq, d = q.shape
    sk = k.shape[1]
    sqp = cdiv(sq, 2 * cfg.block_q) * 2 * cfg.block_q
    skp = cdiv(sk, cfg.block_kv) * cfg.block_kv
    qp = jnp.pad(q, ((0, 0), (0, sqp - sq), (0, 0), (0, 0))) if sqp != sq else q
    pad_kv = ((0, 0), (0, skp - sk), (0, 0), (0, 0))
    kp = jnp.pad(k, pad_kv) if skp != sk else k
    vp = jnp.pad(v, pad_kv) if skp != sk else v
    kw = dict(sq=sq, sk=sk, causal=causal, scale=scale, cfg=cfg)
    if impl == "emulate":
        out, lse2 = _emulated_forward_padded(qp, kp, vp, **kw)
    else:
        out, lse2 = _mosaic_forward_padded(qp, kp, vp, interpret=(impl == "interpret"), **kw)
    out = out[:, :sq]
    lse2 = lse2[:, :, :sq]
    lse = jnp.where(lse2 > 0.5 * _M_INIT, lse2 * LN2, -jnp.inf)
    return out, lse


# ------------------------------------------------------------------------------------------ backward
# FlashAttention-2's backward (Dao 2023, Alg. 2) as two Mosaic GPU kernels, each a producer warpgroup
# streaming tiles by TMA into a ring and two consumer warpgroups of 64-row wgmma tiles: ``dkv`` owns
# ``2 * block_kv_dkv`` keys (its K/V tiles stay in SMEM) and streams, for each query head of its kv head
# (GQA summed in registers), the Q / dO / LSE / delta tiles of the query blocks that see them; ``dq`` owns
# ``2 * block_q_dq`` query rows and streams K/V.  ``delta = rowsum(dO * O) - dLSE`` and the LSE in log2
# units come from XLA; a row that sees no key or a padded row gets LSE ``_LSE_EMPTY``, so its ``p`` is 0.
_LSE_EMPTY = 1e30


@dataclasses.dataclass(frozen=True)
class MosaicBackwardBlockSizes:
    """Tiles of the Mosaic backward kernels (multiples of 64, the wgmma M).

    * ``block_q_dq``: query rows per consumer warpgroup of the dq kernel (a CTA has two);
      ``block_kv_dq``: keys per pipeline step of the dq kernel.
    * ``block_kv_dkv``: key rows per consumer warpgroup of the dkv kernel (a CTA has two);
      ``block_q_dkv``: query rows per pipeline step of the dkv kernel.
    * ``max_concurrent_steps``: depth of both kernels' TMA rings, >= 2.

    The defaults are FlashAttention-3's Hopper backward tile for head_dim 128 (``hopper/flash_bwd_launch_template.h``:
    ``kBlockM = 64`` queries per step, ``kBlockN = 128`` keys per CTA over two MMA warpgroups). Timed on one H200
    (``benchmarks/results/nvidia-h200/block_search.json``, D=128 bf16): the same tile with a 3-slot ring was within
    the spread (dq 0.440 vs 0.458 ms, dkv 0.510 vs 0.557), so the defaults stand until a paired timing says
    otherwise."""

    block_q_dq: int = 64
    block_kv_dq: int = 64
    block_q_dkv: int = 64
    block_kv_dkv: int = 64
    max_concurrent_steps: int = 2

    def __post_init__(self):
        _check_tiles(self, ("block_q_dq", "block_kv_dq", "block_q_dkv", "block_kv_dkv"))

    def smem_bytes(self, head_dim: int, itemsize: int = 2) -> int:
        """Shared memory of the larger of the two kernels (resident tiles, ring, LSE / delta)."""
        mcs, tile = self.max_concurrent_steps, head_dim * itemsize
        dq = 2 * 2 * self.block_q_dq * tile + 2 * 2 * self.block_q_dq * 4 + mcs * 2 * self.block_kv_dq * tile
        dkv = 2 * 2 * self.block_kv_dkv * tile + mcs * (2 * self.block_q_dkv * tile + 2 * self.block_q_dkv * 4)
        return max(dq, dkv) + 1024  # + barriers / alignment slack


BACKWARD_HEAD_DIMS = (64, 128)  # head_dim 256: two fp32 64x256 accumulators exceed a warpgroup's registers


def _q_bounds(k_base, rows: int, *, sq: int, sk: int, nq: int, block_q: int, causal: bool):
    """(lo, full) for key rows ``[k_base, k_base + rows)``, the transpose of :func:`_kv_bounds`: query blocks
    ``[lo, nq)`` hold every query row that sees one of these keys, blocks ``[full, nq)`` see all of them
    without a mask (padded query rows need none: their LSE is ``_LSE_EMPTY``)."""
    if not causal:
        return 0, 0
    offset = sk - sq  # key j is seen by query rows i >= j - offset
    lo = jnp.minimum(lax.div(jnp.maximum(k_base - offset, 0), jnp.asarray(block_q, jnp.int32)), nq)
    last = jnp.minimum(k_base + rows, sk) - 1  # padded keys need no mask: their dK / dV rows are sliced off
    full = jnp.minimum(cdiv(jnp.maximum(last - offset, 0), block_q), nq)
    return lo, jnp.maximum(full, lo)


def _tile_mask_t(iota, kv_start, q_start, shape, *, sq: int, sk: int):
    """Causal visibility of a transposed ``shape = (keys, queries)`` score tile (bottom-right)."""
    return tile_mask(iota(shape, 1) + (q_start + (sk - sq)), iota(shape, 0) + kv_start, right=0)


class _WarpgroupOps:
    """The few warpgroup operations both backward kernels use, and their interpreter substitutes (see
    :func:`_mosaic_forward_padded`): ``mm`` is wgmma (``jnp.dot`` on loaded values, each read fenced by
    ``commit_smem`` before a consumed arrive lets TMA refill the slot), ``row``/``col`` load an fp32 vector
    laid out for broadcasting along a WGMMA tile's rows / columns, ``iota`` and ``zeros`` are laid out for it."""

    def __init__(self, interpret: bool):
        import jax.experimental.pallas as pl
        import jax.experimental.pallas.mosaic_gpu as plgpu

        self.pl, self.plgpu, self.interpret = pl, plgpu, interpret

    def mm(self, a, b_ref, shape=None, *, a_ref: bool, b_t: bool = False, acc=None):
        """``a @ b`` (``a @ b.T`` with ``b_t``) in fp32: ``a`` an SMEM ref (``a_ref``) or registers, ``b`` an SMEM
        ref; into a fresh ``shape`` accumulator, or added to ``acc``."""
        pl, plgpu = self.pl, self.plgpu
        if self.interpret:
            b = b_ref[...]
            out = jnp.dot(a[...] if a_ref else a, b.T if b_t else b, preferred_element_type=jnp.float32)
            plgpu.commit_smem()
            return out if acc is None else acc + out
        b = plgpu.transpose_ref(b_ref, (1, 0)) if b_t else b_ref
        if acc is None:

            def fresh(acc_ref):
                plgpu.wgmma(acc_ref, a, b)
                return acc_ref[...]

            return pl.run_scoped(fresh, plgpu.ACC(shape, jnp.float32))

        def add(acc_ref):
            plgpu.wgmma(acc_ref, a, b)

        return pl.run_state(add)(plgpu.ACC.init(acc))

    def _vector(self, ref, dim: int):
        if self.interpret:
            return ref[...]
        layout = self.plgpu.Layout.WGMMA.reduce(dim)
        try:  # jax >= 0.11: no index argument (0.12 has none at all)
            return self.plgpu.load(ref, layout=layout)
        except TypeError:  # jax 0.10: the index is positional and required
            return self.plgpu.load(ref, (slice(None),), layout=layout)

    def rows(self, ref):
        """``ref``'s fp32 vector, one value per row of a WGMMA tile (broadcast with ``broadcast_in_dim(.., [0])``)."""
        return self._vector(ref, 1)

    def col(self, ref, shape):
        """``ref``'s fp32 vector broadcast down each column (one value per column) to ``shape``."""
        return lax.broadcast_in_dim(self._vector(ref, 0), shape, [1])

    def iota(self, shape, dim):
        if self.interpret:
            return lax.broadcasted_iota(jnp.int32, shape, dim)
        return self.plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=self.plgpu.Layout.WGMMA)

    def zeros(self, shape):
        z = jnp.full(shape, 0.0, jnp.float32)
        return z if self.interpret else self.plgpu.layout_cast(z, self.plgpu.Layout.WGMMA)

    def release(self, barrier):
        """A consumer is done with a ring slot (its wgmmas have completed: ``run_state`` waits)."""
        self.plgpu.barrier_arrive(barrier)

    def consumer_registers(self):
        if not self.interpret:
            self.plgpu.set_max_registers(232, action="increase")

    def producer_registers(self):
        if not self.interpret:
            self.plgpu.set_max_registers(40, action="decrease")


def _ring_producer(ops, steps, slots: int, first: int, load, consumed):
    """The producer warpgroup of a ring of ``slots`` SMEM slots: loads steps ``0 .. slots - 1`` (at most the
    static ``first``: none past the last block), then refills slot ``t % slots`` with step ``t + slots`` once
    both consumers released it, then observes the last releases before the barriers go away."""
    for i in range(min(slots, first)):
        _when(i < steps, functools.partial(load, i, i))

    def refill(t, _):
        slot = _rem(t, slots)
        ops.plgpu.barrier_wait(consumed.at[slot])
        load(t + slots, slot)
        return _

    lax.fori_loop(0, steps - slots, refill, None)

    def settle(t, _):
        ops.plgpu.barrier_wait(consumed.at[_rem(t, slots)])
        return _

    lax.fori_loop(jnp.maximum(steps - slots, 0), steps, settle, None)


def _drain(ops, slot_of, bars, consumed):
    """A consumer's skipped ring step: observe the slot's loads (needed by the other consumer) and release
    it, so that every barrier phase is observed by every thread."""

    def skip(t, _):
        slot = slot_of(t)
        for bar in bars:
            ops.plgpu.barrier_wait(bar.at[slot])
        ops.release(consumed.at[slot])
        return _

    return skip


def _kernel_call(ops, kernel, out_type, scratch, grid, grid_names):
    plgpu = ops.plgpu
    kwargs = (
        dict(interpret=_interpret_params())
        if ops.interpret
        else dict(compiler_params=plgpu.CompilerParams(approx_math=True))
    )
    return plgpu.kernel(
        kernel,
        out_type=out_type,
        scratch_types=scratch,
        grid=grid,
        grid_names=grid_names,
        num_threads=3,
        thread_name="wg",
        **kwargs,
    )


def _mosaic_dq_padded(qp, kp, vp, dop, lse2, delta, *, sq, sk, causal, scale, blocks, interpret):
    """dq ``[B, Sqp, Hq, D]`` (FA2 Alg. 2 lines 11-14 per query block; keys streamed)."""
    ops = _WarpgroupOps(interpret)
    pl, plgpu = ops.pl, ops.plgpu
    b, sqp, hq, d = qp.shape
    group = hq // kp.shape[2]
    bq, bkv, mcs = blocks.block_q_dq, blocks.block_kv_dq, blocks.max_concurrent_steps
    dtype, c = qp.dtype, scale * LOG2E
    bounds = functools.partial(_kv_bounds, sq=sq, sk=sk, block_kv=bkv, causal=causal)

    def kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref, q2, do2, lse2_, delta2, k_ring, v_ring, *bars):
        q_bar, do_bar, lse_bar, delta_bar, k_bars, v_bars, consumed = bars
        batch, head, wg = lax.axis_index("batch"), lax.axis_index("heads"), lax.axis_index("wg")
        cta_base = _q_block(sqp // (2 * bq), causal) * (2 * bq)
        cta_steps, _ = bounds(cta_base, 2 * bq)

        @pl.when(wg < 2)
        def _consumer():
            ops.consumer_registers()
            q_s, do_s, lse_s, delta_s = q2.at[wg], do2.at[wg], lse2_.at[wg], delta2.at[wg]
            q_base = cta_base + wg * bq
            steps, full = bounds(q_base, bq)
            rows = (batch, pl.ds(q_base, bq), head)
            vec = (batch, head, pl.ds(q_base, bq))
            for src, dst, bar in (
                (q_ref.at[rows], q_s, q_bar),
                (do_ref.at[rows], do_s, do_bar),
                (lse_ref.at[vec], lse_s, lse_bar),
                (delta_ref.at[vec], delta_s, delta_bar),
            ):
                plgpu.copy_gmem_to_smem(src, dst, bar.at[wg])
            for bar in (q_bar, do_bar, lse_bar, delta_bar):
                plgpu.barrier_wait(bar.at[wg])

            def step(t, carry, masked):
                dq, lse, dlt = carry
                slot = _rem(t, mcs)
                plgpu.barrier_wait(k_bars.at[slot])
                s = ops.mm(q_s, k_ring.at[slot], (bq, bkv), a_ref=True, b_t=True)  # S = Q K^T
                if masked:
                    s = jnp.where(
                        _tile_mask(ops.iota, q_base, t * bkv, (bq, bkv), sq=sq, sk=sk, causal=causal), s, -jnp.inf
                    )
                p = jnp.exp2(s * c - lax.broadcast_in_dim(lse, (bq, bkv), [0]))
                plgpu.barrier_wait(v_bars.at[slot])
                dp = ops.mm(do_s, v_ring.at[slot], (bq, bkv), a_ref=True, b_t=True)  # dP = dO V^T
                ds = p * (dp - lax.broadcast_in_dim(dlt, (bq, bkv), [0]))
                dq = ops.mm(ds.astype(dtype), k_ring.at[slot], a_ref=False, acc=dq)  # dQ += dS K
                ops.release(consumed.at[slot])
                return dq, lse, dlt

            carry = (ops.zeros((bq, d)), ops.rows(lse_s), ops.rows(delta_s))
            carry = lax.fori_loop(0, full, functools.partial(step, masked=False), carry)
            dq, _, _ = lax.fori_loop(full, steps, functools.partial(step, masked=True), carry)
            if causal:  # warpgroup 0 sees fewer keys: keep the ring moving for warpgroup 1
                lax.fori_loop(steps, cta_steps, _drain(ops, lambda t: _rem(t, mcs), (k_bars, v_bars), consumed), None)
            q_s[...] = (dq * scale).astype(dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(q_s, dq_ref.at[rows])
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == 2)
        def _producer():
            ops.producer_registers()
            kv_head = lax.div(head, jnp.array(group, head.dtype))

            def load(t, slot):
                s = (batch, pl.ds(t * bkv, bkv), kv_head)
                plgpu.copy_gmem_to_smem(k_ref.at[s], k_ring.at[slot], k_bars.at[slot])
                plgpu.copy_gmem_to_smem(v_ref.at[s], v_ring.at[slot], v_bars.at[slot])

            _ring_producer(ops, cta_steps, mcs, kp.shape[1] // bkv, load, consumed)

    tiles = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    scratch = [
        plgpu.SMEM((2, bq, d), dtype, transforms=tiles),  # Q (reused for dQ)
        plgpu.SMEM((2, bq, d), dtype, transforms=tiles),  # dO
        plgpu.SMEM((2, bq), jnp.float32),  # LSE (log2)
        plgpu.SMEM((2, bq), jnp.float32),  # delta
        plgpu.SMEM((mcs, bkv, d), dtype, transforms=tiles),  # K ring
        plgpu.SMEM((mcs, bkv, d), dtype, transforms=tiles),  # V ring
        *[plgpu.Barrier(num_barriers=2) for _ in range(4)],  # Q, dO, LSE, delta landed (per warpgroup)
        plgpu.Barrier(num_barriers=mcs),  # K landed
        plgpu.Barrier(num_barriers=mcs),  # V landed
        plgpu.Barrier(num_arrivals=2, num_barriers=mcs),  # slot released by both consumers
    ]
    call = _kernel_call(
        ops,
        kernel,
        jax.ShapeDtypeStruct(qp.shape, dtype),
        scratch,
        (hq, sqp // (2 * bq), b),
        ("heads", "q_seq", "batch"),
    )
    return call(qp, kp, vp, dop, lse2, delta)


def _mosaic_dkv_padded(qp, kp, vp, dop, lse2, delta, *, sq, sk, causal, scale, blocks, interpret):
    """(dk, dv) ``[B, Skp, Hkv, D]`` (FA2 Alg. 2 lines 6-10 per key block; queries streamed, every query head
    of the kv head in turn, summed in registers)."""
    ops = _WarpgroupOps(interpret)
    pl, plgpu = ops.pl, ops.plgpu
    b, sqp, hq, d = qp.shape
    skp, hkv = kp.shape[1], kp.shape[2]
    group = hq // hkv
    bq, bkv, mcs = blocks.block_q_dkv, blocks.block_kv_dkv, blocks.max_concurrent_steps
    nq = sqp // bq
    dtype, c = kp.dtype, scale * LOG2E
    bounds = functools.partial(_q_bounds, sq=sq, sk=sk, nq=nq, block_q=bq, causal=causal)

    def kernel(
        q_ref,
        k_ref,
        v_ref,
        do_ref,
        lse_ref,
        delta_ref,
        dk_ref,
        dv_ref,
        k2,
        v2,
        q_ring,
        do_ring,
        lse_ring,
        delta_ring,
        *bars,
    ):
        k_bar, v_bar, q_bars, do_bars, lse_bars, delta_bars, consumed = bars
        batch, kv_head, wg = lax.axis_index("batch"), lax.axis_index("heads"), lax.axis_index("wg")
        cta_base = lax.axis_index("kv_seq") * (2 * bkv)
        cta_lo, _ = bounds(cta_base, 2 * bkv)  # = warpgroup 0's lo, <= warpgroup 1's
        per_head = nq - cta_lo  # ring steps per query head: query blocks [cta_lo, nq)

        @pl.when(wg < 2)
        def _consumer():
            ops.consumer_registers()
            k_s, v_s = k2.at[wg], v2.at[wg]
            k_base = cta_base + wg * bkv
            lo, full = bounds(k_base, bkv)
            rows = (batch, pl.ds(k_base, bkv), kv_head)
            plgpu.copy_gmem_to_smem(k_ref.at[rows], k_s, k_bar.at[wg])
            plgpu.copy_gmem_to_smem(v_ref.at[rows], v_s, v_bar.at[wg])
            plgpu.barrier_wait(k_bar.at[wg])
            plgpu.barrier_wait(v_bar.at[wg])

            def step(qi, carry, t0, masked):
                dk, dv = carry
                slot = _rem(t0 + qi, mcs)
                plgpu.barrier_wait(q_bars.at[slot])
                st = ops.mm(k_s, q_ring.at[slot], (bkv, bq), a_ref=True, b_t=True)  # S^T = K Q^T
                if masked:
                    st = jnp.where(_tile_mask_t(ops.iota, k_base, qi * bq, (bkv, bq), sq=sq, sk=sk), st, -jnp.inf)
                plgpu.barrier_wait(lse_bars.at[slot])
                pt = jnp.exp2(st * c - ops.col(lse_ring.at[slot], (bkv, bq)))
                plgpu.barrier_wait(do_bars.at[slot])
                dv = ops.mm(pt.astype(dtype), do_ring.at[slot], a_ref=False, acc=dv)  # dV += P^T dO
                dpt = ops.mm(v_s, do_ring.at[slot], (bkv, bq), a_ref=True, b_t=True)  # dP^T = V dO^T
                plgpu.barrier_wait(delta_bars.at[slot])
                dst = pt * (dpt - ops.col(delta_ring.at[slot], (bkv, bq)))
                dk = ops.mm(dst.astype(dtype), q_ring.at[slot], a_ref=False, acc=dk)  # dK += dS^T Q
                ops.release(consumed.at[slot])
                return dk, dv

            def head(g, carry):
                t0 = g * per_head - cta_lo  # ring step of query block qi: t0 + qi
                skip = _drain(ops, lambda qi: _rem(t0 + qi, mcs), (q_bars, lse_bars, do_bars, delta_bars), consumed)
                lax.fori_loop(cta_lo, lo, skip, None)  # warpgroup 1's keys come later: no query there sees them
                carry = lax.fori_loop(lo, full, functools.partial(step, t0=t0, masked=True), carry)
                return lax.fori_loop(full, nq, functools.partial(step, t0=t0, masked=False), carry)

            dk, dv = lax.fori_loop(0, group, head, (ops.zeros((bkv, d)), ops.zeros((bkv, d))))
            k_s[...] = (dk * scale).astype(dtype)
            v_s[...] = dv.astype(dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(k_s, dk_ref.at[rows])
            plgpu.copy_smem_to_gmem(v_s, dv_ref.at[rows])
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == 2)
        def _producer():
            ops.producer_registers()
            per = jnp.maximum(per_head, 1)  # no division by zero where no step runs

            def load(t, slot):
                g = lax.div(t, per)
                q_head = kv_head * group + g
                q0 = (cta_lo + _rem(t, per)) * bq
                rows, vec = (batch, pl.ds(q0, bq), q_head), (batch, q_head, pl.ds(q0, bq))
                plgpu.copy_gmem_to_smem(q_ref.at[rows], q_ring.at[slot], q_bars.at[slot])
                plgpu.copy_gmem_to_smem(lse_ref.at[vec], lse_ring.at[slot], lse_bars.at[slot])
                plgpu.copy_gmem_to_smem(do_ref.at[rows], do_ring.at[slot], do_bars.at[slot])
                plgpu.copy_gmem_to_smem(delta_ref.at[vec], delta_ring.at[slot], delta_bars.at[slot])

            _ring_producer(ops, group * per_head, mcs, group * nq, load, consumed)

    tiles = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    scratch = [
        plgpu.SMEM((2, bkv, d), dtype, transforms=tiles),  # K (reused for dK)
        plgpu.SMEM((2, bkv, d), dtype, transforms=tiles),  # V (reused for dV)
        plgpu.SMEM((mcs, bq, d), dtype, transforms=tiles),  # Q ring
        plgpu.SMEM((mcs, bq, d), dtype, transforms=tiles),  # dO ring
        plgpu.SMEM((mcs, bq), jnp.float32),  # LSE ring (log2)
        plgpu.SMEM((mcs, bq), jnp.float32),  # delta ring
        plgpu.Barrier(num_barriers=2),  # K landed (per warpgroup)
        plgpu.Barrier(num_barriers=2),  # V landed
        *[plgpu.Barrier(num_barriers=mcs) for _ in range(4)],  # Q, dO, LSE, delta landed
        plgpu.Barrier(num_arrivals=2, num_barriers=mcs),  # slot released by both consumers
    ]
    kv = jax.ShapeDtypeStruct(kp.shape, dtype)
    call = _kernel_call(ops, kernel, (kv, kv), scratch, (hkv, skp // (2 * bkv), b), ("heads", "kv_seq", "batch"))
    return call(qp, kp, vp, dop, lse2, delta)


def _backward_blocks(cfg: MosaicBlockSizes, d: int) -> MosaicBackwardBlockSizes | None:
    """The Mosaic backward's tiles, or None where the flash Pallas backward serves (``cfg.backward`` is a
    ``flash.BlockSizes``, or head_dim is not in ``BACKWARD_HEAD_DIMS``)."""
    if isinstance(cfg.backward, flash.BlockSizes) or d not in BACKWARD_HEAD_DIMS:
        return None
    return cfg.backward or MosaicBackwardBlockSizes()


def _emulated_backward(q, k, v, do, lse2, delta, *, causal, scale):
    """Pure-jnp twin of the two kernels' math on whole score matrices (same LSE / delta inputs, the same
    exp2, the same casts of ``p`` and ``dS`` to the input dtype before their matmuls); also float32."""
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    group, dtype, f32 = hq // hkv, q.dtype, jnp.float32
    kk, vv = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)  # [B, Sk, Hq, D]
    s = jnp.einsum("bqhd,bkhd->bhqk", q, kk, preferred_element_type=f32)
    if causal:
        s = jnp.where(tile_mask(jnp.arange(sq)[:, None], jnp.arange(sk)[None, :], shift=sk - sq, right=0), s, -jnp.inf)
    p = jnp.exp2(s * (scale * LOG2E) - lse2[..., None])  # [B, Hq, Sq, Sk]
    dp = jnp.einsum("bqhd,bkhd->bhqk", do, vv, preferred_element_type=f32)
    ds = (p * (dp - delta[..., None])).astype(dtype)
    dq = jnp.einsum("bhqk,bkhd->bqhd", ds, kk, preferred_element_type=f32) * scale
    per_kv = lambda x: x.reshape(b, sk, hkv, group, d).sum(axis=3)  # noqa: E731  [B, Sk, Hq, D] -> [B, Sk, Hkv, D]
    dk = per_kv(jnp.einsum("bhqk,bqhd->bkhd", ds, q, preferred_element_type=f32)) * scale
    dv = per_kv(jnp.einsum("bhqk,bqhd->bkhd", p.astype(dtype), do, preferred_element_type=f32))
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


def _pad_seq(x, multiple: int, axis: int, value: float = 0.0):
    """``x`` padded with ``value`` at the end of ``axis`` to a multiple of ``multiple``."""
    n = cdiv(x.shape[axis], multiple) * multiple - x.shape[axis]
    widths = [(0, n if i == axis else 0) for i in range(x.ndim)]
    return jnp.pad(x, widths, constant_values=value) if n else x


def _mosaic_backward(q, k, v, out, lse, do, dlse, *, causal, scale, blocks, impl):
    """(dq, dk, dv) by the two Mosaic kernels (``impl``: "mosaic", "interpret") or their emulation."""
    sq, sk = q.shape[1], k.shape[1]
    lse2 = jnp.where(jnp.isfinite(lse), lse * LOG2E, _LSE_EMPTY)  # [B, Hq, Sq], log2 units
    delta = jnp.einsum("bqhd,bqhd->bhq", out.astype(jnp.float32), do.astype(jnp.float32)) - dlse
    kw = dict(causal=causal, scale=scale)
    if impl == "emulate":
        return _emulated_backward(q, k, v, do, lse2, delta, **kw)
    mq = math.lcm(2 * blocks.block_q_dq, blocks.block_q_dkv)  # both kernels' query tiles divide Sqp
    mk = math.lcm(2 * blocks.block_kv_dkv, blocks.block_kv_dq)
    qp, dop = (_pad_seq(x, mq, 1) for x in (q, do))
    kp, vp = (_pad_seq(x, mk, 1) for x in (k, v))
    lse2, delta = _pad_seq(lse2, mq, 2, _LSE_EMPTY), _pad_seq(delta, mq, 2)
    kw.update(sq=sq, sk=sk, blocks=blocks, interpret=impl == "interpret")
    dq = _mosaic_dq_padded(qp, kp, vp, dop, lse2, delta, **kw)
    dk, dv = _mosaic_dkv_padded(qp, kp, vp, dop, lse2, delta, **kw)
    return dq[:, :sq], dk[:, :sk], dv[:, :sk]


@dataclasses.dataclass(frozen=True)
class MosaicKernels:
    """The Mosaic GPU kernels of one call, each callable on its own on padded operands (the block-size search
    compiles and times them one at a time; :func:`kernel_callables`).  q / do ``[B, sq_pad, Hq, D]``, k / v
    ``[B, sk_pad, Hkv, D]``, lse2 / delta ``[B, Hq, sq_pad]`` float32 with the LSE in log2 units:
    ``calls["mosaic_fwd"](q, k, v) -> (out, lse2)``, ``calls["mosaic_bwd_dq"](q, k, v, do, lse2, delta) -> dq``,
    ``calls["mosaic_bwd_dkv"](...) -> (dk, dv)`` (no backward kernels where the flash backward serves)."""

    calls: dict
    sq_pad: int
    sk_pad: int
    head_dim_pad: int


def kernel_callables(q, k, block_sizes: MosaicBlockSizes | None = None, *, causal: bool = False, interpret=False):
    """:class:`MosaicKernels` for q ``[B, Sq, Hq, D]`` and k / v ``[B, Sk, Hkv, D]`` (arrays or
    ShapeDtypeStructs) with ``block_sizes`` (default :meth:`MosaicBlockSizes.default`); ``interpret=True`` runs
    them in the Mosaic GPU interpreter."""
    args, cfg = _validate(q, k, k, causal, None, block_sizes, allow_fp32=False)
    blocks = _backward_blocks(cfg, q.shape[-1])
    mq, mk = 2 * cfg.block_q, cfg.block_kv
    if blocks is not None:  # the same padding as _forward and _mosaic_backward, to a length all three accept
        mq = math.lcm(mq, 2 * blocks.block_q_dq, blocks.block_q_dkv)
        mk = math.lcm(mk, 2 * blocks.block_kv_dkv, blocks.block_kv_dq)
    kw = dict(sq=q.shape[1], sk=k.shape[1], causal=args.causal, scale=float(args.scale), interpret=interpret)
    calls = {"mosaic_fwd": functools.partial(_mosaic_forward_padded, cfg=cfg, **kw)}
    if blocks is not None:
        calls["mosaic_bwd_dq"] = functools.partial(_mosaic_dq_padded, blocks=blocks, **kw)
        calls["mosaic_bwd_dkv"] = functools.partial(_mosaic_dkv_padded, blocks=blocks, **kw)
    return MosaicKernels(calls, cdiv(q.shape[1], mq) * mq, cdiv(k.shape[1], mk) * mk, q.shape[-1])


# ------------------------------------------------------------------------------------------ custom VJP
@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _attention_vjp(q, k, v, causal, scale, cfg, impl):
    """``(out, lse)``: the forward is the Mosaic kernel; the backward the Mosaic dq and dkv kernels (the flash
    Pallas kernels for head_dim 256 or where ``cfg.backward`` is a ``flash.BlockSizes``)."""
    return _forward(q, k, v, causal, scale, cfg, impl)


def _attention_vjp_fwd(q, k, v, causal, scale, cfg, impl):
    out, lse = _forward(q, k, v, causal, scale, cfg, impl)
    return (out, lse), (q, k, v, out, lse)


def _attention_vjp_bwd(causal, scale, cfg, impl, res, cts):
    q, k, v, out, lse = res
    do, dlse = cts
    blocks = _backward_blocks(cfg, q.shape[-1])
    if blocks is not None:
        return _mosaic_backward(q, k, v, out, lse, do, dlse, causal=causal, scale=scale, blocks=blocks, impl=impl)
    # The flash backward: impl="mosaic" always compiles it (it also runs under a cross-platform export on CPU);
    # the CPU test paths run the same kernels in Pallas interpret mode when no GPU is present.
    return flash.flash_backward(
        q,
        k,
        v,
        out,
        lse,
        do,
        AttnArgs(causal=causal, scale=scale),
        dlse=dlse,
        block_sizes=cfg.backward,
        interpret=False if impl == "mosaic" else None,
    )


_attention_vjp.defvjp(_attention_vjp_fwd, _attention_vjp_bwd)


def _mosaic_attention(q, k, v, *, causal=False, scale=None, block_sizes=None, impl="mosaic", return_lse=False):
    """Internal entry with the implementation switch (tests use ``impl="emulate"`` / ``"interpret"``;
    ``"emulate"`` also accepts float32).  ``return_lse`` gives ``(out, lse [B, Hq, Sq])``, both
    differentiable."""
    if impl not in _IMPLS:
        raise ValueError(f"impl must be one of {_IMPLS}, got {impl!r}")
    args, cfg = _validate(q, k, v, causal, scale, block_sizes, allow_fp32=(impl == "emulate"))
    out, lse = _attention_vjp(q, k, v, args.causal, float(args.scale), cfg, impl)
    return (out, lse) if return_lse else out


def mosaic_attention(
    q, k, v, *, causal: bool = False, scale: float | None = None, block_sizes: MosaicBlockSizes | None = None
):
    """Flash attention on Hopper: q ``[B, Sq, Hq, D]``, k/v ``[B, Sk, Hkv, D]``, bf16/fp16, D in
    ``HEAD_DIMS``; bottom-right ``causal``; ``scale`` defaults to ``1/sqrt(D)``.  Differentiable (the
    backward is the Mosaic dq and dkv kernels; at head_dim 256 the flash Pallas kernels).  Raises
    ValueError/TypeError for bad inputs and RuntimeError when no Hopper GPU is present."""
    args, cfg = _validate(q, k, v, causal, scale, block_sizes, allow_fp32=False)
    reason = _mosaic_import_error() or _device_reason(current_target(q))
    if reason is not None:
        raise RuntimeError(f"mosaic_attention cannot run here: {reason}")
    return _attention_vjp(q, k, v, args.causal, float(args.scale), cfg, "mosaic")[0]
