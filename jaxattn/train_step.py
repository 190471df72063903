"""One training step for the Flax NNX Llama, the twin of ``torchref.train_step.make_train_step``.

    graphdef, state = TrainState.create(model, tx, policy="bf16")
    step = make_train_step(graphdef, tx, policy="bf16", max_grad_norm=1.0)
    state, metrics = step(state, {"tokens": tokens})       # metrics: loss, grad_norm, loss_scale, skipped

A jitted PURE function of ``(TrainState, batch)``: the model is split once outside and merged inside the trace
(flax's performance guide: no per-call graph traversal). The host checks the batch format and token ids first.
One step, in ``torch.amp``'s order: cast the float32 masters to the compute dtype inside the differentiated
function; mean next-token cross-entropy in float32 (masked targets dropped with ``where``, never ``0 * nan``);
gradients of ``loss * scale``, the non-finite check on the SCALED gradients, unscale; clipping with
``clip_grad_norm_``'s formula (``max_norm / (norm + 1e-6)``, which ``optax.clip_by_global_norm`` is not); the
update — or, on a non-finite step, the OLD params and optimizer state, and the scale backs off (optax's count
then does not advance, like a skipped ``optimizer.step``). ``TrainState.step`` counts calls.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct
from jax.experimental import checkify

from twincore.batch import BATCH_KEYS, check_batch, check_token_ids, token_id_error
from twincore.grad_accum import check_accum_batch, check_grad_accum
from twincore.loss import DEFAULT_CHUNK, check_loss

from .fused_ce import fused_cross_entropy
from .loss_scale import DynamicLossScale, LossScale, NoOpLossScale
from .model import ACT_AXES, _Tracer, per_shard
from .precision import Policy, get_policy

__all__ = [
    "TrainState",
    "make_train_step",
    "CHECK_IDS",
    "loss_fn",
    "moe_metrics",
    "loss_weights",
    "loss_denominator",
    "cross_entropy",
    "check_grad_accum",
    "check_accum_batch",
    "clip_by_global_norm",
    "global_norm",
    "BATCH_KEYS",
]

Batch = Mapping[str, jax.Array]
Metrics = dict[str, jax.Array]

_FP16_NO_SCALE = (
    "fp16 training WITHOUT dynamic loss scaling: float16 gradients underflow to zero and "
    "overflow to inf without it. Use Policy.preset('fp16').make_loss_scale() (a DynamicLossScale, "
    "torch.amp.GradScaler's rule) as TrainState.loss_scale, or train in bf16."
)
_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


@struct.dataclass
class TrainState:
    """Everything a step reads and writes, as one pytree (the model's graphdef stays outside, static).

    ``params``: the trainable ``nnx.Param`` state in the policy's param dtype (float32 masters);
    ``rest``: the model's other variables (e.g. the RoPE ``inv_freq``), passed through unchanged;
    ``opt_state``: the optax state; ``loss_scale``: ``DynamicLossScale`` (fp16) or ``NoOpLossScale``;
    ``step``: int32 count of step calls.
    """

    step: jax.Array
    params: nnx.State
    rest: nnx.State
    opt_state: optax.OptState
    loss_scale: DynamicLossScale | NoOpLossScale

    @classmethod
    def create(
        cls,
        model: nnx.Module,
        tx: optax.GradientTransformation,
        *,
        policy: str | Policy = "fp32",
        loss_scale: LossScale | None = None,
    ) -> tuple[nnx.GraphDef, TrainState]:
        """Splits ``model`` once; returns ``(graphdef, state)``. Params are cast to ``policy.param_dtype``;
        ``loss_scale`` defaults to ``policy.make_loss_scale()`` (a DynamicLossScale for fp16)."""
        policy = get_policy(policy)
        if not isinstance(tx, optax.GradientTransformation):
            raise TypeError(f"tx must be an optax.GradientTransformation, got {type(tx).__name__}")
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        params = policy.cast_to_param(params)
        if loss_scale is None:
            loss_scale = policy.make_loss_scale()
        if not isinstance(loss_scale, (DynamicLossScale, NoOpLossScale)):
            raise TypeError(f"loss_scale must be a DynamicLossScale or NoOpLossScale, got {type(loss_scale).__name__}")
        if policy.uses_loss_scaling and isinstance(loss_scale, NoOpLossScale):
            _warn_once(_FP16_NO_SCALE)
        return graphdef, cls(
            step=jnp.asarray(0, jnp.int32), params=params, rest=rest, opt_state=tx.init(params), loss_scale=loss_scale
        )

    def model(self, graphdef: nnx.GraphDef) -> nnx.Module:
        """The model with the current (master-dtype) parameters, e.g. for evaluation or checkpointing."""
        return nnx.merge(graphdef, self.params, self.rest)


# --------------------------------------------------------------------------------------------------------------
# Loss
# --------------------------------------------------------------------------------------------------------------


def loss_weights(batch: Batch) -> jax.Array:
    """float32 ``[B, S-1]`` weights of the targets ``tokens[:, 1:]``.

    ``loss_mask[b, t]`` (same shape as tokens) says whether token t counts as a TARGET; with ``segment_ids``,
    a target counts only when it is in the same segment as the token predicting it (no loss across document
    boundaries in packed sequences).
    """
    tokens = batch["tokens"]
    w = jnp.ones((tokens.shape[0], tokens.shape[1] - 1), jnp.float32)
    if batch.get("loss_mask") is not None:
        w = w * batch["loss_mask"][:, 1:].astype(jnp.float32)
    if batch.get("segment_ids") is not None:
        seg = batch["segment_ids"]
        w = w * (seg[:, 1:] == seg[:, :-1]).astype(jnp.float32)
    return w


def cross_entropy(
    logits: jax.Array, targets: jax.Array, weights: jax.Array, denominator: jax.Array | None = None
) -> jax.Array:
    """Weighted mean token cross-entropy in float32: ``sum(w * nll) / max(sum(w), 1)``; ``denominator``
    replaces ``max(sum(w), 1)`` (gradient accumulation divides each microbatch by the WHOLE batch's weight).

    Targets with ``w == 0`` are dropped with ``where`` on the logits and the targets BEFORE the cross-entropy (a
    NaN logit or an out-of-range target there stays out of the loss and out of its gradient, where ``0 * nan``
    would not)."""
    keep = weights > 0
    logits = jnp.where(keep[..., None], logits.astype(jnp.float32), 0.0)
    nll = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.where(keep, targets, 0))
    if denominator is None:
        denominator = jnp.maximum(jnp.sum(weights), 1.0)
    return jnp.sum(nll * weights) / denominator


def loss_denominator(batch: Batch) -> jax.Array:
    """float32 ``max(sum(loss_weights(batch)), 1)``: the number of real (loss-weighted) targets in ``batch``."""
    return jnp.maximum(jnp.sum(loss_weights(batch)), 1.0)


def loss_fn(
    model: Callable[..., jax.Array],
    batch: Batch,
    denominator: jax.Array | None = None,
    loss: str = "dense",
    loss_chunk: int = DEFAULT_CHUNK,
    moe_scale: float | None = None,
):
    """Next-token loss of ``model`` on ``batch`` (inputs ``tokens[:, :-1]``, targets ``tokens[:, 1:]``);
    ``denominator``: see :func:`cross_entropy`. ``loss="fused"``: the model's final hidden states
    (``model.features``) and its LM head (the embedding when tied) go to :func:`jaxattn.fused_ce.fused_cross_entropy`
    in chunks of ``loss_chunk`` tokens: the same number, never the ``[tokens, vocab]`` logits.

    ``moe_scale`` (training): returns ``(loss, moe)``; for a Mixture-of-Experts model the loss then also holds
    ``moe_scale * (router_aux_loss_coef * aux_loss + router_z_loss_coef * z_loss)`` and ``moe`` the router metrics
    (:func:`moe_metrics`; ``{}`` for a dense model). The router statistics count the tokens whose segment id is not
    0 (the data pipeline's padding), all tokens without segment ids."""
    tokens = batch["tokens"]
    pos, seg = batch.get("positions"), batch.get("segment_ids")
    inputs = dict(positions=None if pos is None else pos[:, :-1], segment_ids=None if seg is None else seg[:, :-1])
    routed = moe_scale is not None and getattr(getattr(model, "config", None), "is_moe", False)
    if routed:
        inputs.update(moe_stats=True, moe_mask=None if seg is None else seg[:, :-1] != 0)
    moe = None
    if loss == "fused":
        hidden = model.features(tokens[:, :-1], **inputs)  # [B, S, dim]
        if routed:
            hidden, moe = hidden
        tied = model.config.tie_embeddings
        head = model.embed[...] if tied else model.lm_head[...]  # [vocab, dim] tied, [dim, vocab] untied
        weights = loss_weights(batch)
        denominator = loss_denominator(batch) if denominator is None else denominator  # the whole batch's

        def rows(h, head, targets, w, denominator):  # one device's rows when sharded: [b, S, dim] -> [1]
            n = h.shape[0] * h.shape[1]
            return fused_cross_entropy(
                h.reshape(n, -1), head, targets.reshape(n), w.reshape(n), denominator, chunk=loss_chunk, transposed=tied
            )[None]

        # per device block (shard_map) when sharded: the head gathered once, its gradient reduced once, each chunk
        # local; under plain GSPMD every chunk step would gather the head and reduce-scatter its gradient
        parts = per_shard(
            rows,
            (hidden, head, tokens[:, 1:], weights, jnp.asarray(denominator, jnp.float32)),
            (ACT_AXES, (None, None), ("batch", "seq"), ("batch", "seq"), ()),
            ("batch",),
        )
        value = jnp.sum(parts)  # [devices along the batch] partial losses
    else:
        logits = model(tokens[:, :-1], **inputs)
        if routed:
            logits, moe = logits
        value = cross_entropy(logits, tokens[:, 1:], loss_weights(batch), denominator)
    if moe_scale is None:
        return value
    if moe is None:
        return value, {}
    cfg = model.config
    value = value + moe_scale * (cfg.router_aux_loss_coef * moe["aux_loss"] + cfg.router_z_loss_coef * moe["z_loss"])
    return value, moe_metrics(moe, cfg)


def moe_metrics(moe: Mapping[str, jax.Array], cfg) -> Metrics:
    """The train step's router metrics from ``jaxattn.moe.moe_losses``: ``aux_loss`` and ``z_loss`` (unweighted),
    ``expert_load_min`` / ``expert_load_max`` (the least and most loaded expert of any layer, as a multiple of a
    perfectly balanced share: 1.0 = balanced) and ``dropped_fraction`` (capacity-factor drops)."""
    load = moe["tokens_per_expert"].astype(jnp.float32)  # [L, E]; a pipeline's [m, L, E]: the mean over its m
    balanced = jnp.maximum(jnp.sum(load, axis=-1, keepdims=True), 1.0) / cfg.n_experts
    return {
        "aux_loss": moe["aux_loss"],
        "z_loss": moe["z_loss"],
        "expert_load_min": jnp.mean(jnp.min(load / balanced, axis=(-2, -1))),
        "expert_load_max": jnp.mean(jnp.max(load / balanced, axis=(-2, -1))),
        "dropped_fraction": moe["dropped_fraction"],
    }


# --------------------------------------------------------------------------------------------------------------
# Clipping
# --------------------------------------------------------------------------------------------------------------


def global_norm(tree: Any) -> jax.Array:
    """L2 norm over all leaves, accumulated in float32."""
    leaves = jax.tree.leaves(tree)
    return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in leaves))


def clip_by_global_norm(grads: Any, max_norm: float, norm: jax.Array | None = None) -> Any:
    """``torch.nn.utils.clip_grad_norm_``: ``g * min(max_norm / (norm + 1e-6), 1)``."""
    norm = global_norm(grads) if norm is None else norm
    coef = jnp.minimum(jnp.float32(max_norm) / (norm + jnp.float32(1e-6)), 1.0)
    return jax.tree.map(lambda g: (g.astype(jnp.float32) * coef).astype(g.dtype), grads)


# --------------------------------------------------------------------------------------------------------------
# The step
# --------------------------------------------------------------------------------------------------------------


def _vocab_size(graphdef: nnx.GraphDef, state: TrainState) -> int | None:
    config = getattr(nnx.merge(graphdef, state.params, state.rest), "config", None)
    return getattr(config, "vocab_size", None)


def _check_ids_in_jit(tokens: jax.Array, vocab: int) -> None:
    """``checkify.check`` that every id is in ``[0, vocab)``, naming the first bad one (position and value)."""
    bad = (tokens < 0) | (tokens >= vocab)
    first = jnp.argmax(bad.reshape(-1))
    row, col = jnp.divmod(first, tokens.shape[1])
    checkify.check(
        jnp.logical_not(bad.any()),
        token_id_error("batch['tokens']", vocab, "{value}", "({row}, {col})", "{n_bad}"),
        value=tokens.reshape(-1)[first],
        row=row,
        col=col,
        n_bad=bad.sum(),
    )


def _accumulated_grads(grad_fn: Callable, params: nnx.State, batch: Batch, grad_accum: int):
    """``(sum of grads, sum of aux)`` of ``grad_fn(params, microbatch, denominator)`` over ``grad_accum``
    microbatches (consecutive row blocks of ``batch``), as ONE ``lax.scan`` (one compiled body). The denominator
    is the WHOLE batch's target weight, so the sums equal the full batch's mean-token loss and its gradient (an
    MoE's router terms are each micro-batch's, weighted ``1 / grad_accum``: their mean, as torch's twin)."""
    denominator = loss_denominator(batch)
    if grad_accum == 1:
        return grad_fn(params, batch, denominator)
    micro = check_accum_batch(batch, grad_accum)
    split = {k: v.reshape(grad_accum, micro, *v.shape[1:]) for k, v in batch.items() if v is not None}

    def body(acc, mb):
        grads, loss = grad_fn(params, mb, denominator)
        return jax.tree.map(jnp.add, acc, (grads, loss)), None

    shapes = jax.eval_shape(lambda: grad_fn(params, jax.tree.map(lambda v: v[0], split), denominator))
    zeros = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), shapes)
    return jax.lax.scan(body, zeros, split)[0]


def _train_step(
    graphdef: nnx.GraphDef,
    state: TrainState,
    batch: Batch,
    *,
    tx: optax.GradientTransformation,
    policy: Policy,
    max_grad_norm: float | None,
    check_ids: bool = False,
    grad_accum: int = 1,
    loss: str = "dense",
    loss_chunk: int = DEFAULT_CHUNK,
) -> tuple[TrainState, Metrics]:
    check_batch(batch)
    check_accum_batch(batch, grad_accum)
    ls = state.loss_scale
    if policy.uses_loss_scaling and isinstance(ls, NoOpLossScale):
        _warn_once(_FP16_NO_SCALE)
    vocab = _vocab_size(graphdef, state) if check_ids else None
    if vocab is not None:
        _check_ids_in_jit(batch["tokens"], vocab)

    def scaled_loss(params, mb, denominator):
        model = nnx.merge(graphdef, policy.cast_to_compute(params), state.rest)
        value, moe = loss_fn(model, mb, denominator, loss, loss_chunk, moe_scale=1.0 / grad_accum)
        return ls.scale(value), (value, jax.tree.map(lambda m: m / grad_accum, moe))

    grads, (loss_value, moe) = _accumulated_grads(jax.grad(scaled_loss, has_aux=True), state.params, batch, grad_accum)
    finite = ls.all_finite(grads)  # on the SCALED gradients, like GradScaler's kernel
    grads = ls.unscale(grads)
    grad_norm = global_norm(grads)
    if max_grad_norm is not None:
        grads = clip_by_global_norm(grads, max_grad_norm, grad_norm)
    updates, new_opt_state = tx.update(grads, state.opt_state, state.params)
    new_params = optax.apply_updates(state.params, updates)
    params, opt_state = ls.select(finite, (new_params, new_opt_state), (state.params, state.opt_state))
    skipped = jnp.logical_not(finite) if ls.skips_nonfinite else jnp.asarray(False)
    metrics = {
        "loss": loss_value,
        "grad_norm": grad_norm,
        "loss_scale": ls.loss_scale.astype(jnp.float32),
        "skipped": skipped,
        **moe,  # an MoE's router metrics (mean over micro-batches): see moe_metrics
    }
    new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state, loss_scale=ls.update(finite))
    return new_state, metrics


CHECK_IDS = ("host", "jit", "off")


def make_train_step(
    graphdef: nnx.GraphDef,
    tx: optax.GradientTransformation,
    *,
    policy: str | Policy = "fp32",
    max_grad_norm: float | None = None,
    donate: bool = True,
    check_ids: str = "host",
    grad_accum: int = 1,
    sharding: Any | None = None,
    loss: str = "dense",
    loss_chunk: int = DEFAULT_CHUNK,
) -> Callable[[TrainState, Batch], tuple[TrainState, Metrics]]:
    """``step(state, batch) -> (new_state, metrics)``: one jitted training step with everything static bound.

    ``batch``: ``{"tokens": int [B, S+1], "loss_mask"?: [B, S+1], "segment_ids"?: [B, S+1], "positions"?: [B, S+1]}``
    (``twincore.batch``; the model sees the first S tokens), format checked before the jitted call.
    ``metrics``, each a 0-d jax array (no host sync): ``loss`` (float32, unscaled), ``grad_norm`` (float32:
    global norm of the unscaled gradients BEFORE clipping, what ``clip_grad_norm_`` returns), ``loss_scale``
    (float32: the scale applied to THIS step's loss), ``skipped`` (bool: the update was dropped for non-finite
    gradients). ``donate=True`` donates the state's buffers (updated in place on accelerators; the ``state``
    passed in is invalid afterwards).

    ``check_ids``: token ids outside ``[0, vocab)`` raise ValueError naming the first one (position, value).
    ``"host"`` (default): checked on the host before the call when the ids are concrete (numpy, or a jax array:
    one small device-to-host copy per step); ``"jit"`` (debug): checked INSIDE the compiled step with
    ``jax.experimental.checkify`` and raised after it, with donation off so the state passed in survives the
    error; ``"off"``: no check (an out-of-range id then embeds to zeros, see ``jaxattn.model``; never NaN).
    ``grad_accum=k``: the batch (``[k * b, S+1]``) is split inside the step into ``k`` microbatches of ``b``
    consecutive rows, run one after another in a ``lax.scan`` inside the ONE jitted step (one compile, one
    microbatch's activations live at a time), their gradients summed before the unscale / clip / update. The
    loss is normalised by the real (loss-weighted) targets of the WHOLE batch, so the step equals one step on
    the full batch up to float rounding, whatever padding each microbatch holds. A ``k`` that does not divide
    the batch is a ValueError naming both.

    ``loss``: ``"dense"`` (full logits, then :func:`cross_entropy`) or ``"fused"`` (:mod:`jaxattn.fused_ce`: the LM
    head and the cross-entropy in chunks of ``loss_chunk`` tokens per device, never the ``[tokens, vocab]``
    logits; with ``sharding`` each device chunks its own rows under ``shard_map`` with the head gathered once, as
    each torch rank does).

    ``sharding``: a ``jaxattn.sharding.TrainSharding`` (``shard_train_state``) — the jit's in/out shardings, the
    batch-size rule of its mesh, the activation-sharding context the step traces under, and how a host batch
    becomes a global array (multi-process); None: everything wherever the inputs are.

    ``step.jitted`` is the jitted pure function (no host-side checks; with ``"jit"`` it returns ``(error,
    (state, metrics))``), ``step.lower`` lowers it (under the sharding's tracing context).
    """
    if not isinstance(tx, optax.GradientTransformation):
        raise TypeError(f"tx must be an optax.GradientTransformation, got {type(tx).__name__}")
    if max_grad_norm is not None and (
        isinstance(max_grad_norm, bool) or not isinstance(max_grad_norm, (int, float)) or not max_grad_norm > 0
    ):
        raise ValueError(f"max_grad_norm must be None or a positive float, got {max_grad_norm!r}")
    if check_ids not in CHECK_IDS:
        raise ValueError(f"check_ids={check_ids!r} is not valid; use one of {', '.join(map(repr, CHECK_IDS))}")
    grad_accum = check_grad_accum(grad_accum)
    check_loss(loss, loss_chunk)
    policy = get_policy(policy)
    max_grad_norm = None if max_grad_norm is None else float(max_grad_norm)

    def pure(state: TrainState, batch: Batch) -> tuple[TrainState, Metrics]:
        return _train_step(
            graphdef,
            state,
            batch,
            tx=tx,
            policy=policy,
            max_grad_norm=max_grad_norm,
            check_ids=check_ids == "jit",
            grad_accum=grad_accum,
            loss=loss,
            loss_chunk=loss_chunk,
        )

    sh = {} if sharding is None else {"in_shardings": sharding.in_shardings, "out_shardings": sharding.out_shardings}
    if check_ids == "jit":
        sh = sh and {"in_shardings": sh["in_shardings"], "out_shardings": (None, sh["out_shardings"])}
        jitted = jax.jit(checkify.checkify(pure, errors=checkify.user_checks), **sh)
    else:
        jitted = jax.jit(pure, donate_argnums=(0,) if donate else (), **sh)
    vocab: list[int | None] = []  # read from the model's config on the first host check (one merge)
    tracing = contextlib.nullcontext if sharding is None else sharding.tracing

    def step(state: TrainState, batch: Batch) -> tuple[TrainState, Metrics]:
        check_batch(batch)
        check_accum_batch(batch, grad_accum)
        tokens = batch["tokens"]
        if check_ids == "host" and not isinstance(tokens, _Tracer):
            if not vocab:
                vocab.append(_vocab_size(graphdef, state))
            if vocab[0] is not None:
                check_token_ids(tokens, vocab[0], arg="batch['tokens']")
        if sharding is not None:
            sharding.check_batch_size(int(tokens.shape[0]))
            batch = sharding.place(batch)
        with tracing():
            out = jitted(state, batch)
        if check_ids != "jit":
            return out
        err, out = out
        message = err.get()
        if message:
            raise ValueError(message)
        return out

    def lower(*args, **kwargs):
        with tracing():
            return jitted.lower(*args, **kwargs)

    step.jitted, step.lower, step.sharding = jitted, lower, sharding
    return step
