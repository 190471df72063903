"""GGUF (llama.cpp) files -> ``ModelConfig``, Hugging Face-named numpy tensors and a tokenizer, for the families the
model covers: dense Llama and Mixtral (``general.architecture`` "llama", Mixtral with ``llama.expert_count``), Qwen2 /
2.5 ("qwen2"), Qwen3 ("qwen3") and Qwen3-MoE ("qwen3moe"). The tokenizer of ``tokenizer.ggml.*`` is the byte-level
BPE of ``model`` "gpt2", split before its merges as llama.cpp splits for ``tokenizer.ggml.pre`` (:data:`PRE_TOKENIZERS`:
GPT-2's, SmolLM's, Llama 3's and Qwen2's splits), or the SentencePiece BPE of ``model`` "llama" (merges from
scores). Llama 3.x's ``rope_freqs.weight`` (RoPE scaling as one divisor per frequency) becomes the config's llama3
``rope_scaling`` (:func:`llama3_scaling_from_factors`).

Framework-neutral (numpy, the ``gguf`` package and, for the tokenizer, ``tokenizers``): ``jaxattn.hf`` and
``torchref.hf`` build their models from what this returns. Quantized tensors (Q4_1, Q8_0, K-quants, ...) are
dequantized by ``gguf.quants.dequantize``; llama.cpp's row permutation of the q/k projections ("llama" files only) is
undone; each layer's merged expert tensor (``blk.N.ffn_gate_exps.weight``: every expert in one tensor) is split into
the per-expert HF keys (``model.layers.N.mlp.experts.E.gate_proj.weight``, Mixtral's ``...experts.E.w1.weight``).

Before anything is read, the tensor-info records are checked against the file as llama.cpp's
``gguf_init_from_file`` checks them (:func:`check_tensor_data`): every type is a ggml type, every row length a
multiple of its type's block, and each tensor's data offset equals the running sum of the tensors before it, each
padded to the alignment, with the data inside the file (and, beyond llama.cpp, no more than the alignment padding
left after the last tensor). A changed type field (F32 read as F16, Q8_0 as Q4_1) therefore fails with a
``CheckpointError`` naming the file, the tensor, its type and the byte counts, instead of loading as garbage.

    config, tensors, tok = read_gguf("SmolLM2-135M-Instruct.Q4_1.gguf")
    tok.decode(tok.encode("<|im_start|>user\\nHi")), tok.chat_template
    read_gguf_config(path), read_gguf_tokenizer(path)   # the metadata alone: no weight is dequantized
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from . import params
from .chat import render_template
from .config import ModelConfig
from .hf_format import CheckpointError, check_state_shapes

# ModelConfig field <- "llama.<key>" (None = required)
CONFIG_KEYS = (
    ("n_layers", "block_count", None),
    ("dim", "embedding_length", None),
    ("n_heads", "attention.head_count", None),
    ("n_kv_heads", "attention.head_count_kv", "n_heads"),
    ("ffn_dim", "feed_forward_length", None),
    ("max_seq_len", "context_length", None),
    ("norm_eps", "attention.layer_norm_rms_epsilon", None),
    ("rope_theta", "rope.freq_base", 10000.0),
)

# What llama.cpp's converter writes for the two mixture-of-experts families, verified in ggml-org/llama.cpp
# (conversion/base.py TextModel.set_gguf_parameters, conversion/llama.py LlamaModel, conversion/qwen.py
# Qwen2MoeModel / Qwen3MoeModel; src/models/llama.cpp, src/models/qwen3moe.cpp, src/llama-model.cpp
# llama_model_rope_type) and gguf-py 0.19 (constants.py MODEL_ARCH_NAMES / TENSOR_NAMES / Keys.LLM, tensor_mapping.py):
# - MixtralForCausalLM converts as LlamaModel: arch "llama", q/k rows permuted as for Llama, llama.expert_count
#   (num_local_experts), llama.expert_used_count (num_experts_per_tok), the experts' width in
#   llama.feed_forward_length (intermediate_size); no sliding-window key. Per layer, experts.{e}.w1 / w3 / w2 are
#   torch.stack-ed on dim 0 into blk.N.ffn_gate_exps / ffn_up_exps / ffn_down_exps.weight: numpy [experts, out, in]
#   (ggml ne {in, out, experts}); the router is blk.N.ffn_gate_inp.weight.
# - Qwen3MoeForCausalLM converts as Qwen2MoeModel, a TextModel (not LlamaModel: no q/k permutation; llama.cpp ropes
#   qwen3moe NEOX-style): arch "qwen3moe", keys qwen3moe.* with expert_count (num_experts), expert_used_count,
#   expert_feed_forward_length (moe_intermediate_size; llama.cpp falls back to feed_forward_length //
#   expert_used_count), attention.key_length / value_length (head_dim); extra tensors blk.N.attn_q_norm /
#   attn_k_norm.weight; experts merged as for Mixtral (mlp.experts.{e}.gate_proj / up_proj / down_proj).
# - norm_topk_prob is not written for either: both graphs call build_moe_ffn with norm_w=true and softmax gating, so
#   an absent {arch}.expert_weights_norm reads as True. Routers and norms stay F32 in quantized files.
# MoE keys these two converters never write, refused when present with another value: (key, allowed, what it is)
MOE_REFUSED = (
    ("attention.sliding_window", (0,), "sliding-window attention"),
    ("expert_shared_count", (0,), "shared experts"),
    ("leading_dense_block_count", (0,), "leading dense (non-MoE) layers"),
    ("expert_gating_func", (1,), "a router gating function other than softmax (1)"),
    ("expert_weights_scale", (0.0, 1.0), "scaled expert weights"),
    ("expert_group_count", (0, 1), "grouped expert routing"),
)
# - Qwen3ForCausalLM converts as Qwen3Model (a Qwen2Model, a TextModel): arch "qwen3", keys qwen3.*, no expert keys,
#   no q/k permutation (NEOX-style RoPE in src/models/qwen3.cpp), attention.key_length / value_length (head_dim),
#   blk.N.attn_q_norm / attn_k_norm.weight as for Qwen3-MoE; its dense MLP named as Llama's.
FAMILY_NAMES = {
    "llama": "Llama",
    "mistral": "Mistral",
    "qwen2": "Qwen2",
    "qwen3": "Qwen3",
    "mixtral": "Mixtral",
    "qwen3_moe": "Qwen3-MoE",
}
ARCHITECTURES = ("llama", "qwen2", "qwen3", "qwen3moe")  # general.architecture values that load


class PreTokenizer(NamedTuple):
    """How llama.cpp's llama-vocab.cpp treats a ``tokenizer.ggml.pre`` name (its LLAMA_VOCAB_PRE_TYPE_* table).

    ``split``: "gpt2" is GPT-2's regex (ByteLevel's own); "digits+gpt2" each digit alone first, then GPT-2's regex;
    anything else a regex whose matches and the gaps between them are the pieces. ``ignore_merges``: a piece that is
    a whole vocabulary token is that token, whatever the merges would make of it (tiktoken's rule; HF's
    ``"ignore_merges": true``). ``add_bos``: whether a BOS is added when the file has no ``add_bos_token`` key.
    """

    split: str
    ignore_merges: bool = False
    add_bos: bool = False


# Llama 3's and Qwen2's regexes (llama.cpp spells the contractions '[sS]|'[tT]|..., the same thing) differ in the
# digits: runs of up to three, or one at a time.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
_GPT2, _DIGITS = PreTokenizer("gpt2"), PreTokenizer("digits+gpt2")
_LLAMA3, _QWEN2 = PreTokenizer(_LLAMA3_SPLIT, ignore_merges=True, add_bos=True), PreTokenizer(_QWEN2_SPLIT)
PRE_TOKENIZERS = {  # tokenizer.ggml.pre -> PreTokenizer, for the names of the families the model covers
    "default": _GPT2,
    "gpt-2": _GPT2,
    "gpt2": _GPT2,
    "smollm": _DIGITS,
    "starcoder": _DIGITS,
    "refact": _DIGITS,
    "llama3": _LLAMA3,  # Llama 3.x ("llama-bpe" is what the converter writes)
    "llama-v3": _LLAMA3,
    "llama-bpe": _LLAMA3,
    "qwen2": _QWEN2,  # Qwen2 / 2.5 / 3
    "deepseek-r1-qwen": _QWEN2,
}
GGUF_READ_DTYPES = ("float32", "float16")
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types that are matched as whole tokens in text


class GGUFModel(NamedTuple):
    config: ModelConfig
    tensors: dict  # HF name -> np.ndarray
    tokenizer: GGUFTokenizer | None


@dataclass(frozen=True)
class GGUFTokenizer:
    """The file's BPE tokenizer (a ``tokenizers.Tokenizer``), its special ids and chat template."""

    tokenizer: Any
    bos_id: int | None
    eos_id: int | None
    add_bos: bool
    chat_template: str | None

    name = "the GGUF file's tokenizer"

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, no BOS added (``add_bos`` says whether the model wants one first); special tokens
        written in the text (``<|im_start|>``) become their ids."""
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """``messages`` through the file's chat template (``tokenizer.chat_template``)."""
        special = {f"{k}_token": self.tokenizer.id_to_token(i) for k, i in (("bos", self.bos_id), ("eos", self.eos_id))}
        return render_template(self.chat_template, messages, add_generation_prompt, "this GGUF file", special)


_REQUIRED = object()


def _get(reader, key: str, where: str, default: Any = _REQUIRED) -> Any:
    field = reader.fields.get(key)
    if field is None:
        if default is _REQUIRED:
            raise CheckpointError(f"{where} has no metadata key {key!r}")
        return default
    return field.contents()


def _positive(value: Any, key: str, where: str, kind=int):
    if isinstance(value, list):  # per-layer values (some architectures): one value only
        if len(set(value)) != 1:
            raise CheckpointError(
                f"{where}: {key}={value} varies per layer; only one value for all layers is supported"
            )
        value = value[0]
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.number)) or not value > 0:
        raise CheckpointError(f"{where}: {key}={value!r} is invalid; expected a positive number")
    if kind is int:
        if int(value) != value:
            raise CheckpointError(f"{where}: {key}={value!r} is invalid; expected a positive integer")
        return int(value)
    return float(str(np.float32(value)))  # the float32 in the file, shortest form: 1e-05, not 9.99999974e-06


def _read_config(reader, where: str, arch: str, names: set) -> ModelConfig:
    kw: dict[str, Any] = {}
    for field, key, default in CONFIG_KEYS:
        full = f"{arch}.{key}"
        value = _get(reader, full, where, _REQUIRED if default is None else None)
        if value is None:
            value = kw[default] if isinstance(default, str) else default
        kw[field] = _positive(value, full, where, float if field in ("norm_eps", "rope_theta") else int)
    head_dim = _get(reader, f"{arch}.attention.key_length", where, None)
    head_dim = kw["dim"] // kw["n_heads"] if head_dim is None else _positive(head_dim, "key_length", where)
    value_dim = _get(reader, f"{arch}.attention.value_length", where, None)
    if value_dim is not None and value_dim != head_dim:
        raise CheckpointError(
            f"{where}: {arch}.attention.value_length={value_dim} differs from key_length="
            f"{head_dim}; only equal query/key and value head sizes are supported"
        )
    rope_dim = _get(reader, f"{arch}.rope.dimension_count", where, None)
    if rope_dim is not None and rope_dim != head_dim:
        raise CheckpointError(
            f"{where}: {arch}.rope.dimension_count={rope_dim} but the head size is {head_dim}; "
            f"partial rotary embeddings are not supported"
        )
    scaling = _get(reader, f"{arch}.rope.scaling.type", where, "none")
    if scaling != "none":
        raise CheckpointError(
            f"{where} uses {arch}.rope.scaling.type={scaling!r}: not supported; a GGUF file loads without RoPE "
            f"scaling or with Llama 3's (a {ROPE_FREQS} tensor, no rope.scaling.type key)"
        )
    if ROPE_FREQS in names:
        factors = _rope_freq_factors(reader, where)
        kw["rope_scaling"] = llama3_scaling_from_factors(factors, kw["rope_theta"], head_dim, where)
    moe = _read_moe(reader, where, arch, kw["ffn_dim"], names)
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = len(tokens.data) if tokens is not None else _get(reader, f"{arch}.vocab_size", where, None)
    if vocab is None:
        raise CheckpointError(f"{where} has neither tokenizer.ggml.tokens nor {arch}.vocab_size")
    special = {}  # the tokenizer's BOS / EOS, kept in the config as a Hugging Face config.json keeps them
    for key in ("bos_token_id", "eos_token_id"):
        value = _get(reader, f"tokenizer.ggml.{key}", where, None)
        if value is not None and 0 <= int(value) < int(vocab):
            special[key] = int(value)
    return ModelConfig(
        vocab_size=int(vocab),
        head_dim=None if head_dim * kw["n_heads"] == kw["dim"] else head_dim,
        tie_embeddings="output.weight" not in names,
        **special,
        **moe,
        **kw,
    )


ROPE_FREQS = "rope_freqs.weight"
LLAMA3_ORIGINAL_CONTEXT = 8192  # Llama 3.x's original_max_position_embeddings; see llama3_scaling_from_factors


def _rope_freq_factors(reader, where: str) -> np.ndarray:
    import gguf

    (t,) = [t for t in reader.tensors if t.name == ROPE_FREQS]
    return np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float64).reshape(-1)


def llama3_factors(scaling: dict, rope_theta: float, head_dim: int) -> np.ndarray:
    """Llama 3's per-frequency RoPE divisors as llama.cpp's converter writes them (``rope_freqs.weight``): 1 for a
    wavelength under ``old / high_freq_factor``, ``factor`` over ``old / low_freq_factor``, and between them the
    reciprocal of HF's smoothed interpolation."""
    inv = 1.0 / (rope_theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    wavelen = 2 * np.pi / inv
    old, lo, hi, factor = (scaling[k] for k in ("original_max_position_embeddings", *_FACTOR_KEYS))
    smooth = (old / wavelen - lo) / (hi - lo)
    out = 1.0 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < old / hi, 1.0, np.where(wavelen > old / lo, factor, out))


_FACTOR_KEYS = ("low_freq_factor", "high_freq_factor", "factor")


def llama3_scaling_from_factors(factors, rope_theta: float, head_dim: int, where: str) -> dict | None:
    """HF's ``rope_scaling`` dict (``rope_type`` "llama3") that gives the file's ``rope_freqs.weight``, or None when
    every factor is 1 (no scaling).

    ``factor`` is the largest divisor. Between the two wavelength bounds the converter wrote
    ``1 / ((1 - s) / factor + s)`` with ``s = (old / wavelen - lo) / (hi - lo)``, a straight line in ``1 / wavelen``:
    its slope and intercept, fitted on those frequencies (at least two), give ``old / (hi - lo)`` and
    ``-lo / (hi - lo)``. Only the ratios ``old / lo`` and ``old / hi`` are in the file, and the rotation depends on
    nothing else, so ``old`` is taken as Llama 3.x's 8192. The result is checked against every factor."""
    f = np.asarray(factors, np.float64)
    if f.shape != (head_dim // 2,) or not np.isfinite(f).all() or f.min() < 1 - 1e-6:
        raise CheckpointError(
            f"{where}: {ROPE_FREQS} has shape {list(f.shape)} and values in [{f.min():g}, {f.max():g}]; expected "
            f"{head_dim // 2} finite divisors >= 1 (Llama 3's RoPE scaling, one per frequency of a {head_dim}-wide "
            f"head)"
        )
    factor = float(np.float32(f.max()))
    if factor <= 1 + 1e-6:
        return None
    inv = 1.0 / (rope_theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    mid = (f > 1 + 1e-5) & (f < factor * (1 - 1e-5))
    if mid.sum() >= 2:
        smooth = (1 / f[mid] - 1 / factor) / (1 - 1 / factor)
        slope, intercept = np.polyfit(inv[mid] / (2 * np.pi), smooth, 1)
        old = LLAMA3_ORIGINAL_CONTEXT
        lo = -intercept * old / slope
        for digits in (4, None):  # round numbers when they give the same factors (Llama 3.x: 1 and 4)
            scaling = {"rope_type": "llama3", "factor": factor}
            scaling["low_freq_factor"] = float(lo if digits is None else round(lo, digits))
            scaling["high_freq_factor"] = float(
                (lo + old / slope) if digits is None else round(lo + old / slope, digits)
            )
            scaling["original_max_position_embeddings"] = old
            if np.allclose(llama3_factors(scaling, rope_theta, head_dim), f, rtol=1e-5, atol=0):
                return scaling
    raise CheckpointError(
        f"{where}: {ROPE_FREQS} = {np.array2string(f, precision=4)} is not Llama 3's RoPE scaling (divisors 1, then a "
        f"smooth rise over at least two frequencies, then one factor) for rope_theta={rope_theta:g} and a "
        f"{head_dim}-wide head; no other per-frequency scaling is supported"
    )


def _read_moe(reader, where: str, arch: str, ffn_dim: int, names: set) -> dict:
    """The family and mixture-of-experts ``ModelConfig`` fields (only the family for a dense "llama" or "qwen3" file);
    refuses by key what the model cannot represent."""
    experts = _get(reader, f"{arch}.expert_count", where, _REQUIRED if arch == "qwen3moe" else 0)
    if arch in ("qwen2", "qwen3") and experts:
        raise CheckpointError(f"{where}: {arch}.expert_count={experts!r}: a dense {FAMILY_NAMES[arch]} has no experts")
    if arch != "qwen3moe" and not experts:
        window = _get(reader, f"{arch}.attention.sliding_window", where, None)
        if window not in (None, 0):  # never written for Llama / Mistral / Qwen3 by the converter: refused, not ignored
            raise CheckpointError(f"{where}: {arch}.attention.sliding_window={window!r}: not supported in a GGUF file")
        return {} if arch == "llama" else dict(model_type=arch)
    n_experts = _positive(experts, f"{arch}.expert_count", where)
    key = f"{arch}.expert_used_count"
    used = _positive(_get(reader, key, where), key, where)
    if used > n_experts:
        raise CheckpointError(
            f"{where}: {key}={used} is more than {arch}.expert_count={n_experts}: a token can be sent to at most "
            f"every expert once"
        )
    for name, allowed, what in MOE_REFUSED:
        value = _get(reader, f"{arch}.{name}", where, None)
        if value is not None and value not in allowed:
            raise CheckpointError(f"{where}: {arch}.{name}={value!r}: {what} is not supported")
    dense = sorted(n for n in names if (m := params.match_gguf(n)) and m[0] in params.dense_mlp_rows())
    if dense:
        raise CheckpointError(
            f"{where} is a mixture-of-experts file with dense MLP tensors ({', '.join(dense[:6])}"
            f"{' ...' if len(dense) > 6 else ''}): only models whose every layer is sparse load (the layers are "
            f"stacked and scanned as identical ones)"
        )
    norm = _get(reader, f"{arch}.expert_weights_norm", where, True)
    expert_ffn = _get(reader, f"{arch}.expert_feed_forward_length", where, None)
    if arch == "llama":  # Mixtral
        if not norm:
            raise CheckpointError(
                f"{where}: {arch}.expert_weights_norm={norm!r}: Mixtral always renormalises its top-k router weights"
            )
        if expert_ffn is not None and expert_ffn != ffn_dim:
            raise CheckpointError(
                f"{where}: {arch}.expert_feed_forward_length={expert_ffn!r} differs from feed_forward_length="
                f"{ffn_dim}; Mixtral's experts are feed_forward_length wide"
            )
        return dict(model_type="mixtral", n_experts=n_experts, experts_per_token=used)
    if expert_ffn is None:
        moe_ffn = max(1, ffn_dim // used)  # llama.cpp's fallback (src/models/qwen3moe.cpp)
    else:
        moe_ffn = _positive(expert_ffn, f"{arch}.expert_feed_forward_length", where)
    return dict(
        model_type="qwen3_moe",
        n_experts=n_experts,
        experts_per_token=used,
        moe_ffn_dim=moe_ffn,
        norm_topk_prob=bool(norm),
    )


def unpermute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's ``permute`` of a q/k projection ``[n_heads * head_dim, dim]`` (its RoPE layout)."""
    rows, cols = w.shape
    return w.reshape(n_heads, rows // n_heads // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def _pre_tokenizer(split: str, pre_tokenizers):
    """The ``tokenizers`` pre-tokenizer for a :class:`PreTokenizer`'s ``split``."""
    if split == "gpt2":
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if split == "digits+gpt2":
        return pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), _pre_tokenizer("gpt2", pre_tokenizers)]
        )
    from tokenizers import Regex

    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


TOKENIZER_MODELS = ("gpt2", "llama")  # tokenizer.ggml.model values that load: byte-level BPE, SentencePiece BPE


def _build_tokenizer(reader, where: str) -> GGUFTokenizer:
    model = _get(reader, "tokenizer.ggml.model", where)
    if model not in TOKENIZER_MODELS:
        raise CheckpointError(
            f"{where}: tokenizer.ggml.model={model!r} is not supported; only 'gpt2' (byte-level BPE) and 'llama' "
            f"(SentencePiece BPE: Llama 2, Mistral, TinyLlama) tokenizers load"
        )
    try:
        from tokenizers import AddedToken, processors
    except ImportError as e:
        raise ImportError(
            "reading a GGUF tokenizer needs the `tokenizers` package (pip install tokenizers), or pass tokenizer=False"
        ) from e
    tokens = _get(reader, "tokenizer.ggml.tokens", where)
    types = _get(reader, "tokenizer.ggml.token_type", where, [1] * len(tokens))
    if len(types) != len(tokens):
        raise CheckpointError(
            f"{where}: tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens; expected one "
            f"per token"
        )
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    build = _byte_level_bpe if model == "gpt2" else _sentencepiece_bpe
    tok, add_bos_default = build(reader, where, tokens, types, vocab)
    tok.add_tokens(
        [
            AddedToken(tokens[i], special=types[i] == _CONTROL, normalized=False)
            for i in range(len(tokens))
            if types[i] in (_CONTROL, _USER_DEFINED)
        ]
    )
    bos = _get(reader, "tokenizer.ggml.bos_token_id", where, None)
    eos = _get(reader, "tokenizer.ggml.eos_token_id", where, None)
    for key, i in (("bos_token_id", bos), ("eos_token_id", eos)):
        if i is not None and not 0 <= i < len(tokens):
            raise CheckpointError(f"{where}: tokenizer.ggml.{key}={i} is outside the vocabulary (0..{len(tokens) - 1})")
    add_bos = bool(_get(reader, "tokenizer.ggml.add_bos_token", where, add_bos_default))
    if add_bos:
        if bos is None:
            raise CheckpointError(f"{where}: tokenizer.ggml.add_bos_token is true but bos_token_id is missing")
        tok.post_processor = processors.TemplateProcessing(
            single=f"{tokens[bos]} $A", special_tokens=[(tokens[bos], bos)]
        )
    return GGUFTokenizer(
        tok,
        None if bos is None else int(bos),
        None if eos is None else int(eos),
        add_bos,
        _get(reader, "tokenizer.chat_template", where, None),
    )


def _byte_level_bpe(reader, where: str, tokens, types, vocab):
    """``(tokenizer, add_bos default)`` of a "gpt2" file: its merges, split first as :data:`PRE_TOKENIZERS` says."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    pre = _get(reader, "tokenizer.ggml.pre", where, "default")
    if pre not in PRE_TOKENIZERS:
        raise CheckpointError(f"{where}: tokenizer.ggml.pre={pre!r} is not supported; known: {sorted(PRE_TOKENIZERS)}")
    merges = []
    for m in _get(reader, "tokenizer.ggml.merges", where):
        pair = m.split(" ")
        if len(pair) != 2:
            raise CheckpointError(f"{where}: tokenizer.ggml.merges entry {m!r} is not two tokens split by a space")
        merges.append(tuple(pair))
    pre = PRE_TOKENIZERS[pre]
    tok = Tokenizer(
        models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False, ignore_merges=pre.ignore_merges)
    )
    tok.pre_tokenizer = _pre_tokenizer(pre.split, pre_tokenizers)
    tok.decoder = decoders.ByteLevel()
    return tok, pre.add_bos


_NORMAL, _UNKNOWN = 1, 2


def _sentencepiece_bpe(reader, where: str, tokens, types, vocab):
    """``(tokenizer, add_bos default)`` of a "llama" file: SentencePiece's BPE as llama.cpp runs it (its
    llm_tokenizer_spm). Spaces are "▁", and a "▁" goes before the text and after each special token when
    ``add_space_prefix`` (the default); adjacent pieces merge while their concatenation is a normal token, the
    highest-scoring first; a character outside the vocabulary becomes its UTF-8 byte tokens (``<0xE4>``). The file
    has scores, not merges: every split of a normal token into two normal tokens is a merge ranked by that token's
    score, and ``tokenizers``' BPE with byte fallback then runs the same algorithm. A BOS is added by default."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    scores = _get(reader, "tokenizer.ggml.scores", where)
    if len(scores) != len(tokens):
        raise CheckpointError(
            f"{where}: tokenizer.ggml.scores has {len(scores)} entries for {len(tokens)} tokens; a SentencePiece "
            f"vocabulary needs one score per token"
        )
    if _get(reader, "tokenizer.ggml.remove_extra_whitespaces", where, False):
        raise CheckpointError(f"{where}: tokenizer.ggml.remove_extra_whitespaces=True is not supported")
    normal = {t for t, k in zip(tokens, types) if k == _NORMAL}
    ranked = []
    for i, (t, k) in enumerate(zip(tokens, types)):
        if k == _NORMAL and len(t) > 1:
            ranked += [(-float(scores[i]), i, t[:j], t[j:]) for j in range(1, len(t)) if {t[:j], t[j:]} <= normal]
    merges = [(a, b) for _, _, a, b in sorted(ranked)]
    unknown = _get(reader, "tokenizer.ggml.unknown_token_id", where, None)
    if unknown is None:
        unknown = next((i for i, k in enumerate(types) if k == _UNKNOWN), None)
    unk = None if unknown is None else tokens[unknown]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
    prefix = bool(_get(reader, "tokenizer.ggml.add_space_prefix", where, True))
    spaces = normalizers.Replace(" ", "▁")  # per stretch of text between special tokens, as llama.cpp's fragments
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), spaces]) if prefix else spaces
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    return tok, True


# --------------------------------------------------------------------------------- tensor-info validation
_GGUF_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # GGUFValueType -> bytes
_GGUF_STRING, _GGUF_ARRAY, _GGUF_UINT32 = 8, 9, 4
GGML_MAX_DIMS = 4


class TensorInfo(NamedTuple):
    """One tensor-info record of a GGUF header: GGUF dims (innermost first), raw ggml type, data offset."""

    name: str
    dims: tuple[int, ...]
    type: int
    offset: int


class _Header:
    """A cursor over a GGUF file's header (versions 2 and 3: 64-bit counts and lengths), either byte order."""

    def __init__(self, buf, order: str):
        self.buf, self.order, self.pos = buf, order, 0

    def take(self, fmt: str):
        import struct

        value = struct.unpack_from(self.order + fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value[0]

    def string(self) -> bytes:
        n = self.take("Q")
        if self.pos + n > len(self.buf):
            raise ValueError(f"the header is truncated: a string of {n} bytes at byte {self.pos} runs past the end")
        self.pos += n
        return bytes(self.buf[self.pos - n : self.pos])

    def skip_value(self, vtype: int) -> None:
        if vtype == _GGUF_STRING:
            self.string()
        elif vtype == _GGUF_ARRAY:
            itype, count = self.take("I"), self.take("Q")
            if itype in _GGUF_SCALAR_BYTES:
                self.pos += _GGUF_SCALAR_BYTES[itype] * count
            else:
                for _ in range(count):
                    self.skip_value(itype)
        elif vtype in _GGUF_SCALAR_BYTES:
            self.pos += _GGUF_SCALAR_BYTES[vtype]
        else:
            raise ValueError(f"unknown metadata value type {vtype} at byte {self.pos}")
        if self.pos > len(self.buf):
            raise ValueError("the header is truncated: the metadata runs past the end of the file")


def read_tensor_infos(path: str) -> tuple[int, int, list[TensorInfo]]:
    """``(alignment, data section start, tensor infos)`` of a GGUF file, read from its header alone (no tensor
    data). Raises ValueError for a header that cannot be parsed."""
    import mmap
    import struct

    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        try:
            version = struct.unpack_from("<I", buf, 4)[0]
            h = _Header(buf, ">" if version & 0xFFFF == 0 else "<")  # a big-endian file reads as 0x0N000000
            h.pos = 4
            version = h.take("I")
            if version not in (2, 3):
                raise ValueError(f"GGUF version {version} is not supported (versions 2 and 3 are)")
            n_tensors, n_kv = h.take("Q"), h.take("Q")
            alignment = 32  # GGUF_DEFAULT_ALIGNMENT
            for _ in range(n_kv):
                key, vtype = h.string(), h.take("I")
                if key == b"general.alignment" and vtype == _GGUF_UINT32:
                    alignment = h.take("I")
                else:
                    h.skip_value(vtype)
            infos = []
            for _ in range(n_tensors):
                name = h.string().decode("utf-8", errors="replace")
                n_dims = h.take("I")
                if n_dims > GGML_MAX_DIMS:
                    raise ValueError(f"tensor {name!r} has {n_dims} dimensions; ggml allows at most {GGML_MAX_DIMS}")
                dims = tuple(h.take("Q") for _ in range(n_dims))
                infos.append(TensorInfo(name, dims, h.take("I"), h.take("Q")))
        except struct.error as e:
            raise ValueError(f"the header is truncated ({e})") from None
        if alignment == 0 or alignment & (alignment - 1):
            raise ValueError(f"general.alignment={alignment} is not a power of two")
        return alignment, -(-h.pos // alignment) * alignment, infos


def check_tensor_data(path: str, where: str | None = None) -> list[TensorInfo]:
    """Check every tensor-info record of the GGUF file ``path`` against its type, its shape and the file length,
    as llama.cpp's ``gguf_init_from_file`` does (see the module docstring); returns the records. Raises
    :class:`CheckpointError` naming the file, the tensor, its type and what was expected vs found."""
    import gguf

    where = f"GGUF file {path!r}" if where is None else where
    try:
        alignment, start, infos = read_tensor_infos(path)
    except ValueError as e:
        raise CheckpointError(f"{where} cannot be parsed: {e}") from None
    size = os.path.getsize(path)

    def describe(t: TensorInfo) -> str:
        kind = gguf.GGMLQuantizationType(t.type).name
        return f"tensor {t.name!r} (type {kind}, GGUF shape {list(t.dims)})"

    def nbytes(t: TensorInfo) -> int:
        block, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(t.type)]
        return int(np.prod(t.dims, dtype=object)) // block * block_bytes

    expected, prev = 0, None
    for t in infos:
        try:
            block, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(t.type)]
        except (ValueError, KeyError):
            raise CheckpointError(
                f"{where}: tensor {t.name!r} has type {t.type}, which is not a ggml type the installed gguf "
                f"package knows (known: "
                f"{', '.join(f'{k.name}={k.value}' for k in gguf.GGML_QUANT_SIZES)})"
            ) from None
        if any(d < 0 for d in t.dims) or (t.dims and t.dims[0] % block):
            raise CheckpointError(
                f"{where}: {describe(t)} has rows of {t.dims[0] if t.dims else 1} elements, which is not a multiple "
                f"of the {block}-element blocks of its type: the type field does not fit the shape"
            )
        if t.offset % alignment:
            raise CheckpointError(
                f"{where}: {describe(t)} has data offset {t.offset}, expected a multiple of the alignment {alignment}"
            )
        if t.offset != expected:
            if prev is None:
                raise CheckpointError(
                    f"{where}: the first tensor, {describe(t)}, has data offset {t.offset}, expected 0"
                )
            raise CheckpointError(
                f"{where}: {describe(t)} has data offset {t.offset}, expected {expected}: the tensor before it, "
                f"{describe(prev)}, takes {nbytes(prev)} bytes by its type and shape (padded to the {alignment}-byte "
                f"alignment: {expected - prev.offset}) but the file gives it {t.offset - prev.offset}; the type "
                f"field or shape of one of the two does not match the data"
            )
        end = start + t.offset + nbytes(t)
        if end > size:
            raise CheckpointError(
                f"{where}: {describe(t)} takes {nbytes(t)} bytes by its type and shape, from byte "
                f"{start + t.offset} to {end}, but the file has {size} bytes: the type field or shape does not "
                f"match the data, or the file is truncated"
            )
        expected, prev = -(-(t.offset + nbytes(t)) // alignment) * alignment, t
    if prev is not None and size - end >= alignment:
        raise CheckpointError(
            f"{where}: the last tensor, {describe(prev)}, takes {nbytes(prev)} bytes by its type and shape and "
            f"ends at byte {end}, but the file has {size} bytes ({size - end} after it, expected fewer than the "
            f"{alignment}-byte alignment): the type field or shape does not match the data"
        )
    return infos


def _open(path: str | os.PathLike):
    """``(gguf.GGUFReader, where, arch)`` of a llama.cpp file of a supported architecture (memory-mapped: nothing is
    read yet); errors name it."""
    try:
        import gguf
    except ImportError as e:
        raise ImportError("reading a GGUF file needs the `gguf` package (pip install gguf)") from e
    path = os.fspath(path)
    where = f"GGUF file {path!r}"
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{where} does not exist or is not a file")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise CheckpointError(f"{where} is not a GGUF file (starts with {magic!r}, expected b'GGUF')")
    check_tensor_data(path, where)  # before gguf's reader maps (and mis-slices) any tensor
    try:
        reader = gguf.GGUFReader(path)
    except (ValueError, IndexError, TypeError) as e:  # the reader's own errors do not name the file
        raise CheckpointError(f"{where} cannot be parsed: {e}") from e
    arch = _get(reader, "general.architecture", where)
    if arch not in ARCHITECTURES:
        raise CheckpointError(
            f"{where}: general.architecture={arch!r} is not supported; only 'llama' (Llama, Mixtral), 'qwen2' "
            f"(Qwen2 / 2.5), 'qwen3' (Qwen3) and 'qwen3moe' (Qwen3-MoE) load"
        )
    return reader, where, arch


def read_gguf_config(path: str | os.PathLike) -> ModelConfig:
    """The ``ModelConfig`` of a llama.cpp file, from its metadata and tensor names (and Llama 3's small
    ``rope_freqs.weight``): no weight is dequantized."""
    reader, where, arch = _open(path)
    return _read_config(reader, where, arch, {t.name for t in reader.tensors})


def read_gguf_tokenizer(path: str | os.PathLike) -> GGUFTokenizer:
    """The file's tokenizer, without reading the tensors (CheckpointError naming the key if it is unsupported)."""
    reader, where, _ = _open(path)
    return _build_tokenizer(reader, where)


def read_gguf(path: str | os.PathLike, dtype: str = "float32", tokenizer: bool = True) -> GGUFModel:
    """``(config, tensors, tokenizer)`` of a llama.cpp file; tensors are HF-named ``dtype`` numpy arrays (one per
    expert, as in HF files, for a mixture of experts).

    ``dtype`` is ``"float32"`` or ``"float16"`` (for bfloat16 read float32 and let the framework cast);
    ``tokenizer=False`` skips the tokenizer (the third element is then None).
    """
    import gguf

    if dtype not in GGUF_READ_DTYPES:
        raise ValueError(
            f"dtype={dtype!r} is not supported by read_gguf; use one of {', '.join(GGUF_READ_DTYPES)} "
            f"(for bfloat16 read float32 and cast in the framework: from_gguf(path, 'bfloat16'))"
        )
    reader, where, arch = _open(path)
    by_name = {t.name: t for t in reader.tensors}
    config = _read_config(reader, where, arch, set(by_name))
    names = params.gguf_names(config)  # GGUF name -> HF key (a merged expert tensor: its experts' keys, in order)
    unknown = sorted(n for n in by_name if params.match_gguf(n) is None and n != ROPE_FREQS)
    missing = [n for n in names if n not in by_name]
    extra = sorted(set(by_name) - set(names) - set(unknown) - {ROPE_FREQS})  # e.g. blk.30.*; ROPE_FREQS: the config
    if missing or unknown or extra:
        parts = [f"{where} does not hold the tensors of a {config.n_layers}-layer {FAMILY_NAMES[config.model_type]}:"]
        for title, items in (("missing", missing), ("unsupported", unknown), ("unexpected", extra)):
            if items:
                parts.append(
                    f"  {title} ({len(items)}): " + ", ".join(items[:20]) + (" ..." if len(items) > 20 else "")
                )
        raise CheckpointError("\n".join(parts))
    full = {n: tuple(int(d) for d in reversed(by_name[n].shape)) for n in names}  # numpy order
    shapes = {}
    for name, hf in names.items():
        if isinstance(hf, str):
            shapes[hf] = full[name]
        elif len(full[name]) != 3 or full[name][0] != len(hf):
            raise CheckpointError(
                f"{where}: tensor {name} has GGUF shape {list(full[name][::-1])}; expected [in, out, experts] "
                f"with {arch}.expert_count={len(hf)} experts on its last axis"
            )
        else:
            shapes.update(dict.fromkeys(hf, full[name][1:]))
    check_state_shapes(config, shapes, where)  # before any dequantization
    tensors = {}
    for name, hf in names.items():
        t = by_name[name]
        try:
            w = gguf.quants.dequantize(t.data, t.tensor_type)
        except NotImplementedError as e:
            raise CheckpointError(
                f"{where}: tensor {name} has type {t.tensor_type.name}, which gguf "
                f"{getattr(gguf, '__version__', '')} cannot dequantize: {e}"
            ) from e
        w = np.asarray(w).reshape(full[name])
        permute = params.match_gguf(name)[0].gguf_permute
        if permute is not None and arch == "llama":  # llama.cpp permutes q/k rows for its LlamaModel family only
            w = unpermute_rows(w, getattr(config, permute))
        if isinstance(hf, str):
            tensors[hf] = w.astype(dtype, copy=True)  # a copy: nothing points into the file's mmap
        else:
            tensors.update((key, w[e].astype(dtype, copy=True)) for e, key in enumerate(hf))
    return GGUFModel(config, tensors, _build_tokenizer(reader, where) if tokenizer else None)
