"""Mixture-of-experts GGUF files (Mixtral as arch "llama", Qwen3-MoE as "qwen3moe") load into both twins: files
written here as llama.cpp's ``convert_hf_to_gguf.py`` writes them from a random transformers model's saved directory
(its per-expert tensors stacked into one ``blk.N.ffn_*_exps`` tensor per layer; q/k rows permuted for "llama" only),
F32 logits within 1e-4 of transformers', Q8_0 twins within 1e-4 of each other; bad files are refused by key.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")
pytest.importorskip("tokenizers")

from parity_tests.twins import gguf_twin_logits, llama_cpp_permute, write_gguf_tensors  # noqa: E402
from twincore.config import ModelConfig  # noqa: E402
from twincore.gguf import read_gguf, read_gguf_config  # noqa: E402
from twincore.hf_format import CheckpointError, expected_shapes  # noqa: E402

LOGITS_TOL = 1e-4  # design §7 (docs/design.md), fp32 full-model logits
Q8_0 = gguf.GGMLQuantizationType.Q8_0
MERGES = ["Ġ t", "h e"]
ARCH = {"mixtral": "llama", "qwen3_moe": "qwen3moe"}


def _vocab() -> list[str]:
    from tokenizers.pre_tokenizers import ByteLevel

    return sorted(ByteLevel.alphabet()) + ["".join(m.split(" ")) for m in MERGES]


def _config(model_type: str, tied: bool = False) -> ModelConfig:
    """moe-tiny in either family; router_aux_loss_coef is transformers' default, as a GGUF file does not store it."""
    extra = dict(moe_ffn_dim=32) if model_type == "qwen3_moe" else {}
    return ModelConfig.preset(
        "moe-tiny",
        model_type=model_type,
        vocab_size=len(_vocab()),
        tie_embeddings=tied,
        router_aux_loss_coef=0.001,
        **extra,
    )


# The converter's names (gguf-py tensor_mapping.py), written out as the oracle: HF layer suffix -> GGUF suffix.
LAYER_NAMES = {
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "block_sparse_moe.gate.weight": "ffn_gate_inp.weight",
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
}
EXPERT_NAMES = {  # per-expert HF projection -> merged GGUF tensor (Mixtral: w1 gate, w3 up, w2 down)
    "gate_proj": "ffn_gate_exps.weight",
    "up_proj": "ffn_up_exps.weight",
    "down_proj": "ffn_down_exps.weight",
    "w1": "ffn_gate_exps.weight",
    "w3": "ffn_up_exps.weight",
    "w2": "ffn_down_exps.weight",
}
GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def _gguf_tensors(cfg: ModelConfig, hf: dict) -> dict:
    """GGUF name -> numpy tensor, as the converter builds them from an HF state dict with one tensor per expert."""
    out, experts = {}, {}
    for key, t in hf.items():
        if key in GLOBAL_NAMES:
            out[GLOBAL_NAMES[key]] = t
            continue
        _, _, i, rest = key.split(".", 3)
        if ".experts." in rest:  # mlp.experts.{e}.gate_proj.weight / block_sparse_moe.experts.{e}.w1.weight
            e, proj = rest.split(".experts.")[1].split(".")[:2]
            experts.setdefault(f"blk.{i}.{EXPERT_NAMES[proj]}", {})[int(e)] = t
            continue
        if cfg.model_type == "mixtral" and rest == "self_attn.q_proj.weight":  # LlamaModel.modify_tensors
            t = llama_cpp_permute(t, cfg.n_heads)
        elif cfg.model_type == "mixtral" and rest == "self_attn.k_proj.weight":
            t = llama_cpp_permute(t, cfg.n_kv_heads)
        out[f"blk.{i}.{LAYER_NAMES[rest]}"] = t
    for name, by_e in experts.items():  # torch.stack(datas, dim=0) over the expert ids
        assert sorted(by_e) == list(range(cfg.n_experts))
        out[name] = np.stack([by_e[e] for e in range(cfg.n_experts)])
    return out


def _write(path, cfg: ModelConfig, hf: dict, qtype=None, arch=None, kv=None, drop=(), extra=None):
    """The file convert_hf_to_gguf.py writes: TextModel.set_gguf_parameters' keys, plus LlamaModel's vocab size and
    rope dimension (Mixtral) or Qwen2MoeModel's expert width (Qwen3-MoE). ``kv`` adds or replaces metadata
    ({key: (GGUFWriter add_ method suffix, value)}, value None drops the key); ``drop`` / ``extra`` edit tensors."""
    arch = arch or ARCH[cfg.model_type]
    meta = {
        "block_count": ("uint32", cfg.n_layers),
        "context_length": ("uint32", cfg.max_seq_len),
        "embedding_length": ("uint32", cfg.dim),
        "feed_forward_length": ("uint32", cfg.ffn_dim),
        "attention.head_count": ("uint32", cfg.n_heads),
        "attention.head_count_kv": ("uint32", cfg.n_kv_heads),
        "rope.freq_base": ("float32", cfg.rope_theta),
        "attention.layer_norm_rms_epsilon": ("float32", cfg.norm_eps),
        "expert_count": ("uint32", cfg.n_experts),
        "expert_used_count": ("uint32", cfg.experts_per_token),
        "attention.key_length": ("uint32", cfg.resolved_head_dim),
        "attention.value_length": ("uint32", cfg.resolved_head_dim),
    }
    if cfg.model_type == "mixtral":
        meta.update(
            vocab_size=("uint32", cfg.vocab_size), **{"rope.dimension_count": ("uint32", cfg.resolved_head_dim)}
        )
    else:
        meta.update(expert_feed_forward_length=("uint32", cfg.expert_ffn_dim))
    meta = {f"{arch}.{k}": v for k, v in meta.items()}
    meta.update(kv or {})
    w = gguf.GGUFWriter(str(path), arch)
    for key, (kind, value) in meta.items():
        if value is not None:
            getattr(w, f"add_{kind}")(key, value)
    vocab = _vocab()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(vocab)
    w.add_token_types([1] * len(vocab))
    w.add_token_merges(MERGES)
    tensors = {name: t for name, t in {**_gguf_tensors(cfg, hf), **(extra or {})}.items() if name not in drop}
    # the converter keeps 1-D tensors, norms and the router (FFN_GATE_INP) in F32
    write_gguf_tensors(w, tensors, qtype, f32=("ffn_gate_inp",))
    return path


def _hf_model(cfg: ModelConfig, path, seed: int):
    """A random-weight transformers model of ``cfg`` (norms around 1) and its saved tensors as on disk (one tensor
    per expert: what the converter reads)."""
    import safetensors.numpy

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**cfg.to_hf())).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if p.ndim == 1 else 0.2 * torch.randn_like(p))
    model.save_pretrained(path)
    return model, safetensors.numpy.load_file(str(path / "model.safetensors"))


@pytest.mark.parametrize(
    "model_type,qtype,tied",
    [
        ("mixtral", None, False),
        ("qwen3_moe", None, False),
        pytest.param("mixtral", Q8_0, True, marks=pytest.mark.slow),
        ("qwen3_moe", Q8_0, True),
    ],
    ids=["mixtral-f32", "qwen3_moe-f32", "mixtral-q8_0-tied", "qwen3_moe-q8_0-tied"],
)
def test_converted_file_loads_into_both(tmp_path, rng, model_type, qtype, tied):
    cfg = _config(model_type, tied)
    model, hf = _hf_model(cfg, tmp_path / "hf", seed=int(rng.integers(1 << 30)))
    path = _write(tmp_path / "m.gguf", cfg, hf, qtype)
    assert read_gguf_config(path) == cfg
    config, tensors, tok = read_gguf(path)
    assert config == cfg and set(tensors) == set(hf) - ({"lm_head.weight"} if tied else set())
    assert tok.decode(tok.encode(" the he")) == " the he"
    for k, v in tensors.items():
        quantized = qtype is not None and v.ndim >= 2 and not k.endswith(".gate.weight")  # the router stays F32
        want = gguf.quants.dequantize(gguf.quants.quantize(hf[k], qtype), qtype) if quantized else hf[k]
        np.testing.assert_array_equal(v, want, err_msg=k)  # each expert in its place; q/k un-permuted exactly
    ids = rng.integers(0, cfg.vocab_size, (2, 11))
    out_t, out_j = gguf_twin_logits(path, ids)
    if qtype is None:
        with torch.no_grad():
            ref = model(torch.from_numpy(ids)).logits.double().numpy()
        assert np.abs(out_t - ref).max() <= LOGITS_TOL
        assert np.abs(out_j - ref).max() <= LOGITS_TOL
    else:
        assert np.abs(out_t - out_j).max() <= LOGITS_TOL


def test_parameter_table_names_the_merged_expert_tensors(rng):
    """params.gguf_names: the converter's names; a merged tensor maps to its layer's per-expert HF keys, in order."""
    from twincore import params

    for model_type in ARCH:
        cfg = _config(model_type)
        hf = _random_hf(cfg, rng)
        names = params.gguf_names(cfg)
        assert set(names) == set(_gguf_tensors(cfg, hf))
        gate = "block_sparse_moe.experts.{}.w1" if model_type == "mixtral" else "mlp.experts.{}.gate_proj"
        assert names["blk.1.ffn_gate_exps.weight"] == tuple(
            f"model.layers.1.{gate.format(e)}.weight" for e in range(cfg.n_experts)
        )
        assert params.match_gguf("blk.1.ffn_gate_exps.weight") == (params.row("e_gate"), (1,))


def _random_hf(cfg: ModelConfig, rng) -> dict:
    return {k: (0.1 * rng.standard_normal(s)).astype(np.float32) for k, s in expected_shapes(cfg).items()}


def test_refusals_name_the_key(tmp_path, rng):
    mix, qwen = _config("mixtral"), _config("qwen3_moe")
    hf_mix, hf_qwen = _random_hf(mix, rng), _random_hf(qwen, rng)
    dense = {f"blk.1.ffn_{p}.weight": np.zeros((64, 64), np.float32) for p in ("gate", "up", "down")}
    three = np.zeros((3, 64, 64), np.float32)  # 3 experts merged where expert_count says 4
    cases = [
        ("arch", mix, hf_mix, dict(arch="qwen2moe"), r"general\.architecture='qwen2moe' is not supported"),
        ("used", mix, hf_mix, dict(kv={"llama.expert_used_count": ("uint32", 5)}), r"llama\.expert_used_count=5"),
        ("swa", mix, hf_mix, dict(kv={"llama.attention.sliding_window": ("uint32", 4096)}), r"sliding_window=4096"),
        ("norm", mix, hf_mix, dict(kv={"llama.expert_weights_norm": ("bool", False)}), r"llama\.expert_weights_norm"),
        ("shared", qwen, hf_qwen, dict(kv={"qwen3moe.expert_shared_count": ("uint32", 1)}), r"expert_shared_count=1"),
        ("gating", qwen, hf_qwen, dict(kv={"qwen3moe.expert_gating_func": ("uint32", 2)}), r"expert_gating_func=2"),
        ("dense", qwen, hf_qwen, dict(extra=dense), r"dense MLP tensors \(blk\.1\.ffn_down\.weight"),
        ("count", qwen, hf_qwen, dict(kv={"qwen3moe.expert_count": ("uint32", 0)}), r"qwen3moe\.expert_count=0"),
        (
            "merged",
            qwen,
            hf_qwen,
            dict(extra={"blk.0.ffn_up_exps.weight": three}),
            r"ffn_up_exps\.weight has GGUF shape \[64, 64, 3\].*=4",
        ),
        ("router", qwen, hf_qwen, dict(drop={"blk.1.ffn_gate_inp.weight"}), r"missing \(1\): blk\.1\.ffn_gate_inp"),
    ]
    for name, cfg, hf, kw, match in cases:
        path = _write(tmp_path / f"{name}.gguf", cfg, hf, **kw)
        with pytest.raises(CheckpointError, match=rf"{name}\.gguf(.|\n)*{match}"):
            read_gguf(path, tokenizer=False)
    with pytest.raises(CheckpointError, match=r"swa\.gguf.*sliding_window"):  # the metadata alone refuses too
        read_gguf_config(tmp_path / "swa.gguf")


def test_qwen3moe_metadata_defaults_are_llama_cpps(tmp_path, rng):
    """No expert_feed_forward_length: llama.cpp's feed_forward_length // expert_used_count (64 // 2 here); an
    explicit expert_weights_norm=false (the converter never writes one) is read as the file states it."""
    cfg = _config("qwen3_moe")
    hf = _random_hf(cfg, rng)
    path = _write(tmp_path / "w.gguf", cfg, hf, kv={"qwen3moe.expert_feed_forward_length": ("uint32", None)})
    assert read_gguf_config(path) == cfg
    path = _write(tmp_path / "n.gguf", cfg, hf, kv={"qwen3moe.expert_weights_norm": ("bool", False)})
    assert read_gguf_config(path) == cfg.replace(norm_topk_prob=False)
