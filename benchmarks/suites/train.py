"""Train suite: one training step of the same Llama in both frameworks, each technique as a toggle from a baseline
(``moe`` / ``moe_capacity``: the Mixture-of-Experts twin, dropless or with a capacity factor of 1.25).

    records = run(quick=True, toggles=["baseline", "bf16"])   # python -m benchmarks run --suite train [--quick]

Toggles, shapes, the time budget and the record fields (tokens/s, peak memory, MFU): benchmarks/NOTES.md.
"""

from __future__ import annotations

import contextlib
import gc
import time

import numpy as np

from twincore.flops import flops_per_token
from twincore.params import active_matmul_param_count, matmul_param_count
from twincore.runlog import MOE_KEYS

from .. import measure
from ..twins import jax_config, twin_models
from . import peaks

BASELINE = {
    "precision": "fp32",
    "remat": "none",
    "optimizer": "adamw",
    "grad_accum": 1,
    "attention": None,
    "compile": False,
    "loss": "dense",
    "model": "dense",
    "capacity_factor": None,
    "matmul": None,  # float32 matmul precision by torch's names (jaxattn/torchref.precision); None: each default
}
# name -> changes from BASELINE; attention as {framework: backend name} (torch names are torchref.attention's,
# "xla" = SDPA math, "flash" = SDPA flash).
TOGGLES: dict[str, dict] = {
    "baseline": {},
    "bf16": {"precision": "bf16"},
    "fp16": {"precision": "fp16"},
    "tf32": {"matmul": "high"},  # fp32 with TF32 matmuls on both sides: baseline's like-for-like twin on a GPU
    "remat_full": {"remat": "full"},
    "attn_math": {"attention": {"jax": "xla", "torch": "xla"}},
    "attn_fast": {"attention": {"jax": "chunked", "torch": "flash"}},
    "torch_compile": {"compile": True},
    "grad_accum2": {"grad_accum": 2},
    "adamw8bit": {"optimizer": "adamw8bit"},
    "fused_loss": {"loss": "fused"},
    "moe": {"model": "moe"},
    "moe_capacity": {"model": "moe", "capacity_factor": 1.25},
}
QUICK_COMPILE_LIMIT_S = 60.0
BUDGET_S = 480.0  # outside --quick: rows not started by then are skipped (gpu_session.sh gives the suite 570 s)
LR = 1e-4


def _shape(quick: bool, model: str = "dense"):
    """(preset, batch, seq) of the ``model`` rows: the dense Llama, or its Mixtral-style MoE twin of about the same
    active size."""
    if model == "moe":
        return ("moe-tiny", 4, 128) if quick else ("moe-350m", 1, 2048)
    return ("tiny", 4, 128) if quick else ("1b", 1, 2048)


def _weights(tcfg) -> dict:
    """HF-named fp32 numpy tensors of the twin models (``benchmarks.twins.twin_models(seed=0,
    perturb_norms=False)``), drawn once per run and copied into each row's models."""
    from torchref.hf import to_state_dict

    tmodel = twin_models(tcfg, seed=0, perturb_norms=False)[0]
    return {k: v.numpy() for k, v in to_state_dict(tmodel).items()}  # HF names (an MoE's experts one by one)


def _jax_model(tcfg, weights: dict):
    from jaxattn import hf as jhf

    # copies: on a CPU jax may alias a numpy buffer, and the train step donates its state
    return jhf.from_state_dict(jax_config(tcfg), {k: v.copy() for k, v in weights.items()})


def _torch_model(tcfg, weights: dict):
    import torch

    from torchref import hf as thf

    # copies: the optimizer updates the parameters in place, and on a CPU .to() would not copy
    return thf.from_state_dict(tcfg, {k: torch.tensor(v) for k, v in weights.items()})


def _settings(toggle: str, fw: str) -> dict:
    s = {**BASELINE, **TOGGLES[toggle]}
    att = s["attention"]
    s["attention"] = "default" if att is None else att[fw]
    return s


# ------------------------------------------------------------------------------------------------------- JAX
def _jax_train_step(graphdef, tx, s: dict):
    from jaxattn.train_step import make_train_step

    return make_train_step(
        graphdef,
        tx,
        policy=s["precision"],
        max_grad_norm=1.0,
        grad_accum=s["grad_accum"],
        check_ids="off",
        loss=s["loss"],
    )


def _jax_step(tcfg, s: dict, tokens, weights: dict):
    import jax.numpy as jnp

    from jaxattn import optim, remat
    from jaxattn.train_step import TrainState

    jmodel = remat.apply(_jax_model(tcfg, weights), s["remat"])
    tx = optim.build(s["optimizer"], LR, 0.1)
    graphdef, state = TrainState.create(jmodel, tx, policy=s["precision"])
    return _jax_train_step(graphdef, tx, s), state, {"tokens": jnp.asarray(tokens)}


def jax_program(toggle: str, quick: bool = False):
    """``(jitted, (state, batch), backend, preset)`` of a toggle's JAX step at the suite's shape with abstract inputs
    (``jax.ShapeDtypeStruct``s, no weights drawn) and the attention backend block it runs under: what
    ``benchmarks/tools/suite_memory.py`` compiles for an H100 without one."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jaxattn import optim, remat
    from jaxattn.model import Llama
    from jaxattn.train_step import TrainState
    from torchref.config import ModelConfig as TConfig

    s = _settings(toggle, "jax")
    preset, b, seq = _shape(quick, s["model"])
    b = b if b % s["grad_accum"] == 0 else b * s["grad_accum"]  # as run() does
    cfg = jax_config(TConfig.preset(preset).replace(capacity_factor=s["capacity_factor"]))
    tx = optim.build(s["optimizer"], LR, 0.1)

    def make():
        return remat.apply(Llama(cfg, rngs=nnx.Rngs(0)), s["remat"])

    graphdef = nnx.split(nnx.eval_shape(make), nnx.Param, ...)[0]
    state = jax.eval_shape(lambda: TrainState.create(make(), tx, policy=s["precision"])[1])
    batch = {"tokens": jax.ShapeDtypeStruct((b, seq + 1), jnp.int32)}
    return _jax_train_step(graphdef, tx, s).jitted, (state, batch), lambda: _backend(s, "jax"), preset


@contextlib.contextmanager
def _backend(s: dict, fw: str):
    """The row's attention backend (``jaxattn`` / ``torchref`` ``attention_backend``) and float32 matmul precision
    (``jaxattn`` / ``torchref`` ``precision.matmul_precision``) for ``fw``, where the row sets them. JAX reads the
    precision when it traces and keys its jit cache on it, so every call of a row's step runs inside this too."""
    with contextlib.ExitStack() as stack:
        if s["attention"] != "default":
            if fw == "jax":
                from jaxattn.attention import attention_backend
            else:
                from torchref.attention import attention_backend
            stack.enter_context(attention_backend(s["attention"]))
        if s["matmul"] is not None:
            if fw == "jax":
                from jaxattn.precision import matmul_precision
            else:
                from torchref.precision import matmul_precision
            stack.enter_context(matmul_precision(s["matmul"]))
        yield


def _jax_prepare(tcfg, s, tokens, weights) -> dict:
    """The JAX step, compiled by its first call: ``{"call", "first_step_s", "finish"}`` (``finish()`` -> peak
    memory and the loss after the timed steps)."""
    with _backend(s, "jax"):
        step, state, batch = _jax_step(tcfg, s, tokens, weights)
        box, last = [state], [{}]

        def one():
            with _backend(s, "jax"):
                box[0], last[0] = step(box[0], batch)
            return last[0]["loss"]

        t0 = time.perf_counter()
        measure.sync(one())
        first = time.perf_counter() - t0

    def finish() -> dict:
        with _backend(s, "jax"):  # lowered again for the analysis: under the row's backend, as compiled
            mem = measure.jax_compiled_memory(step.jitted, box[0], batch)
        loss = float(one())
        return {"peak_mem_bytes": mem, "mem_source": "xla memory_analysis (compiled)", "loss": loss, **_moe(last[0])}

    return {"call": one, "first_step_s": first, "finish": finish}


# ----------------------------------------------------------------------------------------------------- torch
def _torch_prepare(tcfg, s, tokens, dev, quick, weights) -> dict:
    """The torch step after its first call (torch.compile compiles there): ``{"call", "first_step_s", "finish"}``."""
    import torch

    from torchref import optim, remat
    from torchref.precision import get_policy
    from torchref.train_step import make_train_step

    model = _torch_model(tcfg, weights).to(dev).train()
    model = remat.apply(model, s["remat"])
    opt = optim.build(model, s["optimizer"], LR, 0.1)[0]
    policy = get_policy(s["precision"])
    scaler = policy.make_grad_scaler(dev) if policy.uses_loss_scaling else None
    runner = torch.compile(model) if s["compile"] else model
    step = make_train_step(
        runner, opt, policy=policy, scaler=scaler, max_grad_norm=1.0, grad_accum=s["grad_accum"], loss=s["loss"]
    )
    batch = {"tokens": torch.from_numpy(tokens).long().to(dev)}

    last = [{}]

    def one():
        with _backend(s, "torch"):
            last[0] = step(batch)
        return last[0]["loss"]

    measure.torch_reset_peak()
    t0 = time.perf_counter()
    measure.sync(one())
    first = time.perf_counter() - t0
    if s["compile"] and quick and first > QUICK_COMPILE_LIMIT_S:
        raise _Skip(
            f"torch.compile first step took {first:.0f} s > {QUICK_COMPILE_LIMIT_S:.0f} s; not timed in --quick"
        )

    def finish() -> dict:
        loss = float(one())
        return {
            "peak_mem_bytes": measure.torch_peak_memory(),
            "mem_source": "torch.cuda.max_memory_allocated" if dev == "cuda" else None,
            "loss": loss,
            **_moe(last[0]),
        }

    return {"call": one, "first_step_s": first, "finish": finish}


def _moe(metrics: dict) -> dict:
    """An MoE step's router metrics (``runlog.MOE_KEYS``: aux and z loss, expert load, dropped tokens) as floats."""
    return {k: float(metrics[k]) for k in MOE_KEYS if k in metrics}


class _Skip(Exception):
    pass


def check_toggles(toggles) -> list[str]:
    """``toggles`` as a list, after checking each names one of :data:`TOGGLES` (ValueError naming the others)."""
    unknown = [n for n in toggles if n not in TOGGLES]
    if unknown:
        raise ValueError(f"unknown train toggle(s) {unknown}; choose from {list(TOGGLES)}")
    return list(toggles)


def run(quick: bool, toggles: list[str] | None = None, log=print, budget_s: float | None = None) -> list[dict]:
    """Records for ``toggles`` (default: all of :data:`TOGGLES`, in order; JAX before torch). Per toggle both
    frameworks' steps are built and compiled, then timed as a pair (``measure.timeit_paired``: alternating rounds,
    the row's speed-up with its interval); a toggle one framework skips is timed alone. ``budget_s``: toggles not
    started within it are skipped (default None with ``quick``, else :data:`BUDGET_S`)."""
    import torch

    from torchref.config import ModelConfig as TConfig

    names = list(TOGGLES) if toggles is None else check_toggles(toggles)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    rounds, warmup = (10, 2) if quick else (10, 3)
    peak, peak_reason = peaks.peak_flops(measure.jax_device_name())
    models: dict = {}

    def model(kind: str) -> dict:  # each model's config, tokens and weights, drawn once, when a row first needs it
        if kind not in models:
            preset, b, seq = _shape(quick, kind)
            tcfg = TConfig.preset(preset)
            models[kind] = dict(
                preset=preset,
                b=b,
                seq=seq,
                tcfg=tcfg,
                tokens=np.random.default_rng(0).integers(0, tcfg.vocab_size, (b, seq + 1), dtype=np.int32),
                weights=_weights(tcfg),
                fpt=flops_per_token(tcfg, seq),
                n_params=matmul_param_count(tcfg),
                active_params=active_matmul_param_count(tcfg),
            )
        return models[kind]

    budget_s = None if quick else BUDGET_S if budget_s is None else budget_s
    t_start = time.perf_counter()
    records = measure.rows()
    for name in names:
        fws = ("torch",) if name == "torch_compile" else ("torch", "jax")  # JAX's step is always jitted
        recs, meas, prepared = {}, {}, {}
        m = model(_settings(name, "jax")["model"])
        preset, b, seq, tokens, weights, fpt = (m[k] for k in ("preset", "b", "seq", "tokens", "weights", "fpt"))
        accum = _settings(name, "jax")["grad_accum"]
        if b % accum:  # B=1 cannot be split: the global batch is `accum` micro-batches of B rows (the rows repeated)
            b, tokens = b * accum, np.concatenate([tokens] * accum)
        for fw in fws:  # torch first: its first step (torch.compile) may skip the row's torch side
            s = _settings(name, fw)
            tcfg = m["tcfg"].replace(capacity_factor=s["capacity_factor"])
            recs[fw] = {
                "suite": "train",
                "toggle": name,
                "preset": preset,
                "B": b,
                "S": seq,
                "framework": fw,
                "impl": "jaxattn" if fw == "jax" else "torchref",
            }
            meas[fw] = {
                **s,
                "n_params": m["n_params"],
                "active_params": m["active_params"],
                "flops_per_token": fpt,
                "peak_flops": peak,
                "device": dev,
            }
            try:
                spent = time.perf_counter() - t_start
                if budget_s is not None and spent > budget_s:
                    raise _Skip(f"time budget spent ({spent:.0f} s > {budget_s:.0f} s); not run")
                prepared[fw] = (
                    _jax_prepare(tcfg, s, tokens, weights)
                    if fw == "jax"
                    else _torch_prepare(tcfg, s, tokens, dev, quick, weights)
                )
            except _Skip as e:
                recs[fw].update(status="skipped", reason=str(e))
                log(f"  train {name} {fw}: skipped, {e}")
            except Exception as e:  # one toggle that fails is a record, not the end of the suite
                recs[fw].update(status="skipped", reason=f"{type(e).__name__}: {str(e)[:300]}")
                log(f"  train {name} {fw}: skipped, {recs[fw]['reason']}")
        if prepared:
            try:
                _time(prepared, rounds, warmup, recs, meas, b * seq, fpt, peak, peak_reason, name, log)
            except Exception as e:
                for fw in prepared:
                    recs[fw].update(status="skipped", reason=f"{type(e).__name__}: {str(e)[:300]}")
        for fw in fws:
            recs[fw]["measured"] = meas[fw]
            records.append(recs[fw])
        prepared.clear()
        gc.collect()
        import jax

        jax.clear_caches()
        if dev == "cuda":
            torch.cuda.empty_cache()
    return sorted(records, key=lambda r: (names.index(r["toggle"]), r["framework"] != "jax"))


def _time(prepared, rounds, warmup, recs, meas, tokens_per_step, fpt, peak, peak_reason, name, log) -> None:
    """Times the prepared steps (a pair when both frameworks are there, else the one alone) into their records."""
    if len(prepared) == 2:
        t = measure.timeit_paired(
            {fw: p["call"] for fw, p in prepared.items()}, rounds=rounds, per_round=1, warmup=warmup
        )
        paired = t.pop("paired")
    else:
        ((fw, p),) = prepared.items()
        t, paired = {fw: measure.timeit(p["call"], warmup=warmup, iters=rounds)}, None
    for fw, p in prepared.items():
        stats, extra = t[fw], p["finish"]()
        tps = tokens_per_step / stats["median_s"]
        recs[fw].update(
            median_ms=1e3 * stats["median_s"],
            p10_ms=1e3 * stats["p10_s"],
            p90_ms=1e3 * stats["p90_s"],
            iters=stats["iters"],
            tokens_per_s=tps,
            peak_mem_bytes=extra["peak_mem_bytes"],
            mfu=peaks.mfu(fpt, tps, peak),
            status="ok",
            **({"paired": paired, "cv": stats["cv"]} if paired else {}),
        )
        meas[fw].update(
            first_step_s=round(p["first_step_s"], 3),
            mem_source=extra["mem_source"],
            final_loss=extra["loss"],
            **{k: extra[k] for k in MOE_KEYS if k in extra},
            mfu_reason=peak_reason,
        )
        log(
            f"  train {name:13s} {fw:5s}: {recs[fw]['median_ms']:.2f} ms/step, {tps:.4g} tok/s, "
            f"first step {p['first_step_s']:.1f} s"
        )
