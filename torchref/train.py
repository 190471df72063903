"""``python -m torchref.train``: the torch training CLI and its :class:`Trainer` (twin of ``jaxattn.train``; the flags
are ``twincore.cli``'s, shared with JAX).

    python -m torchref.train --preset tiny --data README.md --steps 200 --log-json runs/torch.jsonl
    summary = run(["--steps", "30", "--init", "ckpt"])      # in-process: {"losses": [...], ...}

``Trainer`` is ``twincore.trainer.Trainer`` (the loop, data, resume checks, checkpoint cadence, export and summary,
shared with JAX) with torch's parts: ``Trainer(args, config)`` builds the model (``--init`` through
``torchref.hf.from_pretrained``, else ``LlamaForCausalLM`` under the seeded RNG) with remat and the precision
policy, ``--parallel`` under torchrun (``torchref.parallel``), optimizer + ``LambdaLR`` + ``GradScaler`` (enabled for
fp16), the step of ``torchref.train_step``, a restored checkpoint — any bad value fails there, before
``torch.compile`` runs. ``fit()`` runs the loop over a ``DataLoader``; the scheduler advances only on applied
steps (optax's rule). ``--profile DIR`` records three steps after the first with ``torch.profiler`` (a trace per
rank). Checkpoints (``torchref.checkpoint``) hold FULL state dicts keyed by parameter name
(``torch.distributed.checkpoint``'s ``get_state_dict`` / ``set_state_dict``), so a ``--parallel`` run's checkpoint
resumes under any mode or in one process; rank 0 exports ``save_pretrained`` into ``<checkpoint-dir>/final`` and
prints the summary.
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import os

import torch
import torch.distributed as dist

from twincore.cli import PP_MODES, CLIError, print_line
from twincore.eval import EvalResult
from twincore.runlog import MOE_KEYS
from twincore.trainer import PROFILE_STEPS
from twincore.trainer import Trainer as BaseTrainer

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


class Trainer(BaseTrainer):
    """The torch run: ``twincore.trainer.Trainer``'s loop with an eager (or compiled) step, metrics read at once."""

    FRAMEWORK, PROG, BACKENDS = "torch", PROG, BACKENDS
    Checkpointer, hf, attention_backend = Checkpointer, hf, attention_backend

    def writer(self) -> bool:
        return int(os.environ.get("RANK", "0")) == 0

    @property
    def lead(self) -> bool:
        return self.parallel is None or int(os.environ.get("RANK", "0")) == 0

    def setup(self, args) -> None:
        self.parallel, self._own_group = None, False
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        set_matmul_precision(args.matmul_precision)
        seed_all(args.seed, deterministic=args.deterministic)
        self.policy = get_policy(args.precision)

    def build(self, args, config) -> None:
        if self.attention:
            self._check_attention(args, config)
        model = hf.from_pretrained(args.init) if args.init else LlamaForCausalLM(config)
        model = model.to(self.device).train()
        remat.apply(model, args.remat)
        self.policy.cast_model(model)
        self.model = model
        self.mesh, train_model = None, model
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

    def _check_attention(self, args, config) -> None:
        """``--attention`` can serve this model's attention call on this device, backward included (a backend that
        cannot, e.g. ``cudnn`` on a CPU or ``flex`` on a CPU, fails now, not at the first step): one tiny call with
        the model's head shapes."""
        d, dev = config.resolved_head_dim, self.device
        dtype = get_policy(args.precision).compute_dtype
        q = torch.randn(1, config.n_heads, 8, d, device=dev, dtype=dtype, requires_grad=True)
        kv = torch.randn(1, config.n_kv_heads, 8, d, device=dev, dtype=dtype)
        try:
            out = dot_product_attention(q, kv, kv, causal=True, window=config.attention_window, backend=self.attention)
            out.float().sum().backward()
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
                self._own_group = True
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
                    loss=self.args.loss,
                    loss_chunk=self.args.loss_chunk,
                    loss_dtype=get_policy(self.args.precision).compute_dtype,
                    compile=self.args.compile,
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

    def rows(self, host: dict, blocks: int = 1) -> dict:
        """This rank's rows of a host batch (all of them without --parallel, with tp, and with pp; pp+fsdp: the
        rows of this rank's share), its share of each of ``blocks`` accumulation blocks."""
        if self.parallel in PP_MODES:
            return self.pipe.rows(host, blocks)
        return host if self.parallel is None else parallel.local_rows(host, self.parallel, self.mesh, blocks)

    def _resume(self) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict  # 0.8 s to import

        step = self.resume_step()
        p = self.ckpt.load(step)
        self.check_resume(step, p["meta"])
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

    def full_state_dicts(self) -> tuple[dict, dict]:
        """``(model, optimizer)`` full state dicts keyed by parameter name, on the CPU: every rank takes part in the
        gather (FSDP / TP shards are DTensors); rank 0 receives them, the other ranks get empty dicts. ``pp``: the
        stages' weights broadcast to every rank, each parameter's optimizer state gathered from its stage's rank."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        if self.parallel in PP_MODES:  # each stage's weights and optimizer state, whole, sent by name
            whole = self.synced_model()
            optim_sd = self.pipe.optimizer_state(self.model, self.optimizer)
            if not self.lead:
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

    def checkpoint_state(self) -> tuple[dict, dict]:
        return self.full_state_dicts()  # every rank takes part; rank 0 holds them

    def is_finite(self, state) -> bool:
        model_sd, _ = state
        return self._all_ranks(all(bool(torch.isfinite(v).all()) for v in model_sd.values()))

    def write_checkpoint(self, step: int, state, meta: dict) -> None:
        if self.lead:
            model_sd, optim_sd = state
            payload = {"model": model_sd, "optimizer": optim_sd, "scheduler": self.scheduler.state_dict()}
            payload |= {"scaler": self.scaler.state_dict(), "rng": rng_state(), "meta": meta}
            self.ckpt.save(step, payload)

    def _all_ranks(self, ok: bool) -> bool:
        """``ok`` on every rank (rank 0 alone holds the gathered weights; every rank must take the same branch)."""
        if self.parallel is None:
            return ok
        t = torch.tensor([1 if ok else 0], device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return bool(t.item())

    def end_processes(self) -> None:
        if self._own_group:  # torch's shutdown rule: the group this trainer made is destroyed before the exit
            dist.barrier()  # no rank leaves while another still has work in flight
            dist.destroy_process_group()
            self._own_group = False

    def barrier(self) -> None:
        """Under ``--parallel``: wait until rank 0 has written (a checkpoint, the export)."""
        if self.parallel is not None:
            dist.barrier()

    def profiling(self):
        """``--profile DIR``: ``torch.profiler`` over :data:`PROFILE_STEPS` steps after the first (a trace per rank)."""
        self._prof = None
        if not self.args.profile:
            return contextlib.nullcontext()
        prof = profiler(self.args.profile, wait=0, warmup=1, active=PROFILE_STEPS, cuda=self.device.type == "cuda")
        return _Bind(self, prof)

    def after_step(self, i: int) -> None:
        if self._prof is not None:
            self._prof.step()

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

    def batches(self):
        """This rank's rows of each batch on the device, with the whole batch's target count and loss denominator."""
        args = self.args
        pin = self.device.type == "cuda"
        for host in loader(self.data, self.start, args.steps, num_workers=args.num_workers, pin_memory=pin):
            tokens = int(host["loss_mask"][:, :-1].sum())
            denominator = self.denominator(host)
            host = self.rows(host, args.grad_accum)  # --parallel under torchrun: this rank's rows
            yield (({k: v.to(self.device, non_blocking=True) for k, v in host.items()}, denominator), tokens)

    def dispatch(self, batch):
        lr = self.scheduler.get_last_lr()[0]  # the rate this step applies
        return self.step_fn(*batch), lr  # forward + backward + optimizer (eager on CPU: the whole step)

    def read_metrics(self, handle) -> dict[str, float]:
        m, lr = handle
        skipped = bool(m["skipped"])
        optim.step_scheduler(self.scheduler, skipped)
        loss = float(m["loss"]) if self.parallel is None else self._global_mean(m["loss"])
        out = {"loss": loss, "grad_norm": _scalar(m["grad_norm"]), "lr": lr, "loss_scale": float(m["loss_scale"])}
        return out | {"skipped": skipped} | {k: _scalar(m[k]) for k in MOE_KEYS if k in m}  # MoE: this rank's

    def peak_memory(self) -> int | None:
        return peak_memory_bytes(self.device)

    def step_timer(self):
        return StepTimer(skip_first=1)

    def summary_line(self) -> str:
        compiled = "on" if self.args.compile else "off"
        return f"torch train: {self.args.steps - self.start} steps (packing={self.args.packing}, compile={compiled})"

    def export_model(self):
        """Rank 0: a plain model with the gathered full weights (every rank takes part in the gather)."""
        if self.parallel is None:
            return self.model
        model_sd, _ = self.full_state_dicts()
        if not self.lead:
            return None
        model = LlamaForCausalLM(self.config)
        model.load_state_dict(model_sd)
        return model

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


class _Bind(contextlib.AbstractContextManager):
    """The profiler's context, its object kept on the trainer for :meth:`Trainer.after_step`."""

    def __init__(self, trainer: Trainer, prof):
        self.trainer, self.prof = trainer, prof

    def __enter__(self):
        self.trainer._prof = self.prof.__enter__()
        return self.trainer._prof

    def __exit__(self, *exc):
        self.trainer._prof = None
        return self.prof.__exit__(*exc)


def _scalar(x: torch.Tensor) -> float:
    return float(x.full_tensor() if hasattr(x, "full_tensor") else x)  # a DTensor under --parallel tp/fsdp


run, main = Trainer.run, Trainer.cli  # in-process training (fit's dict), and the CLI (an exit status)


if __name__ == "__main__":
    raise SystemExit(main())
