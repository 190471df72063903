"""Flash-attention forward for Hopper GPUs written with Pallas Mosaic GPU (wgmma + TMA, FA3-style).

What it does
------------
``mosaic_attention(q, k, v, causal=..., scale=...)`` computes softmax(scale * q k^T) v in the JAX layout
(q ``[B, Sq, Hq, D]``, k/v ``[B, Sk, Hkv, D]``), bf16/fp16 inputs, fp32 accumulation, with

* bottom-right causal masking (query ``i`` sees key ``j`` iff ``j <= i + Sk - Sq``; CONVENTIONS §4);
* GQA/MQA: q head ``h`` reads kv head ``h // (Hq // Hkv)`` straight from HBM (K/V are never repeated);
* any sequence length: q is zero-padded to a multiple of ``2 * block_q`` and k/v to a multiple of
  ``block_kv`` outside the kernel; padded keys are masked inside the kernel (only in the last kv block,
  or by the causal mask, which already hides them), padded query rows are sliced off;
* a query row that sees no key (causal with ``Sq > Sk``) gives zeros and log-sum-exp ``-inf``, never NaN
  (the running max starts at a finite ``-1e30`` and ``l`` is clamped before the division).

Kernel structure (hand-written, because JAX's own ``attention_mgpu`` op has no scale, no bottom-right
causal for ``Sq != Sk``, no padding and no causal backward): one CTA per (q head, ``2 * block_q`` query
rows, batch) with three warpgroups. Warpgroups 0 and 1 each own ``block_q`` query rows: Q tile -> SMEM by
TMA, then for every kv block ``S = Q K^T`` (wgmma, fp32), online softmax in registers (exp2 with the scale
folded into ``log2(e) * scale``), ``acc += P V`` (wgmma). Warpgroup 2 is the producer: it streams K/V
blocks by TMA into a ring of ``max_concurrent_steps`` SMEM slots and re-fills a slot once both consumers
arrived on its "consumed" barrier. A shared "schedule" barrier keeps the two consumers in lock-step
(ping-pong, FA3) which also makes it safe for the consumer that finished early under causal masking to
keep arriving on the consumed barriers (epilogue loop) until the producer has streamed every block the
other consumer needs. The kv loop is split in an unmasked fast part and a masked part.

The per-tile math (``_kv_bounds``, ``_tile_mask``, ``_softmax_update``, ``_finalize``) is written once
with operations that exist both on Mosaic GPU register arrays and on ordinary ``jnp`` arrays, so it runs
in three ways:

* ``impl="mosaic"``: the real kernel (needs a Hopper GPU);
* ``impl="interpret"``: the same kernel body run by JAX's Mosaic GPU *interpreter* on CPU (threads,
  barriers and TMA are simulated). The interpreter lacks ``layout_cast``, layout-annotated iotas,
  ``wgmma`` on transposed refs and ``run_state``, so under it those four things are replaced by their
  plain equivalents (identity, ``lax.broadcasted_iota``, ``jnp.dot`` on SMEM values, ``acc + ...``) and
  the two scheduling hints (``set_max_registers``, ``optimization_barrier``) are skipped; everything
  else (loop bounds, the barrier protocol, TMA copies, masking, softmax, stores) is the kernel;
* ``impl="emulate"``: a pure-jnp, vmapped tile loop with the same bounds and tile math (fast, also
  accepts float32, so the padding/masking/finalize/backward can be checked against float64 tightly).

Backward: there is no Mosaic backward. ``mosaic_attention`` is a ``jax.custom_vjp`` whose forward is the
kernel (saving ``out`` and the log-sum-exp) and whose backward is a blockwise pure-JAX recompute
(``_blockwise_backward``, FlashAttention-2 equations: ``P = exp(S - lse)``, ``dV = P^T dO``,
``dS = P * (dO V^T - rowsum(dO * O))``, ``dQ = dS K``, ``dK = dS^T Q``) that scans over kv blocks, keeps
matmul operands in the input dtype with fp32 accumulation, and sums GQA groups without repeating K/V.
(``jaxattn.attention.flash`` keeps its backward private to its own ``custom_vjp`` -- its tile helpers take
its own config and segment ids -- so it is not reused; the recompute here keeps this module independent.
It is O(Sq * block_kv_bwd) in memory per (batch, kv head group) and runs as XLA matmuls, so training with
this backend is forward-fast but not backward-fast.)

Import cost: ``jax.experimental.pallas.mosaic_gpu`` is imported lazily inside functions, so importing
this module never fails on CPU or on a jax without Mosaic GPU; ``supports`` then reports why it declines.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = [
    "HEAD_DIMS",
    "MosaicBlockSizes",
    "supports",
    "attention",
    "mosaic_attention",
    "mosaic_attention_reference",
]

HEAD_DIMS = (64, 128, 256)
DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_IMPLS = ("mosaic", "interpret", "emulate")
_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)
_M_INIT = -1e30  # finite "minus infinity" for the running max (log2 units): no inf - inf = NaN
_L_MIN = 1e-30  # clamp for the softmax denominator: an empty row gives 0 / 1e-30 = 0
_SMEM_BYTES = 227 * 1024  # usable shared memory per CTA on H100/H200


# ------------------------------------------------------------------------------------------ config
@dataclasses.dataclass(frozen=True)
class MosaicBlockSizes:
    """Tile sizes and pipeline depth of the Mosaic kernel.

    * ``block_q``: query rows per compute warpgroup (a CTA has two, so it covers ``2 * block_q`` rows);
      a multiple of 64 (wgmma M).
    * ``block_kv``: keys per pipeline step; a multiple of 64.
    * ``max_concurrent_steps``: depth of the K/V TMA ring (SMEM slots), >= 2.
    * ``block_kv_bwd``: keys per step of the blockwise pure-JAX backward.
    """

    block_q: int = 64
    block_kv: int = 128
    max_concurrent_steps: int = 2
    block_kv_bwd: int = 512

    def __post_init__(self):
        for name in ("block_q", "block_kv", "max_concurrent_steps", "block_kv_bwd"):
            val = getattr(self, name)
            if not isinstance(val, (int, np.integer)) or isinstance(val, bool):
                raise TypeError(f"MosaicBlockSizes.{name} must be an int, got {val!r} "
                                f"of type {type(val).__name__}")
        for name in ("block_q", "block_kv"):
            val = getattr(self, name)
            if val < 64 or val % 64:
                raise ValueError(f"MosaicBlockSizes.{name} must be a positive multiple of 64 "
                                 f"(wgmma tile), got {val}")
        if self.max_concurrent_steps < 2:
            raise ValueError(f"MosaicBlockSizes.max_concurrent_steps must be >= 2, "
                             f"got {self.max_concurrent_steps}")
        if self.block_kv_bwd < 1:
            raise ValueError(f"MosaicBlockSizes.block_kv_bwd must be >= 1, got {self.block_kv_bwd}")

    @classmethod
    def default(cls, head_dim: int) -> "MosaicBlockSizes":
        """Defaults that fit in shared memory and registers: 64x128 tiles, 64x64 for head_dim 256."""
        return cls(block_kv=64) if head_dim > 128 else cls()

    def smem_bytes(self, head_dim: int, itemsize: int = 2) -> int:
        """Shared memory the forward kernel allocates for this config (Q/O tiles, K/V ring, lse)."""
        qo = 2 * self.block_q * head_dim * itemsize
        kv = 2 * self.max_concurrent_steps * self.block_kv * head_dim * itemsize
        return qo + kv + 2 * self.block_q * 4 + 1024  # + barriers / alignment slack


# ------------------------------------------------------------------------------------------ support
def _mosaic_import_error() -> Optional[str]:
    try:
        import jax.experimental.pallas.mosaic_gpu  # noqa: F401
    except Exception as e:  # ImportError, or anything a half-installed jax raises
        return (f"jax {jax.__version__} has no usable jax.experimental.pallas.mosaic_gpu "
                f"({type(e).__name__}: {e})")
    return None


def _device_reason(x=None) -> Optional[str]:
    """None when the device running ``x`` (or the default device) is a Hopper GPU (compute capability 9.x)."""
    try:
        from jaxattn.attention._common import gpu_compute_capability, platform_of
        plat = platform_of(x)
        cc = gpu_compute_capability(x)
    except ImportError:  # pragma: no cover - _common is part of the package
        dev = jax.devices()[0]
        plat = "gpu" if dev.platform in ("gpu", "cuda") else dev.platform
        cc_s = getattr(dev, "compute_capability", None)
        cc = tuple(int(t) for t in str(cc_s).split(".")[:2]) if cc_s else None
    if plat != "gpu":
        return f"needs a Hopper GPU (compute capability 9.x), found platform {plat!r}"
    if cc is None:
        return "needs a Hopper GPU (compute capability 9.x), found a GPU of unknown compute capability"
    if cc[0] != 9:
        return (f"needs a Hopper GPU (compute capability 9.x, wgmma), found compute capability "
                f"{cc[0]}.{cc[1]}")
    return None


def _cuda_causal_reason(causal: bool) -> Optional[str]:
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
        return (f"causal masking is miscompiled by ptxas on CUDA runtime {ver} "
                f"(12.8.0 <= version < 12.9.1)")
    return None


def _feature_reason(args) -> Optional[str]:
    if getattr(args, "q_segment_ids", None) is not None or getattr(args, "kv_segment_ids", None) is not None:
        return "segment_ids are not supported by the mosaic kernel"
    window = getattr(args, "window", None)
    if window is not None and tuple(window) not in ((None, None),) and not (
            getattr(args, "causal", False) and tuple(window) == (None, 0)):
        return f"window={tuple(window)!r} is not supported by the mosaic kernel (only window=None)"
    if getattr(args, "softcap", None) is not None:
        return f"softcap={args.softcap!r} is not supported by the mosaic kernel (only softcap=None)"
    return None


def _shape_reason(q, k, v) -> Optional[str]:
    dt = jnp.dtype(q.dtype)
    if dt not in DTYPES or jnp.dtype(k.dtype) != dt or jnp.dtype(v.dtype) != dt:
        return (f"dtype {q.dtype}/{k.dtype}/{v.dtype} not supported (q, k, v must all be bfloat16 "
                f"or all float16)")
    d = q.shape[-1]
    if d not in HEAD_DIMS or k.shape[-1] != d or v.shape[-1] != d:
        return f"head_dim {d} not in {HEAD_DIMS}"
    return None


def supports(q, k, v, args) -> Optional[str]:
    """None when the Mosaic kernel can serve this call, else a one-line reason.

    Declines: segment ids, a sliding window, softcap, dtype other than bf16/fp16, head_dim not in
    ``HEAD_DIMS``, a jax without ``jax.experimental.pallas.mosaic_gpu``, no GPU or a GPU that is not
    compute capability 9.x, causal on a CUDA runtime with the known ptxas bug.
    """
    return (_feature_reason(args) or _shape_reason(q, k, v) or _mosaic_import_error()
            or _device_reason(q) or _cuda_causal_reason(bool(getattr(args, "causal", False))))


def attention(q, k, v, args):
    """Backend entry point (``jaxattn.attention`` contract): out ``[B, Sq, Hq, D]`` in ``q.dtype``."""
    reason = supports(q, k, v, args)
    if reason is not None:
        raise ValueError(f"mosaic attention backend cannot serve this call: {reason}")
    return mosaic_attention(q, k, v, causal=bool(args.causal), scale=float(args.scale))


# ------------------------------------------------------------------------------------------ validation
def _validate(q, k, v, causal, scale, block_sizes, *, allow_fp32: bool):
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise TypeError(f"{name} must be an array, got {type(x).__name__}")
        if len(x.shape) != 4:
            raise ValueError(f"{name} must have rank 4 ([B, S, H, D], the JAX layout), "
                             f"got shape {tuple(x.shape)}")
    b, sq, hq, d = q.shape
    bk, sk, hkv, dk = k.shape
    if tuple(v.shape) != tuple(k.shape):
        raise ValueError(f"v shape {tuple(v.shape)} must equal k shape {tuple(k.shape)}")
    if bk != b:
        raise ValueError(f"k batch {bk} must equal q batch {b} (q {tuple(q.shape)}, k {tuple(k.shape)})")
    if dk != d:
        raise ValueError(f"k head_dim {dk} must equal q head_dim {d}")
    if min(b, sq, sk, hq, hkv) < 1:
        raise ValueError(f"empty dimension in q {tuple(q.shape)} / k {tuple(k.shape)}")
    if hq % hkv:
        raise ValueError(f"q heads ({hq}) must be a multiple of kv heads ({hkv}) for GQA")
    dtypes = DTYPES + ((jnp.dtype(jnp.float32),) if allow_fp32 else ())
    dt = jnp.dtype(q.dtype)
    if dt not in dtypes or jnp.dtype(k.dtype) != dt or jnp.dtype(v.dtype) != dt:
        raise TypeError(f"q/k/v dtypes {q.dtype}/{k.dtype}/{v.dtype} not supported: all three must be "
                        f"the same, one of {tuple(str(t) for t in dtypes)}")
    if d not in HEAD_DIMS:
        raise ValueError(f"head_dim {d} not supported by the mosaic kernel, accepted: {HEAD_DIMS}")
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal must be a bool, got {causal!r}")
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    try:
        scale = float(scale)
    except (TypeError, ValueError):
        raise TypeError(f"scale must be a positive float or None, got {scale!r}") from None
    if not (scale > 0 and math.isfinite(scale)):
        raise ValueError(f"scale must be a positive finite float, got {scale}")
    if block_sizes is None:
        block_sizes = MosaicBlockSizes.default(d)
    if not isinstance(block_sizes, MosaicBlockSizes):
        raise TypeError(f"block_sizes must be a MosaicBlockSizes or None, got {type(block_sizes).__name__}")
    need = block_sizes.smem_bytes(d, 2)
    if need > _SMEM_BYTES:
        raise ValueError(f"block_sizes {block_sizes} need {need} bytes of shared memory for head_dim {d}, "
                         f"more than the {_SMEM_BYTES} available; use a smaller block_kv or "
                         f"max_concurrent_steps")
    return bool(causal), scale, block_sizes


# ------------------------------------------------------------------------------------------ tile math
# Shared by the Mosaic kernel and the jnp emulation: only ops that Mosaic GPU lowers on register arrays.
def _cdiv(a, b: int):
    if isinstance(a, (int, np.integer)):
        return -(-int(a) // b)
    a = jnp.asarray(a)
    return lax.div(a + jnp.asarray(b - 1, a.dtype), jnp.asarray(b, a.dtype))


def _rem(a, b: int):
    return lax.rem(a, jnp.asarray(b, jnp.asarray(a).dtype))


def _kv_bounds(q_base, rows: int, *, sq: int, sk: int, block_kv: int, causal: bool):
    """(steps, full) for query rows ``[q_base, q_base + rows)``: kv blocks ``[0, steps)`` hold every key
    any of these rows may see, blocks ``[0, full)`` are visible to all of them without a mask.
    ``q_base`` may be a traced int32 scalar."""
    nkv = _cdiv(sk, block_kv)
    if not causal:
        return nkv, sk // block_kv  # only the last block can hold padded keys
    offset = sk - sq  # bottom-right: row i sees keys j <= i + offset
    hi = jnp.maximum(q_base + (rows + offset), 0)  # exclusive end of the keys the last row sees
    steps = jnp.minimum(_cdiv(hi, block_kv), nkv)
    lo = jnp.maximum(q_base + (offset + 1), 0)  # exclusive end of the keys the first row sees
    full = jnp.minimum(lax.div(lo, jnp.asarray(block_kv, lo.dtype)), steps)
    return steps, full


def _tile_mask(iota, q_start, kv_start, shape, *, sq: int, sk: int, causal: bool):
    """Visibility of a ``shape = (rows, block_kv)`` score tile. With causal the bottom-right mask already
    hides padded keys from every real query row, so one comparison suffices either way."""
    kv_ids = iota(shape, 1) + kv_start
    if causal:
        q_ids = iota(shape, 0) + (q_start + (sk - sq))
        return kv_ids <= q_ids
    return kv_ids < sk


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
    lse2 = m_i + jnp.log(l_safe) * (1.0 / _LN2)
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
    c = scale * _LOG2E
    bounds = functools.partial(_kv_bounds, sq=sq, sk=sk, block_kv=bkv, causal=causal)
    tmask = functools.partial(_tile_mask, sq=sq, sk=sk, causal=causal)

    if interpret:  # substitutes for what the interpreter lacks (see module docstring)
        layout_cast = lambda x, layout: x  # noqa: E731
        iota = lambda shape, dim: lax.broadcasted_iota(jnp.int32, shape, dim)  # noqa: E731
    else:
        layout_cast = plgpu.layout_cast
        iota = lambda shape, dim: plgpu.broadcasted_iota(  # noqa: E731
            jnp.int32, shape, dim, layout=plgpu.Layout.WGMMA)

    def qk_matmul(q_smem, k_smem, during):
        if interpret:
            during()
            return jnp.dot(q_smem[...], k_smem[...].T, preferred_element_type=jnp.float32)

        def body(acc_ref):
            plgpu.wgmma(acc_ref, q_smem, plgpu.transpose_ref(k_smem, (1, 0)))
            during()  # runs while the wgmma is in flight
            return acc_ref[...]
        return pl.run_scoped(body, plgpu.ACC((bq, bkv), jnp.float32))

    def pv_matmul(acc, p16, v_smem, during):
        if interpret:
            during()
            return acc + jnp.dot(p16, v_smem[...], preferred_element_type=jnp.float32)

        def body(acc_ref):
            plgpu.wgmma(acc_ref, p16, v_smem)
            during()
        return pl.run_state(body)(plgpu.ACC.init(acc))

    def kernel(q_ref, k_ref, v_ref, o_ref, lse_ref, qo_smem2, k_smem, v_smem, lse_smem2,
               k_bars, v_bars, q_bars, k_consumed, v_consumed, sched):
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

            for i in range(mcs):
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
        plgpu.SMEM((2, bq, d), dtype, transforms=tiles),      # Q tile, reused for O
        plgpu.SMEM((mcs, bkv, d), dtype, transforms=tiles),   # K ring
        plgpu.SMEM((mcs, bkv, d), dtype, transforms=tiles),   # V ring
        plgpu.SMEM((2, bq), jnp.float32),                     # lse
        plgpu.Barrier(num_barriers=mcs),                      # K landed
        plgpu.Barrier(num_barriers=mcs),                      # V landed
        plgpu.Barrier(num_barriers=2),                        # Q landed
        plgpu.Barrier(num_arrivals=2, num_barriers=mcs),      # K slot consumed
        plgpu.Barrier(num_arrivals=2, num_barriers=mcs),      # V slot consumed
        plgpu.Barrier(num_arrivals=2),                        # schedule (ping-pong)
    ]
    kwargs = dict(interpret=_interpret_params()) if interpret else dict(
        compiler_params=plgpu.CompilerParams(approx_math=True))
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
    c = scale * _LOG2E
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
                qk = jnp.where(_tile_mask(iota, q_base, t * bkv, (bq, bkv), sq=sq, sk=sk, causal=causal),
                               qk, -jnp.inf)
            p16, m_i, l_i, acc = _softmax_update(qk, m_i, l_i, acc, c, dtype)
            return acc + jnp.dot(p16, v_t, preferred_element_type=jnp.float32), m_i, l_i

        carry = (jnp.zeros((bq, d), jnp.float32), jnp.full((bq,), _M_INIT, jnp.float32),
                 jnp.zeros((bq,), jnp.float32))
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
    sqp = _cdiv(sq, 2 * cfg.block_q) * 2 * cfg.block_q
    skp = _cdiv(sk, cfg.block_kv) * cfg.block_kv
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
    lse = jnp.where(lse2 > 0.5 * _M_INIT, lse2 * _LN2, -jnp.inf)
    return out, lse


# ------------------------------------------------------------------------------------------ backward
@functools.partial(jax.jit, static_argnames=("causal", "scale", "block_kv"))
def _blockwise_backward(q, k, v, out, lse, do, *, causal, scale, block_kv):
    """Recompute-based FlashAttention-2 backward in pure JAX, scanning over kv blocks of ``block_kv`` keys.
    ``lse`` is [B, Hq, Sq] (natural log, -inf for empty rows). Matmul operands stay in the input dtype,
    accumulation and the softmax algebra are fp32. GQA: q heads are grouped per kv head, dK/dV are summed
    over the group inside the einsum (K/V are never repeated)."""
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    g = hq // hkv
    dtype = q.dtype
    f32 = jnp.float32
    bk = max(1, min(block_kv, sk))
    nb = _cdiv(sk, bk)
    skp = nb * bk
    pad = ((0, 0), (0, skp - sk), (0, 0), (0, 0))
    kb = jnp.pad(k, pad).reshape(b, nb, bk, hkv, d).swapaxes(0, 1)
    vb = jnp.pad(v, pad).reshape(b, nb, bk, hkv, d).swapaxes(0, 1)
    qg = q.reshape(b, sq, hkv, g, d)
    dog = do.astype(dtype).reshape(b, sq, hkv, g, d)
    delta = jnp.sum(do.astype(f32) * out.astype(f32), axis=-1)  # [B, Sq, Hq]
    delta = delta.reshape(b, sq, hkv, g).transpose(0, 2, 3, 1)[..., None]  # [B, Hkv, G, Sq, 1]
    lse = lse.reshape(b, hkv, g, sq)
    lse_safe = jnp.where(jnp.isfinite(lse), lse, 0.0)[..., None]
    q_pos = jnp.arange(sq)[:, None]

    def body(dq, xs):
        j, k_j, v_j = xs
        kv_pos = j * bk + jnp.arange(bk)[None, :]
        vis = kv_pos < sk
        if causal:
            vis = vis & (kv_pos <= q_pos + (sk - sq))
        s = jnp.einsum("bqhgd,bkhd->bhgqk", qg, k_j, preferred_element_type=f32) * scale
        p = jnp.where(vis, jnp.exp(s - lse_safe), 0.0)
        dv_j = jnp.einsum("bhgqk,bqhgd->bkhd", p.astype(dtype), dog, preferred_element_type=f32)
        dp = jnp.einsum("bqhgd,bkhd->bhgqk", dog, v_j, preferred_element_type=f32)
        ds = (p * (dp - delta)).astype(dtype)
        dq = dq + jnp.einsum("bhgqk,bkhd->bqhgd", ds, k_j, preferred_element_type=f32)
        dk_j = jnp.einsum("bhgqk,bqhgd->bkhd", ds, qg, preferred_element_type=f32)
        return dq, (dk_j, dv_j)

    dq0 = jnp.zeros((b, sq, hkv, g, d), f32)
    dq, (dk, dv) = lax.scan(body, dq0, (jnp.arange(nb), kb, vb))
    dk = dk.swapaxes(0, 1).reshape(b, skp, hkv, d)[:, :sk] * scale
    dv = dv.swapaxes(0, 1).reshape(b, skp, hkv, d)[:, :sk]
    return ((dq * scale).reshape(b, sq, hq, d).astype(dtype), dk.astype(k.dtype), dv.astype(v.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _attention_vjp(q, k, v, causal, scale, cfg, impl):
    return _forward(q, k, v, causal, scale, cfg, impl)[0]


def _attention_vjp_fwd(q, k, v, causal, scale, cfg, impl):
    out, lse = _forward(q, k, v, causal, scale, cfg, impl)
    return out, (q, k, v, out, lse)


def _attention_vjp_bwd(causal, scale, cfg, impl, res, do):
    q, k, v, out, lse = res
    return _blockwise_backward(q, k, v, out, lse, do, causal=causal, scale=scale, block_kv=cfg.block_kv_bwd)


_attention_vjp.defvjp(_attention_vjp_fwd, _attention_vjp_bwd)


def _mosaic_attention(q, k, v, *, causal=False, scale=None, block_sizes=None, impl="mosaic",
                      return_lse=False):
    """Internal entry with the implementation switch (tests use ``impl="emulate"`` / ``"interpret"``;
    ``"emulate"`` also accepts float32). ``return_lse`` gives (out, lse [B, Hq, Sq]) without a VJP."""
    if impl not in _IMPLS:
        raise ValueError(f"impl must be one of {_IMPLS}, got {impl!r}")
    causal, scale, cfg = _validate(q, k, v, causal, scale, block_sizes, allow_fp32=(impl == "emulate"))
    if return_lse:
        return _forward(q, k, v, causal, scale, cfg, impl)
    return _attention_vjp(q, k, v, causal, scale, cfg, impl)


def mosaic_attention(q, k, v, *, causal: bool = False, scale: Optional[float] = None,
                     block_sizes: Optional[MosaicBlockSizes] = None):
    """Flash attention on Hopper (Pallas Mosaic GPU). q ``[B, Sq, Hq, D]``, k/v ``[B, Sk, Hkv, D]``,
    bf16 or fp16, D in ``HEAD_DIMS``; ``causal`` is bottom-right aligned; ``scale`` defaults to
    ``1/sqrt(D)``. Differentiable (backward: blockwise pure-JAX recompute from the saved lse).
    Raises ValueError/TypeError for bad inputs and RuntimeError when no Hopper GPU is present."""
    causal, scale, cfg = _validate(q, k, v, causal, scale, block_sizes, allow_fp32=False)
    reason = _mosaic_import_error() or _device_reason(q)
    if reason is not None:
        raise RuntimeError(f"mosaic_attention cannot run here: {reason}")
    return _attention_vjp(q, k, v, causal, scale, cfg, "mosaic")


def mosaic_attention_reference(q, k, v, *, causal: bool = False, scale: Optional[float] = None):
    """Plain fp32 softmax attention with the same contract (bottom-right causal, GQA, empty rows -> 0),
    computed in float32 and returned in ``q.dtype``."""
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    qf = q.astype(jnp.float32).reshape(b, sq, hkv, hq // hkv, d)
    s = jnp.einsum("bqhgd,bkhd->bhgqk", qf, k.astype(jnp.float32)) * scale
    if causal:
        vis = jnp.arange(sk)[None, :] <= jnp.arange(sq)[:, None] + (sk - sq)
        s = jnp.where(vis, s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    e = jnp.exp(s - m)
    l_ = jnp.sum(e, axis=-1, keepdims=True)
    p = e / jnp.where(l_ > 0, l_, 1.0)
    out = jnp.einsum("bhgqk,bkhd->bqhgd", p, v.astype(jnp.float32))
    return out.reshape(b, sq, hq, d).astype(q.dtype)
