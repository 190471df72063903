"""The GPU session (``benchmarks/tools/gpu_session.sh``) rehearsed on the CPU: its plan fits two device calls, every
step runs under its budget, suites write their JSON row by row (a kill keeps the rows before it), the model suite
releases memory between presets and turns an out-of-memory into a ``skipped`` record, and the report builds from
what a session writes. The whole session at quick sizes is the ``slow`` test at the end."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

pytest.importorskip("torch")

from benchmarks import measure  # noqa: E402
from benchmarks.report.records import LiveRows, read_results  # noqa: E402
from benchmarks.suites import model as model_suite  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "tools", "gpu_session.sh")
CALL_LIMIT_S = 450  # 15 min of device time: a 1-2 min start, two calls, the turn-around between them
SESSION_LIMIT_S = 780  # both calls (2026-11-27b: 740 s of command, 56 s of start and transfers, in 796 s held)


def _session(*args, out, env=None, timeout=600):
    full = {**os.environ, "OUT": str(out), "PYTHON": sys.executable, **(env or {})}
    return subprocess.run(["bash", SCRIPT, *args], cwd=ROOT, env=full, capture_output=True, text=True, timeout=timeout)


def _plan(*args, tmp_path):
    r = _session("--plan", *args, out=tmp_path / "unused")
    assert r.returncode == 0, r.stderr
    rows = [ln.split() for ln in r.stdout.splitlines()[1:] if ln and not ln.startswith("total")]
    return {
        row[0]: (row[1] if row[1] == "-" else int(row[1]), int(row[2].rstrip("s")), int(row[3].rstrip("s")))
        for row in rows
    }, r.stdout


def test_plan_fits_two_device_calls(tmp_path):
    plan, text = _plan(tmp_path=tmp_path)
    assert list(plan) == [
        "tests",
        "profile",
        "attention",
        "peers",
        "order",
        "masked",
        "ring",
        "train",
        "decode",
        "loops",
        "blocks",
        "gqa",
        "model",
    ]
    assert plan["model"][0] == plan["peers"][0] == plan["masked"][0] == "-", "model, peers, masked: in no call"
    for call in (1, 2):
        steps = {s: v for s, v in plan.items() if v[0] == call}
        assert steps, f"call {call} has no step"
        assert sum(b for _, b, _ in steps.values()) <= CALL_LIMIT_S, f"call {call}'s budgets exceed {CALL_LIMIT_S} s"
        one, text_one = _plan("--call", str(call), tmp_path=tmp_path)
        assert one == steps
        assert re.search(rf"total: budget {sum(b for _, b, _ in steps.values())} s", text_one)
    in_calls = [b for c, b, _ in plan.values() if c in (1, 2)]
    assert sum(in_calls) <= SESSION_LIMIT_S, f"the two calls' budgets ({sum(in_calls)} s) exceed {SESSION_LIMIT_S} s"
    for step, (_, budget, expected) in plan.items():
        assert 0 < expected <= budget, f"{step}: expected {expected} s must be under its budget {budget} s"
    assert not (tmp_path / "unused").exists(), "--plan must write nothing"


@pytest.mark.parametrize(
    "args,message",
    [
        (["--call", "3"], r"--call '3': give 1 or 2"),
        (
            ["nope"],
            r"unknown step 'nope'; steps: tests profile attention peers order masked ring train decode loops "
            r"blocks gqa model",
        ),
        (["--fast"], r"unknown option '--fast'"),
    ],
)
def test_bad_arguments_fail_before_anything_runs(tmp_path, args, message):
    r = _session(*args, out=tmp_path / "out")
    assert r.returncode == 2 and re.search(message, r.stderr), r.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
@pytest.mark.slow_feature
def test_budget_ends_a_step_and_the_session_goes_on(tmp_path):
    """A step over its budget is interrupted (exit 124, said in the summary) and the next step still runs.
    ``slow_feature`` (15-18 s: three real steps): the default run keeps :func:`test_step_names_what_ended_it`, the
    ``step`` function's exits on a harness, and CI's rehearsal runs every step within its budget."""
    r = _session(
        "--dry-run", "tests", "blocks", "gqa", out=tmp_path, env={"BUDGET_tests": "3", "KILL_AFTER": "2"}, timeout=300
    )
    log = (tmp_path / "session.log").read_text()
    assert r.returncode == 1, log[-3000:]  # a rehearsal whose step outran its budget fails, after the other steps
    assert "failed steps: tests (a budget's interrupt" in log
    # 124: the interrupt ended it; 137: pytest-xdist, still starting its workers on a slow machine, outlived the
    # interrupt and was killed 15 s later. Either way the summary must name the budget.
    assert re.search(r"tests: exit (124|137), [\d.]+ s of 3 s \(its budget ended it", log), log[-3000:]
    plan = _plan(tmp_path=tmp_path)[0]
    for step in ("blocks", "gqa"):
        assert re.search(rf"{step}: exit 0, [\d.]+ s of {plan[step][1]} s", log), log[-3000:]
    dirs = os.listdir(tmp_path / "results")
    assert len(dirs) == 1
    got = read_results(str(tmp_path / "results" / dirs[0]))["block_search"]
    groups = {(r["kernel"], r.get("kv_heads", 16)) for r in got["records"]}  # both steps' rows, merged in one file
    assert groups == {("flash_bwd_dkv", 16), ("flash_bwd_dkv", 4)}
    assert {r["head_dim"] for r in got["records"]} == {128}
    files = [os.path.join(d, f) for d, _, fs in os.walk(tmp_path) for f in fs]
    assert len(files) <= 8, f"a device call returns at most 8 files: {files}"


@pytest.mark.parametrize(
    ("command", "dry", "summary", "failed"),
    [
        ('trap "" INT; sleep 30', "0", r"x: exit 137, [\d.]+ s of 1 s \(its budget ended it: killed 1 s after", ""),
        ('trap "" INT; sleep 30', "1", r"x: exit 137, [\d.]+ s of 1 s \(its budget ended it: killed 1 s after", "x"),
        ("sleep 30", "0", r"x: exit 124, [\d.]+ s of 1 s \(its budget ended it; finished", ""),
        ("kill -9 $$", "0", r"x: exit 137, [\d.]+ s of 1 s$", "x"),  # killed before its budget: the OOM killer's mark
        ("exit 3", "0", r"x: exit 3, [\d.]+ s of 1 s$", "x"),
    ],
)
def test_step_names_what_ended_it(command, dry, summary, failed):
    """``step``: the budget's interrupt, or its kill of a step that ignores the interrupt, is the budget's doing;
    a kill before the budget is spent is not (the OOM killer's exit 137), nor is any other exit."""
    body = re.search(r"^step\(\) \{.*?^\}$", open(SCRIPT).read(), re.S | re.M).group(0)
    harness = f"""{body}
budget() {{ echo 1; }}; field() {{ echo 0; }}; DRY={dry} KILL_AFTER=1 SUMMARY=() FAILED=()
step x bash -c '{command}' >/dev/null
printf '%s\\n' "${{SUMMARY[@]}}"; echo "failed=${{FAILED[*]}}"
"""
    r = subprocess.run(["bash", "-c", harness], capture_output=True, text=True, timeout=60)
    lines = r.stdout.splitlines()
    assert re.match(summary, lines[0]), r.stdout + r.stderr
    assert lines[1] == f"failed={failed}", r.stdout


# ---- rows written as they finish
def test_live_rows_rewrite_the_file_after_each_row(tmp_path):
    lines = []
    rows = LiveRows(str(tmp_path), "model", {"jax": "x"}, log=lines.append)
    rows.append({"impl": "a", "framework": "jax", "status": "skipped", "reason": "no GPU"})
    assert not (tmp_path / "model.json").exists(), "a run of skips alone must not write (it could replace a result)"
    rows.append({"impl": "a", "framework": "jax", "preset": "tiny", "median_ms": 1.5, "status": "ok"})
    data = json.loads((tmp_path / "model.json").read_text())
    assert data["complete"] is False and len(data["records"]) == 2
    rows.extend([{"impl": "b", "framework": "torch", "median_ms": 2.0}, {"impl": "c", "framework": "torch"}])
    assert len(json.loads((tmp_path / "model.json").read_text())["records"]) == 4
    assert [ln.split(",")[0] for ln in lines] == [f"[model row {i}" for i in (1, 2, 3, 4)]
    assert all(re.match(r"\[model row \d, \d+\.\d s\] ", ln) for ln in lines), lines
    assert "skipped (no GPU)" in lines[0] and "preset=tiny" in lines[1] and "1.500 ms" in lines[1]


def test_rows() -> None:
    """``measure.rows()`` hands the run's sink to one suite only; elsewhere a plain list."""
    sink = LiveRows("/nonexistent", "x", {})
    measure._ROWS = sink
    try:
        assert measure.rows() is sink
        assert measure.rows() == [] and measure.rows() is not sink
    finally:
        measure._ROWS = None


def test_killed_writer_leaves_the_rows_it_printed_loadable(tmp_path):
    """A process appending rows to :class:`LiveRows` as fast as it can, SIGKILLed after its 50th progress line
    (most likely in the middle of a rewrite): the file loads, marked incomplete, with every row it printed."""
    code = (
        "import sys; from benchmarks.report.records import LiveRows\n"
        "rows = LiveRows(sys.argv[1], 'model', {'jax': 'x'})\n"
        "i = 0\n"
        "while True:\n"
        "    i += 1; rows.append({'impl': 'a', 'framework': 'jax', 'preset': str(i), 'median_ms': 1.0})\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        printed = [proc.stdout.readline() for _ in range(50)]
        proc.kill()
    finally:
        proc.wait(timeout=60)
    assert printed[-1].startswith("[model row 50,"), printed[-3:]
    data = json.loads((tmp_path / "model.json").read_text())
    assert data["complete"] is False and len(data["records"]) >= 50
    assert [r["preset"] for r in data["records"]] == [str(i) for i in range(1, len(data["records"]) + 1)]


@pytest.mark.slow  # ~45 s: the default run kills a LiveRows writer above
def test_killed_suite_keeps_the_rows_it_finished(tmp_path):
    """SIGKILL the model suite once its first preset's rows are printed: they are on disk, marked incomplete."""
    cmd = [sys.executable, "-m", "benchmarks", "run", "--suite", "model", "--quick", "--out", str(tmp_path)]
    proc = subprocess.Popen(
        cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    seen, t0 = [], time.time()
    try:
        for line in proc.stdout:
            seen.append(line)
            if line.startswith("[model row 4,") or time.time() - t0 > 240:
                break
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=60)
    assert seen and seen[-1].startswith("[model row 4,"), "".join(seen)[-2000:]
    data = json.loads((tmp_path / "model.json").read_text())
    assert data["complete"] is False
    assert [r["preset"] for r in data["records"]] == ["tiny"] * 4
    assert all(r["status"] == "ok" for r in data["records"])
    assert read_results(str(tmp_path))["model"]["records"] == data["records"]


# ---- the model suite on one device
@pytest.mark.slow  # 8 s; CI runs it with the slow_feature set
@pytest.mark.slow_feature
def test_model_suite_releases_memory_between_presets():
    """No JAX buffer of a finished preset is still alive (the next preset starts from what was there before)."""
    import jax

    before = {id(a) for a in jax.live_arrays()}
    recs = model_suite.preset_rows("tiny", 2, 32, quick=True)
    assert [r["status"] for r in recs] == ["ok"] * 4
    left = [a for a in jax.live_arrays() if id(a) not in before]
    assert not left, f"{len(left)} arrays of the finished preset still alive: {[a.shape for a in left][:5]}"


@pytest.mark.parametrize(
    "error",
    [
        lambda: __import__("torch").OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
        lambda: RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 34359738368 bytes."),
    ],
    ids=["torch", "jax"],
)
def test_out_of_memory_is_a_skipped_record(monkeypatch, error):
    def boom(*a, **k):
        raise error()

    monkeypatch.setattr(model_suite, "_measure", boom)
    recs = model_suite.preset_rows("350m", 8, 1024)
    assert len(recs) == 4 and {r["status"] for r in recs} == {"skipped"}
    assert {(r["framework"], r["pass"]) for r in recs} == {(f, p) for f in ("jax", "torch") for p in ("fwd", "fwd_bwd")}
    assert all(r["reason"].startswith("out of memory: ") and "allocate" in r["reason"] for r in recs)


def test_other_errors_are_not_hidden(monkeypatch):
    monkeypatch.setattr(model_suite, "_measure", lambda *a, **k: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        model_suite.preset_rows("tiny", 2, 32)


def test_a_preset_whose_process_dies_is_skipped_with_its_last_line():
    recs = model_suite._in_fresh_process("nope", 1, 8, True)
    assert {r["status"] for r in recs} == {"skipped"} and len(recs) == 4
    assert re.match(r"its process exited with status 1: ValueError: unknown preset 'nope'", recs[0]["reason"])


# ---- the whole rehearsal
@pytest.mark.slow
def test_whole_session_rehearsed_on_cpu(tmp_path):
    """Both calls at quick sizes: every step exits 0 within its budget, each suite's JSON is complete, the report
    builds from the results folder a session leaves."""
    for call in ("1", "2", "named"):  # "named": the steps in no call (model, peers, masked), run by name
        out = tmp_path / f"call{call}"
        named = ["model", "peers", "masked"]
        r = _session("--dry-run", *(named if call == "named" else ["--call", call]), out=out, timeout=900)
        log = (out / "session.log").read_text()
        assert r.returncode == 0, log[-3000:]
        summary = log.split("=== session summary")[1]
        assert "exit 124" not in summary and re.findall(r"exit 0", summary), summary
        (res,) = [out / "results" / d for d in os.listdir(out / "results")]
        found = read_results(str(res))
        want = {"1": {"attention"}, "2": {"train", "decode", "block_search"}, "named": {"model"}}[call]
        assert set(found) == want
        assert all(found[s].get("complete", True) for s in want)
        if call == "1":  # issue 42's profile beside the suites, its wait ladder included
            profile = json.loads((res / "kernel_profile.json").read_text())
            assert profile["complete"] and len(profile["tails"]) == 2
            ring = json.loads((res / "ring_decode.json").read_text())  # the ring's step against the plain one's
            assert ring["jax"]["ratio"]["rounds"] == ring["torch"]["ratio"]["rounds"] == 2
        if call == "2":  # the decode rows of the batches it was given, the larger first
            batches = [r["B"] for r in found["decode"]["records"] if r["impl"] == "jaxattn" and r["pass"] == "decode"]
            assert batches and batches[0] == 4 and set(batches) == {1, 4}, batches
            loops = json.loads((res / "generate_loop.json").read_text())  # generate's loops, paired
            assert all(loops["tokens_agree"].values()) and len(loops["pairs"]) == 5  # no CUDA: no graph loops
        if call == "named":  # the peers in their own folder; the masked forwards, three ways
            assert set(read_results(str(out / "peers"))) == {"attention"}
            masked = json.loads((res / "masked_attention.json").read_text())
            assert [r["mask"] for r in masked["rows"]] == ["window", "documents"]
        rep = subprocess.run(
            [sys.executable, "-m", "benchmarks", "report", str(res)], cwd=ROOT, capture_output=True, text=True
        )
        assert rep.returncode == 0 and (res / "report.md").exists(), rep.stderr


def test_gpu_summary_names_each_backend():
    """The per-backend verdict a GPU run prints (conftest): node ids map to the backend they check."""
    from benchmarks.tools.default_order import backend_of_test as gpu_backend_of
    from parity_tests.conftest import gpu_summary_lines

    ids = {
        "parity_tests/test_attention.py::test_gpu_backends_bf16[b21_s512x512_h4/4_d128-mosaic]": "mosaic",
        "parity_tests/test_attention.py::test_gpu_torch_sdpa_bf16[cudnn]": "torch sdpa",
        "parity_tests/test_flash.py::TestFlashGPU::test_parity[case3]": "flash",
        "parity_tests/test_flash_decode.py::TestFlashDecodeGPU::test_parity[case0]": "decode",
        "parity_tests/test_grouped_matmul.py::test_compiled_kernel_matches_float64_on_gpu[x]": "grouped matmul",
        "parity_tests/test_mosaic.py::test_gpu_kernel_bf16_two_x_rule[False-64-1000]": "mosaic",
        "parity_tests/test_precision.py::test_matmul_precision_settings_error_on_gpu": "precision",
    }
    for nodeid, backend in ids.items():
        assert gpu_backend_of(nodeid) == backend, nodeid
    lines = gpu_summary_lines(
        {
            "flash": {"passed": ["a", "b"], "failed": ["c (timeout)"], "skipped": []},
            "cudnn": {"passed": ["d"], "failed": [], "skipped": ["e"]},
        }
    )
    assert lines == [
        "cudnn: 1 passed, 0 failed, 1 skipped",
        "flash: 2 passed, 1 failed, 0 skipped",
        "  FAILED c (timeout)",
    ]


@pytest.mark.slow  # 20 s of compiles; the default run checks the committed record (its test below)
@pytest.mark.slow_feature
@pytest.mark.gpu_compile
def test_suite_rows_compiled_memory_for_an_h100():
    """The model and train suites' own JAX programs compile for an H100 without a GPU, and their compiled memory
    is judged against the device's: bigger programs need more, and a device too small says `fits: false`."""
    from jaxattn import gpu_target

    why = gpu_target.unavailable_reason()
    if why:
        pytest.skip(f"needs the gpu-compile extra: {why}")
    from benchmarks.tools import suite_memory as sm
    from benchmarks.tools.deviceless import target_config

    devs = gpu_target.devices(target_config("h100"))
    rows = sm.model_rows(devs, quick=True, log=lambda *a: None)[:2]
    rows += sm.train_rows(devs, quick=True, toggles=["bf16"], log=lambda *a: None)
    assert [r["status"] for r in rows] == ["ok"] * 3, rows
    fwd, fwd_bwd, step = (r["memory"]["peak"] for r in rows)
    assert 0 < fwd < fwd_bwd, (fwd, fwd_bwd)  # the backward keeps the activations
    assert step > 0 and rows[2]["preset"] == "tiny" and rows[2]["S"] == 128
    assert all(r["fits"] for r in sm.judge(rows, sm.DEVICE_BYTES["h100"]))
    tight = int(fwd / sm.USABLE) + 1  # a device whose usable part just holds the forward
    small = sm.judge([dict(r) for r in rows], device_bytes=tight)
    assert [r["fits"] for r in small] == [True, False, step <= sm.USABLE * tight]
    assert "| model | tiny fwd_bwd | 8 | 256 |" in sm.table(small) and "**no**" in sm.table(small)


def test_committed_suite_rows_fit_one_h100():
    """The committed deviceless record (``benchmarks/results/h100-compiled/suite_memory.json``) covers the suites'
    current non-quick rows and shows each fits one H100: model rows with torch's estimate beside JAX (one process),
    train rows on JAX's own (the frameworks run in turn). A suite shape changed without re-running the tool fails."""
    from benchmarks.report.records import RESULTS_DIR
    from benchmarks.suites import train

    got = read_results(str(RESULTS_DIR / "h100-compiled"))["suite_memory"]["records"]
    assert all(r["status"] == "ok" for r in got), [r.get("reason") for r in got]
    model = {(r["preset"], r["B"], r["S"]) for r in got if r["suite"] == "model"}
    assert model == set(model_suite.shapes(quick=False))
    assert all(r["fits_both"] for r in got if r["suite"] == "model"), [r for r in got if not r.get("fits_both")]
    rows = {r["toggle"]: r for r in got if r["suite"] == "train"}
    assert set(rows) == set(train.TOGGLES) - {"torch_compile"}
    for toggle, r in rows.items():
        _, (state, batch), _, preset = train.jax_program(toggle)
        assert (r["preset"], r["B"], r["S"] + 1) == (preset, *batch["tokens"].shape), toggle
        assert r["fits"] and r["memory"]["peak"] < r["device_bytes"], r


def test_default_order_reads_verdicts_per_backend_from_several_logs():
    """`default_order` credits a JAX backend only with its own tests: torch's SDPA cuDNN test says nothing of JAX's
    cudnn, one failure marks a backend failed, and verdicts from two logs (two device calls) add up."""
    from benchmarks.tools.default_order import tests_passed

    call1 = (
        "PASSED parity_tests/test_attention.py::test_gpu_torch_sdpa_bf16[cudnn]\n"
        "PASSED parity_tests/test_flash.py::TestFlashGPU::test_parity[a]\n"
        "FAILED parity_tests/test_flash.py::TestFlashGPU::test_parity[b] - AssertionError: x\n"
    )
    call3 = "PASSED parity_tests/test_mosaic.py::test_gpu_kernel_bf16_two_x_rule[True-64-1000]\n"
    got = tests_passed(call1 + call3)
    assert got["cudnn"] is None and got["flash"] is False and got["mosaic"] is True and got["xla"] is None
    assert tests_passed(call1.replace("FAILED", "PASSED"))["flash"] is True


def _timed(times: dict) -> list:
    """Attention records of three shapes: ``{impl: [ms per shape]}``."""
    return [
        {"framework": "jax", "status": "ok", "impl": impl, "median_ms": t, "pass": "fwd", "dtype": "bfloat16"}
        | dict(B=1, Hq=8, Hkv=8, Sk=s, D=128, causal=False)
        for impl, ts in times.items()
        for s, t in zip((1024, 2048, 4096), ts)
    ]


@pytest.mark.parametrize(
    "times, want",
    [
        (
            {"cudnn": [1.02, 1.0, 1.03], "mosaic": [1.0, 1.01, 1.0], "flash": [2.0, 2.0, 2.0]},
            ["cudnn", "mosaic", "flash"],
        ),
        ({"cudnn": [1.3, 1.2, 1.3], "mosaic": [1.0, 1.0, 1.0], "flash": [2.0, 2.0, 2.0]}, ["mosaic", "cudnn", "flash"]),
        ({"cudnn": [1.0, 1.0, 1.0], "mosaic": [2.0, 2.0, 2.0], "flash": [1.5, 1.5, 1.5]}, ["cudnn", "flash", "mosaic"]),
    ],
    ids=["tie-keeps-incumbent", "clear-lead-moves", "slower-stays-behind"],
)
def test_default_order_ranks_by_median_and_a_tie_keeps_the_current_order(times, want):
    from benchmarks.tools.default_order import ranking

    assert ranking(_timed(times), current=("cudnn", "flash", "chunked", "xla")) == want


def test_committed_gpu_default_is_what_the_committed_h200_session_supports():
    """The GPU default order (the backend table's ranks) is the one `default_order` derives from the committed H200
    session: its `gpu` test log and its attention records. A rank changed without new evidence fails here."""
    from benchmarks.tools.default_order import ranking, tests_passed
    from twincore.attention import default_order

    here = os.path.join(ROOT, "benchmarks", "results", "nvidia-h200")
    with open(os.path.join(here, "session-2026-11-27", "call1-gpu_tests.log")) as f:
        passed = tests_passed(f.read())
    with open(os.path.join(here, "attention.json")) as f:
        records = json.load(f)["records"]
    ranked = [b for b in ranking(records) if passed.get(b)]
    assert ranked == ["cudnn", "mosaic", "flash"], ranked
    assert default_order("gpu") == (*ranked, "chunked", "xla")


def _search_row(knobs: dict, median_s: float | None, **extra) -> dict:
    row = {"kernel": "flash_bwd_dq", "head_dim": 128, "dtype": "bfloat16", "knobs": knobs, "passed": True, **extra}
    row |= {"registers": 166, "smem_bytes": 98304, "occupancy": 0.125, "sass": {}}
    return row if median_s is None else {**row, "time": {"median_s": median_s}}


def test_block_search_times_the_fastest_tile_against_the_default_paired():
    """The GPU session's block search: the fastest timed tile is timed again against the default, alternately, and
    carries its paired speed-up over the default (default / best per round). Here a `best` call of ~2 ms against a
    default of ~10 ms (a ratio near 5: a scheduler delay of a few ms in one round, which a loaded 2-core machine gives,
    cannot turn a round's ratio below 1, as it did with 1 ms against 3 ms); the default is recognised by its knobs
    (rows written before `default` was recorded)."""
    from benchmarks.report.tables import format_ratio
    from benchmarks.tools import block_search as bsr

    default_knobs = {"block_q_dq": 128, "block_k_dq": 64, "num_warps": 8, "num_stages": 2}  # flash._DEFAULTS
    assert bsr.is_default(_search_row(default_knobs, None))
    assert not bsr.is_default(_search_row({**default_knobs, "num_warps": 4}, None))
    fast = _search_row({**default_knobs, "block_q_dq": 64, "num_warps": 4}, 0.002)
    slow = _search_row({**default_knobs, "block_k_dq": 32}, 0.012)
    default = _search_row(default_knobs, 0.010)
    calls = {id(r): (lambda s=s: time.sleep(s)) for r, s in ((fast, 0.002), (slow, 0.012), (default, 0.010))}
    pair = bsr.pair_best_with_default([slow, default, fast], lambda r: calls[id(r)], rounds=6, sync=lambda out: None)
    assert pair is fast["vs_default"] and "vs_default" not in default and "vs_default" not in slow
    assert 3.0 < pair["ratio"] < 6.0 and pair["ci"][0] > 1.0 and pair["finding"], pair
    assert pair["default_knobs"] == default_knobs and pair["rounds"] == 6
    assert format_ratio(pair["ratio"], pair) in bsr.table([slow, default, fast]).splitlines()[-1].split("|")[-2]
    # nothing to pair: the default is the fastest, or was not timed
    assert bsr.pair_best_with_default([default, slow], lambda r: calls[id(r)], sync=lambda out: None) is None
    assert bsr.pair_best_with_default([fast, slow], lambda r: calls[id(r)], sync=lambda out: None) is None


def test_block_search_keeps_a_gqa_group_apart(tmp_path, capsys):
    """A GQA search (``--kv-heads``) is its own group: written beside the 16/16-head rows of the same kernel (never
    replacing them), named with its heads in the table, and selected by its kv heads from a survivors file."""
    from benchmarks.tools import block_search as bsr

    knobs = {"block_q_dkv": 32, "block_k_dkv": 64, "num_warps": 8, "num_stages": 3}
    mha = _search_row(knobs, None) | {"kernel": "flash_bwd_dkv"}
    gqa = _search_row({**knobs, "num_warps": 4}, None) | {"kernel": "flash_bwd_dkv", "q_heads": 16, "kv_heads": 4}
    bsr.write(str(tmp_path), [mha], {"label": "test"})
    bsr.write(str(tmp_path), [gqa], {"label": "test"})  # a later GQA search: the MHA rows stay
    stored = read_results(str(tmp_path))["block_search"]["records"]
    assert [bsr.group_key(r)[3] for r in stored] == [16, 4]
    md = (tmp_path / "block_search.md").read_text()
    assert "| flash_bwd_dkv | 128 |" in md and "| flash_bwd_dkv (16/4 heads) | 128 |" in md
    survivors = str(tmp_path / "block_search.json")
    with pytest.raises(SystemExit):  # no 16/2-head rows stored
        bsr.main(["--survivors", survivors, "--kernel", "flash_bwd_dkv", "--d", "128", "--kv-heads", "2"])
    assert "no rows for flash_bwd_dkv D=128 bf16 with 2 kv heads" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bsr.main(["--kernel", "flash_bwd_dkv", "--kv-heads", "3"])
    assert "--kv-heads must divide the 16 query heads" in capsys.readouterr().err
