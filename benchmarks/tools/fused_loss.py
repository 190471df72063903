"""Dense vs fused loss on this machine, paired and interleaved: one train step of each, A B A B ..., per framework.

    python -m benchmarks.tools.fused_loss --shape tiny --shape tiny-v32k --out benchmarks/results/local/fused-loss

For each preset and framework the two steps (``--loss dense`` and ``--loss fused``, the same weights and batch) are
built once, warmed up, then timed alternately for ``--rounds`` rounds (the order flips every round); the record holds
each side's median step time, the per-round ratio fused/dense (median and an order-statistic 95% interval), the
coefficient of variation, and JAX's compiled memory (temporaries and arguments + outputs + temporaries - aliased,
``jaxattn.profiling.compiled_memory``) for both. torch on
a CPU has no allocator statistics, so its memory is not recorded. Writes ``fused_loss.json`` (benchmarks/NOTES.md
reads it); a ratio whose interval spans more than x1.5 is marked ``unstable``.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import numpy as np

from ..report.records import check_out_dir, default_out, write_results
from ..twins import twin_models

# name -> (preset, config overrides, batch, seq, --loss-chunk): tiny as the main job trains it (one chunk), tiny with
# a 32k vocabulary (the head dominates: 4 chunks), and 125m (4 chunks)
SHAPES = {
    "tiny": ("tiny", {}, 4, 128, 1024),
    "tiny-v32k": ("tiny", {"vocab_size": 32000}, 4, 256, 256),
    "125m": ("125m", {}, 1, 512, 128),
}


def _interval(ratios: list[float]) -> tuple[float, float]:
    """Order-statistic 95% interval of the median (binomial ranks)."""
    r, n = sorted(ratios), len(ratios)
    k = max(0, int(math.floor(n / 2 - 1.96 * math.sqrt(n) / 2)))
    return r[k], r[min(n - 1, n - 1 - k)]


def _jax_steps(tmodel, tokens, chunk):
    import jax.numpy as jnp
    import optax

    from jaxattn import hf as jhf
    from jaxattn.profiling import compiled_memory
    from jaxattn.train_step import TrainState, make_train_step

    from ..twins import jax_config

    weights = {k: v.detach().numpy().copy() for k, v in tmodel.state_dict().items()}
    out = {}
    for loss in ("dense", "fused"):
        model = jhf.from_state_dict(jax_config(tmodel.config), {k: v.copy() for k, v in weights.items()})
        tx = optax.adamw(1e-4)
        graphdef, state = TrainState.create(model, tx)
        step = make_train_step(graphdef, tx, check_ids="off", loss=loss, loss_chunk=chunk)
        batch = {"tokens": jnp.asarray(tokens)}
        ma = compiled_memory(step.jitted, state, batch)
        box = [state]

        def one(step=step, box=box, batch=batch):
            box[0], m = step(box[0], batch)
            return float(m["loss"])

        out[loss] = (one, {"temp_bytes": ma["temp"], "total_bytes": ma["total"]} if ma else {})
    return out


def _torch_steps(tmodel, tokens, chunk):
    import copy

    import torch

    from torchref.train_step import make_train_step

    out = {}
    for loss in ("dense", "fused"):
        model = copy.deepcopy(tmodel).train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        step = make_train_step(model, opt, loss=loss, loss_chunk=chunk)
        batch = {"tokens": torch.from_numpy(tokens).long()}
        out[loss] = ((lambda step=step, batch=batch: float(step(batch)["loss"])), {})
    return out


def measure(name: str, rounds: int, warmup: int, log=print) -> list[dict]:
    from torchref.config import ModelConfig

    preset, overrides, b, s, chunk = SHAPES[name]
    tmodel = twin_models(ModelConfig.preset(preset, **overrides), seed=0, perturb_norms=False)[0]
    tokens = np.random.default_rng(0).integers(0, tmodel.config.vocab_size, (b, s + 1))
    records = []
    for fw, build in (("jax", _jax_steps), ("torch", _torch_steps)):
        steps = build(tmodel, tokens, chunk)
        for _ in range(warmup):
            for loss in ("dense", "fused"):
                steps[loss][0]()
        times = {"dense": [], "fused": []}
        for r in range(rounds):
            for loss in ("dense", "fused") if r % 2 == 0 else ("fused", "dense"):
                t0 = time.perf_counter()
                steps[loss][0]()
                times[loss].append(time.perf_counter() - t0)
        ratios = [f / d for f, d in zip(times["fused"], times["dense"])]
        lo, hi = _interval(ratios)
        rec = dict(
            suite="fused_loss",
            framework=fw,
            impl=fw,
            shape=name,
            preset=preset,
            overrides=overrides,
            loss_chunk=chunk,
            B=b,
            S=s,
            vocab=tmodel.config.vocab_size,
            rounds=rounds,
            dense_median_ms=1e3 * statistics.median(times["dense"]),
            fused_median_ms=1e3 * statistics.median(times["fused"]),
            dense_cv=statistics.pstdev(times["dense"]) / statistics.mean(times["dense"]),
            fused_cv=statistics.pstdev(times["fused"]) / statistics.mean(times["fused"]),
            ratio_fused_over_dense=statistics.median(ratios),
            ratio_ci95=[lo, hi],
            unstable=hi / lo > 1.5,
            dense_memory=steps["dense"][1] or None,
            fused_memory=steps["fused"][1] or None,
            memory_source="xla memory_analysis (compiled)" if fw == "jax" else None,
            status="ok",
        )
        records.append(rec)
        log(
            f"{name} {fw}: dense {rec['dense_median_ms']:.1f} ms, fused {rec['fused_median_ms']:.1f} ms, "
            f"fused/dense {rec['ratio_fused_over_dense']:.3f} [{lo:.3f}, {hi:.3f}]"
            + (
                f", temp {rec['dense_memory']['temp_bytes']:,} -> {rec['fused_memory']['temp_bytes']:,} B"
                if fw == "jax"
                else ""
            )
        )
    return records


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.tools.fused_loss", description=__doc__.split("\n")[0])
    p.add_argument("--shape", action="append", choices=list(SHAPES), help="repeatable (default: all of SHAPES)")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--out", default=default_out("fused-loss"))
    a = p.parse_args(argv)
    out = check_out_dir(a.out)
    from .. import measure as m

    records = [r for name in a.shape or list(SHAPES) for r in measure(name, a.rounds, a.warmup)]
    print(write_results(out, "fused_loss", records, m.env_info()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
