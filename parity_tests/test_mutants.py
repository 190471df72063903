"""The mutation check itself (``parity_tests/mutants.py``): its list still fits the code, it covers the areas the
project promises, it tells caught from missed, and it never touches the checkout. Its full run (~15 min) is not a
test; its last table is in ``parity_tests/README.md``, which this file keeps in step with the list."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from parity_tests import mutants

AREAS = {
    "moe",
    "pipeline",
    "fused loss",
    "attention",
    "debugger",
    "statistics",
    "training",
    "data",
    "model",
    "records",
}


def test_every_mutant_applies_to_this_tree_and_names_real_tests():
    assert [p for x in mutants.MUTANTS for p in mutants.check_mutant(x, mutants.ROOT)] == []
    names = [x.name for x in mutants.MUTANTS]
    assert len(names) == len(set(names)) >= 25
    assert {x.area for x in mutants.MUTANTS} == AREAS
    assert all(x.why and x.tests and x.edits for x in mutants.MUTANTS)


def test_check_names_an_edit_that_does_not_fit(tmp_path):
    (tmp_path / "a.py").write_text("x = 1\nx = 1\n")
    twice = mutants.m("twice", "model", "a.py", "x = 1", "x = 2", "parity_tests/test_nothing.py", "why")
    gone = mutants.m("gone", "model", "b.py", "x", "y", "t.py", "why")
    same = mutants.m("same", "model", "a.py", "x = 1\nx = 1", "x = 1\nx = 1", "t.py", "why")
    assert mutants.check_mutant(twice, tmp_path) == [
        "twice: a.py has 2 copies of 'x = 1' (needs exactly 1)",
        "twice: test file parity_tests/test_nothing.py does not exist",
    ]
    assert mutants.check_mutant(gone, tmp_path)[0] == "gone: b.py does not exist"
    assert "same: an edit of a.py changes nothing" in mutants.check_mutant(same, tmp_path)


def test_bad_arguments_exit_2_naming_them(capsys):
    for argv, words in ((["--only", "nope"], "unknown mutant or area ['nope']"), (["--jobs", "0"], "--jobs")):
        with pytest.raises(SystemExit) as e:
            mutants.main(argv)
        assert e.value.code == 2 and words in capsys.readouterr().err


def test_caught_missed_and_error_are_told_apart_and_every_edit_is_undone(tmp_path):
    """On a two-file project (no jax: a second each): a bug its test sees is caught, a harmless edit is missed, a
    selection of no test is an error (never caught), and the file is the same bytes after each."""
    (tmp_path / "calc.py").write_text("def mean(xs):\n    return sum(xs) / len(xs)  # the mean\n")
    (tmp_path / "test_calc.py").write_text(
        "from calc import mean\n\n\ndef test_mean():\n    assert mean([1, 3]) == 2\n"
    )
    stamp = (tmp_path / "calc.py").read_bytes()
    cases = {
        "caught": ("sum(xs) / len(xs)", "sum(xs) / (len(xs) - 1)", "test_calc.py"),
        "missed": ("# the mean", "# the average", "test_calc.py"),
        "error": ("sum(xs) / len(xs)", "sum(xs) / (len(xs) - 1)", "test_calc.py -k nothing_matches"),
    }
    for want, (old, new, tests) in cases.items():
        r = mutants.run_mutant(mutants.m(want, "model", "calc.py", old, new, tests, "why"), tmp_path, timeout=120)
        assert r["verdict"] == want, r
        assert (tmp_path / "calc.py").read_bytes() == stamp
    assert (
        "test_calc.py::test_mean"
        in mutants.run_mutant(
            mutants.m("c", "model", "calc.py", "/ len(xs)", "/ 3", "test_calc.py", "why"), tmp_path, timeout=120
        )["detail"]
    )


@pytest.mark.slow  # ~30 s: a copy of the repository and two pytest runs that import jax
def test_a_planted_bug_is_caught_a_harmless_edit_is_missed_and_the_checkout_is_untouched(tmp_path):
    """One real mutant end to end through ``main`` (its tests fail: caught, exit 0), then a harmless edit (a
    comment) with the same tests: missed. The checkout's files are the same bytes before and after."""
    before = subprocess.run(["git", "status", "--porcelain"], cwd=mutants.ROOT, capture_output=True, text=True).stdout
    stamp = (mutants.ROOT / "twincore/timing.py").read_bytes()
    out = tmp_path / "r.json"
    assert (
        mutants.main(["--only", "stats-median-ci-index", "--json", str(out), "--markdown", str(tmp_path / "r.md")]) == 0
    )
    (r,) = json.loads(out.read_text())["results"]
    assert r["verdict"] == "caught" and "test_median_ci" in r["detail"]
    assert "| `stats-median-ci-index` | statistics | caught |" in (tmp_path / "r.md").read_text()

    harmless = mutants.m(
        "harmless",
        "statistics",
        "twincore/timing.py",
        "# ... or when either side's per-round times",
        "# ... or when either side's per-round durations",
        "parity_tests/test_profiling.py -k median_ci",
        "a comment",
    )
    copy = mutants.copy_repo(tmp_path / "copy")
    assert mutants.run_mutant(harmless, copy, timeout=300)["verdict"] == "missed"
    assert (copy / "twincore/timing.py").read_bytes() == stamp  # undone in the copy too
    assert (mutants.ROOT / "twincore/timing.py").read_bytes() == stamp
    assert (
        subprocess.run(["git", "status", "--porcelain"], cwd=mutants.ROOT, capture_output=True, text=True).stdout
        == before
    )


def test_the_readme_table_lists_every_mutant_once():
    text = (mutants.ROOT / "parity_tests/README.md").read_text()
    listed = re.findall(r"^\| `([\w-]+)` \|", text, re.M)
    assert sorted(listed) == sorted(x.name for x in mutants.MUTANTS)


def test_readme_check_and_list_commands_run_as_written():
    """``parity_tests/README.md``'s quick commands, in a subprocess as a user types them (the full run is the
    ``slow`` test above; ``--area`` runs tests like it)."""
    for argv, words in ((["--check"], "mutants apply to this tree"), (["--list"], "moe-renorm-jax")):
        out = subprocess.run(
            [sys.executable, "-m", "parity_tests.mutants", *argv], cwd=mutants.ROOT, capture_output=True, text=True
        )
        assert out.returncode == 0 and words in out.stdout, out.stderr
    assert "python -m parity_tests.mutants --check" in (mutants.ROOT / "parity_tests/README.md").read_text()
