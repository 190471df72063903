"""What CI proves about the jax lines: the compile-marker accounting of ``conftest.py`` (a run where every
``gpu_compile`` or ``tpu_compile`` test skipped fails under ``$JAXATTN_REQUIRE_COMPILE_TESTS``), the version-aware
compile extras, and the declared range."""

import os
import textwrap

import pytest

pytest_plugins = ["pytester"]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _pyproject():
    import tomllib  # Python >= 3.11 (ruff's target is 3.10, where it is not stdlib)

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)


def test_compile_extras_take_jax_own_extras_so_the_plugin_and_libtpu_match_jax():
    extras = _pyproject()["project"]["optional-dependencies"]
    assert "jax[cuda12-local]" in extras["gpu-compile"]  # pins jax-cuda12-plugin (and -pjrt) to jax's version
    assert not any(r.startswith(("jax-cuda12-plugin", "jax-cuda12-pjrt")) for r in extras["gpu-compile"])
    assert extras["tpu-compile"] == ["jax[tpu]"]  # names libtpu per jax line


def test_the_declared_range_bounds_jax_below_the_untested_line():
    deps = _pyproject()["project"]["dependencies"]
    assert "jax>=0.10.2,<0.13" in deps and "flax>=0.12.0,<0.13" in deps
    assert _pyproject()["project"]["requires-python"] == ">=3.11"  # jax 0.10.2 needs 3.11


_FAKE_TESTS = """
import pytest

@pytest.mark.gpu_compile
@pytest.mark.skipif(True, reason="jax-cuda12-plugin 0.1 does not match jaxlib 0.2")
def test_a():
    pass

@pytest.mark.gpu_compile
@pytest.mark.skipif({second_skips}, reason="jax-cuda12-plugin 0.1 does not match jaxlib 0.2")
def test_b():
    pass
"""


@pytest.mark.parametrize("second_skips, required", [(True, "1"), (True, None), (False, "1")])
def test_a_run_where_every_gpu_compile_test_skipped_fails_when_required(pytester, monkeypatch, second_skips, required):
    # in this process (jax and torch are imported already): the suite's conftest, copied as a plugin module of its
    # own name (fresh outcome tables; "conftest" in sys.modules is this suite's), run on two fake tests
    pytester.makepyfile(test_fake=textwrap.dedent(_FAKE_TESTS.format(second_skips=second_skips)))
    pytester.makepyfile(ci_conftest_copy=open(os.path.join(ROOT, "parity_tests", "conftest.py")).read())
    pytester.makeini("[pytest]\nmarkers =\n    gpu_compile: x\n    tpu_compile: x\n    gpu: x\n")
    pytester.syspathinsert()
    monkeypatch.delenv("JAXATTN_REQUIRE_COMPILE_TESTS", raising=False)
    if required:
        monkeypatch.setenv("JAXATTN_REQUIRE_COMPILE_TESTS", required)
    result = pytester.runpytest_inprocess("-q", "-p", "no:cacheprovider", "-p", "no:randomly", "-p", "ci_conftest_copy")
    out = "\n".join(result.outlines)
    assert "gpu_compile: " in out and "skipped (" in out and "does not match jaxlib 0.2" in out, out[-2000:]
    all_skipped = second_skips
    assert result.ret == (1 if all_skipped and required else 0), out[-2000:]
    assert ("every gpu_compile test skipped" in out) == bool(all_skipped and required), out[-2000:]
