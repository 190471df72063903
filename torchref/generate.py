"""Batched generation with a static KV cache for ``torchref.model.LlamaForCausalLM`` (twin of
``jaxattn/generate.py``).

    out = generate(model, [[1, 2, 3], [4, 5]], max_new_tokens=16)              # greedy, ragged prompts
    for step in stream(model, [ids], 32, temperature=0.8, top_p=0.9):          # one list of B ids per step
        ...
    python -m torchref.generate --init SmolLM2-135M-Instruct.Q4_1.gguf --prompt "Hi" --chat

Same rules as the JAX twin: right-padded prompts, a length per cache row (a windowed model's cache a ring of
``sliding_window`` slots when the generation needs more; a longer prompt is prefilled into a plain cache first,
:func:`_prefill`), prefill padded to a power of two (logits of each row's last real position only: ``logits_at``),
greedy at ``temperature == 0``, else temperature -> top-k -> top-p -> ``torch.multinomial`` with a ``torch.Generator``
seeded by ``seed`` (reproducible within torch; the JAX twin draws with its own PRNG), stop per row at ``eos_id``.
``compile=True`` runs the decode step under ``torch.compile`` (the cache is a set of fixed-shape tensors updated in
place, so the step has static shapes); ``compile_mode="reduce-overhead"`` also replays it as one CUDA graph per step on
a GPU (gpt-fast's decode; the cache marked static, :meth:`KVCache.mark_static`). A CUDA graph holds its inputs'
addresses, so in those modes the cache is kept per model and reused by the next call of the same shape, zeroed in place
(:func:`static_cache`, as gpt-fast's ``setup_caches`` and Hugging Face's static cache do): a new cache per call would
re-record every step's graph per call. Logits that are not finite are refused as in the JAX twin
(``twincore.generate.emit``). ``loop="device"`` (``--loop device``) keeps the ids on the device: the steps are queued
without a host wait per token (the stopped rows' EOS fed by ``torch.where``), and the host checks whether every row has
stopped once per :data:`CHECK_EVERY` steps (torch has no on-device loop; the JAX twin runs one ``lax.while_loop``);
``stream`` yields the same steps after the loop.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

import torch

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
from .config import ModelConfig
from .kv_cache import KVCache
from .model import LlamaForCausalLM, trusted_ids
from .quant import quantize


def sample(
    logits: torch.Tensor, generator: torch.Generator | None, temperature: float, top_k: int | None, top_p: float | None
) -> torch.Tensor:
    """Token ids ``[B]`` from float32 logits ``[B, V]`` (greedy when ``temperature == 0``)."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        keep_sorted = probs.cumsum(dim=-1) - probs < top_p  # the first token is always kept
        keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
        logits = logits.masked_fill(~keep, float("-inf"))
    return torch.multinomial(logits.softmax(dim=-1), 1, generator=generator)[:, 0]


def _sample_finite(logits: torch.Tensor, generator, temperature: float, top_k, top_p) -> torch.Tensor:
    """:func:`sample`, with ``NON_FINITE`` for a row whose logits are not all finite (no extra sync: the host sees
    it in the ids it fetches anyway, and ``emit`` refuses it); such a row draws from zeros, not from NaN. One pass:
    a row's float32 sum is finite iff its logits are (|logits| < 1e34), ~10 us a step on a CPU."""
    finite = torch.isfinite(logits.sum(dim=-1, dtype=torch.float32))
    if temperature:
        logits = logits.masked_fill(~finite[:, None], 0.0)
    return torch.where(finite, sample(logits, generator, temperature, top_k, top_p), NON_FINITE)


def _prefill(model, tokens, lengths, cache, chunk: int | None = None) -> torch.Tensor:
    """Fills the empty ``cache`` from right-padded ``tokens [B, P]`` (its lengths set to ``lengths [B]``; a ring of
    fewer than P slots gets each row's window, :meth:`KVCache.ring_into`) and returns the logits ``[B, V]`` of each
    row's last real position, the only ones computed (``logits_at``). ``chunk``: an appending cache filled ``chunk``
    tokens per call (P a multiple of it), each row's length set to what it holds before each call, its logits
    kept from the chunk that holds its last token."""
    if chunk is not None:
        kept = None
        for start in range(0, tokens.shape[1], chunk):
            at = (lengths - 1 - start).clamp(0, chunk - 1)[:, None]  # [B, 1]: the last token, clamped into the chunk
            cache.set_lengths(lengths.clamp(max=start))
            logits = model(tokens[:, start : start + chunk], cache=cache, logits_at=at)[:, 0]  # [B, V]
            mine = ((lengths - 1 >= start) & (lengths - 1 < start + chunk))[:, None]  # [B, 1]
            kept = logits if kept is None else torch.where(mine, logits, kept)
        cache.set_lengths(lengths)
        return kept
    p = tokens.shape[1]
    full = cache  # a ring shorter than the prompt: a plain cache of p slots first, then its window into the ring
    if p > cache.max_len:
        full = KVCache(model.config, cache.batch, p, dtype=cache.k.dtype, device=cache.k.device)
    logits = model(tokens, cache=full, logits_at=(lengths - 1)[:, None])  # [B, 1, vocab]
    full.set_lengths(lengths)
    if full is not cache:
        full.ring_into(cache)
    return logits[:, 0]


def _decode_step(model, token, cache):
    return model(token[:, None], cache=cache)[:, 0]


def _device_loop(advance, token, max_new_tokens: int, eos: tuple[int, ...]) -> torch.Tensor:
    """``loop="device"``: ids ``[max_new_tokens, B]`` from the first ``token`` and ``advance(step, token)``, the
    host waiting only every :data:`CHECK_EVERY` steps (to stop once every row has: an EOS, or a non-finite step
    the host will refuse); rows past the step it stopped at are never read (``replay_steps``)."""
    stop_ids = torch.tensor((*eos, NON_FINITE), device=token.device)
    feed = torch.full_like(token, eos[0] if eos else 0)  # a stopped row's next input
    ids = torch.zeros((max_new_tokens, *token.shape), dtype=token.dtype, device=token.device)
    ids[0] = token
    done = torch.isin(token, stop_ids)
    for step in range(1, max_new_tokens):
        if step % CHECK_EVERY == 0 and bool(done.all()):
            break
        token = advance(step, torch.where(done, feed, token))
        ids[step] = token
        done |= torch.isin(token, stop_ids)
    return ids


COMPILE_MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
CUDAGRAPH_MODES = ("reduce-overhead", "max-autotune")  # the modes that record CUDA graphs on a GPU


def check_compile_mode(compile: bool, compile_mode: str | None) -> None:
    """ValueError naming ``compile_mode`` when it is not one of :data:`COMPILE_MODES` or is given without
    ``compile=True``."""
    if compile_mode not in COMPILE_MODES:
        raise ValueError(f"compile_mode must be one of {list(COMPILE_MODES)}, got {compile_mode!r}")
    if compile_mode is not None and not compile:
        raise ValueError(f"compile_mode={compile_mode!r} needs compile=True (it is torch.compile's mode)")


def compiled_step(cache, compile_mode: str | None = None):
    """The decode step under ``torch.compile`` (fullgraph) in ``compile_mode``; a CUDA-graph mode marks ``cache``
    static first, so its in-place writes stay inside the recorded graph."""
    check_compile_mode(True, compile_mode)
    if compile_mode in CUDAGRAPH_MODES:
        cache.mark_static()
    return torch.compile(_decode_step, fullgraph=True, mode=compile_mode)


_STATIC = weakref.WeakKeyDictionary()  # model -> the KVCache its CUDA-graph decode steps were recorded with
_IN_USE: set[int] = set()  # ids of the kept caches a live stream is using


@contextmanager
def static_cache(model, batch: int, max_len: int, dtype, device, append: bool = False):
    """The model's kept :class:`KVCache` when it has this shape (``batch``, ``max_len`` slots, ``dtype``,
    ``device``, ``append``) and no live stream holds it, emptied in place (zeros, lengths 0: a CUDA graph recorded
    with it still points at its tensors), else a new one kept in its place. One cache per model, the last shape used (a
    new shape records new graphs anyway); a cache held by a live stream is left to it, the caller gets a fresh
    one that is not kept."""
    cache = _STATIC.get(model)
    shape = (model.config.n_layers, batch, model.config.n_kv_heads, max_len, model.config.resolved_head_dim)
    if cache is not None and id(cache) in _IN_USE:
        yield KVCache(model.config, batch, max_len, dtype=dtype, device=device, append=append)
        return
    now = (shape, dtype, torch.device(device), append)
    if cache is None or (tuple(cache.k.shape), cache.k.dtype, cache.k.device, cache.append) != now:
        cache = _STATIC[model] = KVCache(model.config, batch, max_len, dtype=dtype, device=device, append=append)
    else:
        for t in (cache.k, cache.v, cache.lengths):  # stale keys may hold anything a masked slot could turn to NaN
            t.zero_()
    _IN_USE.add(id(cache))
    try:
        yield cache
    finally:
        _IN_USE.discard(id(cache))


@torch.no_grad()
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
    compile: bool = False,
    compile_mode: str | None = None,
    prefill_chunk: int | None = None,
) -> Iterator[list]:
    """Yields, per generation step, a list of B new token ids (None for a row that already stopped).
    ``loop="device"``: no host wait per token (:func:`_device_loop`); the steps are yielded after it.
    ``compile_mode``: ``torch.compile``'s mode for the decode step (with ``compile=True``; :data:`COMPILE_MODES`).
    ``prefill_chunk``: the prompts are prefilled this many tokens per model call, appended to the cache
    (``KVCache(append=True)``; a windowed model's ring then holds ``sliding_window + prefill_chunk - 1`` slots)."""
    check_loop(loop)
    check_compile_mode(compile, compile_mode)
    cfg = model.config
    tokens, lengths, t, eos = prepare(
        prompts, max_new_tokens, temperature, top_k, top_p, eos_id, max_len, cfg, seed, prefill_chunk
    )
    device = model.model.embed_tokens.weight.device
    b = len(tokens)
    dtype = model.model.embed_tokens.weight.dtype
    chunk = chunk_len(prefill_chunk, tokens.shape[1])
    if compile and compile_mode in CUDAGRAPH_MODES:  # the graphs hold the cache's addresses: keep it across calls
        held = static_cache(model, b, t, dtype, device, append=chunk is not None)
    else:
        held = nullcontext(KVCache(cfg, b, t, dtype=dtype, device=device, append=chunk is not None))
    with held as cache:
        gen = torch.Generator(device=device).manual_seed(seed) if temperature else None
        lengths = torch.from_numpy(lengths).long().to(device)
        logits = _prefill(model, torch.from_numpy(tokens).long().to(device), lengths, cache, chunk)  # [B, vocab]
        token = _sample_finite(logits, gen, temperature, top_k, top_p)
        step_fn = compiled_step(cache, compile_mode) if compile else _decode_step

        def advance(step, token):  # the model's own draws or a fed EOS: no id check, no device sync per step
            with trusted_ids():
                return _sample_finite(step_fn(model, token, cache), gen, temperature, top_k, top_p)

        if loop == "device":
            yield from replay_steps(_device_loop(advance, token, max_new_tokens, eos).cpu().numpy(), eos)
            return

        def feed_eos(token, done, eos_id):
            return torch.where(torch.from_numpy(done).to(device), torch.full_like(token, eos_id), token)

        yield from decode_steps(token, b, max_new_tokens, eos, advance, lambda t: t.cpu().numpy(), feed_eos)


@takes_arguments_of(stream)
def generate(model, prompts, max_new_tokens: int, *args, **kwargs) -> list[list[int]]:
    """The new token ids of each prompt, a list per row (:func:`twincore.generate.generate_with`); the arguments
    are :func:`stream`'s."""
    return generate_with(stream, model, prompts, max_new_tokens, *args, **kwargs)


class Conversation(_Conversation):
    """Multi-turn generation over one KV cache kept between turns (``twincore.generate.Conversation``; twin of
    ``jaxattn.generate.Conversation``). The cache is appending (``KVCache(append=True)``, written in place); a turn
    is one model call for its new tokens and then ``generate``'s decode steps: eager, or with ``compile=True``
    ``torch.compile``d in ``compile_mode`` (:func:`compiled_step`, once per cache; a CUDA-graph mode marks the
    conversation's cache static, and the graphs replay on it turn after turn).

        chat = Conversation(model, max_len=256)
        first = chat.send([ids], max_new_tokens=32)[0]
        second = chat.send([more_ids], max_new_tokens=32)[0]     # the cache holds ids + first: not prefilled again
    """

    def __init__(self, model, max_len: int | None = None, compile: bool = False, compile_mode: str | None = None):
        check_compile_mode(compile, compile_mode)
        self.compile, self.compile_mode = compile, compile_mode
        super().__init__(model, max_len)

    def _new_cache(self, batch: int, slots: int) -> None:
        weight = self.model.model.embed_tokens.weight
        self.cache = KVCache(self.model.config, batch, slots, dtype=weight.dtype, device=weight.device, append=True)
        self._step = compiled_step(self.cache, self.compile_mode) if self.compile else _decode_step

    @torch.no_grad()
    def _append(self, tokens, held, new, sampling, seed: int, eos: tuple):
        model, cache, decode, (temperature, top_k, top_p) = self.model, self.cache, self._step, sampling
        device = cache.k.device
        gen = torch.Generator(device=device).manual_seed(seed) if temperature else None
        held, new = (torch.from_numpy(x).long().to(device) for x in (held, new))
        cache.set_lengths(held)
        logits = model(torch.from_numpy(tokens).long().to(device), cache=cache, logits_at=(new - 1)[:, None])
        cache.set_lengths(held + new)
        token = _sample_finite(logits[:, 0], gen, temperature, top_k, top_p)

        @torch.no_grad()
        def advance(step, token):  # the model's own draws or a fed EOS: no id check, no device sync per step
            with trusted_ids():
                return _sample_finite(decode(model, token, cache), gen, temperature, top_k, top_p)

        return token, advance

    @staticmethod
    def _to_host(token):
        return token.cpu().numpy()

    @staticmethod
    def _feed_eos(token, done, eos_id):
        return torch.where(torch.from_numpy(done).to(token.device), torch.full_like(token, eos_id), token)


def main(argv=None) -> int:
    parser = build_parser("python -m torchref.generate")
    parser.add_argument("--compile", action="store_true", help="torch.compile the decode step")
    parser.add_argument(
        "--compile-mode",
        choices=[m for m in COMPILE_MODES if m],
        default=None,
        help="torch.compile's mode for --compile (reduce-overhead: one CUDA graph per decode step on a GPU)",
    )
    return cli("python -m torchref.generate", parser, _run, argv)


def _run(args) -> None:
    if args.compile_mode is not None and not args.compile:
        raise ValueError(f"--compile-mode {args.compile_mode} needs --compile")
    if args.init is not None:
        model = hf.from_pretrained(args.init, dtype=args.dtype)
    else:
        torch.manual_seed(args.seed)
        model = LlamaForCausalLM(ModelConfig.preset(args.preset)).to(getattr(torch, preset_dtype(args)))
    model.eval()
    if args.int8:
        model = quantize(model)
    tok = load_tokenizer(args.init)
    if args.compile:  # the first token waits for the compile: say so rather than sit silent for minutes
        print(
            "python -m torchref.generate: compiling the decode step with torch.compile (minutes on a CPU; the "
            "tokens follow)...",
            file=sys.stderr,
            flush=True,
        )
    if args.interactive:
        chat = Conversation(model, max_len=args.max_len, compile=args.compile, compile_mode=args.compile_mode)
        converse(chat, tok, args, sys.stdin)
    else:
        print_generated(stream, model, args, tok, compile=args.compile, compile_mode=args.compile_mode)


if __name__ == "__main__":
    sys.exit(main())
