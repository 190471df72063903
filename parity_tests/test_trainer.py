"""The twin training CLIs (``python -m jaxattn.train`` / ``python -m torchref.train``), in-process, tiny, CPU.

* One flag table: both parsers have the same shared flags (names, defaults, choices, help) and only their own
  framework flags; every bad value in :data:`BAD` is a ``CLIError`` naming the flag and the value, raised by
  ``parse_args`` (no model built, nothing compiled), and ``main`` turns it into exit status 2.
* Cross-framework: from ONE ``--init`` directory (the twin builder's weights, written by ``save_pretrained``),
  the same data and seed, fp32, adamw with warmup + cosine and clipping, the per-step losses of the two CLIs
  agree within 1e-4 for 30 steps (measured: ~1e-6), also with ``--grad-accum 2 --remat full``.
* Same seed twice in a row: identical per-step losses in each framework (random init, synthetic data).
* bf16 and fp16 runs of both CLIs train (the loss falls); ``--packing bucket`` compiles the JAX step once per bucket
  used; ``--profile`` writes a trace; ``--log-json`` has one object per step with the documented keys; the
  final ``save_pretrained`` export loads in ``transformers`` and gives torchref's logits.
"""

from __future__ import annotations

import json
import os
import re

import numpy as np
import pytest

from twincore.cli import FLAGS, CLIError, build_parser, parse_args
from twincore.runlog import KEYS, read_log

torch = pytest.importorskip("torch")
from jaxattn import train as jtrainer  # noqa: E402
from torchref import train as ttrainer  # noqa: E402

JAX_BACKENDS = ("flash", "mosaic", "splash", "cudnn", "chunked", "xla")
TORCH_BACKENDS = ("xla", "flash", "chunked", "cudnn")
SMALL = ["--seq-len", "32", "--batch-size", "4", "--no-progress"]


@pytest.fixture(scope="module")
def init_dir(tmp_path_factory):
    """A Hugging Face directory holding the twin builder's tiny weights."""
    from benchmarks.twins import twin_models
    from torchref.config import ModelConfig
    from torchref.hf import save_pretrained

    tm, _ = twin_models(ModelConfig.preset("tiny"), seed=0)
    return save_pretrained(tm, tmp_path_factory.mktemp("init"))


def _options(parser):
    return {
        a.option_strings[0]: (a.default, a.choices, a.help, type(a).__name__)
        for a in parser._actions
        if a.option_strings and a.option_strings[0] != "-h"
    }


def test_one_flag_table_for_both_clis():
    jax_opts, torch_opts = _options(build_parser("jax")), _options(build_parser("torch"))
    shared = {f.name for f in FLAGS if len(f.frameworks) == 2}
    assert {k: jax_opts[k] for k in shared} == {k: torch_opts[k] for k in shared}
    assert set(jax_opts) - shared == {"--mesh", "--coordinator", "--num-processes", "--process-id"}
    assert set(torch_opts) - shared == {"--compile", "--parallel", "--pp-stages", "--num-workers"}
    conventions = (
        "--preset --config-json --init --data --seq-len --batch-size --grad-accum --steps --lr --warmup "
        "--schedule --optimizer --weight-decay --clip-grad --precision --remat --attention --seed "
        "--checkpoint-dir --checkpoint-every --resume --log-json --profile"
    ).split()
    assert set(conventions) <= shared


# (argv, frameworks, regex the message must match)
BAD = [
    (["--steps", "0"], "both", r"--steps 0: must be an integer >= 1"),
    (["--steps", "ten"], "both", r"--steps: invalid int value: 'ten'"),
    (["--seq-len", "-4"], "both", r"--seq-len -4: must be an integer >= 1"),
    (["--seq-len", "512"], "both", r"--seq-len 512: exceeds the model's max_seq_len=256"),
    (["--batch-size", "0"], "both", r"--batch-size 0: must be an integer >= 1"),
    (["--batch-size", "6", "--grad-accum", "4"], "both", r"--grad-accum 4 must divide --batch-size 6"),
    (["--grad-accum", "0"], "both", r"--grad-accum 0: must be an integer >= 1"),
    (["--lr", "0"], "both", r"--lr 0.0: must be a finite float > 0"),
    (["--lr", "nan"], "both", r"--lr nan: must be a finite float > 0"),
    (["--warmup", "200", "--steps", "100"], "both", r"--warmup 200 must not exceed --steps 100"),
    (["--warmup", "-1"], "both", r"--warmup -1: must be an integer >= 0"),
    (["--schedule", "step"], "both", r"--schedule: invalid choice: 'step' \(choose from constant, linear, cosine"),
    (["--optimizer", "sgd"], "both", r"--optimizer: invalid choice: 'sgd' \(choose from adamw, adamw_fused"),
    (["--weight-decay", "-0.1"], "both", r"--weight-decay -0.1: must be a finite float >= 0"),
    (["--clip-grad", "-1"], "both", r"--clip-grad -1.0: must be a finite float >= 0"),
    (["--precision", "fp8"], "both", r"--precision: invalid choice: 'fp8' \(choose from fp32, bf16, fp16"),
    (["--matmul-precision", "low"], "both", r"--matmul-precision: invalid choice: 'low'"),
    (["--remat", "dots"], "both", r"--remat: invalid choice: 'dots' \(choose from none, full, save_dots"),
    (["--attention", "flash,nope"], "both", r"--attention 'flash,nope': expected .* attention backends from"),
    (["--attention", "xla,xla"], "both", r"--attention 'xla,xla': expected comma-separated, non-repeated"),
    (["--attention", "mosaic"], "torch", r"--attention 'mosaic': expected .*torch attention backends from xla"),
    (["--preset", "2b"], "both", r"--preset: invalid choice: '2b'"),
    (["--seed", "-1"], "both", r"--seed -1: must be an integer >= 0"),
    (["--seed", str(2**32)], "both", r"--seed 4294967296: must be in \[0, 2\*\*32\)"),
    (["--data", "/no/such/file.txt"], "both", r"--data '/no/such/file.txt': no such file or folder"),
    (["--eval-data", "/no/such/file.txt"], "both", r"--eval-data '/no/such/file.txt': no such file or folder"),
    (["--eval-data", "synthetic"], "both", r"--eval-data 'synthetic': no such file or folder; use a text file"),
    (["--eval-every", "5"], "both", r"--eval-every 5 needs --eval-data PATH"),
    (["--eval-every", "-1", "--eval-data", "README.md"], "both", r"--eval-every -1: must be an integer >= 0"),
    (["--eval-data", "README.md", "--log-json", "README.md"], "both", r"--log-json 'README.md' would overwrite"),
    (["--packing", "zip"], "both", r"--packing: invalid choice: 'zip' \(choose from pack, bucket\)"),
    (["--init", "/no/such/dir"], "both", r"--init '/no/such/dir': no such directory"),
    (["--config-json", "/no/such.json"], "both", r"--config-json '/no/such.json': no such file"),
    (["--resume"], "both", r"--resume needs --checkpoint-dir DIR"),
    (["--checkpoint-every", "5"], "both", r"--checkpoint-every 5 needs --checkpoint-dir DIR"),
    (["--checkpoint-every", "-5"], "both", r"--checkpoint-every -5: must be an integer >= 0"),
    (["--keep-checkpoints", "0"], "both", r"--keep-checkpoints 0: must be an integer >= 1"),
    (["--mesh", "data=2,pipe=2"], "jax", r"--mesh 'data=2,pipe=2': axis 'pipe' is unknown or repeated"),
    (["--mesh", "data"], "jax", r"--mesh 'data': expected comma-separated AXIS=N"),
    (["--mesh", "data=1"], "torch", r"unrecognized arguments: --mesh data=1"),
    (["--compile"], "jax", r"unrecognized arguments: --compile"),
    (
        ["--coordinator", "h:1"],
        "jax",
        r"multi-process run needs --coordinator, --num-processes and --process-id .*"
        r"missing --num-processes, --process-id",
    ),
    (
        ["--coordinator", "h", "--num-processes", "2", "--process-id", "0", "--mesh", "data=8"],
        "jax",
        r"--coordinator 'h': expected HOST:PORT",
    ),
    (
        ["--coordinator", "h:1", "--num-processes", "2", "--process-id", "2", "--mesh", "data=8"],
        "jax",
        r"--process-id 2: must be in \[0, --num-processes 2\)",
    ),
    (
        ["--coordinator", "h:1", "--num-processes", "0", "--process-id", "0"],
        "jax",
        r"--num-processes 0: must be an integer >= 1",
    ),
    (
        ["--coordinator", "h:1", "--num-processes", "2", "--process-id", "1"],
        "jax",
        r"--num-processes 2: a multi-process run needs --mesh",
    ),
    (["--process-id", "0"], "torch", r"unrecognized arguments: --process-id 0"),
    (["--offload-optimizer"], "jax", r"--offload-optimizer needs --mesh"),
    (["--offload-optimizer", "--parallel", "ddp"], "torch", r"--offload-optimizer needs --parallel fsdp or fsdp\+tp"),
    (
        ["--optimizer", "adafactor", "--parallel", "fsdp"],
        "torch",
        r"--optimizer adafactor does not run with --parallel fsdp in torchref: .*Adafactor.*use --parallel ddp or pp",
    ),
    (
        ["--optimizer", "adamw8bit", "--parallel", "ep+fsdp"],
        "torch",
        r"--optimizer adamw8bit does not run with --parallel ep\+fsdp in torchref: .*AdamW8bit.*use --parallel ddp "
        r"or pp or fsdp, .*runs adamw8bit on any",
    ),
    (
        ["--parallel", "zero"],
        "torch",
        r"--parallel: invalid choice: 'zero' \(choose from ddp, fsdp, tp, fsdp\+tp, ep, ep\+fsdp, pp, pp\+fsdp, "
        r"pp\+tp\)",
    ),
    (["--num-workers", "-1"], "torch", r"--num-workers -1: must be an integer >= 0"),
    (["--stpes", "3"], "both", r"unrecognized arguments: --stpes 3"),
]


@pytest.mark.parametrize("argv,frameworks,message", BAD, ids=[" ".join(b[0])[:40] for b in BAD])
def test_bad_flag_values_are_clear_errors_before_any_build(argv, frameworks, message):
    for fw in ("jax", "torch") if frameworks == "both" else (frameworks,):
        with pytest.raises(CLIError) as e:
            parse_args(argv, fw, JAX_BACKENDS if fw == "jax" else TORCH_BACKENDS)
        # argparse quotes the choices from Python 3.12.8 on ("choose from 'a', 'b'"), older versions do not
        text = re.sub(r"\(choose from [^)]*\)", lambda m: m.group(0).replace("'", ""), str(e.value))
        assert re.search(message, text), text


def test_torchrun_without_parallel_is_refused(monkeypatch, tmp_path):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    for parallel in ("ddp", "fsdp"):  # outside torchrun the flag would be silently ignored: refused
        with pytest.raises(CLIError, match=rf"--parallel {parallel} runs under torchrun .* drop the flag"):
            parse_args(["--parallel", parallel], "torch", TORCH_BACKENDS)
    monkeypatch.setenv("WORLD_SIZE", "2")
    ck, prof = str(tmp_path / "ck"), str(tmp_path / "p")
    parse_args(["--parallel", "fsdp+tp", "--checkpoint-dir", ck, "--profile", prof], "torch", TORCH_BACKENDS)
    assert not os.path.exists(ck) and not os.path.exists(prof)  # the writability probe leaves nothing behind
    with pytest.raises(
        CLIError,
        match=r"under torchrun with WORLD_SIZE=2 needs --parallel \{ddp,fsdp,tp,fsdp\+tp,ep,ep\+fsdp,pp,pp\+fsdp,"
        r"pp\+tp\}",
    ):
        parse_args([], "torch", TORCH_BACKENDS)


def test_main_exits_2_with_the_message(tmp_path, capsys):
    bad_cfg = tmp_path / "c.json"
    bad_cfg.write_text(json.dumps({"dim": 64, "colour": "red"}))
    np.save(tmp_path / "ids.npy", np.array([1, 2, 999]))
    cases = [
        (["--lr", "-1"], r"error: --lr -1.0: must be a finite float > 0"),
        (["--config-json", str(bad_cfg)], r"error: --config-json .*c\.json.*colour"),
        (["--data", str(tmp_path / "ids.npy")], r"error: --data .*ids\.npy.*vocab_size=256.*999"),
        (
            ["--resume", "--checkpoint-dir", str(tmp_path / "none")],
            r"error: --checkpoint-dir .*none'.*no such directory to --resume from",
        ),
        (
            ["--resume", "--checkpoint-dir", str(tmp_path)],
            r"error: --resume: --checkpoint-dir .* holds no training run of ours",
        ),
    ]
    for main, prog in ((jtrainer.main, "jaxattn.train"), (ttrainer.main, "torchref.train")):
        for argv, message in cases:
            assert main(argv + SMALL) == 2
            err = capsys.readouterr().err
            assert prog in err and re.search(message, err), err


class _Writes:
    """A stderr that records each write call (torchrun's ranks share one pipe: a line written in two calls can
    have another rank's line between its text and its newline)."""

    def __init__(self):
        self.calls: list[str] = []

    def write(self, s):
        self.calls.append(s)
        return len(s)

    def flush(self):
        pass


def test_main_writes_each_error_line_in_one_call(monkeypatch, tmp_path):
    """Several ranks' one-line errors (torchrun, several JAX processes) stay one per line: each is one write
    holding its newline (print writes the text and the newline in two calls to an unbuffered stderr)."""
    from twincore.cli import TrainingError, cli_main

    def fails(exc):
        def raise_(_):
            raise exc

        return raise_

    for prepare, train, code in (
        (fails(CLIError("--lr -1: bad")), None, 2),
        (lambda argv: None, fails(TrainingError("training diverged")), 1),
    ):
        err = _Writes()
        monkeypatch.setattr("sys.stderr", err)
        assert cli_main("prog", prepare, train, []) == code
        assert len(err.calls) == 1 and err.calls[0].startswith("prog: error: ") and err.calls[0].endswith("\n")


def _both(argv):
    a = jtrainer.run(argv)
    b = ttrainer.run(argv + ["--num-workers", "0"])
    return np.array(a["losses"]), np.array(b["losses"]), a


# accum2-remat-full (14 s): torch vs JAX with accumulation is test_grad_accum's, remat test_remat's; the CLI pair over
# 30 steps with both flags runs in CI's slow_feature run
@pytest.mark.parametrize(
    "extra",
    [[], pytest.param(["--grad-accum", "2", "--remat", "full"], marks=(pytest.mark.slow, pytest.mark.slow_feature))],
    ids=["plain", "accum2-remat-full"],
)
def test_cross_framework_losses_agree_over_30_steps(init_dir, tmp_path, extra):
    """Twin CLIs from one --init checkpoint, README.md as byte-level text, fp32: max |loss_jax - loss_torch| over
    30 steps <= 1e-4 (a per-step loss is a full-model forward, so 1e-4 is the §7 fp32 logits rule)."""
    argv = (
        [
            "--init",
            str(init_dir),
            "--data",
            "README.md",
            "--steps",
            "30",
            "--lr",
            "3e-3",
            "--warmup",
            "3",
            "--precision",
            "fp32",
            "--optimizer",
            "adamw",
            "--seed",
            "0",
        ]
        + SMALL
        + extra
    )
    jl, tl, _ = _both(argv + ["--log-json", str(tmp_path / "log.jsonl")])
    assert len(jl) == len(tl) == 30
    np.testing.assert_allclose(jl, tl, rtol=0, atol=1e-4)
    assert jl[-5:].mean() < jl[:5].mean() - 0.5  # it trains
    log = read_log(str(tmp_path / "log.jsonl"))  # torch ran last and wrote the file
    assert [r["step"] for r in log] == list(range(1, 31)) and all(tuple(r) == KEYS for r in log)
    assert log[0]["lr"] == 0.0 and log[3]["lr"] == pytest.approx(3e-3 * 0.5 * (1 + np.cos(np.pi * 0 / 27)))


@pytest.mark.slow
@pytest.mark.slow_feature
def test_same_seed_twice_gives_identical_losses(tmp_path):
    argv = ["--steps", "5", "--seed", "5", "--lr", "1e-3"] + SMALL
    for fw in (jtrainer, ttrainer):
        extra = ["--num-workers", "0"] if fw is ttrainer else []
        first = fw.run(argv + extra + ["--profile", str(tmp_path / fw.__name__)])["losses"]
        assert first == fw.run(argv + extra)["losses"]
    assert list((tmp_path / "jaxattn.train").rglob("*.xplane.pb")), "no JAX trace written"
    assert list((tmp_path / "torchref.train").rglob("*.pt.trace.json")), "no torch trace written"


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_low_precision_runs_of_both_clis_train(precision):
    """bf16 (autocast vs the JAX policy) and fp16 (+ GradScaler / DynamicLossScale) both train in both CLIs."""
    argv = ["--steps", "12", "--precision", precision, "--lr", "3e-3", "--data", "README.md"] + SMALL
    jl, tl, _ = _both(argv)
    for losses in (jl, tl):
        assert np.isfinite(losses).all() and losses[-3:].mean() < losses[:3].mean() - 0.3


def test_bucket_packing_compiles_once_per_bucket():
    from twincore.data import Dataset

    argv = ["--steps", "5", "--packing", "bucket", "--seq-len", "32", "--batch-size", "2", "--no-progress"]
    out = jtrainer.run(argv)
    ds = Dataset.from_source("synthetic", seq_len=32, batch_size=2, seed=0, packing="bucket")
    widths = {ds.batch(i)["tokens"].shape[1] for i in range(5)}
    assert len(widths) >= 2  # the test means something
    assert out["compiles"] == len(widths)


def test_final_export_loads_in_transformers(init_dir, tmp_path):
    transformers = pytest.importorskip("transformers")
    from torchref.hf import from_pretrained

    out = jtrainer.run(["--init", str(init_dir), "--steps", "2", "--checkpoint-dir", str(tmp_path)] + SMALL)
    ours = from_pretrained(out["final"]).eval()
    theirs = transformers.LlamaForCausalLM.from_pretrained(out["final"]).eval()
    ids = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        np.testing.assert_allclose(theirs(ids).logits.numpy(), ours(ids).numpy(), rtol=0, atol=1e-4)


def test_both_trainers_report_a_step_time_breakdown():
    """Both loops time the same phases with ``twincore.timing.StepTimer`` (first step left out: compilation): data
    (waiting for the loader), dispatch (the step call) and metrics (reading the loss back); no phase adds a sync."""
    from jaxattn import train as jt
    from torchref import train as tt

    argv = ["--steps", "4", "--seq-len", "16", "--batch-size", "2", "--no-progress"]
    for out in (jt.run(argv), tt.run(argv + ["--num-workers", "0"])):
        phases = out["phases"]
        assert list(phases) == ["data", "dispatch", "metrics"], phases
        assert phases["data"]["iters"] == phases["dispatch"]["iters"] == 3
        assert all(v["median_s"] >= 0 and v["total_s"] > 0 for v in phases.values())


def test_forward_only_backend_not_offered_for_training():
    """``flash_decode`` (the split-K decode kernel) has no gradient: the JAX trainer refuses it at parse time."""
    from jaxattn import train as jt

    with pytest.raises(
        CLIError,
        match=r"--attention 'flash_decode': expected .* jax attention backends from "
        r"flash, mosaic, splash, cudnn, chunked, xla",
    ):
        jt.Trainer.from_argv(["--attention", "flash_decode", "--steps", "1"])


def test_one_trainer_serves_both_twins():
    """Both CLIs' trainers are twincore's Trainer: the loop, the save, the resume checks and the data are written
    once there, and neither twin overrides them (each supplies only its framework's hooks)."""
    from twincore.trainer import Trainer

    shared = (
        "fit",
        "save",
        "meta",
        "resume_step",
        "check_resume",
        "eval_due",
        "_load_data",
        "_finish",
        "from_argv",
        "run",
    )
    for twin in (jtrainer.Trainer, ttrainer.Trainer):
        assert issubclass(twin, Trainer)
        assert [name for name in shared if name in vars(twin)] == [], twin
    assert jtrainer.Trainer.METRICS_LAG == 1 and ttrainer.Trainer.METRICS_LAG == 0


def test_attention_flag_is_parsed_once_into_one_choice():
    """``--attention`` is parsed and checked once, in the flag check: the trainer holds that AttentionChoice (the
    names, in order; its text in the checkpoint's JSON flags) and enters it around the loop, where each twin's
    dispatcher reads the same names; a malformed list never gets past the parse."""
    import pickle

    import jaxattn.attention as jattn
    import torchref.attention as tattn
    from twincore.attention import AttentionChoice

    args, _ = parse_args(["--attention", " chunked , xla", "--steps", "1"], "jax", jtrainer.TRAIN_BACKENDS)
    assert isinstance(args.attention, AttentionChoice) and args.attention == "chunked,xla"
    assert args.attention.names == ("chunked", "xla") and args.attention.framework == "jax"
    assert json.loads(json.dumps(vars(args)))["attention"] == "chunked,xla"
    assert pickle.loads(pickle.dumps(args.attention)).names == ("chunked", "xla")
    with jattn.attention_backend(args.attention) as names:
        assert names == ("chunked", "xla") and jattn.current_backends() == names
    with tattn.attention_backend(args.attention) as names:  # made for jax: torch's table checks it again
        assert names == ("chunked", "xla")
    mosaic = AttentionChoice(("mosaic", "xla"), "jax")
    with pytest.raises(ValueError, match=r"'mosaic' .* has no torch twin"):
        with tattn.attention_backend(mosaic):
            pass
    with pytest.raises(CLIError, match=r"--attention 'xla,,flash': expected comma-separated"):
        parse_args(["--attention", "xla,,flash"], "torch", ttrainer.BACKENDS)
    with pytest.raises(ValueError, match=r"--attention: \['flash_decode'\] not offered here"):
        AttentionChoice(("flash_decode",), "jax", "--attention", allowed=jtrainer.TRAIN_BACKENDS)
