"""The parameter table (``twincore.params``) against what derives from it, each checked against an oracle that
does not read the table: transformers' own Llama (HF names and shapes), both built models, both int8 quantizers,
Megatron's tensor-parallel plan written out by hand, and the parameter count of the torch model."""

from __future__ import annotations

import numpy as np
import pytest

from twincore import hf_format, params
from twincore.config import ModelConfig

torch = pytest.importorskip("torch")

CONFIGS = {
    "untied-gqa": ModelConfig.preset("tiny"),
    "tied-mha-head_dim": ModelConfig.preset("tiny", n_kv_heads=4, head_dim=24, tie_embeddings=True),
}


@pytest.fixture(params=list(CONFIGS), scope="module")
def cfg(request):
    return CONFIGS[request.param]


def test_hf_shapes_are_transformers_llama_state_dict(cfg):
    transformers = pytest.importorskip("transformers")
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg.to_hf()))
    want = {k: tuple(v.shape) for k, v in model.state_dict().items() if not k.endswith("rotary_emb.inv_freq")}
    if cfg.tie_embeddings:
        want.pop("lm_head.weight")  # HF writers drop the tied head; the table has no such row
    assert hf_format.expected_shapes(cfg) == params.hf_shapes(cfg) == want


def test_torch_model_state_dict_is_the_table(cfg):
    from torchref.hf import to_state_dict
    from torchref.model import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    assert {k: tuple(v.shape) for k, v in to_state_dict(model).items()} == params.hf_shapes(cfg)
    unique = {p.data_ptr(): p.numel() for p in LlamaForCausalLM(cfg).parameters()}
    assert sum(unique.values()) == params.param_count(cfg)


def test_jax_model_params_are_the_table(cfg):
    import jax
    from flax import nnx

    from jaxattn.model import Llama

    model = nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0)))
    found = {}
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        found[path[-1]] = (tuple(var.get_value().shape), tuple(nnx.get_partition_spec(var).get_value()))
    want = {r.name: (r.jax_shape(cfg), r.jax_axes) for r in params.rows(cfg)}
    assert found == want
    assert sum(int(np.prod(s)) for s, _ in found.values()) == params.param_count(cfg)
    assert jax.tree.leaves(nnx.state(model, nnx.Param))  # the model has parameters at all


def test_both_quantizers_quantize_exactly_the_quantizable_rows(cfg):
    import jax.numpy as jnp
    from flax import nnx

    from jaxattn import quant as jquant
    from jaxattn.model import Llama
    from torchref import quant as tquant
    from torchref.model import LlamaForCausalLM

    want = {r.name for r in params.quantizable_rows(cfg)}
    assert want == {"wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"} | (set() if cfg.tie_embeddings else {"lm_head"})
    jq = jquant.quantize(Llama(cfg, rngs=nnx.Rngs(0), param_dtype=jnp.float32))
    got = {
        r.name
        for r in params.rows(cfg)
        if isinstance(getattr(jq.layers if r.per_layer else jq, r.name)[...], jquant.QArray)
    }
    assert got == want
    tq = tquant.quantize(LlamaForCausalLM(cfg))
    int8 = {name for name, m in tq.named_modules() if isinstance(m, tquant.Int8Linear)}
    layer_modules = {r.module for r in params.quantizable_rows(cfg) if r.per_layer}
    assert int8 == (
        {f"model.layers.{i}.{m}" for i in range(cfg.n_layers) for m in layer_modules}
        | ({"lm_head"} if not cfg.tie_embeddings else set())
    )


def test_torch_tp_plan_is_megatrons():
    from torchref.parallel import tp_plan

    model_plan, layer_plan = tp_plan(CONFIGS["untied-gqa"])
    assert model_plan == {"model.embed_tokens": "rowwise", "model.norm": None, "lm_head": "colwise"}
    assert layer_plan == {
        "self_attn.q_proj": "colwise",
        "self_attn.k_proj": "colwise",
        "self_attn.v_proj": "colwise",
        "self_attn.o_proj": "rowwise",
        "mlp.gate_proj": "colwise",
        "mlp.up_proj": "colwise",
        "mlp.down_proj": "rowwise",
        "input_layernorm": None,
        "post_attention_layernorm": None,
    }


def test_jax_sharding_rules_split_what_torch_tp_splits():
    """The JAX ``tensor`` mesh axis and the torch TP plan read the same logical axes."""
    pytest.importorskip("jax")
    from jaxattn import sharding

    tensor = {a for a, m in sharding.RULES.items() if m == "tensor"}
    assert tensor == set(params.TENSOR_PARALLEL_AXES)
    for r in params.ROWS:
        split = [a for a in r.axes if a in tensor]
        assert (params.tp_style(r) is None) == (not split), r.name


def test_matmul_param_count_is_the_6n_rule(cfg):
    """N of 6·N·tokens: the projections and MLP of every layer plus the head (the embedding when tied)."""
    d = cfg.resolved_head_dim
    per_layer = cfg.dim * d * (cfg.n_heads + 2 * cfg.n_kv_heads) + cfg.n_heads * d * cfg.dim + 3 * cfg.dim * cfg.ffn_dim
    assert params.matmul_param_count(cfg) == cfg.n_layers * per_layer + cfg.dim * cfg.vocab_size


def test_gguf_name_matching():
    row, index = params.match_gguf("blk.17.attn_k.weight")
    assert row.name == "wk" and index == (17,) and row.gguf_permute == "n_kv_heads"
    assert params.match_gguf("output.weight")[0].name == "lm_head"
    assert params.match_gguf("rope_freqs.weight") is None and params.match_gguf("blk.x.attn_k.weight") is None


def test_a_new_row_reaches_every_derived_map():
    """What 'a new tensor is one row' means: a QK-norm row appears in the HF, GGUF and JAX maps at once."""
    qk = params.ParamRow(
        "q_norm",
        "model.layers.{i}.self_attn.q_norm.weight",
        "norm",
        lambda c: (c.resolved_head_dim,),
        ("head_dim",),
        "blk.{i}.attn_q_norm.weight",
    )
    cfg = CONFIGS["untied-gqa"]
    old = params.ROWS
    try:
        params.ROWS = old + (qk,)
        assert params.hf_shapes(cfg)["model.layers.1.self_attn.q_norm.weight"] == (cfg.resolved_head_dim,)
        assert params.gguf_names(cfg)["blk.0.attn_q_norm.weight"] == "model.layers.0.self_attn.q_norm.weight"
        assert qk in params.layer_rows(cfg) and params.tp_style(qk) is None and not qk.quantizable
    finally:
        params.ROWS = old
