"""Train suite: one training step of the same Llama in both frameworks, each technique as a toggle from a baseline.

    records = run(quick=True, toggles=["baseline", "bf16"])   # python -m benchmarks run --suite train [--quick]

Toggles, shapes, the time budget and the record fields (tokens/s, peak memory, MFU): benchmarks/NOTES.md.
"""

from __future__ import annotations

import contextlib
import gc
import time

import numpy as np

from jaxattn.spec.flops import flops_per_token
from jaxattn.spec.params import matmul_param_count

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
}
# name -> changes from BASELINE; attention as {framework: backend name} (torch names are torchref.attention's,
# "xla" = SDPA math, "flash" = SDPA flash).
TOGGLES: dict[str, dict] = {
    "baseline": {},
    "bf16": {"precision": "bf16"},
    "fp16": {"precision": "fp16"},
    "remat_full": {"remat": "full"},
    "attn_math": {"attention": {"jax": "xla", "torch": "xla"}},
    "attn_fast": {"attention": {"jax": "chunked", "torch": "flash"}},
    "torch_compile": {"compile": True},
    "grad_accum2": {"grad_accum": 2},
    "adamw8bit": {"optimizer": "adamw8bit"},
    "fused_loss": {"loss": "fused"},
}
QUICK_COMPILE_LIMIT_S = 60.0
BUDGET_S = 480.0  # outside --quick: rows not started by then are skipped (gpu_session.sh gives the suite 570 s)
LR = 1e-4


def _shape(quick: bool):
    return ("tiny", 4, 128) if quick else ("1b", 1, 2048)


def _weights(tcfg) -> dict:
    """HF-named fp32 numpy tensors of the twin models (``benchmarks.twins.twin_models(seed=0,
    perturb_norms=False)``), drawn once per run and copied into each row's models."""
    tmodel = twin_models(tcfg, seed=0, perturb_norms=False)[0]
    return {k: v.detach().numpy() for k, v in tmodel.state_dict().items()}


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
def _jax_step(tcfg, s: dict, tokens, weights: dict):
    import jax.numpy as jnp

    from jaxattn import optim, remat
    from jaxattn.train_step import TrainState, make_train_step

    jmodel = remat.apply(_jax_model(tcfg, weights), s["remat"])
    tx = optim.build(s["optimizer"], LR, 0.1)
    graphdef, state = TrainState.create(jmodel, tx, policy=s["precision"])
    step = make_train_step(
        graphdef,
        tx,
        policy=s["precision"],
        max_grad_norm=1.0,
        grad_accum=s["grad_accum"],
        check_ids="off",
        loss=s["loss"],
    )
    return step, state, {"tokens": jnp.asarray(tokens)}


def _jax_measure(tcfg, s, tokens, warmup, iters, weights) -> dict:
    from jaxattn.attention import attention_backend

    ctx = attention_backend(s["attention"]) if s["attention"] != "default" else contextlib.nullcontext()
    with ctx:
        step, state, batch = _jax_step(tcfg, s, tokens, weights)
        box = [state]

        def one():
            box[0], m = step(box[0], batch)
            return m["loss"]

        t0 = time.perf_counter()
        loss = one()
        measure.sync(loss)
        first = time.perf_counter() - t0
        t = measure.timeit(one, warmup=warmup, iters=iters)
        mem = measure.jax_compiled_memory(step.jitted, box[0], batch)
        loss = float(one())
    return {
        "t": t,
        "first_step_s": first,
        "peak_mem_bytes": mem,
        "mem_source": "xla memory_analysis (compiled)",
        "loss": loss,
    }


# ----------------------------------------------------------------------------------------------------- torch
def _torch_measure(tcfg, s, tokens, warmup, iters, dev, quick, weights) -> dict:
    import torch

    from torchref import attention as tattn
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
    ctx = tattn.attention_backend(s["attention"]) if s["attention"] != "default" else contextlib.nullcontext()
    with ctx:
        measure.torch_reset_peak()
        t0 = time.perf_counter()
        loss = step(batch)["loss"]
        measure.sync(loss)
        first = time.perf_counter() - t0
        if s["compile"] and quick and first > QUICK_COMPILE_LIMIT_S:
            raise _Skip(
                f"torch.compile first step took {first:.0f} s > {QUICK_COMPILE_LIMIT_S:.0f} s; not timed in --quick"
            )
        t = measure.timeit(lambda: step(batch)["loss"], warmup=warmup, iters=iters)
        loss = float(step(batch)["loss"])
    return {
        "t": t,
        "first_step_s": first,
        "peak_mem_bytes": measure.torch_peak_memory(),
        "mem_source": "torch.cuda.max_memory_allocated" if dev == "cuda" else None,
        "loss": loss,
    }


class _Skip(Exception):
    pass


def run(quick: bool, toggles: list[str] | None = None, log=print, budget_s: float | None = None) -> list[dict]:
    """Records for ``toggles`` (default: all of :data:`TOGGLES`, in order; JAX before torch). ``budget_s``: rows
    not started within it are skipped (default None with ``quick``, else :data:`BUDGET_S`)."""
    import torch

    from torchref.config import ModelConfig as TConfig

    names = list(TOGGLES) if toggles is None else list(toggles)
    unknown = [n for n in names if n not in TOGGLES]
    if unknown:
        raise ValueError(f"unknown train toggle(s) {unknown}; choose from {list(TOGGLES)}")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    warmup, iters = (2, 5) if quick else (3, 20)
    preset, b, seq = _shape(quick)
    tcfg = TConfig.preset(preset)
    fpt, n_params = flops_per_token(tcfg, seq), matmul_param_count(tcfg)
    peak, peak_reason = peaks.peak_flops(measure.jax_device_name())
    tokens = np.random.default_rng(0).integers(0, tcfg.vocab_size, (b, seq + 1), dtype=np.int32)
    weights = _weights(tcfg)
    budget_s = None if quick else BUDGET_S if budget_s is None else budget_s
    t_start = time.perf_counter()
    records = []
    # torch first: its cache is emptied after each row, JAX's allocator keeps what it grew (one GPU, both)
    rows = [
        (name, fw) for fw in ("torch", "jax") for name in names if not (name == "torch_compile" and fw == "jax")
    ]  # JAX's step is always jitted
    for name, fw in rows:
        s = _settings(name, fw)
        rec = {
            "suite": "train",
            "toggle": name,
            "preset": preset,
            "B": b,
            "S": seq,
            "framework": fw,
            "impl": "jaxattn" if fw == "jax" else "torchref",
        }
        meas = {**s, "n_params": n_params, "flops_per_token": fpt, "peak_flops": peak, "device": dev}
        try:
            spent = time.perf_counter() - t_start
            if budget_s is not None and spent > budget_s:
                raise _Skip(f"time budget spent ({spent:.0f} s > {budget_s:.0f} s); not run")
            if fw == "jax":
                m = _jax_measure(tcfg, s, tokens, warmup, iters, weights)
            else:
                m = _torch_measure(tcfg, s, tokens, warmup, iters, dev, quick, weights)
            t = m["t"]
            tps = b * seq / t["median_s"]
            rec.update(
                median_ms=1e3 * t["median_s"],
                p10_ms=1e3 * t["p10_s"],
                p90_ms=1e3 * t["p90_s"],
                iters=t["iters"],
                tokens_per_s=tps,
                peak_mem_bytes=m["peak_mem_bytes"],
                mfu=peaks.mfu(fpt, tps, peak),
                status="ok",
            )
            meas.update(
                first_step_s=round(m["first_step_s"], 3),
                mem_source=m["mem_source"],
                final_loss=m["loss"],
                mfu_reason=peak_reason,
            )
            log(
                f"  train {name:13s} {fw:5s}: {rec['median_ms']:.2f} ms/step, {tps:.4g} tok/s, "
                f"first step {m['first_step_s']:.1f} s"
            )
        except _Skip as e:
            rec.update(status="skipped", reason=str(e))
            log(f"  train {name} {fw}: skipped, {e}")
        except Exception as e:  # one toggle that fails is a record, not the end of the suite
            rec.update(status="skipped", reason=f"{type(e).__name__}: {str(e)[:300]}")
            log(f"  train {name} {fw}: skipped, {rec['reason']}")
        rec["measured"] = meas
        records.append(rec)
        gc.collect()
        if fw == "jax":
            import jax

            jax.clear_caches()
        elif dev == "cuda":
            torch.cuda.empty_cache()
    return sorted(records, key=lambda r: (names.index(r["toggle"]), r["framework"] != "jax"))
