"""Hugging Face checkpoint interop: transformers-written directories load into both packages with the same
logits as transformers; save in one framework -> load in the other -> save again is bit-exact (fp32); bad
checkpoints give errors that list what is wrong; an interrupted save leaves the previous checkpoint intact.
"""

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

import jaxattn  # noqa: E402
import torchref  # noqa: E402
from parity_tests.twins import hf_llama_dir, jitted, tokens, twin_models  # noqa: E402
from torchref.config import ModelConfig  # noqa: E402
from twincore import hf_format  # noqa: E402
from twincore.hf_format import CheckpointError  # noqa: E402

LOGITS_TOL = 1e-4

HF_CASES = {  # transformers LlamaConfig kwargs
    "gqa-untied": dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False),
    "mha-tied": dict(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True),
    "mqa-headdim-llama3": dict(
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=24,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    ),
}


def _hf_dir(tmp_path, case, max_shard_size=None):
    return hf_llama_dir(
        tmp_path / case,
        seed=7,
        max_shard_size=max_shard_size,
        vocab_size=96,
        hidden_size=64,
        intermediate_size=112,
        num_hidden_layers=2,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        **HF_CASES[case],
    )


@pytest.mark.parametrize("case", list(HF_CASES))
def test_transformers_directory_loads_into_both(tmp_path, case):
    hf_model, path = _hf_dir(tmp_path, case, max_shard_size="40KB" if case == "gqa-untied" else None)
    if case == "gqa-untied":
        assert (path / hf_format.INDEX_FILE).exists()  # really sharded
    tok = tokens(np.random.default_rng(0), 96, 2, 21)
    with torch.no_grad():
        ref = hf_model(torch.from_numpy(tok)).logits.double().numpy()
    tmodel = torchref.from_pretrained(path)
    jmodel = jaxattn.from_pretrained(path)
    with torch.no_grad():
        out_t = tmodel(torch.from_numpy(tok)).double().numpy()
    out_j = np.asarray(jitted(jmodel)(jnp.asarray(tok, jnp.int32)), np.float64)
    assert np.abs(out_t - ref).max() <= LOGITS_TOL
    assert np.abs(out_j - ref).max() <= LOGITS_TOL


# transformers families beside Llama: (config class, model class, config kwargs); the tiny shape below is shared
FAMILIES = {
    "mistral-window": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=5)),  # shorter than the rows
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=24, tie_word_embeddings=True)),  # q/k norms
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True)),  # biased q / k / v
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_directory_loads_decodes_and_saves_in_both(tmp_path, family):
    """A transformers Mistral (sliding window of 5 tokens), Qwen3 (q/k norms, head_dim 24, tied) or Qwen2 (biased
    q / k / v) directory loads
    into both twins with its logits on 21 tokens and its greedy tokens through the KV cache (past the window), and
    each twin saves a directory transformers reloads as the same class with the same logits. The window matters at
    this length: transformers' full-attention logits differ."""
    from jaxattn.generate import generate as jgen
    from torchref.generate import generate as tgen

    config_cls, model_cls, kw = FAMILIES[family]
    cfg = getattr(transformers, config_cls)(
        vocab_size=96, hidden_size=64, intermediate_size=112, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5, **kw,
        bos_token_id=None, eos_token_id=None,  # no EOS: transformers' generate runs its 10 tokens unforced
    )  # fmt: skip
    torch.manual_seed(5)
    ref = getattr(transformers, model_cls)(cfg).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
    ref.save_pretrained(tmp_path / "hf")
    tok = torch.from_numpy(tokens(np.random.default_rng(2), 96, 2, 21))
    with torch.no_grad():
        want = ref(tok).logits.double().numpy()
        if "sliding_window" in kw:
            ref.config.sliding_window = None
            assert np.abs(ref(tok).logits.double().numpy() - want).max() > 1e-2  # the window changes these logits
            ref.config.sliding_window = kw["sliding_window"]
        greedy = ref.generate(tok[:1, :7], max_new_tokens=10, do_sample=False)[0, 7:].tolist()
    assert len(greedy) == 10
    tmodel, jmodel = torchref.from_pretrained(tmp_path / "hf"), jaxattn.from_pretrained(tmp_path / "hf")
    assert tmodel.config == jmodel.config and tmodel.config.model_type == cfg.model_type
    assert tmodel.config.sliding_window == kw.get("sliding_window")
    with torch.no_grad():
        assert np.abs(tmodel(tok).double().numpy() - want).max() <= LOGITS_TOL
    assert (
        np.abs(np.asarray(jitted(jmodel)(jnp.asarray(tok.numpy(), jnp.int32)), np.float64) - want).max() <= LOGITS_TOL
    )
    prompt = tok[:1, :7].tolist()
    assert tgen(tmodel, prompt, 10, eos_id=None)[0] == greedy
    assert jgen(jmodel, prompt, 10, eos_id=None)[0] == greedy
    for name, save, model in (("torch", torchref.save_pretrained, tmodel), ("jax", jaxattn.save_pretrained, jmodel)):
        save(model, tmp_path / name)
        back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / name).eval()
        assert type(back).__name__ == model_cls and back.config.sliding_window == kw.get("sliding_window"), name
        with torch.no_grad():
            assert np.abs(back(tok).logits.double().numpy() - want).max() <= LOGITS_TOL, name


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("shard", [None, 30_000])
def test_cross_framework_round_trip_is_bit_exact(tmp_path, tied, shard):
    tmodel, _ = twin_models(ModelConfig.preset("tiny", tie_embeddings=tied), seed=3)
    kw = {} if shard is None else {"max_shard_bytes": shard}
    torchref.save_pretrained(tmodel, tmp_path / "a", **kw)
    jmodel = jaxattn.from_pretrained(tmp_path / "a")
    jaxattn.save_pretrained(jmodel, tmp_path / "b", **kw)
    tmodel2 = torchref.from_pretrained(tmp_path / "b")
    torchref.save_pretrained(tmodel2, tmp_path / "c", **kw)
    files = sorted(os.listdir(tmp_path / "a"))
    assert files == sorted(os.listdir(tmp_path / "b")) == sorted(os.listdir(tmp_path / "c"))
    assert (hf_format.INDEX_FILE in files) == (shard is not None)
    for d in ("b", "c"):
        a = {}
        for f in hf_format.weight_files(tmp_path / "a"):
            a.update(safetensors_torch.load_file(f))
        for f in hf_format.weight_files(tmp_path / d):
            for k, v in safetensors_torch.load_file(f).items():
                assert v.dtype == torch.float32 and torch.equal(v, a.pop(k)), k
        assert not a
    if tied:
        assert tmodel2.lm_head.weight is tmodel2.model.embed_tokens.weight
    # and transformers reads what jaxattn wrote
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "b").eval()
    tok = torch.from_numpy(tokens(np.random.default_rng(1), 256, 1, 9))
    with torch.no_grad():
        assert float((hf(tok).logits - tmodel(tok)).abs().max()) <= LOGITS_TOL


def test_dtype_argument(tmp_path):
    tmodel, _ = twin_models(ModelConfig.preset("tiny"), seed=4)
    torchref.save_pretrained(tmodel, tmp_path / "bf", dtype="bfloat16")
    assert json.loads((tmp_path / "bf" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert torchref.from_pretrained(tmp_path / "bf").lm_head.weight.dtype == torch.bfloat16  # None keeps file dtype
    assert torchref.from_pretrained(tmp_path / "bf", dtype="float32").lm_head.weight.dtype == torch.float32
    assert jaxattn.from_pretrained(tmp_path / "bf").embed[...].dtype == jnp.bfloat16
    assert jaxattn.from_pretrained(tmp_path / "bf", dtype=jnp.float32).embed[...].dtype == jnp.float32
    with pytest.raises(ValueError, match="dtype='int8'"):
        jaxattn.from_pretrained(tmp_path / "bf", dtype="int8")
    with pytest.raises(ValueError, match="dtype='int8'"):
        torchref.from_pretrained(tmp_path / "bf", dtype="int8")


@pytest.mark.parametrize("short, full", [("bf16", "bfloat16"), ("fp16", "float16"), ("fp32", "float32")])
def test_dtype_takes_the_short_precision_names(tmp_path, short, full):
    """``dtype="bf16"`` (the spelling of ``--precision``) means bfloat16 weights in every loader and saver of both
    twins, as ``dtype="bfloat16"`` does; an unknown name lists both spellings."""
    tmodel, _ = twin_models(ModelConfig.preset("tiny"), seed=5)
    torchref.save_pretrained(tmodel, tmp_path / "s", dtype=short)
    assert json.loads((tmp_path / "s" / "config.json").read_text())["torch_dtype"] == full
    jmodel = jaxattn.from_pretrained(tmp_path / "s", dtype=short)
    assert jmodel.embed[...].dtype == jnp.dtype(full)
    assert torchref.from_pretrained(tmp_path / "s", dtype=short).lm_head.weight.dtype == getattr(torch, full)
    jaxattn.save_pretrained(jmodel, tmp_path / "j", dtype=short)
    assert json.loads((tmp_path / "j" / "config.json").read_text())["torch_dtype"] == full
    for load in (jaxattn.from_pretrained, torchref.from_pretrained):
        with pytest.raises(ValueError, match=r"dtype='bf8' is not supported; .*bfloat16.*\(or fp32, bf16, fp16\)"):
            load(tmp_path / "s", dtype="bf8")


def _write(path, tensors, cfg):
    os.makedirs(path, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg.to_hf()))
    safetensors_torch.save_file(tensors, str(path / hf_format.SINGLE_FILE))


@pytest.mark.parametrize("load", [jaxattn.from_pretrained, torchref.from_pretrained], ids=["jax", "torch"])
def test_bad_checkpoints_list_every_problem(tmp_path, load):
    cfg = ModelConfig.preset("tiny")
    tmodel, _ = twin_models(cfg, seed=5)
    sd = dict(torchref.hf.to_state_dict(tmodel))
    sd.pop("model.layers.1.mlp.up_proj.weight")
    sd.pop("lm_head.weight")
    sd["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(3, 3)
    sd["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(64)
    _write(tmp_path / "bad", sd, cfg)
    with pytest.raises(CheckpointError) as e:
        load(tmp_path / "bad")
    msg = str(e.value)
    for needle in (
        "missing (2)",
        "model.layers.1.mlp.up_proj.weight",
        "lm_head.weight",
        "unexpected (1)",
        "q_proj.bias",
        "wrong shape (1)",
        "k_proj.weight: expected (32, 64), got (3, 3)",
    ):
        assert needle in msg
    with pytest.raises(FileNotFoundError, match="no config.json"):
        os.makedirs(tmp_path / "empty")
        load(tmp_path / "empty")
    (tmp_path / "empty" / "config.json").write_text(json.dumps(cfg.to_hf()))
    with pytest.raises(FileNotFoundError, match="neither model.safetensors nor"):
        load(tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match="not a directory"):
        load(tmp_path / "nowhere")


def test_interrupted_save_keeps_previous_checkpoint(tmp_path, monkeypatch):
    tmodel, jmodel = twin_models(ModelConfig.preset("tiny"), seed=6)
    target = tmp_path / "ckpt"
    torchref.save_pretrained(tmodel, target)
    before = {f: (target / f).read_bytes() for f in os.listdir(target)}

    import safetensors.numpy

    calls = {"n": 0}
    real = safetensors.numpy.save_file

    def dying_save(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt("simulated crash mid-save")
        return real(*args, **kwargs)

    monkeypatch.setattr(safetensors.numpy, "save_file", dying_save)
    with pytest.raises(KeyboardInterrupt):
        jaxattn.save_pretrained(jmodel, target, max_shard_bytes=20_000)
    assert {f: (target / f).read_bytes() for f in os.listdir(target)} == before
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # no temp directory left behind


def test_save_rejects_wrong_model_type(tmp_path):
    with pytest.raises(TypeError, match="jaxattn.model.Llama"):
        jaxattn.save_pretrained(object(), tmp_path / "x")
    with pytest.raises(TypeError, match="LlamaForCausalLM"):
        torchref.save_pretrained(object(), tmp_path / "x")


def test_a_mixed_dtype_checkpoint_loads_each_tensor_as_stored(tmp_path):
    """Layer 0's norm weights stored in bfloat16, layer 1's in float32: ``dtype=None`` stacks the layers in the
    widest dtype of the group (float32), so layer 1 is not rounded to bfloat16 and the logits are torch's."""
    from safetensors import safe_open

    tmodel, _ = twin_models(ModelConfig.preset("tiny"), seed=6)
    with torch.no_grad():  # norm weights away from 1.0 (exact in bfloat16)
        gen = torch.Generator().manual_seed(0)
        for name, p in tmodel.named_parameters():
            if name.endswith("layernorm.weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
    torchref.save_pretrained(tmodel, tmp_path / "m")
    f = str(tmp_path / "m" / hf_format.SINGLE_FILE)
    with safe_open(f, "pt") as sf:
        metadata, tensors = sf.metadata(), {k: sf.get_tensor(k) for k in sf.keys()}
    for k in [k for k in tensors if k.startswith("model.layers.0.") and k.endswith("layernorm.weight")]:
        tensors[k] = tensors[k].to(torch.bfloat16)
    safetensors_torch.save_file(tensors, f, metadata=metadata)

    tloaded = torchref.from_pretrained(tmp_path / "m")
    jloaded = jaxattn.from_pretrained(tmp_path / "m")
    assert tloaded.model.layers[0].input_layernorm.weight.dtype == torch.bfloat16
    stacked = np.asarray(jloaded.layers.attn_norm[...])
    assert stacked.dtype == np.float32
    want = tensors["model.layers.1.input_layernorm.weight"].numpy()
    assert np.array_equal(stacked[1].view(np.uint32), want.view(np.uint32))  # bit-exact, not rounded to bf16
    tok = tokens(np.random.default_rng(2), 256, 2, 9)
    with torch.no_grad():
        want_logits = tloaded(torch.from_numpy(tok)).numpy()
    got = np.asarray(jitted(jloaded)(jnp.asarray(tok)))
    assert np.abs(got - want_logits).max() <= 1e-6
