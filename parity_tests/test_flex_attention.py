"""torch's FlexAttention under the attention contract (``torchref.flex_attention``, backend ``flex``) against JAX.

The oracle is JAX's, ``jaxattn.attention.reference.attention_reference`` (float32, ``Precision.HIGHEST``; JAX's
backends meet it on the same shapes in ``test_attention.py``): the mask (bottom-right causal, windows, segment ids,
rows that see no key), the softcap, the scale and GQA must give the same numbers. Every case goes through
``dot_product_attention(backend="flex")``: most with ``flex_attention.COMPILED`` off (torch's unfused FlexAttention:
the same ``mask_mod`` / ``score_mod``, seconds cheaper than a compile), two through the compiled kernel, one of them
in bfloat16 by flash-attn's 2x rule. On a CPU FlexAttention has no backward: the refusal and the fall-through of a
backend list are tested here (the trainer's early check in ``test_bad_inputs.py``). The block-mask cache (one mask
per model call with segment ids) must never serve a stale mask.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import torchref.attention as tattn  # noqa: E402
from jaxattn.attention import dot_product_attention as jax_attention  # noqa: E402
from jaxattn.attention.reference import attention_reference  # noqa: E402
from torchref import flex_attention as flex  # noqa: E402

OUT_ATOL = 1e-5  # fp32 output tolerance (design §7), as in test_attention


def _case(seed, b, sq, sk, hq, hkv, d, *, seg=None, **kw):
    """JAX-layout float32 inputs, segment ids (``"self"``: packed documents; ``"pair"``: some query ids absent from
    the keys, so some rows see no key) and the call's keywords."""
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal(s).astype(np.float32) for s in ((b, sq, hq, d), (b, sk, hkv, d), (b, sk, hkv, d)))
    ids = None
    if seg == "self":
        ids = (np.sort(rng.integers(0, 4, (b, sq)), axis=1).astype(np.int32),) * 2
    elif seg == "pair":
        q_ids = np.sort(rng.integers(0, 3, (b, sq)), axis=1).astype(np.int32)
        q_ids[:, : max(1, sq // 5)] = 9
        ids = (q_ids, np.sort(rng.integers(0, 3, (b, sk)), axis=1).astype(np.int32))
    return q, k, v, ids, kw


def _oracle(q, k, v, ids, kw):
    seg = None if ids is None else tuple(jnp.asarray(x) for x in ids)
    return np.asarray(attention_reference(*(jnp.asarray(x) for x in (q, k, v)), segment_ids=seg, **kw), np.float64)


def _torch(q, k, v, ids, kw, *, dtype=torch.float32, compiled=True):
    """``dot_product_attention(backend="flex")``, torch layout in and out; ``compiled=False``: the module's
    ``COMPILED`` off for the call (torch's unfused reference)."""
    T = lambda x: torch.tensor(x).transpose(1, 2).contiguous().to(dtype)  # noqa: E731
    seg = None if ids is None else tuple(torch.tensor(x) for x in ids)
    before, flex.COMPILED = flex.COMPILED, compiled
    try:
        out = tattn.dot_product_attention(T(q), T(k), T(v), segment_ids=seg, **kw, backend="flex")
    finally:
        flex.COMPILED = before
    return out.transpose(1, 2).float().numpy().astype(np.float64)


# (seed, B, Sq, Sk, Hq, Hkv, D, options): every mask feature, odd lengths, GQA, Sq != Sk both ways, decode
CASES = [
    (0, 2, 37, 37, 8, 2, 32, dict(causal=True)),
    (1, 3, 17, 255, 4, 4, 32, dict(causal=True)),  # bottom-right, Sq < Sk
    (2, 1, 255, 17, 8, 1, 80, dict(causal=True)),  # Sq > Sk: rows with no key
    (3, 1, 128, 128, 4, 4, 64, dict(seg="pair", window=(16, 8))),  # dead rows from segment ids
    (4, 3, 17, 17, 8, 2, 32, dict(seg="self", softcap=5.0, window=(4, None), causal=True)),
    (5, 3, 1, 255, 8, 2, 64, dict(seg="pair", softcap=5.0, window=(40, None), causal=True)),  # batched GQA decode
    (6, 1, 128, 17, 4, 4, 32, dict(window=(None, 3), scale=0.3)),
    (7, 2, 200, 200, 4, 2, 16, dict()),  # nothing masked: no block mask at all
]


def _id(c):
    return f"B{c[1]}-Sq{c[2]}-Sk{c[3]}-H{c[4]}/{c[5]}-D{c[6]}-" + "-".join(f"{k}={v}" for k, v in c[7].items())


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_flex_matches_the_oracle(case):
    seed, b, sq, sk, hq, hkv, d, opts = case
    q, k, v, ids, kw = _case(seed, b, sq, sk, hq, hkv, d, **opts)
    want = _oracle(q, k, v, ids, kw)
    got = _torch(q, k, v, ids, kw, compiled=False)
    assert np.isfinite(got).all()
    err = np.abs(got - want).max()
    assert err <= OUT_ATOL, f"flex vs the oracle: max-abs error {err:.3g} > {OUT_ATOL}"
    if ids is not None and opts.get("seg") == "pair":
        assert (got[:, : max(1, sq // 5)] == 0).all(), "a row that sees no key gives zeros"


def test_flex_backend_compiled_fp32():
    """The compiled kernel through the backend name: segment ids with dead rows, a window, softcap, GQA, odd S."""
    q, k, v, ids, kw = _case(11, 2, 45, 45, 8, 2, 32, seg="pair", window=(9, 2), softcap=7.0, causal=True)
    got = _torch(q, k, v, ids, kw)
    err = np.abs(got - _oracle(q, k, v, ids, kw)).max()
    assert err <= OUT_ATOL, f"compiled flex vs the oracle: max-abs error {err:.3g} > {OUT_ATOL}"


def test_flex_backend_compiled_bf16_two_x_rule():
    """bfloat16 through the compiled kernel: error vs the fp32 oracle at most twice that of attention computed in
    bfloat16 op by op (flash-attn's rule, as for the JAX kernels)."""
    q, k, v, ids, kw = _case(12, 2, 96, 96, 4, 2, 64, causal=True)
    want = _oracle(q, k, v, ids, kw)
    got = _torch(q, k, v, ids, kw, dtype=torch.bfloat16)
    T = lambda x: torch.tensor(x).transpose(1, 2).to(torch.bfloat16)  # noqa: E731
    Q, K, V = T(q), T(k).repeat_interleave(2, dim=1), T(v).repeat_interleave(2, dim=1)
    s = (Q @ K.transpose(-1, -2)) * torch.tensor(1 / 8, dtype=torch.bfloat16)  # 1 / sqrt(D)
    s = s.masked_fill(~torch.ones(96, 96, dtype=torch.bool).tril(), float("-inf"))
    naive = (torch.softmax(s, -1) @ V).transpose(1, 2).float().numpy()
    base = np.abs(naive - want).max()
    assert 0 < np.abs(got - want).max() <= 2 * base


def test_flex_refuses_a_backward_on_a_cpu_and_a_list_falls_through():
    q, k, v, _, _ = _case(13, 1, 16, 16, 4, 2, 16)
    Q, K, V = (torch.tensor(x).transpose(1, 2).contiguous().requires_grad_(True) for x in (q, k, v))
    with pytest.raises(ValueError, match=r"backend 'flex': torch .* has no FlexAttention backward on cpu"):
        tattn.dot_product_attention(Q, K, V, causal=True, backend="flex")
    # ("flex", "xla"): flex declines, MATH serves, gradients flow
    out = tattn.dot_product_attention(Q, K, V, causal=True, backend=("flex", "xla"))
    out.sum().backward()
    want = tattn.dot_product_attention(*(x.detach() for x in (Q, K, V)), causal=True, backend="xla")
    torch.testing.assert_close(out.detach(), want)
    assert Q.grad is not None and torch.isfinite(Q.grad).all()
    with pytest.raises(RuntimeError, match=r"no torch attention backend in \['cudnn', 'flex'\].*cudnn: .*flex: "):
        tattn.dot_product_attention(Q, K, V, causal=True, backend=("cudnn", "flex"))


def test_flex_as_the_active_backend_and_the_names_of_both_twins():
    """``attention_backend("flex")`` routes a ``backend=None`` call (and only inside the block); jaxattn refuses the
    name as torch's only."""
    q, k, v, _, _ = _case(14, 1, 16, 16, 4, 2, 16)
    Q, K, V = (torch.tensor(x).transpose(1, 2).contiguous() for x in (q, k, v))
    calls = []
    real = flex.flex_dot_product_attention

    def spy(*a, **kw):
        calls.append(kw)
        return real(*a, **kw)

    flex.flex_dot_product_attention, flex.COMPILED = spy, False
    try:
        with tattn.attention_backend("flex") as names:
            assert names == ("flex",)
            inside = tattn.dot_product_attention(Q, K, V, causal=True)
        tattn.dot_product_attention(Q, K, V, causal=True)
    finally:
        flex.flex_dot_product_attention, flex.COMPILED = real, True
    assert len(calls) == 1 and calls[0]["causal"] is True
    torch.testing.assert_close(inside, tattn.dot_product_attention(Q, K, V, causal=True, backend="xla"))
    assert "flex" in tattn.BACKENDS and "flex" not in tattn.SDPA_BACKENDS
    with pytest.raises(ValueError, match=r"'flex' \(torch FlexAttention\) has no JAX twin; jax backends are"):
        jax_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), backend="flex")


def test_block_mask_cache_never_serves_a_stale_mask():
    """Segment ids: the same two tensors give the same mask (every layer of one call); new tensors, or the same ones
    edited in place, give a new one."""
    ids = torch.tensor([[0, 0, 1, 1, 1, 2]])
    a = flex.block_mask(6, 6, causal=True, segment_ids=(ids, ids))
    assert flex.block_mask(6, 6, causal=True, segment_ids=(ids, ids)) is a
    other = ids.clone()
    b = flex.block_mask(6, 6, causal=True, segment_ids=(other, other))
    assert b is not a
    other[0, 1] = 1  # in place: query 1 now sits in document 1
    c = flex.block_mask(6, 6, causal=True, segment_ids=(other, other))
    assert c is not b
    vis = c.mask_mod(torch.tensor(0), torch.tensor(0), torch.tensor(1), torch.tensor(0))
    assert not bool(vis), "key 0 (document 0) is hidden from query 1 (document 1 after the edit)"
    assert flex.block_mask(6, 6, causal=False) is None


def test_masked_attention_tool_times_three_ways_that_agree(capsys, tmp_path, monkeypatch):
    """``benchmarks.tools.masked_attention``: SDPA's dense mask, FlexAttention and JAX's default give the same output
    (checked before any timing) on a window in float32 and on packed documents in bfloat16, then are timed
    interleaved; ``--out`` writes the rows; bad arguments are refused by name."""
    import json

    from benchmarks.tools import masked_attention as tool

    monkeypatch.setattr(flex, "COMPILED", False)  # the tool's plumbing; the compiled kernel is tested above
    rows = []
    for mask, dtype in (("window", "float32"), ("documents", "bfloat16")):
        argv = ["--seq", "48", "--window", "8", "--docs", "3", "--rounds", "2", "--mask", mask, "--dtype", dtype]
        assert tool.main([*argv, "--out", str(tmp_path)]) == 0
        rows += json.loads((tmp_path / "masked_attention.json").read_text())["rows"]
    assert [(r["S"], r["mask"]) for r in rows] == [(48, "window"), (48, "documents")]
    assert all(set(r["ratios"]) == {"sdpa/flex", "jax/flex"} and r["ratios"]["jax/flex"]["rounds"] == 2 for r in rows)
    out = capsys.readouterr().out
    assert out.count("jax/flex per round") == 2 and "S=48 documents (3 documents), bfloat16" in out
    # the documents mask: every row gets docs-many sorted ids, boundaries inside the row
    _, _, _, call = tool._inputs(np.random.default_rng(0), 2, 48, 4, 2, 8, "documents", 8, 3)
    ids = call["segment_ids"]
    assert (
        ids.shape == (2, 48)
        and (np.diff(ids, axis=1) >= 0).all()
        and (ids[:, -1] == 2).all()
        and (ids[:, 0] == 0).all()
    )
    bad_args = (["--seq", "1"], "--seq"), (["--heads", "6/4"], "--heads"), (["--seq", "3"], "--seq 3")
    for bad, what in (*bad_args, (["--dtype", "float16"], "--dtype")):
        with pytest.raises(SystemExit):
            tool.main(bad)
        assert what in capsys.readouterr().err
