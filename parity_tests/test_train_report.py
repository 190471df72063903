"""What both training CLIs report (``twincore.runlog``): the end-of-run summary, progress when stderr is piped,
``--tensorboard`` scalars.

* One subprocess per twin (stdout and stderr are pipes, not terminals), tiny, 5 steps, with ``--log-json``,
  ``--checkpoint-dir``, ``--eval-data`` and ``--tensorboard`` (where the package is installed): the summary on
  stdout names the log file, the last checkpoint and the Hugging Face export, all on disk; stderr has a plain
  progress line per step (5 steps: every step is a tenth's mark); the TensorBoard event files hold the
  ``--log-json`` numbers at steps 1..5 in both twins, and the JAX trainer imported no torch for them.
* In-process: without ``--checkpoint-dir`` the summary says the weights were NOT saved and names the flag;
  ``--no-progress`` silences the progress lines; ``run()`` (the library path) prints no summary but returns it.
* The line cadence of :class:`RunLog` (tenths, first and last step, the time floor, a resumed run's marks).
* Without the ``tensorboard`` package ``--tensorboard`` is one ``prog: error:`` line and exit 2, before anything is
  built or created.
"""

from __future__ import annotations

import importlib.util
import io
import os
import re
import subprocess
import sys

import pytest

from twincore import runlog
from twincore.cli import CLIError, parse_args
from twincore.runlog import TENSORBOARD_MISSING, RunLog, read_log

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--preset", "tiny", "--seq-len", "16", "--batch-size", "2", "--data", "README.md"]
HAS_TENSORBOARD = importlib.util.find_spec("tensorboard") is not None
PROGRESS = re.compile(r"(jax|torch) train: step (\d+)/(\d+) \(\d+%\), loss \S+, [\d,]+ tokens/s, .* elapsed")
# the subprocess's command: the twin's main; the JAX one also proves that its --tensorboard path imported no torch
CODE = {
    "jax": "import sys\nfrom jaxattn.train import main\nrc = main(sys.argv[1:])\n"
    "assert 'torch' not in sys.modules, 'the JAX trainer imported torch'\nsys.exit(rc)",
    "torch": "import sys\nfrom torchref.train import main\nsys.exit(main(sys.argv[1:]))",
}


@pytest.fixture(scope="module", params=["jax", "torch"])
def cli_run(request, tmp_path_factory):
    """One piped CLI run of a twin: ``(twin, out_dir, completed_process)``."""
    pytest.importorskip("torch")
    twin, out = request.param, tmp_path_factory.mktemp(f"report-{request.param}")
    (out / "held.txt").write_text("A small held-out text for the summary's eval line.\n" * 3)
    argv = TINY + ["--steps", "5", "--log-json", str(out / "log.jsonl"), "--checkpoint-dir", str(out / "ckpt")]
    argv += ["--eval-data", str(out / "held.txt")]
    if HAS_TENSORBOARD:
        argv += ["--tensorboard", str(out / "tb")]
    if twin == "torch":
        argv += ["--num-workers", "0"]
    env = {**os.environ, "PYTHONPATH": ROOT, "JAX_SKIP_CUDA_CONSTRAINTS_CHECK": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", CODE[twin], *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return twin, out, proc


def _summary_path(stdout: str, label: str) -> str:
    m = re.search(rf"^  {label}:\s+(\S+)", stdout, re.M)
    assert m, (label, stdout)
    return m.group(1)


def test_cli_summary_names_the_files_it_wrote(cli_run):
    twin, out, proc = cli_run
    lines = proc.stdout.strip().splitlines()
    head = rf"{twin} train: done, steps 0 -> 5 in [\d.]+ s, median [\d,]+ tokens/s; final train loss (\S+)"
    m = re.fullmatch(head, lines[0])
    assert m, proc.stdout
    log = read_log(str(out / "log.jsonl"))
    assert float(m.group(1)) == pytest.approx(log[-1]["loss"], abs=1e-4)
    last_eval = read_log(str(out / "log.jsonl"), "eval")[-1]
    assert lines[1] == (
        f"  eval after step 5: loss {last_eval['eval_loss']:.4f}, perplexity {last_eval['eval_perplexity']:.4f}"
    )
    assert _summary_path(proc.stdout, "log") == str(out / "log.jsonl")
    checkpoint, export = _summary_path(proc.stdout, "checkpoint"), _summary_path(proc.stdout, "export")
    assert os.path.dirname(checkpoint) == str(out / "ckpt") and os.path.exists(checkpoint)
    assert export == str(out / "ckpt" / "final") and os.path.isfile(os.path.join(export, "config.json"))
    assert "NOT saved" not in proc.stdout
    if HAS_TENSORBOARD:
        assert _summary_path(proc.stdout, "tensorboard") == str(out / "tb")
    assert "done" not in proc.stderr  # the summary is on stdout only


def test_piped_progress_lines(cli_run):
    twin, _, proc = cli_run
    seen = [PROGRESS.fullmatch(line) for line in proc.stderr.splitlines()]
    steps = [(m.group(1), int(m.group(2)), int(m.group(3))) for m in seen if m]
    assert steps == [(twin, s, 5) for s in range(1, 6)], proc.stderr[-3000:]


def _scalars(logdir) -> dict[str, list[tuple[int, float]]]:
    """Every scalar in the event files under ``logdir``: ``{tag: [(step, value), ...]}``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={"tensors": 0, "scalars": 0})
    acc.Reload()
    tags = acc.Tags()
    out = {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in tags["scalars"]}  # simple_value scalars
    for t in tags["tensors"]:  # tensorboard.summary.Writer's: a float32 scalar tensor per point
        out[t] = [(e.step, float(e.tensor_proto.float_val[0])) for e in acc.Tensors(t)]
    return out


@pytest.mark.skipif(not HAS_TENSORBOARD, reason="--tensorboard needs the optional 'tensorboard' package")
def test_tensorboard_scalars_read_back(cli_run):
    _, out, _ = cli_run
    got = _scalars(out / "tb")
    assert set(got) == {
        "train/loss",
        "train/grad_norm",
        "train/lr",
        "train/tokens_per_s",
        "eval/loss",
        "eval/perplexity",
    }
    log, evals = read_log(str(out / "log.jsonl")), read_log(str(out / "log.jsonl"), "eval")
    for key in ("loss", "grad_norm", "lr", "tokens_per_s"):
        assert [s for s, _ in got[f"train/{key}"]] == [1, 2, 3, 4, 5]
        assert [v for _, v in got[f"train/{key}"]] == pytest.approx([r[key] for r in log], rel=1e-6)
    assert got["eval/loss"] == [(5, pytest.approx(evals[-1]["eval_loss"], rel=1e-6))]
    assert got["eval/perplexity"] == [(5, pytest.approx(evals[-1]["eval_perplexity"], rel=1e-6))]


@pytest.mark.parametrize("twin", ["jax", "torch"])
def test_no_checkpoint_dir_says_not_saved_and_no_progress_is_quiet(twin, capsys):
    pytest.importorskip("torch")
    from jaxattn import train as jtrain
    from torchref import train as ttrain

    mod, extra = (jtrain, []) if twin == "jax" else (ttrain, ["--num-workers", "0"])
    argv = TINY + ["--steps", "2"] + extra
    assert mod.main(argv + ["--no-progress"]) == 0
    cap = capsys.readouterr()
    assert not [line for line in cap.err.splitlines() if PROGRESS.fullmatch(line)], cap.err
    lines = cap.out.strip().splitlines()
    assert lines[0].startswith(f"{twin} train: done, steps 0 -> 2 in "), cap.out
    assert lines[1:] == [
        "  the trained weights were NOT saved: give --checkpoint-dir DIR to keep checkpoints and a Hugging Face "
        "export in DIR/final"
    ]
    out = mod.run(argv + ["--no-progress"])  # the library path: the summary returned, not printed
    assert capsys.readouterr().out == ""
    s = out["summary"]
    assert (s.name, s.start, s.steps, s.train_loss) == (f"{twin} train", 0, 2, out["losses"][-1])
    assert s.final is None and s.checkpoint is None and s.log_json is None and s.eval_step is None


def _lines(monkeypatch, total, start=0, seconds=None, progress=True) -> list[int]:
    """The steps a piped :class:`RunLog` prints a progress line after."""
    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    if seconds is not None:
        monkeypatch.setattr(runlog, "PROGRESS_SECONDS", seconds)
    log = RunLog(total, start, progress=progress, desc="t")
    for step in range(start + 1, total + 1):
        log.step(
            step=step,
            loss=1.0,
            grad_norm=1.0,
            lr=1e-3,
            loss_scale=1.0,
            skipped=False,
            tokens=10,
            seconds=0.1,
            peak_mem_bytes=0,
        )
    log.close()
    return [int(m.group(1)) for m in re.finditer(r"^t: step (\d+)/", err.getvalue(), re.M)]


def test_piped_progress_cadence(monkeypatch):
    assert _lines(monkeypatch, 25) == [1, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 25]
    assert _lines(monkeypatch, 100, start=37) == [38, 40, 50, 60, 70, 80, 90, 100]  # a resumed run: the same marks
    assert _lines(monkeypatch, 7, seconds=0.0) == [1, 2, 3, 4, 5, 6, 7]  # the time floor
    assert _lines(monkeypatch, 1000, seconds=0.0)[:3] == [1, 2, 3]
    assert _lines(monkeypatch, 25, progress=False) == []


def test_tensorboard_without_the_package_is_one_error_line(monkeypatch, tmp_path, capsys):
    pytest.importorskip("torch")
    from jaxattn import train as jtrain
    from torchref import train as ttrain

    for name in [m for m in sys.modules if m == "tensorboard" or m.startswith("tensorboard.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # import tensorboard -> ImportError
    tb = tmp_path / "tb"
    for fw in ("jax", "torch"):
        with pytest.raises(CLIError, match=re.escape(TENSORBOARD_MISSING)):
            parse_args(["--tensorboard", str(tb)], fw)
    for mod, prog in ((jtrain, "python -m jaxattn.train"), (ttrain, "python -m torchref.train")):
        assert mod.main(TINY + ["--tensorboard", str(tb), "--steps", "1"]) == 2
        cap = capsys.readouterr()
        assert cap.err.splitlines() == [f"{prog}: error: {TENSORBOARD_MISSING}"] and cap.out == ""
    assert not tb.exists()
    assert TENSORBOARD_MISSING == "--tensorboard needs the 'tensorboard' package (pip install tensorboard)"
