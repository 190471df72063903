"""The model runs with every attention backend and gives the same logits (issue: attention backends).

JAX: the ``tiny`` model under ``attention_backend(name)`` for each backend that serves CPU calls (``xla``,
``chunked``, ``flash`` and ``splash`` in interpret mode) matches the ``xla`` logits and the torch model at the fp32
full-model tolerance. torch: the same model under each SDPA backend available on CPU. Backends that cannot
serve (``cudnn``/``mosaic`` without a GPU) must decline with a reason, never silently fall back.
"""

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from jaxattn.attention import AttentionBackendError, attention_backend  # noqa: E402
from parity_tests.conftest import HAS_GPU  # noqa: E402
from parity_tests.twins import jitted, tokens, twin_models  # noqa: E402
from torchref import attention as tattn  # noqa: E402
from torchref import flex_attention as flex  # noqa: E402
from torchref.config import ModelConfig  # noqa: E402

LOGITS_TOL = 1e-4


@pytest.fixture(scope="module")
def case():
    tmodel, jmodel = twin_models(ModelConfig.preset("tiny"), seed=11)
    rng = np.random.default_rng(12)
    tok = tokens(rng, 256, 2, 19)  # odd length: not a multiple of any block size
    seg = np.sort(rng.integers(0, 2, (2, 19)), axis=1)
    pos = np.broadcast_to(np.arange(19), (2, 19)).copy()
    with torch.no_grad():
        ref_t = tmodel(torch.from_numpy(tok), torch.from_numpy(pos), torch.from_numpy(seg)).numpy()
    return tmodel, jmodel, tok, pos, seg, ref_t


@pytest.mark.parametrize("backend", ["xla", "chunked", "flash", "splash"])
def test_jax_model_same_logits_with_each_backend(case, backend):
    tmodel, jmodel, tok, pos, seg, ref_t = case
    with attention_backend(backend):  # jit inside the context: the backend is chosen at trace time
        out = jitted(jmodel)(*(jnp.asarray(a, jnp.int32) for a in (tok, pos, seg)))
    assert np.abs(np.asarray(out) - ref_t).max() <= LOGITS_TOL


@pytest.mark.skipif(HAS_GPU, reason="checks the CPU refusal")
@pytest.mark.parametrize("backend", ["cudnn", "mosaic"])
def test_gpu_only_backends_decline_on_cpu(case, backend):
    _, jmodel, tok, *_ = case
    with attention_backend(backend), pytest.raises(AttentionBackendError, match=backend):
        jitted(jmodel)(jnp.asarray(tok, jnp.int32))


def _torch_backends():
    names = ["xla", "flex"]  # flex: FlexAttention, forward only on a CPU (these calls are under no_grad)
    q = torch.randn(1, 4, 8, 16)
    for name in ("flash", "chunked"):
        try:
            tattn.dot_product_attention(q, q[:, :2], q[:, :2], causal=True, backend=name)
            names.append(name)
        except RuntimeError:  # this build has no CPU kernel for it
            pass
    return names


@pytest.mark.parametrize("backend", _torch_backends())
def test_torch_model_same_logits_with_each_sdpa_backend(case, backend, monkeypatch):
    monkeypatch.setattr(flex, "COMPILED", False)  # the kernel compiled: test_flex_attention.py; here the routing
    tmodel, _, tok, pos, _, _ = case
    with torch.no_grad():
        ref = tmodel(torch.from_numpy(tok), torch.from_numpy(pos)).numpy()
        with tattn.attention_backend(backend):
            out = tmodel(torch.from_numpy(tok), torch.from_numpy(pos)).numpy()
    assert np.abs(out - ref).max() <= LOGITS_TOL


def test_torch_flex_model_matches_jax_with_a_window_and_segment_ids(case, monkeypatch):
    """torch's model under ``attention_backend("flex")`` as a Mistral (a 4-token window) on packed documents: the
    mask of every layer comes from FlexAttention's block mask, built once per call (``torchref.flex_attention``), and
    the logits equal the JAX twin's (torch's unfused FlexAttention: the compiled kernel is test_flex_attention's)."""
    from parity_tests.twins import windowed_twins

    monkeypatch.setattr(flex, "COMPILED", False)
    tmodel, jmodel = windowed_twins(twin_models(ModelConfig.preset("tiny"), seed=11))
    _, _, tok, pos, seg, _ = case
    args = [torch.from_numpy(a) for a in (tok, pos, seg)]
    with torch.no_grad():
        with tattn.attention_backend("flex"):
            out = tmodel(*args).numpy()
        ref = tmodel(*args).numpy()
    want = np.asarray(jitted(jmodel)(*(jnp.asarray(a, jnp.int32) for a in (tok, pos, seg))))
    assert np.abs(out - ref).max() <= LOGITS_TOL
    assert np.abs(out - want).max() <= LOGITS_TOL


@pytest.mark.slow  # the tool's run; the default's choice is test_attention's test_default_backend_on_cpu; CI runs it
@pytest.mark.slow_feature
def test_cpu_default_tool_pairs_the_default_with_xla(capsys, tmp_path):
    """``benchmarks.tools.cpu_default``: the model's training step and forward traced under the default backends and
    under ``xla`` alone agree (checked inside before any timing), then are timed, paired; ``--out`` writes the
    JSON. On a CPU the default puts ``chunked`` first from 128 keys on; ``--sweep`` times ``xla`` and ``chunked``
    by name."""
    import json

    from benchmarks.tools import cpu_default as tool

    res = tool.main(
        ["--preset", "tiny", "--train", "2x16", "--prefill", "1x128", "--rounds", "1", "--out", str(tmp_path)]
    )
    assert res["train"]["default"] == ["xla"] and res["prefill"]["default"] == ["chunked", "xla"]
    for what in ("train", "prefill"):
        assert res[what]["ratio"]["rounds"] == 1 and set(res[what]["times"]) == {"xla", "default"}
    assert capsys.readouterr().out.count("default / xla per round") == 2
    assert json.loads((tmp_path / "cpu_default.json").read_text())["args"]["train"] == [2, 16]
    sweep = tool.main(["--preset", "tiny", "--train", "2x8", "--sweep", "12", "--rounds", "1"])["sweep"]
    assert list(sweep) == [12] and set(sweep[12]) == {"xla", "chunked"}
    assert all(r["first_s"] > 0 and r["median_ms"] > 0 for r in sweep[12].values())
    assert "S=12: xla" in capsys.readouterr().out
    for bad in (["--train", "2by16"], ["--sweep", "8,0"], ["--sweep", "a"]):
        with pytest.raises(SystemExit):
            tool.main(bad)
