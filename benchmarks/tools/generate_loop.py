"""``generate``'s loops timed side by side, paired and interleaved in one process: ``benchmarks/NOTES.md``,
"Generation loops: the key folded in the program, the loop on the device".

    python -m benchmarks.tools.generate_loop                     [--preset tiny --prompt 16 --new 32 --rounds 15]
    python -m benchmarks.tools.generate_loop --preset 125m --out DIR   # also DIR/generate_loop.json (GPU session)

Random ``--preset`` weights (fp32, seed 0; the twins hold the same ones), B = 1, a prompt of ``--prompt`` random ids,
``--new`` greedy tokens, no EOS. Variants: ``jax:host:key-on-host`` (the host loop as it was: each step's key
``fold_in`` dispatched from Python), ``jax:host`` (``loop="host"``), ``jax:device`` (``loop="device"``),
``torch:host``, ``torch:device``, ``jax:host:eos`` (``loop="host"`` with an EOS id the greedy tokens never reach,
so the same steps in the stopping loop: a stopped row's EOS is fed inside the decode program) and
``jax:host:eos:fed-on-host`` (the same loop with that feed an eager ``where`` per step, as before),
``jax:device:eos`` (``loop="device"`` with that EOS: on a GPU its stop is read once per ``CHECK_EVERY`` steps) and
``jax:device:eos:per-step`` (the same loop with the stop read after every step, as before the chunks; on a CPU
both are one program), and with ``--graphs`` (the default where CUDA is present) ``torch:host:graphs`` and
``torch:device:graphs``: the decode step under ``torch.compile(mode="reduce-overhead")``, one CUDA graph per step
replayed on the cache ``generate`` keeps per model (its compile, 14-24 s for 125m on an H200, is in the first,
untimed call). Whether each framework's variants give the same tokens, and the two frameworks
too, is recorded (``tokens_agree``), not enforced: ``parity_tests/test_generate.py`` guards that on trained-like
logits, while a random model's near-ties may flip under a GPU's TF32 dots or another fusion. Prints each variant's
median and 10th-90th percentile per call and per token, and each ratio of a pair named in :data:`PAIRS` with its 95%
interval (``twincore.timing.paired_ratio``; ``unstable`` when wide). Each call returns Python ints, so it has
waited for its device work (the JAX and torch models sit on each framework's default device, a GPU where there is
one: the torch model is moved there). ``--out``: the same as JSON (``env``, ``args``, ``variants``, ``pairs``).
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np

PAIRS = (  # (slower, faster): the ratio printed is slower / faster per round, the speed-up of the second
    ("jax:host:key-on-host", "jax:host"),
    ("jax:host", "jax:device"),
    ("torch:host", "torch:device"),
    ("torch:device", "jax:device"),
    ("jax:host:eos:fed-on-host", "jax:host:eos"),
    ("jax:device:eos:per-step", "jax:device:eos"),
    ("torch:host:graphs", "torch:device:graphs"),  # with --graphs
    ("torch:device:graphs", "jax:device"),
)


def _key_on_host_loop(jmodel, prompt, n: int):
    """JAX's host loop as it was before the key moved into the decode program: one eager ``fold_in`` per step."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jaxattn import generate as jgen
    from twincore.generate import prepare

    tokens, lengths, t, _ = prepare([prompt], n, 0.0, None, None, None, None, jmodel.config)
    graphdef, state = nnx.split(jmodel)
    spec = jgen._cache_spec(jmodel.config, 1, t, jmodel.embed[...].dtype)
    prefill, decode = jgen._programs(graphdef, 0.0, None, None, (), spec)
    key = jax.random.PRNGKey(0)

    def run():
        token, done, cache = prefill(state, jnp.asarray(tokens), jnp.asarray(lengths), key)
        out = [int(np.asarray(token)[0])]
        for step in range(1, n):
            token, done, cache = decode(state, token, done, cache, jax.random.fold_in(key, step), step)
            out.append(int(np.asarray(token)[0]))
        return [out]

    return run


def _eos_fed_on_host(jmodel, prompt, n: int, eos: int):
    """JAX's host loop with an EOS as it was before the feed moved into the decode program: after each step, a
    stopped row's next input chosen by an eager ``jnp.where`` on the host's ``done`` (two eager ops a token)."""
    import jax.numpy as jnp
    from flax import nnx

    from jaxattn import generate as jgen
    from twincore.generate import collect, decode_steps, prepare

    tokens, lengths, t, eos_ids = prepare([prompt], n, 0.0, None, None, eos, None, jmodel.config)
    graphdef, state = nnx.split(jmodel)
    spec = jgen._cache_spec(jmodel.config, 1, t, jmodel.embed[...].dtype)
    prefill, decode = jgen._programs(graphdef, 0.0, None, None, (), spec)  # no EOS in the programs
    key = jgen._key(0)

    def run():
        token, done, cache = prefill(state, tokens, lengths, key)
        box = [done, cache]

        def advance(step, token):
            token, box[0], box[1] = decode(state, token, box[0], box[1], key, step)
            return token

        def feed_eos(token, done, eos_id):
            return jnp.where(jnp.asarray(done), jnp.int32(eos_id), token)

        return collect(decode_steps(token, 1, n, eos_ids, advance, np.asarray, feed_eos), 1)

    return run


def _stop_read_every_step(jmodel, prompt, n: int, eos: int):
    """JAX's device loop with an EOS whose stop is read after every decode step (``_check_every() == 1``: a CPU's
    and a TPU's loop, and a GPU's before the chunks), through ``generate`` as the other variants."""
    from unittest import mock

    from jaxattn import generate as jgen

    def run():
        with mock.patch.object(jgen, "_check_every", return_value=1):
            return jgen.generate(jmodel, [prompt], n, eos_id=eos, loop="device")

    return run


def calls(preset: str, prompt_len: int, n: int, graphs: bool = False) -> dict:
    """The variants as zero-argument callables returning the generated ids (each waits for its own result);
    ``graphs``: also torch's loops with the CUDA-graph step."""
    import torch

    from benchmarks.twins import twin_models
    from jaxattn import generate as jgen
    from torchref import generate as tgen
    from torchref.config import ModelConfig

    tmodel, jmodel = twin_models(ModelConfig.preset(preset), seed=0)
    tmodel = tmodel.eval().to("cuda" if torch.cuda.is_available() else "cpu")  # beside JAX's default device
    prompt = np.random.default_rng(0).integers(0, tmodel.config.vocab_size, prompt_len).tolist()
    out = {"jax:host:key-on-host": _key_on_host_loop(jmodel, prompt, n)}
    for fw, gen, model in (("jax", jgen, jmodel), ("torch", tgen, tmodel)):
        for loop in ("host", "device"):
            out[f"{fw}:{loop}"] = lambda gen=gen, model=model, loop=loop: gen.generate(
                model, [prompt], n, eos_id=None, loop=loop
            )
    free = jgen.generate(jmodel, [prompt], n, eos_id=None, loop="device")[0]
    eos = min(set(range(jmodel.config.vocab_size)) - set(free))  # never reached: every variant runs n steps
    out["jax:host:eos"] = lambda: jgen.generate(jmodel, [prompt], n, eos_id=eos, loop="host")
    out["jax:host:eos:fed-on-host"] = _eos_fed_on_host(jmodel, prompt, n, eos)
    out["jax:device:eos"] = lambda: jgen.generate(jmodel, [prompt], n, eos_id=eos, loop="device")
    out["jax:device:eos:per-step"] = _stop_read_every_step(jmodel, prompt, n, eos)
    for loop in ("host", "device") if graphs else ():
        out[f"torch:{loop}:graphs"] = lambda loop=loop: tgen.generate(
            tmodel, [prompt], n, eos_id=None, loop=loop, compile=True, compile_mode="reduce-overhead"
        )
    return out


def run(preset: str = "tiny", prompt_len: int = 16, n: int = 32, rounds: int = 15, graphs: bool = False) -> dict:
    """The variants' tokens compared, then timed: ``{"env", "args", "variants": {name: stats}, "pairs"}`` (the
    :data:`PAIRS` whose two variants ran)."""
    from benchmarks import measure
    from twincore.timing import paired_ratio, time_interleaved

    fns = calls(preset, prompt_len, n, graphs)
    ids = {name: fn() for name, fn in fns.items()}  # also the first (compiling) call
    agree = {fw: all(v == ids[f"{fw}:host"] for k, v in ids.items() if k.startswith(fw)) for fw in ("jax", "torch")}
    agree["jax_torch"] = ids["jax:host"] == ids["torch:host"]  # recorded, not enforced: the timings stand either way
    t = time_interleaved(fns, rounds=rounds, per_round=3, warmup=1)
    variants = {
        name: {k: t[name][k] for k in ("median_s", "p10_s", "p90_s", "cv", "rounds")}
        | {"per_token_s": t[name]["median_s"] / n}
        for name in fns
    }
    pairs = []
    for slow, fast in (p for p in PAIRS if set(p) <= set(fns)):
        r = paired_ratio(t[slow]["rounds"], t[fast]["rounds"], cv=(t[slow]["cv"], t[fast]["cv"]))
        pairs.append({"slow": slow, "fast": fast, "ratio": r["ratio"], "ci": list(r["ci"]), "unstable": r["unstable"]})
    args = {"preset": preset, "B": 1, "prompt": prompt_len, "new_tokens": n, "rounds": rounds, "per_round": 3}
    args["graphs"] = graphs
    return {"tool": "generate_loop", "env": measure.env_info(), "args": args, "tokens_agree": agree} | {
        "variants": variants,
        "pairs": pairs,
    }


def table(res: dict) -> str:
    a = res["args"]
    lines = [
        f"{a['preset']} B=1 prompt={a['prompt']} new={a['new_tokens']}, {a['rounds']} rounds x 3 calls; "
        f"tokens agree: {', '.join(f'{k} {v}' for k, v in res['tokens_agree'].items())}"
    ]
    for name, v in res["variants"].items():
        lines.append(
            f"  {name:22s} {1e3 * v['median_s']:8.3f} ms per call ({1e3 * v['p10_s']:.3f}-{1e3 * v['p90_s']:.3f}), "
            f"{1e3 * v['per_token_s']:.4f} ms per token"
        )
    for p in res["pairs"]:
        flag = " unstable" if p["unstable"] else ""
        lines.append(f"  {p['fast']} vs {p['slow']}: {p['ratio']:.2f}x [{p['ci'][0]:.2f}-{p['ci'][1]:.2f}]{flag}")
    return "\n".join(lines)


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.tools.generate_loop", description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--prompt", type=int, default=16, help="prompt tokens (B = 1)")
    p.add_argument("--new", type=int, default=32, help="new tokens per call (greedy, no EOS)")
    p.add_argument("--rounds", type=int, default=15, help="interleaved rounds (3 calls of each variant per round)")
    p.add_argument(
        "--graphs",
        choices=("auto", "on", "off"),
        default="auto",
        help="torch's loops with the CUDA-graph step too (auto: where CUDA is present; on a CPU, minutes of compile)",
    )
    p.add_argument("--out", default=None, help="also write DIR/generate_loop.json")
    args = p.parse_args(argv)
    graphs = args.graphs == "on" or (args.graphs == "auto" and _cuda())
    res = run(args.preset, args.prompt, args.new, args.rounds, graphs)
    print(table(res), flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "generate_loop.json"), "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
