"""The main job (``python -m benchmarks run --quick``) writes well-formed records; the FLOP convention and the
side-by-side table are right."""
import json

import pytest

pytest.importorskip("torch")

from benchmarks import __main__ as cli  # noqa: E402
from benchmarks import common  # noqa: E402


def test_flops_convention():
    # FlashAttention: forward 4*B*H*Sq*Sk*D, halved when causal; forward+backward 3.5x forward
    assert common.attention_flops(2, 8, 1024, 1024, 128, causal=False) == 4 * 2 * 8 * 1024 * 1024 * 128
    assert common.attention_flops(2, 8, 1024, 1024, 128, causal=True) == 2 * 2 * 8 * 1024 * 1024 * 128
    assert common.attention_flops(1, 1, 4, 4, 2, causal=False, backward=True) == 3.5 * 4 * 4 * 4 * 2


def test_report_table_ratio():
    recs = [{"suite": "x", "S": 8, "pass": "fwd", "impl": "a", "framework": "jax", "median_ms": 2.0},
            {"suite": "x", "S": 8, "pass": "fwd", "impl": "b", "framework": "torch", "median_ms": 3.0},
            {"suite": "x", "S": 8, "pass": "fwd", "impl": "c", "framework": "torch", "median_ms": 1.0, "status": "skipped"}]
    table = common.report_table(recs)
    assert "1.50x" in table and "| S | pass | jax:a | torch:b | torch:c | torch/jax |" in table


def test_timeit_rejects_bad_counts():
    with pytest.raises(ValueError, match="iters"):
        common.timeit(lambda: None, iters=0)


def test_main_job_model_suite(tmp_path):
    assert cli.main(["run", "--suite", "model", "--quick", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "model.json").read_text())
    assert data["env"]["jax"] and data["env"]["torch"] and data["env"]["jax_device"]
    recs = data["records"]
    assert {(r["framework"], r["pass"]) for r in recs} == {("jax", "fwd"), ("jax", "fwd_bwd"), ("torch", "fwd"),
                                                            ("torch", "fwd_bwd")}
    for r in recs:
        assert r["status"] == "ok" and r["iters"] >= 20 and 0 < r["p10_ms"] <= r["median_ms"] <= r["p90_ms"]
        assert r["max_abs_diff"] <= 1e-4 and r["tokens_per_s"] > 0
    assert "torch/jax" in (tmp_path / "report.md").read_text()
