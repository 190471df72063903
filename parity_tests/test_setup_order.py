"""The README's two set-up commands, in order, on a clone: the main job changes no tracked file, then the tests pass.

The main job (``python -m benchmarks run --quick``) and every other benchmarks command write to the git-ignored
``benchmarks/results/local/`` unless ``--out`` says otherwise, so the test that reads the committed JSON
(``test_readme.py``) still passes after it. The copy is "clone-like": the tracked files of this working tree (with
their uncommitted edits, and new files git would track) in a fresh git repository, so ``git status`` there shows
exactly what the command changed.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def setup_commands(text: str | None = None) -> list[str]:
    """The two bash commands of README.md's "Set up" section, in order."""
    if text is None:
        with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
            text = f.read()
    section = text.split("## Set up", 1)[1].split("\n## ", 1)[0]
    return [block.strip() for block in re.findall(r"^```bash\n(.*?)^```$", section, re.S | re.M)]


def _python_part(command: str) -> list[str]:
    """The last ``&&``-step of a set-up command (after the venv and installs), as argv for this interpreter."""
    step = command.split("&&")[-1].split()
    assert step[:2] == ["python", "-m"], command
    return [sys.executable, *step[1:]]


def _git(cwd: str, *args: str) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t"}
    env["GIT_COMMITTER_EMAIL"] = "t@t"
    return subprocess.run(["git", *args], cwd=cwd, env=env, check=True, capture_output=True, text=True).stdout


def _needs_git():
    if (
        shutil.which("git") is None
        or not os.path.isdir(os.path.join(ROOT, ".git"))
        and not os.path.isfile(os.path.join(ROOT, ".git"))
    ):
        pytest.skip("not a git checkout (the set-up order is about a clone's tracked files)")


@pytest.fixture
def clone(tmp_path):
    """A fresh git repository holding this working tree's files that git tracks or would track, committed."""
    _needs_git()
    dst = tmp_path / "clone"
    for rel in _git(ROOT, "ls-files", "-z", "--cached", "--others", "--exclude-standard").split("\0"):
        src = os.path.join(ROOT, rel)
        if rel and os.path.isfile(src):
            os.makedirs(dst / os.path.dirname(rel), exist_ok=True)
            shutil.copy2(src, dst / rel)
    _git(str(dst), "init", "-q")
    _git(str(dst), "add", "-A")
    _git(str(dst), "commit", "-q", "-m", "snapshot")
    return str(dst)


def _run(argv: list[str], cwd: str, timeout: int) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": cwd, "JAX_SKIP_CUDA_CONSTRAINTS_CHECK": "1"}
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def test_readme_sets_up_with_the_main_job_then_the_ci_test_command():
    main_job, tests = setup_commands()
    assert _python_part(main_job)[1:] == ["-m", "benchmarks", "run", "--quick"]
    with open(os.path.join(ROOT, ".ci", "run")) as f:
        ci_tests = [line.strip() for line in f.read().splitlines() if "pytest" in line and not line.startswith("#")]
    # the README's test command is what CI runs, once per set (the pinned set and Python 3.12's newest jax), and on
    # the pinned set then the slow tests that hold a feature row's only coverage (the README's table says so)
    readme = tests.split("&&")[-1].strip()
    assert ci_tests == [readme, f"{readme} -m slow_feature", readme]


def test_every_benchmarks_default_output_is_ignored_by_git():
    _needs_git()
    from benchmarks import measure
    from benchmarks.report.records import LOCAL_DIR, RESULTS_DIR, default_out
    from benchmarks.tools import train_example

    defaults = [default_out(measure.device_slug({"jax_device": "cpu (x86_64)"}) + "-quick"), train_example.DEFAULT_OUT]
    defaults += [default_out("h100-compiled"), default_out("nvidia-h100-80gb-hbm3")]
    for path in defaults:
        assert os.path.commonpath([path, str(LOCAL_DIR)]) == str(LOCAL_DIR), path
        rel = os.path.relpath(os.path.join(path, "report.md"), ROOT)
        assert subprocess.run(["git", "check-ignore", "-q", rel], cwd=ROOT).returncode == 0, f"{rel} is not ignored"
    committed = os.path.relpath(os.path.join(RESULTS_DIR, "cpu-quick", "report.md"), ROOT)
    assert subprocess.run(["git", "check-ignore", "-q", committed], cwd=ROOT).returncode == 1  # the check can fail


def _main_job_then_tests(clone: str, main_job: list[str], timeout: int) -> None:
    proc = _run(main_job, clone, timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "benchmarks/results/local/" in proc.stdout  # it says where it wrote
    assert os.path.isfile(os.path.join(clone, "benchmarks", "results", "local", "cpu-quick", "report.md"))
    assert _git(clone, "status", "--porcelain") == "", "the main job changed files git tracks or does not ignore"
    proc = _run([sys.executable, "-m", "pytest", "-q", "-p", "no:warnings", "parity_tests/test_readme.py"], clone, 300)
    assert proc.returncode == 0, proc.stdout[-3000:]


def test_main_job_then_tests_in_a_clone(clone):
    """The README's order with the main job cut to one suite and one of its presets (the other suites and presets
    write the same way): seconds, not minutes, in the default suite; the whole main job as written is the ``slow``
    test below, and the model suite's MoE preset ``test_benchmarks.test_main_job_model_suite``. What the model suite
    wrote is checked too (``test_benchmarks.check_model_suite_output``)."""
    from parity_tests.test_benchmarks import check_model_suite_output

    _main_job_then_tests(clone, _python_part(setup_commands()[0]) + ["--suite", "model", "--preset", "tiny"], 600)
    check_model_suite_output(Path(clone) / "benchmarks" / "results" / "local" / "cpu-quick", presets={"tiny"})


@pytest.mark.slow
def test_main_job_as_written_then_tests_in_a_clone(clone):
    _main_job_then_tests(clone, _python_part(setup_commands()[0]), 3600)
