"""The training data pipeline's numpy side, shared by both trainers: tokenize, pack or bucket, batch i.

    ds = Dataset.from_source("notes.txt", seq_len=128, batch_size=8, seed=0, vocab_size=256)
    batch = ds.batch(0)   # {"tokens": int32 [8, 129], "loss_mask", "segment_ids", "positions"} (twincore.batch format)

``batch(i)`` is a pure function of ``(source, seq_len, batch_size, seed, packing, i)``: both frameworks see the same
batches in the same order, and a resume needs only ``i``. Tokens are UTF-8 bytes (ids 0..255, no special tokens),
or the ``--init`` directory's ``tokenizer.json``; document boundaries are ``segment_ids`` (attention and targets
never cross them; positions restart per segment). Sources: ``synthetic`` (learnable ``(a + b*t) mod vocab``
documents), a text file, a folder of files, or a ``.npy`` of ids. Each epoch shuffles the documents (seeded by
``[seed, purpose, epoch]``), then ``packing="pack"`` cuts their concatenation into full rows (one shape: one
compile) or ``packing="bucket"`` puts one document per row, padded to the smallest of :func:`bucket_lengths`
(one compile per bucket).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from typing import Any

import numpy as np

from .batch import check_token_ids
from .tokenizer import TOKENIZER_FILE, ByteTokenizer, HFTokenizer, is_gguf, load_tokenizer

__all__ = [
    "PACKING",
    "SYNTHETIC",
    "ByteTokenizer",
    "HFTokenizer",
    "load_tokenizer",
    "read_documents",
    "bucket_lengths",
    "pack_rows",
    "segment_rows",
    "is_gguf",
    "copy_tokenizer",
    "Dataset",
]

PACKING: tuple[str, ...] = ("pack", "bucket")
SYNTHETIC = "synthetic"
# a Hugging Face directory's tokenizer files, copied beside an export of a model trained from it
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


def copy_tokenizer(init_dir: str | None, out_dir: str) -> None:
    """Put the tokenizer of ``--init`` beside an exported model in ``out_dir``: a directory's ``tokenizer.json``
    (if any) is copied with its chat template, special tokens and EOS/BOS ids (:data:`TOKENIZER_FILES`); a
    ``.gguf`` file's tokenizer is written as ``tokenizer.json`` plus its chat template
    (``tokenizer_config.json``) and BOS/EOS ids (``generation_config.json``), so the export generates and
    evaluates with the same tokens as the file."""
    if is_gguf(init_dir):
        import json

        from .atomic import write_text_atomic
        from .gguf import read_gguf_tokenizer

        tok = read_gguf_tokenizer(init_dir)
        write_text_atomic(os.path.join(out_dir, TOKENIZER_FILE), tok.tokenizer.to_str())
        vocab = {i: t for t, i in tok.tokenizer.get_vocab(with_added_tokens=True).items()}
        config = {"chat_template": tok.chat_template, "add_bos_token": tok.add_bos}
        config.update({f"{k}_token": vocab[i] for k, i in (("bos", tok.bos_id), ("eos", tok.eos_id)) if i is not None})
        write_text_atomic(os.path.join(out_dir, "tokenizer_config.json"), json.dumps(config, indent=2) + "\n")
        ids = {f"{k}_token_id": i for k, i in (("bos", tok.bos_id), ("eos", tok.eos_id)) if i is not None}
        write_text_atomic(os.path.join(out_dir, "generation_config.json"), json.dumps(ids, indent=2) + "\n")
    elif init_dir and os.path.isfile(os.path.join(init_dir, TOKENIZER_FILE)):
        for name in TOKENIZER_FILES:
            if os.path.isfile(os.path.join(init_dir, name)):
                shutil.copyfile(os.path.join(init_dir, name), os.path.join(out_dir, name))


_WINDOW = 8  # bucket mode sorts rows by length within windows of this many batches
_SHUFFLE, _SYNTH, _ORDER = 0, 1, 2  # RNG purposes
_NPY_ACCEPTED = "a .npy written by numpy.save holding integer token ids, 1-D (one document) or 2-D (one per row)"


def _npy_documents(file: str, flag: str = "--data") -> list[np.ndarray]:
    with open(file, "rb") as f:
        magic = f.read(6)
    if magic != b"\x93NUMPY":  # numpy would call a text file "pickled data"
        raise ValueError(
            f"{flag} {file!r} is not a .npy array file (it starts with {magic!r}, not numpy's b'\\x93NUMPY'); "
            f"a file named *.npy must be {_NPY_ACCEPTED}; give text data a name without the .npy suffix"
        )
    try:
        arr = np.load(file, allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:  # object arrays (pickles), truncated or corrupt headers
        raise ValueError(f"{flag} {file!r} cannot be read as {_NPY_ACCEPTED}: {e}") from None
    if arr.dtype.kind not in "iu" or arr.ndim not in (1, 2):
        raise ValueError(
            f"{flag} {file!r}: a pre-tokenized .npy must hold integer token ids, 1-D (one document) "
            f"or 2-D (one document per row); got {arr.dtype}{list(arr.shape)}"
        )
    # int64 unless that would wrap: uint64 ids >= 2**63 stay uint64, so the vocabulary check shows their value
    # (they are out of any vocabulary) instead of a negative number.
    if arr.dtype == np.uint64 and arr.size and arr.max() > np.iinfo(np.int64).max:
        return [arr] if arr.ndim == 1 else list(arr)
    return [arr.astype(np.int64)] if arr.ndim == 1 else [row.astype(np.int64) for row in arr]


def _file_documents(file: str, tokenizer, flag: str = "--data") -> list[np.ndarray]:
    if file.endswith(".npy"):
        return _npy_documents(file, flag)
    with open(file, "rb") as f:
        raw = f.read()
    if isinstance(tokenizer, ByteTokenizer):  # byte-level: any file's bytes, UTF-8 or not
        return [np.frombuffer(raw, np.uint8).astype(np.int32)]
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(
            f"{flag} {file!r} is not UTF-8 text ({e}), which {tokenizer.name} needs; pass "
            f"text files or pre-tokenized .npy"
        ) from None
    return [np.asarray(tokenizer.encode(text), np.int32)]


def read_documents(source: str, tokenizer=None, flag: str = "--data") -> list[np.ndarray]:
    """The non-empty token-id documents of a text file, a folder or a ``.npy`` (see the module docstring); errors
    name ``flag``."""
    tokenizer = ByteTokenizer() if tokenizer is None else tokenizer
    if os.path.isdir(source):
        files = sorted(os.path.join(d, f) for d, _, fs in os.walk(source) for f in fs if not f.startswith("."))
        if not files:
            raise ValueError(f"{flag} {source!r} is a folder with no files; expected text files or .npy files")
        docs = [doc for file in files for doc in _file_documents(file, tokenizer, flag)]
    elif os.path.isfile(source):
        docs = _file_documents(source, tokenizer, flag)
    else:
        raise ValueError(
            f"{flag} {source!r}: no such file or folder; use 'synthetic', a text file, a folder of "
            f"text files or a pre-tokenized .npy"
        )
    docs = [d for d in docs if d.size]
    if not docs:
        raise ValueError(f"{flag} {source!r} holds no tokens")
    return docs


def bucket_lengths(seq_len: int) -> tuple[int, ...]:
    """Padded input lengths of bucket mode: ``seq_len / 8, / 4, / 2, seq_len`` (those >= 8, at least one)."""
    return tuple(sorted({seq_len} | {seq_len // d for d in (2, 4, 8) if seq_len // d >= 8}))


def _segments_to_rows(tokens: np.ndarray, doc: np.ndarray, rows: int, width: int) -> dict[str, np.ndarray]:
    """Batch arrays for a token stream cut into ``rows`` rows of ``width`` (``doc``: document index per token;
    -1 marks padding). Segment ids count from 1 within each row; positions restart at each segment start."""
    n = rows * width
    t = np.zeros(n, np.int32)
    d = np.full(n, -1, np.int64)
    t[: tokens.size], d[: tokens.size] = tokens, doc
    return segment_rows(t.reshape(rows, width), d.reshape(rows, width))


def segment_rows(t: np.ndarray, d: np.ndarray) -> dict[str, np.ndarray]:
    """Batch arrays (``twincore.batch`` format) for token rows ``t [R, W]`` and their document index per token ``d``
    (-1: padding): segment ids count from 1 within each row, positions restart at each segment start."""
    t = t.astype(np.int32)
    rows, width = t.shape
    start = np.ones_like(d, bool)
    start[:, 1:] = d[:, 1:] != d[:, :-1]
    seg = np.cumsum(start, axis=1).astype(np.int32)
    idx = np.broadcast_to(np.arange(width), (rows, width))
    last_start = np.maximum.accumulate(np.where(start, idx, 0), axis=1)
    pad = d < 0
    return {
        "tokens": t,
        "loss_mask": (~pad).astype(np.int32),
        "segment_ids": np.where(pad, 0, seg).astype(np.int32),
        "positions": np.where(pad, 0, idx - last_start).astype(np.int32),
    }


def pack_rows(docs: Sequence[np.ndarray], width: int) -> dict[str, np.ndarray]:
    """Concatenate ``docs`` and cut into rows of ``width`` tokens (the tail row padded)."""
    tokens = np.concatenate(docs)
    doc = np.repeat(np.arange(len(docs)), [len(d) for d in docs])
    return _segments_to_rows(tokens, doc, -(-tokens.size // width), width)


def _pad_rows(docs: Sequence[np.ndarray], width: int) -> dict[str, np.ndarray]:
    """One document per row, right-padded to ``width``."""
    out = {k: np.zeros((len(docs), width), np.int32) for k in ("tokens", "loss_mask", "segment_ids", "positions")}
    for r, d in enumerate(docs):
        out["tokens"][r, : len(d)] = d
        out["loss_mask"][r, : len(d)] = 1
        out["segment_ids"][r, : len(d)] = 1
        out["positions"][r, : len(d)] = np.arange(len(d))
    return out


def _rng(seed: int, purpose: int, index: int) -> np.random.Generator:
    return np.random.default_rng([seed, purpose, index])


class Dataset:
    """Deterministic batches: :meth:`batch` ``(i)`` for any step ``i`` (see the module docstring)."""

    def __init__(
        self,
        docs: list[np.ndarray] | None,
        *,
        seq_len: int,
        batch_size: int,
        seed: int = 0,
        packing: str = "pack",
        vocab_size: int = 256,
        name: str = SYNTHETIC,
    ):
        if packing not in PACKING:
            raise ValueError(f"--packing {packing!r} is not known; use one of {', '.join(PACKING)}")
        self.docs, self.seq_len, self.batch_size, self.seed = docs, int(seq_len), int(batch_size), int(seed)
        self.packing, self.vocab_size, self.name = packing, int(vocab_size), name
        self.width = self.seq_len + 1  # tokens per row: inputs [:-1], targets [1:]
        self.buckets = bucket_lengths(self.seq_len) if packing == "bucket" else (self.seq_len,)
        self._epoch: tuple[int, Any] | None = None
        if docs is not None:
            if packing == "bucket":  # long documents become chunks of at most one row
                self.docs = [d[i : i + self.width] for d in docs for i in range(0, len(d), self.width)]
                self.docs = [d for d in self.docs if len(d) >= 2]
            if not any(len(d) >= 2 for d in self.docs):  # targets never cross documents, in either mode
                raise ValueError(
                    f"--data {name!r}: no document has 2 tokens or more (needed for one target: a token and the "
                    f"next one of the same document); --packing {packing} would train on nothing (loss 0)"
                )
            for i, d in enumerate(self.docs):
                check_token_ids(d, self.vocab_size, arg=f"--data {name!r} (tokenized document {i})")

    @classmethod
    def from_source(
        cls,
        source: str,
        *,
        seq_len: int,
        batch_size: int,
        seed: int = 0,
        packing: str = "pack",
        vocab_size: int = 256,
        tokenizer=None,
    ) -> Dataset:
        docs = None if source == SYNTHETIC else read_documents(source, tokenizer)
        return cls(
            docs, seq_len=seq_len, batch_size=batch_size, seed=seed, packing=packing, vocab_size=vocab_size, name=source
        )

    # -- one epoch of a finite source: rows and batch order --------------------------------------------------
    def _build_epoch(self, epoch: int) -> tuple[list, np.ndarray]:
        docs = [self.docs[j] for j in _rng(self.seed, _SHUFFLE, 2 * epoch).permutation(len(self.docs))]
        b = self.batch_size
        if self.packing == "pack":
            rows = pack_rows(docs, self.width)
            rows = {k: v[_rng(self.seed, _SHUFFLE, 2 * epoch + 1).permutation(len(v))] for k, v in rows.items()}
            n = rows["tokens"].shape[0]
            idx = np.arange(-(-n // b) * b) % n  # the last batch wraps around to the epoch's first rows
            batches = [{k: v[idx[i : i + b]] for k, v in rows.items()} for i in range(0, idx.size, b)]
        else:
            idx = np.arange(-(-len(docs) // b) * b) % len(docs)
            window = _WINDOW * b
            for w in range(0, idx.size, window):  # sort by length within windows, then batch
                idx[w : w + window] = sorted(idx[w : w + window], key=lambda j: len(docs[j]))
            batches = []
            for i in range(0, idx.size, b):
                chunk = [docs[j] for j in idx[i : i + b]]
                longest = max(len(d) for d in chunk) - 1
                batches.append(_pad_rows(chunk, next(L for L in self.buckets if L >= longest) + 1))
        return batches, _rng(self.seed, _ORDER, epoch).permutation(len(batches))

    def batches_per_epoch(self) -> int | None:
        """Batches in one epoch of a finite source; None for ``synthetic`` (endless)."""
        return None if self.docs is None else len(self._epoch_data(0)[0])

    def _epoch_data(self, epoch: int):
        if self._epoch is None or self._epoch[0] != epoch:
            self._epoch = (epoch, self._build_epoch(epoch))
        return self._epoch[1]

    # -- synthetic ---------------------------------------------------------------------------------------------
    def _synthetic_doc(self, rng: np.random.Generator, max_len: int) -> np.ndarray:
        n = int(rng.integers(2, max_len + 1))
        a, stride = int(rng.integers(0, self.vocab_size)), int(rng.integers(1, 8))
        return ((a + stride * np.arange(n)) % self.vocab_size).astype(np.int32)

    def _synthetic_batch(self, i: int) -> dict[str, np.ndarray]:
        rng = _rng(self.seed, _SYNTH, i)
        b, w = self.batch_size, self.width
        if self.packing == "pack":
            docs, total = [], 0
            while total < b * w:
                docs.append(self._synthetic_doc(rng, w))
                total += len(docs[-1])
            tokens = np.concatenate(docs)[: b * w]
            doc = np.repeat(np.arange(len(docs)), [len(d) for d in docs])[: b * w]
            return _segments_to_rows(tokens, doc, b, w)
        chunk = [self._synthetic_doc(rng, w) for _ in range(b)]
        longest = max(len(d) for d in chunk) - 1
        return _pad_rows(chunk, next(L for L in self.buckets if L >= longest) + 1)

    # -- the public access -------------------------------------------------------------------------------------
    def batch(self, i: int) -> dict[str, np.ndarray]:
        """Batch number ``i`` (``i`` = the data position: batches consumed so far)."""
        if isinstance(i, bool) or not isinstance(i, (int, np.integer)) or i < 0:
            raise ValueError(f"batch index must be an int >= 0, got {i!r}")
        if self.docs is None:
            return self._synthetic_batch(int(i))
        n = self.batches_per_epoch()
        batches, order = self._epoch_data(int(i) // n)
        return batches[order[int(i) % n]]

    def tokens_in(self, batch: dict[str, np.ndarray]) -> int:
        """Real (non-padding) input tokens of a batch, for tokens/s."""
        return int(np.asarray(batch["loss_mask"])[:, :-1].sum())
