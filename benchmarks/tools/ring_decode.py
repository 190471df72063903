"""A windowed model's decode step on a ring KV cache of w slots vs a plain cache of the generation's length, paired
and interleaved, in each twin: ``benchmarks/NOTES.md``, "A ring KV cache for windowed models".

    python -m benchmarks.tools.ring_decode [--framework jax|torch|both --preset 125m --window 256 --batch 8
                                            --length 1900 --out DIR]   # DIR/ring_decode.json (the GPU session's)

The ``--preset`` as a Mistral with ``sliding_window = --window`` (random weights, fp32, seed 0), on each framework's
default device (a GPU where there is one: the torch model is moved there). Both caches hold the same random keys and
values at ``--length`` tokens per row, drawn on the device: the plain one in slots ``0 .. length - 1`` of
``bucket(length + steps)`` slots (as ``generate`` sized it before the ring), the ring the last w of them in slot
``p % w`` (the twin's own fold: ``KVCache.ring`` / ``ring_into``). One step from each must give the same logits
(checked first); then each cache advances a token per call, donated (JAX) or written in place (torch) as ``generate``
does, each call waited for (``measure.sync``). Prints each cache's median step and 10th-90th percentile, and the
paired ratio ring / plain with its 95% interval (``twincore.timing.paired_ratio``).
"""

from __future__ import annotations

import argparse

import numpy as np

from twincore.generate import bucket

LOGITS_TOL = 1e-4  # fp32 full-model logits (design §7): the two caches sum the same slots in another order


def _jax(cfg, batch: int, slots: int, length: int, window: int, tokens):
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jaxattn.kv_cache import KVCache
    from jaxattn.model import Llama

    graphdef, state = nnx.split(Llama(cfg, rngs=nnx.Rngs(0)))
    step = jax.jit(lambda st, tok, c: nnx.merge(graphdef, st)(tok, cache=c), donate_argnums=2)
    shape = (cfg.n_layers, batch, slots, cfg.n_kv_heads, cfg.resolved_head_dim)  # the slots on axis 2
    k, v = (jax.random.normal(jax.random.PRNGKey(i), shape, jnp.float32) for i in (1, 2))
    lengths = lambda: jnp.full((batch,), length, jnp.int32)  # noqa: E731  (one each: a donated cache takes its own)
    live = {"ring": KVCache(k, v, lengths()).ring(window)}  # the twin's own fold, as generate's prefill does
    live = {"plain": KVCache(k, v, lengths()), **live}
    tok = jnp.asarray(tokens, jnp.int32)

    def call(name):
        def run():
            logits, live[name] = step(state, tok, live[name])
            return logits

        return run

    return {name: call(name) for name in live}


def _torch(cfg, batch: int, slots: int, length: int, window: int, tokens):
    import torch

    from torchref.kv_cache import KVCache
    from torchref.model import LlamaForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval().to(device)
    shape = (cfg.n_layers, batch, cfg.n_kv_heads, slots, cfg.resolved_head_dim)  # torch's layout: slots on axis 3
    gen = torch.Generator(device=device).manual_seed(1)
    k, v = (torch.randn(shape, generator=gen, device=device) for _ in range(2))
    plain = KVCache(cfg, batch, slots, device=device)
    plain.k.copy_(k)
    plain.v.copy_(v)
    plain.set_lengths([length] * batch)
    live = {"plain": plain, "ring": plain.ring_into(KVCache(cfg, batch, window, device=device))}  # generate's fold
    tok = torch.as_tensor(np.asarray(tokens), device=device).long()

    def call(name):
        @torch.no_grad()
        def run():
            return model(tok, cache=live[name])

        return run

    return {name: call(name) for name in live}


def measure_one(framework: str, cfg, args) -> dict:
    """One twin's parity step and paired timing (module doc): ``{"times", "ratio", "slots"}``."""
    from .. import measure

    warmup = 2
    steps = 1 + warmup + args.rounds * args.per_round  # the parity step, then time_interleaved's calls
    slots = bucket(args.length + steps)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (args.batch, 1))
    build = _jax if framework == "jax" else _torch
    calls = build(cfg, args.batch, slots, args.length, args.window, tokens)
    times, ratio = measure.checked_pair(
        calls, "ring", "plain", LOGITS_TOL, rounds=args.rounds, per_round=args.per_round, warmup=warmup
    )
    return {"times": times, "ratio": ratio, "slots": slots}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m benchmarks.tools.ring_decode", description=__doc__.split("\n")[0])
    p.add_argument("--framework", choices=["jax", "torch", "both"], default="both")
    p.add_argument("--preset", default="125m")
    p.add_argument("--window", type=int, default=256, help="the model's sliding_window w: the ring's slots")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--length", type=int, default=1900, help="tokens each row holds when the timing starts (> w)")
    p.add_argument("--rounds", type=int, default=8, help="time_interleaved rounds (order reversed every other)")
    p.add_argument("--per-round", type=int, default=3, help="steps of each cache per round")
    p.add_argument("--out", default=None, help="also write DIR/ring_decode.json")
    args = p.parse_args(argv)
    if not 1 <= args.window < args.length:
        p.error(f"--window must be in [1, --length={args.length}), got {args.window}")

    from twincore.config import ModelConfig

    from .. import measure

    cfg = ModelConfig.preset(args.preset).replace(model_type="mistral", sliding_window=args.window)
    frameworks = ["jax", "torch"] if args.framework == "both" else [args.framework]
    res = {"tool": "ring_decode", "env": measure.env_info(), "args": vars(args)}
    for fw in frameworks:
        one = res[fw] = measure_one(fw, cfg, args)
        print(
            f"{fw} {args.preset} as mistral w={args.window} B={args.batch} length={args.length}: "
            f"plain cache {one['slots']} slots, ring {args.window}"
        )
        measure.print_paired(one["times"], one["ratio"], "ring / plain")
    measure.write_record(args.out, "ring_decode.json", res)
    return res


if __name__ == "__main__":
    main()
