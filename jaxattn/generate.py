"""Batched generation with a KV cache for ``jaxattn.model.Llama`` (twin of ``torchref/generate.py``).

    out = generate(model, [[1, 2, 3], [4, 5]], max_new_tokens=16)              # greedy, ragged prompts
    for step in stream(model, [ids], 32, temperature=0.8, top_p=0.9):          # one list of B ids per step
        ...
    python -m jaxattn.generate --init SmolLM2-135M-Instruct.Q4_1.gguf --prompt "Hi" --chat

Prompts are right-padded into one batch (``jaxattn.kv_cache``: a length per row). The model is split once
(``nnx.split``) and two pure functions of its state are jitted: the prefill (compiled once per power-of-two
prompt length; it computes the logits of each row's last real position only, ``logits_at``, never ``[B, P,
vocab]``) and the decode step (compiled once per cache length; the cache is donated, so it is updated in
place where the backend supports donation). Sampling: ``temperature == 0`` is greedy (argmax); otherwise logits
/ temperature, then top-k, then top-p (nucleus: the smallest set of most-likely tokens whose probability reaches
``top_p``), then a draw with ``jax.random.categorical`` from ``fold_in(PRNGKey(seed), step)``: a fixed seed
reproduces the same tokens (within jax; torch draws its own). A row stops after it emits ``eos_id`` (the EOS is
returned); finished rows keep feeding EOS until every row is done, their outputs discarded. Logits that are not
finite (NaN weights) are refused with a ValueError at the prefill or step they appear (``twincore.generate.emit``).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from twincore.generate import (
    FROM_CONFIG,
    NON_FINITE,
    build_parser,
    cli,
    decode_steps,
    generate_with,
    load_tokenizer,
    prepare,
    preset_dtype,
    print_generated,
    takes_arguments_of,
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


def _programs(graphdef, temperature: float, top_k, top_p):
    """(prefill, decode) jitted pure functions of the model state for one sampling setting, traced under the
    attention backends active NOW (``attention_backend(...)``: part of the cache key, so entering another backend
    block gives other programs instead of reusing the first trace)."""
    return _programs_for(graphdef, temperature, top_k, top_p, current_backends())


@functools.lru_cache(maxsize=32)
def _programs_for(graphdef, temperature: float, top_k, top_p, backends):

    def prefill(state, tokens, lengths, cache, key):  # only each row's last real position reaches the LM head
        logits, cache = nnx.merge(graphdef, state)(tokens, cache=cache, logits_at=(lengths - 1)[:, None])  # [B, 1, V]
        return _sample_finite(logits[:, 0], key, temperature, top_k, top_p), cache.with_lengths(lengths)

    def decode(state, token, cache, key):
        logits, cache = nnx.merge(graphdef, state)(token[:, None], cache=cache)
        return _sample_finite(logits[:, 0], key, temperature, top_k, top_p), cache

    def traced_under(fn):  # the programs trace lazily: re-enter the backends they were made for
        @functools.wraps(fn)
        def wrapped(*args):
            if backends is None:
                return fn(*args)
            with attention_backend(*backends):
                return fn(*args)

        return wrapped

    return jax.jit(traced_under(prefill)), jax.jit(traced_under(decode), donate_argnums=(2,))


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
) -> Iterator[list]:
    """Yields, per generation step, a list of B new token ids (None for a row that already stopped)."""
    cfg = model.config
    tokens, lengths, t, eos = prepare(prompts, max_new_tokens, temperature, top_k, top_p, eos_id, max_len, cfg)
    graphdef, state = nnx.split(model)  # once per call: the loop runs pure jitted functions of `state`
    prefill, decode = _programs(graphdef, float(temperature), top_k, None if top_p is None else float(top_p))
    cache = KVCache.init(cfg, len(tokens), t, dtype=model.embed[...].dtype)
    key = jax.random.PRNGKey(seed)
    token, cache = prefill(state, jnp.asarray(tokens), jnp.asarray(lengths), cache, jax.random.fold_in(key, 0))

    def advance(step, token):
        nonlocal cache
        token, cache = decode(state, token, cache, jax.random.fold_in(key, step))
        return token

    def feed_eos(token, done, eos_id):
        return jnp.where(jnp.asarray(done), jnp.int32(eos_id), token)

    yield from decode_steps(token, len(tokens), max_new_tokens, eos, advance, np.asarray, feed_eos)


@takes_arguments_of(stream)
def generate(model, prompts, max_new_tokens: int, *args, **kwargs) -> list[list[int]]:
    """The new token ids of each prompt, a list per row (:func:`twincore.generate.generate_with`); the arguments
    are :func:`stream`'s."""
    return generate_with(stream, model, prompts, max_new_tokens, *args, **kwargs)


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
    print_generated(stream, model, args, load_tokenizer(args.init))


if __name__ == "__main__":
    sys.exit(main())
