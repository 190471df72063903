"""Every bad input found by the reliability review, in one table run against both packages.

Each row names the input, the packages it applies to, the exception type and fragments its message must hold
(design §10: the argument, the value, what is accepted), so a regression in either package shows here.
A second table lists inputs that must WORK (numpy scalars, uint8 ids, ``np.bool_`` flags, lazy submodules).

    pytest parity_tests/test_bad_inputs.py -k torch       # one package's rows
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

import jaxattn.attention as jattn  # noqa: E402
import jaxattn.config as jconfig  # noqa: E402
import jaxattn.hf as jhf  # noqa: E402
import torchref.attention as tattn  # noqa: E402
import torchref.config as tconfig  # noqa: E402
import torchref.hf as thf  # noqa: E402
from jaxattn.loss_scale import DynamicLossScale  # noqa: E402
from jaxattn.model import Llama  # noqa: E402
from torchref.model import LlamaForCausalLM  # noqa: E402
from twincore.batch import check_token_ids  # noqa: E402
from twincore.data import Dataset  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BOTH = ("jax", "torch")
VOCAB = 256  # the tiny preset


# --------------------------------------------------------------------------------------------- the two sides
@functools.cache
def _model(pkg: str):
    cfg = jconfig.ModelConfig.preset("tiny")
    if pkg == "jax":
        return Llama(cfg, rngs=nnx.Rngs(0))
    torch.manual_seed(0)
    return LlamaForCausalLM(tconfig.ModelConfig.preset("tiny"))


def _array(pkg: str, x):
    """numpy -> the package's array, dtype kept; anything else (a Python list) is passed as it is."""
    if not isinstance(x, np.ndarray):
        return x
    return jnp.asarray(x) if pkg == "jax" else torch.from_numpy(x)


def _call_model(pkg: str, tokens, **kw):
    kw = {k: _array(pkg, v) for k, v in kw.items()}
    return _model(pkg)(_array(pkg, tokens), **kw)


def _qkv(pkg: str, b=1, s=4, h=2, d=8):
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((b, s, h, d)).astype(np.float32) for _ in range(3))
    if pkg == "torch":  # torch layout [B, H, S, D]
        return tuple(torch.from_numpy(x.transpose(0, 2, 1, 3).copy()) for x in (q, k, v))
    return tuple(jnp.asarray(x) for x in (q, k, v))


def _attention(pkg: str, **kw):
    if "segment_ids" in kw:
        kw["segment_ids"] = _array(pkg, kw["segment_ids"])
    fn = jattn.dot_product_attention if pkg == "jax" else tattn.dot_product_attention
    return fn(*_qkv(pkg), **kw)


def _config(pkg: str):
    return jconfig.ModelConfig if pkg == "jax" else tconfig.ModelConfig


def _hf(pkg: str):
    return jhf if pkg == "jax" else thf


def _saved(pkg: str, tmp_path, **kw) -> str:
    path = str(tmp_path / f"ckpt-{pkg}")
    _hf(pkg).save_pretrained(_model(pkg), path, **kw)
    return path


def _hf_config(**changes) -> dict:
    hf = jconfig.ModelConfig.preset("tiny").to_hf()
    hf.update(changes)
    return hf


def _cli(*argv: str):
    from benchmarks import __main__ as cli

    return cli.main(["run", *argv])


# --------------------------------------------------------------------------------------------- trainer CLIs
TRAIN = ["--preset", "tiny", "--seq-len", "16", "--batch-size", "2", "--steps", "2", "--no-progress"]


def _train_main(pkg: str, argv, after: Callable[[], None] | None = None):
    """A thunk running the twin's trainer CLI in this process; a non-zero exit is raised as SystemExit."""

    def thunk():
        if pkg == "jax":
            from jaxattn.train import main
        else:
            from torchref.train import main
        code = main([*TRAIN, *argv])
        if after is not None:
            after()
        if code:
            raise SystemExit(code)

    return thunk


def _train_row(argv_of, fragments_of=None):
    """``argv_of(tmp_path) -> argv`` (str paths), or the argv itself; fragments may depend on tmp_path too."""

    def build(pkg, tmp_path):
        argv = argv_of(tmp_path) if callable(argv_of) else argv_of
        fragments = fragments_of(tmp_path) if callable(fragments_of) else fragments_of
        return _train_main(pkg, argv), fragments

    return build


def _run_dir(pkg, ck, step=None, **run_changes):
    """A run recorded in ``ck`` as the twin's trainer records it (``step``: one complete checkpoint)."""
    from twincore.cli import parse_args, run_flags
    from twincore.rundir import RunDir

    args, config = parse_args([*TRAIN, "--checkpoint-dir", str(ck)], pkg, ())
    vars(args).update(run_changes)
    rd = RunDir(str(ck), pkg, run_flags(args, config), resume=False)
    if step is not None:
        name = f"step_{step}" if pkg == "jax" else f"torchref-step-{step:08d}.pt"
        rd.begin(step, [name])
        (ck / name).write_bytes(b"weights")
        rd.commit(step)
    return rd


def _fresh_into_other_run(pkg, tmp_path):
    _run_dir(pkg, tmp_path / "ck", step=4)
    return _train_main(pkg, ["--checkpoint-dir", str(tmp_path / "ck")]), [
        "holds the checkpoints of another run",
        "steps [4]",
        "--resume",
        "--overwrite",
    ]


def _resume_changed_flags(pkg, tmp_path):
    _run_dir(pkg, tmp_path / "ck", step=2, seed=7, packing="pack")
    argv = ["--checkpoint-dir", str(tmp_path / "ck"), "--resume", "--packing", "bucket"]
    return _train_main(pkg, argv), [
        "--resume: the flags that define the run",
        "packing: 'pack' in the checkpoint, 'bucket' now",
        "seed: 7 in the checkpoint, 0 now",
    ]


def _resume_other_framework(pkg, tmp_path):
    other = "torch" if pkg == "jax" else "jax"
    _run_dir(other, tmp_path / "ck", step=2)
    argv = ["--checkpoint-dir", str(tmp_path / "ck"), "--resume"]
    return _train_main(pkg, argv), [f"holds a run of the {other} trainer"]


def _dir_in_use(pkg, tmp_path):
    held = _run_dir(pkg, tmp_path / "ck")
    lock = held.locked()
    lock.__enter__()  # another trainer holds the directory (released by the thunk)

    def release():
        lock.__exit__(None, None, None)

    thunk = _train_main(pkg, ["--checkpoint-dir", str(tmp_path / "ck")], after=release)

    def run():
        try:
            thunk()
        finally:
            release()

    return run, ["is in use by another trainer", f"pid {os.getpid()}", "must not share a checkpoint directory"]


def _resume_missing_dir(pkg, tmp_path):
    missing = tmp_path / "none"
    return _train_main(pkg, ["--resume", "--checkpoint-dir", str(missing)], after=lambda: _absent(missing)), [
        "--checkpoint-dir",
        "no such directory to --resume from",
    ]


def _absent(path):
    assert not os.path.exists(path), f"{path} was created by a refused command line"


def _log_is_input(flag):
    def build(pkg, tmp_path):
        if flag == "--data":
            f = tmp_path / "ids.npy"
            np.save(f, np.arange(100) % VOCAB)
        else:
            f = tmp_path / "cfg.json"
            f.write_text(__import__("json").dumps(_hf_config()))
        before = f.read_bytes()

        def unchanged():
            assert f.read_bytes() == before

        return _train_main(pkg, [flag, str(f), "--log-json", str(f)], after=unchanged), [
            f"would overwrite {flag}",
            "an input of the run",
        ]

    return build


def _small_vocab_json(tmp_path, vocab=250) -> str:
    f = tmp_path / "small-vocab.json"
    f.write_text(__import__("json").dumps(_hf_config(vocab_size=vocab)))
    return str(f)


def _small_vocab_text_data(flag):
    """A --config-json vocabulary smaller than the byte tokenizer that encodes text ``flag`` data: the message
    names the flags given (not an --init that was not)."""

    def build(pkg, tmp_path):
        cfg = _small_vocab_json(tmp_path)
        text = tmp_path / "text.txt"
        text.write_text("some text to train on, " * 20)
        argv = ["--config-json", cfg, flag, str(text)]
        return _train_main(pkg, argv), [
            f"--config-json {cfg!r}: vocab_size 250 < the 256 ids of the byte tokenizer",
            f"{flag} {str(text)!r}",
        ]

    return build


# --------------------------------------------------------------------------------------------- bad inputs
def _moe_in_tp_pipeline_stages(pkg, tmp_path):
    """An MoE preset in torch's tensor-parallel pipeline stages (no TP plan for stacked experts): refused with the
    flags (exit 2), not at the first step."""
    import socket
    from unittest import mock

    flags = ["--preset", "moe-tiny", "--microbatches", "2", "--batch-size", "8"]
    with socket.socket() as s:  # a port nobody listens on: a late refusal would wait for rank 1, then time out
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    env = {"WORLD_SIZE": "4", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
    thunk = _train_main(pkg, [*flags, "--parallel", "pp+tp", "--packing", "bucket", "--distributed-timeout", "5"])

    def run():
        with mock.patch.dict(os.environ, env):
            thunk()

    return run, ["--parallel pp+tp: torchref has no tensor-parallel plan", "(MoE)", "--parallel pp or pp+fsdp"]


@dataclass(frozen=True)
class Bad:
    """``build(pkg, tmp_path) -> (thunk, fragments)``: calling ``thunk()`` must raise ``exc`` whose message
    holds every fragment. ``exc=SystemExit`` (a CLI): the exit code must be non-zero and the fragments are
    looked for in stderr."""

    name: str
    pkgs: tuple
    exc: Any
    build: Callable


def _save_onto_file(pkg, tmp_path):
    f = tmp_path / "a_file"
    f.write_text("not a checkpoint")
    return lambda: _hf(pkg).save_pretrained(_model(pkg), str(f)), [str(f)]


def _corrupt(pkg, tmp_path, name, **save_kw):
    path = _saved(pkg, tmp_path, **save_kw)
    file = os.path.join(path, name)
    assert os.path.isfile(file), sorted(os.listdir(path))
    with open(file, "w") as f:
        f.write("{not json")
    return lambda: _hf(pkg).from_pretrained(path), [file]


def _int32_tensor(pkg, tmp_path):
    import safetensors.numpy

    path = _saved(pkg, tmp_path)
    file = os.path.join(path, "model.safetensors")
    tensors = safetensors.numpy.load_file(file)
    key = "model.norm.weight"
    tensors[key] = tensors[key].astype(np.int32)
    safetensors.numpy.save_file(tensors, file)
    return lambda: _hf(pkg).from_pretrained(path), [key, "int32"]


def _tokens(pkg):
    return "tokens" if pkg == "jax" else "input_ids"


def _scale_state(bad):
    def build(pkg, tmp_path):
        ls = DynamicLossScale.create()
        return lambda: ls.load_state_dict({**ls.state_dict(), "scale": bad}), ["state_dict['scale']", repr(bad)]

    return build


def _from_hf(key, value):
    def build(pkg, tmp_path):
        hf = _hf_config(**{key: value})
        if key == "rope_theta":
            hf.pop("rope_parameters")  # the legacy key alone, as in a transformers 4.x config.json
        return lambda: _config(pkg).from_hf(hf), [key, repr(value), "expected"]

    return build


def _dataset(source, packing="pack"):
    return Dataset.from_source(str(source), seq_len=16, batch_size=2, packing=packing, vocab_size=VOCAB)


def _one_token_docs(packing, pkg, tmp_path):
    """A folder of one-byte files: every document is one token, so no (token, next token) target exists."""
    d = tmp_path / "ones"
    d.mkdir()
    for i in range(3):
        (d / f"{i}.txt").write_text(str(i))
    return lambda: _dataset(d, packing), ["--data", repr(str(d)), "no document has 2 tokens", f"--packing {packing}"]


def _uint64_npy(pkg, tmp_path):
    f = tmp_path / "ids.npy"
    np.save(f, np.array([1, 2, 2**64 - 1], np.uint64))
    return lambda: _dataset(f), ["--data", repr(str(f)), f"{2**64 - 1} at position (2,)", f"[0, {VOCAB})"]


def _text_named_npy(pkg, tmp_path):
    f = tmp_path / "x.npy"
    f.write_text("plain text, not an array")
    return lambda: _dataset(f), ["--data", repr(str(f)), "is not a .npy array file", "numpy.save", "without the .npy"]


BAD = [
    # (a) saving: onto an existing file, to ""
    Bad("a-save-onto-file", BOTH, (ValueError, FileExistsError), _save_onto_file),
    Bad(
        "a-save-to-empty-path",
        BOTH,
        (ValueError, FileExistsError),
        lambda pkg, tmp: (lambda: _hf(pkg).save_pretrained(_model(pkg), ""), ["''"]),
    ),
    # (b) token ids outside the vocabulary in an eager call: position and value named
    Bad(
        "b-token-id-too-large",
        BOTH,
        ValueError,
        lambda pkg, tmp: (
            lambda: _call_model(pkg, np.array([[1, 2, VOCAB]], np.int32)),
            [f"outside [0, vocab_size={VOCAB}", str(VOCAB), "(0, 2)"],
        ),
    ),
    Bad(
        "b-token-id-negative",
        BOTH,
        ValueError,
        lambda pkg, tmp: (
            lambda: _call_model(pkg, np.array([[1, -3, 2]], np.int32)),
            [f"outside [0, vocab_size={VOCAB}", "-3", "(0, 1)"],
        ),
    ),
    # (c) a loss-scale state whose scale is not finite and > 0 in float32
    *[
        Bad(f"c-loss-scale-{label}", ("jax",), ValueError, _scale_state(v))
        for label, v in (
            ("zero", 0.0),
            ("nan", float("nan")),
            ("inf", float("inf")),
            ("negative", -2.0),
            ("1e40", 1e40),
        )
    ],
    # (d) benchmark filters that select nothing
    Bad(
        "d-bench-impl-nope",
        ("cli",),
        SystemExit,
        lambda pkg, tmp: (lambda: _cli("--impl", "nope", "--out", str(tmp / "out")), ["--impl", "'nope'"]),
    ),
    Bad(
        "d-bench-max-seq-negative",
        ("cli",),
        SystemExit,
        lambda pkg, tmp: (lambda: _cli("--max-seq", "-5", "--out", str(tmp / "out")), ["--max-seq", "-5"]),
    ),
    Bad(
        "d-bench-out-empty",  # "" once fell back to the default: the committed results were overwritten
        ("cli",),
        SystemExit,
        lambda pkg, tmp: (lambda: _cli("--suite", "attention", "--out", ""), ["--out ''", "an empty path"]),
    ),
    # (e) invalid JSON: the message names the file
    Bad("e-config-json-invalid", BOTH, ValueError, lambda pkg, tmp: _corrupt(pkg, tmp, "config.json")),
    Bad(
        "e-index-json-invalid",
        BOTH,
        ValueError,
        lambda pkg, tmp: _corrupt(pkg, tmp, "model.safetensors.index.json", max_shard_bytes=50_000),
    ),
    # (f) config.json values of the wrong kind
    Bad("f-rms-norm-eps-str", BOTH, ValueError, _from_hf("rms_norm_eps", "abc")),
    Bad("f-rope-theta-null", BOTH, ValueError, _from_hf("rope_theta", None)),
    Bad("f-num-kv-heads-zero", BOTH, ValueError, _from_hf("num_key_value_heads", 0)),
    # (g) wrong argument types
    Bad(
        "g-backend-int",
        BOTH,
        TypeError,
        lambda pkg, tmp: (lambda: _attention(pkg, backend=3), ["backend", "3", "'xla'"]),
    ),
    Bad(
        "g-max-shard-bytes-str",
        BOTH,
        (TypeError, ValueError),
        lambda pkg, tmp: (
            lambda: _hf(pkg).save_pretrained(_model(pkg), str(tmp / "c"), max_shard_bytes="1GB"),
            ["max_shard_bytes", "'1GB'"],
        ),
    ),
    # (h) Python lists where arrays are expected
    Bad(
        "h-tokens-list",
        BOTH,
        TypeError,
        lambda pkg, tmp: (lambda: _call_model(pkg, [[1, 2, 3]]), [_tokens(pkg), "list"]),
    ),
    Bad(
        "h-segment-ids-list",
        BOTH,
        TypeError,
        lambda pkg, tmp: (lambda: _attention(pkg, segment_ids=[[0, 0, 1, 1]]), ["segment_ids", "list"]),
    ),
    Bad(
        "h-segment-ids-flat-list",
        BOTH,
        TypeError,
        lambda pkg, tmp: (lambda: _attention(pkg, segment_ids=[0, 0, 1, 1]), ["segment_ids", "list"]),
    ),
    # (j) a checkpoint tensor of a dtype the model does not hold
    Bad("j-int32-tensor-in-checkpoint", BOTH, ValueError, _int32_tensor),
    # (k) bool ids are refused the same way in both (attention segment ids and model tokens)
    Bad(
        "k-bool-segment-ids",
        BOTH,
        TypeError,
        lambda pkg, tmp: (
            lambda: _attention(pkg, segment_ids=np.zeros((1, 4), bool)),
            ["segment_ids", "integer dtype", "bool"],
        ),
    ),
    Bad(
        "k-bool-tokens",
        BOTH,
        TypeError,
        lambda pkg, tmp: (lambda: _call_model(pkg, np.zeros((1, 4), bool)), [_tokens(pkg), "bool"]),
    ),
    Bad(
        "k-causal-int",
        BOTH,
        TypeError,
        lambda pkg, tmp: (lambda: _attention(pkg, causal=1), ["causal must be a bool", "1"]),
    ),
    # (l) empty batch or sequence
    Bad(
        "l-seq-zero",
        BOTH,
        ValueError,
        lambda pkg, tmp: (lambda: _call_model(pkg, np.zeros((1, 0), np.int32)), [_tokens(pkg)]),
    ),
    Bad(
        "l-batch-zero",
        BOTH,
        ValueError,
        lambda pkg, tmp: (lambda: _call_model(pkg, np.zeros((0, 4), np.int32)), [_tokens(pkg)]),
    ),
    # (m) trainer checkpoint directories, output paths and run flags (both trainers, refused before any step)
    Bad("m-fresh-run-into-another-runs-dir", BOTH, SystemExit, _fresh_into_other_run),
    Bad("m-resume-changed-run-flags", BOTH, SystemExit, _resume_changed_flags),
    Bad("m-resume-other-frameworks-run", BOTH, SystemExit, _resume_other_framework),
    Bad("m-dir-in-use", BOTH, SystemExit, _dir_in_use),
    Bad("m-resume-missing-dir", BOTH, SystemExit, _resume_missing_dir),
    Bad(
        "m-resume-and-overwrite",
        BOTH,
        SystemExit,
        _train_row(lambda t: ["--resume", "--overwrite", "--checkpoint-dir", str(t)], ["give one of them"]),
    ),
    # run flags refused on their own: (name, packages, argv, fragments)
    *[
        Bad(f"m-{name}", pkgs, SystemExit, _train_row(argv, fragments))
        for name, pkgs, argv, fragments in (
            ("overwrite-without-dir", BOTH, ["--overwrite"], ["--overwrite needs --checkpoint-dir DIR"]),
            (
                "checkpoint-dir-unwritable",
                BOTH,
                ["--checkpoint-dir", "/proc/jaxattn-ck"],
                ["--checkpoint-dir", "is not writable"],
            ),
            ("log-json-unwritable", BOTH, ["--log-json", "/proc/jaxattn/log.jsonl"], ["--log-json", "is not writable"]),
            ("profile-unwritable", BOTH, ["--profile", "/proc/jaxattn-trace"], ["--profile", "is not writable"]),
            ("checkpoint-dir-empty", BOTH, ["--checkpoint-dir", ""], ["--checkpoint-dir ''", "an empty path"]),
            (
                "max-nonfinite-steps-zero",
                BOTH,
                ["--max-nonfinite-steps", "0"],
                ["--max-nonfinite-steps 0", "integer >= 1"],
            ),
            (
                "distributed-timeout-nan",
                BOTH,
                ["--distributed-timeout", "nan"],
                ["--distributed-timeout nan", "seconds > 0"],
            ),
            ("attention-cudnn-on-cpu", BOTH, ["--attention", "cudnn"], ["--attention 'cudnn' cannot serve", "cpu"]),
            (
                "attention-flex-backward-on-cpu",
                ("torch",),
                ["--attention", "flex"],
                ["--attention 'flex' cannot serve", "no FlexAttention backward on cpu"],
            ),
            (
                "attention-flex-in-jax",
                ("jax",),
                ["--attention", "flex"],
                ["--attention 'flex'", "jax attention backends from flash,"],
            ),
            (
                "parallel-outside-torchrun",
                ("torch",),
                ["--parallel", "fsdp", "--offload-optimizer"],
                ["--parallel fsdp runs under torchrun"],
            ),
        )
    ],
    Bad("m-log-json-is-data", BOTH, SystemExit, _log_is_input("--data")),
    Bad("m-log-json-is-config", BOTH, SystemExit, _log_is_input("--config-json")),
    Bad(
        "m-checkpoint-dir-under-a-file",
        BOTH,
        SystemExit,
        _train_row(
            lambda t: (t.joinpath("f").write_text("x"), ["--checkpoint-dir", str(t / "f" / "ck")])[1],
            ["--checkpoint-dir", "cannot be created", "is not a directory"],
        ),
    ),
    Bad("m-moe-in-tp-pipeline-stages", ("torch",), SystemExit, _moe_in_tp_pipeline_stages),
    Bad("m-config-json-vocab-under-bytes-data", BOTH, SystemExit, _small_vocab_text_data("--data")),
    Bad("m-config-json-vocab-under-bytes-eval-data", BOTH, SystemExit, _small_vocab_text_data("--eval-data")),
    # (n) training data: no trainable target in either packing mode; uint64 ids shown as they are; a text file
    # named .npy (numpy calls it "pickled data")
    *[
        Bad(f"n-data-no-target-{packing}", ("spec",), ValueError, functools.partial(_one_token_docs, packing))
        for packing in ("pack", "bucket")
    ],
    Bad("n-data-npy-uint64-id", ("spec",), ValueError, _uint64_npy),
    Bad(
        "n-token-ids-uint64",
        ("spec",),
        ValueError,
        lambda pkg, tmp: (
            lambda: check_token_ids(np.array([[1, 2**64 - 1]], np.uint64), VOCAB),
            [f"{2**64 - 1} at position (0, 1)"],
        ),
    ),
    Bad("n-data-text-named-npy", ("spec",), ValueError, _text_named_npy),
]


def _bad_params():
    return [pytest.param(case, pkg, id=f"{case.name}-{pkg}") for case in BAD for pkg in case.pkgs]


@pytest.mark.parametrize("case, pkg", _bad_params())
def test_bad_input(case, pkg, tmp_path, capsys):
    thunk, fragments = case.build(pkg, tmp_path)
    with pytest.raises(case.exc) as info:
        thunk()
    if case.exc is SystemExit:
        assert info.value.code not in (0, None)
        message = capsys.readouterr().err
        assert not (tmp_path / "out").exists()  # a failed command line writes nothing
    else:
        message = str(info.value)
    missing = [f for f in fragments if f not in message]
    assert not missing, f"{type(info.value).__name__} message lacks {missing}: {message}"


# --------------------------------------------------------------------------------------------- must work
def _np_scalar_loss_scale(pkg):
    ls = DynamicLossScale.create(
        init_scale=np.float32(2.0),
        growth_factor=np.float64(2.0),
        backoff_factor=np.asarray(0.5),
        growth_interval=np.int64(10),
    )
    assert ls.state_dict() == DynamicLossScale.create(2.0, 2.0, 0.5, 10).state_dict()
    sd = {k: np.asarray(v) for k, v in ls.state_dict().items()}
    assert DynamicLossScale.from_state_dict(sd).state_dict() == ls.state_dict()


def _uint8_ids(pkg):
    ids = np.array([[1, 2, 255, 3]], np.uint8)
    logits = _call_model(pkg, ids, segment_ids=np.array([[0, 0, 1, 1]], np.uint8))
    assert tuple(logits.shape) == (1, 4, VOCAB)
    out = _attention(pkg, segment_ids=np.array([[0, 0, 1, 1]], np.uint8))
    assert tuple(out.shape) in ((1, 4, 2, 8), (1, 2, 4, 8))


def _np_bool_causal(pkg):
    got = np.asarray(_attention(pkg, causal=np.bool_(True)))
    want = np.asarray(_attention(pkg, causal=True))
    np.testing.assert_array_equal(got, want)


def _kv_heads_null(pkg):
    assert _config(pkg).from_hf(_hf_config(num_key_value_heads=None)).n_kv_heads == 4  # HF: null = n_heads


def _lazy_submodules(pkg):
    code = {
        "jax": "import jaxattn; jaxattn.attention.dot_product_attention; "
        "jaxattn.precision.Policy; jaxattn.loss_scale.DynamicLossScale",
        "torch": "import torchref; torchref.attention.dot_product_attention; torchref.precision",
    }[pkg]
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]


def _small_vocab_synthetic(pkg, tmp_path):
    """A vocabulary under 256 trains on synthetic data: no tokenizer encodes anything."""
    _train_main(pkg, ["--config-json", _small_vocab_json(tmp_path), "--data", "synthetic"])()


GOOD = [
    ("i-loss-scale-numpy-scalars", ("jax",), _np_scalar_loss_scale),
    ("k-uint8-ids", BOTH, _uint8_ids),
    ("k-causal-np-bool", BOTH, _np_bool_causal),
    ("f-num-kv-heads-null", BOTH, _kv_heads_null),
    ("m-lazy-submodules", BOTH, _lazy_submodules),
    ("m-config-json-vocab-under-bytes-synthetic", BOTH, _small_vocab_synthetic),
]


@pytest.mark.parametrize(
    "fn, pkg", [pytest.param(fn, pkg, id=f"{name}-{pkg}") for name, pkgs, fn in GOOD for pkg in pkgs]
)
def test_good_input(fn, pkg, tmp_path):
    if "tmp_path" in __import__("inspect").signature(fn).parameters:
        fn(pkg, tmp_path)
    else:
        fn(pkg)


def test_row_names_unique():
    """Row names are unique (a duplicated name would hide a row in ``-k`` selections)."""
    names = [c.name for c in BAD] + [g[0] for g in GOOD]
    assert len(names) == len(set(names)), sorted(names)
