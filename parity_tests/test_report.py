"""``python -m benchmarks report DIR`` rebuilds ``report.md`` and the plots from the JSON already in DIR (running
nothing), with the "JAX speed-up = torch time / JAX time" column; the attention plot gives each implementation
one colour and marker in every panel and one legend that lists every series."""
import json

import pytest

from benchmarks import __main__ as cli
from benchmarks import common


def _attn(impl, fw, pss, s, causal, ms, status="ok"):
    r = {"suite": "attention", "impl": impl, "framework": fw, "pass": pss, "dtype": "float32", "B": 1, "Hq": 2,
         "Hkv": 2, "Sq": s, "Sk": s, "D": 64, "causal": causal, "median_ms": None, "tflops": None,
         "peak_mem_bytes": None, "status": status, "reason": None if status == "ok" else "needs CUDA"}
    if status == "ok":
        r.update(median_ms=ms, tflops=1.0 / ms, iters=20)
    return r


def _write(dirpath, suite, records, when):
    env = {"jax_device": "cpu (synthetic)", "time_utc": when, "jax": "0.0", "torch": "0.0"}
    (dirpath / f"{suite}.json").write_text(json.dumps({"env": env, "suite": suite, "records": records}))


@pytest.fixture
def results(tmp_path):
    # a torch series only in the last panel, listed first: per-panel colour cycles would give it the colour that
    # jax:chunked has in the other panels, and a first-panel legend could not name it
    attn = [_attn("sdpa:flash", "torch", "fwd_bwd", s, True, 1.0) for s in (128, 256)]
    for s in (128, 256):
        for pss in ("fwd", "fwd_bwd"):
            for causal in (False, True):
                attn += [_attn("chunked", "jax", pss, s, causal, 2.0), _attn("xla", "jax", pss, s, causal, 4.0),
                         _attn("sdpa:math", "torch", pss, s, causal, 3.0),
                         _attn("sdpa:efficient", "torch", pss, s, causal, None, status="skipped")]
    _write(tmp_path, "attention", attn, "2026-01-02T00:00:00Z")
    _write(tmp_path, "model", [
        {"suite": "model", "preset": "tiny", "B": 4, "S": 128, "impl": "jaxattn", "framework": "jax", "pass": "fwd",
         "median_ms": 1.0, "tokens_per_s": 512000.0, "status": "ok"},
        {"suite": "model", "preset": "tiny", "B": 4, "S": 128, "impl": "torchref", "framework": "torch",
         "pass": "fwd", "median_ms": 2.5, "tokens_per_s": 204800.0, "status": "ok"}], "2026-01-01T00:00:00Z")
    return tmp_path


def test_report_rebuilds_markdown_and_plot_from_json(results, capsys):
    assert cli.main(["report", str(results)]) == 0
    assert "report.md" in capsys.readouterr().out
    text = (results / "report.md").read_text()
    assert "Rebuilt by `python -m benchmarks report`" in text and "cpu (synthetic)" in text
    assert "time_utc=2026-01-02T00:00:00Z" in text  # the newest file's environment
    assert "## attention" in text and "## model" in text
    header = next(line for line in text.splitlines() if line.startswith("| preset"))
    assert header.endswith("| JAX speed-up = torch time / JAX time |")
    assert "| tiny | 4 | 128 | fwd | 1 ms (5.12e+05 tok/s) | 2.5 ms (2.05e+05 tok/s) | 2.50x |" in text
    # attention rows: fastest torch (3.0, or 1.0 where sdpa:flash ran) over fastest jax (2.0)
    assert "| 1.50x |" in text and "| 0.50x |" in text
    assert "Skipped: torch:sdpa:efficient (needs CUDA)" in text
    png = results / "attention_tflops.png"
    assert png.stat().st_size > 10_000 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_refuses_dirs_without_timings(tmp_path):
    with pytest.raises(ValueError, match="holds no benchmark JSON"):
        common.rebuild_report(str(tmp_path))
    with pytest.raises(ValueError, match="is not a directory"):
        common.rebuild_report(str(tmp_path / "nope"))
    _write(tmp_path, "kernels", [{"kernel": "x"}], "2026-01-01T00:00:00Z")
    with pytest.raises(ValueError, match="only deviceless-compile results \\(kernels.json\\)"):
        common.rebuild_report(str(tmp_path))
    assert not (tmp_path / "report.md").exists()
    with pytest.raises(SystemExit):
        cli.main(["report", str(tmp_path / "nope")])


def test_attention_plot_one_style_per_impl_and_a_legend_for_all(results, monkeypatch):
    import matplotlib.pyplot as plt

    figs = []
    real_close = plt.close
    monkeypatch.setattr(plt, "close", lambda fig=None: figs.append(fig) or real_close(fig))
    recs = json.loads((results / "attention.json").read_text())["records"]
    assert common.plot_attention(str(results), recs)
    fig = figs[-1]
    style = {}
    for ax in fig.axes:
        assert ax.get_legend() is None  # no per-panel legend that names only that panel's lines
        for line in ax.get_lines():
            got = (line.get_color(), line.get_marker(), line.get_linestyle())
            assert style.setdefault(line.get_label(), got) == got, line.get_label()
    assert len(set(style.values())) == len(style) == 4  # distinct per implementation
    assert len(fig.legends) == 1
    assert {t.get_text() for t in fig.legends[0].get_texts()} == set(style) == {
        "jax:chunked", "jax:xla", "torch:sdpa:math", "torch:sdpa:flash"}
