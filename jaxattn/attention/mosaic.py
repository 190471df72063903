"""``mosaic`` backend: flash attention for Hopper GPUs (Pallas Mosaic GPU forward, flash Pallas backward).

q ``[B, Sq, Hq, D]``, k/v ``[B, Sk, Hkv, D]``, bf16 or fp16, ``D`` in ``HEAD_DIMS``; bottom-right causal,
GQA/MQA, any sequence length (padded inside; a row that sees no key gives zeros).  The forward is a
FlashAttention-3 kernel (Shah et al. 2024, §3.1: wgmma + TMA, two consumer warpgroups in ping-pong and a
producer warpgroup streaming K/V) that saves ``out`` and the log-sum-exp; the backward is
:func:`jaxattn.attention.flash.flash_backward` (the ``dq`` and in-kernel-GQA ``dkv`` Pallas kernels), so a
training step on Hopper runs Pallas kernels both ways.  No segment ids, window or softcap (``supports``
declines)::

    out = mosaic_attention(q, k, v, causal=True)            # needs a Hopper GPU

Tests run the same kernel body on CPU (``impl="interpret"``: the Mosaic GPU interpreter; ``"emulate"``:
a pure-jnp twin of its tile loop) and the backward kernels in Pallas interpret mode; how the kernel, its
barrier protocol and the interpreter substitutions work is written out in ``parity_tests/test_mosaic.py``.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from . import flash
from .args import AttnArgs, normalize
from .target import Target, current_target
from .tiling import LN2, LOG2E, cdiv, tile_mask

__all__ = ["HEAD_DIMS", "MosaicBlockSizes", "supports", "attention", "mosaic_attention"]

HEAD_DIMS = (64, 128, 256)
DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_IMPLS = ("mosaic", "interpret", "emulate")
_M_INIT = -1e30  # finite "minus infinity" for the running max (log2 units): no inf - inf = NaN
_L_MIN = 1e-30  # clamp for the softmax denominator: an empty row gives 0 / 1e-30 = 0
_SMEM_BYTES = 227 * 1024  # usable shared memory per CTA on H100/H200


# ------------------------------------------------------------------------------------------ config
@dataclasses.dataclass(frozen=True)
class MosaicBlockSizes:
    """Tile sizes and pipeline depth of the Mosaic forward kernel, and the backward's block sizes.

    * ``block_q``: query rows per compute warpgroup (a CTA has two, so it covers ``2 * block_q`` rows);
      a multiple of 64 (wgmma M).
    * ``block_kv``: keys per pipeline step; a multiple of 64.
    * ``max_concurrent_steps``: depth of the K/V TMA ring (SMEM slots), >= 2.
    * ``backward``: :class:`flash.BlockSizes` of the flash backward kernels (None: flash's default).
    """

    block_q: int = 64
    block_kv: int = 128
    max_concurrent_steps: int = 2
    backward: flash.BlockSizes | None = None

    def __post_init__(self):
        for name in ("block_q", "block_kv", "max_concurrent_steps"):
            val = getattr(self, name)
            if not isinstance(val, (int, np.integer)) or isinstance(val, bool):
                raise TypeError(f"MosaicBlockSizes.{name} must be an int, got {val!r} of type {type(val).__name__}")
        for name in ("block_q", "block_kv"):
            val = getattr(self, name)
            if val < 64 or val % 64:
                raise ValueError(f"MosaicBlockSizes.{name} must be a positive multiple of 64 (wgmma tile), got {val}")
        if self.max_concurrent_steps < 2:
            raise ValueError(f"MosaicBlockSizes.max_concurrent_steps must be >= 2, got {self.max_concurrent_steps}")
        if self.backward is not None and not isinstance(self.backward, flash.BlockSizes):
            raise TypeError(
                f"MosaicBlockSizes.backward must be None or a flash.BlockSizes, got {type(self.backward).__name__}"
            )

    @classmethod
    def default(cls, head_dim: int) -> MosaicBlockSizes:
        """Defaults that fit in shared memory and registers: 64x128 tiles, 64x64 for head_dim 256."""
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
    compute capability 9.x, causal on a CUDA runtime with the known ptxas bug, and a call whose backward
    the flash kernels decline.
    """
    target = current_target(q)  # read once, handed to the flash backward's check
    limit = _limit(q, args)
    reason = (
        (limit[1] if limit else None)
        or _mosaic_import_error()
        or _device_reason(target)
        or _cuda_causal_reason(args.causal)
    )
    if reason is None:
        bwd = flash.supports(q, k, v, args, target=target)
        reason = None if bwd is None else f"its backward (the flash kernels) declines: {bwd}"
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
    need = block_sizes.smem_bytes(d, 2)
    if need > _SMEM_BYTES:
        raise ValueError(
            f"block_sizes {block_sizes} need {need} bytes of shared memory for head_dim {d}, "
            f"more than the {_SMEM_BYTES} available; use a smaller block_kv or "
            f"max_concurrent_steps"
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


def _tile_mask(iota, q_start, kv_start, shape, *, sq: int, sk: int, causal: bool):
    """Visibility of a ``shape = (rows, block_kv)`` score tile (:func:`tiling.tile_mask`). With causal the
    bottom-right mask already hides padded keys from every real query row, so one comparison suffices."""
    kv_pos = iota(shape, 1) + kv_start
    if causal:
        return tile_mask(iota(shape, 0) + (q_start + (sk - sq)), kv_pos, right=0)  # q_pos: absolute positions
    return tile_mask(None, kv_pos, k_len=sk)


def _softmax_update(qk, m_i, l_i, acc, c: float, dtype):
    """One online-softmax step on an fp32 score tile ``qk`` (masked entries ``-inf``). ``m_i`` is kept in
    log2 units scaled by ``c = scale * log2(e)`` so that ``p = exp2(qk * c - m)`` is one FMA."""
    m_new = jnp.maximum(m_i, qk.max(axis=1) * c)
    alpha = jnp.exp2(m_i - m_new)
    p = jnp.exp2(qk * c - lax.broadcast_in_dim(m_new, qk.shape, [0]))
    acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
    l_i = l_i * alpha + p.sum(axis=1)
    return p.astype(dtype), m_new, l_i, acc


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
    bq, bkv, mcs = cfg.block_q, cfg.block_kv, cfg.max_concurrent_steps
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
        cta_base = lax.axis_index("q_seq") * (2 * bq)
        cta_steps, _ = bounds(cta_base, 2 * bq)  # = steps of warpgroup 1, >= steps of warpgroup 0

        def sched_sync():
            plgpu.barrier_arrive(sched)
            plgpu.barrier_wait(sched)

        @pl.when(wg < 2)
        def _consumer():
            if not interpret:
                plgpu.set_max_registers(232, action="increase")
            qo_smem = qo_smem2.at[wg]
            lse_smem = lse_smem2.at[wg]
            q_base = cta_base + wg * bq
            steps, full = bounds(q_base, bq)

            plgpu.copy_gmem_to_smem(q_ref.at[batch, pl.ds(q_base, bq), head], qo_smem, q_bars.at[wg])
            plgpu.barrier_wait(q_bars.at[wg])
            m_i = layout_cast(jnp.full((bq,), _M_INIT, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
            l_i = layout_cast(jnp.full((bq,), 0.0, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
            acc = layout_cast(jnp.full((bq, d), 0.0, jnp.float32), plgpu.Layout.WGMMA)

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
                plgpu.set_max_registers(40, action="decrease")
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


# ------------------------------------------------------------------------------------------ custom VJP
@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _attention_vjp(q, k, v, causal, scale, cfg, impl):
    """``(out, lse)``: the forward is the Mosaic kernel, the backward the flash Pallas kernels."""
    return _forward(q, k, v, causal, scale, cfg, impl)


def _attention_vjp_fwd(q, k, v, causal, scale, cfg, impl):
    out, lse = _forward(q, k, v, causal, scale, cfg, impl)
    return (out, lse), (q, k, v, out, lse)


def _attention_vjp_bwd(causal, scale, cfg, impl, res, cts):
    q, k, v, out, lse = res
    do, dlse = cts
    # impl="mosaic" always compiles the backward (it also runs under a cross-platform export on CPU);
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
    backward is the flash Pallas kernels).  Raises ValueError/TypeError for bad inputs and RuntimeError
    when no Hopper GPU is present."""
    args, cfg = _validate(q, k, v, causal, scale, block_sizes, allow_fp32=False)
    reason = _mosaic_import_error() or _device_reason(current_target(q))
    if reason is not None:
        raise RuntimeError(f"mosaic_attention cannot run here: {reason}")
    return _attention_vjp(q, k, v, args.causal, float(args.scale), cfg, "mosaic")[0]
