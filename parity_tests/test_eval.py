"""Perplexity in both twins: ``jaxattn.eval`` / ``torchref.eval`` (library and CLI) and the trainers' ``--eval-data``.

* The evaluation rows (``twincore.eval``) score every token but a document's first exactly once, in file order.
* The mean token loss is the plain next-token cross-entropy (oracle: torch's ``F.cross_entropy`` per document),
  and JAX = torch within the full-model 1e-4 rule (design §7), on the tiny twins.
* The CLIs print the same loss and perplexity, take ``--dtype bf16``, and turn every bad flag into one
  ``prog: error: --flag ...`` line and exit status 2.
* Both trainers log ``--eval-data`` records (``twincore.runlog.EVAL_KEYS``) after every ``--eval-every`` steps and the
  last, equal across twins, and the last one equals the eval CLI on the trainer's export.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from twincore.data import read_documents
from twincore.eval import EvalResult, eval_batches, eval_rows
from twincore.runlog import EVAL_KEYS, KEYS, read_log

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

from jaxattn import eval as jeval  # noqa: E402
from parity_tests.twins import twin_models  # noqa: E402
from torchref import eval as teval  # noqa: E402
from torchref.config import ModelConfig  # noqa: E402

LOSS_TOL = 1e-4  # a mean token loss is a full-model forward: the §7 fp32 logits rule
LINE = re.compile(r"mean token loss (\S+) nats, perplexity (\S+) over (\d+) tokens of (.+)")


@pytest.fixture(scope="module")
def twins():
    return twin_models(ModelConfig.preset("tiny"), seed=11)


@pytest.fixture(scope="module")
def init_dir(twins, tmp_path_factory):
    from torchref.hf import save_pretrained

    return save_pretrained(twins[0], tmp_path_factory.mktemp("init"))


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "held-out.txt"
    with open("README.md", encoding="utf-8") as f:
        path.write_text(f.read()[:1500], encoding="utf-8")
    return str(path)


def _targets(batches) -> list[int]:
    """The scored targets of ``batches`` in order (a target counts where the train step's loss weight is 1)."""
    out = []
    for b in batches:
        w = b["loss_mask"][:, 1:] * (b["segment_ids"][:, 1:] == b["segment_ids"][:, :-1])
        out += [int(t) for t in b["tokens"][:, 1:][w > 0]]
    return out


def test_rows_score_every_token_but_a_documents_first_once(rng):
    docs = [rng.integers(0, 256, n) for n in (1, 9, 30, 2, 17)]
    for seq_len, batch_size in ((4, 3), (7, 2), (64, 5)):
        batches = eval_batches(docs, seq_len=seq_len, batch_size=batch_size, vocab_size=256)
        assert _targets(batches) == [int(t) for d in docs for t in d[1:]]
        assert {b["tokens"].shape for b in batches} == {(batch_size, seq_len + 1)}  # one shape: one compile
        rows = eval_rows(docs, seq_len)
        assert rows["tokens"].shape[0] == -(-(sum(map(len, docs)) - 1) // seq_len)
    with pytest.raises(ValueError, match=r"--data 'x' \(tokenized document 1\).*300"):
        eval_batches([np.array([1, 2]), np.array([3, 300])], seq_len=4, batch_size=2, vocab_size=256, name="--data 'x'")
    with pytest.raises(ValueError, match="batch_size must be an int >= 1"):
        eval_batches(docs, seq_len=4, batch_size=0, vocab_size=256)
    assert EvalResult(loss_sum=812.5, tokens=400).perplexity == pytest.approx(np.exp(812.5 / 400))


def test_jax_and_torch_perplexity_agree_and_equal_the_cross_entropy(twins, text):
    tmodel, jmodel = twins
    docs = read_documents(text)
    short = [docs[0][:20], docs[0][20:45]]  # one row of 64: the oracle is one forward per document
    batches = eval_batches(short, seq_len=64, batch_size=4, vocab_size=256)
    with torch.no_grad():
        logits = [tmodel(torch.from_numpy(d[None, :-1]))[0] for d in short]  # [S, vocab] each
        nll = [F.cross_entropy(lg, torch.from_numpy(d[1:]).long(), reduction="sum") for lg, d in zip(logits, short)]
    want = float(sum(nll)) / 43
    got_t, got_j = teval.evaluate(tmodel, batches), jeval.evaluate(jmodel, batches)
    assert got_t.tokens == got_j.tokens == 43
    assert abs(got_t.loss - want) <= 1e-5 and abs(got_j.loss - want) <= LOSS_TOL

    batches = eval_batches(docs, seq_len=32, batch_size=4, vocab_size=256)
    got_t, got_j = teval.evaluate(tmodel, batches), jeval.evaluate(jmodel, batches)
    assert got_t.tokens == got_j.tokens == sum(len(d) - 1 for d in docs)
    assert abs(got_t.loss - got_j.loss) <= LOSS_TOL
    assert 100 < got_t.perplexity < 400  # an untrained model on bytes: about the vocabulary size
    for mode in (True, False):  # evaluate() puts the module back in the mode it found
        tmodel.train(mode)
        teval.evaluate(tmodel, batches[:1])
        assert tmodel.training is mode


def _cli(main, argv, capsys):
    code = main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_eval_clis_print_the_same_perplexity(init_dir, text, capsys):
    argv = ["--init", str(init_dir), "--data", text, "--seq-len", "32", "--batch-size", "4"]
    found = {}
    for name, main in (("jax", jeval.main), ("torch", teval.main)):
        for dtype in ("float32", "bf16"):
            code, out, err = _cli(main, argv + ["--dtype", dtype], capsys)
            assert code == 0, err
            m = LINE.fullmatch(out.strip())
            assert m and m.group(4) == text, out
            found[name, dtype] = (float(m.group(1)), float(m.group(2)), int(m.group(3)))
    (lj, pj, nj), (lt, _, nt) = found["jax", "float32"], found["torch", "float32"]
    assert nj == nt and abs(lj - lt) <= LOSS_TOL and pj == pytest.approx(np.exp(lj), rel=1e-4)
    assert abs(found["jax", "bf16"][0] - lj) < 0.05 and abs(found["torch", "bf16"][0] - lt) < 0.05  # bf16 weights


def test_eval_cli_errors_are_one_line(init_dir, text, tmp_path, capsys):
    ok = ["--init", str(init_dir), "--data", text]
    cases = [
        (["--data", text], r"the following arguments are required: --init"),
        (["--init", str(tmp_path / "nope"), "--data", text], r"--init '.*nope': no such directory or \.gguf file"),
        (["--init", str(tmp_path), "--data", text], r"--init '.*': not a Llama checkpoint we can read"),
        (ok[:2] + ["--data", str(tmp_path / "x.txt")], r"--data '.*x\.txt': no such file or folder"),
        (ok + ["--seq-len", "0"], r"--seq-len 0: must be an integer >= 1"),
        (ok + ["--seq-len", "999"], r"--seq-len 999: exceeds the model's max_seq_len=256"),
        (ok + ["--batch-size", "two"], r"--batch-size: invalid int value: 'two'"),
        (ok + ["--dtype", "int8"], r"--dtype 'int8' is not supported; use one of float32, bfloat16, float16"),
    ]
    for prog, main in (("python -m jaxattn.eval", jeval.main), ("python -m torchref.eval", teval.main)):
        for argv, message in cases:
            code, out, err = _cli(main, argv, capsys)
            assert code == 2 and not out and len(err.strip().splitlines()) == 1, (argv, err)
            assert err.startswith(f"{prog}: error: ") and re.search(message, err), err


def test_trainers_log_eval_records_equal_across_twins_and_to_the_cli(init_dir, text, tmp_path, capsys):
    from jaxattn import train as jtrain
    from torchref import train as ttrain

    argv = ["--init", str(init_dir), "--data", "README.md", "--eval-data", text, "--eval-every", "2", "--steps", "5"]
    argv += ["--seq-len", "32", "--batch-size", "4", "--lr", "3e-3", "--no-progress"]
    out_j = jtrain.run(argv + ["--log-json", str(tmp_path / "j.jsonl"), "--checkpoint-dir", str(tmp_path / "j")])
    out_t = ttrain.run(argv + ["--log-json", str(tmp_path / "t.jsonl"), "--num-workers", "0"])
    for out, log in ((out_j, tmp_path / "j.jsonl"), (out_t, tmp_path / "t.jsonl")):
        evals = read_log(str(log), "eval")
        assert [r["step"] for r in evals] == [2, 4, 5] and all(tuple(r) == EVAL_KEYS for r in evals)
        assert evals == out["evals"]
        train = read_log(str(log))
        assert [r["step"] for r in train] == [1, 2, 3, 4, 5] and all(tuple(r) == KEYS for r in train)
        steps = [r["step"] for r in read_log(str(log), "all")]
        assert steps == [1, 2, 2, 3, 4, 4, 5, 5]  # each evaluation right after its step's record
        assert evals[-1]["eval_loss"] < evals[0]["eval_loss"]  # it trains (README's text: the same kind of bytes)
    for a, b in zip(out_j["evals"], out_t["evals"]):
        assert a["eval_tokens"] == b["eval_tokens"] and abs(a["eval_loss"] - b["eval_loss"]) <= LOSS_TOL
    capsys.readouterr()
    code, out, _ = _cli(
        teval.main, ["--init", out_j["final"], "--data", text, "--seq-len", "32", "--batch-size", "4"], capsys
    )
    m = LINE.fullmatch(out.strip())
    assert code == 0 and abs(float(m.group(1)) - out_j["evals"][-1]["eval_loss"]) <= LOSS_TOL
    with pytest.raises(ValueError, match="kind='dev'"):
        read_log(str(tmp_path / "j.jsonl"), "dev")
