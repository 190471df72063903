"""The parameter table: one row per tensor of the model; every per-tensor map of both twins derives from it.

    for row in rows(cfg):                        # the rows present for this config (lm_head only when untied)
        row.name, row.hf, row.jax_shape(cfg), row.jax_axes, row.gguf, row.quantizable

A row gives the tensor's JAX name (attribute of ``Llama`` or, per layer, of ``Llama.layers``), its Hugging Face key
(``{i}`` = layer index), its JAX-layout shape (a linear weight is ``[in, out]``; HF stores it transposed), its logical
axis names, its llama.cpp GGUF name and, for the q/k projections, the config field that groups llama.cpp's row
permutation. What derives from it: the HF and GGUF name maps and shapes (``hf_format``, ``gguf``), the JAX model's
parameters and axes (``jaxattn.model``), the int8 targets (both ``quant`` modules), torch's tensor-parallel plan
(``torchref.parallel``, from the axes) and the parameter / FLOP counts (:func:`param_count`,
:func:`matmul_param_count`). A new tensor (a bias, a QK-norm) is one row here plus its use in the two model files.

A key may also hold ``{e}`` (an expert index): such a row's JAX shape then starts with the ``experts`` axis and each
expert is its own HF tensor, while torch keeps the experts stacked in one parameter (:attr:`ParamRow.torch`, e.g.
``model.layers.{i}.mlp.experts.gate_proj`` ``[experts, out, in]``, transformers 5's layout). A row's ``hf`` is the
name of the Llama / Qwen3-MoE families; ``hf_alt`` names it for another ``model_type`` (Mixtral's
``block_sparse_moe.experts.{e}.w1``): :meth:`ParamRow.hf_pattern`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass

__all__ = [
    "ParamRow",
    "ROWS",
    "TENSOR_PARALLEL_AXES",
    "AXIS_FIELDS",
    "rows",
    "layer_rows",
    "global_rows",
    "row",
    "hf_keys",
    "hf_shapes",
    "gguf_names",
    "match_gguf",
    "quantizable_rows",
    "dense_mlp_rows",
    "expert_weights",
    "tp_style",
    "param_count",
    "matmul_param_count",
    "active_matmul_param_count",
]

KINDS = ("embedding", "linear", "router", "norm", "bias")  # a router is a linear layer that int8 leaves in float
# Logical axes that Megatron tensor parallelism splits (JAX: the ``tensor`` mesh axis; torch: the TP plan).
TENSOR_PARALLEL_AXES = ("vocab", "heads", "kv_heads", "mlp", "expert_mlp")
# The config field whose divisibility a split of each logical axis needs.
AXIS_FIELDS = {
    "heads": "n_heads",
    "kv_heads": "n_kv_heads",
    "mlp": "ffn_dim",
    "expert_mlp": "expert_ffn_dim",
    "vocab": "vocab_size",
    "embed": "dim",
    "experts": "n_experts",
}


def _always(cfg) -> bool:
    return True


@dataclass(frozen=True)
class ParamRow:
    """One tensor. ``shape(cfg)``: JAX layout, one layer (and one expert axis, if any) — no ``layers`` axis."""

    name: str
    hf: str
    kind: str
    shape: Callable
    axes: tuple
    gguf: str  # llama.cpp's name ({i} = layer, never {e}: an expert row names the merged per-layer tensor)
    gguf_permute: str | None = None
    present: Callable = _always
    hf_alt: tuple = ()  # ((model_type, hf pattern), ...) where a family names the tensor differently

    def hf_pattern(self, cfg) -> str:
        """The HF key pattern of this row in ``cfg.model_type``'s checkpoints."""
        return dict(self.hf_alt).get(getattr(cfg, "model_type", "llama"), self.hf)

    @property
    def expert(self) -> bool:
        """One tensor per expert in HF files; stacked on a leading ``experts`` axis in both twins."""
        return "{e}" in self.hf

    @property
    def torch(self) -> str:
        """The torch ``state_dict`` key pattern: the HF key, or for expert rows the stacked parameter
        (``...experts.{e}.gate_proj.weight`` -> ``...experts.gate_proj``)."""
        return self.hf.replace(".{e}", "").removesuffix(".weight") if self.expert else self.hf

    @property
    def per_layer(self) -> bool:
        return "{i}" in self.hf

    @property
    def transposed(self) -> bool:
        """HF (and torch ``nn.Linear``) store linear weights ``[out, in]``; ours are ``[in, out]``."""
        return self.kind in ("linear", "router")

    @property
    def quantizable(self) -> bool:
        """int8 weight-only targets: every linear weight (an untied head included; the embedding and norms stay)."""
        return self.kind == "linear"

    @property
    def jax_axes(self) -> tuple:
        return ("layers", *self.axes) if self.per_layer else self.axes

    def jax_shape(self, cfg) -> tuple:
        """The JAX parameter's shape (with the leading ``n_layers`` axis for per-layer rows)."""
        return (cfg.n_layers, *self.shape(cfg)) if self.per_layer else tuple(self.shape(cfg))

    def hf_shape(self, cfg) -> tuple:
        """One HF tensor's shape (one layer, one expert)."""
        s = tuple(self.shape(cfg))[1 if self.expert else 0 :]
        return s[::-1] if self.transposed else s

    @property
    def module(self) -> str:
        """The torch module path under a decoder layer (per-layer rows) or the model (others): the owner of
        :attr:`torch` (``mlp.experts`` for the three expert rows)."""
        key = self.torch.split("{i}.", 1)[1] if self.per_layer else self.torch
        return key.rsplit(".", 1)[0]


def _hd(c) -> int:
    return c.resolved_head_dim


def _dense(c) -> bool:
    return not c.is_moe


def _moe(c) -> bool:
    return c.is_moe


ROWS: tuple[ParamRow, ...] = (
    ParamRow(
        "embed",
        "model.embed_tokens.weight",
        "embedding",
        lambda c: (c.vocab_size, c.dim),
        ("vocab", "embed"),
        "token_embd.weight",
    ),
    ParamRow(
        "wq",
        "model.layers.{i}.self_attn.q_proj.weight",
        "linear",
        lambda c: (c.dim, c.n_heads * _hd(c)),
        ("embed", "heads"),
        "blk.{i}.attn_q.weight",
        gguf_permute="n_heads",
    ),
    ParamRow(
        "wk",
        "model.layers.{i}.self_attn.k_proj.weight",
        "linear",
        lambda c: (c.dim, c.n_kv_heads * _hd(c)),
        ("embed", "kv_heads"),
        "blk.{i}.attn_k.weight",
        gguf_permute="n_kv_heads",
    ),
    ParamRow(
        "wv",
        "model.layers.{i}.self_attn.v_proj.weight",
        "linear",
        lambda c: (c.dim, c.n_kv_heads * _hd(c)),
        ("embed", "kv_heads"),
        "blk.{i}.attn_v.weight",
    ),
    ParamRow(
        "wo",
        "model.layers.{i}.self_attn.o_proj.weight",
        "linear",
        lambda c: (c.n_heads * _hd(c), c.dim),
        ("heads", "embed"),
        "blk.{i}.attn_output.weight",
    ),
    ParamRow(
        "q_norm",
        "model.layers.{i}.self_attn.q_norm.weight",
        "norm",
        lambda c: (_hd(c),),
        ("head_dim",),
        "blk.{i}.attn_q_norm.weight",
        present=lambda c: c.qk_norm,
    ),
    ParamRow(
        "k_norm",
        "model.layers.{i}.self_attn.k_norm.weight",
        "norm",
        lambda c: (_hd(c),),
        ("head_dim",),
        "blk.{i}.attn_k_norm.weight",
        present=lambda c: c.qk_norm,
    ),
    # Qwen2's biases on the q / k / v projections (o_proj has none); the bias of its linear's output features
    *(
        ParamRow(
            f"{x}_bias",
            f"model.layers.{{i}}.self_attn.{x}_proj.bias",
            "bias",
            (lambda c, h=heads: (getattr(c, h) * _hd(c),)),
            ("heads" if x == "q" else "kv_heads",),
            f"blk.{{i}}.attn_{x}.bias",
            present=lambda c: c.qkv_bias,
        )
        for x, heads in (("q", "n_heads"), ("k", "n_kv_heads"), ("v", "n_kv_heads"))
    ),
    ParamRow(
        "w_gate",
        "model.layers.{i}.mlp.gate_proj.weight",
        "linear",
        lambda c: (c.dim, c.ffn_dim),
        ("embed", "mlp"),
        "blk.{i}.ffn_gate.weight",
        present=_dense,
    ),
    ParamRow(
        "w_up",
        "model.layers.{i}.mlp.up_proj.weight",
        "linear",
        lambda c: (c.dim, c.ffn_dim),
        ("embed", "mlp"),
        "blk.{i}.ffn_up.weight",
        present=_dense,
    ),
    ParamRow(
        "w_down",
        "model.layers.{i}.mlp.down_proj.weight",
        "linear",
        lambda c: (c.ffn_dim, c.dim),
        ("mlp", "embed"),
        "blk.{i}.ffn_down.weight",
        present=_dense,
    ),
    # Mixture of Experts (cfg.n_experts > 0): the router and every expert's SwiGLU, stacked [experts, in, out]
    ParamRow(
        "router",
        "model.layers.{i}.mlp.gate.weight",
        "router",
        lambda c: (c.dim, c.n_experts),
        ("embed", None),
        "blk.{i}.ffn_gate_inp.weight",
        present=_moe,
        hf_alt=(("mixtral", "model.layers.{i}.block_sparse_moe.gate.weight"),),
    ),
    ParamRow(
        "e_gate",
        "model.layers.{i}.mlp.experts.{e}.gate_proj.weight",
        "linear",
        lambda c: (c.n_experts, c.dim, c.expert_ffn_dim),
        ("experts", "embed", "expert_mlp"),
        "blk.{i}.ffn_gate_exps.weight",
        present=_moe,
        hf_alt=(("mixtral", "model.layers.{i}.block_sparse_moe.experts.{e}.w1.weight"),),
    ),
    ParamRow(
        "e_up",
        "model.layers.{i}.mlp.experts.{e}.up_proj.weight",
        "linear",
        lambda c: (c.n_experts, c.dim, c.expert_ffn_dim),
        ("experts", "embed", "expert_mlp"),
        "blk.{i}.ffn_up_exps.weight",
        present=_moe,
        hf_alt=(("mixtral", "model.layers.{i}.block_sparse_moe.experts.{e}.w3.weight"),),
    ),
    ParamRow(
        "e_down",
        "model.layers.{i}.mlp.experts.{e}.down_proj.weight",
        "linear",
        lambda c: (c.n_experts, c.expert_ffn_dim, c.dim),
        ("experts", "expert_mlp", "embed"),
        "blk.{i}.ffn_down_exps.weight",
        present=_moe,
        hf_alt=(("mixtral", "model.layers.{i}.block_sparse_moe.experts.{e}.w2.weight"),),
    ),
    ParamRow(
        "attn_norm",
        "model.layers.{i}.input_layernorm.weight",
        "norm",
        lambda c: (c.dim,),
        ("embed",),
        "blk.{i}.attn_norm.weight",
    ),
    ParamRow(
        "mlp_norm",
        "model.layers.{i}.post_attention_layernorm.weight",
        "norm",
        lambda c: (c.dim,),
        ("embed",),
        "blk.{i}.ffn_norm.weight",
    ),
    ParamRow("norm", "model.norm.weight", "norm", lambda c: (c.dim,), ("embed",), "output_norm.weight"),
    ParamRow(
        "lm_head",
        "lm_head.weight",
        "linear",
        lambda c: (c.dim, c.vocab_size),
        ("embed", "vocab"),
        "output.weight",
        present=lambda c: not c.tie_embeddings,
    ),
)
assert all(r.kind in KINDS for r in ROWS) and len({r.name for r in ROWS}) == len(ROWS)
assert not any("{e}" in r.gguf for r in ROWS)


def rows(cfg=None) -> tuple[ParamRow, ...]:
    """The rows present for ``cfg`` (all rows when ``cfg`` is None), in table order."""
    return ROWS if cfg is None else tuple(r for r in ROWS if r.present(cfg))


def layer_rows(cfg=None) -> tuple[ParamRow, ...]:
    return tuple(r for r in rows(cfg) if r.per_layer)


def global_rows(cfg=None) -> tuple[ParamRow, ...]:
    return tuple(r for r in rows(cfg) if not r.per_layer)


def row(name: str) -> ParamRow:
    for r in ROWS:
        if r.name == name:
            return r
    raise KeyError(f"no parameter row named {name!r}; rows: {[r.name for r in ROWS]}")


def dense_mlp_rows() -> tuple[ParamRow, ...]:
    """A dense layer's SwiGLU weights (``w_gate``, ``w_up``, ``w_down``): the rows an MoE config leaves out."""
    return tuple(r for r in ROWS if r.present is _dense)


def expert_weights() -> tuple[str, ...]:
    """The stacked expert weights' names on torch's ``mlp.experts`` module (``gate_proj``, ``up_proj``,
    ``down_proj``), in table order."""
    return tuple(r.torch.rsplit(".", 1)[1] for r in ROWS if r.expert)


def quantizable_rows(cfg) -> tuple[ParamRow, ...]:
    return tuple(r for r in rows(cfg) if r.quantizable)


def _expand(pattern: str, cfg) -> Iterator[tuple[str, tuple]]:
    layers = range(cfg.n_layers) if "{i}" in pattern else (None,)
    experts = range(cfg.n_experts) if "{e}" in pattern else (None,)
    for i in layers:
        for e in experts:
            index = tuple(x for x in (i, e) if x is not None)
            yield pattern.format(**({"i": i} if i is not None else {}), **({"e": e} if e is not None else {})), index


def hf_keys(r: ParamRow, cfg) -> list[tuple[str, tuple]]:
    """``[(HF key, index into the JAX parameter)]`` of one row in ``cfg.model_type``'s names: ``(i,)`` per layer,
    ``(i, e)`` per expert."""
    return list(_expand(r.hf_pattern(cfg), cfg))


def hf_shapes(cfg) -> dict[str, tuple[int, ...]]:
    """HF key -> shape for every tensor of ``cfg`` (``lm_head.weight`` only when embeddings are not tied)."""
    return {key: r.hf_shape(cfg) for r in rows(cfg) for key, _ in hf_keys(r, cfg)}


def gguf_names(cfg) -> dict[str, str | tuple[str, ...]]:
    """GGUF name -> HF key for every tensor of ``cfg``; for an expert row the value is the tuple of that layer's
    ``n_experts`` HF keys in expert order: llama.cpp merges them into one GGUF tensor (``blk.{i}.ffn_gate_exps``,
    numpy shape ``[experts, out, in]``), whose leading axis is the expert index."""
    out: dict[str, str | tuple[str, ...]] = {}
    for r in rows(cfg):
        by_layer: dict[tuple, list[str]] = {}  # (layer,) or () -> HF keys (an expert row's: e ascending)
        for key, index in hf_keys(r, cfg):
            by_layer.setdefault(index[:1] if r.expert else index, []).append(key)
        for name, index in _expand(r.gguf, cfg):
            out[name] = tuple(by_layer[index]) if r.expert else by_layer[index][0]
    return out


def match_gguf(name: str) -> tuple[ParamRow, tuple] | None:
    """``(row, index)`` of a GGUF tensor name, whatever the layer count; None for a name of no row. ``index`` is
    ``(layer,)`` for a per-layer name (for an expert row's merged tensor: the whole ``[experts, ...]`` slice of the
    stacked parameter) and ``()`` for a global one."""
    for r in ROWS:
        m = re.fullmatch(re.escape(r.gguf).replace(r"\{i\}", r"(\d+)"), name)
        if m:
            return r, tuple(int(g) for g in m.groups())
    return None


def tp_style(r: ParamRow) -> str | None:
    """Megatron tensor parallelism of a weight, read off its logical axes: ``"colwise"`` when its output (last JAX)
    axis is split, ``"rowwise"`` when its first axis is (an ``nn.Embedding``'s vocabulary rows, or a linear's input
    features), None when neither is (norms: replicated). An expert row is read past its ``experts`` axis (each
    expert's matrix split as a dense one's)."""
    if r.kind == "norm":
        return None
    if r.kind == "bias":  # split with its linear's output features (the same module's plan)
        return "colwise" if r.axes[-1] in TENSOR_PARALLEL_AXES else None
    axes = r.axes[1:] if r.expert else r.axes
    if r.kind == "linear" and axes[-1] in TENSOR_PARALLEL_AXES:
        return "colwise"
    return "rowwise" if axes[0] in TENSOR_PARALLEL_AXES else None


def _numel(r: ParamRow, cfg) -> int:
    return math.prod(r.jax_shape(cfg))


def param_count(cfg) -> int:
    """Trainable parameters (a tied head counts once, as the embedding)."""
    return sum(_numel(r, cfg) for r in rows(cfg))


def matmul_param_count(cfg) -> int:
    """Parameters that take part in a matmul per token: every linear weight, plus the embedding when it is also the
    (tied) head; the embedding lookup and the norms do no matmul. The N of the 6·N·tokens FLOP rule."""
    n = sum(_numel(r, cfg) for r in rows(cfg) if r.kind in ("linear", "router"))
    return n + (cfg.vocab_size * cfg.dim if cfg.tie_embeddings else 0)


def active_matmul_param_count(cfg) -> int:
    """:func:`matmul_param_count` counting only the ``experts_per_token`` experts a token runs through (an MoE's
    "active" parameters: the N of 6·N·tokens for a sparse model); the same number for a dense one."""
    n = matmul_param_count(cfg)
    if cfg.is_moe:
        idle = cfg.n_experts - cfg.experts_per_token
        n -= sum(_numel(r, cfg) // cfg.n_experts * idle for r in rows(cfg) if r.expert)
    return n
