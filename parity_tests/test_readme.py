"""README.md's results section is generated from the committed JSON (``python -m benchmarks.readme``), never typed."""

import json
import random
import statistics

import pytest

from benchmarks.report import readme


def test_results_section_matches_the_committed_json():
    with open(readme.README) as f:
        text = f.read()
    assert text == readme.splice(text, readme.render()), (
        "README.md's results section does not match the committed JSON under benchmarks/results/ (the benchmark "
        "commands write to the untracked benchmarks/results/local/ by default, so running them cannot cause this). "
        "If you changed a committed file there or the section on purpose, run `python -m benchmarks.readme` and "
        "commit README.md with the JSON; if not, `git checkout -- README.md benchmarks/results` restores both."
    )


def test_splice_replaces_only_between_the_markers_and_needs_them():
    text = f"head\n{readme.BEGIN}\nold\n{readme.END}\ntail\n"
    assert readme.splice(text, "new\n") == f"head\n{readme.BEGIN}\nnew\n{readme.END}\ntail\n"
    with pytest.raises(ValueError, match="markers"):
        readme.splice("no markers here", "x")


def _write_suite(tmp_path, suite, records, when):
    env = {
        "jax_device": "cpu (x86_64)",
        "torch_device": "cpu",
        "jax": "9.9.1",
        "torch": "8.8.2+cpu",
        "time_utc": when,
        "quick": True,
    }
    (tmp_path / f"{suite}.json").write_text(json.dumps({"env": env, "suite": suite, "records": records}))


def test_cpu_quick_section_is_built_from_the_json_with_torch_over_jax_time(tmp_path):
    """Fresh random times: the section's speed-up must be the median / min / max over the paired rows of the
    fastest torch median over the fastest JAX median (report.md's column), never JAX/torch or a mean."""
    rng = random.Random()
    recs, expected = [], []
    for s in (64, 128, 256, 512, 1024, 2048):  # an even number of paired rows: the median is a mean of two
        jax_ms = [rng.uniform(1.0, 2.0), rng.uniform(1.0, 2.0)]  # two JAX impls: the fastest counts
        torch_ms = rng.uniform(2.5, 9.0)
        recs += [
            dict(
                suite="model",
                S=s,
                **{"pass": "fwd"},
                framework="jax",
                impl="a",
                median_ms=jax_ms[0],
                tokens_per_s=s / jax_ms[0],
            ),
            dict(suite="model", S=s, **{"pass": "fwd"}, framework="jax", impl="b", median_ms=jax_ms[1]),
            dict(suite="model", S=s, **{"pass": "fwd"}, framework="torch", impl="ref", median_ms=torch_ms),
            dict(
                suite="model",
                S=s,
                **{"pass": "fwd"},
                framework="torch",
                impl="slow",
                status="skipped",
                reason="not here",
            ),
        ]
        expected.append(torch_ms / min(jax_ms))
    recs.append(dict(suite="model", S=4096, **{"pass": "fwd"}, framework="jax", impl="a", median_ms=0.5))  # unpaired
    _write_suite(tmp_path, "model", recs, "2031-01-02T03:04:05Z")
    _write_suite(
        tmp_path,
        "plan",
        [dict(suite="plan", framework="jax", impl="fsdp", mesh="fsdp=8", measured={"peak": 1})],
        "2031-01-02T03:09:00Z",
    )
    (tmp_path / "attention_tflops.png").write_bytes(b"")  # no attention JSON: not linked
    text = "\n".join(readme.cpu_quick_section(str(tmp_path)))
    row = next(line for line in text.splitlines() if line.startswith("| model |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1] == "S, pass" and cells[2] == "a, b vs ref" and cells[3] == "6 (not paired)"  # rows (unstable)
    want = f"{statistics.median(expected):.2f}× / {min(expected):.2f}× / {max(expected):.2f}×"
    assert cells[4] == want, (cells[4], want)
    assert cells[5] == "— / —" and cells[6] == "—"  # no p10/p90, no load average in these records
    assert statistics.median(expected) > 1  # torch is slower by construction: the inverse ratio would fail here
    assert "jax 9.9.1, torch 8.8.2+cpu" in text and "cpu (x86_64)" in text
    assert "runs started 2031-01-02T03:04:05Z to 2031-01-02T03:09:00Z" in text and "not a GPU result" in text
    assert "- `plan`: JAX only" in text and "attention_tflops.png" not in text
    assert readme.cpu_quick_section(str(tmp_path / "missing")) == []


def test_setup_times_come_from_the_committed_record():
    """The README's two "N min M s measured" figures are the set-up commands' seconds in
    ``benchmarks/results/setup-times/setup_times.json``, in the README's order (main job, then tests)."""
    import re

    recs = json.load(open("benchmarks/results/setup-times/setup_times.json", encoding="utf-8"))["records"]
    text = open("README.md", encoding="utf-8").read()
    quoted = [int(m) * 60 + int(sec) for m, sec in re.findall(r"(\d+) min (\d+) s measured", text)]
    assert quoted == [round(r["seconds"]) for r in recs], (quoted, [r["seconds"] for r in recs])
