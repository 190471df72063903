"""Framework-neutral parts of text generation, shared by ``jaxattn.generate`` and ``torchref.generate``: argument
checks, prompt padding and cache sizing, the decode loop and the collected / printed output of ``stream``,
tokenizer loading and the CLI (one flag table for both twins).

    prompts = check_prompts([[1, 2, 3], [4]], vocab_size=256)      # ValueError naming a bad prompt / id
    tok = load_tokenizer("SmolLM2-135M-Instruct.Q4_1.gguf")         # GGUF metadata, tokenizer.json, or bytes

Rows are RIGHT-padded (``pad_prompts``): each row keeps positions ``0 .. len - 1`` as when it runs alone; the
KV caches track a length per row. Prefill lengths and cache lengths are rounded up to a power of two
(:func:`bucket`) so a new prompt length rarely compiles a new program.
"""

from __future__ import annotations

import argparse
import inspect
import numbers
import os
from collections.abc import Sequence

import numpy as np

from .tokenizer import ByteTokenizer, load_tokenizer  # noqa: F401 - the CLI's tokenizer, re-exported

FROM_CONFIG = "config"  # generate(eos_id=...)'s default: stop at the model config's eos_token_id


def check_sampling(max_new_tokens, temperature, top_k, top_p, eos_id=None, vocab_size=None) -> None:
    if not isinstance(max_new_tokens, numbers.Integral) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    if not isinstance(temperature, numbers.Real) or not np.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature must be a finite float >= 0 (0 = greedy), got {temperature!r}")
    if top_k is not None and (not isinstance(top_k, numbers.Integral) or isinstance(top_k, bool) or top_k < 1):
        raise ValueError(f"top_k must be None or an int >= 1, got {top_k!r}")
    if top_p is not None and (not isinstance(top_p, numbers.Real) or not 0 < top_p <= 1):
        raise ValueError(f"top_p must be None or a float in (0, 1], got {top_p!r}")
    if eos_id is not None and eos_id != FROM_CONFIG:
        ids = list(eos_id) if isinstance(eos_id, (list, tuple)) else [eos_id]
        bad = [
            i
            for i in ids
            if isinstance(i, bool)
            or not isinstance(i, numbers.Integral)
            or i < 0
            or (vocab_size is not None and i >= vocab_size)
        ]
        if bad or not ids:
            vocab = f" in [0, {vocab_size})" if vocab_size is not None else ""
            raise ValueError(
                f"eos_id must be {FROM_CONFIG!r} (the model config's eos_token_id), None (never stop early), a token "
                f"id{vocab} or a non-empty list of them, got {eos_id!r}"
            )


SEED_LIMIT = 2**32  # jax keeps a seed's low 32 bits without x64: 2**32 + 5 would draw as seed 5 does


def check_seed(seed) -> None:
    """``seed`` must be an int in ``[0, 2**32)``: jax's ``PRNGKey`` silently drops a larger seed's high bits (2**32
    + 5 draws as 5) and maps a negative one onto a large one; torch's generator would take both."""
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or not 0 <= seed < SEED_LIMIT:
        raise ValueError(f"seed must be an int in [0, 2**32), got {seed!r}")


def eos_ids(eos_id, config) -> tuple[int, ...]:
    """The ids a row stops after: ``eos_id=FROM_CONFIG`` (the default of ``generate``) is the model config's
    ``eos_token_id`` (from ``config.json`` or the GGUF metadata; none for a preset), None is none."""
    if eos_id is None:
        return ()
    if eos_id == FROM_CONFIG:
        return config.eos_ids
    return tuple(int(i) for i in eos_id) if isinstance(eos_id, (list, tuple)) else (int(eos_id),)


def check_prompts(prompts, vocab_size: int) -> list[list[int]]:
    """``prompts`` (a list of token-id lists, ragged) as lists of ints; ValueError for an empty list, an empty
    prompt or an id outside ``[0, vocab_size)`` (naming the prompt, the position and the value)."""
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) or len(prompts) == 0:
        raise ValueError(f"prompts must be a non-empty list of token-id lists, got {type(prompts).__name__}")
    out = []
    for i, p in enumerate(prompts):
        ids = np.asarray(p)
        if ids.ndim != 1 or ids.size == 0:
            raise ValueError(f"prompts[{i}] must be a non-empty 1-D list of token ids, got shape {ids.shape}")
        if not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"prompts[{i}] must hold integer token ids, got dtype {ids.dtype}")
        bad = np.flatnonzero((ids < 0) | (ids >= vocab_size))
        if bad.size:
            raise ValueError(f"prompts[{i}][{bad[0]}] = {int(ids[bad[0]])} is outside the vocabulary [0, {vocab_size})")
        out.append([int(t) for t in ids])
    return out


def bucket(n: int, minimum: int = 16) -> int:
    """Smallest power of two >= max(n, minimum)."""
    return max(minimum, 1 << (int(n) - 1).bit_length())


def cache_len(prompts: list[list[int]], max_new_tokens: int, max_len: int | None) -> int:
    """Slots the KV cache needs (rounded up to a bucket, capped at ``max_len``); ValueError when the longest
    prompt plus the new tokens do not fit ``max_len`` (the model's ``max_seq_len`` by default)."""
    need = max(len(p) for p in prompts) + max_new_tokens - 1  # the last sampled token is never fed back
    if need > max_len:
        longest = max(range(len(prompts)), key=lambda i: len(prompts[i]))
        raise ValueError(
            f"prompts[{longest}] has {len(prompts[longest])} tokens; with max_new_tokens="
            f"{max_new_tokens} it needs {need} cache slots > max_len={max_len} (the model's "
            f"max_seq_len unless given): shorten the prompt or generate fewer tokens"
        )
    return min(bucket(need), max_len)


def pad_prompts(prompts: list[list[int]], length: int, pad_id: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Right-padded ``tokens [B, length]`` int32 and ``lengths [B]`` int32."""
    tokens = np.full((len(prompts), length), pad_id, np.int32)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = p
    return tokens, np.asarray([len(p) for p in prompts], np.int32)


def prepare(
    prompts,
    max_new_tokens: int,
    temperature,
    top_k,
    top_p,
    eos_id,
    max_len: int | None,
    config,
    seed: int = 0,
    prefill_chunk: int | None = None,
) -> tuple[np.ndarray, np.ndarray, int, tuple[int, ...]]:
    """Both ``stream`` functions' start: every argument checked, the prompts right-padded to a prefill bucket (with
    ``prefill_chunk``, to a whole number of chunks of :func:`chunk_len` tokens). Returns ``(tokens [B, P] int32,
    lengths [B] int32, cache slots (:func:`ring_slots`), the EOS ids (:func:`eos_ids`))``."""
    check_sampling(max_new_tokens, temperature, top_k, top_p, eos_id, config.vocab_size)
    check_seed(seed)
    check_prefill_chunk(prefill_chunk)
    prompts = check_prompts(prompts, config.vocab_size)
    t = cache_len(prompts, max_new_tokens, config.max_seq_len if max_len is None else max_len)
    p = min(bucket(max(len(p) for p in prompts)), t)
    chunk = chunk_len(prefill_chunk, p)
    tokens, lengths = pad_prompts(prompts, p if chunk is None else -(-p // chunk) * chunk)
    return tokens, lengths, ring_slots(t, config.sliding_window, chunk or 1), eos_ids(eos_id, config)


def check_prefill_chunk(prefill_chunk) -> None:
    if prefill_chunk is not None and (
        not isinstance(prefill_chunk, numbers.Integral) or isinstance(prefill_chunk, bool) or prefill_chunk < 1
    ):
        raise ValueError(f"prefill_chunk must be None (one call) or an int >= 1, got {prefill_chunk!r}")


def chunk_len(prefill_chunk: int | None, p: int) -> int | None:
    """The tokens per prefill call of both twins' ``stream(prefill_chunk=...)`` for a prompt batch padded to ``p``
    (a prefill bucket or a whole number of chunks): ``prefill_chunk``, at most ``p`` (None: one call)."""
    return None if prefill_chunk is None else min(int(prefill_chunk), p)


def ring_slots(slots: int, window: int | None, chunk: int = 1) -> int:
    """The KV cache's slots for a generation that needs ``slots``: a windowed model's cache is a ring when the
    generation needs more than ``window`` (``twincore.batch.is_ring``): of ``window`` slots (a longer prompt is
    prefilled into a plain cache whose window the ring keeps), or of ``window + chunk - 1`` for a prefill of
    ``chunk`` tokens per call appended to it (``twincore.batch.check_append``); else ``slots``."""
    return slots if window is None or slots <= window else window + chunk - 1


NON_FINITE = -1  # the id both step programs give a row whose logits are not all finite (emit refuses it)
CHECK_EVERY = 16  # loop="device": decode steps between two checks that some row is still going, where a check
# costs a host wait (torch's queue; JAX's while loop on a GPU, whose predicate XLA reads back on the host)


def emit(host: np.ndarray, done: np.ndarray, eos: tuple[int, ...], step: int = 0) -> list:
    """One step's ids as ``stream`` yields them (None for a row that stopped before this step); marks in ``done``
    (updated in place) the rows that emitted one of the ``eos`` ids now. A live row's :data:`NON_FINITE` id (NaN /
    inf logits: NaN weights, or an overflow in the model's dtype) is a ValueError: greedy would print id 0 (NUL
    bytes) and a draw from NaN fails deep inside torch."""
    if np.any(host[~done] == NON_FINITE):
        where = "the prompt" if step == 0 else f"generation step {step}"
        raise ValueError(
            f"the logits at {where} are not finite (NaN or inf), so no token is sampled from them: the model's "
            f"weights (--init) hold NaN or inf, or overflow in their dtype (--dtype float32 is the widest)"
        )
    ids = [None if d else int(x) for x, d in zip(host, done)]
    if eos:
        done |= np.isin(np.asarray(host), eos)
    return ids


def collect(steps, n_rows: int) -> list[list[int]]:
    """``generate``'s result from ``stream``'s steps: the new ids of each row (a row that hit EOS ends with it)."""
    out = [[] for _ in range(n_rows)]
    for step in steps:
        for row, tok in zip(out, step):
            if tok is not None:
                row.append(tok)
    return out


def decode_steps(token, n_rows: int, max_new_tokens: int, eos: tuple[int, ...], advance, to_host, feed_eos):
    """``stream``'s loop after the prefill drew the first ``token`` (both twins): per step the :func:`emit`-ed ids of
    the ``n_rows`` rows, the next token from ``advance(step, token)`` (a decode step and a draw), ``to_host(token)``
    the ids as numpy; it ends when every row is done, and finished rows keep feeding an EOS
    (``feed_eos(token, done, eos_id)``, ``done`` a numpy bool per row)."""
    done = np.zeros(n_rows, bool)
    for step in range(max_new_tokens):
        if step:
            token = advance(step, token)
        yield emit(to_host(token), done, eos, step)
        if done.all():
            return
        if eos:  # finished rows keep feeding an EOS
            token = feed_eos(token, done, eos[0])


LOOPS = ("host", "device")  # stream(loop=...): the host reads each step's ids, or all of them once at the end


def check_loop(loop) -> None:
    if loop not in LOOPS:
        raise ValueError(f"loop must be one of {list(LOOPS)}, got {loop!r}")


def replay_steps(ids: np.ndarray, eos: tuple[int, ...]):
    """``stream``'s steps from the ids a device loop wrote (``ids [max_new_tokens, B]``, numpy; rows past the
    step where the loop stopped are never read): the host loop's :func:`decode_steps` over them, so both loops
    yield the same lists, stop at the same step and refuse a non-finite step with the same error."""
    n, b = ids.shape
    yield from decode_steps(ids[0], b, n, eos, lambda step, _: ids[step], np.asarray, lambda t, done, eos_id: t)


def takes_arguments_of(stream):
    """Decorator: the decorated ``generate(model, prompts, *args, **kwargs)`` shows ``stream``'s parameters
    (``help()``, ``inspect.signature``, editors), so forwarding them does not hide them."""

    def decorate(fn):
        returns = inspect.signature(fn).return_annotation
        fn.__signature__ = inspect.signature(stream).replace(return_annotation=returns)
        return fn

    return decorate


def generate_with(stream, model, prompts, *args, **kwargs) -> list[list[int]]:
    """``generate``: the new token ids of each prompt (a list per row; a row that hit an EOS ends with it) from a
    twin's ``stream(model, prompts, *args, **kwargs)`` (:func:`collect`). ``eos_id``: the default ``"config"``
    stops at ``model.config.eos_token_id`` (read from ``config.json`` or the GGUF file, as Hugging Face's
    ``generate`` does; none for a preset), None never stops early, an id or a list of ids."""
    return collect(stream(model, prompts, *args, **kwargs), len(prompts))


# ------------------------------------------------------------------------------------------- conversations
class Conversation:
    """Multi-turn generation over ONE KV cache kept between turns (both twins' ``Conversation`` subclass this):
    each :meth:`send` appends only the turn's new tokens to what the cache holds and decodes from there, so the
    earlier turns are never prefilled again (a cache made with ``append=True``; ``generate`` starts empty).

        chat = Conversation(model, max_len=512)          # jaxattn.generate.Conversation / torchref's
        reply = chat.send([ids_turn1], max_new_tokens=32)[0]
        reply = chat.send([ids_turn2], max_new_tokens=32)[0]   # == generate(model, [turn1 + reply + turn2], 32)[0]

    A turn's tokens, for every row, are the last reply's final token (drawn, never fed to the model yet) followed
    by the turn's prompt; the replies and their sampling are ``generate``'s on the whole conversation (greedy: the
    same tokens; ``seed`` draws as ``generate`` does from the turn's first step). Rows are a fixed batch (the first
    turn's); each row's conversation is its own (lengths per row, right padding as in ``generate``). The cache has
    ``max_len`` slots (the model's ``max_seq_len`` unless given); a turn that does not fit is refused before it
    runs, naming the row. A windowed model's cache of ``max_len >= sliding_window`` slots is a ring and a
    conversation runs past ``max_len`` (``twincore.batch.is_ring``); a ring takes at most ``max_len - window + 1``
    new tokens per turn and ``max_new_tokens <= max_len - window + 2`` (a stopped row keeps feeding its EOS into
    slots that its next turn must still see otherwise). ``history`` holds every row's tokens so far.

    A subclass makes the cache and runs the model: ``_new_cache(batch, slots)``, ``_append(tokens [B, P], held
    [B], new [B], sampling, seed)`` (the turn's tokens written after each row's ``held`` ones; returns the first
    drawn token [B] on the device and the ``advance(step, token)`` of the decode steps), and ``_to_host`` and
    ``_feed_eos`` as :func:`decode_steps` takes them. A turn that fails (a non-finite step) leaves a plain cache's
    conversation as it was before it; a ring's may have been written over, and it is refused until :meth:`reset`.
    """

    def __init__(self, model, max_len: int | None = None):
        cfg = model.config
        limit = cfg.max_seq_len if max_len is None else max_len
        if isinstance(limit, bool) or not isinstance(limit, numbers.Integral) or limit < 2:
            raise ValueError(f"max_len must be None (the model's max_seq_len) or an int >= 2, got {max_len!r}")
        self.model, self.max_len, self.window = model, int(limit), cfg.sliding_window
        self.reset()

    def reset(self) -> None:
        """Forget every turn (the next :meth:`send` starts a new conversation, of any batch)."""
        self.rows: list[list[int]] | None = None  # every row's tokens so far (the last reply's final one included)
        self.held = None  # [B] int: the tokens each row's cache holds (all of ``rows`` but the last one)
        self.broken = False

    @property
    def history(self) -> list[list[int]]:
        """Every row's tokens so far: prompts and replies, in order."""
        return [] if self.rows is None else [list(r) for r in self.rows]

    @property
    def ring(self) -> bool:
        from .batch import is_ring

        return is_ring(self.max_len, self.window)

    def send(self, prompts, max_new_tokens: int, *args, **kwargs) -> list[list[int]]:
        """Each row's reply (a list of new ids; a row that hit an EOS ends with it); the arguments are
        :meth:`stream`'s."""
        return collect(self.stream(prompts, max_new_tokens, *args, **kwargs), len(prompts))

    def stream(
        self,
        prompts,
        max_new_tokens: int,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int = 0,
        eos_id=FROM_CONFIG,
    ):
        """Yields, per generation step of this turn, a list of B new ids (None for a row that stopped), as the
        twins' ``stream``; ``prompts``: one non-empty token-id list per row, the turn's new text."""
        cfg = self.model.config
        check_sampling(max_new_tokens, temperature, top_k, top_p, eos_id, cfg.vocab_size)
        check_seed(seed)
        prompts = check_prompts(prompts, cfg.vocab_size)
        if self.broken:
            raise ValueError("this conversation's ring cache was left part-written by a failed turn: call reset()")
        if self.rows is not None and len(prompts) != len(self.rows):
            raise ValueError(
                f"prompts has {len(prompts)} rows; this conversation has {len(self.rows)} (its first turn's): one "
                f"prompt per row, or reset() for a new batch"
            )
        first = self.rows is None
        new = [p if first else [r[-1], *p] for r, p in zip(self.rows or prompts, prompts)]  # the reply's last token
        held = np.zeros(len(new), np.int64) if first else self.held
        width = self._width([len(n) for n in new], held, max_new_tokens)
        tokens, lengths = pad_prompts(new, width)
        if first:
            self._new_cache(len(new), self.max_len)
        sampling = (float(temperature), top_k, None if top_p is None else float(top_p))
        eos = eos_ids(eos_id, cfg)
        replies = [[] for _ in new]
        try:
            token, advance = self._append(tokens, held.astype(np.int32), lengths, sampling, int(seed), eos)
            for step in decode_steps(token, len(new), max_new_tokens, eos, advance, self._to_host, self._feed_eos):
                for reply, tok in zip(replies, step):
                    if tok is not None:
                        reply.append(tok)
                yield step
        except GeneratorExit:  # the caller stopped reading: the steps it saw are the turn (the cache holds them)
            self._keep(first, prompts, replies, held, lengths)
            raise
        except BaseException:
            self.broken = self.ring and not first  # a plain cache's conversation is as before the turn
            raise
        self._keep(first, prompts, replies, held, lengths)

    def _keep(self, first, prompts, replies, held, lengths) -> None:
        rows = [[] for _ in prompts] if first else self.rows
        self.rows = [[*r, *p, *a] for r, p, a in zip(rows, prompts, replies)]
        self.held = held + lengths + np.asarray([len(a) for a in replies]) - 1

    def _width(self, new: list[int], held: np.ndarray, max_new_tokens: int) -> int:
        """The padded length of the turn's call (a prefill bucket when it fits), after checking the turn fits the
        cache: ValueError naming the row, ``max_len`` and what the turn needs."""
        t, longest = self.max_len, max(new)
        if self.ring:
            room = t - self.window + 1
            if longest > room or max_new_tokens > room + 1:
                raise ValueError(
                    f"this turn appends {longest} tokens (the last reply's final token and the prompt) and draws "
                    f"max_new_tokens={max_new_tokens} on a ring of max_len={t} slots for a sliding_window of "
                    f"{self.window}: a turn takes at most max_len - window + 1 = {room} tokens and "
                    f"max_new_tokens <= {room + 1}; a larger max_len, or shorter turns"
                )
            return min(bucket(longest), room)
        need = held + np.asarray(new) + max_new_tokens - 1  # the last drawn token is never fed
        if need.max() > t:
            b = int(need.argmax())
            so_far = 0 if self.rows is None else len(self.rows[b])
            raise ValueError(
                f"prompts[{b}]: this turn needs {int(need[b])} cache slots > max_len={t} (the row's {so_far} tokens "
                f"so far, the prompt's {new[b] - (so_far > 0)} and max_new_tokens={max_new_tokens} - 1): a "
                f"Conversation with a larger max_len, a shorter turn, or reset()"
            )
        room = t - int(held.max())
        if longest > room:
            raise ValueError(
                f"this turn's rows do not fit one call: row {int(held.argmax())} holds {int(held.max())} of "
                f"max_len={t} slots and another row appends {longest} tokens (rows are padded to one length): a "
                f"Conversation with a larger max_len"
            )
        return min(bucket(longest), room)


def print_stream(steps, tokenizer, file=None) -> list[int]:
    """The CLIs' output: each new token's text as soon as it is complete (EOS not printed), then a newline; returns
    the first row's new ids (an EOS it stopped at included)."""
    import sys

    file = sys.stdout if file is None else file
    enc = getattr(file, "encoding", None) or "utf-8"
    out, ids = TextStream(tokenizer), []
    for step in steps:
        if step[0] is not None:
            ids.append(step[0])
        if step[0] is not None and step[0] != tokenizer.eos_id:  # a character the terminal lacks prints as "?"
            file.write(out.push(step[0]).encode(enc, "replace").decode(enc))
            file.flush()
    file.write("\n")
    file.flush()
    return ids


# ------------------------------------------------------------------------------------------- tokenizers
class TextStream:
    """Incremental detokenization: ``push(id)`` returns the new text (decodes the whole row, prints the suffix,
    so a multi-byte character split over tokens is printed once it is complete)."""

    def __init__(self, tokenizer):
        self.tokenizer, self.ids, self.printed = tokenizer, [], ""

    def push(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for the next token
            return ""
        new, self.printed = text[len(self.printed) :], text
        return new


# ------------------------------------------------------------------------------------------------- CLI
def build_parser(prog: str) -> argparse.ArgumentParser:
    """The generation CLI's flags (identical in ``python -m jaxattn.generate`` and ``python -m torchref.generate``)."""
    from .cli import OneLineParser  # argparse's errors as a CLIError: one line through :func:`cli`
    from .config import PRESET_NAMES
    from .dtypes import MODEL_DTYPES

    p = OneLineParser(prog=prog, description="Generate text with a Llama checkpoint, streaming tokens.")
    p.add_argument("--init", default=None, help="HF Llama directory or .gguf file (default: random --preset weights)")
    p.add_argument(
        "--preset",
        default="tiny",
        choices=PRESET_NAMES,
        help="model preset when --init is not given (random weights, byte-level tokens)",
    )
    p.add_argument("--prompt", default=None, help="prompt text (UTF-8); with --interactive, the first turn (optional)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the checkpoint's chat template")
    p.add_argument(
        "--system",
        default=None,
        help="with --chat: the conversation's system message (default: none of ours; the template may add its own)",
    )
    p.add_argument(
        "--interactive",
        action="store_true",
        help="a conversation: each line on stdin is a user turn, answered on one KV cache kept between turns "
        "(Conversation); with --chat every turn and reply goes through the chat template; ends at end of input",
    )
    p.add_argument(
        "--max-len",
        type=int,
        default=None,
        help="an --interactive conversation's KV-cache slots (default: the model's max_seq_len)",
    )
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate (>= 1)")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (>= 0; 0 = greedy)")
    p.add_argument("--top-k", type=int, default=None, help="sample from the k most likely tokens (>= 1)")
    p.add_argument("--top-p", type=float, default=None, help="nucleus sampling: the smallest set of mass p, in (0, 1]")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampling (and of a --preset's random weights)")
    p.add_argument(
        "--dtype", default=None, help=f"weights and compute dtype: {', '.join(MODEL_DTYPES)} (default float32)"
    )
    p.add_argument("--int8", action="store_true", help="int8 weight-only quantization (quant.quantize)")
    p.add_argument(
        "--prefill-chunk",
        type=int,
        default=None,
        help="prefill the prompt this many tokens per call, appended to the KV cache (a windowed model's ring then "
        "holds sliding_window + N - 1 slots and never the whole prompt; default: one call)",
    )
    p.add_argument(
        "--loop",
        choices=LOOPS,
        default="host",
        help="host: print each token as it is made; device: the tokens stay on the device and print at the end "
        "(no host wait per token)",
    )
    return p


def check_cli_args(args: argparse.Namespace) -> None:
    """Every generate flag checked before a model is loaded; ValueError naming the flag."""
    try:
        check_sampling(args.max_new_tokens, args.temperature, args.top_k, args.top_p)
        check_seed(args.seed)
        check_prefill_chunk(args.prefill_chunk)
    except ValueError as e:
        name = str(e).split(" ", 1)[0]
        raise ValueError(f"--{name.replace('_', '-')}: {str(e).split(' ', 1)[1]}") from None
    if args.dtype is not None:
        from .dtypes import check_model_dtype

        args.dtype = check_model_dtype(args.dtype, "--dtype")
    if args.prompt is None and not args.interactive:
        raise ValueError("--prompt is required (or --interactive, which reads the turns from stdin)")
    if args.prompt is not None and not args.prompt:
        raise ValueError("--prompt '': an empty prompt; give some text")
    try:
        (args.prompt or "").encode("utf-8")
    except UnicodeEncodeError as e:  # bytes that are not UTF-8 reach Python as lone surrogates
        raise ValueError(f"--prompt is not valid UTF-8 text (byte {e.start} onwards); pass UTF-8 text") from None
    if args.system is not None and not args.chat:
        raise ValueError("--system: a system message goes through the chat template; add --chat")
    if args.max_len is not None and (not args.interactive or args.max_len < 2):
        raise ValueError(f"--max-len {args.max_len}: an --interactive conversation's cache slots, an int >= 2")
    if args.interactive and args.loop != "host":
        raise ValueError(f"--loop {args.loop}: an --interactive conversation prints each reply as it is made (host)")
    if args.interactive and args.prefill_chunk is not None:
        raise ValueError("--prefill-chunk: an --interactive conversation appends each turn in one call")
    if args.init is not None:
        init = args.init
        if not os.path.exists(init):
            raise ValueError(f"--init {init!r}: no such file or directory; expected a .gguf file or a Hugging Face dir")
        if os.path.isfile(init) and not init.endswith(".gguf"):
            raise ValueError(
                f"--init {init!r} is a file whose name does not end in .gguf; give a llama.cpp .gguf file "
                f"(named *.gguf) or a Hugging Face Llama directory"
            )


def cli(prog: str, parser: argparse.ArgumentParser, body, argv=None) -> int:
    """Both generate CLIs' ``main``: parse and check the flags, then ``body(args)``; bad input (a flag, a file that
    is not a checkpoint, a corrupt tokenizer) prints one ``prog: error: ...`` line and returns 2."""
    import sys

    try:
        args = parser.parse_args(argv)
        check_cli_args(args)
        body(args)
    except (ValueError, TypeError, OSError) as e:  # CLIError, CheckpointError, RunDirError are ValueErrors
        msg = " ".join(str(e).split()) or type(e).__name__
        print(f"{prog}: error: {msg}".encode("utf-8", "replace").decode("utf-8"), file=sys.stderr)
        return 2
    return 0


def preset_dtype(args) -> str:
    """The dtype a ``--preset`` model is built in (``--dtype``, default float32)."""
    return args.dtype or "float32"


def print_generated(stream, model, args: argparse.Namespace, tokenizer, **options) -> None:
    """The CLIs' run after the model is built: a twin's ``stream`` of the prompt with the command line's sampling
    flags (``options``: the twin's own, e.g. torch's ``compile``), stopping at the tokenizer's EOS (else the
    model config's), printed as it comes (:func:`print_stream`)."""
    eos_id = tokenizer.eos_id if tokenizer.eos_id is not None else FROM_CONFIG
    steps = stream(
        model,
        [prompt_ids(args, tokenizer)],
        args.max_new_tokens,
        args.temperature,
        args.top_k,
        args.top_p,
        args.seed,
        eos_id,
        loop=args.loop,
        prefill_chunk=args.prefill_chunk,
        **options,
    )
    print_stream(steps, tokenizer)


def prompt_ids(args, tokenizer) -> list[int]:
    messages = [*system_message(args), {"role": "user", "content": args.prompt}]
    return encode_prompt(tokenizer, tokenizer.render_chat(messages) if args.chat else args.prompt)


def system_message(args) -> list[dict]:
    """The CLI's ``--system`` as the chat's first message (none without it)."""
    return [] if getattr(args, "system", None) is None else [{"role": "system", "content": args.system}]


def encode_prompt(tokenizer, text: str) -> list[int]:
    """``text``'s ids, after the tokenizer's BOS where it adds one (``add_bos``) and the text does not begin with it."""
    ids = tokenizer.encode(text)
    if getattr(tokenizer, "add_bos", False) and tokenizer.bos_id is not None and ids[:1] != [tokenizer.bos_id]:
        ids = [tokenizer.bos_id] + ids
    return ids
