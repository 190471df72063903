"""Batched generation with a KV cache for ``jaxattn.model.Llama`` (twin of ``torchref/generate.py``).

    out = generate(model, [[1, 2, 3], [4, 5]], max_new_tokens=16)              # greedy, ragged prompts
    for step in stream(model, [ids], 32, temperature=0.8, top_p=0.9):          # one list of B ids per step
        ...
    python -m jaxattn.generate --init SmolLM2-135M-Instruct.Q4_1.gguf --prompt "Hi" --chat

Prompts are right-padded into one batch (``jaxattn.kv_cache``: a length per row; a windowed model's cache is a ring of
``sliding_window`` slots when the generation needs more, ``twincore.generate.ring_slots``; a longer prompt's prefill
fills a plain cache first and keeps its window, ``KVCache.ring``). The model is split once (``nnx.split``) and two pure
functions of its state are jitted: the prefill (compiled once per power-of-two prompt length; it makes the empty cache
and computes the logits of each row's last real position only, ``logits_at``, never ``[B, P, vocab]``) and the decode
step (compiled once per cache length; the cache is donated, so it is updated in place where the backend supports
donation). Both keep on the device which rows have stopped, and a decode step feeds a stopped row its EOS itself: the
host's work per token is the call and the read of B ids. Sampling: ``temperature == 0`` is greedy (argmax); otherwise
logits / temperature, then top-k, then top-p (nucleus: the smallest set of most-likely tokens whose probability reaches
``top_p``), then a draw with ``jax.random.categorical`` from ``fold_in(PRNGKey(seed), step)`` (``seed`` an int in ``[0,
2**32)``): a fixed seed reproduces the same tokens (within jax; torch draws its own). A row stops after it emits
``eos_id`` (the EOS is returned); finished rows keep feeding EOS until every row is done, their outputs discarded.
Logits that are not finite (NaN weights) are refused with a ValueError at the prefill or step they appear
(``twincore.generate.emit``). ``loop="device"`` (``--loop device``) runs the prefill and every decode step as one jitted
``lax.while_loop`` that stops when every row has: the host waits once per generation instead of once per token (the same
steps and ids; ``stream`` yields them after the program ends). On a GPU the stop is checked once per ``CHECK_EVERY``
steps, between ``fori_loop`` chunks of fixed trip count: XLA:GPU reads a while loop's predicate back on the host each
iteration, a wait per token otherwise.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from twincore.chat import converse
from twincore.generate import (
    CHECK_EVERY,
    FROM_CONFIG,
    NON_FINITE,
    build_parser,
    check_loop,
    chunk_len,
    cli,
    decode_steps,
    generate_with,
    load_tokenizer,
    prepare,
    preset_dtype,
    print_generated,
    replay_steps,
    takes_arguments_of,
)
from twincore.generate import (
    Conversation as _Conversation,
)

from . import hf
from .attention import attention_backend, current_backends
from .config import ModelConfig
from .kv_cache import KVCache
from .model import Llama
from .quant import quantize


def sample(logits: jax.Array, key, temperature: float, top_k: int | None, top_p: float | None) -> jax.Array:
    """Token ids ``[B]`` from float32 logits ``[B, V]`` (greedy when ``temperature == 0``)."""
    if temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits.astype(jnp.float32) / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if top_p is not None and top_p < 1:
        order = jnp.argsort(-logits, axis=-1)
        sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        keep_sorted = jnp.cumsum(probs, axis=-1) - probs < top_p  # the first token is always kept
        keep = jnp.zeros_like(keep_sorted).at[jnp.arange(logits.shape[0])[:, None], order].set(keep_sorted)
        logits = jnp.where(keep, logits, -jnp.inf)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


def _sample_finite(logits: jax.Array, key, temperature: float, top_k, top_p) -> jax.Array:
    """:func:`sample`, with ``NON_FINITE`` for a row whose logits are not all finite (one reduction in the same
    program; the host sees it in the ids it fetches anyway, and ``emit`` refuses it)."""
    finite = jnp.isfinite(logits).all(axis=-1)
    return jnp.where(finite, sample(logits, key, temperature, top_k, top_p), jnp.int32(NON_FINITE))


def _programs(graphdef, temperature: float, top_k, top_p, eos: tuple, spec):
    """(prefill, decode) jitted pure functions of the model state for one sampling setting and cache shape, traced
    under the attention backends active NOW (``attention_backend(...)``: part of the cache key, so entering another
    backend block gives other programs instead of reusing the first trace). The ``eos`` ids are an argument of the
    programs (bound here), not a constant in them: another EOS set of the same size reuses the compiled programs."""
    prefill, decode = _programs_for(graphdef, temperature, top_k, top_p, current_backends(), bool(eos), spec)
    stop = _stop_ids(eos)
    return functools.partial(prefill, stop), functools.partial(decode, stop)


@functools.lru_cache(maxsize=64)
def _stop_ids(eos: tuple) -> jax.Array:
    """The ids that stop a row, ``[*eos, NON_FINITE]`` int32 on the device, made once per EOS set (a transfer per
    decode step otherwise); the step programs feed a stopped row the first."""
    return jnp.asarray((*eos, NON_FINITE), jnp.int32)


def _slots(spec) -> int:
    """The slots of the cache of ``spec`` (:func:`_cache_spec`)."""
    return jax.tree.unflatten(spec[0], [shape for shape, _ in spec[1]]).k[2]


def _chunked_prefill(graphdef, state, cache: KVCache, tokens, lengths, chunk: int):
    """``(logits [B, V] of each row's last real position, cache)`` from ``tokens [B, n * chunk]`` appended to the
    empty appending ``cache`` ``chunk`` tokens per call (``stream``'s ``prefill_chunk``): a ``lax.scan`` over the
    chunks (the model traced once), each row's length set to what it holds before each call, its logits kept from
    the chunk that holds its last token."""
    b, p = tokens.shape
    xs = (tokens.reshape(b, p // chunk, chunk).transpose(1, 0, 2), jnp.arange(0, p, chunk, dtype=jnp.int32))

    def step(carry, x):
        cache, kept = carry
        toks, start = x
        at = jnp.clip(lengths - 1 - start, 0, chunk - 1)[:, None]  # [B, 1]: the last token, clamped into the chunk
        cache = cache.with_lengths(jnp.minimum(lengths, start))
        logits, cache = nnx.merge(graphdef, state)(toks, cache=cache, logits_at=at)  # [B, 1, V] float32
        mine = (lengths - 1 >= start) & (lengths - 1 < start + chunk)  # [B]: the row's last token is in this chunk
        return (cache, jnp.where(mine[:, None], logits[:, 0], kept)), None

    kept = jnp.zeros((b, nnx.merge(graphdef, state).config.vocab_size), jnp.float32)  # [B, V]
    (cache, logits), _ = jax.lax.scan(step, (cache, kept), xs)
    return logits, cache


def _empty_cache(spec, slots: int | None = None) -> KVCache:
    """The empty cache of ``spec`` (:func:`_cache_spec`; ``slots`` slots if given), made inside a program (no eager
    zeros, no second copy)."""
    treedef, leaves, _ = spec
    cache = jax.tree.unflatten(treedef, [jnp.zeros(shape, dtype) for shape, dtype in leaves])
    if slots is None or slots == cache.max_len:
        return cache
    shape = (*cache.k.shape[:2], slots, *cache.k.shape[3:])
    return dataclasses.replace(cache, k=jnp.zeros(shape, cache.k.dtype), v=jnp.zeros(shape, cache.v.dtype))


def _steps(graphdef, temperature: float, top_k, top_p, has_eos: bool, spec):
    """The pure (prefill, decode) step functions both loops run; ``stop`` (their first argument) is
    :func:`_stop_ids`. Each returns the drawn ``token [B]`` and ``done [B]``, the rows that have stopped (an EOS id,
    or a non-finite step the host will refuse); a stopped row is fed ``stop[0]``, its first EOS, inside the next
    decode step (no eager ``where`` per step on the host)."""

    def prefill(stop, state, tokens, lengths, key):  # only each row's last real position reaches the LM head
        slots, p, chunk = _slots(spec), tokens.shape[1], spec[2]
        if chunk is not None:  # appended to the cache chunk by chunk (a ring of sliding_window + chunk - 1 slots)
            logits, cache = _chunked_prefill(graphdef, state, _empty_cache(spec), tokens, lengths, chunk)
        else:
            cache = _empty_cache(spec, max(p, slots))  # a ring shorter than the prompt: p slots, then its window
            logits, cache = nnx.merge(graphdef, state)(tokens, cache=cache, logits_at=(lengths - 1)[:, None])
            logits = logits[:, 0]  # [B, V]
        token = _sample_finite(logits, jax.random.fold_in(key, 0), temperature, top_k, top_p)
        cache = cache.with_lengths(lengths)
        return token, jnp.isin(token, stop), cache if chunk is not None or p <= slots else cache.ring(slots)

    def decode(stop, state, token, done, cache, key, step):  # step t draws with fold_in(key, t), in the program
        feed = stop[0] if has_eos else 0  # without an EOS only a non-finite row stops, and the host refuses it
        logits, cache = nnx.merge(graphdef, state)(jnp.where(done, feed, token)[:, None], cache=cache)
        token = _sample_finite(logits[:, 0], jax.random.fold_in(key, step), temperature, top_k, top_p)
        return token, done | jnp.isin(token, stop), cache

    return prefill, decode


def _traced_under(fn, backends):
    """``fn`` re-entering the attention backends it was made for when it traces (the programs trace lazily)."""

    @functools.wraps(fn)
    def wrapped(*args):
        if backends is None:
            return fn(*args)
        with attention_backend(*backends):
            return fn(*args)

    return wrapped


@functools.lru_cache(maxsize=32)
def _programs_for(graphdef, temperature: float, top_k, top_p, backends, has_eos: bool, spec):
    prefill, decode = _steps(graphdef, temperature, top_k, top_p, has_eos, spec)
    return jax.jit(_traced_under(prefill, backends)), jax.jit(_traced_under(decode, backends), donate_argnums=(4,))


@functools.lru_cache(maxsize=32)
def _loop_program_for(
    graphdef, temperature: float, top_k, top_p, backends, max_new_tokens: int, has_eos: bool, spec, check_every: int
):
    """``loop="device"``: the prefill and every decode step as ONE jitted program: with an EOS a ``lax.while_loop``
    that ends when every row has stopped (an EOS, or a non-finite step the host will refuse) or after
    ``max_new_tokens``, checking every ``check_every`` steps (the steps between two checks are a ``fori_loop`` of
    fixed trip count, which XLA:GPU runs without reading a predicate back); without, ``max_new_tokens - 1`` decode
    steps (``fori_loop``). ``spec``: the empty cache's ``(treedef, ((shape, dtype), ...), chunk)``, made inside the
    program (:func:`_empty_cache`); ``run(stop, state, tokens, lengths, key)``, ``stop`` :func:`_stop_ids`. Compiled
    once per ``max_new_tokens``, number of EOS ids, cache shape, prefill chunk and ``check_every``. Returns
    ``(ids [max_new_tokens, B], steps run)``; the host reads them once."""
    prefill, decode = _steps(graphdef, temperature, top_k, top_p, has_eos, spec)

    def advance(stop, state, key, carry):
        step, token, cache, done, ids = carry  # the loop's step t
        token, done, cache = decode(stop, state, token, done, cache, key, step)
        return step + 1, token, cache, done, ids.at[step].set(token)

    def run(stop, state, tokens, lengths, key):
        token, done, cache = prefill(stop, state, tokens, lengths, key)
        ids = jnp.zeros((max_new_tokens, token.shape[0]), jnp.int32).at[0].set(token)  # [max_new_tokens, B]
        carry = (jnp.int32(1), token, cache, done, ids)

        def steps(k):  # k decode steps at a fixed trip count: no predicate read between them
            return lambda carry: jax.lax.fori_loop(0, k, lambda _, c: advance(stop, state, key, c), carry)

        if not has_eos:  # only a non-finite row could stop, and the host refuses it afterwards
            carry = steps(max_new_tokens - 1)(carry)
        else:
            chunks, rest = divmod(max_new_tokens - 1, check_every)
            last = 1 + chunks * check_every  # the step after the last whole chunk
            carry = jax.lax.while_loop(lambda c: (c[0] < last) & ~c[3].all(), steps(check_every), carry)
            if rest:  # the last, shorter chunk, unless every row has stopped (one more check)
                carry = jax.lax.cond(carry[3].all(), lambda c: c, steps(rest), carry)
        return carry[4], carry[0]  # ids, steps run

    return jax.jit(_traced_under(run, backends))


@functools.lru_cache(maxsize=32)
def _cache_spec(cfg, batch: int, max_len: int, dtype, chunk: int | None = None) -> tuple:
    """``(treedef, ((shape, dtype), ...), chunk)`` of ``KVCache.init(cfg, batch, max_len, dtype)`` (appending, for
    a prefill of ``chunk`` tokens per call), without making it (traced once per cache shape, not once per call)."""
    make = lambda: KVCache.init(cfg, batch, max_len, dtype=dtype, append=chunk is not None)  # noqa: E731
    leaves, treedef = jax.tree.flatten(jax.eval_shape(make))
    return treedef, tuple((x.shape, jnp.dtype(x.dtype).name) for x in leaves), chunk


@functools.lru_cache(maxsize=64)
def _key(seed: int) -> jax.Array:
    """``jax.random.PRNGKey(seed)``, made once per seed (an eager op per call otherwise; ``check_seed`` made
    ``seed`` an int in ``[0, 2**32)``). Never donated, so one array serves every call."""
    return jax.random.PRNGKey(seed)


def _check_every() -> int:
    """Decode steps between two checks that some row is still going: :data:`CHECK_EVERY` on a GPU (each check of
    a while loop's predicate is a host wait there: XLA's ``WhileThunk`` copies it back and blocks), 1 elsewhere (a
    CPU reads it in place, a TPU's scalar core runs the loop)."""
    return CHECK_EVERY if jax.default_backend() == "gpu" else 1


def _device_loop(
    graphdef,
    state,
    sampling,
    cache_args: tuple,
    tokens,
    lengths,
    key,
    max_new_tokens: int,
    eos: tuple,
    check_every=None,
):
    """``loop="device"``'s run: ``(ids [max_new_tokens, B] numpy, steps run)`` from :func:`_loop_program_for`;
    ``cache_args``: ``KVCache.init``'s (:func:`_cache_spec`'s) arguments; ``check_every``: :func:`_check_every`'s
    unless given (the loops tool times 1 on a GPU too)."""
    spec = _cache_spec(*cache_args)
    every = _check_every() if check_every is None else check_every
    run = _loop_program_for(graphdef, *sampling, current_backends(), max_new_tokens, bool(eos), spec, every)
    ids, steps = jax.device_get(
        run(_stop_ids(eos), state, tokens, lengths, key)
    )  # numpy in, both results out in one fetch
    return ids, int(steps)


def stream(
    model,
    prompts,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int = 0,
    eos_id: int | list[int] | None | str = FROM_CONFIG,
    max_len: int | None = None,
    loop: str = "host",
    prefill_chunk: int | None = None,
) -> Iterator[list]:
    """Yields, per generation step, a list of B new token ids (None for a row that already stopped).
    ``loop="device"``: the whole generation runs as one program (``lax.while_loop``) and the steps are yielded
    after it, from ids read once (no host wait per token). ``prefill_chunk``: the prompts are prefilled this many
    tokens per model call, appended to the cache (``KVCache.init(append=True)``; a windowed model's ring then holds
    ``sliding_window + prefill_chunk - 1`` slots and the prefill never the whole prompt)."""
    check_loop(loop)
    cfg = model.config
    tokens, lengths, t, eos = prepare(
        prompts, max_new_tokens, temperature, top_k, top_p, eos_id, max_len, cfg, seed, prefill_chunk
    )
    graphdef, state = nnx.split(model)  # once per call: the loop runs pure jitted functions of `state`
    sampling = (float(temperature), top_k, None if top_p is None else float(top_p))
    chunk = chunk_len(prefill_chunk, tokens.shape[1])
    cache_args = (cfg, len(tokens), t, model.embed[...].dtype, chunk)  # _cache_spec's
    key = _key(int(seed))
    if loop == "device":
        ids, _ = _device_loop(graphdef, state, sampling, cache_args, tokens, lengths, key, max_new_tokens, eos)
        yield from replay_steps(ids, eos)
        return
    prefill, decode = _programs(graphdef, *sampling, eos, _cache_spec(*cache_args))
    token, done, cache = prefill(state, tokens, lengths, key)  # numpy in: jit's own transfer, no eager op

    def advance(step, token):
        nonlocal cache, done
        token, done, cache = decode(state, token, done, cache, key, step)
        return token

    def fed_in_the_program(token, done, eos_id):  # decode feeds a stopped row its EOS from its own `done`
        return token

    yield from decode_steps(token, len(tokens), max_new_tokens, eos, advance, np.asarray, fed_in_the_program)


@takes_arguments_of(stream)
def generate(model, prompts, max_new_tokens: int, *args, **kwargs) -> list[list[int]]:
    """The new token ids of each prompt, a list per row (:func:`twincore.generate.generate_with`); the arguments
    are :func:`stream`'s."""
    return generate_with(stream, model, prompts, max_new_tokens, *args, **kwargs)


@functools.lru_cache(maxsize=32)
def _append_program_for(graphdef, temperature: float, top_k, top_p, backends):
    """A :class:`Conversation` turn's first program: the turn's tokens ``[B, P]`` appended after each row's ``held``
    ones in the appending cache (donated), the logits of each row's last new token only, the first draw."""

    def append(stop, state, cache, tokens, held, new, key):
        cache = cache.with_lengths(held)
        logits, cache = nnx.merge(graphdef, state)(tokens, cache=cache, logits_at=(new - 1)[:, None])  # [B, 1, V]
        token = _sample_finite(logits[:, 0], jax.random.fold_in(key, 0), temperature, top_k, top_p)
        return token, jnp.isin(token, stop), cache.with_lengths(held + new)

    return jax.jit(_traced_under(append, backends), donate_argnums=(2,))


class Conversation(_Conversation):
    """Multi-turn generation over one KV cache kept between turns (``twincore.generate.Conversation``; twin of
    ``torchref.generate.Conversation``). The cache is appending (``KVCache.init(append=True)``); a turn runs one
    jitted program for its new tokens (compiled per padded length) and the decode step of ``generate`` (compiled
    once per cache shape), both under the attention backends active at the call.

        chat = Conversation(model, max_len=256)
        first = chat.send([ids], max_new_tokens=32)[0]
        second = chat.send([more_ids], max_new_tokens=32)[0]     # the cache holds ids + first: not prefilled again
    """

    def _new_cache(self, batch: int, slots: int) -> None:
        self.cache = KVCache.init(self.model.config, batch, slots, dtype=self.model.embed[...].dtype, append=True)

    def _append(self, tokens, held, new, sampling, seed: int, eos: tuple):
        graphdef, state = nnx.split(self.model)
        key, stop = _key(seed), _stop_ids(eos)
        append = _append_program_for(graphdef, *sampling, current_backends())
        token, done, self.cache = append(stop, state, self.cache, tokens, held, new, key)
        decode = _programs_for(graphdef, *sampling, current_backends(), bool(eos), None)[1]

        def advance(step, token):
            nonlocal done
            token, done, self.cache = decode(stop, state, token, done, self.cache, key, step)
            return token

        return token, advance

    _to_host = staticmethod(np.asarray)

    @staticmethod
    def _feed_eos(token, done, eos_id):  # the decode program feeds a stopped row its EOS from its own `done`
        return token


def main(argv=None) -> int:
    return cli("python -m jaxattn.generate", build_parser("python -m jaxattn.generate"), _run, argv)


def _run(args) -> None:
    if args.init is not None:
        model = hf.from_pretrained(args.init, dtype=args.dtype)
    else:
        cfg = ModelConfig.preset(args.preset)
        model = Llama(cfg, rngs=nnx.Rngs(args.seed), param_dtype=jnp.dtype(preset_dtype(args)))
    if args.int8:
        model = quantize(model)
    tokenizer = load_tokenizer(args.init)
    if args.interactive:
        converse(Conversation(model, max_len=args.max_len), tokenizer, args, sys.stdin)
    else:
        print_generated(stream, model, args, tokenizer)


if __name__ == "__main__":
    sys.exit(main())
