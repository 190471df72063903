"""Remat suite: what each activation-checkpointing policy keeps for the backward pass, and what it recomputes.

    records = run(quick=True, policies=("none", "full"))    # python -m benchmarks run --suite remat [--quick]

JAX: the bf16 train step compiled (CPU and deviceless H100), never run; torch: the step run here, bytes kept for
the backward counted. What is measured and how: benchmarks/NOTES.md ("remat").
"""

from __future__ import annotations

import gc
import time
import weakref

import numpy as np

from .. import measure
from ..tools.deviceless import target_config
from ..tools.programs import cost_stats, memory_stats

ORDER = ("none", "save_dots", "save_qkv_attn", "full")
LABEL = "compiled for H100, not run"


def _cases(quick: bool):
    """``[(preset, overrides, batch, seq, frameworks)]``."""
    if quick:
        return [("tiny", {}, 2, 128, ("jax", "torch"))]
    return [("1b", {}, 4, 2048, ("jax",)), ("1b", {"n_layers": 2}, 1, 512, ("jax", "torch"))]


def _base(framework: str, policy: str, target: str, preset: str, cfg, batch: int, seq: int) -> dict:
    """The keys of a remat record: which framework, policy, target and model at which shape (bf16)."""
    return dict(
        suite="remat",
        framework=framework,
        impl=policy,
        target=target,
        preset=preset,
        n_layers=cfg.n_layers,
        B=batch,
        S=seq,
        dtype="bf16",
    )


def _summary(m: dict, key: str) -> str:
    s = f"{m[key] / 2**20:.4g} MiB"
    if m.get("bytes_ratio") is not None:
        s += f" ({m['bytes_ratio']:.2f}x)"
    if m.get("residual_ratio") is not None:
        s += f", residuals {m['residual_bytes'] / 2**20:.4g} MiB ({m['residual_ratio']:.2f}x)"
    if m.get("flops_ratio") is not None:
        s += f", {m['flops_ratio']:.2f}x FLOPs"
    return s


def _add_ratios(records: list, key: str) -> None:
    """``bytes_ratio`` / ``flops_ratio`` to the ``none`` record of the same group, the summary, and on ``none``
    whether the expected order holds."""
    groups: dict = {}
    for r in records:
        if r.get("status") == "ok":
            groups.setdefault((r["framework"], r["target"], r["preset"], r["n_layers"], r["B"], r["S"]), {})[
                r["impl"]
            ] = r
    for group in groups.values():
        base = group.get("none")
        for r in group.values():
            m = r["measured"]
            if base is not None:
                b = base["measured"]
                m["bytes_ratio"] = m[key] / b[key] if b[key] else None
                if "residual_bytes" in m and b.get("residual_bytes"):
                    m["residual_ratio"] = m["residual_bytes"] / b["residual_bytes"]
                m["flops_ratio"] = m["flops"] / b["flops"] if b.get("flops") and m.get("flops") is not None else None
            r["summary"] = _summary(m, key)
        if base is not None and all(p in group for p in ORDER):
            vals = [group[p]["measured"][key] for p in ORDER]
            base["measured"]["order_holds"] = all(a > b for a, b in zip(vals, vals[1:]))
            if all("residual_bytes" in group[p]["measured"] for p in ORDER):
                vals = [group[p]["measured"]["residual_bytes"] for p in ORDER]
                base["measured"]["residual_order_holds"] = all(a > b for a, b in zip(vals, vals[1:]))


# ------------------------------------------------------------------------------------------------------- JAX
def _jax_step(cfg, policy: str, batch: int, seq: int, device=None):
    """``(jitted step, (state, batch) ShapeDtypeStructs)`` of the bf16 train step with remat ``policy``."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from jaxattn import remat
    from jaxattn.model import Llama
    from jaxattn.train_step import TrainState, make_train_step

    tx = optax.adamw(1e-4)
    model = remat.apply(nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0))), policy, device=device)
    graphdef = nnx.split(model, nnx.Param, ...)[0]

    def create():
        return TrainState.create(remat.apply(Llama(cfg, rngs=nnx.Rngs(0)), policy, device=device), tx, policy="bf16")[1]

    state = jax.eval_shape(create)
    step = make_train_step(graphdef, tx, policy="bf16", donate=False, check_ids="off")
    return step.jitted, (state, {"tokens": jax.ShapeDtypeStruct((batch, seq + 1), jnp.int32)})


def jax_residual_bytes(cfg, policy: str, batch: int, seq: int) -> int:
    """Bytes of the residuals the bf16 loss's forward keeps for its backward (``jax.ad_checkpoint.
    saved_residuals``; parameters excluded): the JAX twin of torch's saved bytes, before XLA's scheduling."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jaxattn import remat
    from jaxattn.model import Llama
    from jaxattn.train_step import loss_fn

    model = remat.apply(nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0))), policy)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.bfloat16), params)
    tokens = jax.ShapeDtypeStruct((batch, seq + 1), jnp.int32)
    try:  # jax exports only print_saved_residuals; the list behind it is private
        from jax._src.ad_checkpoint import saved_residuals
    except ImportError:  # pragma: no cover - a jax that moved it
        saved_residuals = jax.ad_checkpoint.saved_residuals
    res = saved_residuals(lambda p, r, t: loss_fn(nnx.merge(graphdef, p, r), {"tokens": t}), params, rest, tokens)
    return int(sum(a.size * a.dtype.itemsize for a, why in res if not str(why).startswith("from the argument")))


def _jax_record(compiled, base: dict, t0: float) -> dict:
    mem, cost = memory_stats(compiled), cost_stats(compiled)
    host = compiled.memory_analysis()
    m = {
        "temp_bytes": mem["temp"],
        "argument_bytes": mem["argument"],
        "output_bytes": mem["output"],
        "host_temp_bytes": int(getattr(host, "host_temp_size_in_bytes", 0) or 0),
        "flops": cost["xla_flops"],
        "cost_source": cost["cost_source"],
        "compile_s": round(time.perf_counter() - t0, 1),
    }
    return dict(base, status="ok", measured=m)


def _jax_records(cases, policies, targets, log) -> list:
    import jax

    from jaxattn import gpu_target
    from jaxattn.attention import attention_backend
    from jaxattn.config import ModelConfig

    records = []
    devs, why = None, None
    if "h100" in targets:
        why = gpu_target.unavailable_reason()
        if why is None:
            try:
                devs = gpu_target.devices(target_config("h100"))
            except Exception as e:  # a plugin that is installed but does not start
                why = f"{type(e).__name__}: {e}"
    for preset, overrides, b, s, fws in cases:
        if "jax" not in fws:
            continue
        cfg = ModelConfig.preset(preset, **overrides)
        for target in targets:
            for policy in policies:
                base = _base("jax", policy, target, preset, cfg, b, s)
                if target == "h100":
                    base["label"] = LABEL
                t0 = time.perf_counter()
                try:
                    if target == "cpu":
                        jitted, args = _jax_step(cfg, policy, b, s)
                        compiled = jitted.lower(*args).compile()
                    elif devs is None:
                        raise _Skip(f"deviceless H100 compile unavailable: {why}")
                    else:  # a deviceless device lists no memory spaces: offload is checked on the CPU's
                        with attention_backend("flash"):
                            jitted, args = _jax_step(cfg, policy, b, s)
                            compiled = gpu_target.compile(None, *gpu_target.place(args, devs), jitted=jitted)[1]
                    rec = _jax_record(compiled, base, t0)
                    rec["measured"]["residual_bytes"] = jax_residual_bytes(cfg, policy, b, s)
                    log(
                        f"  jax {target} {preset} L={cfg.n_layers} B={b} S={s} {policy}: temp "
                        f"{rec['measured']['temp_bytes'] / 2**20:.1f} MiB in {rec['measured']['compile_s']} s"
                    )
                except _Skip as e:
                    rec = dict(base, status="skipped", reason=str(e))
                    log(f"  jax {target} {policy}: skipped, {e}")
                except Exception as e:  # one failed compile is a record, not the end of the suite
                    rec = dict(base, status="skipped", reason=f"{type(e).__name__}: {str(e)[:300]}")
                    log(f"  jax {target} {policy}: {rec['reason']}")
                records.append(rec)
                jax.clear_caches()
    return records


class _Skip(Exception):
    pass


# ------------------------------------------------------------------------------------------------------- torch
def torch_saved_bytes(model, batch, policy: str = "bf16") -> dict:
    """One training forward + backward of ``model`` (its ``remat`` as set) on ``batch``: ``saved_bytes`` (by
    device type) = bytes of the storages the forward created that are still alive when it returns, parameters
    excluded; ``flops`` of forward + backward (recomputation included)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves
    from torch.utils.flop_counter import FlopCounterMode

    from torchref.train_step import loss_fn

    class Created(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.refs = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    st = t.untyped_storage()
                    key = (t.device.type, st.data_ptr())
                    old = self.refs.get(key)
                    if old is None or old[0]() is None:  # a freed storage's address may be reused
                        self.refs[key] = (weakref.ref(st), st.nbytes())
            return out

    params = {(p.device.type, p.untyped_storage().data_ptr()) for p in model.parameters()}
    params |= {(b.device.type, b.untyped_storage().data_ptr()) for b in model.buffers()}
    model.zero_grad(set_to_none=True)
    created = Created()
    with FlopCounterMode(display=False) as flops:
        with created:
            loss = loss_fn(model, batch, policy=policy)
        gc.collect()
        saved: dict = {}
        for key, (ref, n) in created.refs.items():
            if ref() is not None and key not in params:
                saved[key[0]] = saved.get(key[0], 0) + n
        loss.backward()
    model.zero_grad(set_to_none=True)
    return {"saved_bytes": saved, "flops": float(flops.get_total_flops())}


def _torch_records(cases, policies, log) -> list:
    import torch

    from torchref import remat
    from torchref.config import ModelConfig
    from torchref.model import LlamaForCausalLM

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    records = []
    for preset, overrides, b, s, fws in cases:
        if "torch" not in fws:
            continue
        cfg = ModelConfig.preset(preset, **overrides)
        torch.manual_seed(0)
        model = LlamaForCausalLM(cfg).to(dev)
        tokens = torch.from_numpy(np.random.default_rng(0).integers(0, cfg.vocab_size, (b, s + 1))).to(dev)
        for policy in policies:
            base = _base("torch", policy, dev, preset, cfg, b, s)
            t0 = time.perf_counter()
            remat.apply(model, policy)
            measure.torch_reset_peak()
            out = torch_saved_bytes(model, {"tokens": tokens})
            m = {
                "saved_bytes": out["saved_bytes"].get(dev, 0),
                "saved_bytes_by_device": out["saved_bytes"],
                "flops": out["flops"],
                "peak_mem_bytes": measure.torch_peak_memory(),
                "run_s": round(time.perf_counter() - t0, 1),
            }
            records.append(dict(base, status="ok", measured=m))
            log(
                f"  torch {dev} {preset} L={cfg.n_layers} B={b} S={s} {policy}: saved "
                f"{m['saved_bytes'] / 2**20:.1f} MiB in {m['run_s']} s"
            )
        del model
        gc.collect()
    return records


def run(quick: bool, policies=None, targets=("cpu", "h100"), frameworks=("jax", "torch"), log=print) -> list:
    """Records for ``policies`` (default all), JAX ``targets`` (``cpu``, ``h100``) and ``frameworks``."""
    from twincore.remat import REMAT_POLICIES

    policies = tuple(policies or REMAT_POLICIES)
    bad = [p for p in policies if p not in REMAT_POLICIES] + [t for t in targets if t not in ("cpu", "h100")]
    if bad:
        raise ValueError(
            f"remat suite: unknown policies/targets {bad}; policies: {REMAT_POLICIES}, targets: ('cpu', 'h100')"
        )
    cases = _cases(quick)
    jax_recs = _jax_records(cases, policies, targets, log) if "jax" in frameworks else []
    torch_recs = _torch_records(cases, policies, log) if "torch" in frameworks else []
    _add_ratios(jax_recs, "temp_bytes")
    _add_ratios(torch_recs, "saved_bytes")
    return jax_recs + torch_recs
