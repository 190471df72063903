"""Smoke test of the train benchmark suite (``benchmarks/suites/train.py``): the record format on a two-toggle subset
of the --quick shapes, the MFU peak lookup, and the FLOPs count."""

from __future__ import annotations

import json
import math

import pytest

from benchmarks.report import records as result_files
from benchmarks.report import tables
from benchmarks.suites import peaks, train


def test_peaks_table():
    assert peaks.peak_flops("NVIDIA H100 80GB HBM3") == (989e12, None)
    assert peaks.peak_flops("NVIDIA H200")[0] == 989e12
    assert peaks.peak_flops("NVIDIA A100-SXM4-80GB")[0] == 312e12
    peak, why = peaks.peak_flops("cpu (x86_64)")
    assert peak is None and "CPU" in why
    assert peaks.mfu(1e9, 1e3, None) is None
    assert peaks.mfu(1e9, 1e3, 1e13) == pytest.approx(0.1)


def test_flops_per_token_counts_matmul_params():
    """One FLOP formula (``twincore.flops``) for the train suite and the compile tool: 6·N per token for the N
    parameters in a matmul (the model's parameters but the embedding lookup's table and the norms) + attention."""
    from torchref.config import ModelConfig
    from torchref.model import LlamaForCausalLM
    from twincore.flops import flops_per_token, model_flops
    from twincore.params import matmul_param_count

    cfg = ModelConfig.preset("tiny")
    named = dict(LlamaForCausalLM(cfg).named_parameters())
    n = sum(p.numel() for k, p in named.items() if not k.endswith("norm.weight") and "embed_tokens" not in k)
    assert matmul_param_count(cfg) == n
    fpt = flops_per_token(cfg, 128)
    assert fpt > 6 * n and fpt == model_flops(cfg, 2, 128, train=True)["model_flops"] / 256
    # an MoE counts the experts a token runs through: moe-tiny's 2 of 4, plus its router
    moe = ModelConfig.preset("moe-tiny")
    named = dict(LlamaForCausalLM(moe).named_parameters())
    per_expert = sum(p[0].numel() for k, p in named.items() if ".experts." in k)
    active = sum(p.numel() for k, p in named.items() if not k.endswith("norm.weight") and "embed_tokens" not in k)
    active -= (moe.n_experts - moe.experts_per_token) * per_expert
    assert model_flops(moe, 1, 128, train=True)["matmul_params"] == active


def test_unknown_toggle_is_refused():
    with pytest.raises(ValueError, match="unknown train toggle"):
        train.run(quick=True, toggles=["nope"])


@pytest.mark.slow  # 25 s: the train suite's quick rows, both twins; CI runs it (slow_feature) and the GPU-session
@pytest.mark.slow_feature  # rehearsal runs the suite itself
def test_quick_records_format(tmp_path):
    records = train.run(quick=True, toggles=["grad_accum2", "moe_capacity"], log=lambda *a: None)
    assert [(r["toggle"], r["framework"]) for r in records] == [
        ("grad_accum2", "jax"),
        ("grad_accum2", "torch"),
        ("moe_capacity", "jax"),
        ("moe_capacity", "torch"),
    ]
    for r in records:
        assert r["suite"] == "train" and r["status"] == "ok", r.get("reason")
        assert r["iters"] >= 5 and r["median_ms"] > 0
        assert r["tokens_per_s"] == pytest.approx(r["B"] * r["S"] / (r["median_ms"] / 1e3))
        m = r["measured"]
        assert m["first_step_s"] > 0 and math.isfinite(m["final_loss"])
        assert m["grad_accum"] == (2 if r["toggle"] == "grad_accum2" else 1)
        assert m["precision"] == "fp32" and m["remat"] == "none" and m["optimizer"] == "adamw"
        moe = r["toggle"] == "moe_capacity"
        assert r["preset"] == ("moe-tiny" if moe else "tiny") and m["capacity_factor"] == (1.25 if moe else None)
        assert (m["active_params"] < m["n_params"]) == moe  # 2 of 4 experts per token
        assert ("aux_loss" in m and "dropped_fraction" in m) == moe
        if m["peak_flops"] is None:
            assert r["mfu"] is None and m["mfu_reason"]
        else:
            assert 0 < r["mfu"] < 1
    # the MoE twins start from one set of weights and drop the same tokens on the first steps
    j, t = (r["measured"] for r in records[2:])
    assert j["final_loss"] == pytest.approx(t["final_loss"], abs=1e-4)
    assert 0 < j["dropped_fraction"] == pytest.approx(t["dropped_fraction"], abs=1e-6)
    # the records go through the suite writer and the report table like every other suite
    result_files.write_results(str(tmp_path), "train", records, {"jax_device": "test"})
    assert json.loads((tmp_path / "train.json").read_text())["records"][0]["toggle"] == "grad_accum2"
    table = tables.report_table(records)
    assert "| grad_accum2 | tiny |" in table and "| moe_capacity | moe-tiny |" in table
