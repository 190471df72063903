"""``benchmarks.tools.kernel_profile`` (issue 42's GPU profile) on the CPU: the XSpace reader counts a GPU plane's
stream kernels once (not again from its "XLA Ops" line, nor a host plane's events), per-call figures divide by the
calls, and the quick run times every variant against the reference with a paired ratio."""

import json
import os

import pytest

pytest.importorskip("torch")

from jax.profiler import ProfileData  # noqa: E402

from benchmarks.report import profile_tables  # noqa: E402
from benchmarks.tools import kernel_profile as kp  # noqa: E402
from twincore.flops import attention_flops  # noqa: E402

XSPACE = """
planes {
  id: 1 name: "/device:GPU:0"
  lines { id: 1 name: "Stream #13(Compute)" timestamp_ns: 1000
    events { metadata_id: 1 offset_ps: 0 duration_ps: 5000000 }
    events { metadata_id: 2 offset_ps: 6000000 duration_ps: 2000000 }
    events { metadata_id: 1 offset_ps: 9000000 duration_ps: 7000000 } }
  lines { id: 2 name: "Stream #14(MemcpyD2D)" timestamp_ns: 1000
    events { metadata_id: 3 offset_ps: 0 duration_ps: 1000000 } }
  lines { id: 3 name: "XLA Ops" timestamp_ns: 1000
    events { metadata_id: 1 offset_ps: 0 duration_ps: 5000000 } }
  event_metadata { key: 1 value { id: 1 name: "cudnn_fprop_kernel" } }
  event_metadata { key: 2 value { id: 2 name: "transpose_kernel" } }
  event_metadata { key: 3 value { id: 3 name: "memcpy" } }
}
planes {
  id: 2 name: "/host:CPU"
  lines { id: 1 name: "Stream #1" timestamp_ns: 1000 events { metadata_id: 1 offset_ps: 0 duration_ps: 9000000 } }
  event_metadata { key: 1 value { id: 1 name: "host_thing" } }
}
"""


def test_jax_reader_counts_each_stream_kernel_once(tmp_path):
    run = tmp_path / "plugins" / "profile" / "run1"
    run.mkdir(parents=True)
    (run / "host.xplane.pb").write_bytes(ProfileData.text_proto_to_serialized_xspace(XSPACE))
    got = kp.device_kernels_jax(str(tmp_path))
    assert got == {"cudnn_fprop_kernel": [2, 12000.0], "transpose_kernel": [1, 2000.0], "memcpy": [1, 1000.0]}
    rows = kp._per_call(got, calls=2)
    assert [r["kernel"] for r in rows] == ["cudnn_fprop_kernel", "transpose_kernel", "memcpy"]  # longest first
    assert rows[0] == {"kernel": "cudnn_fprop_kernel", "launches_per_call": 1.0, "us_per_call": 6.0}
    assert kp.device_kernels_jax(str(tmp_path / "empty")) == {}


def test_quick_run_pairs_every_variant_with_the_reference():
    res = kp.run(quick=True, rounds=2, profile_calls=1)
    assert res["complete"] and res["reference"] == "torch:math:bhsd"
    assert len(res["rows"]) == 4  # 2 shapes x (fwd, fwd_bwd)
    for row in res["rows"]:
        assert set(row["variants"]) == {"jax:xla:bshd", "torch:math:bhsd", "torch:math:bshd"}
        flops = attention_flops(
            row["B"], row["H"], row["S"], row["S"], row["D"], row["causal"], row["pass"] == "fwd_bwd"
        )
        for name, rec in row["variants"].items():
            assert rec["p10_s"] <= rec["median_s"] <= rec["p90_s"]
            assert rec["tflops"] == pytest.approx(flops / rec["median_s"] / 1e12)
            assert ("speedup_vs_reference" in rec) == (name != res["reference"])
            assert ("burst_speedup_vs_reference" in rec) == (name != res["reference"])
            assert rec["burst_per_call_s"] > 0
            assert rec["kernels"] == []  # traced, but a CPU has no device plane / CUDA events
        sp = row["variants"]["jax:xla:bshd"]["speedup_vs_reference"]
        assert sp["rounds"] == 2 and sp["ci"][0] <= sp["ratio"] <= sp["ci"][1]


def test_cli_writes_json_and_rejects_one_round(tmp_path, capsys):
    with pytest.raises(SystemExit):
        kp.main(["--quick", "--rounds", "1", "--out", str(tmp_path)])
    assert "--rounds must be >= 2" in capsys.readouterr().err
    assert not os.listdir(tmp_path)


def test_table_reads_device_time_from_the_traced_kernels():
    """Device time = the traced kernels' microseconds summed; device TF/s from it; ratio = reference / variant;
    off-GPU = wall - device; a row without kernels shows wall figures only."""
    res = kp.run(quick=True, rounds=2, profile_calls=1)
    row = res["rows"][0]
    ref, other = res["reference"], "jax:xla:bshd"
    row["variants"][ref]["kernels"] = [{"kernel": "k_ref", "launches_per_call": 1.0, "us_per_call": 300.0}]
    row["variants"][other]["kernels"] = [
        {"kernel": "k_main", "launches_per_call": 1.0, "us_per_call": 100.0},
        {"kernel": "memset", "launches_per_call": 3.0, "us_per_call": 50.0},
    ]
    lines = profile_tables.table(res).splitlines()
    cells = next(ln for ln in lines if f"`{other}`" in ln).strip("|").split("|")
    flops = attention_flops(row["B"], row["H"], row["S"], row["S"], row["D"], row["causal"], row["pass"] == "fwd_bwd")
    wall_us = row["variants"][other]["median_s"] * 1e6
    assert [c.strip() for c in cells[9:13]] == ["150", f"{wall_us - 150:.0f}", f"{flops / 150e-6 / 1e12:.0f}", "2.00"]
    assert cells[13].strip() == "`k_main` (1)"
    assert cells[7].strip() == f"{row['variants'][other]['burst_per_call_s'] * 1e3:.3f}"
    rows = [ln.strip("|").split("|") for ln in lines if ln.startswith("| ") and "`" in ln]
    untraced = rows[3:]  # every row but the first: no kernel in them (a CPU trace)
    assert len(untraced) == 9 and all([x.strip() for x in c[9:]] == [""] * 5 for c in untraced), untraced


def test_committed_h200_profile_tables_are_generated_from_their_json():
    """benchmarks/results/nvidia-h200/kernel_profile.md holds exactly the tables --table prints for the JSON beside
    it: no GPU number typed by hand, none left stale after a new profile."""
    here = os.path.join(
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "results", "nvidia-h200"
    )
    with open(os.path.join(here, "kernel_profile.md")) as f:
        text = f.read()
    for name in ["kernel_profile-call1.json", "kernel_profile-call3.json"]:
        with open(os.path.join(here, name)) as f:
            assert profile_tables.table(json.load(f), name) in text, name
