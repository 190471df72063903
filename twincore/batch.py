"""The training batch format and the token-id rules, shared by both twins (numpy only).

A batch is a mapping ``{"tokens": int [B, S+1], "loss_mask"?: [B, S+1], "segment_ids"?: [B, S+1],
"positions"?: [B, S+1]}``; the model reads ``tokens[:, :-1]`` and predicts ``tokens[:, 1:]``. The shape and
dtype checks read only ``.shape`` and ``.dtype``, so they accept numpy, jax and torch arrays alike (tracers too);
:func:`check_token_ids` reads the values, so it needs concrete ids.

    from twincore.batch import check_batch, check_token_ids
    check_batch({"tokens": np.zeros((2, 17), np.int32)})
    check_token_ids(np.array([[1, 2, 300]]), vocab_size=256)   # ValueError: ... position (0, 2) ... 300
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from .dtypes import ID_DTYPES

BATCH_KEYS: tuple[str, ...] = ("tokens", "loss_mask", "segment_ids", "positions")


def dtype_name(x: Any) -> str:
    """``"int32"`` for a numpy/jax array's dtype or a torch tensor's ``torch.int32``."""
    return str(getattr(x, "dtype", type(x).__name__)).removeprefix("torch.")


def check_id_dtype(x: Any, arg: str) -> None:
    """Token ids, positions and segment ids: an integer dtype from :data:`ID_DTYPES` (bool is refused)."""
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(
            f"{arg} must be an integer array (numpy, jax or torch) of dtype one of {ID_DTYPES}, got {type(x).__name__}"
        )
    name = dtype_name(x)
    if name not in ID_DTYPES:
        raise TypeError(f"{arg} must have an integer dtype, one of {ID_DTYPES}; got {name}")


def token_id_error(arg: str, vocab_size: int, value: Any, position: tuple[int, ...], n_bad: Any = None) -> str:
    """The message for an id outside ``[0, vocab_size)`` (shared with the in-jit ``checkify`` check)."""
    count = "" if n_bad is None else f" ({n_bad} bad ids in all)"
    return (
        f"{arg} holds an id outside [0, vocab_size={vocab_size}): {value} at position {position}{count}; "
        f"token ids must be in [0, {vocab_size})"
    )


def check_token_ids(ids: Any, vocab_size: int, arg: str = "tokens") -> None:
    """Raise ValueError naming the first id outside ``[0, vocab_size)`` (its position and value).

    ``ids`` must be concrete (numpy, or anything ``np.asarray`` takes: a jax array, a CPU torch tensor);
    callers inside ``jit`` cannot use it.
    """
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, (int, np.integer)) or vocab_size < 1:
        raise ValueError(f"vocab_size must be a positive int, got {vocab_size!r}")
    a = np.asarray(ids)
    bad = (a < 0) | (a >= vocab_size)
    if bad.any():
        pos = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(token_id_error(arg, int(vocab_size), int(a[pos]), pos, int(bad.sum())))


def check_model_inputs(tokens: Any, positions: Any = None, segment_ids: Any = None, arg: str = "tokens") -> None:
    """A model call's inputs: ``tokens`` int ``[batch >= 1, seq >= 1]``; ``positions`` and ``segment_ids``
    (optional) int arrays of the same shape. Reads shapes and dtypes only (works on tracers)."""
    check_id_dtype(tokens, arg)
    if len(tokens.shape) != 2 or 0 in tuple(tokens.shape):
        raise ValueError(
            f"{arg} must be an int array [batch >= 1, seq >= 1], got {dtype_name(tokens)}{list(tokens.shape)}"
        )
    for name, v in (("positions", positions), ("segment_ids", segment_ids)):
        if v is None:
            continue
        check_id_dtype(v, name)
        if tuple(v.shape) != tuple(tokens.shape):
            raise ValueError(f"{name} must have the {arg}' shape {tuple(tokens.shape)}, got {tuple(v.shape)}")


def check_moe_args(config, tokens_shape: tuple, cache: Any, moe_stats: Any, moe_mask: Any, arg: str = "tokens") -> None:
    """A model call's Mixture-of-Experts arguments: ``moe_stats`` a bool, True only for an MoE config and without a
    KV cache; ``moe_mask`` None or ``[B, S]`` like the ``arg`` ids. ValueError naming the argument otherwise."""
    if not isinstance(moe_stats, bool):
        raise ValueError(f"moe_stats must be True or False, got {moe_stats!r}")
    if moe_stats and not config.is_moe:
        raise ValueError("moe_stats=True needs a Mixture-of-Experts config (n_experts > 0); this model is dense")
    if moe_stats and cache is not None:
        raise ValueError("moe_stats=True cannot be combined with a KV cache (router statistics are for training)")
    if moe_mask is not None and tuple(np.shape(moe_mask)) != tuple(tokens_shape):
        raise ValueError(f"moe_mask must be [B, S] like {arg} {tuple(tokens_shape)}, got {tuple(np.shape(moe_mask))}")


def cache_positions(cache: Any, positions: Any, segment_ids: Any, tokens_shape: tuple) -> Any:
    """The positions of a forward call over a KV cache (both twins' models): the cache checks the call's
    ``[B, S]`` and gives the rows' next positions unless ``positions`` are given; a cache refuses ``segment_ids``
    (its rows are right-padded instead). Without a cache, ``positions`` unchanged (None: the model's 0..S-1)."""
    if cache is None:
        return positions
    if segment_ids is not None:
        raise ValueError("segment_ids cannot be combined with a KV cache (rows are right-padded instead)")
    cache.check_call(tuple(tokens_shape))
    return cache.positions(tokens_shape[1]) if positions is None else positions


def is_ring(max_len: int, window: int | None) -> bool:
    """Whether both twins' KV cache of ``max_len`` slots for a model of ``sliding_window`` ``window`` is a ring:
    position p in slot ``p % max_len``, so decoding runs past ``max_len`` (``jaxattn/kv_cache.py``)."""
    return window is not None and max_len >= window


def check_append(s: int, max_len: int, window: int | None) -> None:
    """ValueError unless a call of ``s`` tokens may append to both twins' cache of ``max_len`` slots made with
    ``append=True`` for a model of ``sliding_window`` ``window``: in a ring ``s <= max_len - window + 1``, so the
    call never writes over a slot that its first token (or, with right padding, a row's next token) still sees."""
    if is_ring(max_len, window) and s > max_len - window + 1:
        raise ValueError(
            f"cache: a call of {s} tokens appends to a ring of max_len {max_len} for a sliding_window of {window}; "
            f"it takes at most max_len - window + 1 = {max_len - window + 1} tokens per call (more would write over "
            f"slots its first tokens still see): shorter calls, or a ring of sliding_window + {s} - 1 slots"
        )


def check_logits_at(logits_at: Any, tokens_shape: tuple, arg: str = "logits_at") -> None:
    """A model call's ``logits_at``: an int array ``[batch, K >= 1]`` (the tokens' batch) of indices into the
    sequence axis of tokens shaped ``tokens_shape = (batch, seq)``. Reads the shape and dtype only (works on
    tracers); :func:`check_logits_at_values` checks the values where they are concrete."""
    check_id_dtype(logits_at, arg)
    b, s = tuple(tokens_shape)
    if len(logits_at.shape) != 2 or logits_at.shape[0] != b or logits_at.shape[1] < 1:
        raise ValueError(
            f"{arg} must be an int array [batch={b}, K >= 1] of positions in [0, {s}) (one list per row), got "
            f"{dtype_name(logits_at)}{list(logits_at.shape)}"
        )


def check_logits_at_values(logits_at: Any, seq: int, arg: str = "logits_at") -> None:
    """ValueError naming the first index of a concrete ``logits_at`` outside ``[0, seq)`` (its place and value)."""
    a = np.asarray(logits_at)
    bad = (a < 0) | (a >= seq)
    if bad.any():
        pos = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(f"{arg}{list(pos)} = {int(a[pos])} is outside the sequence [0, {seq}) of this call")


def check_batch(batch: Any) -> None:
    """Keys, dtypes and shapes of a training batch (not the id values: see :func:`check_token_ids`)."""
    if not isinstance(batch, Mapping):
        raise TypeError(
            f"batch must be a mapping with keys {BATCH_KEYS} ('tokens' required), got {type(batch).__name__}"
        )
    unknown = [k for k in batch if k not in BATCH_KEYS]
    if unknown or "tokens" not in batch:
        raise ValueError(f"batch keys must be 'tokens' plus optional {BATCH_KEYS[1:]}; got {sorted(batch)}")
    tokens = batch["tokens"]
    check_id_dtype(tokens, "batch['tokens']")
    if len(tokens.shape) != 2 or tokens.shape[1] < 2 or tokens.shape[0] < 1:
        raise ValueError(
            f"batch['tokens'] must be an int array [batch >= 1, seq >= 2], got {dtype_name(tokens)}{list(tokens.shape)}"
        )
    for k in BATCH_KEYS[1:]:
        v = batch.get(k)
        if v is None:
            continue
        if not hasattr(v, "shape"):
            raise TypeError(f"batch[{k!r}] must be an array of the tokens' shape, got {type(v).__name__}")
        if k != "loss_mask":
            check_id_dtype(v, f"batch[{k!r}]")
        if tuple(v.shape) != tuple(tokens.shape):
            raise ValueError(f"batch[{k!r}] must have the tokens' shape {tuple(tokens.shape)}, got {tuple(v.shape)}")
