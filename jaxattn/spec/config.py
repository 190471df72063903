"""Model configuration shared by both twins (``jaxattn.config`` and ``torchref.config`` re-export it).

``ModelConfig`` holds the Llama-style decoder's shape; ``preset(name)`` gives the project's standard sizes and
``from_hf`` / ``to_hf`` read and write a Hugging Face Llama ``config.json`` dictionary (both the transformers 4.x
keys ``rope_theta`` / ``rope_scaling`` and the 5.x ``rope_parameters`` are understood).
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
    # Llama-3.2-1B shape.
    "1b": dict(
        vocab_size=128256,
        dim=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim=8192,
        max_seq_len=131072,
        norm_eps=1e-5,
        rope_theta=500000.0,
        tie_embeddings=True,
        rope_scaling=dict(
            rope_type="llama3",
            factor=32.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8192,
        ),
    ),
    # Llama-3.1-8B shape.
    "8b": dict(
        vocab_size=128256,
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim=14336,
        max_seq_len=131072,
        norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling=dict(_LLAMA31_ROPE),
    ),
    # Llama-3.1-70B shape: compiled for pods (the plan suite's 64-chip / 64-GPU rows), far too big for one device.
    "70b": dict(
        vocab_size=128256,
        dim=8192,
        n_layers=80,
        n_heads=64,
        n_kv_heads=8,
        ffn_dim=28672,
        max_seq_len=131072,
        norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling=dict(_LLAMA31_ROPE),
    ),
}
PRESET_NAMES: tuple[str, ...] = tuple(_PRESETS)


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
        """Build from a Hugging Face Llama ``config.json`` dictionary; refuses what the model cannot represent."""
        if not isinstance(hf, dict):
            raise TypeError(f"from_hf expects the config.json dict, got {type(hf).__name__}")
        missing = [
            k
            for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
            if k not in hf
        ]
        if missing:
            raise ValueError(f"HF config is missing required keys {missing}")
        if hf.get("model_type", "llama") != "llama":
            raise ValueError(f"HF config model_type={hf['model_type']!r}: only 'llama' is supported")
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
        )

    def to_hf(self) -> dict:
        """A ``config.json`` dict that transformers 4.x and 5.x both load as ``LlamaForCausalLM``."""
        rope_parameters = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_scaling is not None:
            rope_parameters.update(self.rope_scaling)
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
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
