"""Per-step reporting shared by both trainers: the tqdm progress bar and the ``--log-json`` lines.

    log = RunLog(total=100, start=0, path="run.jsonl", progress=True)
    log.step(step=1, loss=5.5, grad_norm=1.2, lr=3e-4, loss_scale=1.0, skipped=False, tokens=1024, seconds=0.1,
             peak_mem_bytes=123)
    log.close()

One JSON object per line: a training step's record has :data:`KEYS` (``step`` counts optimizer steps from 1); an
evaluation of ``--eval-data`` after step N is a record of its own with :data:`EVAL_KEYS` (``step`` N, the mean token
loss in nats, its perplexity and the targets scored), written after step N's record; :func:`read_log` returns one
kind (training records by default). On ``--resume`` the log
keeps the lines up to the resumed step and drops the later ones (lines a killed run wrote after its last
checkpoint), so the file reads as one uninterrupted run. ``peak_mem_bytes`` is the device's peak allocation
where the framework reports one (GPU), else the process's peak resident set size (CPU). ``tokens_per_s`` counts
real (non-padding) input tokens over the step's wall time; step 1's time includes the compile. The file is strict
JSON: a non-finite value is written as ``null``.
"""

from __future__ import annotations

import json
import math
import os
import resource
import sys

__all__ = ["KEYS", "EVAL_KEYS", "RunLog", "DivergenceGuard", "TrainingError", "host_peak_rss_bytes", "read_log"]

KEYS = ("step", "loss", "grad_norm", "lr", "loss_scale", "skipped", "tokens_per_s", "peak_mem_bytes")
EVAL_KEYS = ("step", "eval_loss", "eval_perplexity", "eval_tokens")
LOG_KINDS = ("train", "eval", "all")


def host_peak_rss_bytes() -> int:
    """Peak resident set size of this process in bytes (``ru_maxrss`` is KiB on Linux, bytes on macOS)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


def read_log(path: str, kind: str = "train") -> list[dict]:
    """The JSON objects of a ``--log-json`` file: ``kind="train"`` the step records (:data:`KEYS`), ``"eval"`` the
    evaluation records (:data:`EVAL_KEYS`), ``"all"`` every line in file order."""
    if kind not in LOG_KINDS:
        raise ValueError(f"kind={kind!r} is not known; use one of {', '.join(LOG_KINDS)}")
    with open(path) as f:
        records = [json.loads(line) for line in f if line.strip()]
    if kind == "all":
        return records
    return [r for r in records if ("eval_loss" in r) == (kind == "eval")]


class RunLog:
    def __init__(self, total: int, start: int = 0, path: str | None = None, progress: bool = True, desc: str = "train"):
        self.file = None
        if path is not None:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            kept = []
            if start > 0 and os.path.exists(path):
                kept = [r for r in read_log(path, "all") if r.get("step", 0) <= start]
            self.file = open(path, "w")
            for r in kept:
                self.file.write(json.dumps(r) + "\n")
            self.file.flush()
        self.bar = None
        if progress:
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=start, desc=desc, unit="step", dynamic_ncols=True, disable=None)

    def step(
        self,
        *,
        step: int,
        loss: float,
        grad_norm: float,
        lr: float,
        loss_scale: float,
        skipped: bool,
        tokens: int,
        seconds: float,
        peak_mem_bytes: int,
    ) -> dict:
        rec = {
            "step": int(step),
            "loss": float(loss),
            "grad_norm": float(grad_norm),
            "lr": float(lr),
            "loss_scale": float(loss_scale),
            "skipped": bool(skipped),
            "tokens_per_s": float(tokens / seconds) if seconds > 0 else None,
            "peak_mem_bytes": int(peak_mem_bytes),
        }
        if self.file is not None:  # strict JSON: a non-finite loss or norm is null, never a bare NaN
            strict = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in rec.items()}
            self.file.write(json.dumps(strict, allow_nan=False) + "\n")
            self.file.flush()
        if self.bar is not None:
            tps = rec["tokens_per_s"]
            self.bar.set_postfix(loss=f"{rec['loss']:.4f}", tok_s=f"{tps:,.0f}" if tps else "-", refresh=False)
            self.bar.update(1)
        return rec

    def eval(self, *, step: int, loss: float, perplexity: float, tokens: int) -> dict:
        """Log an evaluation after ``step`` (a ``spec.eval.EvalResult``'s mean token loss, perplexity and scored
        targets): an :data:`EVAL_KEYS` record and a line beside the bar."""
        ppl = perplexity
        rec = {"step": int(step), "eval_loss": float(loss), "eval_perplexity": float(ppl), "eval_tokens": int(tokens)}
        if self.file is not None:
            strict = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in rec.items()}
            self.file.write(json.dumps(strict, allow_nan=False) + "\n")
            self.file.flush()
        self.write(f"eval after step {step}: loss {loss:.4f}, perplexity {ppl:.4f} over {tokens} tokens")
        return rec

    def write(self, message: str) -> None:
        """A line that does not break the bar."""
        if self.bar is not None:
            self.bar.write(message, file=sys.stderr)
        else:
            print(message, file=sys.stderr)

    def breakdown(self, timer) -> dict:
        """Write ``timer``'s phase table (a ``spec.timing.StepTimer``) and return its summary ({} if empty)."""
        summary = timer.summary()
        if summary:
            self.write(f"step-time breakdown (host view, first step left out):\n{timer.report()}")
        return summary

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.file is not None:
            self.file.close()


class TrainingError(RuntimeError):
    """A run that cannot go on (it diverged, a checkpoint could not be written): the CLIs exit 1 with the message."""


class DivergenceGuard:
    """Stops a run after ``limit`` consecutive steps whose loss, or (for a step the loss scale did not skip) whose
    gradient norm, is not finite: :meth:`check` raises :class:`TrainingError`. A finite step resets the count."""

    def __init__(self, limit: int, flag: str = "--max-nonfinite-steps"):
        self.limit, self.flag, self.bad = limit, flag, []

    def check(self, rec: dict) -> None:
        finite = math.isfinite(rec["loss"]) and (rec["skipped"] or math.isfinite(rec["grad_norm"]))
        self.bad = [] if finite else self.bad + [rec["step"]]
        if len(self.bad) >= self.limit:
            raise TrainingError(
                f"training diverged: the loss or the gradient norm was not finite for {len(self.bad)} consecutive "
                f"steps ({self.bad[0]}..{self.bad[-1]}; last loss {rec['loss']}, grad_norm {rec['grad_norm']}); "
                f"stopped without writing a checkpoint or an export of these weights. Lower --lr, keep --clip-grad "
                f"on, or check the --init weights ({self.flag} {self.limit} sets how many steps are tolerated)"
            )
