"""Model suite: the same Llama (one set of weights, ``twins.twin_models``) in both frameworks, dense and Mixture of
Experts (Mixtral-style, dropless: ``ragged_dot`` / ``torch._grouped_mm``): logits parity to 1e-4 first, then forward
and forward+backward timed as pairs: JAX and torch alternate in rounds (``measure.timeit_paired``), and each row
carries the paired JAX speed-up with its 95% interval and an ``unstable`` label (design §9), and the time of its
first call (``first_call_s``: JAX's trace and compile, torch's first eager call).

    records = run(quick=True)
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np

from .. import measure
from ..twins import twin_models

LOGITS_TOL = 1e-4  # design §7, fp32 full-model logits


def shapes(quick: bool) -> list[tuple[str, int, int]]:
    """``[(preset, B, S)]`` of the suite's rows."""
    if quick:
        return [("tiny", 8, 256), ("moe-tiny", 8, 256)]
    # moe-350m at B=2: its fwd_bwd compiles to 50 GiB at B=8 and 32 GiB at B=4 for an H100
    # (benchmarks/tools/suite_memory.py); with torch's ~1.45x beside it in one process, B=4 would not fit 80 GB
    return [("125m", 8, 1024), ("350m", 8, 1024), ("moe-350m", 2, 1024)]


def check_presets(quick: bool, presets) -> list[str]:
    """``presets`` as a list, after checking each is one of this suite's (ValueError naming them)."""
    known = [p for p, _, _ in shapes(quick)]
    bad = [p for p in presets if p not in known]
    if bad:
        raise ValueError(f"--preset: {bad} not in the model suite{' (quick)' if quick else ''}; choose from {known}")
    return list(presets)


def run(quick: bool, presets: list[str] | None = None, isolate: bool = True) -> list[dict]:
    """Records of every (preset, pass, framework). ``isolate`` (the default) measures each preset in a fresh
    process (``python -m benchmarks.suites.model PRESET B S QUICK OUT``), so no preset inherits the memory an
    earlier one left in JAX's or torch's allocator pool; either way a preset that runs out of memory is recorded
    as ``skipped`` with the reason, and its buffers are released before the next (:func:`release_memory`)."""
    records = measure.rows()
    for preset, b, s in shapes(quick):
        if presets is not None and preset not in presets:
            continue
        records.extend(_in_fresh_process(preset, b, s, quick) if isolate else preset_rows(preset, b, s, quick))
    return records


def preset_rows(preset: str, b: int, s: int, quick: bool = False) -> list[dict]:
    """One preset's four records (fwd, fwd_bwd x jax, torch) in this process; out of memory -> four ``skipped``."""
    try:
        return _measure(preset, b, s, quick)
    except Exception as e:  # noqa: BLE001 - only an allocation failure becomes a record; anything else is raised
        if not is_out_of_memory(e):
            raise
        return _skipped(preset, b, s, f"out of memory: {_first_line(e)}")
    finally:
        release_memory()


def is_out_of_memory(e: BaseException) -> bool:
    """torch's ``OutOfMemoryError`` or XLA's ``RESOURCE_EXHAUSTED`` (jax's allocation failure)."""
    return type(e).__name__ == "OutOfMemoryError" or "RESOURCE_EXHAUSTED" in str(e)


def release_memory() -> None:
    """Drop what a finished row left: garbage, jax's compiled-function caches (their constants and executables)
    and torch's cached CUDA blocks. JAX's own allocator pool keeps what it reserved until the process ends, which
    is why :func:`run` gives each preset a fresh process outside ``--quick``."""
    import gc

    gc.collect()
    if "jax" in sys.modules:
        import jax

        jax.clear_caches()
    if "torch" in sys.modules:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    gc.collect()


def _skipped(preset: str, b: int, s: int, reason: str) -> list[dict]:
    base = {"suite": "model", "preset": preset, "B": b, "S": s, "dtype": "float32", "status": "skipped"}
    return [
        {**base, "impl": "jaxattn" if fw == "jax" else "torchref", "framework": fw, "pass": name, "reason": reason}
        for name in ("fwd", "fwd_bwd")
        for fw in ("jax", "torch")
    ]


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]


def _in_fresh_process(preset: str, b: int, s: int, quick: bool) -> list[dict]:
    """:func:`preset_rows` in a child process (its records through a JSON file); a child that dies (killed for
    memory, a crash) gives four ``skipped`` records naming its exit status and the last line it printed."""
    import json
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory(prefix="model-suite-") as tmp:
        path = os.path.join(tmp, "rows.json")
        cmd = [sys.executable, "-m", "benchmarks.suites.model", preset, str(b), str(s), str(int(quick)), path]
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if proc.stdout:
            print(proc.stdout, end="", flush=True)
        if proc.returncode == 0 and os.path.exists(path):
            with open(path) as f:
                return json.load(f)
        last = (proc.stdout or "").strip().splitlines()[-1:] or ["no output"]
        return _skipped(preset, b, s, f"its process exited with status {proc.returncode}: {last[0][:300]}")


def jax_passes(graphdef) -> dict:
    """The suite's two jitted JAX programs over a split model (the real one here, an abstract one in
    ``benchmarks/tools/suite_memory.py``): ``{"fwd": f(state, tokens) -> logits, "fwd_bwd": g(params, rest,
    tokens[B, S+1]) -> (mean next-token cross-entropy, grads)}``."""
    import jax
    import optax
    from flax import nnx

    @jax.jit
    def fwd(state, tok):
        return nnx.merge(graphdef, state)(tok)

    def loss(params, rest, tok):
        logits = nnx.merge(graphdef, params, rest)(tok[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tok[:, 1:]).mean()

    return {"fwd": fwd, "fwd_bwd": jax.jit(jax.value_and_grad(loss))}


def _measure(preset: str, b: int, s: int, quick: bool) -> list[dict]:
    import jax
    import jax.numpy as jnp
    import torch
    from flax import nnx

    from jaxattn import precision as jprec
    from torchref import precision as tprec
    from torchref.config import ModelConfig as TConfig

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    rounds, per_round, warmup = (10, 3, 2) if quick else (8, 3, 2)  # 30 / 24 timed calls a side
    tcfg = TConfig.preset(preset)
    tmodel, jmodel = twin_models(tcfg, seed=0, perturb_norms=False)
    tmodel = tmodel.to(dev)
    tokens = np.random.default_rng(0).integers(0, tcfg.vocab_size, (b, s), dtype=np.int32)
    t_tok = torch.from_numpy(tokens).long().to(dev)
    j_tok = jnp.asarray(tokens)
    graphdef, state = nnx.split(jmodel)
    params, rest = nnx.split(jmodel, nnx.Param, ...)[1:]
    del jmodel
    j_fwd, j_fwd_bwd = jax_passes(graphdef).values()

    def t_fwd(tok):
        with torch.no_grad():
            return tmodel(tok)

    def t_fwd_bwd(tok):
        logits = tmodel(tok[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tok[:, 1:].flatten())
        loss.backward()
        tmodel.zero_grad(set_to_none=True)
        return loss

    # The parity gate runs both sides at highest fp32 matmul precision (on GPU jax defaults to TF32 for
    # fp32 dots); the timed functions below keep each framework's default.
    with jprec.matmul_precision("highest"), tprec.matmul_precision("highest"):
        j_logits = jax.jit(lambda st, t: nnx.merge(graphdef, st)(t))(state, j_tok)
        diff = float(np.abs(np.asarray(j_logits) - t_fwd(t_tok).cpu().numpy()).max())
    del j_logits
    if not diff <= LOGITS_TOL:
        raise AssertionError(
            f"{preset}: JAX and torch logits differ by {diff:.3g} > {LOGITS_TOL}; "
            "not timing a model pair that disagrees"
        )
    base = {"suite": "model", "preset": preset, "B": b, "S": s, "dtype": "float32"}
    passes = {
        "fwd": {"jax": lambda: j_fwd(state, j_tok), "torch": lambda: t_fwd(t_tok)},
        "fwd_bwd": {"jax": lambda: j_fwd_bwd(params, rest, j_tok), "torch": lambda: t_fwd_bwd(t_tok)},
    }
    records = []
    for name, calls in passes.items():
        measure.torch_reset_peak()
        first = {fw: _first_call_s(call) for fw, call in calls.items()}
        t = measure.timeit_paired(calls, rounds=rounds, per_round=per_round, warmup=warmup)
        for fw in ("jax", "torch"):
            records.append(
                {
                    **base,
                    "impl": "jaxattn" if fw == "jax" else "torchref",
                    "framework": fw,
                    "pass": name,
                    "median_ms": 1e3 * t[fw]["median_s"],
                    "p10_ms": 1e3 * t[fw]["p10_s"],
                    "p90_ms": 1e3 * t[fw]["p90_s"],
                    "iters": t[fw]["iters"],
                    "cv": t[fw]["cv"],
                    "tokens_per_s": b * s / t[fw]["median_s"],
                    "first_call_s": round(first[fw], 4),
                    "peak_mem_bytes": measure.jax_peak_memory() if fw == "jax" else measure.torch_peak_memory(),
                    "max_abs_diff": diff,
                    "paired": t["paired"],
                    "loadavg": list(os.getloadavg()),
                    "status": "ok",
                }
            )
    return records


def _first_call_s(call) -> float:
    """Seconds of ``call``'s first run (a jitted function traces and compiles there), synchronised."""
    t0 = time.perf_counter()
    measure.sync(call())
    return time.perf_counter() - t0


def _main(argv: list[str]) -> int:
    """``python -m benchmarks.suites.model PRESET B S QUICK OUT_JSON``: one preset's records into OUT_JSON (the
    fresh process of :func:`run`; QUICK 1 or 0)."""
    import json

    from ..report.records import write_text_atomic

    preset, b, s, quick, out = argv
    write_text_atomic(out, json.dumps(preset_rows(preset, int(b), int(s), quick == "1"), default=str))
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
