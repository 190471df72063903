"""``python -m torchref.train``: the torch training CLI and its :class:`Trainer` (twin of ``jaxattn.train``; the flags
are ``twincore.cli``'s, shared with JAX).

    python -m torchref.train --preset tiny --data README.md --steps 200 --log-json runs/torch.jsonl
    summary = run(["--steps", "30", "--init", "ckpt"])      # in-process: {"losses": [...], ...}

``Trainer(args, config)`` builds everything from checked flags: the model (``--init`` through
``torchref.hf.from_pretrained``, else ``LlamaForCausalLM`` under the seeded RNG) with remat and the precision
policy, ``--parallel`` under torchrun (``torchref.parallel``), optimizer + ``LambdaLR`` + ``GradScaler`` (enabled for
fp16), the step of ``torchref.train_step``, a restored checkpoint — any bad value fails there, before
``torch.compile`` runs. ``Trainer.fit()`` runs the loop over a ``DataLoader``; the scheduler advances only on applied
steps (optax's rule). ``--profile DIR`` records three steps after the first with ``torch.profiler`` (a trace per
rank). Checkpoints (``torchref.checkpoint``) hold FULL state dicts keyed by parameter name
(``torch.distributed.checkpoint``'s ``get_state_dict`` / ``set_state_dict``), so a ``--parallel`` run's checkpoint
resumes under any mode or in one process; at the end rank 0 exports ``save_pretrained`` to
``<checkpoint-dir>/final``. ``fit`` returns a dict whose ``"summary"`` (``twincore.runlog.RunSummary``) says
what the run did and wrote; the CLI prints it on stdout from rank 0 (progress, lines and ``--tensorboard``:
``twincore.runlog``).
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import functools
import os
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from twincore.cli import (
    PP_MODES,
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

from . import hf, optim, parallel, pipeline, remat
from .attention import BACKENDS, attention_backend, dot_product_attention
from .checkpoint import Checkpointer
from .data import loader
from .eval import eval_sums
from .model import LlamaForCausalLM
from .precision import get_policy, set_matmul_precision
from .profiling import StepTimer, peak_memory_bytes, profiler
from .seed import rng_state, seed_all, set_rng_state
from .train_step import BATCH_KEYS, cross_entropy, loss_denominator, loss_fn, loss_weights, make_train_step  # noqa: F401

__all__ = ["Trainer", "main", "run", "make_train_step", "loss_fn"]

PROG = "python -m torchref.train"
PROFILE_STEPS = 3


class Trainer:
    """A training run built from checked flags; :meth:`fit` trains it. :meth:`from_argv` parses the flags first."""

    def __init__(self, args, config):
        self.args, self.config = args, config
        # the checkpoint directory first: its lock (held until fit() ends), then another run's, or a changed run on
        # --resume, fails before anything is built
        self.ckpt = None
        if args.checkpoint_dir:
            writer = int(os.environ.get("RANK", "0")) == 0
            self.ckpt = Checkpointer(args.checkpoint_dir, **checkpointer_options(args, config), writer=writer)
        try:
            self._build(args, config)
        except BaseException:
            self.close()  # the directory's lock goes with a trainer that could not be built
            raise

    def _build(self, args, config) -> None:
        self.last_saved = None
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        set_matmul_precision(args.matmul_precision)
        seed_all(args.seed, deterministic=args.deterministic)
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
        if self.backends:
            self._check_attention(args, config)
        model = hf.from_pretrained(args.init) if args.init else LlamaForCausalLM(config)
        model = model.to(self.device).train()
        remat.apply(model, args.remat)
        self.policy = get_policy(args.precision)
        self.policy.cast_model(model)
        self.model = model
        self.parallel, self.mesh, train_model = None, None, model
        if args.parallel is not None:  # under torchrun (checked with the flags)
            train_model = self._parallelize(args.parallel, model)
        self.optimizer, self.scheduler = optim.build(
            model,
            args.optimizer,
            args.lr,
            args.weight_decay,
            schedule=args.schedule,
            warmup=args.warmup,
            steps=args.steps,
        )
        self.scaler = self.policy.make_grad_scaler(self.device)
        if self.parallel in PP_MODES and self.scaler.is_enabled():  # every rank skips a step any rank overflowed
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            self.scaler = ShardedGradScaler(self.device.type)
        self.start = 0
        if args.resume:
            self._resume()
        self.compiled = torch.compile(train_model) if args.compile else train_model
        if self.parallel in PP_MODES:  # the library's schedule runs forward and backward (torchref.pipeline)
            self.step_fn = pipeline.make_pipeline_step(
                self.pipe,
                self.optimizer,
                max_grad_norm=args.clip_grad or None,
                autocast=lambda: self.policy.autocast(self.device.type),
                scaler=self.scaler,
                grad_accum=args.grad_accum,
            )
            return
        self.step_fn = make_train_step(
            self.compiled,
            self.optimizer,
            policy=self.policy,
            scaler=self.scaler,
            max_grad_norm=args.clip_grad or None,
            grad_accum=args.grad_accum,
            loss=args.loss,
            loss_chunk=args.loss_chunk,
        )

    def close(self) -> None:
        """Let the checkpoint directory go (its lock), for a trainer whose :meth:`fit` will not run; fit does it."""
        if self.ckpt is not None:
            self.ckpt.close()

    @classmethod
    def from_argv(cls, argv: Sequence[str] | None = None) -> Trainer:
        """Parse, check and build; raises :class:`CLIError` (or ValueError for bad data) before any compile."""
        args, config = parse_args(argv, "torch", BACKENDS)
        return cls(args, config)

    def _check_attention(self, args, config) -> None:
        """``--attention`` can serve this model's attention call on this device (a backend that cannot, e.g.
        ``cudnn`` on a CPU, fails now, not at the first step): one tiny call with the model's head shapes."""
        d, dev = config.resolved_head_dim, self.device
        dtype = get_policy(args.precision).compute_dtype
        q = torch.randn(1, config.n_heads, 8, d, device=dev, dtype=dtype)
        kv = torch.randn(1, config.n_kv_heads, 8, d, device=dev, dtype=dtype)
        try:
            with torch.no_grad():
                dot_product_attention(q, kv, kv, causal=True, backend=self.backends)
        except (RuntimeError, ValueError) as e:
            raise CLIError(
                f"--attention {args.attention!r} cannot serve this model's attention call on "
                f"{dev.type}: {str(e).splitlines()[0]}"
            ) from None

    def _parallelize(self, mode: str, model):
        """``torchref.parallel`` over all ranks; this rank keeps ``batch / dp`` rows of each batch (``pp``: its
        pipeline stage(s) of the model, ``torchref.pipeline``, and every row)."""
        if not dist.is_initialized():
            rank, world, timeout = os.environ.get("RANK", "0"), os.environ["WORLD_SIZE"], self.args.distributed_timeout
            where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
            print_line(f"torchref: rank {rank} waiting up to {timeout:g} s for all {world} ranks at {where}")
            try:
                dist.init_process_group(
                    "nccl" if self.device.type == "cuda" else "gloo", timeout=datetime.timedelta(seconds=timeout)
                )
            except dist.DistError as e:
                raise CLIError(
                    f"rank {rank}: the {world} ranks did not all meet at {where} within {timeout:g} s "
                    f"({str(e).splitlines()[0][:160]}); start every rank with torchrun's same --nproc-per-node / "
                    f"--nnodes / rendezvous, or raise --distributed-timeout"
                ) from None
        if self.device.type == "cuda":
            self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(self.device)
            model.to(self.device)
        if mode in PP_MODES:
            mesh, shard, self.whole = None, None, model  # pp: the stages share the model's parameters
            if mode != "pp":  # (stages, ranks sharding each stage); the whole model kept plain for eval / export
                from torch.distributed.device_mesh import init_device_mesh

                shard, stages = mode.split("+")[1], self.args.pp_stages
                dims = (stages, dist.get_world_size() // stages)
                names = ("pp", "dp_shard" if shard == "fsdp" else "tp")
                mesh = init_device_mesh(self.device.type, dims, mesh_dim_names=names)
                self.whole = copy.deepcopy(model)
            try:
                self.pipe = pipeline.Pipeline(
                    model,
                    self.args.pp_schedule,
                    self.args.microbatches,
                    virtual=self.args.pp_virtual,
                    device=self.device,
                    mesh=mesh,
                    shard=shard,
                    gather_once=self.args.pp_gather_once,
                )
            except ValueError as e:
                raise CLIError(f"--parallel {mode} --pp-schedule {self.args.pp_schedule}: {e}") from None
            self.parallel = mode
            return model
        self.mesh = parallel.build_mesh(mode)
        n = parallel.dp_size(mode, self.mesh)
        if self.args.batch_size % (n * self.args.grad_accum):
            raise CLIError(
                f"--batch-size {self.args.batch_size} must be divisible by the {n} data-parallel ranks "
                f"times --grad-accum {self.args.grad_accum} (--parallel {mode})"
            )
        self.parallel = mode
        return parallel.parallelize(model, mode, self.mesh, offload=self.args.offload_optimizer)

    def denominator(self, host: dict):
        """Data-parallel ranks divide their loss SUM by (the whole batch's real targets / dp), so the gradients
        averaged by DDP/FSDP and the mean of the ranks' losses are the whole batch's mean-token ones even when the
        ranks hold different numbers of targets (None: the step's own denominator)."""
        if self.parallel in PP_MODES:  # FSDP ranks of a stage: the whole batch's count over them
            return None if self.pipe.dp == 1 else float(loss_denominator(host)) / self.pipe.dp
        if self.parallel is None:
            return None
        return loss_denominator(host).to(self.device) / parallel.dp_size(self.parallel, self.mesh)

    def rows(self, host: dict) -> dict:
        """This rank's rows of a host batch (all of them without --parallel, with tp, and with pp: there only the
        tokens and the loss mask, one document per row, so causal attention never reaches the padding at the end and
        the stages' own positions 0..S-1 are the rows' positions)."""
        if self.parallel in PP_MODES:  # pp+fsdp: the rows of this rank's block
            return self.pipe.rows({"tokens": host["tokens"], "loss_mask": host["loss_mask"]})
        return host if self.parallel is None else parallel.local_rows(host, self.parallel, self.mesh)

    def _resume(self) -> None:
        step = self.ckpt.latest_step()
        for problem in self.ckpt.problems:
            print_line(f"{PROG}: warning: --resume skips a checkpoint: {problem}")
        if step is None:
            raise CLIError(
                f"--resume: no valid checkpoint in --checkpoint-dir {self.args.checkpoint_dir!r}"
                + (f" ({'; '.join(self.ckpt.problems)})" if self.ckpt.problems else "")
            )
        p = self.ckpt.load(step)
        meta = p["meta"]
        if meta.get("model_config") != self.config.to_hf():
            raise CLIError(
                f"--resume: the checkpoint at step {step} in {self.args.checkpoint_dir!r} is of another "
                f"model config ({meta.get('model_config')}) than the flags ask for ({self.config.to_hf()})"
            )
        if step > self.args.steps:
            raise CLIError(f"--resume: the latest checkpoint is at step {step}, past --steps {self.args.steps}")
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=p["model"],
            optim_state_dict=p["optimizer"],
            options=StateDictOptions(full_state_dict=True),
        )
        self.scheduler.load_state_dict(p["scheduler"])
        self.scaler.load_state_dict(p["scaler"])
        set_rng_state(p["rng"])
        self.start = self.last_saved = int(meta["data_position"])

    @property
    def rank0(self) -> bool:
        return self.parallel is None or int(os.environ.get("RANK", "0")) == 0

    def full_state_dicts(self) -> tuple[dict, dict]:
        """``(model, optimizer)`` full state dicts keyed by parameter name, on the CPU: every rank takes part in the
        gather (FSDP / TP shards are DTensors); rank 0 receives them, the other ranks get empty dicts. ``pp``: the
        stages' weights broadcast to every rank, each parameter's optimizer state gathered from its stage's rank."""
        if self.parallel in PP_MODES:  # each stage's weights and optimizer state, whole, sent by name
            whole = self.synced_model()
            optim_sd = self.pipe.optimizer_state(self.model, self.optimizer)
            if not self.rank0:
                return {}, {}
            return {k: v.detach().cpu().clone() for k, v in whole.state_dict().items()}, optim_sd
        return get_state_dict(
            self.model, self.optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )

    def synced_model(self):
        """Pipeline modes: a plain whole model holding every stage's current weights, on every rank (``pp``: the
        model itself, whose stages share its parameters; ``pp+fsdp`` / ``pp+tp``: the plain copy kept for this)."""
        self.pipe.sync_model(self.whole, self.model)
        return self.whole

    def save(self, step: int) -> None:
        model_sd, optim_sd = self.full_state_dicts()
        if not self._all_ranks(all(bool(torch.isfinite(v).all()) for v in model_sd.values())):
            raise TrainingError(
                f"the weights are not finite after step {step}: no checkpoint of them is written "
                f"(lower --lr, keep --clip-grad on, or check the --init weights)"
            )
        if self.rank0:
            meta = {
                "framework": "torch",
                "step": step,
                "data_position": step,
                "model_config": self.config.to_hf(),
                "flags": {k: v for k, v in vars(self.args).items()},
            }
            save = functools.partial(
                self.ckpt.save,
                step,
                {
                    "model": model_sd,
                    "optimizer": optim_sd,
                    "scheduler": self.scheduler.state_dict(),
                    "scaler": self.scaler.state_dict(),
                    "rng": rng_state(),
                    "meta": meta,
                },
            )
            try:
                save()
            except OSError as e:
                raise TrainingError(
                    f"cannot write the checkpoint of step {step} in --checkpoint-dir "
                    f"{self.args.checkpoint_dir!r}: {e.strerror or e}"
                ) from e
        self.last_saved = step
        self.barrier()

    def _all_ranks(self, ok: bool) -> bool:
        """``ok`` on every rank (rank 0 alone holds the gathered weights; every rank must take the same branch)."""
        if self.parallel is None:
            return ok
        t = torch.tensor([1 if ok else 0], device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return bool(t.item())

    def barrier(self) -> None:
        """Under ``--parallel``: wait until rank 0 has written (a checkpoint, the export)."""
        if self.parallel is not None:
            dist.barrier()

    def _profiler(self):
        if not self.args.profile:
            return contextlib.nullcontext(None)
        return profiler(self.args.profile, wait=0, warmup=1, active=PROFILE_STEPS, cuda=self.device.type == "cuda")

    def evaluate(self) -> EvalResult:
        """Mean token loss and perplexity of the current weights on ``--eval-data``: under ``--parallel`` each rank
        scores its rows and the sums are added over all ranks (tensor-parallel ranks hold the same rows: divided
        out)."""
        if self.parallel in PP_MODES:  # every rank the whole current model, every row: the same sums everywhere
            return self._evaluate_rows(model=self.synced_model())
        return self._evaluate_rows(reduce=self.parallel is not None)

    def _evaluate_rows(self, reduce: bool = False, model=None) -> EvalResult:
        sums = []
        for host in self.eval_batches:
            rows = self.rows(host) if model is None else host  # a synced whole model: every row
            batch = {k: torch.from_numpy(v).to(self.device) for k, v in rows.items()}
            sums.append(torch.stack(eval_sums(model or self.model, batch, policy=self.policy)))
        total = torch.stack(sums).double().sum(0)
        if reduce:
            dist.all_reduce(total, op=dist.ReduceOp.SUM)
            total /= dist.get_world_size() // parallel.dp_size(self.parallel, self.mesh)
        return EvalResult(loss_sum=float(total[0]), tokens=int(round(float(total[1]))))

    def eval_due(self, step: int) -> bool:
        """``--eval-data`` is evaluated after the last step and every ``--eval-every`` steps."""
        every = self.args.eval_every
        return self.eval_batches is not None and (step == self.args.steps or (every > 0 and step % every == 0))

    def fit(self) -> dict[str, Any]:
        """Train from ``start`` to ``--steps``; returns ``{"losses", "compiles", "start", "steps", "phases",
        "evals", "summary", "final"?}`` (``evals``: the ``--eval-data`` records, ``twincore.runlog.EVAL_KEYS``;
        ``summary``: a ``twincore.runlog.RunSummary``, the same shape as jaxattn's)."""
        args = self.args
        rank0 = self.rank0  # one log per run under torchrun
        log = RunLog(
            args.steps,
            self.start,
            args.log_json if rank0 else None,
            progress=rank0 and not args.no_progress,
            desc="torch train",
            tensorboard=args.tensorboard if rank0 else None,
            loss_scaling=self.policy.uses_loss_scaling,
        )
        losses: list[float] = []
        evals: list[dict] = []
        ctx = attention_backend(*self.backends) if self.backends else contextlib.nullcontext()
        batches = loader(
            self.data, self.start, args.steps, num_workers=args.num_workers, pin_memory=self.device.type == "cuda"
        )
        timer = StepTimer(skip_first=1)  # the same phases as jaxattn.train, no extra syncs
        guard = DivergenceGuard(args.max_nonfinite_steps)
        lock = self.ckpt.locked() if self.ckpt else contextlib.nullcontext()
        try:
            with lock, ctx, self._profiler() as prof:
                t_last = time.perf_counter()
                it = iter(batches)
                for i in range(self.start, args.steps):
                    with timer.phase("data"):  # waiting for the DataLoader, then the host-to-device copy
                        host = next(it)
                        tokens = int(host["loss_mask"][:, :-1].sum())
                        denominator = self.denominator(host)
                        host = self.rows(host)  # --parallel under torchrun: this rank's rows
                        batch = {k: v.to(self.device, non_blocking=True) for k, v in host.items()}
                    lr = self.scheduler.get_last_lr()[0]
                    with timer.phase("dispatch"):  # forward + backward + optimizer (eager on CPU: the whole step)
                        m = self.step_fn(batch, denominator)
                    with timer.phase("metrics"):  # reading the loss back waits for the device
                        skipped = bool(m["skipped"])
                        optim.step_scheduler(self.scheduler, skipped)
                        loss = float(m["loss"]) if self.parallel is None else self._global_mean(m["loss"])
                    now = time.perf_counter()
                    rec = log.step(
                        step=i + 1,
                        loss=loss,
                        grad_norm=_scalar(m["grad_norm"]),
                        lr=lr,
                        loss_scale=float(m["loss_scale"]),
                        skipped=skipped,
                        tokens=tokens,
                        seconds=now - t_last,
                        peak_mem_bytes=peak_memory_bytes(self.device),
                        **{k: _scalar(m[k]) for k in MOE_KEYS if k in m},  # an MoE's router metrics (this rank's)
                    )
                    t_last = now
                    losses.append(rec["loss"])
                    guard.check(rec)
                    if prof is not None:
                        prof.step()
                    if self.ckpt and args.checkpoint_every and (i + 1) % args.checkpoint_every == 0:
                        self.save(i + 1)
                        t_last = time.perf_counter()
                    if self.eval_due(i + 1):  # after the step's record; its time is not the next step's
                        r = self.evaluate()
                        if rank0:
                            evals.append(log.eval(step=i + 1, loss=r.loss, perplexity=r.perplexity, tokens=r.tokens))
                        t_last = time.perf_counter()
                final = self._finish(rank0) if self.ckpt else None
            log.write(
                f"torch train: {args.steps - self.start} steps (packing={args.packing}, "
                f"compile={'on' if args.compile else 'off'})"
            )
            out = {
                "losses": losses,
                "compiles": None,
                "start": self.start,
                "steps": args.steps,
                "phases": log.breakdown(timer),
                "evals": evals,
            }
            if final is not None:
                out["final"] = final
            last = None if self.last_saved is None else self.ckpt.path(self.last_saved)
            out["summary"] = log.summary(checkpoint=last, final=final)
            return out
        finally:
            log.close()

    def _finish(self, rank0: bool) -> str:
        """The last checkpoint (if the loop did not just write it) and the Hugging Face export in ``final/``."""
        if self.last_saved != self.args.steps:
            self.save(self.args.steps)  # refuses non-finite weights: no export of them either
        final = os.path.join(self.args.checkpoint_dir, "final")
        model = self.model
        if self.parallel is not None:  # the gathered full weights in a plain model (rank 0)
            model_sd, _ = self.full_state_dicts()
            if rank0:
                model = LlamaForCausalLM(self.config)
                model.load_state_dict(model_sd)
        if rank0:
            hf.save_pretrained(model, final)
            copy_tokenizer(self.args.init, final)
        self.barrier()
        return final

    def _global_mean(self, loss: torch.Tensor) -> float:
        """The loss over the whole batch: the mean of the data-parallel ranks' losses (equal row blocks)."""
        t = loss.detach().float().reshape(1).clone()
        if self.parallel in PP_MODES:  # already the whole batch's, on every rank
            return float(t)
        n = parallel.dp_size(self.parallel, self.mesh)
        if n > 1:
            dist.all_reduce(t, op=dist.ReduceOp.SUM)  # gloo has no AVG
            t /= n
        return float(t)


def _scalar(x: torch.Tensor) -> float:
    return float(x.full_tensor() if hasattr(x, "full_tensor") else x)  # a DTensor under --parallel tp/fsdp


def run(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Train as the CLI would (without printing the summary); returns :meth:`Trainer.fit`'s dict."""
    return Trainer.from_argv(argv).fit()


def _fit_and_report(trainer: Trainer) -> dict[str, Any]:
    """The CLI's training: :meth:`Trainer.fit`, then its summary on stdout (rank 0)."""
    out = trainer.fit()
    if trainer.rank0:
        print(out["summary"], flush=True)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    return cli_main(PROG, Trainer.from_argv, _fit_and_report, argv)


if __name__ == "__main__":
    raise SystemExit(main())
