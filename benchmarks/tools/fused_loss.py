"""Dense vs fused loss on this machine, paired and interleaved: one train step of each, A B A B ..., per framework.

    python -m benchmarks.tools.fused_loss --shape tiny --shape tiny-v32k --out benchmarks/results/local/fused-loss

For each preset and framework the two steps (``--loss dense`` and ``--loss fused``, the same weights and batch) are
built once, warmed up, then timed alternately for ``--rounds`` rounds (the order flips every round); the record holds
each side's median step time, the per-round ratio fused/dense (median and an order-statistic 95% interval), the
coefficient of variation, and JAX's compiled memory (temporaries and arguments + outputs + temporaries - aliased,
``jaxattn.profiling.compiled_memory``) for both. torch on
a CPU has no allocator statistics, so its memory is not recorded. Writes ``fused_loss.json`` (benchmarks/NOTES.md
reads it); a ratio whose interval spans more than x1.5 is marked ``unstable``.

``--memory-sweep`` measures memory against sequence length instead (tiny with a 32k vocabulary, batch 1, SGD so no
optimizer state, ``--loss-chunk`` 256): JAX's compiled temporaries of the train step (with the ``chunked`` attention,
O(S) memory like torch's CPU SDPA kernel, so that the curves show the loss, not ``[S, S]`` scores), and torch's peak
host memory over one train step (the process's resident high-water mark, reset through ``/proc/self/clear_refs``
before the step, minus the resident size before it; measured in a child process with a fixed
``MALLOC_MMAP_THRESHOLD_`` so freed tensors leave the resident set: Linux only). Writes ``fused_loss_memory.json`` and
``fused_loss_memory.png``.
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


SWEEP = dict(preset="tiny", overrides={"vocab_size": 32000, "max_seq_len": 4096}, batch=1, chunk=256)
SWEEP_SEQS = (256, 512, 1024, 2048, 4096)


def _jax_temp(cfg, b: int, s: int, chunk: int) -> dict:
    """JAX's compiled memory of the SGD train step at [b, s] for each loss (compiled, not run)."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from jaxattn.attention import attention_backend
    from jaxattn.model import LlamaForCausalLM
    from jaxattn.profiling import compiled_memory
    from jaxattn.train_step import TrainState, make_train_step

    from ..twins import jax_config

    model = LlamaForCausalLM(jax_config(cfg), rngs=nnx.Rngs(0))
    tx = optax.sgd(1e-3)
    graphdef, state = TrainState.create(model, tx)
    batch = {"tokens": jax.ShapeDtypeStruct((b, s + 1), jnp.int32)}
    with attention_backend("chunked"):  # O(S) memory, as torch's CPU SDPA kernel: the curves show the loss
        return {
            loss: compiled_memory(
                make_train_step(graphdef, tx, check_ids="off", loss=loss, loss_chunk=chunk).jitted, state, batch
            )
            for loss in ("dense", "fused")
        }


_RSS_CHILD = r"""
import gc, json, sys
import numpy as np, torch
from torchref.config import ModelConfig
from torchref.model import LlamaForCausalLM
from torchref.train_step import make_train_step

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024

preset, overrides, b, chunk, seqs = json.loads(sys.argv[1])
torch.manual_seed(0)
model = LlamaForCausalLM(ModelConfig.preset(preset, **overrides)).train()
out = {}
for s in seqs:
    tokens = torch.from_numpy(np.random.default_rng(s).integers(0, model.config.vocab_size, (b, s + 1))).long()
    for loss in ("dense", "fused"):
        step = make_train_step(model, torch.optim.SGD(model.parameters(), lr=1e-3), loss=loss, loss_chunk=chunk)
        step({"tokens": tokens[:, :65]})  # warm: first-call allocations (thread pools, kernels) are not the loss's
        gc.collect()
        before = status("VmRSS")
        open("/proc/self/clear_refs", "w").write("5")  # resets VmHWM to the current resident size
        step({"tokens": tokens})
        out[f"{loss}/{s}"] = status("VmHWM") - before
print(json.dumps(out))
"""


def _torch_peak_rss(preset: str, overrides: dict, b: int, chunk: int, seqs) -> dict | str:
    """torch's peak host memory growth over one train step per (loss, seq), or the reason it cannot be measured."""
    import json
    import os
    import subprocess
    import sys

    if not os.path.exists("/proc/self/clear_refs"):
        return "needs Linux /proc/self/clear_refs to reset the resident high-water mark"
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"))
    arg = json.dumps([preset, overrides, b, chunk, list(seqs)])
    p = subprocess.run([sys.executable, "-c", _RSS_CHILD, arg], env=env, capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"torch memory child failed: {p.stderr.strip()[-2000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def memory_sweep(seqs=SWEEP_SEQS, log=print) -> list[dict]:
    """Memory of one train step vs sequence length, dense vs fused, both frameworks (see the module docstring)."""
    from torchref.config import ModelConfig

    cfg = ModelConfig.preset(SWEEP["preset"], **SWEEP["overrides"])
    b, chunk = SWEEP["batch"], SWEEP["chunk"]
    torch_mem = _torch_peak_rss(SWEEP["preset"], SWEEP["overrides"], b, chunk, seqs)
    records = []
    for s in seqs:
        jm = _jax_temp(cfg, b, s, chunk)
        base = dict(
            suite="fused_loss_memory",
            preset=SWEEP["preset"],
            overrides=SWEEP["overrides"],
            B=b,
            S=s,
            vocab=cfg.vocab_size,
            loss_chunk=chunk,
            logits_f32_bytes=4 * b * s * cfg.vocab_size,
        )
        for loss in ("dense", "fused"):
            records.append(
                dict(
                    base,
                    framework="jax",
                    impl="jax",
                    loss=loss,
                    bytes=jm[loss]["temp"],
                    memory_source="xla memory_analysis temp (compiled)",
                    status="ok",
                )
            )
            if isinstance(torch_mem, str):
                records.append(
                    dict(base, framework="torch", impl="torch", loss=loss, status="skipped", reason=torch_mem)
                )
            else:
                records.append(
                    dict(
                        base,
                        framework="torch",
                        impl="torch",
                        loss=loss,
                        bytes=torch_mem[f"{loss}/{s}"],
                        memory_source="host peak RSS growth over one step (VmHWM - VmRSS)",
                        status="ok",
                    )
                )
        row = {(r["framework"], r["loss"]): r.get("bytes") for r in records if r["S"] == s}
        log(
            f"S={s}: "
            + ", ".join(
                f"{fw} {lo} {v / 2**20:.1f} MiB" if v is not None else f"{fw} {lo} skipped"
                for (fw, lo), v in row.items()
            )
        )
    return records


def plot_memory(out_dir: str, records: list[dict]):
    """Peak memory vs sequence length, dense vs fused: one panel per framework."""
    from ..report.plots import Panel, draw

    panels = []
    for fw, ylabel in (("jax", "compiled temporaries (MiB)"), ("torch", "peak host RSS growth (MiB)")):
        series = {}
        for r in records:
            if r["framework"] == fw and r["status"] == "ok":
                series.setdefault(f"{fw} {r['loss']}", {})[r["S"]] = r["bytes"] / 2**20
        logits = {r["S"]: r["logits_f32_bytes"] / 2**20 for r in records if r["framework"] == fw}
        series["f32 logits [S, vocab]"] = logits
        panels.append(
            Panel(f"{fw}: one train step, tiny, vocab 32k, batch 1", "sequence length", ylabel, series, logx=2)
        )
    return draw(out_dir, "fused_loss_memory.png", "Memory vs sequence length: dense vs fused loss (this CPU)", panels)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.tools.fused_loss", description=__doc__.split("\n")[0])
    p.add_argument("--shape", action="append", choices=list(SHAPES), help="repeatable (default: all of SHAPES)")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--memory-sweep", action="store_true", help="memory vs sequence length instead of step times")
    p.add_argument("--out", default=default_out("fused-loss"))
    a = p.parse_args(argv)
    out = check_out_dir(a.out)
    from .. import measure as m

    if a.memory_sweep:
        records = memory_sweep()
        print(write_results(out, "fused_loss_memory", records, m.env_info()))
        plot = plot_memory(out, records)
        print(plot.path if plot else "no plot (matplotlib missing)")
        return 0
    records = [r for name in a.shape or list(SHAPES) for r in measure(name, a.rounds, a.warmup)]
    print(write_results(out, "fused_loss", records, m.env_info()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
