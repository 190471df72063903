"""The porting debugger: run one checkpoint through both twins and show, tensor by tensor and layer by layer, where
the numbers part, and whether that is rounding or a bug.

    python -m parity_tests.diff --init runs/tiny-init --text "The capital of France" --dtype bf16 --plot diff.png

Loads the same weights into both twins (each with its own loader: ``torchref.hf`` / ``jaxattn.hf``), runs the same
tokens, and captures every named intermediate (:data:`KINDS`: the embedding; per layer the q/k/v projections, q and
k after RoPE, the attention output before and after ``o_proj``, the residual stream after attention, the MLP
gate/up/hidden, the layer output; the final norm; the logits; with
``--grads`` every parameter's gradient of the mean next-token loss). Each tensor is compared with a float64 run of
the torch twin (design §7): each twin's error is measured in units of the compute dtype's unit roundoff
(:func:`rounding_error`), and ``ratio`` is the worse twin's error over the rounding floor, the better twin's (at least
one unit). Both twins right: the two errors are rounding of the same size, ratio ~1. One twin wrong: its error is
many floors, ratio 10^2 to 10^7. The table marks the FIRST tensor above ``--tolerance`` (default 4); exit 0 when
none is, 1 when one is, 2 on bad input (also a Mixture-of-Experts model, whose routed experts have no per-layer
MLP to hook, another architecture's ``model_type``, and non-finite weights, which have no rounding floor). Rows
between §7's kernel rule (2) and the tolerance are marked ``~``: through a whole model the twins' per-op differences
compound (SmolLM2-135M, ``benchmarks/results/porting-diff/``: correct twins reach 2.39 on the fp32 logits and 2.37
on a bf16 gradient), so 2 is the rule for one op and 4 the default for a model; ``--tolerance 2`` applies the
kernel rule everywhere.

Capture changes no model file. torch: forward hooks on the Hugging Face-named modules (:data:`TORCH_HOOKS`) and a
wrapper around the ``dot_product_attention`` name ``torchref.model`` calls (q, k after RoPE). JAX: the model's own
jitted call with ``jaxattn.model``'s ``checkpoint_name`` (the tags the remat policies use), its
``dot_product_attention`` / ``decoder_layer`` names and ``Llama.features`` wrapped to add an ordered
``jax.debug.callback``: the layers still run under ``lax.scan``, and the callbacks arrive in layer order. The
float64 reference is the torch twin with ``.double()`` weights, attention by the float64 softmax here (torchref's
attention takes 16/32-bit floats only), and ``Tensor.float()`` (the twin's "at least float32" upcasts in RMSNorm and
RoPE) keeping float64 while it runs.
Written by hand: no library compares two frameworks' intermediates.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
import os
import sys
from collections import defaultdict

import numpy as np

import jaxattn  # noqa: F401 - before any jax import: jaxattn.cuda_quiet's quiet start (no CUDA noise, no TPU client)
from twincore.cli import CLIError, OneLineParser
from twincore.tensors import LAYER_TENSORS, TORCH_HOOKS

# The tensors compared, in forward order: the embedding, then per layer (twincore.tensors: the remat tags plus q and
# k after RoPE, Hugging Face's module names), then the final norm and the logits. torch side, per decoder layer:
# (name, submodule of ``model.layers.{i}``, "out" = its output | "in" = its input).
LAYER_KINDS: tuple[str, ...] = tuple(t.name for t in LAYER_TENSORS)
KINDS: tuple[str, ...] = ("embed",) + LAYER_KINDS + ("final_norm", "logits")
TORCH_GLOBAL_HOOKS: tuple[tuple[str, str], ...] = (("embed", "model.embed_tokens"), ("final_norm", "model.norm"))

# Design §7's rule for one kernel against a naive implementation, and the default for a whole model (the module
# docstring says why they differ).
KERNEL_RULE = 2.0
DEFAULT_TOLERANCE = 4.0

# Unit roundoff of each compute dtype: the smallest error floor a tensor of largest value m gets is u * m.
UNIT_ROUNDOFF: dict[str, float] = {"float32": 2.0**-24, "bfloat16": 2.0**-8, "float16": 2.0**-11}
DTYPES: dict[str, str] = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
DEFAULT_TEXT = "The quick brown fox jumps over the lazy dog."


def _np64(x) -> np.ndarray:
    """A host float64 copy of a torch tensor or a jax array."""
    if hasattr(x, "detach"):
        x = x.detach().float() if x.dtype != _torch().float64 else x.detach()
        return x.cpu().numpy().astype(np.float64)
    return np.asarray(x).astype(np.float64)


def _torch():
    import torch

    return torch


# ----------------------------------------------------------------------------------------------------- torch side
def _attention64(q, k, v, *, causal=True, segment_ids=None, **_):
    """float64 causal GQA softmax attention in torch layout (q ``[B, Hq, S, D]``), for the reference run."""
    torch = _torch()
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)  # [B, Hq, S, D]
    s = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])  # [B, Hq, Sq, Sk]
    sq, sk = s.shape[-2:]
    visible = torch.arange(sk)[None, :] <= torch.arange(sq)[:, None] + (sk - sq)
    return torch.softmax(s.masked_fill(~visible, float("-inf")), dim=-1) @ v


@contextlib.contextmanager
def _float_keeps_float64():
    """``Tensor.float()`` returns a float64 tensor unchanged while the block runs (the reference's upcasts)."""
    torch = _torch()
    original = torch.Tensor.float

    def float_(self, *args, **kwargs):
        return self if self.dtype == torch.float64 else original(self, *args, **kwargs)

    torch.Tensor.float = float_
    try:
        yield
    finally:
        torch.Tensor.float = original


@contextlib.contextmanager
def _torch_run(model, autocast=None, backend=None, tap=None):
    """Runs a torchref model in: a float64 model as the reference (float64 attention, ``.float()`` keeping float64),
    any other under ``autocast`` and the attention ``backend``. ``tap(q, k)`` sees q and k after RoPE."""
    torch = _torch()
    import torchref.model as tm
    from torchref.attention import attention_backend

    reference = model.lm_head.weight.dtype == torch.float64
    real = tm.dot_product_attention
    inner = _attention64 if reference else real

    def attention(q, k, v, **kw):  # q [B, Hq, S, D], k/v [B, Hkv, S, D]
        if tap is not None:
            tap(q, k)
        return inner(q, k, v, **kw)

    tm.dot_product_attention = attention
    try:
        with contextlib.ExitStack() as stack:
            if reference:
                stack.enter_context(_float_keeps_float64())
            if autocast is not None:
                stack.enter_context(autocast)
            if backend is not None and not reference:
                stack.enter_context(attention_backend(backend))
            yield
    finally:
        tm.dot_product_attention = real


def capture_torch(model, ids: np.ndarray, *, autocast=None, backend=None) -> dict:
    """``{(kind, layer): float64 array}`` of one forward of a torchref model (``layer`` None outside the layers).

    ``autocast``: a context manager to run under (a precision policy's); ``backend``: a torchref attention backend
    name. A float64 model runs as the reference (see the module docstring)."""
    torch = _torch()
    out: dict = {}
    state = {"layer": None}
    handles = []

    def hook(kind, layer, where):
        def fn(module, args, result=None):
            out[(kind, layer)] = _np64(args[0] if where == "in" else result)

        return fn

    def tap(q, k):
        out[("q_rope", state["layer"])] = _np64(q.transpose(1, 2))  # [B, S, Hq, D]
        out[("k_rope", state["layer"])] = _np64(k.transpose(1, 2))  # [B, S, Hkv, D]

    for kind, name in TORCH_GLOBAL_HOOKS:
        handles.append(model.get_submodule(name).register_forward_hook(hook(kind, None, "out")))
    for i, layer in enumerate(model.model.layers):
        handles.append(layer.self_attn.register_forward_pre_hook(lambda m, a, i=i: state.update(layer=i)))
        for kind, name, where in TORCH_HOOKS:
            mod = layer.get_submodule(name) if name else layer
            handles.append(
                mod.register_forward_pre_hook(hook(kind, i, "in"))
                if where == "in"
                else mod.register_forward_hook(hook(kind, i, "out"))
            )
    try:
        with torch.no_grad(), _torch_run(model, autocast, backend, tap):
            logits = model(torch.as_tensor(ids))
    finally:
        for h in handles:
            h.remove()
    out[("logits", None)] = _np64(logits)
    return out


def torch_grads(model, ids: np.ndarray, *, autocast=None, backend=None) -> dict:
    """``{hf_name: float64 gradient}`` of the mean next-token cross-entropy of one batch."""
    torch = _torch()
    model.zero_grad(set_to_none=True)
    with _torch_run(model, autocast, backend):
        logits = model(torch.as_tensor(ids))  # [1, S, V]
        labels = torch.as_tensor(ids)[:, 1:].reshape(-1)
        torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels).backward()
    return {n: _np64(p.grad) for n, p in model.named_parameters() if p.grad is not None}


@contextlib.contextmanager
def planted_rope_bug(layer: int, n_layers: int):
    """The ``--plant-rope-bug`` demo: RoPE's sin has the wrong sign in torch's decoder layer ``layer`` (the twin
    run, not the float64 reference), to see what a bug looks like. ``apply_rope`` runs twice per layer, in order."""
    torch = _torch()
    import torchref.model as tm

    real, calls = tm.apply_rope, [0]

    def apply_rope(x, cos, sin):
        if x.dtype == torch.float64:
            return real(x, cos, sin)
        i = calls[0] // 2 % n_layers
        calls[0] += 1
        return real(x, cos, -sin if i == layer else sin)

    tm.apply_rope = apply_rope
    try:
        yield
    finally:
        tm.apply_rope = real


# ------------------------------------------------------------------------------------------------------- JAX side
@contextlib.contextmanager
def _jax_taps(record):
    """Wraps ``jaxattn.model``'s ``checkpoint_name``, ``dot_product_attention``, ``decoder_layer`` and
    ``Llama.features`` so each tagged value also goes to ``record(kind, array)`` through an ordered
    ``jax.debug.callback`` (in layer order)."""
    import jax

    import jaxattn.model as jm

    names = ("checkpoint_name", "dot_product_attention", "decoder_layer")
    real = {n: getattr(jm, n) for n in names}
    real_features = jm.Llama.features

    def tap(kind, x):
        jax.debug.callback(lambda v: record(kind, v), x, ordered=True)

    def checkpoint_name(x, name):
        tap(name, x)
        return real["checkpoint_name"](x, name)

    def dot_product_attention(q, k, v, **kw):  # [B, S, H, D] after RoPE
        tap("q_rope", q)
        tap("k_rope", k)
        return real["dot_product_attention"](q, k, v, **kw)

    def decoder_layer(x, *args, **kw):
        tap("layer_input", x)  # layer 0's is the embedding
        return real["decoder_layer"](x, *args, **kw)

    def features(self, *args, **kw):  # the final-norm hidden states the LM head reads (no cache here)
        out = real_features(self, *args, **kw)
        tap("final_norm", out)
        return out

    for n, fn in zip(names, (checkpoint_name, dot_product_attention, decoder_layer)):
        setattr(jm, n, fn)
    jm.Llama.features = features
    try:
        yield
    finally:
        for n in names:
            setattr(jm, n, real[n])
        jm.Llama.features = real_features


def _jax_state(model, policy):
    from flax import nnx

    graphdef, state = nnx.split(model)
    return graphdef, (state if policy is None else policy.cast_to_compute(state))


def capture_jax(model, ids: np.ndarray, *, policy=None, backend=None) -> dict:
    """``{(kind, layer): float64 array}`` of one jitted forward of a jaxattn model (same keys as
    :func:`capture_torch`); ``policy`` a ``jaxattn.precision.Policy`` cast on the state, ``backend`` a jaxattn
    attention backend name."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jaxattn.attention import attention_backend

    seen: dict = defaultdict(list)
    graphdef, state = _jax_state(model, policy)
    with contextlib.ExitStack() as stack:
        if backend is not None:
            stack.enter_context(attention_backend(backend))
        stack.enter_context(_jax_taps(lambda kind, v: seen[kind].append(np.asarray(v, np.float64))))
        logits = jax.jit(lambda st, t: nnx.merge(graphdef, st)(t))(state, jnp.asarray(ids))
        jax.block_until_ready(logits)
        jax.effects_barrier()
    out = {("embed", None): seen["layer_input"][0], ("final_norm", None): seen["final_norm"][0]}
    for kind in LAYER_KINDS:  # one value per layer, in layer order
        out.update({(kind, i): value for i, value in enumerate(seen[kind])})
    out[("logits", None)] = _np64(logits)
    return out


def jax_grads(model, ids: np.ndarray, *, policy=None, backend=None) -> dict:
    """``{hf_name: float64 gradient}`` (HF layout, via ``jaxattn.hf.to_state_dict``) of the same loss as
    :func:`torch_grads`."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from jaxattn import hf as jhf
    from jaxattn.attention import attention_backend

    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    tokens = jnp.asarray(ids)

    def loss(p):
        st = p if policy is None else policy.cast_to_compute(p)
        logits = nnx.merge(graphdef, st, rest)(tokens)
        return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], tokens[:, 1:]).mean()

    with attention_backend(backend) if backend is not None else contextlib.nullcontext():
        grads = jax.jit(jax.grad(loss))(params)
    return {k: v.astype(np.float64) for k, v in jhf.to_state_dict(nnx.merge(graphdef, grads, rest)).items()}


# -------------------------------------------------------------------------------------------------- comparison
def rounding_error(x: np.ndarray, ref: np.ndarray, unit_roundoff: float) -> float:
    """The error of ``x`` against ``ref`` in units of the dtype's unit roundoff: the root mean square over elements
    of ``|x - ref| / (|ref| + rms(ref))``, each element's error relative to its own size (so a few very large
    activations do not decide it, and near-zero ones are measured against the tensor's scale), divided by ``u``.
    A correct implementation makes an error of a few units; a bug, many orders more."""
    if not x.size:
        return 0.0
    rel = np.abs(x - ref) / (np.abs(ref) + _rms(ref) + np.finfo(np.float64).tiny)
    return _rms(rel) / unit_roundoff


def compare(torch_out: dict, jax_out: dict, ref: dict, *, unit_roundoff: float, tolerance: float) -> list[dict]:
    """One row per tensor (in ``ref``'s order): each twin's :func:`rounding_error` against the float64 reference,
    the twins' max-abs difference (and relative to ``max|ref|``), and ``ratio`` = the worse twin's error / the
    rounding floor, the better twin's error but at least one unit roundoff; ``ok`` = ratio <= ``tolerance``. Shapes
    must agree (torch's layout is turned to JAX's at capture)."""
    rows = []
    for key, r in ref.items():
        kind, layer = key
        a, b = torch_out[key], jax_out[key]
        if a.shape != r.shape or b.shape != r.shape:
            raise AssertionError(f"{kind} layer {layer}: shapes torch {a.shape}, jax {b.shape}, reference {r.shape}")
        scale = float(np.abs(r).max()) if r.size else 0.0
        err_t, err_j = rounding_error(a, r, unit_roundoff), rounding_error(b, r, unit_roundoff)
        diff = float(np.abs(a - b).max()) if r.size else 0.0
        ratio = max(err_t, err_j) / max(min(err_t, err_j), 1.0)  # the floor: the better twin, at least 1 unit
        rows.append(
            {
                "tensor": kind,
                "layer": layer,
                "shape": list(r.shape),
                "max_abs_diff": diff,
                "max_rel_diff": diff / scale if scale else 0.0,
                "torch_err": err_t,
                "jax_err": err_j,
                "ratio": ratio,
                "worse": "torch" if err_t > err_j else "jax",
                "ok": bool(ratio <= tolerance),
            }
        )
    return rows


def _rms(x: np.ndarray) -> float:
    return float(np.sqrt(np.mean(np.square(x)))) if x.size else 0.0


def _grad_keys(grads: dict) -> dict:
    """HF parameter names -> ``("grad <module>", layer)``: ``model.layers.1.self_attn.q_proj.weight`` ->
    ``("grad self_attn.q_proj", 1)``, ``model.norm.weight`` -> ``("grad norm", None)``."""
    out = {}
    for name, value in grads.items():
        parts = name.removesuffix(".weight").split(".")
        if parts[:2] == ["model", "layers"]:
            out[("grad " + ".".join(parts[3:]), int(parts[2]))] = value
        else:
            out[("grad " + ".".join(parts[1:] if parts[0] == "model" else parts), None)] = value
    return out


def first_mismatch(rows: list[dict]) -> dict | None:
    return next((r for r in rows if not r["ok"]), None)


def format_table(rows: list[dict], tolerance: float) -> str:
    """The printed table; ``<-- first`` marks the first row above the tolerance, ``x`` every other one, ``~`` a row
    between :data:`KERNEL_RULE` and the tolerance."""
    head = f"{'tensor':<30}{'layer':>6}{'max|t-j|':>11}{'rel':>10}{'torch (u)':>11}{'jax (u)':>11}{'ratio':>10}"
    lines = [head, "-" * len(head)]
    first = first_mismatch(rows)
    for r in rows:
        mark = "  <-- first" if r is first else "  x" if not r["ok"] else "  ~" if r["ratio"] > KERNEL_RULE else ""
        layer = "-" if r["layer"] is None else str(r["layer"])
        lines.append(
            f"{r['tensor']:<30}{layer:>6}{r['max_abs_diff']:>11.2e}{r['max_rel_diff']:>10.1e}"
            f"{_num(r['torch_err']):>11}{_num(r['jax_err']):>11}{_num(r['ratio']):>10}{mark}"
        )
    bad = sum(not r["ok"] for r in rows)
    if first is None:
        band = sum(r["ratio"] > KERNEL_RULE for r in rows)
        more = f" ({band} between the one-op rule {KERNEL_RULE:g}x and {tolerance:g}x, marked ~)" if band else ""
        lines.append(f"all {len(rows)} tensors within {tolerance:g}x the rounding floor{more}")
    else:
        where = "" if first["layer"] is None else f"layer {first['layer']} "
        lines.append(
            f"first mismatch: {where}{first['tensor']}: {first['worse']}'s error is {first['ratio']:.3g}x the "
            f"rounding floor (tolerance {tolerance:g}); {bad} of {len(rows)} tensors above it"
        )
    return "\n".join(lines)


def _num(x: float) -> str:
    """A table cell: two decimals below 1000, else two significant digits in e-notation."""
    return f"{x:.2f}" if x < 1000 else f"{x:.2e}"


def plot(rows: list[dict], n_layers: int, tolerance: float, path: str, title: str) -> None:
    """Error vs depth: the ratio to the rounding floor (left, the tolerance drawn, the first mismatch circled) and
    max|torch - jax| / max|ref| (right), one line per tensor kind; the embedding sits at x = -1, the final norm and
    the logits at x = n_layers. Exact agreement (0) is not drawn on the log axes; gradients are in the table only."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    from twincore.atomic import atomic_path

    fig, (ax_r, ax_d) = plt.subplots(1, 2, figsize=(13, 4.8), sharex=True)
    colors = plt.get_cmap("tab20").colors
    first = first_mismatch(rows)
    for c, kind in enumerate(KINDS):
        pts = sorted(
            (-1 if r["layer"] is None and kind == "embed" else n_layers if r["layer"] is None else r["layer"], r)
            for r in rows
            if r["tensor"] == kind
        )
        for ax, field in ((ax_r, "ratio"), (ax_d, "max_rel_diff")):
            xy = [(x, r[field]) for x, r in pts if r[field] > 0]
            if xy:
                xs, ys = zip(*xy)
                ax.plot(xs, ys, "-o" if len(xs) > 1 else "s", ms=4, color=colors[c % 20], label=kind)
    lines = [ax_r.axhline(tolerance, color="k", ls="--", lw=1, label=f"tolerance {tolerance:g}x")]
    if tolerance != KERNEL_RULE:
        lines.append(ax_r.axhline(KERNEL_RULE, color="grey", ls=":", lw=1, label=f"one op's rule {KERNEL_RULE:g}x"))
    if first is not None and first["tensor"] in KINDS:
        x = first["layer"] if first["layer"] is not None else (-1 if first["tensor"] == "embed" else n_layers)
        ax_r.plot([x], [first["ratio"]], "o", ms=14, mfc="none", mec="red", mew=2)
        where = "" if first["layer"] is None else f"layer {first['layer']} "
        ax_r.annotate(
            f"first: {where}{first['tensor']}", (x, first["ratio"]), textcoords="offset points", xytext=(8, -14)
        )
    ax_r.set(yscale="log", xlabel="layer (-1: embedding; last: final norm, logits)", ylabel="worse rms error / floor")
    ax_r.set_title("ratio to the rounding floor (~1: rounding, >> tolerance: a bug)")
    ax_d.set(yscale="log", xlabel="layer", ylabel="max|torch - jax| / max|reference|")
    ax_d.set_title("twin difference, relative to the tensor's scale")
    ax_r.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax_d.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    ax_r.legend(handles=lines, fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------------------------------------- CLI
def _parse(argv):
    from twincore import PRESET_NAMES
    from twincore.dtypes import PRECISION_PRESETS

    p = OneLineParser(
        prog="python -m parity_tests.diff", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--init", help="a Hugging Face Llama directory or a llama.cpp .gguf file")
    src.add_argument("--preset", choices=PRESET_NAMES, help="random weights of a dense preset (with --seed)")
    p.add_argument("--seed", type=int, default=0, help="--preset: the torch seed of the weights (default 0)")
    toks = p.add_mutually_exclusive_group()
    toks.add_argument("--tokens", help="token ids, comma- or space-separated (one row)")
    toks.add_argument("--text", help=f"text, encoded by the checkpoint's tokenizer (default {DEFAULT_TEXT!r})")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="fp32", help="both twins' weights (default fp32)")
    p.add_argument(
        "--precision-policy",
        choices=tuple(PRECISION_PRESETS),
        help="mixed precision instead of --dtype: JAX casts the state to the compute dtype, torch autocasts",
    )
    p.add_argument("--grads", action="store_true", help="also every parameter's gradient of the next-token loss")
    p.add_argument("--backend", help="JAX attention backend (jaxattn names: xla, flash, chunked, ...)")
    p.add_argument("--torch-backend", help="torch attention backend (default: --backend's twin where it has one)")
    p.add_argument(
        "--plant-rope-bug",
        type=int,
        metavar="LAYER",
        help="demo: flip the sign of RoPE's sin in torch's layer LAYER, to see what a bug looks like",
    )
    p.add_argument(
        "--tolerance",
        type=float,
        default=DEFAULT_TOLERANCE,
        help=f"largest accepted ratio (default {DEFAULT_TOLERANCE:g}; design §7 rule for one op: {KERNEL_RULE:g})",
    )
    p.add_argument("--json", help="write the rows and the verdict here")
    p.add_argument("--plot", help="write the error-vs-depth plot here (.png)")
    return p.parse_args(argv)


def _check(args) -> None:
    from twincore.atomic import check_writable
    from twincore.tokenizer import is_gguf

    if args.init is not None and not (os.path.isdir(args.init) or is_gguf(args.init)):
        raise CLIError(
            f"--init {args.init!r}: no such directory or .gguf file; expected a Hugging Face Llama directory or a GGUF"
        )
    if args.preset is not None:
        from twincore import ModelConfig

        _dense_only(ModelConfig.preset(args.preset), f"--preset {args.preset}")
    if args.precision_policy is not None and args.dtype != "fp32":
        raise CLIError(
            f"--dtype {args.dtype} and --precision-policy {args.precision_policy}: give one (a policy keeps fp32 "
            f"weights and sets the compute dtype itself)"
        )
    if not (math.isfinite(args.tolerance) and args.tolerance >= 1):
        raise CLIError(f"--tolerance {args.tolerance!r}: must be a finite number >= 1 (the ratio of two errors)")
    for flag in ("json", "plot"):
        path = getattr(args, flag)
        if path is not None:
            try:
                check_writable(path, f"--{flag}", is_dir=False)
            except ValueError as e:
                raise CLIError(str(e)) from None
    if args.plot is not None and not args.plot.endswith(".png"):
        raise CLIError(f"--plot {args.plot!r}: must end in .png")
    for flag in ("backend", "torch_backend"):
        name = getattr(args, flag)
        if name is not None:
            from twincore import attention as spec

            side = "jax" if flag == "backend" else "torch"
            try:
                spec.check_backend_names(name, f"--{flag.replace('_', '-')}", side)
            except (ValueError, TypeError) as e:
                raise CLIError(str(e)) from None


def _token_ids(args, vocab: int) -> np.ndarray:
    if args.tokens is not None:
        try:
            ids = [int(t) for t in args.tokens.replace(",", " ").split()]
        except ValueError:
            raise CLIError(f"--tokens {args.tokens!r}: integers separated by commas or spaces") from None
        if not ids:
            raise CLIError(f"--tokens {args.tokens!r}: give at least one token id")
        bad = [i for i in ids if not 0 <= i < vocab]
        if bad:
            raise CLIError(f"--tokens: id {bad[0]} is outside the model's vocabulary [0, {vocab})")
        return np.asarray([ids], np.int64)
    from twincore.tokenizer import load_tokenizer

    text = DEFAULT_TEXT if args.text is None else args.text
    tok = load_tokenizer(args.init)
    ids = [tok.bos_id] * bool(tok.add_bos and tok.bos_id is not None) + list(tok.encode(text))
    if not ids:
        raise CLIError("--text '': encodes to no tokens; give some text or --tokens")
    if max(ids) >= vocab:
        raise CLIError(
            f"--text: the tokenizer gave id {max(ids)}, outside the model's vocabulary [0, {vocab}); give --tokens"
        )
    return np.asarray([ids], np.int64)


def load_twins(args):
    """(torch model, JAX model), float32, from ``--init`` (each twin's own loader) or ``--preset`` (the torch
    model's seeded weights handed to JAX)."""
    from jaxattn import hf as jhf
    from torchref import hf as thf

    if args.preset is not None:
        from benchmarks.twins import twin_models
        from torchref.config import ModelConfig

        return twin_models(ModelConfig.preset(args.preset), seed=args.seed)
    where = f"--init {args.init!r}"
    try:
        tmodel = thf.from_pretrained(args.init).eval()
        _dense_only(tmodel.config, where)
        _finite_weights(thf.to_state_dict(tmodel), where)
        return tmodel, jhf.from_pretrained(args.init)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CLIError(f"{where}: cannot be loaded ({e})") from None


def _dense_only(cfg, where: str) -> None:
    """Refuses an MoE: its routed experts have no ``mlp.gate_proj`` / ``up_proj`` / ``down_proj`` to capture."""
    if cfg.is_moe:
        raise CLIError(
            f"{where}: a Mixture-of-Experts model (model_type {cfg.model_type!r}, {cfg.n_experts} experts); the "
            f"debugger compares dense Llama layers only (it captures each layer's gate/up/down MLP projections)"
        )


def _finite_weights(tensors: dict, where: str) -> None:
    """Refuses non-finite weights, naming the first such tensor: NaN has no rounding error to measure."""
    torch = _torch()
    for name, t in tensors.items():
        if not bool(torch.isfinite(t).all()):
            nan, inf = int(torch.isnan(t).sum()), int(torch.isinf(t).sum())
            raise CLIError(
                f"{where}: the checkpoint has non-finite weights, first {name} ({nan} NaN, {inf} inf of "
                f"{t.numel()}); the debugger compares finite numbers only"
            )


def run(args) -> dict:
    """Loads, captures, compares; the record that ``--json`` writes."""
    torch = _torch()
    tmodel, jmodel = load_twins(args)
    n_layers = tmodel.config.n_layers
    ids = _token_ids(args, tmodel.config.vocab_size)
    if args.grads and ids.shape[1] < 2:
        raise CLIError(f"--grads: the next-token loss needs at least 2 tokens, got {ids.shape[1]}")
    if args.plant_rope_bug is not None and not 0 <= args.plant_rope_bug < n_layers:
        raise CLIError(f"--plant-rope-bug {args.plant_rope_bug}: the model's layers are 0..{n_layers - 1}")
    ref_model = copy.deepcopy(tmodel).double()
    jpol, tpol = _policies(args)
    tmodel = tpol.cast_model(tmodel)
    compute = str(jpol.compute_dtype)
    u = UNIT_ROUNDOFF[compute]
    torch_backend = args.torch_backend or _torch_twin(args.backend)
    with contextlib.ExitStack() as stack:
        if args.plant_rope_bug is not None:
            stack.enter_context(planted_rope_bug(args.plant_rope_bug, n_layers))
        flag = "--torch-backend" if args.torch_backend else "--backend"
        stack.enter_context(_backend_errors(flag, torch_backend, "torch"))
        t_out = capture_torch(tmodel, ids, autocast=tpol.autocast("cpu"), backend=torch_backend)
        t_grads = torch_grads(tmodel, ids, autocast=tpol.autocast("cpu"), backend=torch_backend) if args.grads else {}
    with _backend_errors("--backend", args.backend, "JAX"):
        j_out = capture_jax(jmodel, ids, policy=jpol, backend=args.backend)
        j_grads = jax_grads(jmodel, ids, policy=jpol, backend=args.backend) if args.grads else {}
    ref = capture_torch(ref_model, ids)
    rows = compare(t_out, j_out, {k: ref[k] for k in _order(ref, n_layers)}, unit_roundoff=u, tolerance=args.tolerance)
    if args.grads:
        g_ref = _grad_keys(torch_grads(ref_model, ids))
        rows += compare(_grad_keys(t_grads), _grad_keys(j_grads), g_ref, unit_roundoff=u, tolerance=args.tolerance)
    first = first_mismatch(rows)
    return {
        "tool": "parity_tests.diff",
        "init": args.init,
        "checkpoint": os.path.basename(os.path.normpath(args.init)) if args.init else None,
        "preset": args.preset,
        "tokens": ids[0].tolist(),
        "dtype": args.dtype,
        "precision_policy": args.precision_policy,
        "compute_dtype": compute,
        "unit_roundoff": u,
        "backend": {"jax": args.backend, "torch": torch_backend},
        "tolerance": args.tolerance,
        "n_layers": n_layers,
        "plant_rope_bug": args.plant_rope_bug,
        "versions": _versions(torch),
        "passed": first is None,
        "first_mismatch": first,
        "rows": rows,
    }


@contextlib.contextmanager
def _backend_errors(flag: str, backend, side: str):
    """A chosen attention backend that cannot run here (torch SDPA finds no kernel, a JAX backend declines)
    becomes a CLIError naming the flag."""
    try:
        yield
    except (RuntimeError, ValueError, NotImplementedError) as e:
        if backend is None:
            raise
        first = " ".join(str(e).split())[:400] or type(e).__name__
        raise CLIError(f"{flag} {backend}: {side} cannot run this attention backend here ({first})") from None


def _policies(args):
    """(JAX, torch) precision policies: ``--dtype`` casts both twins' weights (fp32 / bf16 = the presets fp32 /
    bf16-pure, fp16 = float16 weights and compute); ``--precision-policy`` runs each twin's own mixed precision
    (JAX casts the state to the compute dtype, torch autocasts)."""
    import jaxattn.precision as jp
    import torchref.precision as tp

    name = args.precision_policy or {"fp32": "fp32", "bf16": "bf16-pure", "fp16": None}[args.dtype]
    if name is None:  # no preset names pure float16
        return jp.Policy("float16", "float16", "float32"), tp.Policy("float16", "float16", "float32")
    return jp.Policy.preset(name), tp.Policy.preset(name)


def _torch_twin(backend):
    """The torch backend paired with a JAX one (the backend table's torch-twin column), or None."""
    if backend is None:
        return None
    from twincore import attention as spec

    return next((b.name for b in spec.BACKENDS if b.name == backend and b.torch_twin is not None), None)


def _order(ref: dict, n_layers: int) -> list:
    """Forward order: embed, each layer's kinds, final norm, logits."""
    keys = [("embed", None)] + [(k, i) for i in range(n_layers) for k in LAYER_KINDS]
    return [k for k in keys + [("final_norm", None), ("logits", None)] if k in ref]


def _versions(torch) -> dict:
    import jax

    return {"jax": jax.__version__, "torch": torch.__version__}


def main(argv=None) -> int:
    try:
        args = _parse(argv)
        _check(args)
        record = run(args)
    except CLIError as e:
        print(f"python -m parity_tests.diff: error: {e}", file=sys.stderr)
        return 2
    title = f"{os.path.basename(os.path.normpath(args.init)) if args.init else args.preset}: {record['compute_dtype']}"
    title += f" compute{', policy ' + args.precision_policy if args.precision_policy else ''}"
    if args.plant_rope_bug is not None:
        title += f", planted RoPE bug in torch's layer {args.plant_rope_bug}"
    print(title)
    print(format_table(record["rows"], args.tolerance))
    if args.json is not None:
        from twincore.atomic import write_text_atomic

        write_text_atomic(args.json, json.dumps(record, indent=1) + "\n")
    if args.plot is not None:
        plot(record["rows"], record["n_layers"], args.tolerance, args.plot, title)
    return 0 if record["passed"] else 1


if __name__ == "__main__":
    import jaxattn  # noqa: F401  (first: quiet jax where the CUDA plugin is installed; see jaxattn.cuda_quiet)

    sys.exit(main())
