"""Llama-style decoder in PyTorch, the twin of ``jaxattn/model.py``.

    model = LlamaForCausalLM(ModelConfig.preset("tiny"))
    logits = model(torch.tensor([[1, 2, 3]]))        # float32 [1, 3, vocab]
    last = model(torch.tensor([[1, 2, 3]]), logits_at=torch.tensor([[2]]))  # [1, 1, vocab]: position 2's only
    hidden = model.model(torch.tensor([[1, 2, 3]]))  # [1, 3, dim]: final-norm hidden states (= model.features)

Module and parameter names follow Hugging Face's ``LlamaForCausalLM`` exactly, so ``state_dict()`` keys are HF's
(``model.embed_tokens.weight``, ``model.layers.{i}.self_attn.q_proj.weight``, ..., ``lm_head.weight``) and a
real HF checkpoint loads with ``load_state_dict``. Attention goes through ``torchref.attention`` (SDPA under the
active ``sdpa_kernel`` backends). Logits are returned in float32. Mixtral / Qwen3-MoE configs (``n_experts > 0``)
swap the MLP for ``torchref.moe.MoEBlock`` (HF's ``mlp.gate`` / ``mlp.experts``, experts stacked as in transformers
5: ``torchref.hf`` maps them to the per-expert tensors of HF files); ``model(ids, moe_stats=True)`` then also returns
the router's losses and loads (``torchref.moe.moe_losses``). A ``sliding_window`` (Mistral) reaches the attention call
as its ``window``.

Token ids: an id outside ``[0, vocab)`` raises ValueError naming its position and value (checked in eager mode;
skipped while ``torch.compile`` traces and inside :func:`trusted_ids`, where the ids are the model's own draws).
``remat`` (one of ``twincore.remat.REMAT_POLICIES``, set from outside by ``torchref.remat.apply``) is how each decoder
layer runs in training: ``torchref.remat.run_layer`` (per-layer ``torch.utils.checkpoint``, selective checkpointing or
``save_on_cpu``; the op lists are there).
"""

from __future__ import annotations

import contextlib
import threading

import torch
import torch.nn.functional as F
from torch import nn

from twincore.batch import (
    cache_positions,
    check_logits_at,
    check_logits_at_values,
    check_model_inputs,
    check_moe_args,
    check_token_ids,
)
from twincore.remat import check_remat

from .attention import dot_product_attention
from .config import ModelConfig
from .moe import MoEBlock, moe_losses
from .remat import run_layer

__all__ = ["LlamaForCausalLM", "LlamaModel", "Llama"]


class RMSNorm(nn.Module):
    """HF LlamaRMSNorm: statistics in float32, scale applied after casting back to the input dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * h.to(x.dtype)


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables ``[B, 1, S, head_dim]`` in float32 for integer ``positions [B, S]``."""
    freqs = positions.float()[..., None] * inv_freq  # [B, S, D/2]
    emb = torch.cat([freqs, freqs], dim=-1)[:, None]
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF ``rotate_half`` convention, computed in float32."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    return (xf * cos + torch.cat([-x2, x1], dim=-1) * sin).to(x.dtype)


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        d = cfg.resolved_head_dim
        self.q_proj = nn.Linear(cfg.dim, cfg.n_heads * d, bias=cfg.qkv_bias)  # Qwen2: biased q / k / v
        self.k_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * d, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * d, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.n_heads * d, cfg.dim, bias=False)
        if cfg.qk_norm:  # Qwen3: RMSNorm over each head's dim, before RoPE
            self.q_norm = RMSNorm(d, cfg.norm_eps)
            self.k_norm = RMSNorm(d, cfg.norm_eps)

    def forward(self, x, cos, sin, segment_ids=None, kv=None):
        """``kv``: this layer's view of a ``torchref.kv_cache.KVCache`` (written in place)."""
        b, s, _ = x.shape
        d = self.cfg.resolved_head_dim
        q = self.q_proj(x).view(b, s, self.cfg.n_heads, d).transpose(1, 2)
        k = self.k_proj(x).view(b, s, self.cfg.n_kv_heads, d).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.cfg.n_kv_heads, d).transpose(1, 2)
        if self.cfg.qk_norm:
            q, k = self.q_norm(q).to(q.dtype), self.k_norm(k).to(k.dtype)  # a float32 norm weight: keep q's dtype
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if kv is None:
            o = dot_product_attention(q, k, v, causal=True, segment_ids=segment_ids, window=self.cfg.attention_window)
        else:
            o = kv.attend(q, k, v)
        return self.o_proj(o.transpose(1, 2).reshape(b, s, self.cfg.n_heads * d))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.up_proj = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.down_proj = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.self_attn = LlamaAttention(cfg)
        self.mlp = MoEBlock(cfg) if cfg.is_moe else LlamaMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)

    def forward(self, x, cos, sin, segment_ids=None, kv=None, moe_mask=None):
        """``x`` after the layer; an MoE layer returns ``(x, stats)`` (``torchref.moe.MoEBlock``) unless ``kv``."""
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, segment_ids, kv)
        if not isinstance(self.mlp, MoEBlock):
            return x + self.mlp(self.post_attention_layernorm(x))
        h, stats = self.mlp(self.post_attention_layernorm(x), moe_mask)
        return x + h if kv is not None else (x + h, stats)


class LlamaModel(nn.Module):
    """The decoder body, as Hugging Face's ``LlamaModel``: ``model.model(input_ids, positions=None,
    segment_ids=None, cache=None)`` -> the final-norm hidden states ``[B, S, dim]`` in the weights' (or autocast's)
    dtype, the input of the LM head and of any other head (a classifier, an embedding pooler).

    Same arguments and checks as :class:`LlamaForCausalLM` (which calls it); ``remat`` is the policy each decoder
    layer runs under in training (``LlamaForCausalLM.remat`` reads and writes this one).
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.remat = "none"
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        # Not persistent: HF state dicts carry no RoPE buffer.
        self.register_buffer("inv_freq", torch.from_numpy(cfg.rope_inv_freq()), persistent=False)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor | None = None,
        segment_ids: torch.Tensor | None = None,
        cache=None,
        *,
        moe_stats: bool = False,
        moe_mask: torch.Tensor | None = None,
    ):
        check_model_inputs(input_ids, positions, segment_ids, arg="input_ids")
        check_moe_args(self.config, input_ids.shape, cache, moe_stats, moe_mask, arg="input_ids")
        if not torch.compiler.is_compiling() and not getattr(_TRUSTED, "on", False):
            _check_ids(input_ids, self.config.vocab_size)
        remat = check_remat(self.remat, "LlamaModel.remat")
        if input_ids.dtype not in (torch.int32, torch.int64):
            input_ids = input_ids.long()
        b, s = input_ids.shape
        positions = cache_positions(cache, positions, segment_ids, (b, s))
        if positions is None:
            positions = torch.arange(s, device=input_ids.device).expand(b, s)
        cos, sin = rope_cos_sin(self.inv_freq, positions)  # [B, 1, S, head_dim]
        x = self.embed_tokens(input_ids)  # [B, S, dim]
        stats = []  # an MoE's per-layer router sums
        kvs = None if cache is None else cache.layers(s)
        for i, layer in enumerate(self.layers):
            if cache is None:
                x = run_layer(layer, remat, x, cos, sin, segment_ids, None, moe_mask)
                if self.config.is_moe:
                    x, st = x
                    stats.append(st)
            else:
                x = layer(x, cos, sin, None, kvs[i])
        if cache is not None:
            cache.lengths += s
        x = self.norm(x)  # [B, S, dim]
        return (x, moe_losses(stats, self.config)) if moe_stats else x


class LlamaForCausalLM(nn.Module):
    """``model(input_ids, positions=None, segment_ids=None)`` -> float32 logits [B, S, V] = ``lm_head`` of
    ``model.model(...)`` (:class:`LlamaModel`, the final-norm hidden states; ``model.features(...)`` is the same
    call under the JAX twin's name). With ``cache=`` a ``torchref.kv_cache.KVCache`` the call writes into it in
    place (positions default to its per-row lengths, which then grow by S); inference only, no remat.

    ``logits_at``: None (every position, the default) or int indices ``[B, K]`` into the sequence axis, per row:
    then only those positions' hidden states reach ``lm_head`` and the logits are ``[B, K, V]`` (Hugging Face's
    ``logits_to_keep``, per row: a prefill of right-padded rows passes ``lengths - 1`` and never computes
    ``[B, S, V]``). An index outside ``[0, S)`` raises ValueError (skipped while ``torch.compile`` traces).

    Inputs are integer tensors ``[B, S]`` (B, S >= 1) of a dtype in ``twincore.dtypes.ID_DTYPES``
    (bool refused); ids other than int32/int64 are widened for the embedding lookup.
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.dim, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.apply(self._init_weights)

    @property
    def remat(self) -> str:
        """The remat policy of the decoder layers (stored on :class:`LlamaModel`; set by ``torchref.remat.apply``)."""
        return self.model.remat

    @remat.setter
    def remat(self, policy: str) -> None:
        self.model.remat = policy

    @staticmethod
    def _init_weights(m: nn.Module):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def features(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor | None = None,
        segment_ids: torch.Tensor | None = None,
        cache=None,
        **moe,
    ):
        """The final-norm hidden states ``[B, S, dim]``: ``self.model(...)`` (the twin of ``jaxattn``'s
        ``Llama.features``; ``moe_stats`` / ``moe_mask`` as for the model)."""
        return self.model(input_ids, positions, segment_ids, cache, **moe)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor | None = None,
        segment_ids: torch.Tensor | None = None,
        cache=None,
        logits_at: torch.Tensor | None = None,
        *,
        head: bool = True,
        moe_stats: bool = False,
        moe_mask: torch.Tensor | None = None,
    ):
        """Logits; ``head=False``: the final hidden states instead, for a loss that applies ``lm_head`` itself
        (``--loss fused``) while the call still goes through whatever wraps the model (DDP, FSDP, torch.compile)."""
        check_remat(self.remat, "LlamaForCausalLM.remat")
        if logits_at is not None:  # checked before the cache is written
            _check_logits_at(logits_at, input_ids, positions, segment_ids)
        hidden = self.model(input_ids, positions, segment_ids, cache, moe_stats=moe_stats, moe_mask=moe_mask)
        moe = None
        if moe_stats:
            hidden, moe = hidden  # [B, S, dim], the router's losses and loads
        if not head:
            return hidden if moe is None else (hidden, moe)
        if logits_at is not None:  # only the kept positions reach the head
            index = logits_at.long()[:, :, None].expand(-1, -1, hidden.shape[-1])  # [B, K, dim]
            hidden = hidden.gather(1, index)  # [B, K, dim]
        logits = self.lm_head(hidden).float()  # [B, S or K, vocab]
        return logits if moe is None else (logits, moe)


# The JAX twin's class name (``jaxattn.Llama``); both names work in both packages.
Llama = LlamaForCausalLM


_TRUSTED = threading.local()


@contextlib.contextmanager
def trusted_ids():
    """Inside, ``forward`` skips the token-id range check, a device sync (``bool(tensor.any())``) per call: for ids
    in range by construction, e.g. ``generate``'s decode steps, fed the model's own draws (or an EOS), so torch's
    queued loop does not wait for the device at every step. JAX's jitted step has no such check either."""
    before = getattr(_TRUSTED, "on", False)
    _TRUSTED.on = True
    try:
        yield
    finally:
        _TRUSTED.on = before


def _check_ids(ids: torch.Tensor, vocab_size: int) -> None:
    """ValueError naming the first id outside ``[0, vocab_size)``; one device sync, a host copy only on error."""
    if bool(((ids < 0) | (ids >= vocab_size)).any()):
        check_token_ids(ids.detach().cpu(), vocab_size, arg="input_ids")


def _check_logits_at(logits_at: torch.Tensor, input_ids, positions, segment_ids) -> None:
    """``logits_at``'s shape and dtype (after the inputs'), and its values in ``[0, S)`` unless compiling."""
    check_model_inputs(input_ids, positions, segment_ids, arg="input_ids")
    check_logits_at(logits_at, input_ids.shape)
    s = input_ids.shape[1]
    if not torch.compiler.is_compiling() and bool(((logits_at < 0) | (logits_at >= s)).any()):
        check_logits_at_values(logits_at.detach().cpu(), s)
