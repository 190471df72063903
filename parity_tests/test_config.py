"""ModelConfig twins: identical fields and defaults, presets, HF config.json interop, clear errors."""

import dataclasses
import re

import pytest

import jaxattn.config as jc
import torchref.config as tc

PRESETS = ["tiny", "125m", "350m", "1b", "8b", "70b", "mistral-7b", "qwen3-0.6b", "qwen2.5-0.5b"]
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
# a minimal HF config.json (no num_key_value_heads: HF reads that as MHA)
HF_BASE = {
    "vocab_size": 10,
    "hidden_size": 32,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "intermediate_size": 48,
}


def test_fields_and_defaults_identical():
    jf = [(f.name, f.type, f.default) for f in dataclasses.fields(jc.ModelConfig)]
    tf = [(f.name, f.type, f.default) for f in dataclasses.fields(tc.ModelConfig)]
    assert jf == tf
    assert [f[0] for f in jf] == [
        "vocab_size",
        "dim",
        "n_layers",
        "n_heads",
        "n_kv_heads",
        "head_dim",
        "ffn_dim",
        "max_seq_len",
        "norm_eps",
        "rope_theta",
        "rope_scaling",
        "tie_embeddings",
        "bos_token_id",
        "eos_token_id",
        "model_type",
        "sliding_window",
        "n_experts",
        "experts_per_token",
        "moe_ffn_dim",
        "norm_topk_prob",
        "router_aux_loss_coef",
        "router_z_loss_coef",
        "capacity_factor",
    ]


@pytest.mark.parametrize("name", PRESETS)
def test_presets_identical_and_round_trip(name):
    j, t = jc.ModelConfig.preset(name), tc.ModelConfig.preset(name)
    assert dataclasses.asdict(j) == dataclasses.asdict(t)
    assert jc.ModelConfig.from_hf(j.to_hf()) == j
    assert (j.rope_inv_freq() == t.rope_inv_freq()).all()


def test_param_count_of_presets_is_llama_shaped():
    def n_params(c):
        d = c.resolved_head_dim
        layer = c.dim * d * (2 * c.n_heads + 2 * c.n_kv_heads) + 3 * c.dim * c.ffn_dim + 2 * c.dim
        return c.vocab_size * c.dim * (1 if c.tie_embeddings else 2) + c.n_layers * layer + c.dim

    sizes = {n: n_params(jc.ModelConfig.preset(n)) / 1e6 for n in PRESETS[1:]}
    assert 100 < sizes["125m"] < 150 and 300 < sizes["350m"] < 400
    assert 1200 < sizes["1b"] < 1300 and 7900 < sizes["8b"] < 8100  # Llama-3.2-1B: 1.24B, Llama-3.1-8B: 8.03B
    assert 70000 < sizes["70b"] < 71000  # Llama-3.1-70B: 70.55B
    assert 7200 < sizes["mistral-7b"] < 7300  # Mistral-7B-v0.1: 7.24B
    assert 490 < sizes["qwen2.5-0.5b"] < 500  # Qwen2.5-0.5B: 0.49B (its q / k / v biases not counted)
    assert 590 < sizes["qwen3-0.6b"] < 600  # Qwen3-0.6B: 0.6B (0.44B without the tied embedding; q/k norms not counted)


@pytest.mark.parametrize("mod", [jc, tc], ids=["jax", "torch"])
def test_transformers_config_interop(mod):
    transformers = pytest.importorskip("transformers")
    c = mod.ModelConfig(
        vocab_size=64,
        dim=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=1,
        head_dim=32,
        ffn_dim=96,
        max_seq_len=128,
        rope_theta=500000.0,
        rope_scaling=LLAMA3,
        tie_embeddings=True,
    )
    hf = transformers.LlamaConfig(**c.to_hf())
    assert hf.head_dim == 32 and hf.num_key_value_heads == 1 and hf.tie_word_embeddings
    back = mod.ModelConfig.from_hf(hf.to_dict())
    assert back == c


@pytest.mark.parametrize("mod", [jc, tc], ids=["jax", "torch"])
@pytest.mark.parametrize("window", [4096, None])
def test_mistral_config_interop_keeps_the_sliding_window(mod, window):
    """Mistral's config.json keeps sliding_window (null: full attention, as in Mistral-7B-v0.2); transformers reads
    ours as a MistralConfig, and a layer_types list mixing sliding and full layers is refused by key."""
    transformers = pytest.importorskip("transformers")
    c = mod.ModelConfig.preset("mistral-7b", sliding_window=window)
    assert c.attention_window == (None if window is None else (window - 1, None))
    hf = transformers.MistralConfig(**c.to_hf())
    assert hf.sliding_window == window and c.to_hf()["architectures"] == ["MistralForCausalLM"]
    assert mod.ModelConfig.from_hf(hf.to_dict()) == c
    mixed = {**c.to_hf(), "layer_types": ["sliding_attention"] * 31 + ["full_attention"]}
    with pytest.raises(ValueError, match="layer_types"):
        mod.ModelConfig.from_hf(mixed)
    assert "sliding_window" not in mod.ModelConfig.preset("8b").to_hf()  # Llama's config.json has no such key


@pytest.mark.parametrize("mod", [jc, tc], ids=["jax", "torch"])
@pytest.mark.parametrize("family", ["qwen3", "qwen2"])
def test_qwen_config_interop_and_its_sliding_window_refused(mod, family):
    """Qwen3's and Qwen2's config.json round-trip through transformers' own config class (Qwen3: q/k norms;
    Qwen2: q / k / v biases; both tied here); their use_sliding_window (a window from max_window_layers on) is
    refused by key."""
    transformers = pytest.importorskip("transformers")
    c = mod.ModelConfig.preset("qwen3-0.6b" if family == "qwen3" else "qwen2.5-0.5b")
    assert c.qk_norm == (family == "qwen3") and c.qkv_bias == (family == "qwen2") and not c.is_moe
    assert c.to_hf()["architectures"] == [f"{family.capitalize()}ForCausalLM"]
    hf = getattr(transformers, f"{family.capitalize()}Config")(**c.to_hf())
    assert hf.head_dim == c.resolved_head_dim and hf.tie_word_embeddings and hf.sliding_window is None
    assert mod.ModelConfig.from_hf(hf.to_dict()) == c
    with pytest.raises(ValueError, match="use_sliding_window"):
        mod.ModelConfig.from_hf({**c.to_hf(), "use_sliding_window": True, "max_window_layers": 14})


@pytest.mark.parametrize("mod", [jc, tc], ids=["jax", "torch"])
def test_from_hf_reads_legacy_and_v5_rope_keys(mod):
    base = {**HF_BASE, "num_key_value_heads": 2}
    legacy = mod.ModelConfig.from_hf({**base, "rope_theta": 5e5, "rope_scaling": {**LLAMA3, "type": "llama3"}})
    v5 = mod.ModelConfig.from_hf({**base, "rope_parameters": {**LLAMA3, "rope_theta": 5e5}})
    assert legacy == v5 and v5.rope_theta == 5e5 and v5.rope_scaling["factor"] == 8.0
    plain = mod.ModelConfig.from_hf({**base, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}})
    assert plain.rope_scaling is None and plain.head_dim is None


@pytest.mark.parametrize("mod", [jc, tc], ids=["jax", "torch"])
@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(dim=65, n_heads=4), "n_heads"),
        (dict(n_heads=4, n_kv_heads=3), "n_kv_heads"),
        (dict(vocab_size=0), "vocab_size"),
        (dict(ffn_dim=-4), "ffn_dim"),
        (dict(n_layers=0), "n_layers"),
        (dict(head_dim=0), "head_dim"),
        (dict(head_dim=15), "head_dim"),
        (dict(norm_eps=0.0), "norm_eps"),
        (dict(rope_theta=-1.0), "rope_theta"),
        (dict(rope_scaling={"rope_type": "linear", "factor": 2.0}), "rope_scaling"),
        (dict(rope_scaling={"rope_type": "llama3", "factor": 2.0}), "rope_scaling"),
        (dict(model_type="mistral", sliding_window=0), "sliding_window"),
        (dict(model_type="mistral", sliding_window=4.0), "sliding_window"),
        (dict(sliding_window=8), "sliding_window=8 with model_type='llama'"),
    ],
)
def test_invalid_config_names_field(mod, kwargs, field):
    with pytest.raises(ValueError, match=field):
        mod.ModelConfig.preset("tiny", **kwargs)


@pytest.mark.parametrize("mod", [jc, tc], ids=["jax", "torch"])
def test_unknown_preset_and_unsupported_hf(mod):
    with pytest.raises(ValueError, match="unknown preset 'huge'.*tiny"):
        mod.ModelConfig.preset("huge")
    hf = mod.ModelConfig.preset("tiny").to_hf()
    with pytest.raises(ValueError, match="rope_type='yarn'"):
        mod.ModelConfig.from_hf({**hf, "rope_scaling": None, "rope_parameters": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(ValueError, match="attention_bias"):
        mod.ModelConfig.from_hf({**hf, "attention_bias": True})
    with pytest.raises(ValueError, match="hidden_act"):
        mod.ModelConfig.from_hf({**hf, "hidden_act": "gelu"})
    with pytest.raises(ValueError, match="missing required keys.*hidden_size"):
        mod.ModelConfig.from_hf({"vocab_size": 3})


@pytest.mark.parametrize("mod", [jc, tc], ids=["jax", "torch"])
@pytest.mark.parametrize(
    "key, value, accepted",
    [
        ("rms_norm_eps", "abc", "positive finite number"),
        ("rms_norm_eps", None, "positive finite number"),
        ("rms_norm_eps", True, "positive finite number"),
        ("rope_theta", None, "positive finite number"),
        ("rope_theta", "1e4", "positive finite number"),
        ("num_key_value_heads", 0, "positive int, or null/absent for num_attention_heads"),
        ("num_key_value_heads", "2", "positive int"),
        ("vocab_size", None, "positive int"),
        ("hidden_size", 64.0, "positive int"),
        ("num_hidden_layers", True, "positive int"),
        ("intermediate_size", "160", "positive int"),
        ("num_attention_heads", -4, "positive int"),
        ("head_dim", 0, "positive int, or null/absent"),
        ("max_position_embeddings", None, "positive int"),
        ("tie_word_embeddings", "false", "true or false"),
        ("tie_word_embeddings", None, "true or false"),
        ("attention_bias", "no", "true or false"),
    ],
)
def test_from_hf_bad_value_names_key_value_and_accepted(mod, key, value, accepted):
    """A config.json value of the wrong kind gives a ValueError naming the key, the value and what is accepted
    (not Python's ``float()`` error, and never a silent fallback)."""
    hf = mod.ModelConfig.preset("tiny").to_hf()
    with pytest.raises(ValueError, match=re.escape(f"HF config {key}={value!r} ") + ".*" + re.escape(accepted)):
        mod.ModelConfig.from_hf({**hf, key: value})


@pytest.mark.parametrize("mod", [jc, tc], ids=["jax", "torch"])
def test_from_hf_null_or_missing_kv_heads_means_mha_and_rope_values_checked(mod):
    base = dict(HF_BASE)  # a copy: from_hf must not be able to change the shared one
    assert mod.ModelConfig.from_hf(base).n_kv_heads == 4  # HF semantics
    assert mod.ModelConfig.from_hf({**base, "num_key_value_heads": None}).n_kv_heads == 4
    assert mod.ModelConfig.from_hf({**base, "num_key_value_heads": 2}).n_kv_heads == 2
    with pytest.raises(ValueError, match=r"rope_parameters\.rope_theta=None"):
        mod.ModelConfig.from_hf({**base, "rope_parameters": {"rope_type": "default", "rope_theta": None}})
    with pytest.raises(ValueError, match=r"rope_parameters="):
        mod.ModelConfig.from_hf({**base, "rope_parameters": "default"})
    with pytest.raises(ValueError, match=r"rope_scaling\.factor='8'.*positive finite number"):
        mod.ModelConfig.from_hf({**base, "rope_scaling": {**LLAMA3, "factor": "8"}})
    with pytest.raises(ValueError, match=r"original_max_position_embeddings=None.*positive int"):
        mod.ModelConfig.from_hf({**base, "rope_scaling": {**LLAMA3, "original_max_position_embeddings": None}})
    with pytest.raises(ValueError, match="tie_embeddings must be a bool"):
        mod.ModelConfig.preset("tiny", tie_embeddings="yes")
    with pytest.raises(ValueError, match="norm_eps"):
        mod.ModelConfig.preset("tiny", norm_eps=True)
