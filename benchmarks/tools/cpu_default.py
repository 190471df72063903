"""JAX's default attention backends against ``xla`` alone, at the model level, paired and interleaved:
``benchmarks/NOTES.md``, "JAX's CPU default: `chunked` for a block of queries".

    python -m benchmarks.tools.cpu_default [--preset 125m --train 8x256 --prefill 1x2048 --rounds 6 --out DIR]

The ``--preset`` (random weights, fp32, seed 0) on jax's default device: a training step's loss and gradients at
``--train BxS`` and a forward over ``--prefill BxS`` tokens, each jitted twice, traced under
``attention_backend("xla")`` (the CPU default before) and under no backend block (today's default: on a CPU
``chunked`` first for a block of queries). Both must agree (fp32 1e-4 on the loss and the logits, checked first);
then they are timed, paired (``measure.checked_pair``), and the ratio default / xla printed with its 95% interval.
At a shape under the default's key-length floor (128 keys on a CPU) both ways are ``xla``; each call's record names
the default it got.

    python -m benchmarks.tools.cpu_default --sweep 8,32,128,512 [--preset tiny --train 2x8]

``--sweep``: instead, for each S the training step at ``--train``'s B under ``xla`` and under ``chunked`` (named):
its first call (trace and compile) and the median of ``--rounds`` calls after it, unpaired, where the floor comes
from (``benchmarks/NOTES.md``, "A key-length floor").
"""

from __future__ import annotations

import argparse

import numpy as np

TOL = 1e-4  # fp32 full-model logits and loss (design §7): two attention backends sum in another order


def _shape(text: str) -> tuple[int, int]:
    b, s = (int(x) for x in text.lower().split("x"))
    if b < 1 or s < 1:
        raise argparse.ArgumentTypeError(f"expected BxS with B, S >= 1, got {text!r}")
    return b, s


def _calls(model, what: str, tokens, ways=(("xla", ("xla",)), ("default", None))):
    """``{name: f}`` for each ``(name, backends)`` of ``ways``: the jitted ``what`` ("train": loss and gradients;
    "prefill": logits) traced under ``attention_backend(*backends)``, or under the default for None."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jaxattn.attention import attention_backend

    graphdef, state = nnx.split(model)
    x = jnp.asarray(tokens, jnp.int32)

    def run(state, x):
        m = nnx.merge(graphdef, state)
        if what == "prefill":
            return m(x)
        logits = m(x[:, :-1]).astype(jnp.float32)
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), x[:, 1:, None], axis=-1))

    fn = run if what == "prefill" else jax.value_and_grad(run)

    def traced(backends):
        def body(state, x):
            if backends is None:
                return fn(state, x)
            with attention_backend(*backends):
                return fn(state, x)

        step = jax.jit(body)
        return lambda: step(state, x)[0]  # the logits, or the loss (the gradients computed, not compared)

    return {name: traced(backends) for name, backends in ways}


def _sweep(model, vocab: int, batch: int, lengths, rounds: int) -> dict:
    """``{S: {backend: {"first_s", "median_ms"}}}`` of the training step under ``xla`` and ``chunked``, unpaired."""
    import time

    import jax

    rng, out = np.random.default_rng(0), {}
    print(f"training step, B={batch}: first call (s) / median of {rounds} calls after it (ms)")
    for s in lengths:
        calls = _calls(
            model, "train", rng.integers(0, vocab, (batch, s + 1)), (("xla", ("xla",)), ("chunked", ("chunked",)))
        )
        row = out[s] = {}
        for name, call in calls.items():
            t0 = time.perf_counter()
            jax.block_until_ready(call())
            first = time.perf_counter() - t0
            times = []
            for _ in range(rounds):
                t0 = time.perf_counter()
                jax.block_until_ready(call())
                times.append(time.perf_counter() - t0)
            row[name] = {"first_s": first, "median_ms": 1e3 * float(np.median(times))}
        print(f"  S={s}: " + ", ".join(f"{n} {r['first_s']:.2f} s / {r['median_ms']:.2f} ms" for n, r in row.items()))
    return out


def _lengths(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",")]
    except ValueError:
        out = []
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated lengths >= 1, e.g. 8,32,128, got {text!r}")
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m benchmarks.tools.cpu_default", description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="125m")
    p.add_argument("--train", type=_shape, default=(8, 256), help="BxS of the training step (default 8x256)")
    p.add_argument("--prefill", type=_shape, default=(1, 2048), help="BxS of the forward (default 1x2048)")
    p.add_argument("--rounds", type=int, default=6, help="time_interleaved rounds (order reversed every other)")
    p.add_argument("--sweep", type=_lengths, default=None, help="S,S,...: compile and run times, xla vs chunked")
    p.add_argument("--out", default=None, help="also write DIR/cpu_default.json")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error(f"--rounds must be >= 1, got {args.rounds}")

    import jax
    from flax import nnx

    from jaxattn.model import Llama
    from twincore.attention import default_order
    from twincore.config import ModelConfig

    from .. import measure

    cfg = ModelConfig.preset(args.preset)
    longest = max([args.train[1], args.prefill[1], *(args.sweep or [])])
    cfg = cfg.replace(max_seq_len=max(cfg.max_seq_len, longest))
    model = Llama(cfg, rngs=nnx.Rngs(0))
    res = {"tool": "cpu_default", "env": measure.env_info(), "args": vars(args)}
    if args.sweep:
        res["sweep"] = _sweep(model, cfg.vocab_size, args.train[0], args.sweep, args.rounds)
        measure.write_record(args.out, "cpu_default.json", res)
        return res
    rng = np.random.default_rng(0)
    for what, (b, s) in (("train", (args.train[0], args.train[1] + 1)), ("prefill", args.prefill)):
        calls = _calls(model, what, rng.integers(0, cfg.vocab_size, (b, s)))
        times, ratio = measure.checked_pair(calls, "default", "xla", TOL, rounds=args.rounds, per_round=1, warmup=1)
        n = s - (what == "train")  # queries and keys per row of each attention call
        res[what] = {"times": times, "ratio": ratio, "default": list(default_order(jax.default_backend(), n, n))}
        print(f"{what} {args.preset} B={b} S={n}: default {res[what]['default']} vs xla")
        measure.print_paired(times, ratio, "default / xla", digits=0)
    measure.write_record(args.out, "cpu_default.json", res)
    return res


if __name__ == "__main__":
    main()
