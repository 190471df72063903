"""Perplexity of a checkpoint on a text, framework-neutral: the evaluation batches, the result and the flags shared by
``python -m jaxattn.eval`` and ``python -m torchref.eval`` (and the trainers' ``--eval-data``).

    docs = read_documents("notes.txt", load_tokenizer("ckpt"))
    batches = eval_batches(docs, seq_len=128, batch_size=8, vocab_size=256)   # twincore.batch format, one pass
    EvalResult(loss_sum=812.5, tokens=400).perplexity                          # exp(812.5 / 400) = 7.62

:func:`eval_batches` reads the documents once, in file order, no shuffling: their concatenation is cut into windows
of ``seq_len + 1`` tokens that overlap by one, so every token but a document's first is a target exactly once
(context restarts at each window, as in training; document boundaries are segment ids, so no target is predicted
across them). The last batch is filled with empty rows (``loss_mask`` 0): one batch shape, one compile. Both twins
sum the next-token cross-entropy over the targets (``train_step.loss_fn`` with denominator 1) and count them; the
mean token loss is ``loss_sum / tokens`` (nats) and the perplexity its ``exp``.

The CLI (:func:`build_parser`, :func:`parse_args`) takes ``--init`` (a Hugging Face directory or a ``.gguf``),
``--data``, ``--seq-len``, ``--batch-size`` and ``--dtype``; every value is checked at parse (:class:`CLIError`
naming the flag), and ``twincore.cli.cli_main`` turns errors into one ``prog: error: ...`` line and exit status 2.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .batch import check_token_ids
from .cli import CLIError, OneLineParser
from .config import ModelConfig
from .data import is_gguf, segment_rows
from .dtypes import DTYPE_ALIASES, MODEL_DTYPES, check_model_dtype

__all__ = ["EvalResult", "eval_rows", "eval_batches", "build_parser", "parse_args", "PROGS"]

PROGS = {"jax": "python -m jaxattn.eval", "torch": "python -m torchref.eval"}


@dataclass(frozen=True)
class EvalResult:
    """Summed next-token cross-entropy (nats) over ``tokens`` scored targets."""

    loss_sum: float
    tokens: int

    @property
    def loss(self) -> float:
        """Mean token loss (nats); NaN when nothing was scored."""
        return self.loss_sum / self.tokens if self.tokens else math.nan

    @property
    def perplexity(self) -> float:
        """``exp(loss)`` (inf past float range)."""
        return math.exp(self.loss) if self.loss < 709 else math.inf

    def line(self, what: str = "") -> str:
        """The CLIs' output line, e.g. ``mean token loss 2.0310 nats, perplexity 7.62 over 400 tokens of x.txt``."""
        of = f" of {what}" if what else ""
        return f"mean token loss {self.loss:.4f} nats, perplexity {self.perplexity:.4f} over {self.tokens} tokens{of}"


def eval_rows(docs: Sequence[np.ndarray], seq_len: int) -> dict[str, np.ndarray]:
    """The documents' concatenation as rows of ``seq_len + 1`` tokens starting every ``seq_len`` tokens (one token of
    overlap: each token but the first is a target of exactly one row); the last row padded."""
    if isinstance(seq_len, bool) or not isinstance(seq_len, (int, np.integer)) or seq_len < 1:
        raise ValueError(f"seq_len must be an int >= 1, got {seq_len!r}")
    tokens = np.concatenate([np.asarray(d) for d in docs])
    doc = np.repeat(np.arange(len(docs)), [len(d) for d in docs])
    n = tokens.size
    rows = max(1, -(-(n - 1) // seq_len))
    idx = np.arange(rows)[:, None] * seq_len + np.arange(seq_len + 1)[None]  # [rows, seq_len + 1]
    inside = idx < n
    t = np.where(inside, tokens[np.minimum(idx, n - 1)], 0)
    d = np.where(inside, doc[np.minimum(idx, n - 1)], -1)
    return segment_rows(t, d)


def eval_batches(
    docs: Sequence[np.ndarray], *, seq_len: int, batch_size: int, vocab_size: int, name: str = "--data"
) -> list[dict[str, np.ndarray]]:
    """:func:`eval_rows` in batches of ``batch_size`` rows (the last one filled with empty rows); ids outside
    ``[0, vocab_size)`` raise ValueError naming ``name``, the document and the position."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
        raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
    docs = [np.asarray(d) for d in docs if np.asarray(d).size]
    if not docs:
        raise ValueError(f"{name}: no tokens to evaluate")
    for i, d in enumerate(docs):
        check_token_ids(d, vocab_size, arg=f"{name} (tokenized document {i})")
    rows = eval_rows(docs, seq_len)
    n = rows["tokens"].shape[0]
    fill = -n % batch_size
    rows = {k: np.concatenate([v, np.zeros((fill, v.shape[1]), v.dtype)]) for k, v in rows.items()}
    return [{k: v[i : i + batch_size] for k, v in rows.items()} for i in range(0, n + fill, batch_size)]


# ------------------------------------------------------------------------------------------------- CLI
def build_parser(framework: str) -> argparse.ArgumentParser:
    """The eval CLI's flags (identical in ``python -m jaxattn.eval`` and ``python -m torchref.eval``)."""
    if framework not in PROGS:
        raise ValueError(f"framework={framework!r} is not known; use one of {tuple(PROGS)}")
    p = OneLineParser(
        prog=PROGS[framework],
        description="Mean token loss and perplexity of a Llama checkpoint on a text (a twin of the other framework's).",
    )
    p.add_argument(
        "--init", required=True, metavar="HF_DIR|GGUF", help="the checkpoint: a Hugging Face directory or .gguf file"
    )
    p.add_argument(
        "--data",
        required=True,
        metavar="PATH",
        help="a text file, a folder of text files or a pre-tokenized .npy (tokenized by the checkpoint's tokenizer)",
    )
    p.add_argument("--seq-len", type=int, default=128, help="tokens of context per row (windows overlap by one)")
    p.add_argument("--batch-size", type=int, default=8, help="rows per forward pass")
    p.add_argument(
        "--dtype",
        default="float32",
        metavar="DTYPE",
        help=f"weights' dtype: {', '.join(MODEL_DTYPES)} or {', '.join(DTYPE_ALIASES)} (default float32)",
    )
    return p


def _config(init: str) -> ModelConfig:
    try:
        if is_gguf(init):
            from .gguf import read_gguf_config

            return read_gguf_config(init)
        from .hf_format import read_config

        return ModelConfig.from_hf(read_config(init))
    except (OSError, ValueError, TypeError, KeyError, ImportError) as e:
        raise CLIError(f"--init {init!r}: not a Llama checkpoint we can read ({e})") from None


def parse_args(argv: Sequence[str] | None, framework: str) -> tuple[argparse.Namespace, ModelConfig]:
    """Parse and check ``argv``: ``(args, model config)``; ``args.dtype`` is the full dtype name. A bad value raises
    :class:`CLIError` naming the flag before any model is loaded."""
    args = build_parser(framework).parse_args(argv)
    if not (os.path.isdir(args.init) or is_gguf(args.init)):
        raise CLIError(
            f"--init {args.init!r}: no such directory or .gguf file; expected a Hugging Face Llama directory or a GGUF"
        )
    if not os.path.exists(args.data):
        raise CLIError(f"--data {args.data!r}: no such file or folder; expected text, a folder of text or a .npy")
    for flag in ("--seq-len", "--batch-size"):
        value = getattr(args, flag[2:].replace("-", "_"))
        if value < 1:
            raise CLIError(f"{flag} {value}: must be an integer >= 1")
    try:
        args.dtype = check_model_dtype(args.dtype, "--dtype")
    except ValueError as e:
        raise CLIError(str(e).replace("--dtype=", "--dtype ")) from None
    config = _config(args.init)
    if args.seq_len > config.max_seq_len:
        raise CLIError(f"--seq-len {args.seq_len}: exceeds the model's max_seq_len={config.max_seq_len}")
    return args, config


def eval_cli(prog: str, framework: str, load_model, evaluate, argv: Sequence[str] | None = None) -> int:
    """A twin's ``python -m <twin>.eval``: the flags checked, ``--data`` read with the checkpoint's tokenizer into
    :func:`eval_batches`, ``load_model(args)`` (the twin's ``from_pretrained`` onto its device), ``evaluate(model,
    batches)`` and its one line on stdout; errors become one ``prog: error: ...`` line (an exit status)."""
    from .cli import cli_main
    from .data import load_tokenizer, read_documents

    def prepare(argv):
        args, config = parse_args(argv, framework)
        docs = read_documents(args.data, load_tokenizer(args.init))
        batches = eval_batches(
            docs,
            seq_len=args.seq_len,
            batch_size=args.batch_size,
            vocab_size=config.vocab_size,
            name=f"--data {args.data!r}",
        )
        return args, load_model(args), batches

    def report(prepared) -> EvalResult:
        args, model, batches = prepared
        result = evaluate(model, batches)
        print(result.line(args.data))
        return result

    return cli_main(prog, prepare, report, argv)
