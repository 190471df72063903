"""The torch training loop behind ``python -m torchref.train`` (twin of ``jaxattn.trainer``; flags: ``spec.cli``).

    python -m torchref.train --preset tiny --data README.md --steps 200 --log-json runs/torch.jsonl
    summary = run(["--steps", "30", "--init", "ckpt"])      # in-process: {"losses": [...], ...}

Order of work: parse and check every flag, read the data, build the model (``--init`` through
``torchref.hf.from_pretrained``, else ``LlamaForCausalLM`` under the seeded RNG), apply remat and the precision
policy, build optimizer + ``LambdaLR`` + ``GradScaler`` (enabled for fp16) and the step, restore a checkpoint
(any bad value fails here, before ``torch.compile`` runs); then the loop over a ``DataLoader``. The scheduler
advances only on applied steps (``torchref.optim.step_scheduler``, optax's rule). ``--profile DIR`` records
three steps after the first with ``torch.profiler`` (a Chrome trace JSON per step window: Perfetto and
TensorBoard open it; under ``torchrun`` each rank writes its own). Checkpoints: ``torchref.checkpoint`` holding the
FULL (unsharded) model and optimizer state dicts keyed by parameter name (``torch.distributed.checkpoint``'s
``get_state_dict`` / ``set_state_dict``), so a checkpoint of a ``--parallel`` run written by rank 0 resumes under
any ``--parallel`` mode or in one process, and the other way round; at the end the model is exported with
``save_pretrained`` to ``<checkpoint-dir>/final`` (rank 0).
"""
from __future__ import annotations

import contextlib
import os
import time
from typing import Any, Optional, Sequence

import torch

from jaxattn.spec.cli import CLIError, cli_main, parse_args
from jaxattn.spec.data import Dataset, copy_tokenizer, load_tokenizer
from jaxattn.spec.runlog import RunLog

__all__ = ["main", "run", "prepare"]

PROG = "python -m torchref.train"
PROFILE_STEPS = 3


def _peak_mem(device: torch.device) -> int:
    from .profiling import peak_memory_bytes

    return peak_memory_bytes(device)  # torch.cuda.max_memory_allocated on CUDA, else host peak RSS


class Run:
    """Everything built from the flags, before any compile."""

    def __init__(self, args, config):
        from . import hf, optim, remat
        from .checkpoint import Checkpointer
        from .model import LlamaForCausalLM
        from .precision import get_policy, set_matmul_precision
        from .seed import seed_all
        from .train import make_train_step

        self.args, self.config = args, config
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        set_matmul_precision(args.matmul_precision)
        seed_all(args.seed, deterministic=args.deterministic)
        self.tokenizer = load_tokenizer(args.init)
        if self.tokenizer.vocab_size > config.vocab_size:
            raise CLIError(f"--init {args.init!r}: tokenizer.json has {self.tokenizer.vocab_size} ids but the model's "
                           f"vocab_size is {config.vocab_size}")
        self.data = Dataset.from_source(args.data, seq_len=args.seq_len, batch_size=args.batch_size, seed=args.seed,
                                        packing=args.packing, vocab_size=config.vocab_size, tokenizer=self.tokenizer)
        self.backends = None if args.attention is None else tuple(n.strip() for n in args.attention.split(","))
        model = hf.from_pretrained(args.init) if args.init else LlamaForCausalLM(config)
        model = model.to(self.device).train()
        remat.apply(model, args.remat)
        self.policy = get_policy(args.precision)
        self.policy.cast_model(model)
        self.model = model
        self.parallel, self.mesh, train_model = None, None, model
        if args.parallel is not None and int(os.environ.get("WORLD_SIZE", "1")) > 1:  # under torchrun
            train_model = self._parallelize(args.parallel, model)
        self.optimizer, self.scheduler = optim.build(model, args.optimizer, args.lr, args.weight_decay,
                                                     schedule=args.schedule, warmup=args.warmup, steps=args.steps)
        self.scaler = self.policy.make_grad_scaler(self.device)
        self.start = 0
        self.ckpt = Checkpointer(args.checkpoint_dir, args.keep_checkpoints) if args.checkpoint_dir else None
        if args.resume:
            self._resume()
        self.compiled = torch.compile(train_model) if args.compile else train_model
        self.step_fn = make_train_step(self.compiled, self.optimizer, policy=self.policy, scaler=self.scaler,
                                       max_grad_norm=args.clip_grad or None, grad_accum=args.grad_accum)

    def _parallelize(self, mode: str, model):
        """``torchref.parallel`` over all ranks; this rank keeps ``batch / dp`` rows of each batch."""
        import torch.distributed as dist

        from . import parallel

        if not dist.is_initialized():
            dist.init_process_group("nccl" if self.device.type == "cuda" else "gloo")
        if self.device.type == "cuda":
            self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(self.device)
            model.to(self.device)
        self.mesh = parallel.build_mesh(mode)
        n = parallel.dp_size(mode, self.mesh)
        if self.args.batch_size % (n * self.args.grad_accum):
            raise CLIError(f"--batch-size {self.args.batch_size} must be divisible by the {n} data-parallel ranks "
                           f"times --grad-accum {self.args.grad_accum} (--parallel {mode})")
        self.parallel = mode
        return parallel.parallelize(model, mode, self.mesh, offload=self.args.offload_optimizer)

    def denominator(self, host: dict):
        """Data-parallel ranks divide their loss SUM by (the whole batch's real targets / dp), so the gradients
        averaged by DDP/FSDP and the mean of the ranks' losses are the whole batch's mean-token ones even when the
        ranks hold different numbers of targets (None: the step's own denominator)."""
        if self.parallel is None:
            return None
        from .parallel import dp_size
        from .train import loss_denominator

        return loss_denominator(host).to(self.device) / dp_size(self.parallel, self.mesh)

    def rows(self, host: dict) -> dict:
        """This rank's rows of a host batch (all of them without --parallel or with tp)."""
        if self.parallel is None:
            return host
        from .parallel import local_rows

        return local_rows(host, self.parallel, self.mesh)

    def _resume(self) -> None:
        from .seed import set_rng_state

        step = self.ckpt.latest_step()
        if step is None:
            raise CLIError(f"--resume: no checkpoint in --checkpoint-dir {self.args.checkpoint_dir!r}")
        p = self.ckpt.load(step)
        meta = p["meta"]
        if meta.get("model_config") != self.config.to_hf():
            raise CLIError(f"--resume: the checkpoint at step {step} in {self.args.checkpoint_dir!r} is of another "
                           f"model config ({meta.get('model_config')}) than the flags ask for ({self.config.to_hf()})")
        if step > self.args.steps:
            raise CLIError(f"--resume: the latest checkpoint is at step {step}, past --steps {self.args.steps}")
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        set_state_dict(self.model, self.optimizer, model_state_dict=p["model"], optim_state_dict=p["optimizer"],
                       options=StateDictOptions(full_state_dict=True))
        self.scheduler.load_state_dict(p["scheduler"])
        self.scaler.load_state_dict(p["scaler"])
        set_rng_state(p["rng"])
        self.start = int(meta["data_position"])

    @property
    def rank0(self) -> bool:
        return self.parallel is None or int(os.environ.get("RANK", "0")) == 0

    def full_state_dicts(self) -> tuple[dict, dict]:
        """``(model, optimizer)`` full state dicts keyed by parameter name, on the CPU: every rank takes part in the
        gather (FSDP / TP shards are DTensors); rank 0 receives them, the other ranks get empty dicts."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        return get_state_dict(self.model, self.optimizer,
                              options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def save(self, step: int) -> None:
        from .seed import rng_state

        model_sd, optim_sd = self.full_state_dicts()
        if self.rank0:
            meta = {"framework": "torch", "step": step, "data_position": step, "model_config": self.config.to_hf(),
                    "flags": {k: v for k, v in vars(self.args).items()}}
            self.ckpt.save(step, {"model": model_sd, "optimizer": optim_sd, "scheduler": self.scheduler.state_dict(),
                                  "scaler": self.scaler.state_dict(), "rng": rng_state(), "meta": meta})
        self.barrier()

    def barrier(self) -> None:
        """Under ``--parallel``: wait until rank 0 has written (a checkpoint, the export)."""
        if self.parallel is not None:
            import torch.distributed as dist

            dist.barrier()


def prepare(argv: Optional[Sequence[str]]) -> Run:
    """Parse, check and build; raises :class:`CLIError` (or ValueError for bad data) before any compile."""
    from .attention import BACKENDS

    args, config = parse_args(argv, "torch", BACKENDS)
    return Run(args, config)


def _profiler(r: Run):
    if not r.args.profile:
        return contextlib.nullcontext(None)
    from .profiling import profiler

    return profiler(r.args.profile, wait=0, warmup=1, active=PROFILE_STEPS, cuda=r.device.type == "cuda")


def _train(r: Run) -> dict[str, Any]:
    from .attention import attention_backend
    from .data import loader
    from .optim import step_scheduler
    from jaxattn.spec.timing import StepTimer

    args = r.args
    rank0 = r.rank0  # one log per run under torchrun
    log = RunLog(args.steps, r.start, args.log_json if rank0 else None, progress=rank0 and not args.no_progress,
                 desc="torch train")
    losses: list[float] = []
    ctx = attention_backend(*r.backends) if r.backends else contextlib.nullcontext()
    cuda = r.device.type == "cuda"
    batches = loader(r.data, r.start, args.steps, num_workers=args.num_workers, pin_memory=cuda)
    timer = StepTimer(skip_first=1)  # the same phases as jaxattn.trainer, no extra syncs
    try:
        with ctx, _profiler(r) as prof:
            t_last = time.perf_counter()
            it = iter(batches)
            for i in range(r.start, args.steps):
                with timer.phase("data"):  # waiting for the DataLoader, then the host-to-device copy
                    host = next(it)
                    tokens = int(host["loss_mask"][:, :-1].sum())
                    denominator = r.denominator(host)
                    host = r.rows(host)  # --parallel under torchrun: this rank's rows
                    batch = {k: v.to(r.device, non_blocking=True) for k, v in host.items()}
                lr = r.scheduler.get_last_lr()[0]
                with timer.phase("dispatch"):  # forward + backward + optimizer (eager on CPU: the whole step)
                    m = r.step_fn(batch, denominator)
                with timer.phase("metrics"):  # reading the loss back waits for the device
                    skipped = bool(m["skipped"])
                    step_scheduler(r.scheduler, skipped)
                    loss = float(m["loss"]) if r.parallel is None else _global_mean(m["loss"], r)
                now = time.perf_counter()
                rec = log.step(step=i + 1, loss=loss, grad_norm=_scalar(m["grad_norm"]), lr=lr,
                               loss_scale=float(m["loss_scale"]), skipped=skipped, tokens=tokens,
                               seconds=now - t_last, peak_mem_bytes=_peak_mem(r.device))
                t_last = now
                losses.append(rec["loss"])
                if prof is not None:
                    prof.step()
                if r.ckpt and args.checkpoint_every and (i + 1) % args.checkpoint_every == 0:
                    r.save(i + 1)
                    t_last = time.perf_counter()
        log.write(f"torch train: {args.steps - r.start} steps (packing={args.packing}, "
                  f"compile={'on' if args.compile else 'off'})")
        out = {"losses": losses, "compiles": None, "start": r.start, "steps": args.steps,
               "phases": log.breakdown(timer)}
        if r.ckpt:
            if r.ckpt.latest_step() != args.steps:
                r.save(args.steps)
            from .hf import save_pretrained

            final = os.path.join(args.checkpoint_dir, "final")
            model = r.model
            if r.parallel is not None:  # the gathered full weights in a plain model (rank 0)
                from .model import LlamaForCausalLM

                model_sd, _ = r.full_state_dicts()
                if rank0:
                    model = LlamaForCausalLM(r.config)
                    model.load_state_dict(model_sd)
            if rank0:
                save_pretrained(model, final)
                copy_tokenizer(args.init, final)
            r.barrier()
            out["final"] = final
        return out
    finally:
        log.close()


def _scalar(x: torch.Tensor) -> float:
    return float(x.full_tensor() if hasattr(x, "full_tensor") else x)  # a DTensor under --parallel tp/fsdp


def _global_mean(loss: torch.Tensor, r: Run) -> float:
    """The loss over the whole batch: the mean of the data-parallel ranks' losses (equal row blocks)."""
    import torch.distributed as dist

    from .parallel import dp_size

    t = loss.detach().float().reshape(1).clone()
    n = dp_size(r.parallel, r.mesh)
    if n > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)  # gloo has no AVG
        t /= n
    return float(t)


def run(argv: Optional[Sequence[str]] = None) -> dict[str, Any]:
    """Train as the CLI would; returns ``{"losses", "start", "steps", "final"?}``."""
    return _train(prepare(argv))


def main(argv: Optional[Sequence[str]] = None) -> int:
    return cli_main(PROG, prepare, _train, argv)
