"""``splash`` backend: jax's Pallas TPU splash attention (``jax.experimental.pallas.ops.tpu.splash_attention``, the
block-sparse flash attention MaxText uses on TPUs) behind the design §4 contract. No kernel is written here: this
module maps the contract onto the library's masks, layout and segment ids, and declines what it cannot serve.

    with target_platform("tpu"), attention_backend("splash"):    # the TPU default order starts with it anyway
        out = dot_product_attention(q, k, v, causal=True, segment_ids=ids)

The mapping (checked against ``attention/reference.py`` in ``parity_tests/test_splash.py``, interpreted on a CPU):

* layout: the kernel takes one sequence's ``[H, S, D]`` (MHA) or ``[G, S, D]`` queries against one K/V head
  (MQA); batches are ``vmap``-ed, GQA is the MQA kernel ``vmap``-ed over the KV heads (K/V never repeated), both
  in ONE ``vmap`` over ``B * Hkv``: nested ``vmap``-s of size 1 (B = Hkv = 1) give the kernel's bf16 backward a
  ``sum(o * do)`` that XLA:CPU (jaxlib 0.10-0.12) sends to a YNNPACK reduce fusion that returns wrong values, so dq/dk
  changed from call to call under ``jit`` (interpret mode only; TPUs have no YNNPACK);
* scale: the kernel multiplies nothing, so q is scaled first (MaxText's way); ``softcap`` is the kernel's
  ``attn_logits_soft_cap``, applied to the scaled logits as the contract says;
* bottom-right causal and windows: ``CausalMask`` / ``LocalMask`` with ``offset = Sk - Sq``;
* any sequence length: q and k/v are padded to a multiple of 128 (the TPU lane width) and the padding gets its own
  segment id, so no real query sees a padded key; padded queries are sliced away (zero cotangent);
* a query that sees no key must give 0 and zero gradients; the kernel's softmax is undefined there (its docstring:
  a row of the mask must not be empty). Shared ``[B, S]`` ids never leave a row empty (every query sees itself);
  for a ``(q_ids, kv_ids)`` pair, rows without a key are found in ``KV_CHUNK``-key chunks (O(Sq) memory) and
  zeroed, which also zeroes their cotangent, so they add nothing to dK/dV (such a row's block is still computed,
  so its values are finite). A causal/window band that leaves the first queries with no key at all (``Sq > Sk``)
  is declined: the library skips those blocks and returns NaN there;
* off a TPU target the kernel runs in ``interpret`` mode (tests; slow);
* bfloat16 inputs run the kernel at default matmul precision: a process-wide ``"highest"`` (``jaxattn.precision``)
  would ask Mosaic for an fp32-precision dot of bf16 operands, which it refuses; the product is exact either way.

Declined: float16 (TPUs compute in bfloat16/float32), static rows without a key (above).

Block sizes (:func:`block_size`): the largest of :data:`BLOCKS` dividing the padded length that fits the TPU
generation's scoped VMEM for the head dim and dtype (:data:`VMEM_CAPS`). The compiler can tell fit, not speed: the
caps come from the deviceless search (``python -m benchmarks compile --target v5e --search``, committed as
``benchmarks/results/<chip>-compiled/splash_blocks.json``, checked against this table by a test); among the blocks
that fit, 512 (MaxText's default) stays first until a TPU has timed the larger ones.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas.ops.tpu import splash_attention as sa

from twincore.attention import visible_bounds

from .args import AttnArgs, mask
from .target import current_target

__all__ = ["supports", "attention", "splash_attention", "block_size", "LANE", "KV_CHUNK"]

LANE = 128  # sequences are padded to a multiple of this (the TPU vector lane width)
BLOCKS = (512, 256, 128)  # block sizes tried, largest first
KV_CHUNK = 512  # keys per step when looking for queries without a key ((q_ids, kv_ids) pairs)

# The largest square block whose causal forward+backward compiles within the chip's scoped VMEM, per TPU generation
# (jax's device kind) and (head dim, dtype): the deviceless search at S=8192 over 2048 / 1024 / 512 / 256
# (benchmarks/results/<chip>-compiled/splash_blocks.json). A head dim between two rows takes the larger row's cap.
_V5_CAPS = {
    (64, "bfloat16"): 1024,
    (64, "float32"): 1024,
    (128, "bfloat16"): 1024,
    (128, "float32"): 1024,
    (256, "bfloat16"): 1024,
    (256, "float32"): 512,
}  # v5e and v5p found alike
VMEM_CAPS: dict[str, dict[tuple[int, str], int]] = {
    "TPU v5 lite": _V5_CAPS,  # v5e
    "TPU v5": _V5_CAPS,  # v5p
    "TPU v6 lite": {  # v6e: a larger scoped VMEM
        (64, "bfloat16"): 2048,
        (64, "float32"): 1024,
        (128, "bfloat16"): 2048,
        (128, "float32"): 1024,
        (256, "bfloat16"): 1024,
        (256, "float32"): 1024,
    },
}


def vmem_cap(head_dim: int, dtype, device_kind: str | None) -> int | None:
    """The largest block that fits ``device_kind``'s scoped VMEM at this head dim and dtype (:data:`VMEM_CAPS`),
    None where the generation or a head dim this large was not searched."""
    caps = VMEM_CAPS.get(device_kind or "")
    if not caps:
        return None
    name = jnp.dtype(dtype).name
    rows = sorted(d for d, dt in caps if dt == name and d >= head_dim)
    return caps[(rows[0], name)] if rows else None


def block_size(padded_len: int, head_dim: int = 128, dtype=jnp.bfloat16, device_kind: str | None = None) -> int:
    """The splash block size for a padded sequence length: the largest of :data:`BLOCKS` dividing it, within the
    generation's VMEM cap (:func:`vmem_cap`; no cap for an unsearched generation)."""
    cap = vmem_cap(head_dim, dtype, device_kind) or max(BLOCKS)
    return next((b for b in BLOCKS if padded_len % b == 0 and b <= cap), LANE)


def _first_rows_empty(sq: int, sk: int, args: AttnArgs) -> bool:
    """Whether the causal/window band leaves the first queries with no key (query 0 sees up to ``Sk - Sq + right``)."""
    _, right = visible_bounds(args.causal, args.window)
    return right is not None and sk - sq + right < 0


def supports(q, k, v, args: AttnArgs):
    dt = str(q.dtype)
    if dt not in ("float32", "bfloat16"):
        return f"splash attention takes float32/bfloat16 (TPUs compute in bfloat16, not {dt})"
    sq, sk = q.shape[1], k.shape[1]
    if _first_rows_empty(sq, sk, args):
        return (
            f"causal/window with Sq={sq} > Sk={sk} leaves the first queries with no key; splash skips those "
            "blocks and its softmax is undefined there (use chunked)"
        )
    return None


def _pad(x, axis: int, to: int, value=0):
    extra = to - x.shape[axis]
    if not extra:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths, constant_values=value)


@functools.lru_cache(maxsize=64)
def _kernel(
    heads: int,
    sq: int,
    sk: int,
    offset: int,
    causal: bool,
    window,
    softcap,
    mqa: bool,
    interpret: bool,
    bq: int,
    bk: int,
):
    """The library kernel for one padded shape, mask and ``bq`` x ``bk`` blocks (its mask processing runs once per
    shape)."""
    shape = (sq, sk)
    if window is not None:
        one = sa.LocalMask(shape, window_size=window, offset=offset)
    elif causal:
        one = sa.CausalMask(shape, offset=offset)
    else:
        one = sa.FullMask(shape)
    blocks = sa.BlockSizes(
        block_q=bq,
        block_kv=bk,
        block_kv_compute=bk,
        block_q_dkv=bq,
        block_kv_dkv=bk,
        block_kv_dkv_compute=bk,
        block_q_dq=bq,
        block_kv_dq=bk,
    )
    make = sa.make_splash_mqa_single_device if mqa else sa.make_splash_mha_single_device
    with jax.ensure_compile_time_eval():  # concrete mask arrays, so the cached kernel outlives the trace
        return make(
            sa.MultiHeadMask([one] * heads), block_sizes=blocks, attn_logits_soft_cap=softcap, interpret=interpret
        )


def _rows_with_a_key(sq: int, sk: int, args: AttnArgs):
    """``[B, Sq]`` bool: the queries that see at least one key (causal/window and the ids), ``KV_CHUNK`` keys a
    step."""
    q_ids, kv_ids = args.q_segment_ids, args.kv_segment_ids
    n = -(-sk // KV_CHUNK)
    kv_ids = _pad(kv_ids, 1, n * KV_CHUNK).reshape(kv_ids.shape[0], n, KV_CHUNK)

    def step(seen, c):
        pos = c * KV_CHUNK + jnp.arange(KV_CHUNK, dtype=jnp.int32)  # positions >= Sk are masked by mask()
        vis = mask(sq, sk, args, q_ids, kv_ids[:, c], kv_pos=pos)  # [B, Sq, KV_CHUNK]
        return seen | vis.any(-1), None

    seen, _ = lax.scan(step, jnp.zeros(q_ids.shape, bool), jnp.arange(n))
    return seen


def _at_default_precision(fn):
    """``fn(q, k, v, ids)`` with its forward AND backward traced at default matmul precision. For bf16 operands
    the MXU's one-pass product is exact, and Mosaic refuses a bf16 dot asked for fp32 precision ("Bad lhs type"),
    which a process-wide ``jax_default_matmul_precision="highest"`` would ask. The kernel's backward is traced when
    the gradient is taken, outside any context around the call, hence the ``custom_vjp`` that re-enters it."""

    def ctx():
        return jax.default_matmul_precision("default")

    @jax.custom_vjp
    def call(q, k, v, ids):
        with ctx():
            return fn(q, k, v, ids)

    def call_fwd(q, k, v, ids):
        with ctx():
            out, pull = jax.vjp(lambda q, k, v: fn(q, k, v, ids), q, k, v)
        return out, pull

    def call_bwd(pull, g):
        with ctx():
            return (*pull(g), None)  # no cotangent for the integer segment ids

    call.defvjp(call_fwd, call_bwd)
    return call


def splash_attention(q, k, v, args: AttnArgs, *, interpret: bool | None = None, block: int | None = None):
    """The contract's attention through the splash kernel: q ``[B, Sq, Hq, D]``, k/v ``[B, Sk, Hkv, D]`` ->
    ``[B, Sq, Hq, D]`` in q's dtype (see the module docstring). ``interpret``: None = off a TPU target. ``block``:
    one block size for q and k/v instead of :func:`block_size`'s (the deviceless search's knob; must divide both
    padded lengths)."""
    target = current_target(q)
    if interpret is None:
        interpret = target.platform != "tpu"
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    g = hq // hkv
    sq_p, sk_p = -(-sq // LANE) * LANE, -(-sk // LANE) * LANE
    ids = None
    if args.has_segment_ids or sq_p != sq or sk_p != sk:
        q_ids = args.q_segment_ids if args.has_segment_ids else jnp.zeros((b, sq), jnp.int32)
        kv_ids = args.kv_segment_ids if args.has_segment_ids else jnp.zeros((b, sk), jnp.int32)
        q_ids, kv_ids = q_ids.astype(jnp.int32), kv_ids.astype(jnp.int32)
        pad_id = jnp.maximum(q_ids.max(), kv_ids.max()) + 1  # an id no real position has
        ids = sa.SegmentIds(q=_pad(q_ids, 1, sq_p, pad_id), kv=_pad(kv_ids, 1, sk_p, pad_id))
    window = None if args.window is None else tuple(args.window)
    if block is None:
        bq, bk = (block_size(n, d, q.dtype, target.device_kind) for n in (sq_p, sk_p))
    elif sq_p % block or sk_p % block:
        raise ValueError(f"block must divide the padded lengths {sq_p} and {sk_p}, got {block}")
    else:
        bq = bk = block
    kernel = _kernel(
        g if g > 1 else hq, sq_p, sk_p, sk - sq, args.causal, window, args.softcap, g > 1, interpret, bq, bk
    )
    qs = _pad((q.astype(jnp.float32) * args.scale).astype(q.dtype).swapaxes(1, 2), 2, sq_p)  # [B, Hq, Sq_p, D]
    ks, vs = (_pad(x.swapaxes(1, 2), 2, sk_p) for x in (k, v))  # [B, Hkv, Sk_p, D]
    if g > 1:  # the MQA kernel per (sequence, KV head): head h reads KV head h // G
        qs, ks, vs = qs.reshape(b * hkv, g, sq_p, d), ks.reshape(b * hkv, sk_p, d), vs.reshape(b * hkv, sk_p, d)
        ids = None if ids is None else jax.tree.map(lambda x: jnp.repeat(x, hkv, axis=0), ids)

    def run(qs, ks, vs, ids):  # one flat vmap, not nested ones (module docstring: XLA:CPU)
        call = lambda qb, kb, vb, idb: kernel(qb, kb, vb, segment_ids=idb)  # noqa: E731
        return jax.vmap(call, in_axes=(0, 0, 0, None if ids is None else 0))(qs, ks, vs, ids)

    out = _at_default_precision(run)(qs, ks, vs, ids) if q.dtype == jnp.bfloat16 else run(qs, ks, vs, ids)
    out = out.reshape(b, hq, sq_p, d)[:, :, :sq].swapaxes(1, 2).astype(q.dtype)  # [B, Sq, Hq, D]
    if args.has_segment_ids and args.q_segment_ids is not args.kv_segment_ids:  # a pair: rows may see no key
        out = jnp.where(_rows_with_a_key(sq, sk, args)[:, :, None, None], out, jnp.zeros((), out.dtype))
    return out


def attention(q, k, v, args: AttnArgs):
    return splash_attention(q, k, v, args)
