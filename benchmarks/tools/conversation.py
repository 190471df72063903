"""The next turn of a conversation with its KV cache kept (``Conversation.send``) vs ``generate`` on the whole
conversation again, paired and interleaved, in each twin: ``benchmarks/NOTES.md``, "A conversation's next turn".

    python -m benchmarks.tools.conversation [--framework jax|torch|both --preset 125m --history 1024 --turn 32
                                             --new 16 --batch 1 --rounds 5 --out DIR]   # DIR/conversation.json

The ``--preset`` (random weights, fp32, seed 0; its embedding and head scaled x4 so that greedy tokens are not
decided by roundings), on each framework's default device. A conversation of ``--history`` random tokens is put in
a ``Conversation``'s cache by a first turn (one drawn token); then the timed turn, ``--turn`` random tokens and
``--new`` greedy tokens, two ways: ``kept``, ``Conversation.send`` (the turn's tokens appended to the cache, the
history never prefilled again; before each call the conversation is set back to the history, which costs nothing:
the slots after it are simply written again); ``again``, ``generate`` on the whole conversation (history, the drawn
token, the turn: a prefill of all of it). Both caches have the same slots, so their decode steps cost the same. Both
must give the same tokens (checked first); then each is timed, each call waited for. Prints each way's median and
10th-90th percentile and the paired ratio kept / again with its 95% interval (``twincore.timing.paired_ratio``).
"""

from __future__ import annotations

import argparse

import numpy as np


def _twin(framework: str, cfg):
    """``(generate module, model)`` of one twin: random weights (seed 0), embedding and head x4."""
    if framework == "jax":
        from flax import nnx

        from jaxattn import generate
        from jaxattn.model import Llama

        model = Llama(cfg, rngs=nnx.Rngs(0))
        for w in (model.embed,) if cfg.tie_embeddings else (model.embed, model.lm_head):
            w[...] = w[...] * 4.0
        return generate, model
    import torch

    from torchref import generate
    from torchref.model import LlamaForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval().to(device)
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(4.0)
        if model.lm_head.weight is not model.model.embed_tokens.weight:
            model.lm_head.weight.mul_(4.0)
    return generate, model


def measure_one(framework: str, cfg, args) -> dict:
    """One twin's check and paired timing (module doc): ``{"times", "ratio", "slots"}``."""
    from twincore.generate import bucket

    from .. import measure

    rng = np.random.default_rng(0)
    history = rng.integers(0, cfg.vocab_size, (args.batch, args.history)).tolist()
    turn = rng.integers(0, cfg.vocab_size, (args.batch, args.turn)).tolist()
    gen, model = _twin(framework, cfg)
    slots = bucket(args.history + 1 + args.turn + args.new - 1)  # generate's cache for the whole conversation
    chat = gen.Conversation(model, max_len=slots)
    chat.send(history, 1, eos_id=None)  # the history in the cache, and one drawn token
    rows, held = chat.rows, chat.held
    whole = [r + t for r, t in zip(rows, turn)]

    def kept():
        chat.rows, chat.held = rows, held  # back to the history: its cache slots are as they were
        return np.asarray(chat.send(turn, args.new, eos_id=None))

    def again():
        return np.asarray(gen.generate(model, whole, args.new, eos_id=None))

    times, ratio = measure.checked_pair(
        {"again": again, "kept": kept}, "kept", "again", 0, rounds=args.rounds, per_round=1, warmup=1
    )
    return {"times": times, "ratio": ratio, "slots": slots}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m benchmarks.tools.conversation", description=__doc__.split("\n")[0])
    p.add_argument("--framework", choices=["jax", "torch", "both"], default="both")
    p.add_argument("--preset", default="125m")
    p.add_argument("--history", type=int, default=1024, help="tokens of the conversation so far")
    p.add_argument("--turn", type=int, default=32, help="tokens of the timed turn's prompt")
    p.add_argument("--new", type=int, default=16, help="greedy tokens the timed turn draws")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--rounds", type=int, default=5, help="time_interleaved rounds (order reversed every other)")
    p.add_argument("--out", default=None, help="also write DIR/conversation.json")
    args = p.parse_args(argv)
    for name in ("history", "turn", "new", "batch", "rounds"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(args, name)}")

    from twincore.config import ModelConfig

    from .. import measure

    cfg = ModelConfig.preset(args.preset)
    need = args.history + 1 + args.turn + args.new
    if need > cfg.max_seq_len:
        p.error(f"--history + --turn + --new + 1 = {need} exceeds the preset's max_seq_len {cfg.max_seq_len}")
    frameworks = ["jax", "torch"] if args.framework == "both" else [args.framework]
    res = {"tool": "conversation", "env": measure.env_info(), "args": vars(args)}
    for fw in frameworks:
        one = res[fw] = measure_one(fw, cfg, args)
        print(
            f"{fw} {args.preset} B={args.batch}: a turn of {args.turn} tokens and {args.new} new after "
            f"{args.history} (a cache of {one['slots']} slots): kept (Conversation.send) vs again (generate on all)"
        )
        measure.print_paired(one["times"], one["ratio"], "kept / again", digits=0)
    measure.write_record(args.out, "conversation.json", res)
    return res


if __name__ == "__main__":
    main()
