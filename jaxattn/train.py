"""``python -m jaxattn.train``: the JAX training CLI and its :class:`Trainer` (twin of ``torchref.train``; the flags
are ``twincore.cli``'s, shared with torch).

    python -m jaxattn.train --preset tiny --data README.md --steps 200 --log-json runs/jax.jsonl
    summary = run(["--steps", "30", "--init", "ckpt"])      # in-process: {"losses": [...], "compiles": 1, ...}

``Trainer`` is ``twincore.trainer.Trainer`` (the loop, data, resume checks, checkpoint cadence, export and summary,
shared with torch) with JAX's parts: ``Trainer(args, config)`` builds the model, optimizer, the jitted step of
``jaxattn.train_step``, the mesh, the checkpointer and a resumed state from checked flags (any bad value fails
there, before a compile). In ``fit()`` each step dispatches the jitted step on a batch ``prefetch_to_device``
already moved, and only THEN fetches the previous step's metrics (``METRICS_LAG = 1`` keeps the host from
stalling the device). The step compiles once per batch shape (once with ``--packing pack``, once per bucket used
with ``--packing bucket``). ``--profile DIR`` traces three steps after the first; checkpoints are
``jaxattn.checkpoint`` (orbax); the export is ``save_pretrained`` into ``<checkpoint-dir>/final``; the CLI prints
the summary (``twincore.runlog.RunSummary``) on stdout from process 0.
"""

from __future__ import annotations

import contextlib
import hashlib
import json

import jax
import numpy as np
from flax import nnx

from twincore import optim as spec_optim
from twincore.cli import CLIError
from twincore.eval import EvalResult
from twincore.trainer import PROFILE_STEPS
from twincore.trainer import Trainer as BaseTrainer

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
TRAIN_BACKENDS = tuple(b for b in BACKENDS if b not in FORWARD_ONLY)  # --attention choices


class Trainer(BaseTrainer):
    """The JAX run: ``twincore.trainer.Trainer``'s loop with a jitted step, metrics read one step late."""

    FRAMEWORK, PROG, BACKENDS = "jax", PROG, TRAIN_BACKENDS
    METRICS_LAG = 1  # fetching step i's metrics after step i+1 is dispatched keeps the device busy
    Checkpointer, hf, attention_backend = Checkpointer, hf, attention_backend

    def writer(self) -> bool:
        return jax.process_index() == 0

    @property
    def lead(self) -> bool:
        return jax.process_index() == 0

    def setup(self, args) -> None:
        set_matmul_precision(args.matmul_precision)
        self.keys = seed_all(args.seed, deterministic=args.deterministic)
        self.policy = get_policy(args.precision)

    def build(self, args, config) -> None:
        if self.attention:
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
        # committed to the device like the step's outputs (an uncommitted input would give a second compile), and
        # BEFORE a resume, so orbax restores onto these shardings (multi-process: a restored array committed to
        # one local device cannot move onto a global sharding without cross-host transfers)
        if sharding is None:
            self.device = placement = jax.devices()[0]
        else:  # the state as the step's in_shardings say, the rng replicated
            self.device = sharding.batch
            placement = (sharding.state, jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec()))
        self.state, self.rng = jax.device_put((self.state, self.rng), placement)
        self.mem_device = self.device if self.mesh is None else jax.local_devices()[0]
        if args.resume:
            self._resume()

    @classmethod
    def prepare_process(cls, args) -> None:
        if args.coordinator is not None and args.num_processes > 1:
            _join(args)

    def _check_attention(self, args, config) -> None:
        """``--attention`` can serve this model's attention call here (a backend that cannot, e.g. ``cudnn`` on a
        CPU, fails now with each backend's reason, not at the first step)."""
        d, b, s = config.resolved_head_dim, args.batch_size // args.grad_accum, args.seq_len
        dtype = self.policy.compute_dtype
        q = jax.ShapeDtypeStruct((b, s, config.n_heads, d), dtype)
        kv = jax.ShapeDtypeStruct((b, s, config.n_kv_heads, d), dtype)
        seg = jax.ShapeDtypeStruct((b, s), jax.numpy.int32)
        reasons = available_backends(
            q, kv, kv, causal=True, segment_ids=seg, window=config.attention_window, backends=self.attention
        )
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

    def extra_meta(self) -> dict:
        return {"applied_updates": self.applied, "host_rng": host_rng_state()}

    def _resume(self) -> None:
        step = self.resume_step()
        tree, meta = self.ckpt.restore(step, {"train": self.state, "rng": self.rng})
        self.check_resume(step, meta)
        self.state, self.rng = tree["train"], tree["rng"]
        self.applied = int(meta["applied_updates"])
        set_host_rng_state(meta["host_rng"])

    def lr(self, applied: int) -> float:
        a = self.args
        return a.lr * float(spec_optim.lr_factor(applied, schedule=a.schedule, warmup=a.warmup, steps=a.steps))

    def checkpoint_state(self) -> dict:
        return {"train": self.state, "rng": self.rng}

    def is_finite(self, state) -> bool:
        return _finite(state["train"].params)  # global arrays: every process computes the same

    def write_checkpoint(self, step: int, state, meta: dict) -> None:
        self.ckpt.save(step, state, meta)  # every process takes part; process 0 writes the marker

    def evaluate(self) -> EvalResult:
        if jax.process_count() > 1:  # the same host batches on every process -> global arrays
            place = self.sharding.place
        else:

            def place(host):
                return jax.device_put(host, self.device)

        return run_eval(self.eval_step, self.state.params, self.state.rest, self.eval_batches, place)

    def batches(self):
        return prefetch_to_device(
            self.data,
            self.start,
            self.args.steps,
            device=self.device,
            with_tokens=True,
            place=(lambda b: b) if jax.process_count() > 1 else None,
        )

    def dispatch(self, batch):
        self.state, metrics = self.step_fn(self.state, batch)  # async: returns before the device finishes
        return metrics

    def read_metrics(self, metrics) -> dict[str, float]:
        m = jax.device_get(metrics)
        return {**m, "skipped": bool(m["skipped"]), "lr": self.lr(self.applied)}

    def peak_memory(self) -> int | None:
        return peak_memory_bytes(self.mem_device)

    def step_timer(self):
        return StepTimer(skip_first=1)

    @contextlib.contextmanager
    def profiling(self):
        """``--profile DIR``: a trace of :data:`PROFILE_STEPS` steps, after the first (its compile)."""
        steps = self.args.steps
        self._prof_start = min(self.start + 1, steps - 1) if self.args.profile else -1
        self._tracing = False
        try:
            yield
        finally:
            if self._tracing:
                stop_trace(self.state)
                self._tracing = False

    def before_step(self, i: int) -> None:
        if i == self._prof_start:
            start_trace(self.args.profile)
            self._tracing = True

    def after_step(self, i: int) -> None:
        if self._tracing and i + 1 >= self._prof_start + PROFILE_STEPS:
            stop_trace(self.state)
            self._tracing = False

    def compiles(self) -> int | None:
        jitted = self.step_fn.jitted
        return jitted._cache_size() if hasattr(jitted, "_cache_size") else None

    def summary_line(self) -> str:
        return (
            f"jax train: {self.args.steps - self.start} steps, train step compiled {self.compiles()} time(s)"
            f" (packing={self.args.packing}, buckets={list(self.data.buckets)})"
        )

    def export_model(self):
        model = self.state.model(self.graphdef)
        if jax.process_count() > 1:  # every process takes part in the gather; process 0 writes
            from jax.experimental import multihost_utils

            gdef, weights = nnx.split(model)
            model = nnx.merge(gdef, multihost_utils.process_allgather(weights, tiled=True))
        return model


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


run, main = Trainer.run, Trainer.cli  # in-process training (fit's dict), and the CLI (an exit status)


if __name__ == "__main__":
    raise SystemExit(main())
