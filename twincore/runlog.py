"""Per-step reporting shared by both trainers: progress, the ``--log-json`` lines, the ``--tensorboard`` scalars and
the end-of-run summary.

    log = RunLog(total=100, start=0, path="run.jsonl", progress=True, desc="jax train", tensorboard="runs/tb")
    log.step(step=1, loss=5.5, grad_norm=1.2, lr=3e-4, loss_scale=1.0, skipped=False, tokens=1024, seconds=0.1,
             peak_mem_bytes=123)
    print(log.summary(checkpoint="ckpt/step_100", final="ckpt/final"))   # a RunSummary: a few lines
    log.close()

Progress goes to stderr: a tqdm bar when stderr is a terminal; when it is not (``| tee``, a CI log, a file) a
plain line per :data:`PROGRESS_LINES`-th of ``--steps``, after the run's first step (it includes the compile) and
its last, and at least every :data:`PROGRESS_SECONDS` seconds between them: a step count gives a few lines a run
whatever its speed (the short runs of tests and CI read the same every time), the time floor keeps a long run's
log alive. ``progress=False`` (``--no-progress``) silences both; eval lines and the step-time table are not
progress and still print.

``--tensorboard DIR`` writes each step's loss, grad_norm, lr and tokens_per_s as ``train/<key>`` (and loss_scale
when the precision uses loss scaling) and each evaluation as ``eval/loss`` and ``eval/perplexity``, with the
optimizer step as TensorBoard's step, through ``tensorboard.summary.Writer`` (the ``tensorboard`` package's
framework-neutral writer: numpy only, neither torch nor TensorFlow, so the JAX trainer can use it). The package is
optional (``pip install tensorboard`` or the ``[tensorboard]`` extra); without it the flag is refused at start-up
(:func:`tensorboard_writer_class`). A ``--resume`` adds an event file to DIR; steps a killed run logged after its
last checkpoint appear twice there.

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
import statistics
import sys
import time
from dataclasses import dataclass

__all__ = [
    "KEYS",
    "EVAL_KEYS",
    "RunLog",
    "RunSummary",
    "DivergenceGuard",
    "TrainingError",
    "host_peak_rss_bytes",
    "read_log",
    "MOE_KEYS",
    "tensorboard_writer_class",
    "TENSORBOARD_MISSING",
]

KEYS = ("step", "loss", "grad_norm", "lr", "loss_scale", "skipped", "tokens_per_s", "peak_mem_bytes")
# a Mixture-of-Experts run's router metrics (train_step.moe_metrics), after KEYS in its records (and train/<key>)
MOE_KEYS = ("aux_loss", "z_loss", "expert_load_min", "expert_load_max", "dropped_fraction")
EVAL_KEYS = ("step", "eval_loss", "eval_perplexity", "eval_tokens")
LOG_KINDS = ("train", "eval", "all")
PROGRESS_LINES = 10  # a piped run's progress: a line per tenth of --steps ...
PROGRESS_SECONDS = 60.0  # ... and at least one a minute
TENSORBOARD_MISSING = "--tensorboard needs the 'tensorboard' package (pip install tensorboard)"
TB_TRAIN = ("loss", "grad_norm", "lr", "tokens_per_s")  # train/<key> each step (+ loss_scale with loss scaling)


def tensorboard_writer_class():
    """``tensorboard.summary.Writer`` (``Writer(logdir).add_scalar(tag, value, step)``); ImportError with
    :data:`TENSORBOARD_MISSING` when the optional ``tensorboard`` package is absent."""
    try:
        from tensorboard.summary import Writer
    except ImportError as e:
        raise ImportError(TENSORBOARD_MISSING) from e
    return Writer


def _duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f} s"
    m, s = divmod(int(round(seconds)), 60)
    return f"{m} min {s:02d} s" if m < 60 else f"{m // 60} h {m % 60:02d} min"


def _isatty(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or closed
        return False


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


@dataclass(frozen=True)
class RunSummary:
    """What a training run did and wrote (:meth:`RunLog.summary`; ``Trainer.fit()["summary"]`` in both twins, whose
    CLIs print it on stdout). Paths are absolute, None when not written; ``checkpoint`` is the last checkpoint
    (JAX: a ``step_<N>/`` folder, torch: a ``.pt`` file) and ``final`` the Hugging Face export."""

    name: str  # "jax train" / "torch train"
    start: int  # the step the run started from (> 0 after --resume)
    steps: int  # the step it ended at (--steps)
    train_loss: float | None  # the last step's loss (None: no step ran)
    eval_step: int | None  # the last --eval-data evaluation: after this step ...
    eval_loss: float | None
    eval_perplexity: float | None
    tokens_per_s: float | None  # median over the run's steps (step 1's compile counts as one slow step)
    seconds: float  # wall time of the run (Trainer.fit), the checkpoints and the export included
    log_json: str | None
    tensorboard: str | None
    checkpoint: str | None
    final: str | None

    def lines(self) -> list[str]:
        loss = "-" if self.train_loss is None else f"{self.train_loss:.4f}"
        tps = "" if self.tokens_per_s is None else f", median {self.tokens_per_s:,.0f} tokens/s"
        out = [
            f"{self.name}: done, steps {self.start} -> {self.steps} in {_duration(self.seconds)}{tps}; "
            f"final train loss {loss}"
        ]
        if self.eval_step is not None:
            out.append(
                f"  eval after step {self.eval_step}: loss {self.eval_loss:.4f}, perplexity {self.eval_perplexity:.4f}"
            )
        if self.log_json:
            out.append(f"  log:         {self.log_json}")
        if self.tensorboard:
            out.append(f"  tensorboard: {self.tensorboard} (tensorboard --logdir {self.tensorboard})")
        if self.checkpoint:
            out.append(f"  checkpoint:  {self.checkpoint} (--resume with a larger --steps continues from it)")
        if self.final:
            out.append(f"  export:      {self.final} (Hugging Face format: --init or from_pretrained loads it)")
        else:
            out.append(
                "  the trained weights were NOT saved: give --checkpoint-dir DIR to keep checkpoints and a Hugging "
                "Face export in DIR/final"
            )
        return out

    def __str__(self) -> str:
        return "\n".join(self.lines())


class RunLog:
    """One run's reporting (module docstring): ``progress`` on stderr, ``path`` the ``--log-json`` file,
    ``tensorboard`` the ``--tensorboard`` directory, ``loss_scaling``: write ``train/loss_scale`` there."""

    def __init__(
        self,
        total: int,
        start: int = 0,
        path: str | None = None,
        progress: bool = True,
        desc: str = "train",
        *,
        tensorboard: str | None = None,
        loss_scaling: bool = False,
    ):
        self.total, self.start, self.desc, self.loss_scaling = total, start, desc, loss_scaling
        self.t0 = self._last_line = time.perf_counter()
        self.last_loss, self.last_eval, self.tokens_per_s, self._window = None, None, [], []
        self.path = None if path is None else os.path.abspath(path)
        self.tb_dir = None if tensorboard is None else os.path.abspath(tensorboard)
        self.tb = None if tensorboard is None else tensorboard_writer_class()(self.tb_dir)
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
        self.bar, self.lines = None, False
        if progress and _isatty(sys.stderr):
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=start, desc=desc, unit="step", dynamic_ncols=True, disable=None)
        elif progress:  # piped: plain lines (module docstring)
            self.lines = True

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
        **moe: float,
    ) -> dict:
        unknown = sorted(set(moe) - set(MOE_KEYS))
        if unknown:
            raise TypeError(f"RunLog.step: unknown metrics {unknown}; the extra ones are {MOE_KEYS}")
        rec = {
            "step": int(step),
            "loss": float(loss),
            "grad_norm": float(grad_norm),
            "lr": float(lr),
            "loss_scale": float(loss_scale),
            "skipped": bool(skipped),
            "tokens_per_s": float(tokens / seconds) if seconds > 0 else None,
            "peak_mem_bytes": int(peak_mem_bytes),
            **{k: float(moe[k]) for k in MOE_KEYS if k in moe},
        }
        if self.file is not None:  # strict JSON: a non-finite loss or norm is null, never a bare NaN
            strict = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in rec.items()}
            self.file.write(json.dumps(strict, allow_nan=False) + "\n")
            self.file.flush()
        self.last_loss = rec["loss"]
        if rec["tokens_per_s"] is not None:
            self.tokens_per_s.append(rec["tokens_per_s"])
        if self.tb is not None:
            keys = TB_TRAIN + (("loss_scale",) if self.loss_scaling else ()) + tuple(k for k in MOE_KEYS if k in rec)
            for key in keys:
                if rec[key] is not None:
                    self.tb.add_scalar(f"train/{key}", rec[key], rec["step"])
        if self.bar is not None:
            tps = rec["tokens_per_s"]
            self.bar.set_postfix(loss=f"{rec['loss']:.4f}", tok_s=f"{tps:,.0f}" if tps else "-", refresh=False)
            self.bar.update(1)
        elif self.lines:
            self._line(rec)
        return rec

    def _line(self, rec: dict) -> None:
        """A piped run's progress line, when one is due (module docstring)."""
        step, now = rec["step"], time.perf_counter()
        if rec["tokens_per_s"] is not None:
            self._window.append(rec["tokens_per_s"])
        every = max(1, self.total // PROGRESS_LINES)
        due = step in (self.start + 1, self.total) or step % every == 0 or now - self._last_line >= PROGRESS_SECONDS
        if not due:
            return
        tps = f", {statistics.median(self._window):,.0f} tokens/s" if self._window else ""
        if "aux_loss" in rec:  # an MoE: the balance loss and the least / most loaded expert (1.0 = balanced)
            tps += f", aux {rec['aux_loss']:.4f}, expert load {rec['expert_load_min']:.2f}-{rec['expert_load_max']:.2f}"
        print(
            f"{self.desc}: step {step}/{self.total} ({100 * step // self.total}%), loss {rec['loss']:.4f}{tps}, "
            f"{_duration(now - self.t0)} elapsed",
            file=sys.stderr,
            flush=True,
        )
        self._last_line, self._window = now, []

    def eval(self, *, step: int, loss: float, perplexity: float, tokens: int) -> dict:
        """Log an evaluation after ``step`` (a ``twincore.eval.EvalResult``'s mean token loss, perplexity and scored
        targets): an :data:`EVAL_KEYS` record and a line beside the bar."""
        ppl = perplexity
        rec = {"step": int(step), "eval_loss": float(loss), "eval_perplexity": float(ppl), "eval_tokens": int(tokens)}
        if self.file is not None:
            strict = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in rec.items()}
            self.file.write(json.dumps(strict, allow_nan=False) + "\n")
            self.file.flush()
        if self.tb is not None:
            self.tb.add_scalar("eval/loss", rec["eval_loss"], rec["step"])
            self.tb.add_scalar("eval/perplexity", rec["eval_perplexity"], rec["step"])
        self.last_eval = rec
        self.write(f"eval after step {step}: loss {loss:.4f}, perplexity {ppl:.4f} over {tokens} tokens")
        return rec

    def write(self, message: str) -> None:
        """A line that does not break the bar."""
        if self.bar is not None:
            self.bar.write(message, file=sys.stderr)
        else:
            print(message, file=sys.stderr, flush=True)

    def breakdown(self, timer) -> dict:
        """Write ``timer``'s phase table (a ``twincore.timing.StepTimer``) and return its summary ({} if empty)."""
        summary = timer.summary()
        if summary:
            self.write(f"step-time breakdown (host view, first step left out):\n{timer.report()}")
        return summary

    def summary(self, *, checkpoint: str | None = None, final: str | None = None) -> RunSummary:
        """The run so far as a :class:`RunSummary` (``checkpoint``, ``final``: what the trainer saved)."""
        e = self.last_eval or {}
        return RunSummary(
            name=self.desc,
            start=self.start,
            steps=self.total,
            train_loss=self.last_loss,
            eval_step=e.get("step"),
            eval_loss=e.get("eval_loss"),
            eval_perplexity=e.get("eval_perplexity"),
            tokens_per_s=statistics.median(self.tokens_per_s) if self.tokens_per_s else None,
            seconds=time.perf_counter() - self.t0,
            log_json=self.path,
            tensorboard=self.tb_dir,
            checkpoint=None if checkpoint is None else os.path.abspath(checkpoint),
            final=None if final is None else os.path.abspath(final),
        )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.file is not None:
            self.file.close()
        if self.tb is not None:
            self.tb.close()
            self.tb = None


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
