"""Prefill with every position's logits (the old ``generate``) vs only each row's last (``logits_at``), one twin
per process, paired and interleaved (old, new, old, new, ...): ``benchmarks/NOTES.md``, "Prefill keeps only the
last logits".

    python -m benchmarks.tools.prefill_last --framework jax   [--preset 125m --prompt 512 --new 32 --pairs 15]
    python -m benchmarks.tools.prefill_last --framework torch

Random ``--preset`` weights (fp32, seed 0), B = 1, a prompt of ``--prompt`` random ids, the KV cache sized as
``generate`` sizes it for ``--new`` new tokens. Prints each variant's median and 10th-90th percentile time, the
median and spread of the per-pair ratio new / old, and (JAX) the compiled prefill programs' temp bytes.
"""

from __future__ import annotations

import argparse
import time

import numpy as np


def _jax(cfg, tokens, lengths, t):
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jaxattn import generate as jgen
    from jaxattn.model import Llama

    model = Llama(cfg, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    spec = jgen._cache_spec(cfg, len(tokens), t, jnp.float32)
    new, _ = jgen._programs_for(graphdef, 0.0, None, None, None, False, spec)  # jitted, its stop ids unbound

    @jax.jit
    def old(stop, state, tokens, lengths, key):  # generate's prefill before logits_at (its empty cache made inside too)
        logits, cache = nnx.merge(graphdef, state)(tokens, cache=jgen._empty_cache(spec))  # [B, P, vocab]
        last = jnp.take_along_axis(logits, (lengths - 1)[:, None, None], axis=1)[:, 0]  # [B, vocab]
        return jgen.sample(last, key, 0.0, None, None), cache.with_lengths(lengths)

    args = (jgen._stop_ids(()), state, jnp.asarray(tokens), jnp.asarray(lengths), jax.random.PRNGKey(0))
    temp = {}
    for name, fn in (("old", old), ("new", new)):
        temp[name] = fn.lower(*args).compile().memory_analysis().temp_size_in_bytes
    same = [int(np.asarray(fn(*args)[0])[0]) for fn in (old, new)]
    assert same[0] == same[1], same

    def call(fn):
        return lambda: jax.block_until_ready(fn(*args))

    return {"old": call(old), "new": call(new)}, temp


def _torch(cfg, tokens, lengths, t):
    import torch

    from torchref.generate import _prefill
    from torchref.kv_cache import KVCache
    from torchref.model import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    tok, lens = torch.from_numpy(tokens).long(), torch.from_numpy(lengths).long()
    cache = KVCache(cfg, len(tokens), t)

    @torch.no_grad()
    def old():  # generate's prefill before logits_at
        cache.lengths.zero_()
        logits = model(tok, cache=cache)  # [B, P, vocab]
        cache.set_lengths(lens)
        return logits[torch.arange(len(tokens)), lens - 1].argmax(-1)

    @torch.no_grad()
    def new():
        cache.lengths.zero_()
        return _prefill(model, tok, lens, cache).argmax(-1)

    assert old().tolist() == new().tolist()
    return {"old": old, "new": new}, None


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.tools.prefill_last", description=__doc__.split("\n")[0])
    p.add_argument("--framework", choices=["jax", "torch"], required=True)
    p.add_argument("--preset", default="125m")
    p.add_argument("--prompt", type=int, default=512, help="prompt tokens (B = 1)")
    p.add_argument("--new", type=int, default=32, help="new tokens the cache is sized for, as generate sizes it")
    p.add_argument("--pairs", type=int, default=15, help="timed (old, new) pairs after one warm-up pair")
    args = p.parse_args(argv)

    from twincore.config import ModelConfig
    from twincore.generate import prepare

    cfg = ModelConfig.preset(args.preset)
    prompt = np.random.default_rng(0).integers(0, cfg.vocab_size, args.prompt).tolist()
    tokens, lengths, t, _ = prepare([prompt], args.new, 0.0, None, None, None, None, cfg)
    fns, temp = (_jax if args.framework == "jax" else _torch)(cfg, tokens, lengths, t)
    times = {"old": [], "new": []}
    for i in range(args.pairs + 1):  # the first pair warms up (compiles, allocator growth)
        for name in ("old", "new"):
            t0 = time.perf_counter()
            fns[name]()
            if i:
                times[name].append(time.perf_counter() - t0)
    print(f"{args.framework} {args.preset} B=1 prompt={args.prompt} (bucket {tokens.shape[1]}) cache={t}")
    for name in ("old", "new"):
        a = np.asarray(times[name])
        print(f"  {name}: median {np.median(a):.3f} s, p10-p90 {np.percentile(a, 10):.3f}-{np.percentile(a, 90):.3f} s")
    r = np.asarray(times["new"]) / np.asarray(times["old"])
    print(
        f"  new/old per pair: median {np.median(r):.3f}, p10-p90 {np.percentile(r, 10):.3f}-{np.percentile(r, 90):.3f}"
    )
    if temp:
        print(f"  compiled temp: old {temp['old'] / 2**20:.1f} MiB, new {temp['new'] / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
