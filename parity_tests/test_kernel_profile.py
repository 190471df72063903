"""``benchmarks.tools.kernel_profile`` (issue 42's GPU profile) on the CPU: the XSpace reader counts a GPU plane's
stream kernels once (not again from its "XLA Ops" line, nor a host plane's events), per-call figures divide by the
calls, the quick run times every variant (and each framework's floor) against the reference with a paired ratio,
and a call's wall time splits into launch / device busy / gaps / tail only on aligned clocks."""

import copy
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


@pytest.fixture(scope="module")
def _quick_once():
    return kp.run(quick=True, rounds=2, profile_calls=1)


@pytest.fixture
def quick_run(_quick_once):
    """The quick CPU run (made once per module), a fresh copy for each test to change."""
    return copy.deepcopy(_quick_once)


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


def test_quick_run_pairs_every_variant_with_the_reference(quick_run):
    res = quick_run
    assert res["complete"] and res["reference"] == "torch:math:bhsd"
    assert len(res["rows"]) == 4  # 2 shapes x (fwd, fwd_bwd)
    for row in res["rows"]:
        assert set(row["variants"]) == {"jax:xla:bshd", "jax:xla:bshd:nocb", "torch:math:bhsd", "torch:math:bshd"}
        flops = attention_flops(
            row["B"], row["H"], row["S"], row["S"], row["D"], row["causal"], row["pass"] == "fwd_bwd"
        )
        for name, rec in row["variants"].items():
            assert rec["p10_s"] <= rec["median_s"] <= rec["p90_s"]
            assert rec["tflops"] == pytest.approx(flops / rec["median_s"] / 1e12)
            assert ("speedup_vs_reference" in rec) == (name != res["reference"])
            assert ("burst_speedup_vs_reference" in rec) == (name != res["reference"])
            assert rec["burst_per_call_s"] > 0
            # the first shape traced (a CPU has no device plane / CUDA events), the second timed only
            assert rec.get("kernels", "untraced") == ([] if not row["causal"] else "untraced")
        sp = row["variants"]["jax:xla:bshd"]["speedup_vs_reference"]
        assert sp["rounds"] == 2 and sp["ci"][0] <= sp["ratio"] <= sp["ci"][1]


def test_cli_writes_json_and_rejects_one_round(tmp_path, capsys):
    with pytest.raises(SystemExit):
        kp.main(["--quick", "--rounds", "1", "--out", str(tmp_path)])
    assert "--rounds must be >= 2" in capsys.readouterr().err
    assert not os.listdir(tmp_path)


def test_table_reads_device_time_from_the_traced_kernels(quick_run):
    """Device time = the traced kernels' microseconds summed; device TF/s from it; ratio = reference / variant;
    off-GPU = wall - device; a row without kernels shows wall figures only. A torch record's GPU copy of the call's
    range (named SPAN; the H200 file of 2026-11-28 has one per torch variant) is not a kernel."""
    res = quick_run
    row = res["rows"][0]
    ref, other = res["reference"], "jax:xla:bshd"
    span = {"kernel": profile_tables.SPAN, "launches_per_call": 1.0, "us_per_call": 400.0}
    row["variants"][ref]["kernels"] = [span, {"kernel": "k_ref", "launches_per_call": 1.0, "us_per_call": 300.0}]
    row["variants"][other]["kernels"] = [
        dict(span),
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
    n = len(row["variants"])
    untraced = rows[n:]  # every row but the first: no kernel in them (a CPU trace)
    assert len(untraced) == 3 * n and all([x.strip() for x in c[9:]] == [""] * 5 for c in untraced), untraced


class _Range:
    def __init__(self, start_us, end_us):
        self.start, self.end = start_us, end_us

    def elapsed_us(self):
        return self.end - self.start


def _torch_event(name, cuda, start_us, end_us, annotation=False):
    from types import SimpleNamespace

    import torch

    kind = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU
    return SimpleNamespace(
        name=name, device_type=kind, is_user_annotation=annotation, time_range=_Range(start_us, end_us)
    )


def test_torch_reader_leaves_out_the_gpu_copy_of_the_call_range():
    """kineto copies a ``record_function`` range onto the GPU as a CUDA event (``gpu_user_annotation``): the
    readers take it as neither a kernel nor a second host span. (On the H200, 2026-11-28, it was summed into every
    torch call's device time: 866 us for a 443 us forward.)"""
    events = [
        _torch_event(kp.SPAN, False, 0.0, 500.0, annotation=True),  # the host range
        _torch_event(kp.SPAN, True, 120.0, 400.0, annotation=True),  # its GPU copy
        _torch_event("cudnn_fprop", True, 120.0, 400.0),
        _torch_event("Memset (Device)", True, 401.0, 402.0),
    ]
    prof = type("Prof", (), {"events": lambda self: events})()
    assert kp.device_kernels_torch(prof) == {"cudnn_fprop": [1, 280000.0], "Memset (Device)": [1, 1000.0]}
    spans, kernels = kp.intervals_torch(prof)
    assert spans == [(0.0, 500000.0)] and kernels == [(120000.0, 400000.0), (401000.0, 402000.0)]
    tl = kp.call_timeline(spans, kernels)
    assert (tl["busy_us"], tl["gaps_us"], tl["tail_us"]) == (281.0, 1.0, 98.0)


def test_committed_h200_profile_tables_are_generated_from_their_json():
    """benchmarks/results/nvidia-h200/kernel_profile.md holds exactly the tables --table prints for the JSON beside
    it: no GPU number typed by hand, none left stale after a new profile."""
    here = os.path.join(
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "results", "nvidia-h200"
    )
    with open(os.path.join(here, "kernel_profile.md")) as f:
        text = f.read()
    for name in ["kernel_profile-call1.json", "kernel_profile-call3.json", "kernel_profile-2026-11-28.json"]:
        with open(os.path.join(here, name)) as f:
            res = json.load(f)
        assert profile_tables.table(res, name) in text, name
        assert profile_tables.timeline_table(res) in text, name


SPANS_XSPACE = """
planes {
  id: 1 name: "/host:CPU"
  lines { id: 1 name: "python" timestamp_ns: 0
    events { metadata_id: 1 offset_ps: 2000000000 duration_ps: 500000000 }
    events { metadata_id: 2 offset_ps: 2100000000 duration_ps: 1000000 }
    events { metadata_id: 1 offset_ps: 1000000000 duration_ps: 700000000 } }
  event_metadata { key: 1 value { id: 1 name: "kernel_profile call" } }
  event_metadata { key: 2 value { id: 2 name: "PjitFunction(f)" } }
}
planes {
  id: 2 name: "/device:GPU:0"
  lines { id: 1 name: "Stream #13(Compute)" timestamp_ns: 1000000
    events { metadata_id: 1 offset_ps: 1000000000 duration_ps: 300000000 } }
  event_metadata { key: 1 value { id: 1 name: "k" } }
}
"""


def test_jax_intervals_are_the_call_spans_and_the_stream_kernels_in_ns(tmp_path):
    run = tmp_path / "plugins" / "profile" / "run1"
    run.mkdir(parents=True)
    (run / "host.xplane.pb").write_bytes(ProfileData.text_proto_to_serialized_xspace(SPANS_XSPACE))
    spans, kernels = kp.intervals_jax(str(tmp_path))
    assert spans == [(1_000_000, 1_700_000), (2_000_000, 2_500_000)]  # sorted; the PjitFunction event is not a span
    assert kernels == [(2_000_000, 2_300_000)]  # line timestamp 1 ms + offset 1 ms
    assert kp.intervals_jax(str(tmp_path / "empty")) == ([], [])


def test_call_timeline_splits_each_call_and_takes_medians():
    """Three calls (ns): launch = first kernel start - span start, busy = the union of the call's kernels (two
    overlapping count once), gaps = first start to last end minus busy, tail = span end - last kernel end."""
    us = 1000
    spans = [(0, 1000 * us), (2000 * us, 3500 * us), (5000 * us, 5900 * us)]
    kernels = [
        (2300 * us, 2800 * us),  # call 1: launch 300, busy 500 + 100 (overlap), gaps 0, tail 600
        (2700 * us, 2900 * us),
        (100 * us, 400 * us),  # call 0: launch 100, busy 300 + 150, gaps 50, tail 400
        (450 * us, 600 * us),
        (5020 * us, 5820 * us),  # call 2: launch 20, busy 800, gaps 0, tail 80
    ]
    tl = kp.call_timeline(spans, kernels)
    assert tl == {"aligned": True, "calls": 3, "launch_us": 100.0, "busy_us": 600.0, "gaps_us": 0.0, "tail_us": 400.0}
    one = kp.call_timeline(spans[:1], kernels[2:4])
    assert one == {"aligned": True, "calls": 1, "launch_us": 100.0, "busy_us": 450.0, "gaps_us": 50.0, "tail_us": 400.0}


def test_call_timeline_refuses_misaligned_clocks():
    spans = [(0, 1000), (2000, 3000)]
    assert kp.call_timeline(spans, []) is None and kp.call_timeline([], [(0, 1)]) is None  # a CPU run
    outside = kp.call_timeline(spans, [(100, 200), (2100, 3100)])  # ends after its span
    assert outside["aligned"] is False and "outside every span" in outside["reason"]
    empty = kp.call_timeline(spans, [(100, 200)])  # the second call has no kernel
    assert empty == {"aligned": False, "calls": 2, "reason": "a traced call has no kernel inside its span"}


@pytest.mark.parametrize("framework", ["jax", "torch"])
def test_profile_names_one_host_span_per_traced_call(framework):
    """Each traced call and its wait is one SPAN on the host, found by the framework's reader (on the CPU there is
    no device kernel, so no timeline)."""
    var = kp.floor_variants()["jax:add" if framework == "jax" else "torch:add"]
    kernels, spans, intervals = kp.profile(var, "floor", calls=3)
    assert len(spans) == 3 and all(s0 < s1 for s0, s1 in spans) and (kernels, intervals) == ([], [])
    assert kp.call_timeline(spans, intervals) is None


def test_quick_run_times_each_frameworks_floor_and_dispatch(quick_run):
    res = quick_run
    floor = res["floor"]
    assert floor["pass"] == "floor" and set(floor["variants"]) == {"jax:add", "torch:add"}
    sp = floor["variants"]["jax:add"]["speedup_vs_reference"]
    assert sp["rounds"] == 2 and "speedup_vs_reference" not in floor["variants"]["torch:add"]
    for rec in [*floor["variants"].values(), *(r for row in res["rows"] for r in row["variants"].values())]:
        assert rec["dispatch_s"] > 0 and rec["burst_per_call_s"] > 0 and rec.get("kernels", []) == []
        assert "timeline" not in rec  # no device plane on a CPU: nothing to split


def test_quick_run_climbs_the_wait_ladder(quick_run):
    """The wait ladder: one matmul per size, each variant waiting its own way (jax's block, a spin on ``is_ready``,
    jax's then torch's as the suites waited until 2026-11-28, torch's), timed and traced (on the CPU no device
    kernel, so no timeline), and one timeline-table line per size and variant."""
    tails = quick_run["tails"]
    assert [t["n"] for t in tails] == list(kp.tail_sizes(True)) and all(t["pass"] == "tail" for t in tails)
    for t in tails:
        assert set(t["variants"]) == {"jax:dot", "jax:dot:spin", "jax:dot:both", "torch:mm"}
        assert all(rec["median_s"] > 0 and rec["kernels"] == [] for rec in t["variants"].values()), t
    lines = [ln for ln in profile_tables.timeline_table(quick_run).splitlines() if "| tail n=" in ln]
    assert len(lines) == 4 * len(tails)
    cells = [c.strip() for c in lines[0].strip("|").split("|")]
    assert cells[2:5] == [
        f"tail n={tails[0]['n']}",
        "`jax:dot`",
        f"{tails[0]['variants']['jax:dot']['median_s'] * 1e6:.0f}",
    ]


def test_ladder_variants_return_after_their_result_is_ready():
    """Each ladder call has waited when it returns (the profiler's span and the timer add no wait of their own):
    a jax variant's result is ready, the matmul it ran is ``a @ a``."""
    import jax

    seen = []
    real_jit = jax.jit

    def spy_jit(f):
        g = real_jit(f)

        def call(a):
            out = g(a)
            seen.append((a, out))
            return out

        return call

    jax.jit = spy_jit
    try:
        vs = kp.tail_variants(32, quick=True)
    finally:
        jax.jit = real_jit
    for name in ("jax:dot", "jax:dot:spin", "jax:dot:both"):
        assert vs[name]["tail"]() is None
        a, out = seen[-1]
        assert out.is_ready(), name
        assert float(abs(out - a @ a).max()) < 1e-3, name
    assert vs["torch:mm"]["tail"]() is None


def test_timeline_table_shows_the_split_only_on_aligned_clocks(quick_run):
    res = quick_run
    rec = res["rows"][0]["variants"]["jax:xla:bshd"]
    rec["timeline"] = {
        "aligned": True,
        "calls": 3,
        "launch_us": 41.4,
        "busy_us": 800.0,
        "gaps_us": 2.0,
        "tail_us": 300.6,
    }
    res["floor"]["variants"]["torch:add"]["timeline"] = {"aligned": False, "calls": 3, "reason": "a kernel at 5 ns"}
    lines = profile_tables.timeline_table(res).splitlines()
    assert len(lines) == 2 + 2 + 8 + 16  # header, floor (2 variants), the ladder (2 sizes x 4), 4 rows x 4 variants
    cells = [c.strip() for c in next(ln for ln in lines if "`jax:xla:bshd`" in ln).strip("|").split("|")]
    assert cells[:4] == ["128", "no", "fwd", "`jax:xla:bshd`"] and cells[7:] == ["41", "800", "2", "301", ""]
    assert cells[4] == f"{rec['median_s'] * 1e6:.0f}" and cells[6] == f"{rec['dispatch_s'] * 1e6:.0f}"
    floor = [c.strip() for c in next(ln for ln in lines if "`torch:add`" in ln).strip("|").split("|")]
    assert floor[2] == "floor" and floor[7:11] == [""] * 4 and floor[11] == "clocks not aligned: a kernel at 5 ns"
    for old in ("kernel_profile-call1.json", "kernel_profile-call3.json"):  # written before the timeline
        with open(os.path.join(os.path.dirname(__file__), "..", "benchmarks", "results", "nvidia-h200", old)) as f:
            assert profile_tables.timeline_table(json.load(f)) == ""


def test_an_interrupt_keeps_what_finished(monkeypatch):
    """A session step's budget sends SIGINT: the run returns the rows timed (and traced) so far, marked incomplete
    with the phase it stopped in, so the tool still writes its JSON. (One quick shape: two rows.)"""
    monkeypatch.setattr(kp, "shapes", lambda quick: [("float32", 1, 2, 128, 64, False, True)])
    real_time, real_profile, n = kp._time_variants, kp.profile, {"t": 0, "p": 0}

    def time_twice(*a, **k):  # the floor, one attention row, then the interrupt
        n["t"] += 1
        if n["t"] == 3:
            raise KeyboardInterrupt
        return real_time(*a, **k)

    monkeypatch.setattr(kp, "_time_variants", time_twice)
    res = kp.run(quick=True, rounds=2, profile_calls=1)
    assert (res["complete"], res["interrupted"]) == (False, "timing")
    assert set(res["floor"]["variants"]) == {"jax:add", "torch:add"} and len(res["rows"]) == 1
    assert all("kernels" not in rec for rec in res["rows"][0]["variants"].values())  # nothing traced after it

    def trace_once(*a, **k):
        n["p"] += 1
        if n["p"] == 2:
            raise KeyboardInterrupt
        return real_profile(*a, **k)

    monkeypatch.setattr(kp, "_time_variants", real_time)
    monkeypatch.setattr(kp, "profile", trace_once)
    res = kp.run(quick=True, rounds=2, profile_calls=1)
    assert (res["complete"], res["interrupted"]) == (False, "tracing") and len(res["rows"]) == 2
    traced = [rec for rec in res["floor"]["variants"].values() if "kernels" in rec]
    traced += [rec for row in res["rows"] for rec in row["variants"].values() if "kernels" in rec]
    assert len(traced) == 1  # the first trace (JAX's floor) and no other
