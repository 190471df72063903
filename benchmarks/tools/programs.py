"""The programs both deviceless compiles build (GPU: ``tools/compile.py``, TPU: ``tools/tpu_compile.py``) and what
they read back from an executable: the model forward and the bf16 train step from ShapeDtypeStructs placed on the
target's devices, its compiled memory and XLA's cost analysis.

    jitted, args, cfg = build_program(devs, "tiny", "train_step", 2, 128, {})   # then gpu_target / tpu_target.compile
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp

from jaxattn import gpu_target
from twincore.flops import model_flops

from ..report.records import check_out_dir, default_out
from .deviceless import AttnShape

# The attention implementations both compiles put side by side. Ours (and cuDNN, XLA) go through our dispatcher; the
# peers are other well-kept kernels called as their packages document: jax's own Pallas ops (GPU: Triton `mha`;
# TPU: the Pallas TPU `flash_attention`) and tokamax's (`pip install tokamax`: Triton and Mosaic GPU on a GPU, Mosaic
# TPU on a TPU).
DISPATCHED = ("flash", "mosaic", "cudnn", "xla", "splash")
PEER_MHA = "pallas.ops:mha"  # jax.experimental.pallas.ops.gpu.attention.mha
PEER_TPU_FLASH = "pallas.ops.tpu:flash"  # jax.experimental.pallas.ops.tpu.flash_attention.flash_attention
TOKAMAX_TRITON = "tokamax:triton"
TOKAMAX_MOSAIC = "tokamax:mosaic"
PEERS = (PEER_MHA, PEER_TPU_FLASH, TOKAMAX_TRITON, TOKAMAX_MOSAIC)


def attention_loss(impl: str, shape: AttnShape, d: int):
    """``loss(q, k, v)``: the float32 sum of ``impl``'s attention output, so ``jax.grad`` of it compiles the
    forward and the backward. Ours and cuDNN / XLA go through our dispatcher (``backend=impl``); the peers are
    called as their packages document."""
    if impl in DISPATCHED:
        from jaxattn.attention import dot_product_attention

        fwd = functools.partial(dot_product_attention, causal=shape.causal, backend=impl)
    elif impl == PEER_MHA:
        from jax.experimental.pallas.ops.gpu.attention import mha

        if shape.hkv != shape.hq:
            raise ValueError(f"{PEER_MHA} takes no GQA: Hq={shape.hq} != Hkv={shape.hkv}")
        fwd = lambda q, k, v: mha(q, k, v, None, sm_scale=d**-0.5, causal=shape.causal)  # noqa: E731
    elif impl == PEER_TPU_FLASH:
        from jax.experimental.pallas.ops.tpu.flash_attention import flash_attention

        def fwd(q, k, v):  # its layout is [B, H, S, D]; no GQA
            if shape.hkv != shape.hq:
                raise ValueError(f"{PEER_TPU_FLASH} takes no GQA: Hq={shape.hq} != Hkv={shape.hkv}")
            t = lambda x: x.swapaxes(1, 2)  # noqa: E731
            return t(flash_attention(t(q), t(k), t(v), causal=shape.causal, sm_scale=d**-0.5))
    elif impl in (TOKAMAX_TRITON, TOKAMAX_MOSAIC):
        import tokamax

        fwd = functools.partial(
            tokamax.dot_product_attention, is_causal=shape.causal, implementation=impl.split(":")[1]
        )
    else:
        raise ValueError(f"impl must be one of {DISPATCHED + PEERS}, got {impl!r}")
    return lambda q, k, v: fwd(q, k, v).astype(jnp.float32).sum()


@contextlib.contextmanager
def peer_context(impl: str, devs):
    """tokamax decides whether it may lower by asking jax's default device (a CPU here) what it is, and reads its
    options through absl flags: make the target's first device the default and set its documented
    ``cross_compile`` option (absl flags marked parsed: :func:`import_tokamax`)."""
    if not impl.startswith("tokamax:"):
        yield
        return
    tokamax = import_tokamax()
    with jax.default_device(devs[0]), tokamax.config.cross_compile(True):
        yield


def import_tokamax():
    """The ``tokamax`` module, ready to call from any program. It reads its options through absl flags and, while
    they are unparsed, parses ``sys.argv``, whose flags are ours (``run --quick``: "Unknown command line flag
    'quick'"); so mark them parsed, as a library user's absl ``main`` would, leaving tokamax's at their defaults."""
    import tokamax
    from absl import flags

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()
    return tokamax


def attention_base(impl: str, d: int, dt: str, shape: AttnShape, label: str) -> dict:
    """The keys of an attention record in either compile: which implementation, head dim, dtype and shape."""
    return dict(
        impl=impl,
        head_dim=d,
        dtype=dt,
        B=shape.b,
        S=shape.s,
        Hq=shape.hq,
        Hkv=shape.hkv,
        causal=shape.causal,
        label=label,
    )


def error_record(base: dict, e: Exception, what: str, log=print) -> dict:
    """The record of a compile that failed (one failure is a record, not the end of the run), logged as ``what``."""
    log(f"  {what}: ERROR {type(e).__name__}: {str(e)[:200]}")
    return dict(base, status="error", error=f"{type(e).__name__}: {str(e)[:500]}")


def skipped_record(base: dict, log=print) -> dict | None:
    """The record of a peer whose package is absent (a clean skip, not a failure), None when it can compile."""
    reason = peer_unavailable(base["impl"])
    if reason is None:
        return None
    log(f"  {base['impl']} D={base['head_dim']} {base['dtype']}: skipped ({reason})")
    return dict(base, status="skipped", reason=reason)


def peer_unavailable(impl: str) -> str | None:
    """None when ``impl`` can be compiled here, else why not: a clean skip, never an error."""
    if impl.startswith("tokamax:"):
        try:
            import tokamax  # noqa: F401
        except ImportError:
            return "tokamax is not installed (pip install -e '.[compile-peers]', Python 3.11+)"
    if impl == "cudnn":
        from jaxattn.attention.cudnn import cudnn_version

        if cudnn_version() is None:
            return "the cuDNN library is not installed (nvidia-cudnn-cu12, in the gpu-compile extra)"
    return None


def program_cases(quick: bool):
    """``[(preset, kind, batch, seq, overrides, loss, expert_gemm)]``: the forward and the bf16 train step; the full
    run adds the 1b and 8b train steps at S=4096 and 8192 with the dense and the fused loss (``--loss``;
    benchmarks/NOTES.md). MoE train steps (``expert_gemm``: ``jaxattn.moe.grouped_gemm``'s "pallas" = our kernel,
    "xla" = ``jax.lax.ragged_dot``; None for a dense model): ``moe-tiny`` in ``--quick``, else two-layer Mixtral-8x7B
    and Qwen3-30B-A3B steps (every layer of the scan is the same program) with each grouped GEMM."""
    tiny = [("tiny", "forward", 2, 128, {}, "dense", None), ("tiny", "train_step", 2, 128, {}, "dense", None)]
    if quick:
        return tiny + [
            ("tiny", "train_step", 2, 128, {}, "fused", None),
            ("moe-tiny", "train_step", 2, 128, {}, "dense", "pallas"),
        ]
    cases = tiny + [("1b", "forward", 4, 2048, {}, "dense", None), ("1b", "train_step", 4, 2048, {}, "dense", None)]
    for preset in ("1b", "8b"):
        cases += [(preset, "train_step", 2, s, {}, loss, None) for s in (4096, 8192) for loss in ("dense", "fused")]
    for preset in ("mixtral-8x7b", "qwen3-30b-a3b"):
        cases += [(preset, "train_step", 1, 4096, {"n_layers": 2}, "fused", g) for g in ("pallas", "xla")]
    return cases


def gemm_context(expert_gemm: str | None):
    """The MoE grouped-GEMM choice of a program case (``jaxattn.moe.grouped_gemm``), or nothing for a dense one."""
    if expert_gemm is None:
        return contextlib.nullcontext()
    from jaxattn.moe import grouped_gemm

    return grouped_gemm(expert_gemm)


def analytic_flops(cfg, kind: str, batch: int, seq: int) -> dict:
    """Model FLOPs of a ``forward`` or a ``train_step`` (``twincore.flops``: 6·N·tokens + attention)."""
    return model_flops(cfg, batch, seq, train=kind == "train_step")


def _abstract_model(cfg):
    from flax import nnx

    from jaxattn.model import Llama

    return nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0)))


def build_program(devs, preset: str, kind: str, batch: int, seq: int, overrides: dict, loss: str = "dense"):
    """``(jitted, args, cfg)`` for the model forward or the train step (with ``loss``: ``make_train_step``'s), all
    inputs ShapeDtypeStructs placed on the target's devices."""
    import optax
    from flax import nnx

    from jaxattn.config import ModelConfig

    cfg = ModelConfig.preset(preset, **overrides)
    tokens = jax.ShapeDtypeStruct((batch, seq + (1 if kind == "train_step" else 0)), jnp.int32)
    if kind == "forward":
        graphdef, params, rest = nnx.split(_abstract_model(cfg), nnx.Param, ...)
        params = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, jnp.bfloat16) if jnp.issubdtype(x.dtype, jnp.floating) else x,
            params,
        )

        def forward(params, rest, tokens):
            return nnx.merge(graphdef, params, rest)(tokens)

        return jax.jit(forward), gpu_target.place((params, rest, tokens), devs), cfg
    if kind != "train_step":
        raise ValueError(f"kind must be 'forward' or 'train_step', got {kind!r}")
    from jaxattn.model import Llama
    from jaxattn.train_step import TrainState, make_train_step

    tx = optax.adamw(1e-4)
    graphdef = nnx.split(_abstract_model(cfg), nnx.Param, ...)[0]
    state = jax.eval_shape(lambda: TrainState.create(Llama(cfg, rngs=nnx.Rngs(0)), tx, policy="bf16")[1])
    step = make_train_step(graphdef, tx, policy="bf16", loss=loss)
    return step.jitted, gpu_target.place((state, {"tokens": tokens}), devs), cfg


def memory_stats(compiled) -> dict:
    """Compiled memory of an executable: argument / output / alias / temp bytes and the peak."""
    m = compiled.memory_analysis()
    out = {k: int(getattr(m, f"{k}_size_in_bytes", 0) or 0) for k in ("argument", "output", "alias", "temp")}
    peak = getattr(m, "peak_memory_in_bytes", None)
    out["peak"] = int(peak) if peak else out["argument"] + out["output"] - out["alias"] + out["temp"]
    out["peak_source"] = "memory_analysis" if peak else "argument + output - alias + temp"
    return out


def xla_cost(compiled) -> tuple[dict, str]:
    """``(cost dict, source)``: XLA's HLO cost analysis of a compiled executable. A deviceless GPU executable does
    not implement ``cost_analysis()``, so its optimized module is analysed by the CPU client's HloCostAnalysis;
    custom calls (our Pallas kernels) count 0 FLOPs either way."""
    try:
        cost = compiled.cost_analysis()
        source = "compiled.cost_analysis()"
    except Exception:
        cost = None
    if not cost:
        from jax._src.lib import _jax  # private: the only route to HloCostAnalysis for a deviceless compile

        mods = compiled.runtime_executable().hlo_modules()
        cost = _jax.hlo_module_cost_analysis(jax.devices("cpu")[0].client, mods[0])
        source = "HloCostAnalysis of the compiled module (custom calls count 0)"
    return (cost[0] if isinstance(cost, (list, tuple)) else cost) or {}, source


def cost_stats(compiled) -> dict:
    """FLOPs and bytes accessed of the compiled module (:func:`xla_cost`) and where they came from."""
    cost, source = xla_cost(compiled)
    return {
        "xla_flops": float(cost.get("flops", 0.0)),
        "xla_bytes_accessed": float(cost.get("bytes accessed", 0.0)),
        "cost_source": source,
    }


def out_dir(parser, args) -> str:
    """The checked ``--out`` of a compile command (default ``benchmarks/results/local/<target>-compiled[-quick]``);
    a bad one is the parser's error."""
    out = args.out if args.out is not None else default_out(f"{args.target}-compiled{'-quick' if args.quick else ''}")
    try:
        return check_out_dir(out)
    except ValueError as e:
        parser.error(str(e))


def program_base(
    preset: str,
    kind: str,
    batch: int,
    seq: int,
    overrides: dict,
    loss: str,
    attention: str,
    label: str,
    expert_gemm: str | None = None,
):
    """The keys of a program record (``compile`` and ``tpu_compile``): what was compiled, with which attention (and
    an MoE's grouped GEMM)."""
    return dict(
        preset=preset,
        kind=kind,
        batch=batch,
        seq=seq,
        overrides=overrides,
        loss=loss if kind == "train_step" else None,
        precision="bf16",
        attention=attention,
        expert_gemm=expert_gemm,
        label=label,
    )
