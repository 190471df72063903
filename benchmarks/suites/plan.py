"""Sharding plans checked by the compiler: the ``jaxattn.sharding`` train step compiled deviceless for 8 H100s,
per-device memory and the collectives read out of the compiled HLO ("compiled for H100, not run").

    records = run(quick=True)                               # python -m benchmarks run --suite plan

The committed record (the README's "Scaling plans" table) is ``benchmarks/results/h100-plan/plan.json``, refreshed
with ``python -m benchmarks run --suite plan --out benchmarks/results/h100-plan``.
"""

from __future__ import annotations

import math
import re
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxattn import gpu_target, tpu_target

from ..report.compile_tables import LABEL
from ..tools.deviceless import target_config
from ..tools.programs import memory_stats

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
PLANS = ("fsdp=8", "data=2,fsdp=2,tensor=2")  # --quick: the tiny preset, these two meshes
# (preset, mesh, remat, loss) compiled outside --quick: pure data parallel, ZeRO-3, 3-D and FSDP x TP for both
# presets with the dense loss, the 1b ZeRO-3 step with the cheaper selective policy, and the fused loss
# (--loss fused) on the 8b data=8 / fsdp=8 and 1b fsdp=8 steps to read its memory beside the dense rows
_MESHES = ("data=8", "fsdp=8", "data=2,fsdp=2,tensor=2", "fsdp=4,tensor=2")
GRID = (
    tuple(("1b", m, "full", "dense") for m in _MESHES)
    + (("1b", "fsdp=8", "save_qkv_attn", "dense"), ("1b", "fsdp=8", "full", "fused"))
    + tuple(("8b", m, "full", "dense") for m in _MESHES)
    + (("8b", "data=8", "full", "fused"), ("8b", "fsdp=8", "full", "fused"))
    + (("qwen2.5-0.5b", "fsdp=8", "full", "dense"),)  # AdamW beside OPTIMIZER_GRID's 8-bit row
)
# Pods (issue: TPU without a TPU): the 8b and 70b steps at one sequence of 4096 per device on 64 H100s (8 hosts),
# a 64-chip v5p slice and 256-chip v5e / v6e slices, ZeRO-3 over everything, FSDP x tensor parallel, and (64) a
# data x FSDP hybrid: (target, topology, preset, mesh)
POD_GRID = tuple(
    (t, topo, preset, mesh)
    for t, topo, meshes in (
        ("h100", "1x8x8", ("fsdp=64", "fsdp=16,tensor=4", "data=8,fsdp=8")),
        ("v5p", "4x4x4", ("fsdp=64", "fsdp=16,tensor=4", "data=8,fsdp=8")),
        ("v5e", "16x16", ("fsdp=256", "fsdp=64,tensor=4")),
        ("v6e", "16x16", ("fsdp=256", "fsdp=64,tensor=4")),
    )
    for preset in ("8b", "70b")
    for mesh in meshes
)
# Pipeline stages (issue: model parallel): (topology, preset, mesh, loss, microbatches, virtual) on H100s at one
# sequence of 4096 per device — the 8b stage=8 step over 1..8 micro-batches (the bubble / memory plot), the
# circular schedule, the fused loss (the head runs outside the stages), stage x FSDP / tensor on 8 GPUs, the 70b
# shape, and 64 GPUs with the stages across the 8 hosts and FSDP or tensor parallel inside each; the last field:
# each stage's weights gathered once per step (``gather_once``) instead of per trip
STAGE_GRID = (
    tuple(("1x1x8", "8b", "stage=8", "dense", m, 1, False) for m in (1, 2, 4, 8))
    + (("1x1x8", "8b", "stage=8", "dense", 8, 2, False), ("1x1x8", "8b", "stage=8", "fused", 8, 1, False))
    + tuple(("1x1x8", "8b", "stage=4,fsdp=2", "dense", m, 1, False) for m in (1, 2, 4))
    + (
        ("1x1x8", "8b", "stage=4,fsdp=2", "dense", 4, 1, True),
        ("1x1x8", "8b", "stage=2,fsdp=2,tensor=2", "dense", 4, 1, False),
    )
    + tuple(("1x1x8", "70b", mesh, "dense", m, 1, False) for mesh, m in (("stage=8", 8), ("stage=4,fsdp=2", 4)))
    + (("1x1x8", "70b", "stage=2,fsdp=2,tensor=2", "dense", 4, 1, False),)
    + tuple(
        ("1x8x8", p, mesh, "dense", 8, 1, False)
        for p in ("8b", "70b")
        for mesh in ("stage=8,fsdp=8", "stage=8,tensor=8")
    )
    + (("1x8x8", "8b", "stage=8,fsdp=8", "dense", 8, 1, True), ("1x8x8", "70b", "stage=8,fsdp=8", "dense", 8, 2, False))
)
# Mixture of Experts (issue: MoE): (topology, preset, mesh) at one sequence of 4096 per GPU — Mixtral-8x7B and
# Qwen3-30B-A3B on 8 H100s with their experts over FSDP (fsdp=8) or split by expert (expert=8, and Mixtral's
# fsdp=2 x expert=4), and Mixtral on 64 H100s (8 hosts) ZeRO-3 over all or expert=8 x fsdp=8
MOE_GRID = (
    tuple(("1x1x8", p, m) for p in ("mixtral-8x7b", "qwen3-30b-a3b") for m in ("fsdp=8", "expert=8"))
    + (("1x1x8", "mixtral-8x7b", "fsdp=2,expert=4"),)
    + tuple(("1x8x8", "mixtral-8x7b", m) for m in ("fsdp=64", "fsdp=8,expert=8"))
)
GPU_MEMORY = {"h100": 80 * 10**9, "h200": 141 * 10**9}  # bytes per GPU (the "80 GB" of the name)
# 8-bit AdamW (its moments split as their params are): (topology, preset, mesh, microbatches) compiled with
# adamw8bit beside the same step's AdamW row of the grids above — ZeRO-3, 3-D and FSDP x TP, pipeline stages, a
# model whose dim is not a whole number of 256-element blocks (Qwen2.5-0.5B's 896: its blocks kept flat), and 64
# GPUs (a device's 64 columns of a row, less than a block)
OPTIMIZER_GRID = (
    ("1x1x8", "1b", "fsdp=8", 1),
    ("1x1x8", "1b", "data=2,fsdp=2,tensor=2", 1),
    ("1x1x8", "8b", "fsdp=8", 1),
    ("1x1x8", "8b", "fsdp=4,tensor=2", 1),
    ("1x1x8", "8b", "stage=4,fsdp=2", 4),
    ("1x1x8", "qwen2.5-0.5b", "fsdp=8", 1),
    ("1x8x8", "8b", "fsdp=64", 1),
)
# (target, topology, preset, mesh, remat, loss, batch, seq, microbatches, virtual, gather_once, optimizer)
FULL_GRID = (
    tuple(("h100", "1x1x8", p, m, r, loss, 8, 4096, 1, 1, False, "adamw") for p, m, r, loss in GRID)
    + tuple(
        (t, topo, p, m, "full", "dense", math.prod(map(int, topo.split("x"))), 4096, 1, 1, False, "adamw")
        for t, topo, p, m in POD_GRID
    )
    + tuple(
        ("h100", topo, p, mesh, "full", loss, math.prod(map(int, topo.split("x"))), 4096, mb, v, go, "adamw")
        for topo, p, mesh, loss, mb, v, go in STAGE_GRID
    )
    + tuple(
        ("h100", topo, p, mesh, "full", "dense", math.prod(map(int, topo.split("x"))), 4096, 1, 1, False, "adamw")
        for topo, p, mesh in MOE_GRID
    )
    + tuple(
        ("h100", topo, p, mesh, "full", "dense", math.prod(map(int, topo.split("x"))), 4096, mb, 1, False, "adamw8bit")
        for topo, p, mesh, mb in OPTIMIZER_GRID
    )
)
_BYTES = {"bf16": 2, "f16": 2, "f32": 4, "s32": 4, "u32": 4, "pred": 1, "s8": 1, "u8": 1, "f64": 8, "s64": 8}
_OP = re.compile(r"=\s*(.*?)\s(" + "|".join(COLLECTIVES) + r")(-start)?\(")
_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*->.*\{\s*$")  # "%name (params) -> type {"
_SHAPE = re.compile(r"\b(bf16|f16|f32|s32|u32|pred|s8|u8|f64|s64)\[([0-9,]*)\]")


def _nbytes(dtype: str, dims: str) -> int:
    n = _BYTES[dtype]
    for d in filter(None, dims.split(",")):
        n *= int(d)
    return n


def _group_size(line: str) -> int:
    """Devices in one replica group of a collective's HLO line (``{{0,1},{2,3}}``, ``[4,2]<=[8]`` or
    ``mesh['axis_0'=8,...] {'axis_0'}``); 1 when there is none."""
    m = re.search(r"replica_groups=\{\{([0-9,]*)\}", line)
    if m:
        return len(m.group(1).split(","))
    m = re.search(r"replica_groups=\[([0-9,]+)\]<=", line)
    if m:
        return int(m.group(1).split(",")[-1])
    m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", line)
    if m:
        sizes = dict((k.strip("' "), int(v)) for k, v in (kv.split("=") for kv in m.group(1).split(",")))
        return int(np.prod([sizes[a.strip("' ")] for a in m.group(2).split(",") if a.strip()]))
    return 1


def _volume(kind: str, start: bool, shapes: list, line: str) -> int:
    """Bytes of the FULL buffer a collective works on: the gathered result of an all-gather, the input of a
    reduce-scatter (its result is one device's 1/group part), the buffer of an all-reduce / all-to-all /
    permute. An async ``-start`` result is ``((inputs...), (outputs...), ...)``: its first half are the inputs."""
    sizes = [_nbytes(*sh) for sh in shapes]
    if start and kind in ("all-gather", "reduce-scatter"):
        half = len(sizes) // 2
        return sum(sizes[half : 2 * half]) if kind == "all-gather" else sum(sizes[:half])
    if start and kind == "collective-permute":
        return sizes[0]
    if start and kind == "all-to-all":  # ((inputs...), (outputs...)): one buffer's worth
        return sum(sizes[: max(1, len(sizes) // 2)])
    if start and kind == "all-reduce" and re.search(r"=\s*\(\(", line):
        # jaxlib >= 0.11 writes ((inputs...), outputs...) (the outputs alias the inputs); older ones the outputs only
        return sum(sizes[: len(sizes) // 2])
    if kind == "reduce-scatter":
        return sum(sizes) * _group_size(line)
    return sum(sizes)


def collectives(hlo: str, unknown_trips: int = 1) -> dict:
    """``{kind: {"ops", "bytes", "ops_in_loop", "bytes_in_loop", "bytes_per_step", "bytes_per_step_in_loops"}}``
    from compiled HLO text:
    ``bytes`` is each op's full-buffer size (:func:`_volume`), counted once per appearance in the text (``-done``
    halves of async pairs are skipped); ``bytes_per_step`` counts each op once per run of the computation holding
    it: a while body runs its loop's ``known_trip_count`` times (``unknown_trips`` when XLA gives none) times the
    runs of the computation holding the loop (the layer scan, a chunked loss's scan, a scan inside a scan), and a
    computation a fusion or call runs (``calls=``; the TPU compiler puts collectives there) as often as its caller."""
    out = {k: {"ops": 0, "bytes": 0, "ops_in_loop": 0, "bytes_in_loop": 0} for k in COLLECTIVES}
    loops: dict[str, list] = {}  # computation -> [(body, trips)] of the while ops in it
    called: dict[str, list] = {}  # computation -> the computations its fusions / calls run (``calls=%X``)
    ops: dict[str, list] = {}  # computation -> [(kind, bytes)]
    comp = ""
    for line in hlo.splitlines():
        if line and not line.startswith(" "):  # a computation header, or the tail of an instruction split over lines
            header = _HEADER.match(line)
            if header:
                comp = header.group(1)
            continue
        body = re.search(r"\bwhile\(.*body=%([\w.\-]+)", line)
        if body:
            trips = re.search(r'known_trip_count"?:\{"n":"(\d+)"', line)
            loops.setdefault(comp, []).append((body.group(1), int(trips.group(1)) if trips else unknown_trips))
        for callee in re.findall(r"\bcalls=%([\w.\-]+)", line):
            called.setdefault(comp, []).append(callee)
        m = _OP.search(line)
        shapes = _SHAPE.findall(m.group(1)) if m else []
        if shapes:
            # the TPU compiler writes a reduce-scatter as a fusion calling "all-reduce-scatter": an all-reduce of the
            # full buffer, then each device's slice
            kind = "reduce-scatter" if comp.startswith("all-reduce-scatter") else m.group(2)
            # one collective = one channel id AND one source op: the GPU compiler reuses a channel id in another
            # computation (a forward loop's collective-permute and its transpose's both had channel_id=1)
            channel = re.search(r"\bchannel_id=(\d+)", line)
            source = re.search(r'op_name="([^"]*)"', line)
            key = channel and (int(channel.group(1)), source and source.group(1))
            ops.setdefault(comp, []).append((kind, _volume(m.group(2), bool(m.group(3)), shapes, line), key))
    runs: dict[str, int] = {}
    looped: set = set()  # computations run inside a while loop (directly or through a fusion / call)

    def visit(c: str, n: int, in_loop: bool) -> None:
        runs[c] = runs.get(c, 0) + n
        if in_loop:
            looped.add(c)
        for b, trips in loops.get(c, ()):
            visit(b, n * trips, True)
        for callee in called.get(c, ()):
            visit(callee, n, in_loop)

    reached = {b for pairs in loops.values() for b, _ in pairs} | {x for xs in called.values() for x in xs}
    for c in set(ops) | set(loops) | set(called):
        if c not in reached:  # the entry and any computation nothing else runs: once
            visit(c, 1, False)
    # (channel id, op) -> the computation it was first seen in: the TPU's async collective fusions repeat one collective
    # in a start and a done computation; inside ONE computation every instruction counts (the GPU compiler gives an
    # MoE layer's all-to-alls one channel id and one op name: its forward's dispatch and return, its counts)
    seen: dict = {}
    for c, items in ops.items():
        for kind, nbytes, channel in items:
            if channel is not None and seen.setdefault(channel, c) != c:
                continue
            rec = out[kind]
            rec["ops"] += 1
            rec["bytes"] += nbytes
            if c in looped:
                rec["ops_in_loop"] += 1
                rec["bytes_in_loop"] += nbytes
            rec["bytes_per_step"] = rec.get("bytes_per_step", 0) + runs.get(c, 1) * nbytes
            if c in looped:
                rec["bytes_per_step_in_loops"] = rec.get("bytes_per_step_in_loops", 0) + runs.get(c, 1) * nbytes
    for rec in out.values():
        rec.setdefault("bytes_per_step", 0)
        rec.setdefault("bytes_per_step_in_loops", 0)
    return out


def compile_plan(
    devs,
    spec: str,
    preset: str = "1b",
    batch: int = 8,
    seq: int = 4096,
    remat: str = "full",
    loss: str = "dense",
    target: str = "h100",
    topology: str = "1x1x8",
    microbatches: int = 1,
    virtual: int = 1,
    gather_once: bool = False,
    optimizer: str = "adamw",
    overrides: dict | None = None,
):
    """Compile the bf16 train step of ``preset`` (its fields changed by ``overrides``; with ``loss``; AdamW, or
    ``optimizer`` by ``jaxattn.optim``'s name) sharded by ``spec`` for ``devs`` (deviceless GPUs: flash attention,
    ``gpu_target.compile``; TPU chips: splash, ``tpu_target.compile``); returns a record. A ``stage`` axis runs the
    layers as pipeline stages over ``microbatches`` (``jaxattn.pipeline``; ``virtual`` > 1: the circular
    schedule): the record adds the analytic bubble and the one read off the compiled program, and the stage
    hand-off bytes expected beside the compiled ones (:func:`pipeline_bubble`)."""
    import optax
    from flax import nnx

    from jaxattn import optim, sharding
    from jaxattn import remat as remat_mod
    from jaxattn.attention import attention_backend
    from jaxattn.config import ModelConfig
    from jaxattn.model import Llama
    from jaxattn.train_step import TrainState, make_train_step

    cfg = ModelConfig.preset(preset, **(overrides or {}))
    mesh = sharding.make_mesh(spec, devices=devs)
    sharding.check_config(cfg, mesh)
    sharding.check_batch_size(batch, mesh)
    sharding.check_stages(cfg, mesh, batch, microbatches, virtual)
    tx = optax.adamw(1e-4) if optimizer == "adamw" else optim.build(optimizer, 1e-4)

    def build():
        model = Llama(cfg, rngs=nnx.Rngs(0))
        remat_mod.apply(model, remat)
        return TrainState.create(model, tx, policy="bf16")

    model = nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0)))
    remat_mod.apply(model, remat)
    graphdef = nnx.split(model, nnx.Param, ...)[0]
    state = jax.eval_shape(lambda: build()[1])
    state_sh = sharding.state_shardings(state, mesh)
    batch_sh = sharding.batch_sharding(mesh)
    args = (
        jax.tree.map(
            lambda s, sub: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), sub),
            state_sh,
            state,
        ),
        {"tokens": jax.ShapeDtypeStruct((batch, seq + 1), jnp.int32, sharding=batch_sh)},
    )
    plan = sharding.TrainSharding(
        mesh, state_sh, batch_sh, microbatches=microbatches, virtual=virtual, gather_once=gather_once
    )
    step = make_train_step(graphdef, tx, policy="bf16", sharding=plan, loss=loss)
    t0 = time.perf_counter()
    tpu = devs[0].platform == "tpu"
    attention, compile_fn = ("splash", tpu_target.compile) if tpu else ("flash", gpu_target.compile)
    with attention_backend(attention), plan.tracing():  # as the step traces itself
        _, compiled = compile_fn(None, *args, jitted=step.jitted)
    text = compiled.as_text()
    stages = mesh.shape.get("stage", 1)
    mem, coll = memory_stats(compiled), collectives(text, unknown_trips=cfg.n_layers)
    pipe = {}
    if stages > 1:
        pipe = pipeline_bubble(text, stages, microbatches, virtual)
        # each trip hands one micro-batch's hidden states [rows per data device, seq, dim] (bf16) on, forward, and
        # their cotangents back in the backward: the stage loop's collective-permute bytes should be exactly these
        rows = batch // microbatches // (mesh.shape.get("data", 1) * mesh.shape.get("fsdp", 1))
        pipe["handoff_bytes_expected"] = 2 * (virtual * microbatches + stages - 1) * rows * seq * cfg.dim * 2
        pipe["handoff_bytes_compiled"] = coll["collective-permute"]["bytes_per_step_in_loops"]
    summary = f"peak {mem['peak'] / 2**30:.2f} GiB/device; " + ", ".join(
        f"{k} {v['ops']} ops ({v['ops_in_loop']} in loops) {v['bytes_per_step'] / 2**30:.2f} GiB/step"
        for k, v in coll.items()
        if v["ops"]
    )
    moe = moe_exchange(cfg, mesh, batch, seq, remat, coll) if cfg.is_moe else {}
    if moe:
        summary += f"; all-to-all {moe['all_to_all_bytes_expected'] / 2**30:.2f} GiB/step expected"
    if pipe:
        b = pipe["bubble_compiled"]
        summary += (
            f"; bubble {'not found' if b is None else f'{b:.3f}'} compiled, {pipe['bubble_analytic']:.3f} analytic"
        )
    return dict(
        framework="jax",
        impl="sharding-plan",
        mesh=spec,
        preset=preset,
        kind="train_step",
        batch=batch,
        seq=seq,
        precision="bf16",
        remat=remat,
        loss=loss,
        optimizer=optimizer,
        attention=attention,
        devices=len(devs),
        target=target,
        topology=topology,
        device_memory_bytes=tpu_target.CHIPS[target].hbm_bytes if tpu else GPU_MEMORY[target],
        label=LABEL.format(target=target if tpu else target.upper()),
        summary=summary,
        measured={
            "compile_s": round(time.perf_counter() - t0, 1),
            "per_device_memory": mem,
            "collectives": coll,
            "n_layers": cfg.n_layers,
            **({"pipeline": pipe} if pipe else {}),
            **({"moe": moe} if moe else {}),
        },
        **({} if stages == 1 else {"microbatches": microbatches, "schedule": _schedule(virtual, gather_once)}),
    )


def moe_exchange(cfg, mesh, batch: int, seq: int, remat: str, coll: dict) -> dict:
    """An MoE step's expected all-to-all bytes (``jaxattn.moe``'s dropless exchange over the ``expert`` axis, n
    devices): each layer's forward sends a ``[n, R, dim]`` bf16 block out and back, ``R = T * min(k, E / n)`` rows
    for the ``T`` tokens a device holds (equal-sized blocks: the most one device can receive), once more for a
    remat recompute, and twice transposed in the backward; beside them the ragged minimum (``T * k`` rows each
    way, what ``ragged_all_to_all`` would send) and the compiled bytes (which add the few per-expert counts)."""
    n = mesh.shape.get("expert", 1)
    if n == 1:
        return {"expert_shards": 1, "all_to_all_bytes_expected": 0, "all_to_all_bytes_compiled": 0}
    t = batch * seq // (mesh.shape.get("data", 1) * mesh.shape.get("fsdp", 1) * n)
    k, per_device = cfg.experts_per_token, cfg.n_experts // n
    passes = 2 * (3 if remat != "none" else 2)  # out and back, per forward / recompute / backward
    block = n * t * min(k, per_device) * cfg.dim * 2
    return {
        "expert_shards": n,
        "tokens_per_device": t,
        "all_to_all_bytes_expected": cfg.n_layers * passes * block,
        "all_to_all_bytes_ragged": cfg.n_layers * passes * t * k * cfg.dim * 2,
        "all_to_all_bytes_compiled": coll["all-to-all"]["bytes_per_step"],
    }


def _schedule(virtual: int, gather_once: bool = False) -> str:
    return ("gpipe" if virtual == 1 else f"circular v={virtual}") + (", gather once" if gather_once else "")


def pipeline_bubble(hlo: str, stages: int, microbatches: int, virtual: int = 1) -> dict:
    """The schedule as compiled: the stage loop is the while loop of ``v m + p - 1`` trips (XLA's
    ``known_trip_count``) in which each stage works on a real micro-batch chunk ``v m`` times, so the idle fraction
    is ``(trips - v m) / trips``; beside it the analytic ``(p - 1) / (v m + p - 1)`` (GPipe §2.2; circular:
    interleaved 1F1B's). ``found`` False when no loop of that trip count is in the program (the schedule was
    compiled some other way)."""
    from jaxattn.pipeline import bubble_fraction

    work = virtual * microbatches
    want = work + stages - 1
    trips = sorted({int(n) for n in re.findall(r"known_trip_count[^0-9]*(\d+)", hlo)})
    found = want in trips
    return {
        "stages": stages,
        "microbatches": microbatches,
        "virtual": virtual,
        "loop_trips": want if found else None,
        "while_trip_counts": trips,
        "found": found,
        "bubble_compiled": (want - work) / want if found else None,
        "bubble_analytic": bubble_fraction(stages, microbatches, virtual),
    }


def _pod_devices(target: str, topology: str):
    """The devices of a deviceless slice: ``h100`` GPUs (``slices x hosts x devices``) or TPU chips."""
    if target in tpu_target.CHIPS:
        return tpu_target.devices(target, topology)
    return gpu_target.devices(target_config(target), topology)


def _unavailable(target: str) -> str | None:
    return tpu_target.unavailable_reason() if target in tpu_target.CHIPS else gpu_target.unavailable_reason()


def run(quick: bool = False) -> list:
    """The plan suite: :data:`GRID` on 8 H100s at seq 4096, batch 8, then :data:`POD_GRID`, :data:`STAGE_GRID` and
    :data:`MOE_GRID` (quick: ``tiny`` at seq 128 on :data:`PLANS`, 8 H100s)."""
    grid = (
        tuple(("h100", "1x1x8", "tiny", p, "full", "dense", 8, 128, 1, 1, False, "adamw") for p in PLANS)
        if quick
        else FULL_GRID
    )

    def row(target, topology, preset, spec, remat, loss, batch, seq, mb, v, go, optimizer, **status):  # no compile
        return dict(
            framework="jax",
            impl="sharding-plan",
            target=target,
            topology=topology,
            preset=preset,
            mesh=spec,
            remat=remat,
            loss=loss,
            batch=batch,
            seq=seq,
            optimizer=optimizer,
            **({"microbatches": mb, "schedule": _schedule(v, go)} if "stage=" in spec else {}),
            **status,
        )

    records = []
    for g in grid:
        target, topology, preset, spec, remat, loss, batch, seq, mb, v, go, optimizer = g
        reason = _unavailable(target)
        if reason is not None:
            records.append(row(*g, status="skipped", reason=reason))
            continue
        try:
            devs = _pod_devices(target, topology)
            rec = compile_plan(
                devs,
                spec,
                preset,
                batch,
                seq,
                remat,
                loss,
                target,
                topology,
                microbatches=mb,
                virtual=v,
                gather_once=go,
                optimizer=optimizer,
            )
            rec["status"] = "ok"
        except Exception as e:  # one failed plan does not hide the others
            refused = tpu_target.refused_for_memory(e)
            if refused:  # the TPU compiler refuses a plan larger than the chips: a finding, not an error
                rec = row(*g, status="does_not_fit", required_temp_gib=refused[0])
                rec["device_memory_bytes"] = tpu_target.CHIPS[target].hbm_bytes
            else:
                rec = row(*g, status="error", error=f"{type(e).__name__}: {str(e)[:500]}")
        print(
            f"  plan {target}:{topology} {preset} {spec} remat={remat} loss={loss}"
            + (f" microbatches={mb} {_schedule(v, go)}" if "stage=" in spec else "")
            + ("" if optimizer == "adamw" else f" optimizer={optimizer}")
            + f": {rec.get('status')} "
            f"{rec.get('summary', rec.get('error', rec.get('required_temp_gib', '')))}",
            flush=True,
        )
        records.append(rec)
    return records
