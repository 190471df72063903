"""A windowed model's prefill of a long prompt in one call vs in chunks appended to its ring, paired and interleaved,
in each twin: ``benchmarks/NOTES.md``, "A chunked prefill into the ring".

    python -m benchmarks.tools.chunked_prefill [--framework jax|torch|both --preset 125m --window 256 --chunk 256
                                                --batch 1 --length 4096 --out DIR]   # DIR/chunked_prefill.json

The ``--preset`` as a Mistral with ``sliding_window = --window`` (random weights, fp32, seed 0), on each framework's
default device, prefills ``--batch`` random prompts of ``--length`` tokens the two ways ``generate`` does:
``one-call``, the whole prompt into a plain cache of ``length`` slots whose window goes into a ring of w slots
(``KVCache.ring`` / ``ring_into``); ``chunked``, ``--chunk`` tokens per call appended to a ring of ``w + chunk - 1``
slots (``generate(prefill_chunk=...)``'s own prefill: ``jaxattn.generate._chunked_prefill``,
``torchref.generate._prefill``). Both must give the same last-token logits (checked first); then each is timed, each
call waited for (``measure.sync``). Prints each way's median and 10th-90th percentile and the paired ratio chunked /
one-call with its 95% interval (``twincore.timing.paired_ratio``); for JAX also each compiled program's temp bytes
(XLA's ``memory_analysis``: the buffers the prefill needs beside its inputs and outputs).
"""

from __future__ import annotations

import argparse

import numpy as np

LOGITS_TOL = 1e-4  # fp32 full-model logits (design §7): the two ways sum the same keys in another order


def _jax(cfg, tokens, window: int, chunk: int):
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jaxattn.generate import _chunked_prefill
    from jaxattn.kv_cache import KVCache
    from jaxattn.model import Llama

    graphdef, state = nnx.split(Llama(cfg, rngs=nnx.Rngs(0)))
    b, p = tokens.shape

    def one_call(state, tokens, lengths):
        logits, cache = nnx.merge(graphdef, state)(
            tokens, cache=KVCache.init(cfg, b, p), logits_at=(lengths - 1)[:, None]
        )
        return logits[:, 0], cache.with_lengths(lengths).ring(window)

    def chunked(state, tokens, lengths):
        cache = KVCache.init(cfg, b, window + chunk - 1, append=True)
        return _chunked_prefill(graphdef, state, cache, tokens, lengths, chunk)

    args = (state, jnp.asarray(tokens, jnp.int32), jnp.full((b,), p, jnp.int32))
    compiled = {name: jax.jit(fn).lower(*args).compile() for name, fn in (("one-call", one_call), ("chunked", chunked))}
    temp = {name: int(c.memory_analysis().temp_size_in_bytes) for name, c in compiled.items()}
    return {name: (lambda c=c: c(*args)[0]) for name, c in compiled.items()}, temp


def _torch(cfg, tokens, window: int, chunk: int):
    import torch

    from torchref.generate import _prefill
    from torchref.kv_cache import KVCache
    from torchref.model import LlamaForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval().to(device)
    b, p = tokens.shape
    tok = torch.as_tensor(tokens, device=device).long()
    lengths = torch.full((b,), p, device=device, dtype=torch.long)

    @torch.no_grad()
    def one_call():
        return _prefill(model, tok, lengths, KVCache(cfg, b, window, device=device))

    @torch.no_grad()
    def chunked():
        return _prefill(model, tok, lengths, KVCache(cfg, b, window + chunk - 1, device=device, append=True), chunk)

    return {"one-call": one_call, "chunked": chunked}, None


def measure_one(framework: str, cfg, args) -> dict:
    """One twin's parity check and paired timing (module doc): ``{"times", "ratio", "temp_bytes"}``."""
    from .. import measure

    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (args.batch, args.length))
    calls, temp = (_jax if framework == "jax" else _torch)(cfg, tokens, args.window, args.chunk)
    times, ratio = measure.checked_pair(
        calls, "chunked", "one-call", LOGITS_TOL, rounds=args.rounds, per_round=1, warmup=1
    )
    return {"times": times, "ratio": ratio, "temp_bytes": temp}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m benchmarks.tools.chunked_prefill", description=__doc__.split("\n")[0])
    p.add_argument("--framework", choices=["jax", "torch", "both"], default="both")
    p.add_argument("--preset", default="125m")
    p.add_argument("--window", type=int, default=256, help="the model's sliding_window w")
    p.add_argument("--chunk", type=int, default=256, help="tokens per appending call (the ring: w + chunk - 1 slots)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--length", type=int, default=4096, help="prompt tokens (a multiple of --chunk, > w)")
    p.add_argument("--rounds", type=int, default=6, help="time_interleaved rounds (order reversed every other)")
    p.add_argument("--out", default=None, help="also write DIR/chunked_prefill.json")
    args = p.parse_args(argv)
    for name in ("window", "chunk", "batch", "rounds"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.length <= args.window or args.length % args.chunk:
        p.error(f"--length must exceed --window={args.window} and be a multiple of --chunk={args.chunk}")

    from twincore.config import ModelConfig

    from .. import measure

    cfg = ModelConfig.preset(args.preset).replace(model_type="mistral", sliding_window=args.window)
    cfg = cfg.replace(max_seq_len=max(cfg.max_seq_len, args.length))
    frameworks = ["jax", "torch"] if args.framework == "both" else [args.framework]
    res = {"tool": "chunked_prefill", "env": measure.env_info(), "args": vars(args)}
    for fw in frameworks:
        one = res[fw] = measure_one(fw, cfg, args)
        print(
            f"{fw} {args.preset} as mistral w={args.window} B={args.batch} prompt={args.length}: one call (a cache "
            f"of {args.length} slots, then its window) vs {args.chunk} per call (a ring of "
            f"{args.window + args.chunk - 1} slots)"
        )
        temp = one["temp_bytes"] or {}
        extra = {name: f", compiled temp {b / 2**20:.1f} MiB" for name, b in temp.items()}
        measure.print_paired(one["times"], one["ratio"], "chunked / one-call", digits=0, extra=extra)
    measure.write_record(args.out, "chunked_prefill.json", res)
    return res


if __name__ == "__main__":
    main()
