"""Model configuration shared by both twins (``jaxattn.config`` and ``torchref.config`` re-export it).

``ModelConfig`` holds the Llama-style decoder's shape; ``preset(name)`` gives the project's standard sizes and
``from_hf`` / ``to_hf`` read and write a Hugging Face ``config.json`` dictionary (both the transformers 4.x
keys ``rope_theta`` / ``rope_scaling`` and the 5.x ``rope_parameters`` are understood) for the six families the
model covers (``model_type``): ``llama``; ``mistral`` (Llama's layers, names on disk and ``sliding_window``
attention); ``qwen2`` (Llama's layers with biased q / k / v projections, ``qkv_bias``); ``qwen3`` (Llama's layers
plus RMSNorm on each query / key head, ``qk_norm``); ``mixtral`` (every layer's MLP a sparse Mixture of Experts, a
sliding window allowed); ``qwen3_moe`` (Mixtral's MoE with Qwen3's attention; no window).

    cfg = ModelConfig.preset("moe-tiny")         # 4 experts, 2 per token
    cfg.n_experts, cfg.experts_per_token, cfg.expert_ffn_dim, cfg.capacity_factor   # (4, 2, 32, None)
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

# Llama 3.1/3.2 long-context RoPE scaling: the only scaling this project implements.
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")

# Llama 3.1's RoPE scaling (8b, 70b)
_LLAMA31_ROPE = dict(
    rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
)


def _llama3() -> dict[str, Any]:
    """What every Llama 3.x size shares: the 128k vocabulary, 8 kv heads, the 128k context and its RoPE."""
    return dict(
        vocab_size=128256,
        n_kv_heads=8,
        max_seq_len=131072,
        norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling=dict(_LLAMA31_ROPE),
    )


_PRESETS: dict[str, dict[str, Any]] = {
    # Small enough for CPU tests: GQA (4 query heads over 2 kv heads), untied head.
    "tiny": dict(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=160, max_seq_len=256),
    "125m": dict(
        vocab_size=32000,
        dim=768,
        n_layers=12,
        n_heads=12,
        n_kv_heads=4,
        ffn_dim=2048,
        max_seq_len=2048,
        rope_theta=500000.0,
    ),
    "350m": dict(
        vocab_size=32000,
        dim=1024,
        n_layers=24,
        n_heads=16,
        n_kv_heads=8,
        ffn_dim=2816,
        max_seq_len=2048,
        rope_theta=500000.0,
    ),
    # Llama-3.2-1B shape (its RoPE scaled by 32, not 3.1's 8).
    "1b": dict(
        _llama3(),
        dim=2048,
        n_layers=16,
        n_heads=32,
        ffn_dim=8192,
        tie_embeddings=True,
        rope_scaling=dict(_LLAMA31_ROPE, factor=32.0),
    ),
    # Llama-3.1-8B shape.
    "8b": dict(_llama3(), dim=4096, n_layers=32, n_heads=32, ffn_dim=14336),
    # Llama-3.1-70B shape: compiled for pods (the plan suite's 64-chip / 64-GPU rows), far too big for one device.
    "70b": dict(_llama3(), dim=8192, n_layers=80, n_heads=64, ffn_dim=28672),
}
# Mixture-of-Experts shapes: a CPU-test size, a benchmark size, and Mixtral-8x7B / Qwen3-30B-A3B for the compiled plans.
_PRESETS["moe-tiny"] = dict(
    _PRESETS["tiny"], model_type="mixtral", ffn_dim=64, n_experts=4, experts_per_token=2, router_aux_loss_coef=0.02
)
# The 350m shape with Mixtral's 8 experts, 2 per token (each expert the dense FFN): 1.8B parameters, 0.56B active; the
# MoE rows of the model and train suites on a GPU.
_PRESETS["moe-350m"] = dict(
    _PRESETS["350m"], model_type="mixtral", n_experts=8, experts_per_token=2, router_aux_loss_coef=0.02
)
_PRESETS["mixtral-8x7b"] = dict(
    model_type="mixtral",
    vocab_size=32000,
    dim=4096,
    n_layers=32,
    n_heads=32,
    n_kv_heads=8,
    ffn_dim=14336,
    max_seq_len=32768,
    norm_eps=1e-5,
    rope_theta=1e6,
    n_experts=8,
    experts_per_token=2,
    router_aux_loss_coef=0.02,
    bos_token_id=1,
    eos_token_id=2,
)
_PRESETS["qwen3-30b-a3b"] = dict(
    model_type="qwen3_moe",
    vocab_size=151936,
    dim=2048,
    n_layers=48,
    n_heads=32,
    n_kv_heads=4,
    head_dim=128,
    ffn_dim=6144,
    moe_ffn_dim=768,
    max_seq_len=40960,
    norm_eps=1e-6,
    rope_theta=1e6,
    n_experts=128,
    experts_per_token=8,
    norm_topk_prob=True,
    router_aux_loss_coef=0.001,
    bos_token_id=151643,
    eos_token_id=151645,
)
# Qwen2.5-0.5B: 24 layers of GQA (14 query / 2 kv heads of 64) with biased q/k/v projections, tied embeddings.
_PRESETS["qwen2.5-0.5b"] = dict(
    model_type="qwen2",
    vocab_size=151936,
    dim=896,
    n_layers=24,
    n_heads=14,
    n_kv_heads=2,
    ffn_dim=4864,
    max_seq_len=32768,
    norm_eps=1e-6,
    rope_theta=1e6,
    tie_embeddings=True,
    bos_token_id=151643,
    eos_token_id=151643,
)
# Qwen3-0.6B: 28 layers of GQA (16 query / 8 kv heads of 128) with Qwen3's q/k norms, tied embeddings.
_PRESETS["qwen3-0.6b"] = dict(
    model_type="qwen3",
    vocab_size=151936,
    dim=1024,
    n_layers=28,
    n_heads=16,
    n_kv_heads=8,
    head_dim=128,
    ffn_dim=3072,
    max_seq_len=40960,
    norm_eps=1e-6,
    rope_theta=1e6,
    tie_embeddings=True,
    bos_token_id=151643,
    eos_token_id=151645,
)
# Mistral-7B-v0.1: the 8b's layers at 32k vocabulary, every layer attending over a 4096-token sliding window.
_PRESETS["mistral-7b"] = dict(
    model_type="mistral",
    vocab_size=32000,
    dim=4096,
    n_layers=32,
    n_heads=32,
    n_kv_heads=8,
    ffn_dim=14336,
    max_seq_len=32768,
    norm_eps=1e-5,
    rope_theta=10000.0,
    sliding_window=4096,
    bos_token_id=1,
    eos_token_id=2,
)
PRESET_NAMES: tuple[str, ...] = tuple(_PRESETS)
MODEL_TYPES: tuple[str, ...] = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe")
DENSE_TYPES: tuple[str, ...] = ("llama", "mistral", "qwen2", "qwen3")  # the families whose MLP is the dense SwiGLU
QWEN3_TYPES: tuple[str, ...] = ("qwen3", "qwen3_moe")  # RMSNorm on each query / key head
QWEN_TYPES: tuple[str, ...] = ("qwen2", *QWEN3_TYPES)  # use_sliding_window / max_window_layers in config.json
WINDOW_TYPES: tuple[str, ...] = ("mistral", "mixtral")  # the families whose config.json has a sliding_window
_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 32000
    dim: int = 768
    n_layers: int = 12
    n_heads: int = 12
    n_kv_heads: int = 12
    head_dim: int | None = None  # None = dim // n_heads
    ffn_dim: int = 2048
    max_seq_len: int = 2048
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # None or the HF llama3 dict
    tie_embeddings: bool = False
    # the tokenizer's special ids, as HF's config.json keeps them: generate() stops at eos_token_id by default
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None  # several for e.g. Llama 3.1 Instruct
    # the Hugging Face family (names on disk, config.json keys): one of MODEL_TYPES
    model_type: str = "llama"
    # sliding-window attention (Mistral's / HF's sliding_window): each token sees itself and the sliding_window - 1
    # tokens before it, in every layer; None: all earlier tokens. Only the families whose config.json keeps it.
    sliding_window: int | None = None
    # Mixture of Experts (0 experts = the dense SwiGLU MLP): every layer's MLP is n_experts SwiGLU experts of
    # moe_ffn_dim (None = ffn_dim), each token sent to experts_per_token of them by a float32 softmax router
    n_experts: int = 0
    experts_per_token: int = 2
    moe_ffn_dim: int | None = None
    norm_topk_prob: bool = True  # renormalise the top-k router weights to sum to 1 (Mixtral always does)
    router_aux_loss_coef: float = 0.001  # x transformers' load_balancing_loss_func, added to the training loss
    router_z_loss_coef: float = 0.0  # x the ST-MoE router z-loss, mean over tokens of logsumexp(logits)^2
    capacity_factor: float | None = None  # None: dropless; c: each row sends <= ceil(c*S*k/E) tokens per expert

    def __post_init__(self):
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "max_seq_len"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive int, got {v!r}")
        if self.head_dim is None:
            if self.dim % self.n_heads:
                raise ValueError(
                    f"ModelConfig.n_heads={self.n_heads} must divide dim={self.dim} (or set head_dim explicitly)"
                )
        elif isinstance(self.head_dim, bool) or not isinstance(self.head_dim, int) or self.head_dim <= 0:
            raise ValueError(f"ModelConfig.head_dim must be None or a positive int, got {self.head_dim!r}")
        if self.resolved_head_dim % 2:
            raise ValueError(f"ModelConfig.head_dim must be even for RoPE, got {self.resolved_head_dim}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"ModelConfig.n_kv_heads={self.n_kv_heads} must divide n_heads={self.n_heads} (GQA)")
        for name in ("norm_eps", "rope_theta"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive finite float, got {v!r}")
        if not isinstance(self.tie_embeddings, (bool, np.bool_)):
            raise ValueError(f"ModelConfig.tie_embeddings must be a bool, got {self.tie_embeddings!r}")
        object.__setattr__(self, "tie_embeddings", bool(self.tie_embeddings))
        if self.rope_scaling is not None:
            object.__setattr__(self, "rope_scaling", _check_rope_scaling(self.rope_scaling))
        for name in ("bos_token_id", "eos_token_id"):
            object.__setattr__(
                self, name, _check_token_ids(getattr(self, name), f"ModelConfig.{name}", self.vocab_size)
            )
        self._check_moe()
        w = self.sliding_window
        if w is not None:
            if isinstance(w, bool) or not isinstance(w, (int, np.integer)) or w < 1:
                raise ValueError(f"ModelConfig.sliding_window must be None or a positive int, got {w!r}")
            if self.model_type not in WINDOW_TYPES:
                raise ValueError(
                    f"ModelConfig.sliding_window={w} with model_type={self.model_type!r}: only {WINDOW_TYPES} keep a "
                    f"sliding window in their config.json (a dense windowed model is model_type='mistral')"
                )
            object.__setattr__(self, "sliding_window", int(w))

    def _check_moe(self) -> None:
        if self.model_type not in MODEL_TYPES:
            raise ValueError(f"ModelConfig.model_type={self.model_type!r} is not supported; use one of {MODEL_TYPES}")
        if not isinstance(self.norm_topk_prob, (bool, np.bool_)):
            raise ValueError(f"ModelConfig.norm_topk_prob must be a bool, got {self.norm_topk_prob!r}")
        object.__setattr__(self, "norm_topk_prob", bool(self.norm_topk_prob))
        e, k = self.n_experts, self.experts_per_token
        if isinstance(e, bool) or not isinstance(e, int) or e < 0:
            raise ValueError(f"ModelConfig.n_experts must be an int >= 0 (0 = a dense MLP), got {e!r}")
        if (self.model_type in DENSE_TYPES) != (e == 0):
            raise ValueError(
                f"ModelConfig.model_type={self.model_type!r} with n_experts={e}: {DENSE_TYPES} are the dense models "
                f"(n_experts=0); 'mixtral' and 'qwen3_moe' need n_experts >= 1"
            )
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"ModelConfig.experts_per_token must be a positive int, got {k!r}")
        if e and k > e:
            raise ValueError(
                f"ModelConfig.experts_per_token={k} is more than n_experts={e}: a token can be sent to at most "
                f"every expert once"
            )
        f = self.moe_ffn_dim
        if f is not None and (isinstance(f, bool) or not isinstance(f, int) or f <= 0):
            raise ValueError(f"ModelConfig.moe_ffn_dim must be None (= ffn_dim) or a positive int, got {f!r}")
        if self.model_type == "mixtral" and not self.norm_topk_prob:
            raise ValueError("ModelConfig.norm_topk_prob=False with model_type='mixtral': Mixtral always renormalises")
        if self.model_type == "mixtral" and f not in (None, self.ffn_dim):
            raise ValueError(
                f"ModelConfig.moe_ffn_dim={f} with model_type='mixtral': Mixtral's experts are ffn_dim wide "
                f"(its config.json has one intermediate_size); set ffn_dim={f} instead"
            )
        for name in ("router_aux_loss_coef", "router_z_loss_coef"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ValueError(f"ModelConfig.{name} must be a finite float >= 0, got {v!r}")
            object.__setattr__(self, name, float(v))
        c = self.capacity_factor
        if c is not None:
            if isinstance(c, bool) or not isinstance(c, (int, float)) or not math.isfinite(c) or c <= 0:
                raise ValueError(f"ModelConfig.capacity_factor must be None (dropless) or a positive float, got {c!r}")
            object.__setattr__(self, "capacity_factor", float(c))

    @property
    def qk_norm(self) -> bool:
        """RMSNorm over each query and key head before RoPE (Qwen3's attention)."""
        return self.model_type in QWEN3_TYPES

    @property
    def qkv_bias(self) -> bool:
        """A bias on the query, key and value projections (Qwen2's attention; o_proj has none)."""
        return self.model_type == "qwen2"

    @property
    def attention_window(self) -> tuple[int, None] | None:
        """``sliding_window`` as the attention contract's ``window`` (keys ``i - left .. i`` of query i), or None."""
        return None if self.sliding_window is None else (self.sliding_window - 1, None)

    @property
    def is_moe(self) -> bool:
        """Every layer's MLP is a Mixture of Experts."""
        return self.n_experts > 0

    @property
    def expert_ffn_dim(self) -> int:
        """One expert's SwiGLU hidden size (``moe_ffn_dim``, or ``ffn_dim`` when that is None)."""
        return self.ffn_dim if self.moe_ffn_dim is None else self.moe_ffn_dim

    def expert_capacity(self, tokens: int) -> int | None:
        """Assignments each expert takes from a group of ``tokens`` tokens (one batch row):
        ``ceil(capacity_factor * tokens * k / n_experts)``; None when dropless."""
        if self.capacity_factor is None or not self.is_moe:
            return None
        return max(1, math.ceil(self.capacity_factor * tokens * self.experts_per_token / self.n_experts))

    @property
    def eos_ids(self) -> tuple[int, ...]:
        """``eos_token_id`` as a tuple (empty when unknown)."""
        e = self.eos_token_id
        return () if e is None else (e,) if isinstance(e, int) else tuple(e)

    def __hash__(self):  # rope_scaling is a dict; hash a canonical form (NNX keeps the config as static data)
        return hash(tuple((f.name, repr(getattr(self, f.name))) for f in dataclasses.fields(self)))

    @property
    def resolved_head_dim(self) -> int:
        """The resolved head dimension."""
        return self.dim // self.n_heads if self.head_dim is None else self.head_dim

    def rope_inv_freq(self) -> np.ndarray:
        """RoPE inverse frequencies, float32 ``[head_dim // 2]``, with llama3 scaling applied (HF's formula).

        Computed once in float64 numpy and shared by both frameworks, so the twins rotate identically.
        """
        d = self.resolved_head_dim
        inv = 1.0 / (self.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
        if self.rope_scaling is not None:
            s = self.rope_scaling
            old = s["original_max_position_embeddings"]
            low_wavelen, high_wavelen = old / s["low_freq_factor"], old / s["high_freq_factor"]
            wavelen = 2 * math.pi / inv
            scaled = np.where(wavelen > low_wavelen, inv / s["factor"], inv)
            smooth = (old / wavelen - s["low_freq_factor"]) / (s["high_freq_factor"] - s["low_freq_factor"])
            smoothed = (1 - smooth) * scaled / s["factor"] + smooth * scaled
            medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
            inv = np.where(medium, smoothed, scaled)
        return inv.astype(np.float32)

    @classmethod
    def preset(cls, name: str, **overrides) -> ModelConfig:
        if name not in _PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose one of {sorted(_PRESETS)}")
        return cls(**{**_PRESETS[name], **overrides})

    def replace(self, **changes) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_hf(cls, hf: dict) -> ModelConfig:
        """Build from a Hugging Face ``config.json`` dictionary (``model_type`` one of :data:`MODEL_TYPES`);
        refuses what the model cannot represent, naming the key."""
        if not isinstance(hf, dict):
            raise TypeError(f"from_hf expects the config.json dict, got {type(hf).__name__}")
        model_type = hf.get("model_type", "llama")  # first: another architecture's keys are not "missing"
        if model_type not in MODEL_TYPES:
            raise ValueError(f"HF config model_type={model_type!r}: supported are {', '.join(MODEL_TYPES)}")
        missing = [
            k
            for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
            if k not in hf
        ]
        if missing:
            raise ValueError(f"HF config is missing required keys {missing}")
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"HF config hidden_act={hf['hidden_act']!r}: only 'silu' (SwiGLU) is supported")
        for key in ("attention_bias", "mlp_bias"):
            if _hf_bool(hf, key, False):
                raise ValueError(f"HF config {key}=True: biased projections are not supported")
        tp = hf.get("pretraining_tp", 1)
        if tp is not None and (isinstance(tp, bool) or tp != 1):
            raise ValueError(f"HF config pretraining_tp={tp!r}: only 1 (or null) is supported")
        rope = hf.get("rope_parameters")  # transformers >= 5
        if rope is not None and not isinstance(rope, dict):
            raise ValueError(
                f"HF config rope_parameters={rope!r}: expected a dict (e.g. {{'rope_type': "
                f"'default', 'rope_theta': 10000.0}}) or null"
            )
        rope = dict(rope or {})
        theta = _hf_float(hf, "rope_theta", 10000.0)  # checked even when rope_parameters has its own
        if "rope_theta" in rope:
            theta = _hf_float(rope, "rope_theta", where="HF config rope_parameters.")
            rope.pop("rope_theta")
        scaling = hf.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        if scaling is not None:
            scaling = _check_rope_scaling(scaling, where="rope_scaling")
        n_heads = _hf_int(hf, "num_attention_heads")
        dim = _hf_int(hf, "hidden_size")
        # HF semantics: a missing or null num_key_value_heads means multi-head attention (= num_attention_heads)
        n_kv_heads = _hf_int(hf, "num_key_value_heads", None, null_means=f"num_attention_heads ({n_heads})")
        head_dim = _hf_int(hf, "head_dim", None, null_means="hidden_size // num_attention_heads")
        if head_dim is not None and head_dim == dim // n_heads and dim % n_heads == 0:
            head_dim = None
        return cls(
            vocab_size=_hf_int(hf, "vocab_size"),
            dim=dim,
            n_layers=_hf_int(hf, "num_hidden_layers"),
            n_heads=n_heads,
            n_kv_heads=n_heads if n_kv_heads is None else n_kv_heads,
            head_dim=head_dim,
            ffn_dim=_hf_int(hf, "intermediate_size"),
            max_seq_len=_hf_int(hf, "max_position_embeddings", 2048),
            norm_eps=_hf_float(hf, "rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            tie_embeddings=_hf_bool(hf, "tie_word_embeddings", False),
            bos_token_id=_check_token_ids(hf.get("bos_token_id"), "config.json bos_token_id", None),
            eos_token_id=_check_token_ids(hf.get("eos_token_id"), "config.json eos_token_id", None),
            model_type=model_type,
            sliding_window=_window_from_hf(hf, model_type),
            **_moe_from_hf(hf, model_type),
        )

    def to_hf(self) -> dict:
        """A ``config.json`` dict that transformers 4.x and 5.x both load as the family's class (``architectures``:
        ``LlamaForCausalLM``, ``MistralForCausalLM``, ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``,
        ``MixtralForCausalLM`` or ``Qwen3MoeForCausalLM``)."""
        rope_parameters = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_scaling is not None:
            rope_parameters.update(self.rope_scaling)
        out = {
            "architectures": [_ARCHITECTURES[self.model_type]],
            "model_type": self.model_type,
            "hidden_act": "silu",
            "vocab_size": self.vocab_size,
            "hidden_size": self.dim,
            "num_hidden_layers": self.n_layers,
            "num_attention_heads": self.n_heads,
            "num_key_value_heads": self.n_kv_heads,
            "head_dim": self.resolved_head_dim,
            "intermediate_size": self.ffn_dim,
            "max_position_embeddings": self.max_seq_len,
            "rms_norm_eps": self.norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": None if self.rope_scaling is None else dict(self.rope_scaling),
            "rope_parameters": rope_parameters,
            "tie_word_embeddings": self.tie_embeddings,
            # written even when unknown (null): transformers would otherwise fill in Llama-2's 1 and 2
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id if not isinstance(self.eos_token_id, tuple) else list(self.eos_token_id),
            "attention_bias": False,
            "mlp_bias": False,
            "torch_dtype": "float32",
        }
        if self.model_type in WINDOW_TYPES:
            out["sliding_window"] = self.sliding_window
        if self.model_type in QWEN_TYPES:
            out["use_sliding_window"] = False
        if self.qkv_bias:  # Qwen2's config.json has no such key: its q / k / v biases are the architecture's
            del out["attention_bias"]
        if self.is_moe:
            out.update(_moe_to_hf(self))
        return out


def _window_from_hf(hf: dict, model_type: str) -> int | None:
    """A Mistral / Mixtral ``config.json``'s ``sliding_window`` (null: full attention); a ``layer_types`` list that
    mixes sliding and full layers is refused (the layers are stacked and scanned as identical ones). Llama's config
    has no such key (transformers' Llama ignores one); Qwen2's / Qwen3's ``use_sliding_window`` (a window on the
    layers from ``max_window_layers`` on) is refused by key."""
    if model_type in QWEN_TYPES:
        if _hf_bool(hf, "use_sliding_window", False):
            raise ValueError(
                "HF config use_sliding_window=True: Qwen's sliding window (on the layers from max_window_layers on) "
                "is not supported"
            )
        w = None
    elif model_type in WINDOW_TYPES:
        w = _hf_int(hf, "sliding_window", None, null_means="full attention")
    else:
        return None
    kinds = hf.get("layer_types")
    want = "full_attention" if w is None else "sliding_attention"
    if kinds is not None and (not isinstance(kinds, list) or any(k != want for k in kinds)):
        raise ValueError(
            f"HF config layer_types={kinds!r} with sliding_window={w!r}: only models whose every layer is "
            f"{want!r} are supported (the layers are stacked and scanned as identical ones)"
        )
    return w


def _moe_from_hf(hf: dict, model_type: str) -> dict:
    """The MoE fields of a Mixtral / Qwen3-MoE ``config.json``; what the model cannot do is refused by key."""
    if model_type in DENSE_TYPES:
        return {}
    if model_type == "mixtral":
        n_experts = _hf_int(hf, "num_local_experts")
        jitter = hf.get("router_jitter_noise", 0.0)
        if jitter not in (0, 0.0, None):
            raise ValueError(f"HF config router_jitter_noise={jitter!r}: only 0 (no router noise) is supported")
        fields = dict(norm_topk_prob=True, experts_per_token=_hf_int(hf, "num_experts_per_tok", 2))
    else:  # qwen3_moe
        key = "num_experts" if "num_experts" in hf else "num_local_experts"  # transformers 5 writes the latter
        n_experts = _hf_int(hf, key)
        step = _hf_int(hf, "decoder_sparse_step", 1)
        dense = hf.get("mlp_only_layers") or []
        if step != 1 or dense:
            raise ValueError(
                f"HF config decoder_sparse_step={step}, mlp_only_layers={dense!r}: only models whose every layer is "
                f"sparse are supported (the layers are stacked and scanned as identical ones); need 1 and []"
            )
        fields = dict(
            experts_per_token=_hf_int(hf, "num_experts_per_tok", 8),
            moe_ffn_dim=_hf_int(hf, "moe_intermediate_size", 768),
            norm_topk_prob=_hf_bool(hf, "norm_topk_prob", False),
        )
    coef = hf.get("router_aux_loss_coef", 0.001)
    if isinstance(coef, bool) or not isinstance(coef, (int, float)) or not math.isfinite(coef) or coef < 0:
        raise ValueError(f"HF config router_aux_loss_coef={coef!r}: expected a finite number >= 0")
    z = hf.get("router_z_loss_coef", 0.0)  # not a Mixtral / Qwen3 key: ours, written by to_hf
    if isinstance(z, bool) or not isinstance(z, (int, float)) or not math.isfinite(z) or z < 0:
        raise ValueError(f"HF config router_z_loss_coef={z!r}: expected a finite number >= 0")
    return dict(
        n_experts=n_experts,
        router_aux_loss_coef=float(coef),
        router_z_loss_coef=float(z),
        capacity_factor=hf.get("capacity_factor"),  # ours too; None = dropless (checked by ModelConfig)
        **fields,
    )


def _moe_to_hf(cfg: ModelConfig) -> dict:
    """The Mixtral / Qwen3-MoE keys of ``cfg``'s ``config.json`` (and our z-loss / capacity keys)."""
    out = {
        "num_experts_per_tok": cfg.experts_per_token,
        "router_aux_loss_coef": cfg.router_aux_loss_coef,
        "router_z_loss_coef": cfg.router_z_loss_coef,
        "capacity_factor": cfg.capacity_factor,
        "output_router_logits": False,
    }
    if cfg.model_type == "mixtral":
        out.update(num_local_experts=cfg.n_experts, intermediate_size=cfg.expert_ffn_dim, router_jitter_noise=0.0)
    else:
        out.update(
            num_experts=cfg.n_experts,
            moe_intermediate_size=cfg.expert_ffn_dim,
            norm_topk_prob=cfg.norm_topk_prob,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        )
    return out


def _check_token_ids(value: Any, name: str, vocab_size: int | None):
    """None, a token id, or a tuple of them (a list is made a tuple); ValueError naming ``name`` otherwise."""
    if value is None:
        return None
    many = isinstance(value, (list, tuple))
    items = list(value) if many else [value]
    bad = [v for v in items if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0]
    bad += [v for v in items if vocab_size is not None and v not in bad and v >= vocab_size]
    if bad or (many and not items):
        vocab = f" in [0, {vocab_size})" if vocab_size is not None else ""
        raise ValueError(f"{name} must be None, a token id{vocab} or a non-empty list of them, got {value!r}")
    items = [int(v) for v in items]
    return tuple(items) if many else items[0]


def _check_rope_scaling(scaling: Any, where: str = "ModelConfig.rope_scaling") -> dict:
    if not isinstance(scaling, dict):
        raise ValueError(f"{where} must be None or a dict, got {scaling!r}")
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind != "llama3":
        raise ValueError(
            f"{where}.rope_type={kind!r} is not supported: only 'llama3' (Llama 3.1/3.2) RoPE scaling is implemented"
        )
    missing = [k for k in _LLAMA3_KEYS if k not in scaling]
    if missing:
        raise ValueError(f"{where} (llama3) is missing keys {missing}")
    out = {"rope_type": "llama3", **{k: _hf_float(scaling, k, where=f"{where}.") for k in _LLAMA3_KEYS[:3]}}
    out["original_max_position_embeddings"] = _hf_int(scaling, "original_max_position_embeddings", where=f"{where}.")
    if out["factor"] <= 0 or out["high_freq_factor"] <= out["low_freq_factor"]:
        raise ValueError(f"{where}: need factor > 0 and high_freq_factor > low_freq_factor, got {out}")
    return out


_REQUIRED = object()


def _hf_value(hf: dict, key: str, default: Any, where: str):
    if key not in hf:
        if default is _REQUIRED:
            raise ValueError(f"{where}{key} is missing")
        return default
    return hf[key]


def _hf_int(
    hf: dict, key: str, default: Any = _REQUIRED, *, null_means: str | None = None, where: str = "HF config "
) -> int | None:
    """``hf[key]`` as a positive int (not a bool, string or float); ``null_means`` allows null (returns None)."""
    v = _hf_value(hf, key, default, where)
    if v is None and null_means is not None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        accepted = "a positive int" + (f", or null/absent for {null_means}" if null_means else "")
        raise ValueError(f"{where}{key}={v!r} ({type(v).__name__}) is invalid: expected {accepted}")
    return v


def _hf_float(hf: dict, key: str, default: Any = _REQUIRED, *, where: str = "HF config ") -> float:
    """``hf[key]`` as a positive finite float (a JSON number, not a bool, string or null)."""
    v = _hf_value(hf, key, default, where)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise ValueError(f"{where}{key}={v!r} ({type(v).__name__}) is invalid: expected a positive finite number")
    return float(v)


def _hf_bool(hf: dict, key: str, default: bool, *, where: str = "HF config ") -> bool:
    v = _hf_value(hf, key, default, where)
    if not isinstance(v, bool):
        raise ValueError(f"{where}{key}={v!r} ({type(v).__name__}) is invalid: expected true or false")
    return v
