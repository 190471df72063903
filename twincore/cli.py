"""The training CLI's flag table, defined ONCE for ``python -m jaxattn.train`` and ``python -m torchref.train``.

    args = parse_args(["--preset", "tiny", "--steps", "30"], framework="jax", attention_backends=("xla", ...))

:data:`FLAGS` is one table; :func:`build_parser` turns it into an ``argparse`` parser for one framework (the
shared flags are identical by construction, plus the framework-only ones: ``--mesh`` and the multi-process
``--coordinator/--num-processes/--process-id`` (or ``$JAX_COORDINATOR_ADDRESS/$JAX_NUM_PROCESSES/$JAX_PROCESS_ID``)
for JAX, ``--compile``, ``--parallel`` and ``--num-workers`` for torch). :func:`parse_args` parses AND checks every
value (files exist, numbers in range, names known, combinations valid) so a bad flag fails with a
:class:`CLIError` naming the flag, the value and what is accepted, before any model is built or compiled.
``--mesh`` is checked against the devices by ``jaxattn.train``, ``--parallel`` against the ranks by
``torchref.train``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from .atomic import check_writable
from .attention import AttentionChoice
from .config import PRESET_NAMES, ModelConfig
from .data import PACKING, SYNTHETIC, is_gguf
from .dtypes import PRECISION_PRESETS
from .loss import DEFAULT_CHUNK, LOSSES
from .optim import OPTIMIZER_NAMES, SCHEDULE_NAMES
from .pipeline import JAX_SCHEDULES, virtual_stages
from .pipeline import SCHEDULES as PP_SCHEDULES
from .remat import REMAT_POLICIES
from .rundir import RUN_FLAGS, RunDirError
from .runlog import TrainingError, tensorboard_writer_class

__all__ = [
    "FLAGS",
    "FRAMEWORKS",
    "CLIError",
    "OneLineParser",
    "TrainingError",
    "run_flags",
    "checkpointer_options",
    "build_parser",
    "parse_args",
    "check_args",
    "model_config",
    "MATMUL_PRECISIONS",
]

FRAMEWORKS = ("jax", "torch")
MATMUL_PRECISIONS = ("highest", "high", "medium")
PP_MODES = ("pp", "pp+fsdp", "pp+tp")  # torchref.pipeline: stages alone, each sharded by FSDP2 or tensor parallel
EP_MODES = ("ep", "ep+fsdp")  # torchref.parallel: an MoE's experts split over the ranks (the rest ddp / fsdp)
PARALLEL = ("ddp", "fsdp", "tp", "fsdp+tp", *EP_MODES, *PP_MODES)  # torchref.parallel.MODES + torchref.pipeline's
# optimizers whose torch step fails on DTensor parameters, why, and the DTensor modes they do run (beside ddp, pp)
DTENSORLESS_OPTIMIZERS = {
    "adafactor": "torch.optim.Adafactor's factored row/column norms fail DTensor's sharding propagation",
    "adamw8bit": "torchref's AdamW8bit keeps its 8-bit blocks on row shards of a 1-D mesh only (fsdp)",
}
DTENSOR_MODES = {"adamw8bit": ("fsdp",)}


class CLIError(ValueError):
    """A bad command-line value (the message names the flag, the value and what is accepted)."""


@dataclass(frozen=True)
class Flag:
    name: str
    help: str
    type: Callable | None = None
    default: Any = None
    choices: Sequence[str] | None = None
    action: str | None = None
    metavar: str | None = None
    frameworks: tuple[str, ...] = FRAMEWORKS


FLAGS: tuple[Flag, ...] = (
    Flag("--preset", "model size preset (ignored with --init/--config-json)", str, "tiny", PRESET_NAMES),
    Flag("--config-json", "model config: our ModelConfig fields or a Hugging Face config.json", str, metavar="FILE"),
    Flag(
        "--init",
        "start from this Hugging Face Llama directory (config.json + safetensors; tokenizer.json there is used "
        "for text data) or llama.cpp .gguf file (dequantized to float32; its tokenizer is used for text data)",
        str,
        metavar="HF_DIR|GGUF",
    ),
    Flag(
        "--data",
        "'synthetic', a text file, a folder of text files, or a pre-tokenized .npy",
        str,
        SYNTHETIC,
        metavar="{synthetic|PATH}",
    ),
    Flag(
        "--eval-data",
        "held-out text (a text file, a folder of text files or a pre-tokenized .npy, tokenized as --data) whose "
        "mean token loss and perplexity are logged after the last step and every --eval-every steps",
        str,
        metavar="PATH",
    ),
    Flag("--eval-every", "evaluate --eval-data every N steps too (0: only after the last step)", int, 0),
    Flag(
        "--packing",
        "pack documents into full rows, or one document per row padded to a few bucket lengths",
        str,
        "pack",
        PACKING,
    ),
    Flag("--seq-len", "tokens per row the model sees", int, 128),
    Flag("--batch-size", "rows per optimizer step (split into --grad-accum microbatches)", int, 8),
    Flag("--grad-accum", "microbatches per optimizer step", int, 1),
    Flag("--steps", "optimizer steps in all (a resumed run continues up to this)", int, 100),
    Flag("--lr", "peak learning rate", float, 3e-4),
    Flag("--warmup", "linear warmup steps", int, 0),
    Flag("--schedule", "learning-rate schedule after warmup", str, "cosine", SCHEDULE_NAMES),
    Flag("--optimizer", "optimizer", str, "adamw", OPTIMIZER_NAMES),
    Flag("--weight-decay", "decoupled weight decay (not on norms and biases)", float, 0.1),
    Flag("--clip-grad", "max global gradient norm; 0 turns clipping off", float, 1.0),
    Flag(
        "--precision", "mixed-precision preset (fp16 uses dynamic loss scaling)", str, "fp32", tuple(PRECISION_PRESETS)
    ),
    Flag(
        "--matmul-precision",
        "float32 matmul precision (torch's names; 'highest' = no TF32)",
        str,
        "highest",
        MATMUL_PRECISIONS,
    ),
    Flag("--remat", "activation checkpointing policy per layer", str, "none", REMAT_POLICIES),
    Flag(
        "--loss",
        "dense: the LM head's full [tokens, vocab] logits, then the loss; fused: head + loss in chunks of "
        "--loss-chunk tokens, never the full logits (less memory, the head matmul recomputed in the backward); "
        "auto: fused, except torch's tensor-parallel modes (tp, fsdp+tp, pp+tp), which use dense",
        str,
        "auto",
        ("auto", *LOSSES),
    ),
    Flag("--loss-chunk", "tokens per chunk of --loss fused", int, DEFAULT_CHUNK),
    Flag(
        "--attention",
        "attention backends in order of preference, comma-separated (default: the framework's default order)",
        str,
        metavar="BACKEND[,BACKEND]",
    ),
    Flag("--seed", "seed of the model init, the data order and every other random choice", int, 0),
    Flag(
        "--deterministic",
        "deterministic kernels (torch.use_deterministic_algorithms; XLA deterministic GPU ops)",
        action="store_true",
    ),
    Flag(
        "--checkpoint-dir",
        "where training checkpoints go (and the final Hugging Face export, in final/)",
        str,
        metavar="DIR",
    ),
    Flag("--checkpoint-every", "save a checkpoint every N steps (0: only at the end)", int, 0),
    Flag("--keep-checkpoints", "checkpoints to keep (older ones this run wrote are deleted)", int, 3),
    Flag(
        "--resume",
        "continue the run in --checkpoint-dir from its newest valid checkpoint (the flags that define the run: "
        "--data, --seed, --batch-size, --seq-len, --packing, --optimizer, --precision and the model, must not "
        "change; lr, steps, schedule, logging, checkpoint cadence and the mesh / parallel layout may)",
        action="store_true",
    ),
    Flag(
        "--overwrite",
        "start a new run in a --checkpoint-dir that holds another run's checkpoints, deleting them (only the "
        "files that run recorded)",
        action="store_true",
    ),
    Flag(
        "--max-nonfinite-steps",
        "stop (exit 1, nothing written) after this many consecutive steps with a non-finite loss or gradient norm "
        "(fp16 steps the loss scale skips do not count)",
        int,
        3,
    ),
    Flag(
        "--distributed-timeout",
        "seconds a multi-process run waits for all its processes to arrive before it gives up",
        float,
        300.0,
    ),
    Flag("--log-json", "write one JSON object per step to this file", str, metavar="PATH"),
    Flag("--profile", "write a trace of a few steps here (opens in Perfetto / TensorBoard)", str, metavar="DIR"),
    Flag(
        "--tensorboard",
        "also write the per-step scalars (loss, grad norm, lr, tokens/s, the fp16 loss scale, eval loss and "
        "perplexity) as TensorBoard event files in this directory (needs the tensorboard package)",
        str,
        metavar="DIR",
    ),
    Flag(
        "--no-progress",
        "no progress bar on a terminal, no progress lines when stderr is piped (the end-of-run summary still prints)",
        action="store_true",
    ),
    Flag(
        "--mesh",
        "device mesh over all devices, e.g. data=2,fsdp=2,tensor=2, stage=2,fsdp=4 or (an MoE's expert parallelism) "
        "data=2,expert=4 (jaxattn.sharding)",
        str,
        metavar="AXIS=N[,AXIS=N]",
        frameworks=("jax",),
    ),
    Flag(
        "--microbatches",
        "pipeline micro-batches per step (JAX: with --mesh stage=N, N > 1, GPipe stages, jaxattn.pipeline; torch: "
        "with --parallel pp, torchref.pipeline); each (accumulation) batch must split into them",
        int,
        1,
    ),
    Flag(
        "--pp-schedule",
        "pipeline schedule (torch --parallel pp: default 1f1b, one stage per rank, interleaved: --pp-virtual per "
        "rank; JAX --mesh stage=N: default gpipe, interleaved: the circular schedule, --pp-virtual chunks per stage)",
        str,
        None,
        PP_SCHEDULES,
    ),
    Flag(
        "--pp-virtual",
        "virtual stages per rank / stage of --pp-schedule interleaved (default 2; the layers split into "
        "stages x virtual)",
        int,
        metavar="V",
    ),
    Flag(
        "--pp-gather-once",
        "keep each pipeline stage's FSDP-gathered weights for the whole step instead of regathering them per "
        "micro-batch (JAX: one gather before the stage loop, needs --mesh stage=N with fsdp; torch: FSDP2 "
        "reshard_after_forward=False, needs --parallel pp+fsdp): FSDP traffic for memory",
        action="store_true",
    ),
    Flag(
        "--offload-optimizer",
        "keep the optimizer state in host memory (JAX: pinned_host, needs --mesh, e.g. "
        "--mesh data=1 on one device; torch: FSDP2 CPUOffloadPolicy, needs --parallel fsdp or "
        "fsdp+tp, and moves the sharded parameters and gradients too)",
        action="store_true",
    ),
    Flag(
        "--coordinator",
        "multi-process run: jax.distributed coordinator address (default: $JAX_COORDINATOR_ADDRESS)",
        str,
        metavar="HOST:PORT",
        frameworks=("jax",),
    ),
    Flag(
        "--num-processes", "multi-process run: processes in all (default: $JAX_NUM_PROCESSES)", int, frameworks=("jax",)
    ),
    Flag(
        "--process-id", "multi-process run: this process's index (default: $JAX_PROCESS_ID)", int, frameworks=("jax",)
    ),
    Flag("--compile", "torch.compile the model", action="store_true", frameworks=("torch",)),
    Flag(
        "--parallel",
        "parallelism under torchrun (torchref.parallel; fsdp+tp: tensor parallel over 2 ranks; pp: pipeline stages, "
        "one per rank, torchref.pipeline; pp+fsdp / pp+tp: --pp-stages stages, each sharded over the other ranks; "
        "ep / ep+fsdp: a Mixture-of-Experts model's experts split over the ranks, the rest ddp / fsdp)",
        str,
        None,
        PARALLEL,
        frameworks=("torch",),
    ),
    Flag(
        "--pp-stages",
        "pipeline ranks of --parallel pp+fsdp / pp+tp (default: half the ranks, so 2 shard each stage; pp: all)",
        int,
        frameworks=("torch",),
    ),
    Flag("--num-workers", "DataLoader worker processes", int, 1, frameworks=("torch",)),
)


class OneLineParser(argparse.ArgumentParser):
    """argparse's own errors (unknown flag, not an int, bad choice) raised as a :class:`CLIError`, so a CLI prints
    them as one ``prog: error: ...`` line (argparse prints the usage too). Every CLI of the project parses with it."""

    def error(self, message):
        raise CLIError(message)


def build_parser(framework: str) -> argparse.ArgumentParser:
    """The argparse parser of one trainer (``framework`` = ``"jax"`` or ``"torch"``)."""
    if framework not in FRAMEWORKS:
        raise ValueError(f"framework={framework!r} is not known; use one of {FRAMEWORKS}")
    prog = {"jax": "python -m jaxattn.train", "torch": "python -m torchref.train"}[framework]
    p = OneLineParser(prog=prog, description=f"Train the Llama twin ({framework}); flags shared with the other twin.")
    for f in FLAGS:
        if framework not in f.frameworks:
            continue
        kw: dict[str, Any] = {"help": f.help}
        if f.action:
            kw["action"] = f.action
        else:
            kw.update(type=f.type, default=f.default)
            if f.choices:
                kw["choices"] = f.choices
            if f.metavar:
                kw["metavar"] = f.metavar
        p.add_argument(f.name, **kw)
    return p


def _err(flag: str, value: Any, accepted: str) -> CLIError:
    return CLIError(f"{flag} {value!r}: {accepted}")


def model_config(args: argparse.Namespace) -> ModelConfig:
    """The ModelConfig the flags ask for: ``--init``'s config.json (or GGUF metadata), else ``--config-json``, else
    ``--preset``."""
    if args.init is not None and is_gguf(args.init):
        from .gguf import read_gguf_config  # the metadata alone

        try:
            return read_gguf_config(args.init)
        except (OSError, ValueError, TypeError, KeyError, ImportError) as e:
            raise _err("--init", args.init, f"not a llama.cpp Llama GGUF file we can read ({e})") from None
    if args.init is not None:
        from .hf_format import read_config  # numpy only

        try:
            return ModelConfig.from_hf(read_config(args.init))
        except (OSError, ValueError, TypeError, KeyError) as e:
            raise _err(
                "--init", args.init, f"not a Hugging Face Llama directory with a valid config.json ({e})"
            ) from None
    if args.config_json is not None:
        try:
            with open(args.config_json) as f:
                d = json.load(f)
            return ModelConfig.from_hf(d) if "hidden_size" in d else ModelConfig(**d)
        except (OSError, ValueError, TypeError, KeyError) as e:
            raise _err(
                "--config-json",
                args.config_json,
                f"needs a JSON file of ModelConfig fields or a Hugging Face config.json ({type(e).__name__}: {e})",
            ) from None
    return ModelConfig.preset(args.preset)


MESH_AXES = ("stage", "data", "fsdp", "expert", "tensor")  # jaxattn.sharding.MESH_AXES


def _mesh_axis(spec: str, axis: str) -> int:
    """The size of ``axis`` in a checked ``--mesh`` spec (1 when absent)."""
    for part in spec.split(","):
        name, _, size = part.partition("=")
        if name.strip() == axis:
            return int(size)
    return 1


def _mesh_devices(spec: str) -> int:
    n, seen = 1, set()
    for part in spec.split(","):
        name, _, size = part.partition("=")
        if not name.strip() or not size.strip().isdigit() or int(size) < 1:
            raise _err("--mesh", spec, "expected comma-separated AXIS=N with N >= 1, e.g. data=2,fsdp=2,tensor=2")
        if name.strip() not in MESH_AXES or name.strip() in seen:
            raise _err(
                "--mesh",
                spec,
                f"axis {name.strip()!r} is unknown or repeated; the axes are {', '.join(MESH_AXES)}, each at most once",
            )
        seen.add(name.strip())
        n *= int(size)
    return n


def _check_moe_pipeline(args: argparse.Namespace, framework: str, config: ModelConfig) -> None:
    """An MoE in torch's pipeline stages: ``pp`` and ``pp+fsdp`` (each micro-batch's router sums travel with its
    hidden states); ``pp+tp`` refused here, not at the first step under torchrun (torchref has no tensor-parallel
    plan for stacked experts)."""
    if config.is_moe and framework == "torch" and args.parallel == "pp+tp":
        raise CLIError(
            f"--parallel {args.parallel}: torchref has no tensor-parallel plan for a Mixture-of-Experts (MoE) "
            "model's stacked experts; use --parallel pp or pp+fsdp"
        )


def _check_pipeline_flags(args: argparse.Namespace) -> None:
    """torch's pipeline modes: what the library's schedule serves (no fused loss with a tensor-parallel head, no
    offloaded optimizer), ``--pp-stages`` against the ranks and ``--microbatches`` dividing each rank's
    accumulation block."""
    m = args.microbatches
    if m < 1:
        raise _err("--microbatches", m, "expected an int >= 1")
    _check_schedule(args, "torch", args.parallel in PP_MODES)
    if args.pp_gather_once and args.parallel != "pp+fsdp":
        raise CLIError("--pp-gather-once keeps FSDP-gathered stage weights: it needs --parallel pp+fsdp")
    if args.parallel not in PP_MODES:
        if m > 1:
            raise CLIError(f"--microbatches {m} splits each batch for pipeline stages: it needs --parallel pp")
        if args.pp_stages is not None:
            raise CLIError("--pp-stages sets the pipeline ranks of --parallel pp+fsdp / pp+tp")
        return
    world = int(os.environ.get("WORLD_SIZE", "1"))
    stages = args.pp_stages if args.pp_stages is not None else world if args.parallel == "pp" else world // 2
    if stages < 1 or world % stages or (args.parallel == "pp" and stages != world):
        need = "the rank count" if args.parallel == "pp" else "a divisor of the rank count"
        raise _err("--pp-stages", stages, f"expected {need} {world} for --parallel {args.parallel}")
    if args.parallel != "pp" and world // stages < 2:
        raise CLIError(
            f"--parallel {args.parallel} with --pp-stages {stages} of {world} ranks leaves 1 rank per stage to shard "
            f"it; use --parallel pp or fewer --pp-stages"
        )
    args.pp_stages = stages
    refused = (
        (
            "--loss fused",
            args.loss == "fused" and args.parallel == "pp+tp",
            "the last stage's LM head is split over the vocabulary, and the fused loss is not the "
            "vocabulary-parallel cross-entropy; use --loss dense",
        ),
        ("--offload-optimizer", args.offload_optimizer, "it is FSDP2's (--parallel fsdp)"),
    )
    for flag, bad, why in refused:
        if bad:
            raise CLIError(f"{flag} does not run with --parallel {args.parallel}: {why}")
    dp = world // stages if args.parallel == "pp+fsdp" else 1  # FSDP ranks of a stage: each takes its rows
    k = max(args.grad_accum, 1)  # then accumulation blocks, each split into the micro-batches
    if args.batch_size % (dp * k * m):
        raise CLIError(
            f"--microbatches {m}: --batch-size {args.batch_size} does not split into {m} micro-batches"
            + (f" on each of the {dp} FSDP ranks of a stage" if dp > 1 else "")
            + (f" per --grad-accum block of {args.batch_size // dp // k} rows" if k > 1 else "")
        )
    _check_rounds(args, stages)


def _check_schedule(args: argparse.Namespace, framework: str, pipelined: bool) -> None:
    """``--pp-schedule`` / ``--pp-virtual``: the framework's default schedule filled in (torch 1f1b, JAX gpipe),
    ``args.pp_virtual`` resolved (:func:`virtual_stages`); given without a pipeline, refused naming the flag."""
    given = args.pp_schedule is not None or args.pp_virtual is not None
    if given and not pipelined:
        flag = "--pp-schedule" if args.pp_schedule is not None else "--pp-virtual"
        needs = "--mesh with stage=N, N > 1" if framework == "jax" else "--parallel pp"
        raise CLIError(f"{flag} schedules pipeline stages: it needs {needs}")
    if args.pp_schedule is None:
        args.pp_schedule = "gpipe" if framework == "jax" else "1f1b"
    if framework == "jax" and args.pp_schedule not in JAX_SCHEDULES:
        raise CLIError(
            f"--pp-schedule {args.pp_schedule}: the JAX pipeline runs {' or '.join(JAX_SCHEDULES)} (in one SPMD "
            f"program jax.grad turns the forward loop into the backward one; 1F1B's gain, fewer live activations, "
            f"comes from --remat there)"
        )
    try:
        args.pp_virtual = virtual_stages(args.pp_schedule, args.pp_virtual)
    except ValueError as e:
        raise CLIError(f"--pp-virtual: {e}") from None


def _check_microbatches(args: argparse.Namespace) -> None:
    """``--microbatches``: >= 1; above 1 only with a ``stage`` axis > 1 in ``--mesh``; it divides each
    (accumulation) batch."""
    m = args.microbatches
    if m < 1:
        raise _err("--microbatches", m, "expected an int >= 1")
    stages = 1 if args.mesh is None else _mesh_axis(args.mesh, "stage")
    _check_schedule(args, "jax", stages > 1)
    if args.pp_gather_once and (stages == 1 or _mesh_axis(args.mesh, "fsdp") == 1):
        raise CLIError("--pp-gather-once keeps FSDP-gathered stage weights: it needs --mesh with stage=N and fsdp=M")
    if m > 1 and stages == 1:
        raise CLIError(
            f"--microbatches {m} splits each batch for pipeline stages: it needs --mesh with stage=N, N > 1 "
            f"(e.g. --mesh stage=2,data=4); gradient accumulation is --grad-accum"
        )
    rows = args.batch_size // max(args.grad_accum, 1)
    if rows % m:
        raise CLIError(
            f"--microbatches {m}: each step's batch of {rows} rows (--batch-size {args.batch_size} / --grad-accum "
            f"{args.grad_accum}) does not split into {m} micro-batches"
        )
    _check_rounds(args, stages)


def _check_rounds(args: argparse.Namespace, stages: int) -> None:
    """The interleaved schedule: a micro-batch back from the last stage is due at the first one ``m`` steps after
    it left, so ``--microbatches`` must be at least the stages."""
    if args.pp_virtual > 1 and args.microbatches < stages:
        raise CLIError(
            f"--microbatches {args.microbatches}: --pp-schedule interleaved needs at least as many micro-batches as "
            f"pipeline stages ({stages})"
        )


_PROCESS_ENV = (
    ("coordinator", "JAX_COORDINATOR_ADDRESS"),
    ("num_processes", "JAX_NUM_PROCESSES"),
    ("process_id", "JAX_PROCESS_ID"),
)


def _check_processes(args: argparse.Namespace) -> None:
    """``--coordinator/--num-processes/--process-id`` (each defaulting to its ``JAX_*`` variable): none, or all
    three with a valid id; a multi-process run needs ``--mesh`` (the mesh spans every process's devices). The
    resolved values are written back into ``args``."""
    for attr, env in _PROCESS_ENV:
        if getattr(args, attr) is None and os.environ.get(env):
            value = os.environ[env]
            if attr != "coordinator":
                if not value.strip().isdigit():
                    raise CLIError(f"${env}={value!r}: expected a non-negative integer")
                value = int(value)
            setattr(args, attr, value)
    given = {f"--{a.replace('_', '-')}": getattr(args, a) for a, _ in _PROCESS_ENV}
    if all(v is None for v in given.values()):
        return
    missing = [f for f, v in given.items() if v is None]
    if missing:
        raise CLIError(
            f"a multi-process run needs --coordinator, --num-processes and --process-id (or "
            f"$JAX_COORDINATOR_ADDRESS, $JAX_NUM_PROCESSES, $JAX_PROCESS_ID); missing {', '.join(missing)}"
        )
    host, _, port = args.coordinator.rpartition(":")
    if not host or not port.isdigit():
        raise _err("--coordinator", args.coordinator, "expected HOST:PORT, e.g. 10.0.0.1:1234")
    if args.num_processes < 1:
        raise _err("--num-processes", args.num_processes, "must be an integer >= 1")
    if not 0 <= args.process_id < args.num_processes:
        raise _err("--process-id", args.process_id, f"must be in [0, --num-processes {args.num_processes})")
    if args.num_processes > 1 and args.mesh is None:
        raise CLIError(
            f"--num-processes {args.num_processes}: a multi-process run needs --mesh (one mesh over every "
            f"process's devices, e.g. --mesh data=2,fsdp=2,tensor=2)"
        )


def _check_outputs(args: argparse.Namespace) -> None:
    """Every output path is writable now (not at the first save), and the log never overwrites an input."""
    for flag, path, is_dir in (
        ("--checkpoint-dir", args.checkpoint_dir, True),
        ("--log-json", args.log_json, False),
        ("--profile", args.profile, True),
        ("--tensorboard", args.tensorboard, True),
    ):
        if path is not None:
            try:
                check_writable(path, flag, is_dir=is_dir)
            except ValueError as e:
                raise CLIError(str(e)) from None
    if args.log_json is None:
        return
    log = os.path.realpath(args.log_json)
    inputs = [
        ("--data", args.data),
        ("--eval-data", args.eval_data),
        ("--config-json", args.config_json),
        ("--init", args.init),
    ]
    for flag, path in inputs:
        if path is None or (flag == "--data" and path == SYNTHETIC):
            continue
        real = os.path.realpath(path)
        if log == real or (os.path.isdir(real) and log.startswith(real + os.sep)):
            raise CLIError(
                f"--log-json {args.log_json!r} would overwrite {flag} {path!r} (an input of the run); "
                f"log somewhere else"
            )


def run_flags(args: argparse.Namespace, config: ModelConfig) -> dict:
    """The flags that define a run (``twincore.rundir.RUN_FLAGS``) and the model config, as a checkpoint records
    them."""
    run = {k: getattr(args, k) for k in RUN_FLAGS}
    if run["data"] != SYNTHETIC:
        run["data"] = os.path.abspath(run["data"])
    return {**run, "model_config": config.to_hf()}


def checkpointer_options(args: argparse.Namespace, config: ModelConfig) -> dict:
    """The keyword arguments both trainers give their ``Checkpointer`` (besides the directory and the writer)."""
    return {
        "keep": args.keep_checkpoints,
        "run": run_flags(args, config),
        "resume": args.resume,
        "overwrite": args.overwrite,
    }


def check_args(args: argparse.Namespace, framework: str, attention_backends: Sequence[str] = ()) -> ModelConfig:
    """Check every value and combination, concern by concern; returns the model config. Raises :class:`CLIError`.
    ``--attention`` is parsed here, once: ``args.attention`` becomes a ``twincore.attention.AttentionChoice``."""
    _check_numbers(args)
    if args.attention is not None:
        try:
            args.attention = AttentionChoice.parse(args.attention, framework, attention_backends, "--attention")
        except ValueError as e:
            raise CLIError(str(e)) from None
    _check_inputs(args)
    _check_checkpointing(args)
    _check_output_paths(args)
    _check_outputs(args)
    if framework == "jax":
        _check_jax(args)
    if args.loss == "auto":  # the default, chosen by the measurements in benchmarks/NOTES.md (fused loss)
        tp_head = framework == "torch" and args.parallel in ("tp", "fsdp+tp", "pp+tp")
        args.loss = "dense" if tp_head else "fused"
    if framework == "torch":
        _check_torch(args)
    return _check_model(args, framework)


def _check_numbers(args: argparse.Namespace) -> None:
    """Counts, rates and timeouts in range."""

    def positive(flag, v, zero_ok=False):
        if v < 0 or (v == 0 and not zero_ok):
            raise _err(flag, v, f"must be an integer >= {0 if zero_ok else 1}")

    for flag in ("--seq-len", "--batch-size", "--grad-accum", "--steps", "--keep-checkpoints", "--loss-chunk"):
        positive(flag, getattr(args, flag[2:].replace("-", "_")))
    for flag in ("--warmup", "--checkpoint-every", "--seed"):
        positive(flag, getattr(args, flag[2:].replace("-", "_")), zero_ok=True)
    if args.seed >= 2**32:
        raise _err("--seed", args.seed, "must be in [0, 2**32)")
    if args.batch_size % args.grad_accum:
        raise CLIError(
            f"--grad-accum {args.grad_accum} must divide --batch-size {args.batch_size} (the batch is "
            f"split into --grad-accum microbatches of equal size)"
        )
    if args.warmup > args.steps:
        raise CLIError(f"--warmup {args.warmup} must not exceed --steps {args.steps}")
    if not (math.isfinite(args.lr) and args.lr > 0):
        raise _err("--lr", args.lr, "must be a finite float > 0")
    if not (math.isfinite(args.weight_decay) and args.weight_decay >= 0):
        raise _err("--weight-decay", args.weight_decay, "must be a finite float >= 0")
    if not (math.isfinite(args.clip_grad) and args.clip_grad >= 0):
        raise _err("--clip-grad", args.clip_grad, "must be a finite float >= 0 (0 = no clipping)")
    if args.max_nonfinite_steps < 1:
        raise _err("--max-nonfinite-steps", args.max_nonfinite_steps, "must be an integer >= 1")
    if not (math.isfinite(args.distributed_timeout) and args.distributed_timeout > 0):
        raise _err("--distributed-timeout", args.distributed_timeout, "must be a finite number of seconds > 0")


def _check_inputs(args: argparse.Namespace) -> None:
    """--data, --eval-data, --init, --config-json exist and go together."""
    if args.data != SYNTHETIC and not os.path.exists(args.data):
        raise _err(
            "--data",
            args.data,
            "no such file or folder; use 'synthetic', a text file, a folder of text files or a pre-tokenized .npy",
        )
    if args.eval_data is not None and (args.eval_data == SYNTHETIC or not os.path.exists(args.eval_data)):
        raise _err(
            "--eval-data", args.eval_data, "no such file or folder; use a text file, a folder of text files or a .npy"
        )
    if args.eval_every < 0:
        raise _err("--eval-every", args.eval_every, "must be an integer >= 0")
    if args.eval_every and args.eval_data is None:
        raise CLIError(f"--eval-every {args.eval_every} needs --eval-data PATH (the text to evaluate)")
    if args.init is not None and args.config_json is not None:
        raise CLIError(
            f"--init {args.init!r} and --config-json {args.config_json!r}: give one of them (--init "
            f"carries its own config.json)"
        )
    if args.init is not None and not (os.path.isdir(args.init) or is_gguf(args.init)):
        raise _err(
            "--init", args.init, "no such directory or .gguf file; expected a Hugging Face Llama directory or a GGUF"
        )
    if args.config_json is not None and not os.path.isfile(args.config_json):
        raise _err("--config-json", args.config_json, "no such file")


def _check_checkpointing(args: argparse.Namespace) -> None:
    """--checkpoint-dir and the flags that need it."""
    if (args.resume or args.checkpoint_every or args.overwrite) and args.checkpoint_dir is None:
        flag = (
            "--resume"
            if args.resume
            else "--overwrite"
            if args.overwrite
            else f"--checkpoint-every {args.checkpoint_every}"
        )
        raise CLIError(f"{flag} needs --checkpoint-dir DIR")
    if args.resume and args.overwrite:
        raise CLIError("--resume and --overwrite: give one of them (continue the run, or replace it)")
    if args.resume and not os.path.isdir(args.checkpoint_dir):
        raise _err("--checkpoint-dir", args.checkpoint_dir, "no such directory to --resume from")


def _check_output_paths(args: argparse.Namespace) -> None:
    """Output folders are folders, the log a file, the TensorBoard writer installed."""
    for flag, path in (
        ("--checkpoint-dir", args.checkpoint_dir),
        ("--profile", args.profile),
        ("--tensorboard", args.tensorboard),
    ):
        if path is not None and os.path.exists(path) and not os.path.isdir(path):
            raise _err(flag, path, "exists and is not a directory")
    if args.tensorboard is not None:  # the optional writer package, before any output path is probed
        try:
            tensorboard_writer_class()
        except ImportError as e:
            raise CLIError(str(e)) from None
    if args.log_json is not None and os.path.isdir(args.log_json):
        raise _err("--log-json", args.log_json, "is a directory; expected a file path")


def _check_jax(args: argparse.Namespace) -> None:
    """JAX's own flags: --mesh's syntax, micro-batches, processes, optimizer offload."""
    if args.mesh is not None:
        _mesh_devices(args.mesh)  # syntax here; device count, heads and batch against the mesh in jaxattn.train
    _check_microbatches(args)
    _check_processes(args)
    if args.offload_optimizer and args.mesh is None:
        raise CLIError(
            "--offload-optimizer needs --mesh (the sharded step places the optimizer state; on one "
            "device use --mesh data=1)"
        )


def _check_torch(args: argparse.Namespace) -> None:
    """torch's own flags: --parallel against torchrun, pipelines, the loss with a split head, workers, offload."""
    _check_pipeline_flags(args)
    runs = (None, "ddp", "pp", *DTENSOR_MODES.get(args.optimizer, ()))
    if args.optimizer in DTENSORLESS_OPTIMIZERS and args.parallel not in runs:
        raise CLIError(
            f"--optimizer {args.optimizer} does not run with --parallel {args.parallel} in torchref: the parameters "
            f"are DTensors there, and {DTENSORLESS_OPTIMIZERS[args.optimizer]}; use --parallel "
            f"{' or '.join(m for m in runs if m)}, or --optimizer adamw / adamw_fused (the JAX CLI runs "
            f"{args.optimizer} on any --mesh)"
        )
    if args.loss == "fused" and args.parallel in ("tp", "fsdp+tp"):
        raise CLIError(
            f"--loss fused does not run with --parallel {args.parallel} in torchref (the LM head is split over "
            f"the vocabulary: it would need a vocabulary-parallel cross-entropy); use --loss dense there"
        )
    if args.num_workers < 0:
        raise _err("--num-workers", args.num_workers, "must be an integer >= 0")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.offload_optimizer and args.parallel not in ("fsdp", "fsdp+tp"):
        raise CLIError(
            f"--offload-optimizer needs --parallel fsdp or fsdp+tp under torchrun (FSDP2's "
            f"CPUOffloadPolicy); got --parallel {args.parallel}"
        )
    if args.parallel is not None and "WORLD_SIZE" not in os.environ:
        raise CLIError(
            f"--parallel {args.parallel} runs under torchrun (torchrun --nproc-per-node N -m "
            f"torchref.train --parallel {args.parallel} ...); without it there is one process and "
            f"nothing to parallelize: drop the flag"
        )
    if world > 1 and args.parallel is None:
        raise CLIError(f"running under torchrun with WORLD_SIZE={world} needs --parallel {{{','.join(PARALLEL)}}}")


def _check_model(args: argparse.Namespace, framework: str) -> ModelConfig:
    """The model config the flags give, and the sequence length it allows."""
    config = model_config(args)
    _check_moe_pipeline(args, framework, config)
    if args.seq_len > config.max_seq_len:
        raise _err("--seq-len", args.seq_len, f"exceeds the model's max_seq_len={config.max_seq_len}")
    if args.packing == "bucket" and args.seq_len < 2:
        raise _err("--seq-len", args.seq_len, "must be >= 2 with --packing bucket")
    return config


def check_tokenizer_fits(args: argparse.Namespace, config: ModelConfig, tokenizer) -> None:
    """The tokenizer's ids fit the model's vocabulary where they matter: ``--init``'s own tokenizer always (the
    export carries it), the byte tokenizer (no ``--init`` tokenizer) only when it encodes text ``--data`` /
    ``--eval-data``. The error names the flags actually given: the one the vocabulary came from and the text."""
    from .tokenizer import ByteTokenizer

    n, vocab = tokenizer.vocab_size, config.vocab_size
    if n <= vocab:
        return
    if not isinstance(tokenizer, ByteTokenizer):
        raise CLIError(f"--init {args.init!r}: its tokenizer has {n} ids but the model's vocab_size is {vocab}")
    text = [
        f"{flag} {src!r}"
        for flag, src in (("--data", args.data), ("--eval-data", args.eval_data))
        if src is not None and src != SYNTHETIC and not (os.path.isfile(src) and src.endswith(".npy"))
    ]
    if not text:
        return  # synthetic / pre-tokenized ids: no tokenizer encodes anything (ids are checked against vocab_size)
    source = (
        f"--init {args.init!r}"
        if args.init is not None
        else f"--config-json {args.config_json!r}"
        if args.config_json is not None
        else f"--preset {args.preset}"
    )
    raise CLIError(
        f"{source}: vocab_size {vocab} < the {n} ids of the byte tokenizer that encodes {' and '.join(text)} (no "
        f"--init tokenizer.json); give a vocab_size >= {n}, an --init with its tokenizer, or pre-tokenized .npy data"
    )


def parse_args(
    argv: Sequence[str] | None, framework: str, attention_backends: Sequence[str] = ()
) -> tuple[argparse.Namespace, ModelConfig]:
    """Parse and check ``argv``: ``(args, model_config)``; a bad value raises :class:`CLIError`."""
    args = build_parser(framework).parse_args(argv)
    return args, check_args(args, framework, attention_backends)


def cli_main(
    prog: str,
    prepare: Callable[[Sequence[str] | None], Any],
    train: Callable[[Any], Any],
    argv: Sequence[str] | None = None,
) -> int:
    """Both trainers' ``main``: a bad flag (``CLIError`` / ``ValueError``, raised before anything compiles) or a
    checkpoint directory in use (``RunDirError``, raised when the trainer is built: its lock comes first) prints
    ``prog: error: ...`` and returns 2; a run that cannot go on (``TrainingError``) prints the same and returns 1;
    otherwise 0. Each in one write (:func:`print_line`): torchrun's ranks share one stderr."""
    try:
        run = prepare(argv)
    except (CLIError, ValueError) as e:
        print_line(f"{prog}: error: {e}")
        return 2
    try:
        train(run)
    except RunDirError as e:  # a lock given back and taken again by locked() (library use)
        print_line(f"{prog}: error: {e}")
        return 2
    except TrainingError as e:
        print_line(f"{prog}: error: {e}")
        return 1
    return 0


def print_line(text: str) -> None:
    """``text`` and its newline on stderr in one write: processes sharing a stderr (torchrun's ranks, JAX's
    processes) would otherwise glue their lines, as ``print`` writes the text and the newline in two calls to
    Python's unbuffered stderr."""
    sys.stderr.write(f"{text}\n")
    sys.stderr.flush()
