"""One training run for both twins: the framework-neutral half of ``python -m jaxattn.train`` and
``python -m torchref.train``, written once (torchtitan's ``Trainer`` shape: the loop is shared, each framework
supplies its parts).

    class Trainer(twincore.trainer.Trainer):       # jaxattn/train.py, torchref/train.py
        FRAMEWORK, PROG, BACKENDS = "jax", "python -m jaxattn.train", TRAIN_BACKENDS
        def build(self, args, config): ...         # model, optimizer, step, a resumed state
        def dispatch(self, batch): ...             # one step; metrics read later by read_metrics
    summary = Trainer.from_argv(["--steps", "30"]).fit()["summary"]

What lives here: the checkpoint directory (its lock first, so a directory in use or a changed run fails before
anything is built), the tokenizer / dataset / ``--eval-data`` batches, the ``--attention`` names, the resume checks
(no valid step, another model config, a step past ``--steps``), the checkpoint metadata and the save's error
handling, the step loop (data → dispatch → metrics, read ``METRICS_LAG`` steps late so the host does not stall the
device), its log / divergence guard / checkpoint and eval cadence, the Hugging Face export into
``<checkpoint-dir>/final``, the summary. What a twin supplies (its hooks, below): seeding and devices, the model
and step, the batches, reading a step's metrics, the checkpoint state and its writing, evaluation, the export's
model, the profiler.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator, Sequence
from typing import Any, ClassVar

from .cli import CLIError, TrainingError, check_tokenizer_fits, checkpointer_options, cli_main, parse_args, print_line
from .data import Dataset, copy_tokenizer, load_tokenizer, read_documents
from .eval import EvalResult, eval_batches
from .runlog import MOE_KEYS, DivergenceGuard, RunLog

__all__ = ["Trainer", "PROFILE_STEPS"]

PROFILE_STEPS = 3  # --profile traces this many steps, after the first (its compile)


class Trainer:
    """A training run built from checked flags; :meth:`fit` trains it, :meth:`from_argv` parses the flags first.

    A twin sets the class attributes and implements the hooks that raise ``NotImplementedError`` here."""

    FRAMEWORK: ClassVar[str]  # "jax" | "torch": the flag table's framework, the log's name
    PROG: ClassVar[str]  # "python -m jaxattn.train"
    BACKENDS: ClassVar[tuple[str, ...]]  # the --attention choices
    METRICS_LAG: ClassVar[int] = 0  # a step's metrics are read this many steps after its dispatch
    Checkpointer: ClassVar[type]  # the twin's checkpointer class (a twincore.rundir run directory)
    hf: ClassVar[Any]  # the twin's Hugging Face module (save_pretrained)
    attention_backend: ClassVar[Any]  # the twin's attention_backend(choice) context manager

    def __init__(self, args, config):
        self.args, self.config = args, config
        self.last_saved: int | None = None  # the newest checkpoint's step
        self.start, self.applied = 0, 0  # the first step to run; the optimizer updates applied so far
        # the checkpoint directory first: its lock (held until fit() ends), then another run's, or a changed run on
        # --resume, fails before anything is built
        self.ckpt = None
        if args.checkpoint_dir:
            options = checkpointer_options(args, config)
            self.ckpt = type(self).Checkpointer(args.checkpoint_dir, **options, writer=self.writer())
        try:
            self.setup(args)
            self._load_data(args, config)
            self.build(args, config)
        except BaseException:
            self.close()  # the directory's lock goes with a trainer that could not be built
            raise

    def _load_data(self, args, config) -> None:
        self.tokenizer = load_tokenizer(args.init)
        check_tokenizer_fits(args, config, self.tokenizer)
        self.data = Dataset.from_source(
            args.data,
            seq_len=args.seq_len,
            batch_size=args.batch_size,
            seed=args.seed,
            packing=args.packing,
            vocab_size=config.vocab_size,
            tokenizer=self.tokenizer,
        )
        self.eval_batches = None  # --eval-data: one pass in file order (twincore.eval), the train batch's shape
        if args.eval_data is not None:
            self.eval_batches = eval_batches(
                read_documents(args.eval_data, self.tokenizer, "--eval-data"),
                seq_len=args.seq_len,
                batch_size=args.batch_size,
                vocab_size=config.vocab_size,
                name=f"--eval-data {args.eval_data!r}",
            )
        self.attention = args.attention  # None or the AttentionChoice twincore.cli parsed (the one parse)

    # ---- the twin's hooks: building
    def writer(self) -> bool:
        """This process writes the run directory's marker and checkpoint files (process / rank 0)."""
        raise NotImplementedError

    def setup(self, args) -> None:
        """Before the data: matmul precision, seeds, the device."""
        raise NotImplementedError

    def build(self, args, config) -> None:
        """The model, optimizer, step function (``self.policy``, a precision policy, included); ``--resume``
        restores here (:meth:`resume_step`, then :meth:`check_resume`)."""
        raise NotImplementedError

    @classmethod
    def prepare_process(cls, args) -> None:
        """After parsing, before building: join a multi-process run (JAX), nothing by default."""

    @property
    def lead(self) -> bool:
        """This process logs, writes the export and prints the summary (process / rank 0)."""
        raise NotImplementedError

    # ---- the twin's hooks: the loop
    def batches(self) -> Iterator[tuple[Any, int]]:
        """``(batch, target tokens)`` for steps ``start..steps-1``, on the device (closed by :meth:`fit`)."""
        raise NotImplementedError

    def dispatch(self, batch) -> Any:
        """Run one training step on ``batch``; returns what :meth:`read_metrics` turns into numbers."""
        raise NotImplementedError

    def read_metrics(self, handle) -> dict[str, float]:
        """A dispatched step's ``loss``, ``grad_norm``, ``lr``, ``loss_scale``, ``skipped`` (and an MoE's router
        metrics) as host numbers; this waits for the device."""
        raise NotImplementedError

    def peak_memory(self) -> int | None:
        raise NotImplementedError

    def step_timer(self):
        """A ``twincore.timing.StepTimer`` (skipping the first step) whose phases end with the device's sync."""
        raise NotImplementedError

    def profiling(self):
        """A context manager around the loop (``--profile``); :meth:`before_step` / :meth:`after_step` mark steps."""
        return contextlib.nullcontext()

    def before_step(self, i: int) -> None:
        """Just before step ``i`` (0-based) is dispatched."""

    def after_step(self, i: int) -> None:
        """After step ``i``'s dispatch (and the metrics read then)."""

    def attention_context(self):
        """The ``--attention`` choice in force around the loop: the twin's ``attention_backend`` (a context, like
        ``sdpa_kernel``) entered here, the one place a run sets it."""
        if self.attention is None:
            return contextlib.nullcontext()
        return type(self).attention_backend(self.attention)

    def evaluate(self) -> EvalResult:
        """Mean token loss and perplexity of the current weights on ``--eval-data`` (every process takes part)."""
        raise NotImplementedError

    def summary_line(self) -> str:
        raise NotImplementedError

    def compiles(self) -> int | None:
        """How many times the train step compiled (None where the framework does not say)."""
        return None

    # ---- the twin's hooks: checkpoints
    def checkpoint_state(self) -> Any:
        """What a checkpoint holds (every process takes part in gathering it)."""
        raise NotImplementedError

    def is_finite(self, state) -> bool:
        """Every weight in ``state`` is finite, agreed by every process."""
        raise NotImplementedError

    def write_checkpoint(self, step: int, state, meta: dict) -> None:
        raise NotImplementedError

    def extra_meta(self) -> dict:
        """The twin's own checkpoint metadata."""
        return {}

    def export_model(self):
        """The whole model to export (every process takes part in gathering it; the lead's is written)."""
        raise NotImplementedError

    def barrier(self) -> None:
        """Wait until the lead process has written (a checkpoint, the export)."""

    def end_processes(self) -> None:
        """After a clean finish only (a failed process's peers may be waiting in a collective): let go of what the
        trainer started across processes."""

    # ---- shared
    def close(self) -> None:
        """Let the checkpoint directory go (its lock), for a trainer whose :meth:`fit` will not run; fit does it."""
        if self.ckpt is not None:
            self.ckpt.close()

    @classmethod
    def from_argv(cls, argv: Sequence[str] | None = None) -> Trainer:
        """Parse, check and build; raises :class:`CLIError` (or ValueError for bad data) before any compile."""
        args, config = parse_args(argv, cls.FRAMEWORK, cls.BACKENDS)
        cls.prepare_process(args)
        return cls(args, config)

    @classmethod
    def run(cls, argv: Sequence[str] | None = None) -> dict[str, Any]:
        """Train as the CLI would (without printing the summary); returns :meth:`fit`'s dict."""
        return cls.from_argv(argv).fit()

    @classmethod
    def cli(cls, argv: Sequence[str] | None = None) -> int:
        """The CLI: parse, build, fit, print the summary (the lead process); an exit status."""
        return cli_main(cls.PROG, cls.from_argv, _fit_and_report, argv)

    def resume_step(self) -> int:
        """The newest valid checkpoint's step for ``--resume`` (the skipped ones warned about), else a CLIError."""
        step = self.ckpt.latest_step()
        for problem in self.ckpt.problems:
            print_line(f"{self.PROG}: warning: --resume skips a checkpoint: {problem}")
        if step is None:
            raise CLIError(
                f"--resume: no valid checkpoint in --checkpoint-dir {self.args.checkpoint_dir!r}"
                + (f" ({'; '.join(self.ckpt.problems)})" if self.ckpt.problems else "")
            )
        return step

    def check_resume(self, step: int, meta: dict) -> None:
        """The checkpoint of ``step`` (its ``meta``) is this model's and not past ``--steps``; the loop starts at
        its data position."""
        if meta.get("model_config") != self.config.to_hf():
            raise CLIError(
                f"--resume: the checkpoint at step {step} in {self.args.checkpoint_dir!r} is of another "
                f"model config ({meta.get('model_config')}) than the flags ask for ({self.config.to_hf()})"
            )
        if step > self.args.steps:
            raise CLIError(f"--resume: the latest checkpoint is at step {step}, past --steps {self.args.steps}")
        self.start = self.last_saved = int(meta["data_position"])

    def meta(self, step: int) -> dict:
        """A checkpoint's JSON metadata."""
        return {
            "framework": self.FRAMEWORK,
            "step": step,
            "data_position": step,
            "model_config": self.config.to_hf(),
            "flags": json.loads(json.dumps(vars(self.args))),  # plain JSON (--attention's choice: its text)
            **self.extra_meta(),
        }

    def save(self, step: int) -> None:
        """The checkpoint of ``step`` (non-finite weights are refused: a TrainingError, nothing written)."""
        state = self.checkpoint_state()
        if not self.is_finite(state):
            raise TrainingError(
                f"the weights are not finite after step {step}: no checkpoint of them is written "
                f"(lower --lr, keep --clip-grad on, or check the --init weights)"
            )
        try:
            self.write_checkpoint(step, state, self.meta(step))
        except OSError as e:
            raise TrainingError(
                f"cannot write the checkpoint of step {step} in --checkpoint-dir "
                f"{self.args.checkpoint_dir!r}: {e.strerror or e}"
            ) from e
        self.last_saved = step
        self.barrier()

    def eval_due(self, step: int) -> bool:
        """``--eval-data`` is evaluated after the last step and every ``--eval-every`` steps."""
        every = self.args.eval_every
        return self.eval_batches is not None and (step == self.args.steps or (every > 0 and step % every == 0))

    def fit(self) -> dict[str, Any]:
        """Train from ``start`` to ``--steps``; returns ``{"losses", "compiles", "start", "steps", "phases",
        "evals", "summary", "final"?}`` (``evals``: the ``--eval-data`` records, ``twincore.runlog.EVAL_KEYS``;
        ``summary``: a ``twincore.runlog.RunSummary``)."""
        args, lead = self.args, self.lead
        log = RunLog(
            args.steps,
            self.start,
            args.log_json if lead else None,
            progress=lead and not args.no_progress,
            desc=f"{self.FRAMEWORK} train",
            tensorboard=args.tensorboard if lead else None,
            loss_scaling=self.policy.uses_loss_scaling,
        )
        losses: list[float] = []
        evals: list[dict] = []
        pending: list[tuple[int, Any, int]] = []  # (step, handle, tokens): dispatched, metrics not read yet
        timer = self.step_timer()  # phases timed on the host without extra syncs: the lag is kept
        guard = DivergenceGuard(args.max_nonfinite_steps)
        t_last = time.perf_counter()

        def report() -> None:
            nonlocal t_last
            step, handle, tokens = pending.pop(0)
            m = self.read_metrics(handle)
            now = time.perf_counter()
            rec = log.step(
                step=step,
                loss=m["loss"],
                grad_norm=m["grad_norm"],
                lr=m["lr"],
                loss_scale=m["loss_scale"],
                skipped=m["skipped"],
                tokens=tokens,
                seconds=now - t_last,
                peak_mem_bytes=self.peak_memory(),
                **{k: m[k] for k in MOE_KEYS if k in m},  # an MoE's router metrics
            )
            t_last = now
            self.applied += 0 if m["skipped"] else 1
            losses.append(rec["loss"])
            guard.check(rec)

        def flush() -> None:
            while pending:
                report()

        lock = self.ckpt.locked() if self.ckpt else contextlib.nullcontext()
        final, batches = None, None
        try:
            with lock, self.attention_context(), self.profiling():
                batches = self.batches()
                for i in range(self.start, args.steps):
                    with timer.phase("data"):  # waiting for the loader / prefetch, the host-to-device copy
                        batch, tokens = next(batches)
                    self.before_step(i)
                    with timer.phase("dispatch"):  # async where the framework is: returns before the device ends
                        pending.append((i + 1, self.dispatch(batch), tokens))
                    if len(pending) > self.METRICS_LAG:
                        with timer.phase("metrics"):  # reading a step's metrics back: the device wait
                            report()
                    self.after_step(i)
                    if self.ckpt and args.checkpoint_every and (i + 1) % args.checkpoint_every == 0:
                        flush()
                        self.save(i + 1)
                        t_last = time.perf_counter()  # the save's time is not the next step's
                    if self.eval_due(i + 1):  # after the step's record; its time is not the next step's
                        flush()
                        r = self.evaluate()
                        if lead:
                            evals.append(log.eval(step=i + 1, loss=r.loss, perplexity=r.perplexity, tokens=r.tokens))
                        t_last = time.perf_counter()
                flush()
                if self.ckpt:
                    final = self._finish()
            log.write(self.summary_line())
            out = {
                "losses": losses,
                "compiles": self.compiles(),
                "start": self.start,
                "steps": args.steps,
                "phases": log.breakdown(timer),
                "evals": evals,
            }
            if final is not None:
                out["final"] = final
            last = None if self.last_saved is None else self.ckpt.path(self.last_saved)
            out["summary"] = log.summary(checkpoint=last, final=final)
            self.end_processes()
            return out
        finally:
            if batches is not None and hasattr(batches, "close"):
                batches.close()  # stops a prefetch thread
            log.close()

    def _finish(self) -> str:
        """The last checkpoint (if the loop did not just write it) and the Hugging Face export in ``final/``."""
        if self.last_saved != self.args.steps:
            self.save(self.args.steps)  # refuses non-finite weights: no export of them either
        final = os.path.join(self.args.checkpoint_dir, "final")
        model = self.export_model()
        if self.lead:
            self.hf.save_pretrained(model, final)
            copy_tokenizer(self.args.init, final)
        self.barrier()
        self.ckpt.close()
        return final


def _fit_and_report(trainer: Trainer) -> dict[str, Any]:
    """The CLI's training: :meth:`Trainer.fit`, then its summary on stdout (the lead process)."""
    out = trainer.fit()
    if trainer.lead:
        print(out["summary"], flush=True)
    return out
