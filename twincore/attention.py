"""The attention contract (design §4) and the backend table, shared by both twins (no jax, no torch).

``jaxattn.attention.normalize`` and ``torchref.attention.dot_product_attention`` both check a call with
:func:`check_call`: each side only says how to read an array (``describe(x) -> (shape, dtype name)`` or None)
and which layout it uses, so the two packages accept the same calls and raise the same messages::

    from twincore.attention import check_call
    c = check_call(q, k, v, causal=True, window=(128, None), layout="bshd", describe=describe)
    c.window  # (128, 0): with causal the right side is 0

:data:`BACKENDS` is the one backend table: the JAX dispatcher's names, modules, forward-only set and default
orders, and torchref's SDPA mapping, are all read from it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import re
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

__all__ = [
    "BACKENDS",
    "Backend",
    "PLATFORMS",
    "FLEX",
    "LAYOUTS",
    "Layout",
    "Call",
    "MAX_HEAD_DIM",
    "SUPPORTED_DTYPES",
    "backend_names",
    "torch_backend_names",
    "backend",
    "default_order",
    "check_backend_names",
    "AttentionChoice",
    "check_call",
    "check_window",
    "visible_bounds",
]

PLATFORMS: tuple[str, ...] = ("cpu", "gpu", "tpu")
FLEX = "FlexAttention"  # a ``torch_twin`` that is not an SDPBackend member: torch.nn.attention.flex_attention


# --------------------------------------------------------------------------------------------- backends
@dataclasses.dataclass(frozen=True)
class Backend:
    """One attention backend.

    * ``name``: what ``backend=`` / ``attention_backend(...)`` take.
    * ``module``: its module in ``jaxattn.attention``, or None (a torch-only backend: jaxattn refuses the name).
    * ``torch_twin``: the ``torch.nn.attention.SDPBackend`` member serving the same name in torchref,
      :data:`FLEX` (torch's FlexAttention, ``torchref.flex_attention``), or None (no torch twin: torchref refuses
      the name).
    * ``forward_only``: no backward (never offered to training).
    * ``default_rank``: ``((platform, rank), ...)``: position in that platform's default order (0 first);
      a platform not listed leaves the backend opt-in there.  Pass a dict; it is stored as sorted pairs.
    * ``default_min_q``: ``((platform, n), ...)``: in that platform's default order only for calls of at least n
      queries per row (a backend named explicitly serves any call).  A dict, stored as sorted pairs.
    * ``default_min_kv``: the same floor on keys per row.
    * ``title``: a few words for messages.
    """

    name: str
    module: str | None
    torch_twin: str | None
    forward_only: bool = False
    default_rank: Any = ()
    title: str = ""
    default_min_q: Any = ()
    default_min_kv: Any = ()

    def __post_init__(self):
        for field in ("default_rank", "default_min_q", "default_min_kv"):
            table = dict(getattr(self, field))
            bad = sorted(set(table) - set(PLATFORMS))
            if bad:
                raise ValueError(f"Backend {self.name!r}: {field} platforms must be in {PLATFORMS}, got {bad}")
            object.__setattr__(self, field, tuple(sorted(table.items())))

    def rank(self, platform: str) -> int | None:
        """Position in ``platform``'s default order, or None (opt-in there)."""
        return dict(self.default_rank).get(platform)

    def in_default(self, platform: str, q_len: int | None = None, kv_len: int | None = None) -> bool:
        """Ranked on ``platform`` and, for a call of ``q_len`` queries and ``kv_len`` keys per row (None: any),
        at or above both floors there."""
        return (
            self.rank(platform) is not None
            and (q_len is None or q_len >= dict(self.default_min_q).get(platform, 1))
            and (kv_len is None or kv_len >= dict(self.default_min_kv).get(platform, 1))
        )


# design §4: a backend enters a GPU default only on evidence (its compiled `gpu` tests passed on a real GPU
# and a committed record shows it correct). `mosaic` joined on one H200 (2026-11-27): all 51 `gpu` tests passed and,
# at D=128, it tied cuDNN (median time / fastest 1.00 vs 1.02) and beat flash 1.6x; the tie keeps cuDNN first and it
# declines off Hopper (benchmarks/NOTES.md, "GPU session on one H200").
# On a CPU: `chunked` (blocked, masked blocks skipped; torch's CPU SDPA is a blocked flash kernel too) before `xla`,
# whose materialised scores were 3-15x slower from S = 1024 on, except for one query per row (a decode step), where
# `xla`'s multiply-and-sum was 5x faster (benchmarks/NOTES.md, "JAX's CPU default"), and under 128 keys per row, where
# `chunked`'s scan and custom VJP cost more to compile and dispatch than they save ("A key-length floor").
# On a TPU: jax's splash kernel (a library kernel, MaxText's TPU default), then the pure-JAX ones; its torch twin is
# none (torch_xla is out of scope: torchref runs on CPU/CUDA).
# `flex`: torch's FlexAttention (mask and score cap compiled into one kernel, fully masked blocks skipped), opt-in; no
# JAX twin of its own, its JAX counterparts being the kernels that take the same masks natively (`flash`, `mosaic`,
# `splash`, `chunked`). Its CPU kernel has no backward (torch 2.13): forward only there.
BACKENDS: tuple[Backend, ...] = (
    Backend("flash", "flash", "FLASH_ATTENTION", default_rank={"gpu": 2}, title="Pallas flash attention"),
    Backend("flash_decode", "decode", None, forward_only=True, title="Pallas split-K decode"),
    Backend("mosaic", "mosaic", None, default_rank={"gpu": 1}, title="Pallas Mosaic GPU"),
    Backend("splash", "splash", None, default_rank={"tpu": 0}, title="Pallas TPU splash attention (jax's)"),
    Backend("cudnn", "cudnn", "CUDNN_ATTENTION", default_rank={"gpu": 0}, title="cuDNN fused attention"),
    Backend(
        "chunked",
        "chunked",
        "EFFICIENT_ATTENTION",
        default_rank={"gpu": 3, "tpu": 1, "cpu": 0},
        default_min_q={"cpu": 2},
        default_min_kv={"cpu": 128},
        title="O(S)-memory JAX",
    ),
    Backend("xla", "xla", "MATH", default_rank={"gpu": 4, "cpu": 1, "tpu": 2}, title="plain math"),
    Backend("flex", None, FLEX, title="torch FlexAttention"),
)
_BY_NAME: dict[str, Backend] = {b.name: b for b in BACKENDS}


def backend(name: str) -> Backend:
    """The :data:`BACKENDS` row of ``name`` (KeyError when there is none)."""
    return _BY_NAME[name]


def backend_names(*, forward_only: bool | None = None) -> tuple[str, ...]:
    """Every jaxattn backend name (a row with a ``module``) in table order; ``forward_only=False`` drops the
    forward-only ones."""
    return tuple(
        b.name for b in BACKENDS if b.module is not None and (forward_only is None or b.forward_only == forward_only)
    )


def torch_backend_names() -> tuple[str, ...]:
    """The names torchref serves (a torch twin), in table order."""
    return tuple(b.name for b in BACKENDS if b.torch_twin is not None)


@functools.cache
def default_order(platform: str, q_len: int | None = None, kv_len: int | None = None) -> tuple[str, ...]:
    """Default backend order on ``platform`` ("cpu", "gpu", "tpu"): the ranked rows, by rank; for a call of
    ``q_len`` queries and ``kv_len`` keys per row, without the rows whose ``default_min_q`` / ``default_min_kv``
    there is more (None: every ranked row)."""
    if platform not in PLATFORMS:
        raise ValueError(f"platform must be one of {PLATFORMS}, got {platform!r}")
    ranked = [(b.rank(platform), b.name) for b in BACKENDS if b.in_default(platform, q_len, kv_len)]
    return tuple(name for _, name in sorted(ranked))


def check_backend_names(names, argname: str, framework: str = "jax") -> tuple[str, ...]:
    """``names`` (one name or a sequence) as a tuple, checked against the backends of ``framework``
    ("jax": every row; "torch": the rows with a torch twin).  Unknown, repeated, non-string or no names raise,
    listing the valid ones; a backend without a torch twin is named as such on the torch side.  An
    :class:`AttentionChoice` made for ``framework`` (alone, or the only item) was checked when it was made."""
    if isinstance(names, tuple) and len(names) == 1 and isinstance(names[0], AttentionChoice):
        names = names[0]
    if isinstance(names, AttentionChoice):
        if names.framework == framework:
            return names.names
        names = names.names  # made for the other twin: checked against this one's table below
    valid = backend_names() if framework == "jax" else torch_backend_names()
    given = names
    if isinstance(names, str):
        names = (names,)
    try:
        names = tuple(names)
    except TypeError:
        raise TypeError(
            f"{argname} must be a backend name or a sequence of names from {valid}, "
            f"got {given!r} of type {type(given).__name__}"
        ) from None
    if not names:
        raise ValueError(f"{argname} must name at least one backend from {valid}, got an empty list")
    for n in names:
        if not isinstance(n, str):
            raise TypeError(
                f"{argname}: backend names must be strings from {valid}, got {n!r} of type {type(n).__name__}"
            )
        if n not in valid:
            if n in _BY_NAME:  # a backend of the other twin only
                other = "JAX" if framework == "jax" else "torch"
                raise ValueError(
                    f"{argname}: {n!r} ({_BY_NAME[n].title}) has no {other} twin; {framework} backends are {valid}"
                )
            raise ValueError(f"{argname}: unknown attention backend {n!r}; valid backends are {valid}")
    if len(set(names)) != len(names):
        raise ValueError(f"{argname}: backend names must not repeat, got {names}")
    return names


class AttentionChoice(str):
    """The attention backends a run asked for, in order of preference: parsed and checked ONCE where the choice
    enters (the CLI's ``--attention``: :meth:`parse`; code: ``AttentionChoice(("flash", "xla"), "jax")``), then
    passed down as this object. It is a ``str``, its canonical text (``"flash,xla"``), so flags and checkpoint
    metadata stay JSON; ``names`` is the checked tuple, ``framework`` the twin it was checked for.
    ``attention_backend(choice)`` and ``backend=choice`` take it without checking it again.

        choice = AttentionChoice.parse("flash, xla", "jax", allowed=("flash", "xla", "chunked"))
        choice.names  # ("flash", "xla")
    """

    names: tuple[str, ...]
    framework: str

    def __new__(cls, names, framework: str = "jax", argname: str = "backends", allowed=None):
        checked = check_backend_names(names, argname, framework)
        if allowed is not None and any(n not in allowed for n in checked):
            bad = [n for n in checked if n not in allowed]
            raise ValueError(f"{argname}: {bad} not offered here; expected backends from {tuple(allowed)}")
        self = super().__new__(cls, ",".join(checked))
        self.names, self.framework = checked, framework
        return self

    @classmethod
    def parse(cls, text: str, framework: str, allowed, argname: str = "--attention") -> AttentionChoice:
        """``"flash,xla"`` (comma-separated, spaces allowed) checked against ``allowed`` (the choices offered
        there, e.g. training's: no forward-only backend); a ValueError naming ``argname`` and what is accepted."""
        try:
            return cls(tuple(n.strip() for n in str(text).split(",")), framework, argname, allowed)
        except (TypeError, ValueError):
            raise ValueError(
                f"{argname} {text!r}: expected comma-separated, non-repeated {framework} attention "
                f"backends from {', '.join(allowed)}"
            ) from None

    def __reduce__(self):  # pickles (a torch checkpoint's flags, a worker's arguments) as itself, checked again
        return (type(self), (self.names, self.framework))


# --------------------------------------------------------------------------------------------- the call
MAX_HEAD_DIM = 256
SUPPORTED_DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16")
_INT_DTYPE = re.compile(r"u?int\d+")  # any signed/unsigned integer dtype name (bool is not one)

Window = tuple[int | None, int | None] | None


@dataclasses.dataclass(frozen=True)
class Layout:
    """How one framework lays out and names its arrays in messages."""

    tag: str  # "bshd" (JAX) / "bhsd" (torch)
    q: str  # "[B, Sq, Hq, D]"
    kv: str  # "[B, Sk, Hkv, D]"
    name: str  # "the JAX layout"
    array: str  # "an array with .shape and .dtype": what a non-array input should have been
    ids: str  # "an integer array": what segment ids are


LAYOUTS: dict[str, Layout] = {
    "bshd": Layout(
        "bshd",
        "[B, Sq, Hq, D]",
        "[B, Sk, Hkv, D]",
        "the JAX layout",
        "an array with .shape and .dtype",
        "an integer array",
    ),
    "bhsd": Layout(
        "bhsd", "[B, Hq, Sq, D]", "[B, Hkv, Sk, D]", "the torch layout", "a torch.Tensor", "an integer torch.Tensor"
    ),
}


class Call(NamedTuple):
    """A checked call, defaults filled.  ``segments``: "none", "shared" (one ``[B, S]`` array: ``q_ids`` is
    ``kv_ids``) or "pair"; ``q_ids``/``kv_ids`` are the caller's own arrays (or None)."""

    causal: bool
    scale: float
    window: Window
    softcap: float | None
    segments: str
    q_ids: Any
    kv_ids: Any


Describe = Callable[[Any], tuple[tuple[int, ...], str] | None]


def _described(name: str, x, describe: Describe, layout: Layout) -> tuple[tuple[int, ...], str]:
    got = describe(x)
    if got is None:
        raise TypeError(f"{name} must be {layout.array}, got {type(x).__name__}")
    shape, dtype = got
    return tuple(shape), str(dtype)


def _positive_float(name: str, value) -> float:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"{name} must be a positive finite Python/NumPy number or None, got {value!r} "
            f"of type {type(value).__name__} (an array or a traced value is not accepted: it must "
            f"be static)"
        )
    value = float(value)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a positive finite number or None, got {value!r}")
    return value


def _check_ids(name: str, ids, batch: int, length: int, length_name: str, describe: Describe, layout: Layout):
    shape, dtype = _described(name, ids, describe, layout)
    if not _INT_DTYPE.fullmatch(dtype):
        raise TypeError(f"{name} must have an integer dtype, got {dtype} (accepted: any signed/unsigned integer dtype)")
    if shape != (batch, length):
        raise ValueError(f"{name} must have shape (B, {length_name}) = {(batch, length)}, got {shape}")
    return ids


def check_window(window, causal: bool) -> Window:
    """``window`` as ``(left, right)`` (None = unbounded side), or None when it restricts nothing beyond
    ``causal``; with ``causal`` the right side is 0."""
    if window is None:
        return None
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise ValueError(f"window must be None or a (left, right) pair of non-negative ints or None, got {window!r}")
    sides = []
    for side_name, w in zip(("left", "right"), window):
        if w is None:
            sides.append(None)
            continue
        if isinstance(w, (bool, np.bool_)) or not isinstance(w, numbers.Integral):
            raise TypeError(
                f"window {side_name} side must be a non-negative int or None, got {w!r} "
                f"of type {type(w).__name__} (window={window!r})"
            )
        if w < 0:
            raise ValueError(f"window {side_name} side must be >= 0 or None, got {w} (window={window!r})")
        sides.append(int(w))
    left, right = sides
    if causal:
        right = 0
    if left is None and (right is None or causal):
        return None  # restricts nothing beyond what `causal` already does
    return (left, right)


def visible_bounds(causal: bool, window: Window) -> tuple[int | None, int | None]:
    """``(left, right)`` such that key j is visible to query i iff ``i_abs - left <= j <= i_abs + right``
    (``i_abs = i + Sk - Sq``; None: unbounded side): the window's sides, the right one cut to 0 by ``causal``."""
    left, right = (None, None) if window is None else window
    if causal:
        right = 0 if right is None else min(right, 0)
    return left, right


def default_scale(head_dim: int) -> float:
    """The score scale when none is given: ``1 / sqrt(head_dim)``."""
    return 1.0 / math.sqrt(head_dim)


def check_call(
    q, k, v, *, causal=False, segment_ids=None, scale=None, window=None, softcap=None, layout: str, describe: Describe
) -> Call:
    """Check one attention call and return its :class:`Call`.

    ``layout``: "bshd" (q ``[B, Sq, Hq, D]``, k/v ``[B, Sk, Hkv, D]``) or "bhsd" (q ``[B, Hq, Sq, D]``).
    ``describe(x)``: ``(shape, dtype name)`` of an array of the caller's framework, None for anything else.
    q, k, v share one dtype in :data:`SUPPORTED_DTYPES`; ``Hq % Hkv == 0``; ``1 <= D <= 256``;
    ``segment_ids`` is None, an integer ``[B, S]`` array (needs ``Sq == Sk``) or a pair ``(q_ids [B, Sq],
    kv_ids [B, Sk])``.  Raises ``TypeError`` / ``ValueError`` naming the argument, the value and what is
    accepted (design §10)."""
    lay = LAYOUTS[layout]
    qs, ks, vs = (_described(n, x, describe, lay) for n, x in (("q", q), ("k", k), ("v", v)))
    for name, (s, _) in (("q", qs), ("k", ks), ("v", vs)):
        if len(s) != 4:
            want = lay.q if name == "q" else lay.kv
            raise ValueError(f"{name} must have rank 4 {want} ({lay.name}), got shape {s} (rank {len(s)})")
    dts = {"q": qs[1], "k": ks[1], "v": vs[1]}
    for n, d in dts.items():
        if d not in SUPPORTED_DTYPES:
            raise TypeError(f"{n} dtype must be one of {SUPPORTED_DTYPES}, got {d}")
    if len(set(dts.values())) != 1:
        raise TypeError(
            f"q, k, v must share one dtype, got q={dts['q']}, k={dts['k']}, v={dts['v']} "
            f"(cast them to a common dtype in {SUPPORTED_DTYPES})"
        )
    qs, ks, vs = qs[0], ks[0], vs[0]
    if ks != vs:
        raise ValueError(f"k and v must have the same shape {lay.kv}, got k {ks} and v {vs}")
    if lay.tag == "bshd":
        (b, sq, hq, d), (bk, sk, hkv, dk) = qs, ks
    else:
        (b, hq, sq, d), (bk, hkv, sk, dk) = qs, ks
    if bk != b:
        raise ValueError(f"batch size of k/v ({bk}, shape {ks}) must equal batch size of q ({b}, shape {qs})")
    if dk != d:
        raise ValueError(f"head_dim of k/v ({dk}, shape {ks}) must equal head_dim of q ({d}, shape {qs})")
    for n, val in (
        ("batch size B", b),
        ("query length Sq", sq),
        ("key length Sk", sk),
        ("query heads Hq", hq),
        ("kv heads Hkv", hkv),
        ("head_dim D", d),
    ):
        if val < 1:
            raise ValueError(f"{n} must be >= 1, got {val} (q shape {qs}, k shape {ks})")
    if d > MAX_HEAD_DIM:
        raise ValueError(f"head_dim D={d} is too large: accepted 1 <= D <= {MAX_HEAD_DIM} (q shape {qs})")
    if hq % hkv != 0:
        raise ValueError(
            f"query heads Hq={hq} must be a multiple of kv heads Hkv={hkv} (GQA/MQA); q shape {qs}, k shape {ks}"
        )

    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal must be a bool, got {causal!r} of type {type(causal).__name__}")
    causal = bool(causal)

    if segment_ids is None:
        form, q_ids, kv_ids = "none", None, None
    elif isinstance(segment_ids, (tuple, list)):
        if not all(describe(x) is not None for x in segment_ids):
            raise TypeError(
                f"segment_ids must be {lay.ids} [B, S] or a pair (q_ids [B, Sq], kv_ids [B, Sk]) "
                f"of them, got a {type(segment_ids).__name__} of "
                f"{sorted({type(x).__name__ for x in segment_ids})}"
            )
        if len(segment_ids) != 2:
            raise ValueError(
                f"segment_ids as a sequence must be a pair (q_ids [B, Sq], kv_ids [B, Sk]), "
                f"got {len(segment_ids)} elements"
            )
        form = "pair"
        q_ids = _check_ids("segment_ids[0] (q_ids)", segment_ids[0], b, sq, "Sq", describe, lay)
        kv_ids = _check_ids("segment_ids[1] (kv_ids)", segment_ids[1], b, sk, "Sk", describe, lay)
    else:
        if sq != sk:
            raise ValueError(
                f"segment_ids as one [B, S] array needs Sq == Sk (self-attention), got Sq={sq}, "
                f"Sk={sk}; pass a pair (q_ids [B, Sq], kv_ids [B, Sk]) instead"
            )
        form = "shared"
        q_ids = kv_ids = _check_ids("segment_ids", segment_ids, b, sq, "S", describe, lay)

    scale = default_scale(d) if scale is None else _positive_float("scale", scale)
    softcap = None if softcap is None else _positive_float("softcap", softcap)
    return Call(causal, scale, check_window(window, causal), softcap, form, q_ids, kv_ids)
