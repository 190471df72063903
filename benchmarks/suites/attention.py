"""Attention suite: every jaxattn attention backend against its peers (JAX's own, torch SDPA and FlexAttention), fwd
and fwd+bwd.

    records = run(quick=True, impls=["flash", "sdpa:flash"], max_seq=4096)

Implementations, passes, TFLOP/s and memory conventions and the shapes: benchmarks/NOTES.md ("attention").
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from twincore.attention import backend_names
from twincore.flops import attention_flops
from twincore.timing import is_count

from .. import measure, mgpu_peer

MATERIALISING = {("jax", "xla"), ("jax", "jax.nn:xla"), ("torch", "sdpa:math")}
MAX_MATERIALISED_S = 4096
JAX_OURS = backend_names(forward_only=False)  # the backend table's, minus forward-only flash_decode
JAX_PEERS = ("jax.nn:xla", "jax.nn:cudnn", "pallas:mha", mgpu_peer.SUITE_NAME, "tokamax")
TORCH_SDPA = ("flash", "efficient", "cudnn", "math")
TORCH_FLEX = "flex_attention"  # torch's FlexAttention, compiled (torchref's backend `flex`)
TORCH_IMPLS = (*(f"sdpa:{n}" for n in TORCH_SDPA), TORCH_FLEX)
IMPLS = JAX_OURS + JAX_PEERS + TORCH_IMPLS  # every `impl` a record can have


def _shapes(quick: bool, on_gpu: bool = False):
    """(dtype, B, Hq, Hkv, S, D, causal)."""
    if quick:
        # calls of milliseconds (torch) to a hundred (JAX fwd+bwd): sub-millisecond calls moved 1.3-2.9x between
        # processes (benchmarks/NOTES.md, "Trustworthy numbers")
        return [("float32", 2, 8, 8, s, 64, c) for s in (256, 512) for c in (False, True)]
    out = []
    for d in (64, 128):
        for s in (512, 1024, 2048, 4096, 8192, 16384):
            for c in (False, True):
                out.append(("bfloat16", max(1, 16384 // s), 2048 // d, 2048 // d, s, d, c))
    return out


def check_filters(
    quick: bool, impls: Iterable[str] | None = None, max_seq: int | None = None, head_dims: Iterable[int] | None = None
) -> list:
    """The shapes ``run`` will time, after checking the filters (cheap: imports neither jax nor torch).

    Raises ValueError naming ``impls`` / ``max_seq`` / ``head_dims`` when a name is unknown, ``max_seq`` is not a
    positive int, a head dim is not one the suite has, or the filters leave nothing to run."""
    if impls is not None:
        impls = [impls] if isinstance(impls, str) else list(impls)
        unknown = [i for i in impls if i not in IMPLS]
        if not impls or unknown:
            raise ValueError(f"impls: unknown implementation(s) {unknown or impls}; choose from {list(IMPLS)}")
    if max_seq is not None and not is_count(max_seq, 1):
        raise ValueError(f"max_seq must be a positive int (a sequence length), got {max_seq!r}")
    if head_dims is not None:
        head_dims = list(head_dims)
        have = sorted({sh[5] for sh in _shapes(quick)})
        if not head_dims or any(type(d) is not int or d not in have for d in head_dims):
            raise ValueError(
                f"head_dims: {head_dims} not among the suite's head dims {have}{' (quick)' if quick else ''}"
            )
    shapes = [
        sh
        for sh in _shapes(quick)
        if (max_seq is None or sh[4] <= max_seq) and (head_dims is None or sh[5] in head_dims)
    ]
    if not shapes:
        raise ValueError(
            f"max_seq={max_seq} leaves no shape to run: the shortest sequence "
            f"{'(quick) ' if quick else ''}is {min(sh[4] for sh in _shapes(quick))}"
        )
    return shapes


def _first_line(e: BaseException) -> str:
    msg = str(e).strip().splitlines()
    return f"{type(e).__name__}: {msg[0][:300] if msg else ''}"


def _record(impl, fw, pss, *, dtype, b, hq, hkv, s, d, causal, **kw):
    r = {
        "suite": "attention",
        "impl": impl,
        "framework": fw,
        "pass": pss,
        "dtype": dtype,
        "B": b,
        "Hq": hq,
        "Hkv": hkv,
        "Sq": s,
        "Sk": s,
        "D": d,
        "causal": causal,
        "median_ms": None,
        "tflops": None,
        "peak_mem_bytes": None,
        "status": "ok",
        "reason": None,
    }
    r.update(kw)
    return r


# --------------------------------------------------------------------------------------------- jax
def _jax_impls(quick: bool):
    """name -> (make(q, k, v, causal) -> fwd callable, or raise to skip)."""
    import jax

    impls = {}
    for name in JAX_OURS:

        def make(causal, _name=name):
            from jaxattn.attention import dot_product_attention

            return lambda q, k, v: dot_product_attention(q, k, v, causal=causal, backend=_name)

        impls[name] = make
    for impl in ("xla", "cudnn"):

        def make(causal, _impl=impl):
            return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation=_impl)

        impls[f"jax.nn:{impl}"] = make

    def make_pallas(causal):
        from jax.experimental.pallas.ops.gpu.attention import mha

        if jax.default_backend() != "gpu":
            raise RuntimeError("GPU only (Triton lowering; interpret mode is not benchmarked)")
        return lambda q, k, v: mha(q, k, v, None, sm_scale=1.0 / float(np.sqrt(q.shape[-1])), causal=causal)

    impls["pallas:mha"] = make_pallas

    def make_mgpu(causal):  # jax's FA3-style Mosaic GPU op; its contract: benchmarks/mgpu_peer.py
        if jax.default_backend() != "gpu":
            raise RuntimeError("GPU only (Mosaic GPU, Hopper sm_90a; not interpreted)")
        return mgpu_peer.attention_fn(causal)

    impls[mgpu_peer.SUITE_NAME] = make_mgpu

    def make_tokamax(causal):  # an optional peer: ImportError skips it
        from benchmarks.tools.programs import import_tokamax

        tokamax = import_tokamax()
        return lambda q, k, v: tokamax.dot_product_attention(q, k, v, is_causal=causal)

    impls["tokamax"] = make_tokamax
    return impls


def mgpu_reason(shape, backward: bool = False, platform: str | None = None, compute_capability=None) -> str | None:
    """Why the ``pallas:mgpu`` peer skips ``shape`` (:func:`_shapes`' tuple) for the pass, else None: GPU only, a
    Hopper (compute capability 9.x: wgmma, TMA) only, then the op's contract (:func:`.mgpu_peer.unsupported`).
    ``platform`` / ``compute_capability`` default to jax's default device's."""
    import jax

    dtype, b, hq, hkv, s, d, causal = shape
    platform = jax.default_backend() if platform is None else platform
    if platform != "gpu":
        return f"GPU only (Mosaic GPU, Hopper sm_90a; not interpreted): platform {platform!r}"
    if compute_capability is None:
        compute_capability = getattr(jax.devices()[0], "compute_capability", None)
    if not str(compute_capability).startswith("9."):
        return f"Hopper only (Mosaic GPU wgmma / TMA, compute capability 9.x), found {compute_capability}"
    return mgpu_peer.unsupported(dtype, hq, hkv, s, d, causal, backward=backward)


def _run_jax(records, quick, shape, iters, warmup, wanted=None, calls=None):
    import jax

    from jaxattn.attention import available_backends

    dtype, b, hq, hkv, s, d, causal = shape
    key = jax.random.key(0)
    kq, kk, kv, kd = jax.random.split(key, 4)
    q = jax.random.normal(kq, (b, s, hq, d), dtype)
    k = jax.random.normal(kk, (b, s, hkv, d), dtype)
    v = jax.random.normal(kv, (b, s, hkv, d), dtype)
    do = jax.random.normal(kd, (b, s, hq, d), dtype)
    ours = available_backends(q, k, v, causal=causal)
    for name, make in _jax_impls(quick).items():
        if wanted is not None and name not in wanted:
            continue
        base = dict(dtype=dtype, b=b, hq=hq, hkv=hkv, s=s, d=d, causal=causal)
        reason = None
        if name in ours and ours[name] is not None:
            reason = f"declined: {ours[name]}"
        elif ("jax", name) in MATERIALISING and s > MAX_MATERIALISED_S:
            reason = f"materialises S x S scores; skipped above S={MAX_MATERIALISED_S}"
        elif name == mgpu_peer.SUITE_NAME:
            reason = mgpu_reason(shape)
        elif name == "splash" and jax.default_backend() != "tpu":
            reason = "TPU kernel: timed on a TPU only (interpreted elsewhere, a test path)"
        elif quick and name == "flash" and (s, causal) != (_shapes(True)[0][4], False):
            reason = "interpreted Pallas kernel on CPU: only the smallest quick shape is timed"
        fwd = None
        if reason is None:
            try:
                fwd = make(causal)
            except Exception as e:
                reason = _first_line(e)
        # the mgpu peer runs a bfloat16 call on float16 copies of the same inputs, cast before the timing
        run_as = mgpu_peer.run_dtype(dtype) if name == mgpu_peer.SUITE_NAME else dtype
        qkvd = (q, k, v, do) if run_as == dtype or reason else tuple(x.astype(run_as) for x in (q, k, v, do))
        for pss in ("fwd", "fwd_bwd"):
            if reason is None and pss == "fwd_bwd" and name == mgpu_peer.SUITE_NAME:
                reason = mgpu_reason(shape, backward=True)  # no causal backward
            if reason is not None:
                records.append(_record(name, "jax", pss, status="skipped", reason=reason, **_kw(base)))
                continue
            if pss == "fwd":
                fn = jax.jit(fwd)
                args = qkvd[:3]
            else:
                fn = jax.jit(lambda q, k, v, do: jax.vjp(fwd, q, k, v)[1](do))
                args = qkvd
            it = 3 if name == "flash" and quick else iters
            try:
                t = measure.timeit(fn, *args, warmup=1 if it == 3 else warmup, iters=it)
            except Exception as e:
                records.append(
                    _record(name, "jax", pss, status="skipped", reason=f"error: {_first_line(e)}", **_kw(base))
                )
                if pss == "fwd":  # the forward already fails: record fwd_bwd as skipped for the same reason
                    reason = f"error: {_first_line(e)}"
                continue
            # interpreted Pallas: too slow to pair; a call run at another dtype is not this row's to pair
            if calls is not None and not (quick and name == "flash") and run_as == dtype:
                calls[len(records)] = lambda fn=fn, args=args: fn(*args)
            records.append(_timed_record(name, "jax", pss, t, measure.jax_compiled_memory(fn, *args), base))
            if run_as != dtype:
                records[-1]["run_dtype"] = run_as


def _timed_record(impl, fw, pss, t: dict, peak_mem_bytes, base) -> dict:
    """The record of a timed pass: ``measure.timeit``'s median / p10 / p90 in ms, the TFLOP/s of the pass's
    analytic FLOPs (:func:`twincore.flops.attention_flops`) and ``peak_mem_bytes``, at the shape ``base``."""
    backward = pss == "fwd_bwd"
    fl = attention_flops(base["b"], base["hq"], base["s"], base["s"], base["d"], base["causal"], backward=backward)
    return _record(
        impl,
        fw,
        pss,
        median_ms=t["median_s"] * 1e3,
        p10_ms=t["p10_s"] * 1e3,
        p90_ms=t["p90_s"] * 1e3,
        iters=t["iters"],
        tflops=fl / t["median_s"] / 1e12,
        peak_mem_bytes=peak_mem_bytes,
        **_kw(base),
    )


def _kw(base):
    return dict(
        dtype=base["dtype"],
        b=base["b"],
        hq=base["hq"],
        hkv=base["hkv"],
        s=base["s"],
        d=base["d"],
        causal=base["causal"],
    )


# --------------------------------------------------------------------------------------------- torch
def _run_torch(records, quick, shape, iters, warmup, wanted=None, calls=None):
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    dtype, b, hq, hkv, s, d, causal = shape
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    tdt = getattr(torch, dtype)
    g = torch.Generator(device="cpu").manual_seed(0)
    mk = lambda h: torch.randn(b, h, s, d, generator=g).to(device=dev, dtype=tdt)  # noqa: E731
    q, k, v, do = mk(hq), mk(hkv), mk(hkv), mk(hq)
    sdp = {
        "flash": SDPBackend.FLASH_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "math": SDPBackend.MATH,
    }
    gqa = dict(enable_gqa=True) if hq != hkv else {}
    base = dict(dtype=dtype, b=b, hq=hq, hkv=hkv, s=s, d=d, causal=causal)
    for impl in TORCH_IMPLS:
        if wanted is not None and impl not in wanted:
            continue
        name = impl.removeprefix("sdpa:")
        reason = None
        if ("torch", impl) in MATERIALISING and s > MAX_MATERIALISED_S:
            reason = f"materialises S x S scores; skipped above S={MAX_MATERIALISED_S}"
        elif dev == "cpu" and name in ("efficient", "cudnn"):
            reason = f"SDPA {name} backend needs CUDA (device {dev})"

        if impl == TORCH_FLEX:  # the compiled kernel, causal by its block mask (torchref.flex_attention)

            def fwd(q, k, v):
                from torchref.flex_attention import flex_dot_product_attention

                scale = 1.0 / float(np.sqrt(q.shape[-1]))
                return flex_dot_product_attention(
                    q, k, v, causal=causal, segment_ids=None, scale=scale, window=None, softcap=None
                )

        else:

            def fwd(q, k, v, _b=sdp[name]):
                with sdpa_kernel([_b]):
                    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, **gqa)

        def fwd_bwd(q, k, v, do, fwd=fwd):
            qq, kk, vv = (x.detach().requires_grad_(True) for x in (q, k, v))
            out = fwd(qq, kk, vv)
            return torch.autograd.grad(out, (qq, kk, vv), do)

        for pss, fn, args in (("fwd", fwd, (q, k, v)), ("fwd_bwd", fwd_bwd, (q, k, v, do))):
            why = reason
            if why is None and impl == TORCH_FLEX and pss == "fwd_bwd" and dev == "cpu":
                why = f"FlexAttention has no backward on a CPU (torch {torch.__version__})"
            if why is not None:
                records.append(_record(impl, "torch", pss, status="skipped", reason=why, **_kw(base)))
                continue
            try:
                measure.torch_reset_peak()
                grad_ctx = torch.no_grad() if pss == "fwd" else torch.enable_grad()
                with grad_ctx:
                    t = measure.timeit(fn, *args, warmup=warmup, iters=iters)
            except Exception as e:
                records.append(
                    _record(impl, "torch", pss, status="skipped", reason=f"error: {_first_line(e)}", **_kw(base))
                )
                continue
            if calls is not None:

                def again(fn=fn, args=args, pss=pss):
                    with torch.no_grad() if pss == "fwd" else torch.enable_grad():
                        return fn(*args)

                calls[len(records)] = again
            records.append(_timed_record(impl, "torch", pss, t, measure.torch_peak_memory(), base))


# --------------------------------------------------------------------------------------------- entry
def run(
    quick: bool,
    impls: Iterable[str] | None = None,
    max_seq: int | None = None,
    head_dims: Iterable[int] | None = None,
) -> list[dict]:
    """Benchmark every implementation on every shape; returns the records (see the module docstring).

    ``impls`` (optional) keeps only records whose ``impl`` is listed (e.g. ``["flash", "sdpa:flash"]``),
    ``max_seq`` drops longer shapes and ``head_dims`` keeps only those head dims — for splitting a long GPU sweep
    into several runs, or a short GPU session's D=128 first (all checked first by :func:`check_filters`)."""
    shapes = check_filters(quick, impls, max_seq, head_dims)
    iters, warmup = 20, 3
    records: list[dict] = measure.rows()
    wanted = None if impls is None else set([impls] if isinstance(impls, str) else impls)
    for shape in shapes:
        calls: dict = {}  # index of an ok record -> its timed call, kept for the pair below
        _run_jax(records, quick, shape, iters, warmup, wanted, calls)
        try:
            import torch  # noqa: F401
        except ImportError as e:
            for impl in TORCH_IMPLS:
                for pss in ("fwd", "fwd_bwd"):
                    dtype, b, hq, hkv, s, d, causal = shape
                    records.append(
                        _record(
                            impl,
                            "torch",
                            pss,
                            status="skipped",
                            reason=_first_line(e),
                            dtype=dtype,
                            b=b,
                            hq=hq,
                            hkv=hkv,
                            s=s,
                            d=d,
                            causal=causal,
                        )
                    )
            continue
        _run_torch(records, quick, shape, iters, warmup, wanted, calls)
        _pair_fastest(records, calls)
    return records


def _pair_fastest(records: list[dict], calls: dict) -> None:
    """Per pass of this shape, the fastest JAX and the fastest torch implementation timed again as a pair
    (``measure.timeit_paired``: alternating rounds); both records get the pair (its ratio = the row's speed-up,
    with a 95% interval and the ``unstable`` label) and the two implementations it compared."""
    for pss in ("fwd", "fwd_bwd"):
        best = {}
        for i in calls:
            r = records[i]
            if r["pass"] == pss and (
                r["framework"] not in best or r["median_ms"] < best[r["framework"]][1]["median_ms"]
            ):
                best[r["framework"]] = (i, r)
        if set(best) != {"jax", "torch"}:
            continue
        t = measure.timeit_paired({fw: calls[i] for fw, (i, _) in best.items()}, rounds=10, per_round=3, warmup=1)
        paired = dict(t["paired"], jax_impl=best["jax"][1]["impl"], torch_impl=best["torch"][1]["impl"])
        for fw, (_, r) in best.items():
            r.update(paired=paired, cv=t[fw]["cv"])
