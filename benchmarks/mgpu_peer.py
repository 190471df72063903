"""jax's own FA3-style Mosaic GPU attention as a peer: the attention suite's ``pallas:mgpu`` and the deviceless
compile's ``pallas.ops:mgpu`` (``jax.experimental.pallas.ops.gpu.attention_mgpu.attention``), with its contract.

    reason = unsupported("float16", hq=16, hkv=16, s=4096, d=128, causal=True, backward=True)  # None or why not
    fwd = attention_fn(causal=False)             # fwd(q, k, v) -> out, [B, S, H, D] in and out

Its contract, read in the op's source (the same in jax 0.10.2, 0.11.2 and 0.12): layout [B, S, H, D]; float16 only in
practice (its checks admit bfloat16, but its shared-memory buffers are float16 and Mosaic refuses the mixed wgmma:
"Mixed input dtypes for matrix multiplication unsupported: lhs=bfloat16, rhs=float16"), so a bfloat16 call runs on
float16 copies of the same inputs (:func:`run_dtype`; the record says so); head dim a multiple of 64 (as large as
shared memory allows); GQA / MQA (Hq a multiple of Hkv); no scale argument (it computes softmax(q kᵀ)): q is
scaled by 1/sqrt(D) first, in float32; causal masking (top-left, ours at Sq == Sk) in the forward only (its
backward raises "Causal attention not supported in the backwards pass yet"), and not on CUDA runtimes
12.8.0 <= v < 12.9.1 (a ptxas miscompilation, its own check); no segments, window, softcap, dropout.
"""

from __future__ import annotations

import contextlib

SUITE_NAME = "pallas:mgpu"
COMPILE_NAME = "pallas.ops:mgpu"
DTYPES = ("float16", "bfloat16")  # what its checks admit; bfloat16 runs as float16 (run_dtype)
# TuningConfig: the op's own benchmark (attention_mgpu.main) times block_q=64, max_concurrent_steps=2 and takes the
# first of block_kv 256, 128, 64 that fits shared memory; the backward blocks and compute_wgs_bwd (2 warpgroups
# up to D=128, else 1) are the first of jax's tests/pallas/mgpu_attention_test.py::test_bwd_flash_attention.
BLOCK_Q = 64
BLOCK_KV_CHOICES = (256, 128, 64)
MAX_CONCURRENT_STEPS = 2
BWD_BLOCK = 64  # block_q_dq = block_kv_dq = block_q_dkv = block_kv_dkv
SMEM_PER_BLOCK = 232448  # H100 opt-in shared memory per block (benchmarks/targets/h100.txtpb)
BAD_CUDA = (12080, 12091)  # the op declines causal masking on CUDA runtimes in [12.8.0, 12.9.1)


def _fwd_smem(block_kv: int, d: int) -> int:
    """Bytes of the forward's scratch (2 compute warpgroups' q/o tiles, the k and v ring, the lse rows): the
    buffers ``attention_mgpu._attention_forward`` allocates, all float16 but the float32 lse."""
    return 2 * BLOCK_Q * d * 2 + 2 * MAX_CONCURRENT_STEPS * block_kv * d * 2 + 2 * BLOCK_Q * 4


def block_kv(d: int) -> int | None:
    """The forward's ``block_kv`` at head dim ``d``: the first of :data:`BLOCK_KV_CHOICES` whose scratch fits."""
    return next((b for b in BLOCK_KV_CHOICES if _fwd_smem(b, d) <= SMEM_PER_BLOCK), None)


def compute_wgs_bwd(d: int) -> int:
    return 2 if d <= 128 else 1


def tuning_config(d: int, causal: bool):
    """The :class:`attention_mgpu.TuningConfig` used at head dim ``d`` (see the constants above)."""
    from jax.experimental.pallas.ops.gpu.attention_mgpu import TuningConfig

    return TuningConfig(
        block_q=BLOCK_Q,
        block_kv=block_kv(d),
        max_concurrent_steps=MAX_CONCURRENT_STEPS,
        causal=causal,
        compute_wgs_bwd=compute_wgs_bwd(d),
        block_q_dq=BWD_BLOCK,
        block_kv_dq=BWD_BLOCK,
        block_q_dkv=BWD_BLOCK,
        block_kv_dkv=BWD_BLOCK,
    )


def run_dtype(dtype: str) -> str:
    """The dtype the op runs at for a call at ``dtype`` (a name): bfloat16 -> float16 (see the module docstring)."""
    return "float16" if dtype in ("bfloat16", "bf16") else dtype


def cuda_runtime_version() -> tuple[int | None, str]:
    """``(version, where from)``: the CUDA runtime version the op's causal check reads, or, where no CUDA runtime
    can be loaded (a deviceless compile), the one the jax CUDA plugin was built against (what a GPU host installed
    from the same wheels loads); ``(None, why)`` where neither can be read."""
    try:
        from jax._src.lib import cuda_versions
    except ImportError as e:
        return None, f"no jax CUDA plugin ({e})"
    if cuda_versions is None:
        return None, "no jax CUDA plugin"
    try:
        return int(cuda_versions.cuda_runtime_get_version()), "the loaded CUDA runtime"
    except Exception:
        pass
    try:
        return int(cuda_versions.cuda_runtime_build_version()), "the CUDA runtime the jax CUDA plugin was built against"
    except Exception as e:
        return None, f"unreadable ({type(e).__name__})"


def causal_reason() -> str | None:
    """Why the op declines causal masking here (its own CUDA-runtime check), else None."""
    ver, source = cuda_runtime_version()
    if ver is not None and BAD_CUDA[0] <= ver < BAD_CUDA[1]:
        return (
            f"attention_mgpu declines causal masking on CUDA runtime {ver} ({source}): 12.8.0 <= version < 12.9.1, "
            "a ptxas miscompilation (its own check)"
        )
    return None


def unsupported(dtype: str, hq: int, hkv: int, s: int, d: int, causal: bool, backward: bool = False) -> str | None:
    """None where the op takes a self-attention call (Sq == Sk == ``s``) at this shape and pass, else why not.
    ``dtype``: a numpy name (``"bfloat16"``) or a compile-table one (``"bf16"``); ``backward``: the fwd+bwd pass."""
    dtype = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}.get(dtype, dtype)
    if dtype not in DTYPES:
        return f"attention_mgpu takes float16 / bfloat16 only, got {dtype}"
    if d % 64:
        return f"attention_mgpu needs a head dim that is a multiple of 64, got D={d}"
    bkv = block_kv(d)
    if bkv is None:
        return f"attention_mgpu: no block_kv in {BLOCK_KV_CHOICES} fits shared memory at D={d}"
    if hq % hkv:
        return f"attention_mgpu needs Hq a multiple of Hkv, got Hq={hq}, Hkv={hkv}"
    if s % (2 * BLOCK_Q) or s % bkv:
        return f"attention_mgpu needs S a multiple of 2*block_q={2 * BLOCK_Q} and block_kv={bkv}, got S={s}"
    if backward:
        if causal:
            return "attention_mgpu has no causal backward ('Causal attention not supported in the backwards pass yet')"
        if s % (BWD_BLOCK * compute_wgs_bwd(d)):
            return f"attention_mgpu's backward needs S a multiple of {BWD_BLOCK * compute_wgs_bwd(d)}, got S={s}"
    if causal:
        return causal_reason()
    return None


def attention_fn(causal: bool):
    """``fwd(q, k, v)``: the op at the default scale 1/sqrt(D) (q scaled in float32, then cast back) with
    :func:`tuning_config` at q's head dim D, differentiable (its custom vjp) where :func:`unsupported` allows the
    backward."""
    import jax.numpy as jnp
    from jax.experimental.pallas.ops.gpu.attention_mgpu import attention

    def fwd(q, k, v):
        d = q.shape[-1]
        q = (q.astype(jnp.float32) * (d**-0.5)).astype(q.dtype)
        return attention(q, k, v, tuning_config(d, causal))

    return fwd


@contextlib.contextmanager
def deviceless_cuda_version():
    """The op reads the CUDA runtime's version when it traces (its causal check); a deviceless compile has no CUDA
    runtime to ask. Inside the block, where the runtime cannot be read, the op's module sees the version of
    :func:`cuda_runtime_version` instead (the plugin's build version); yields ``(version, where from)``."""
    from jax.experimental.pallas.ops.gpu import attention_mgpu

    ver, source = cuda_runtime_version()
    orig = attention_mgpu.cuda_versions
    if source == "the loaded CUDA runtime" or ver is None:
        yield ver, source
        return

    class _Versions:
        @staticmethod
        def cuda_runtime_get_version():
            return ver

    attention_mgpu.cuda_versions = _Versions
    try:
        yield ver, source
    finally:
        attention_mgpu.cuda_versions = orig
