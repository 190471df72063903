"""Masked attention forwards, three ways, paired and interleaved in one process: ``benchmarks/NOTES.md``,
"torch's FlexAttention beside SDPA and JAX's default, on masks".

    python -m benchmarks.tools.masked_attention [--seq 1024,4096 --window 256 --docs 4 --batch 1 --heads 8/2
                                                 --dim 64 --dtype float32 --rounds 6 --out DIR]
                                                 # writes DIR/masked_attention.json

Per sequence length S and per mask (``window``: causal with a sliding window of ``--window`` keys; ``documents``:
``--docs`` packed documents of random lengths, causal within each), one forward call on each framework's default
device (a GPU when there is one; the GPU session's ``masked`` step), timed as:

* ``sdpa``: ``torchref.attention.dot_product_attention`` with no backend named (SDPA's choice, the mask dense);
* ``flex``: the same call with ``backend="flex"`` (``torchref.flex_attention``: FlexAttention, compiled);
* ``jax``: ``jaxattn.attention.dot_product_attention`` jitted, default backends (``chunked`` on a CPU, ``flash`` for
  these masks on a GPU).

All three must agree (checked first: within 1e-4 in float32, 3e-2 in bfloat16). Prints each call's median and
10th-90th percentile, and the paired ratios sdpa / flex (FlexAttention's speed-up in torch) and jax / flex with their
95% intervals (``twincore.timing.paired_ratio``), flagged UNSTABLE when wide.
"""

from __future__ import annotations

import argparse

import numpy as np

# the three outputs' agreement, checked before timing: fp32 (design §7); bf16: each output rounded to 8 bits of
# mantissa (|out| <~ 1, about 4e-3 each) and summed in other orders
TOL = {"float32": 1e-4, "bfloat16": 3e-2}
MASKS = ("window", "documents")


def _inputs(rng, b, s, hq, hkv, d, mask, window, docs):
    q = rng.standard_normal((b, s, hq, d)).astype(np.float32)
    k, v = (rng.standard_normal((b, s, hkv, d)).astype(np.float32) for _ in range(2))
    call = dict(causal=True)
    if mask == "window":
        call["window"] = (window, 0)
    else:  # document boundaries at random positions: ids 0..docs-1, sorted along the row
        cuts = np.sort(rng.choice(np.arange(1, s), size=(b, docs - 1), replace=False), axis=1)
        ids = (np.arange(s)[None, :, None] >= cuts[:, None, :]).sum(-1).astype(np.int32)
        call["segment_ids"] = ids
    return q, k, v, call


def calls_for(q, k, v, call, dtype: str = "float32"):
    """``{"sdpa", "flex", "jax"}`` -> a zero-argument call returning the output as numpy-convertible [B, S, H, D]
    (q, k, v cast to ``dtype`` first)."""
    import jax
    import jax.numpy as jnp
    import torch

    from jaxattn.attention import dot_product_attention as jax_attention
    from torchref.attention import dot_product_attention as torch_attention

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    T = lambda x: torch.as_tensor(x).transpose(1, 2).contiguous().to(dev, getattr(torch, dtype))  # noqa: E731
    tq, tk, tv = T(q), T(k), T(v)
    tcall = {n: (torch.as_tensor(x).to(dev) if n == "segment_ids" else x) for n, x in call.items()}
    jcall = {n: (jnp.asarray(x) if n == "segment_ids" else x) for n, x in call.items()}
    jq, jk, jv = (jnp.asarray(x, dtype) for x in (q, k, v))
    jitted = jax.jit(lambda q, k, v: jax_attention(q, k, v, **jcall))

    def torch_call(backend):
        @torch.no_grad()
        def run():
            return torch_attention(tq, tk, tv, **tcall, backend=backend).transpose(1, 2)

        return run

    return {"sdpa": torch_call(None), "flex": torch_call("flex"), "jax": lambda: jitted(jq, jk, jv)}


def _numpy(x):
    return x.detach().float().cpu().numpy() if hasattr(x, "detach") else np.asarray(x, np.float32)


def measure_one(s: int, mask: str, args) -> dict:
    from benchmarks import measure
    from twincore.timing import paired_ratio, time_interleaved

    hq, hkv = args.heads
    q, k, v, call = _inputs(np.random.default_rng(s), args.batch, s, hq, hkv, args.dim, mask, args.window, args.docs)
    calls = calls_for(q, k, v, call, args.dtype)
    outs = {name: _numpy(c()) for name, c in calls.items()}  # also the compiles, before any timing
    for name in ("sdpa", "jax"):
        tol = TOL[args.dtype]
        np.testing.assert_allclose(outs[name], outs["flex"], atol=tol, rtol=0, err_msg=f"{name} != flex at S={s}")
    times = time_interleaved(calls, rounds=args.rounds, per_round=3, warmup=1, sync=measure.sync)
    cv = [times[n]["cv"] for n in calls]
    ratios = {f"{n}/flex": paired_ratio(times[n]["rounds"], times["flex"]["rounds"], cv=cv) for n in ("sdpa", "jax")}
    print(
        f"S={s} {mask}"
        + (f" (w={args.window})" if mask == "window" else f" ({args.docs} documents)")
        + f", {args.dtype}"
    )
    for label, r in ratios.items():
        measure.print_paired({n: times[n] for n in (label.split("/")[0], "flex")}, r, label, digits=2)
    return {
        "S": s,
        "mask": mask,
        "median_ms": {n: float(np.median(t["calls"]) * 1e3) for n, t in times.items()},
        "p10_p90_ms": {
            n: [float(x) for x in np.percentile(np.asarray(t["calls"]) * 1e3, [10, 90])] for n, t in times.items()
        },
        "ratios": ratios,
    }


def _seqs(text: str) -> list[int]:
    try:
        seqs = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated sequence lengths, got {text!r}") from None
    if not seqs or any(x < 2 for x in seqs):
        raise argparse.ArgumentTypeError(f"sequence lengths must be >= 2, got {text!r}")
    return seqs


def _heads(text: str) -> tuple[int, int]:
    try:
        hq, hkv = (int(x) for x in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected query/kv heads such as 8/2, got {text!r}") from None
    if hkv < 1 or hq % hkv:
        raise argparse.ArgumentTypeError(f"query heads must be a multiple of kv heads >= 1, got {text!r}")
    return hq, hkv


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.tools.masked_attention", description=__doc__.split("\n")[0])
    p.add_argument("--seq", type=_seqs, default=[1024, 4096], help="sequence lengths, comma-separated")
    p.add_argument("--mask", choices=MASKS, action="append", help="masks to time (default: both)")
    p.add_argument("--window", type=int, default=256, help="sliding window, keys to the left")
    p.add_argument("--docs", type=int, default=4, help="packed documents per row (the documents mask)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=_heads, default=(8, 2), help="query/kv heads")
    p.add_argument("--dim", type=int, default=64, help="head dim")
    p.add_argument("--dtype", choices=tuple(TOL), default="float32")
    p.add_argument("--rounds", type=int, default=6, help="interleaved rounds (3 calls each)")
    p.add_argument("--out", help="write DIR/masked_attention.json")
    args = p.parse_args(argv)
    for name in ("window", "docs", "batch", "dim", "rounds"):
        if getattr(args, name) < (2 if name in ("docs", "rounds") else 1):
            p.error(f"--{name} must be >= {2 if name in ('docs', 'rounds') else 1}, got {getattr(args, name)}")
    if min(args.seq) <= args.docs:
        p.error(f"--seq {min(args.seq)} holds no {args.docs} documents: give sequences longer than --docs")
    from benchmarks import measure

    rows = [measure_one(s, mask, args) for s in args.seq for mask in (args.mask or MASKS)]
    config = {k: v for k, v in vars(args).items() if k != "out"}
    measure.write_record(args.out, "masked_attention.json", {"env": measure.env_info(), "args": config, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
