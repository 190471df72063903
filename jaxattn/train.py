"""``python -m jaxattn.train``: the JAX training CLI and its :class:`Trainer` (twin of ``torchref.train``; the flags
are ``twincore.cli``'s, shared with torch).

    python -m jaxattn.train --preset tiny --data README.md --steps 200 --log-json runs/jax.jsonl
    summary = run(["--steps", "30", "--init", "ckpt"])      # in-process: {"losses": [...], "compiles": 1, ...}

``Trainer(args, config)`` builds everything from checked flags (data, model, optimizer, the jitted step of
``jaxattn.train_step``, the mesh, the checkpointer, a resumed state): any bad value fails there, before a compile.
``Trainer.fit()`` runs the loop: each step dispatches the jitted step on a batch ``prefetch_to_device`` already
moved, and only THEN fetches the previous step's metrics (one step of lag keeps the host from stalling the
device). The step compiles once per batch shape (once with ``--packing pack``, once per bucket used with
``--packing bucket``). ``--profile DIR`` traces three steps after the first; checkpoints are
``jaxattn.checkpoint`` (orbax); at the end the model is exported with ``save_pretrained`` to
``<checkpoint-dir>/final``. ``fit`` returns a dict whose ``"summary"`` (``twincore.runlog.RunSummary``) says
what the run did and wrote; the CLI prints it on stdout from process 0 (progress, lines and ``--tensorboard``:
``twincore.runlog``).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx

from twincore import optim as spec_optim
from twincore.cli import (
    CLIError,
    TrainingError,
    check_tokenizer_fits,
    checkpointer_options,
    cli_main,
    parse_args,
    print_line,
)
from twincore.data import Dataset, copy_tokenizer, load_tokenizer, read_documents
from twincore.eval import EvalResult, eval_batches
from twincore.runlog import MOE_KEYS, DivergenceGuard, RunLog

from . import hf, optim, remat
from .attention import BACKENDS, FORWARD_ONLY, attention_backend, available_backends
from .checkpoint import Checkpointer
from .data import prefetch_to_device
from .eval import make_eval_step, run_eval
from .model import Llama
from .precision import get_policy, set_matmul_precision
from .profiling import StepTimer, peak_memory_bytes, start_trace, stop_trace
from .seed import host_rng_state, seed_all, set_host_rng_state
from .sharding import initialize_distributed, make_mesh, parse_mesh, shard_train_state
from .train_step import (  # noqa: F401
    BATCH_KEYS,
    CHECK_IDS,
    TrainState,
    check_accum_batch,
    check_grad_accum,
    clip_by_global_norm,
    cross_entropy,
    global_norm,
    loss_denominator,
    loss_fn,
    loss_weights,
    make_train_step,
)

__all__ = ["Trainer", "main", "run", "TrainState", "make_train_step", "loss_fn"]

PROG = "python -m jaxattn.train"
PROFILE_STEPS = 3
TRAIN_BACKENDS = tuple(b for b in BACKENDS if b not in FORWARD_ONLY)  # --attention choices


class Trainer:
    """A training run built from checked flags; :meth:`fit` trains it. :meth:`from_argv` parses the flags first."""

    def __init__(self, args, config):
        self.args, self.config = args, config
        # the checkpoint directory first: its lock (held until fit() ends), then another run's, or a changed run on
        # --resume, fails before anything is built
        self.ckpt, self.last_saved = None, None
        if args.checkpoint_dir:
            writer = jax.process_index() == 0
            self.ckpt = Checkpointer(args.checkpoint_dir, **checkpointer_options(args, config), writer=writer)
        try:
            self._build(args, config)
        except BaseException:
            self.close()  # the directory's lock goes with a trainer that could not be built
            raise

    def _build(self, args, config) -> None:
        set_matmul_precision(args.matmul_precision)
        self.keys = seed_all(args.seed, deterministic=args.deterministic)
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
        self.backends = None if args.attention is None else tuple(n.strip() for n in args.attention.split(","))
        self.policy = get_policy(args.precision)
        if self.backends:
            self._check_attention(args, config)
        model = hf.from_pretrained(args.init) if args.init else Llama(config, rngs=nnx.Rngs(params=self.keys["params"]))
        try:
            remat.apply(model, args.remat)
        except ValueError as e:
            raise CLIError(f"--remat {args.remat!r}: {e}") from None
        self.tx = optim.build(
            args.optimizer, args.lr, args.weight_decay, schedule=args.schedule, warmup=args.warmup, steps=args.steps
        )
        self.graphdef, self.state = TrainState.create(model, self.tx, policy=self.policy)
        self.mesh = self._mesh(args)
        if jax.process_count() > 1:
            self._check_processes_agree(args)
        sharding = None
        if self.mesh is not None:  # params + optimizer state sharded (ZeRO-3 / tensor parallel), batch over data axes
            try:
                self.tx, self.state, sharding = shard_train_state(
                    self.graphdef,
                    self.tx,
                    self.state,
                    self.mesh,
                    batch_size=args.batch_size,
                    grad_accum=args.grad_accum,
                    offload_optimizer=args.offload_optimizer,
                    microbatches=args.microbatches,
                    virtual=args.pp_virtual,
                    gather_once=args.pp_gather_once,
                )
            except ValueError as e:
                flag = "--offload-optimizer" if "offload_optimizer" in str(e) else f"--mesh {args.mesh!r}"
                if str(e).startswith("microbatches") or "micro-batch" in str(e):
                    flag = f"--microbatches {args.microbatches}"
                elif "virtual stages" in str(e):
                    flag = f"--mesh {args.mesh!r} --pp-virtual {args.pp_virtual}"
                raise CLIError(f"{flag}: {e}") from None
        self.step_fn = make_train_step(
            self.graphdef,
            self.tx,
            policy=self.policy,
            max_grad_norm=args.clip_grad or None,
            grad_accum=args.grad_accum,
            sharding=sharding,
            loss=args.loss,
            loss_chunk=args.loss_chunk,
        )
        self.sharding = sharding
        self.eval_step = (
            None if self.eval_batches is None else make_eval_step(self.graphdef, policy=self.policy, sharding=sharding)
        )
        self.rng = jax.random.key_data(self.keys["data"])
        self.start, self.applied = 0, 0
        # committed to the device like the step's outputs (an uncommitted input would give a second compile), and
        # BEFORE a resume, so orbax restores onto these shardings (multi-process: a restored array committed to
        # one local device cannot move onto a global sharding without cross-host transfers)
        if sharding is None:
            self.device = placement = jax.devices()[0]
        else:  # the state as the step's in_shardings say, the rng replicated
            self.device = sharding.batch
            placement = (sharding.state, jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec()))
        self.state, self.rng = jax.device_put((self.state, self.rng), placement)
        if args.resume:
            self._resume()

    def close(self) -> None:
        """Let the checkpoint directory go (its lock), for a trainer whose :meth:`fit` will not run; fit does it."""
        if self.ckpt is not None:
            self.ckpt.close()

    @classmethod
    def from_argv(cls, argv: Sequence[str] | None = None) -> Trainer:
        """Parse, check and build; raises :class:`CLIError` (or ValueError for bad data) before any compile."""
        args, config = parse_args(argv, "jax", TRAIN_BACKENDS)
        if args.coordinator is not None and args.num_processes > 1:
            _join(args)
        return cls(args, config)

    def _check_attention(self, args, config) -> None:
        """``--attention`` can serve this model's attention call here (a backend that cannot, e.g. ``cudnn`` on a
        CPU, fails now with each backend's reason, not at the first step)."""
        d, b, s = config.resolved_head_dim, args.batch_size // args.grad_accum, args.seq_len
        dtype = self.policy.compute_dtype
        q = jax.ShapeDtypeStruct((b, s, config.n_heads, d), dtype)
        kv = jax.ShapeDtypeStruct((b, s, config.n_kv_heads, d), dtype)
        seg = jax.ShapeDtypeStruct((b, s), jax.numpy.int32)
        reasons = available_backends(q, kv, kv, causal=True, segment_ids=seg, backends=self.backends)
        if all(r is not None for r in reasons.values()):
            raise CLIError(
                f"--attention {args.attention!r} cannot serve this model's attention call here: "
                + "; ".join(f"{n}: {r}" for n, r in reasons.items())
            )

    @staticmethod
    def _mesh(args):
        """The ``--mesh`` over all devices (None without the flag or with a 1-device mesh on one device)."""
        if args.mesh is None:
            return None
        try:
            sizes = parse_mesh(args.mesh)
            if jax.device_count() == 1 and all(n == 1 for n in sizes.values()) and not args.offload_optimizer:
                return None
            return make_mesh(args.mesh)
        except ValueError as e:
            raise CLIError(f"--{e}") from None  # "--mesh '...': ..."

    @staticmethod
    def _check_processes_agree(args) -> None:
        """Every process must run the same flags (the mesh first): a CLIError before any compile otherwise."""
        from jax.experimental import multihost_utils

        local = ("process_id", "log_json", "no_progress", "tensorboard")  # process 0's outputs
        flags = {k: v for k, v in sorted(vars(args).items()) if k not in local}
        for what, value in (("--mesh", args.mesh), ("the flags", json.dumps(flags, default=str))):
            digest = np.frombuffer(hashlib.sha256(str(value).encode()).digest()[:8], np.int64)
            seen = multihost_utils.process_allgather(digest)
            if not np.all(seen == seen[0]):
                raise CLIError(
                    f"the {np.asarray(seen).size} processes disagree on {what} (this is process "
                    f"{args.process_id}, {what} = {value if what == '--mesh' else 'see its command line'}); "
                    f"start every process with the same flags but --process-id"
                )

    def meta(self, step: int) -> dict:
        return {
            "framework": "jax",
            "step": step,
            "data_position": step,
            "applied_updates": self.applied,
            "host_rng": host_rng_state(),
            "model_config": self.config.to_hf(),
            "flags": {k: v for k, v in vars(self.args).items()},
        }

    def _resume(self) -> None:
        step = self.ckpt.latest_step()
        for problem in self.ckpt.problems:
            print_line(f"{PROG}: warning: --resume skips a checkpoint: {problem}")
        if step is None:
            raise CLIError(
                f"--resume: no valid checkpoint in --checkpoint-dir {self.args.checkpoint_dir!r}"
                + (f" ({'; '.join(self.ckpt.problems)})" if self.ckpt.problems else "")
            )
        tree, meta = self.ckpt.restore(step, {"train": self.state, "rng": self.rng})
        if meta.get("model_config") != self.config.to_hf():
            raise CLIError(
                f"--resume: the checkpoint at step {step} in {self.args.checkpoint_dir!r} is of another "
                f"model config ({meta.get('model_config')}) than the flags ask for ({self.config.to_hf()})"
            )
        if step > self.args.steps:
            raise CLIError(f"--resume: the latest checkpoint is at step {step}, past --steps {self.args.steps}")
        self.state, self.rng = tree["train"], tree["rng"]
        self.start, self.applied = int(meta["data_position"]), int(meta["applied_updates"])
        self.last_saved = self.start
        set_host_rng_state(meta["host_rng"])

    def lr(self, applied: int) -> float:
        a = self.args
        return a.lr * float(spec_optim.lr_factor(applied, schedule=a.schedule, warmup=a.warmup, steps=a.steps))

    def save(self, step: int) -> None:
        if not _finite(self.state.params):
            raise TrainingError(
                f"the weights are not finite after step {step}: no checkpoint of them is written "
                f"(lower --lr, keep --clip-grad on, or check the --init weights)"
            )
        try:
            self.ckpt.save(step, {"train": self.state, "rng": self.rng}, self.meta(step))
            self.last_saved = step
        except OSError as e:
            raise TrainingError(
                f"cannot write the checkpoint of step {step} in --checkpoint-dir "
                f"{self.args.checkpoint_dir!r}: {e.strerror or e}"
            ) from e

    def evaluate(self) -> EvalResult:
        """Mean token loss and perplexity of the current weights on ``--eval-data`` (every process takes part)."""
        if jax.process_count() > 1:  # the same host batches on every process -> global arrays
            place = self.sharding.place
        else:

            def place(host):
                return jax.device_put(host, self.device)

        return run_eval(self.eval_step, self.state.params, self.state.rest, self.eval_batches, place)

    def eval_due(self, step: int) -> bool:
        """``--eval-data`` is evaluated after the last step and every ``--eval-every`` steps."""
        every = self.args.eval_every
        return self.eval_batches is not None and (step == self.args.steps or (every > 0 and step % every == 0))

    @property
    def lead(self) -> bool:
        """This process logs, writes the export and prints the summary (process 0 of a multi-process run)."""
        return jax.process_index() == 0

    def fit(self) -> dict[str, Any]:
        """Train from ``start`` to ``--steps``; returns ``{"losses", "compiles", "start", "steps", "phases",
        "evals", "summary", "final"?}`` (``evals``: the ``--eval-data`` records, ``twincore.runlog.EVAL_KEYS``;
        ``summary``: a ``twincore.runlog.RunSummary``, the same shape as torchref's)."""
        args = self.args
        mem_device = self.device if self.mesh is None else jax.local_devices()[0]
        lead = self.lead  # a multi-process run logs and exports from process 0
        log = RunLog(
            args.steps,
            self.start,
            args.log_json if lead else None,
            progress=lead and not args.no_progress,
            desc="jax train",
            tensorboard=args.tensorboard if lead else None,
            loss_scaling=self.policy.uses_loss_scaling,
        )
        losses: list[float] = []
        evals: list[dict] = []
        profiling = False
        prof_start = min(self.start + 1, args.steps - 1) if args.profile else -1
        ctx = attention_backend(*self.backends) if self.backends else contextlib.nullcontext()
        pending = None
        t_last = time.perf_counter()
        timer = StepTimer(skip_first=1)  # phases timed on the host without extra syncs: the pipeline keeps its lag
        guard = DivergenceGuard(args.max_nonfinite_steps)

        def report(p) -> None:
            nonlocal t_last
            step, metrics, tokens = p
            m = jax.device_get(metrics)
            now = time.perf_counter()
            skipped = bool(m["skipped"])
            rec = log.step(
                step=step,
                loss=m["loss"],
                grad_norm=m["grad_norm"],
                lr=self.lr(self.applied),
                loss_scale=m["loss_scale"],
                skipped=skipped,
                tokens=tokens,
                seconds=now - t_last,
                peak_mem_bytes=peak_memory_bytes(mem_device),
                **{k: m[k] for k in MOE_KEYS if k in m},  # an MoE's router metrics
            )
            t_last = now
            self.applied += 0 if skipped else 1
            losses.append(rec["loss"])
            guard.check(rec)

        lock = self.ckpt.locked() if self.ckpt else contextlib.nullcontext()
        batches = None
        try:
            with lock, ctx:
                batches = prefetch_to_device(
                    self.data,
                    self.start,
                    args.steps,
                    device=self.device,
                    with_tokens=True,
                    place=(lambda b: b) if jax.process_count() > 1 else None,
                )
                for i in range(self.start, args.steps):
                    with timer.phase("data"):  # waiting for the prefetch thread
                        batch, tokens = next(batches)
                    if i == prof_start:
                        start_trace(args.profile)
                        profiling = True
                    with timer.phase("dispatch"):  # async: returns before the device finishes
                        self.state, metrics = self.step_fn(self.state, batch)
                    if pending is not None:
                        with timer.phase("metrics"):  # fetching the PREVIOUS step's metrics: the device wait
                            report(pending)
                    pending = (i + 1, metrics, tokens)
                    if profiling and i + 1 >= prof_start + PROFILE_STEPS:
                        stop_trace(self.state)
                        profiling = False
                    if self.ckpt and args.checkpoint_every and (i + 1) % args.checkpoint_every == 0:
                        report(pending)
                        pending = None
                        self.save(i + 1)
                    if self.eval_due(i + 1):  # after the step's record; its time is not the next step's
                        if pending is not None:
                            report(pending)
                            pending = None
                        r = self.evaluate()
                        if lead:
                            evals.append(log.eval(step=i + 1, loss=r.loss, perplexity=r.perplexity, tokens=r.tokens))
                        t_last = time.perf_counter()
                if pending is not None:
                    report(pending)
                if self.ckpt:
                    out_final = self._finish(lead)
            if profiling:
                stop_trace(self.state)
            jitted = self.step_fn.jitted
            compiles = jitted._cache_size() if hasattr(jitted, "_cache_size") else None
            log.write(
                f"jax train: {args.steps - self.start} steps, train step compiled {compiles} time(s)"
                f" (packing={args.packing}, buckets={list(self.data.buckets)})"
            )
            out = {
                "losses": losses,
                "compiles": compiles,
                "start": self.start,
                "steps": args.steps,
                "phases": log.breakdown(timer),
                "evals": evals,
            }
            if self.ckpt:
                out["final"] = out_final
            last = None if self.last_saved is None else self.ckpt.path(self.last_saved)
            out["summary"] = log.summary(checkpoint=last, final=out.get("final"))
            return out
        finally:
            if batches is not None:
                batches.close()  # stops the prefetch thread
            log.close()

    def _finish(self, lead: bool) -> str:
        """The last checkpoint (if the loop did not just write it) and the Hugging Face export in ``final/``."""
        if self.last_saved != self.args.steps:
            self.save(self.args.steps)  # refuses non-finite weights: no export of them either
        final = os.path.join(self.args.checkpoint_dir, "final")
        model = self.state.model(self.graphdef)
        if jax.process_count() > 1:  # every process takes part in the gather; process 0 writes
            from jax.experimental import multihost_utils

            gdef, weights = nnx.split(model)
            model = nnx.merge(gdef, multihost_utils.process_allgather(weights, tiled=True))
        if lead:
            hf.save_pretrained(model, final)
            copy_tokenizer(self.args.init, final)
        self.ckpt.close()
        return final


@jax.jit
def _all_finite(tree) -> jax.Array:
    return jax.numpy.all(jax.numpy.asarray([jax.numpy.isfinite(x).all() for x in jax.tree.leaves(tree)]))


def _finite(tree) -> bool:
    """Every parameter is finite (one reduction on the device)."""
    return bool(_all_finite(tree))


def _join(args) -> None:
    """``jax.distributed.initialize`` from the (checked) flags, once per process."""
    joined = getattr(jax.distributed, "is_initialized", None)  # jax.process_count() would start the backend
    if joined is not None and joined():
        return  # already joined (e.g. a second in-process run)
    initialize_distributed(args.coordinator, args.num_processes, args.process_id, args.distributed_timeout)


def run(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Train as the CLI would (without printing the summary); returns :meth:`Trainer.fit`'s dict."""
    return Trainer.from_argv(argv).fit()


def _fit_and_report(trainer: Trainer) -> dict[str, Any]:
    """The CLI's training: :meth:`Trainer.fit`, then its summary on stdout (process 0)."""
    out = trainer.fit()
    if trainer.lead:
        print(out["summary"], flush=True)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    return cli_main(PROG, Trainer.from_argv, _fit_and_report, argv)


if __name__ == "__main__":
    raise SystemExit(main())
