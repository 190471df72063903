"""A windowed model's decode step on a ring KV cache of w slots vs a plain cache of the generation's length, one twin
per process, paired and interleaved: ``benchmarks/NOTES.md``, "A ring KV cache for windowed models".

    python -m benchmarks.tools.ring_decode --framework jax   [--preset 125m --window 256 --batch 8 --length 1900]
    python -m benchmarks.tools.ring_decode --framework torch

The ``--preset`` as a Mistral with ``sliding_window = --window`` (random weights, fp32, seed 0). Both caches hold the
same random keys and values at ``--length`` tokens per row: the plain one in slots ``0 .. length - 1`` of
``bucket(length + steps)`` slots (as ``generate`` sized it before the ring), the ring the last w of them in slot
``p % w``. One step from each must give the same logits (checked first); then each cache advances a token per call,
donated (JAX) or written in place (torch) as ``generate`` does. Prints each cache's median step and 10th-90th
percentile, and the paired ratio ring / plain with its 95% interval (``twincore.timing.paired_ratio``).
"""

from __future__ import annotations

import argparse

import numpy as np

from twincore.generate import bucket
from twincore.timing import paired_ratio, time_interleaved

LOGITS_TOL = 1e-4  # fp32 full-model logits (design §7): the two caches sum the same slots in another order


def ring_of(full: np.ndarray, length: int, window: int, axis: int) -> np.ndarray:
    """The ring of ``window`` slots holding positions ``length - window .. length - 1`` of a plain cache's slot
    axis ``axis``: slot j holds the newest position p < length with ``p % window == j``."""
    j = np.arange(window)
    return np.take(full, (length - 1) - ((length - 1 - j) % window), axis=axis)


def _jax(cfg, caches, tokens):
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jaxattn.kv_cache import KVCache
    from jaxattn.model import Llama

    graphdef, state = nnx.split(Llama(cfg, rngs=nnx.Rngs(0)))
    step = jax.jit(lambda st, tok, c: nnx.merge(graphdef, st)(tok, cache=c), donate_argnums=2)
    live = {
        name: KVCache(jnp.asarray(k), jnp.asarray(v), jnp.asarray(lengths, jnp.int32))
        for name, (k, v, lengths) in caches.items()
    }
    tok = jnp.asarray(tokens, jnp.int32)

    def call(name):
        def run():
            logits, live[name] = step(state, tok, live[name])
            return jax.block_until_ready(logits)

        return run

    return {name: call(name) for name in live}


def _torch(cfg, caches, tokens):
    import torch

    from torchref.kv_cache import KVCache
    from torchref.model import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    live = {}
    for name, (k, v, lengths) in caches.items():
        c = live[name] = KVCache(cfg, k.shape[1], k.shape[2])
        c.k.copy_(torch.from_numpy(k).transpose(2, 3))  # [L, B, T, Hkv, D] -> torch's [L, B, Hkv, T, D]
        c.v.copy_(torch.from_numpy(v).transpose(2, 3))
        c.set_lengths(lengths)
    tok = torch.from_numpy(np.asarray(tokens)).long()

    def call(name):
        @torch.no_grad()
        def run():
            return model(tok, cache=live[name])

        return run

    return {name: call(name) for name in live}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m benchmarks.tools.ring_decode", description=__doc__.split("\n")[0])
    p.add_argument("--framework", choices=["jax", "torch"], required=True)
    p.add_argument("--preset", default="125m")
    p.add_argument("--window", type=int, default=256, help="the model's sliding_window w: the ring's slots")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--length", type=int, default=1900, help="tokens each row holds when the timing starts (> w)")
    p.add_argument("--rounds", type=int, default=8, help="time_interleaved rounds (order reversed every other)")
    p.add_argument("--per-round", type=int, default=3, help="steps of each cache per round")
    args = p.parse_args(argv)
    if not 1 <= args.window < args.length:
        p.error(f"--window must be in [1, --length={args.length}), got {args.window}")

    from twincore.config import ModelConfig

    cfg = ModelConfig.preset(args.preset).replace(model_type="mistral", sliding_window=args.window)
    warmup = 2
    steps = 1 + warmup + args.rounds * args.per_round  # the parity step, then time_interleaved's calls
    slots = bucket(args.length + steps)
    rng = np.random.default_rng(0)
    shape = (cfg.n_layers, args.batch, slots, cfg.n_kv_heads, cfg.resolved_head_dim)
    k, v = (rng.standard_normal(shape, np.float32) for _ in range(2))
    lengths = np.full(args.batch, args.length, np.int32)
    caches = {
        "plain": (k, v, lengths),
        "ring": (ring_of(k, args.length, args.window, 2), ring_of(v, args.length, args.window, 2), lengths),
    }
    tokens = rng.integers(0, cfg.vocab_size, (args.batch, 1))
    calls = (_jax if args.framework == "jax" else _torch)(cfg, caches, tokens)
    first = {name: np.asarray(call()) for name, call in calls.items()}
    np.testing.assert_allclose(first["ring"], first["plain"], atol=LOGITS_TOL, rtol=0, err_msg="ring != plain")
    times = time_interleaved(calls, rounds=args.rounds, per_round=args.per_round, warmup=warmup)
    ratio = paired_ratio(times["ring"]["rounds"], times["plain"]["rounds"], cv=[t["cv"] for t in times.values()])
    print(
        f"{args.framework} {args.preset} as mistral w={args.window} B={args.batch} length={args.length}: "
        f"plain cache {slots} slots, ring {args.window}"
    )
    for name in calls:
        a = np.asarray(times[name]["calls"])
        print(
            f"  {name}: median {np.median(a) * 1e3:.1f} ms, p10-p90 {np.percentile(a, 10) * 1e3:.1f}-"
            f"{np.percentile(a, 90) * 1e3:.1f} ms"
        )
    lo, hi = ratio["ci"]
    flag = f" UNSTABLE ({ratio['why']})" if ratio["unstable"] else ""
    print(f"  ring / plain per round: median {ratio['ratio']:.3f}, 95% interval {lo:.3f}-{hi:.3f}{flag}")
    return {"times": times, "ratio": ratio, "slots": slots}


if __name__ == "__main__":
    main()
