"""``python -m benchmarks report DIR`` rebuilds ``report.md`` and the plots from the JSON already in DIR (running
nothing), with the "JAX speed-up = torch time / JAX time" column; the attention plot gives each implementation
one colour and marker in every panel and one legend that lists every series; so does every other suite's plot
(train, remat, decode, compiled kernels), drawn here from fresh random records."""

import json
import os
import random

import pytest
from matplotlib.container import BarContainer

from benchmarks import __main__ as cli
from benchmarks.report import plots
from benchmarks.report.build import rebuild_report


def _attn(impl, fw, pss, s, causal, ms, status="ok"):
    r = {
        "suite": "attention",
        "impl": impl,
        "framework": fw,
        "pass": pss,
        "dtype": "float32",
        "B": 1,
        "Hq": 2,
        "Hkv": 2,
        "Sq": s,
        "Sk": s,
        "D": 64,
        "causal": causal,
        "median_ms": None,
        "tflops": None,
        "peak_mem_bytes": None,
        "status": status,
        "reason": None if status == "ok" else "needs CUDA",
    }
    if status == "ok":
        r.update(median_ms=ms, p10_ms=0.9 * ms, p90_ms=1.3 * ms, tflops=1.0 / ms, iters=20)
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
                attn += [
                    _attn("chunked", "jax", pss, s, causal, 2.0),
                    _attn("xla", "jax", pss, s, causal, 4.0),
                    _attn("sdpa:math", "torch", pss, s, causal, 3.0),
                    _attn("sdpa:efficient", "torch", pss, s, causal, None, status="skipped"),
                ]
    _write(tmp_path, "attention", attn, "2026-01-02T00:00:00Z")
    _write(
        tmp_path,
        "model",
        [
            {
                "suite": "model",
                "preset": "tiny",
                "B": 4,
                "S": 128,
                "impl": "jaxattn",
                "framework": "jax",
                "pass": "fwd",
                "median_ms": 1.0,
                "tokens_per_s": 512000.0,
                "status": "ok",
            },
            {
                "suite": "model",
                "preset": "tiny",
                "B": 4,
                "S": 128,
                "impl": "torchref",
                "framework": "torch",
                "pass": "fwd",
                "median_ms": 2.5,
                "tokens_per_s": 204800.0,
                "status": "ok",
            },
        ],
        "2026-01-01T00:00:00Z",
    )
    return tmp_path


def test_report_rebuilds_markdown_and_plot_from_json(results, capsys):
    assert cli.main(["report", str(results)]) == 0
    assert "report.md" in capsys.readouterr().out
    text = (results / "report.md").read_text()
    assert "rebuilt by `python -m benchmarks report DIR`" in text and "cpu (synthetic)" in text
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


def test_run_and_rebuild_write_the_same_report_in_the_suites_order(results):
    """A rebuild is the report `run` wrote: same sections in `run`'s suite order (model before attention, whatever
    the files' names or times), same header; rebuilding twice changes nothing."""
    from benchmarks.report.build import write_report
    from benchmarks.suites import SUITES

    rebuild_report(str(results))  # draws the plots a run leaves beside its JSON
    rebuilt = (results / "report.md").read_text()
    model = json.loads((results / "model.json").read_text())  # this run measured `model`; attention is older
    write_report(str(results), {"model": model["records"]}, model["env"])
    written = (results / "report.md").read_text()
    sections = [line[3:] for line in written.splitlines() if line.startswith("## ")]
    assert sections == ["model", "attention"] == [s for s in SUITES if s in sections]
    assert written == rebuilt and "![attention plot](attention_tflops.png)" in written
    rebuild_report(str(results))
    assert (results / "report.md").read_text() == written


def test_report_refuses_dirs_without_timings(tmp_path):
    with pytest.raises(ValueError, match="holds no benchmark JSON"):
        rebuild_report(str(tmp_path))
    with pytest.raises(ValueError, match="is not a directory"):
        rebuild_report(str(tmp_path / "nope"))
    _write(tmp_path, "block_search", [{"impl": "flash"}], "2026-01-01T00:00:00Z")
    with pytest.raises(
        ValueError, match="only deviceless-compile results \\(block_search.json\\) without kernels.json"
    ):
        rebuild_report(str(tmp_path))
    assert not (tmp_path / "report.md").exists()
    # a `run --suite plan` directory: its plan.json is a suite like the others, so its table is rebuilt
    _write(
        tmp_path,
        "plan",
        [{"mesh": "fsdp=8", "impl": "sharding-plan", "framework": "jax", "status": "ok", "summary": "peak 1 GiB"}],
        "2026-01-01T00:00:00Z",
    )
    rebuild_report(str(tmp_path))
    assert "## plan" in (tmp_path / "report.md").read_text()
    with pytest.raises(SystemExit):
        cli.main(["report", str(tmp_path / "nope")])


def test_attention_plot_one_style_per_impl_and_a_legend_for_all(results, drawn):
    recs = json.loads((results / "attention.json").read_text())["records"]
    assert plots.plot_attention(str(results), recs)
    fig = drawn[-1]
    style = {}
    for ax in fig.axes:
        assert ax.get_legend() is None  # no per-panel legend that names only that panel's lines
        for line in ax.get_lines():
            if line.get_label().startswith("_"):  # an error bar's caps, not a series
                continue
            got = (line.get_color(), line.get_marker(), line.get_linestyle())
            assert style.setdefault(line.get_label(), got) == got, line.get_label()
    assert len(set(style.values())) == len(style) == 4  # distinct per implementation
    assert len(fig.legends) == 1
    assert (
        {t.get_text() for t in fig.legends[0].get_texts()}
        == set(style)
        == {"JAX chunked (O(S) memory)", "JAX XLA (plain jnp)", "torch SDPA math", "torch SDPA flash"}
    )


# --------------------------------------------------------------------------------------------- every suite's plot
def _train_records(rng):
    recs = []
    for toggle in ("baseline", "bf16", "remat_full", "attn_fast", "torch_compile", "adamw8bit"):
        for fw, impl in (("jax", "jaxattn"), ("torch", "torchref")):
            if toggle == "torch_compile" and fw == "jax":
                continue
            r = {
                "suite": "train",
                "toggle": toggle,
                "preset": "1b",
                "B": 1,
                "S": 2048,
                "framework": fw,
                "impl": impl,
                "status": "ok",
                "median_ms": rng.uniform(50, 500),
                "tokens_per_s": rng.uniform(1e3, 3e4),
            }
            if (toggle, fw) == ("attn_fast", "torch"):
                r.update(status="skipped", reason="flash SDPA needs CUDA", median_ms=None, tokens_per_s=None)
            recs.append(r)
    return recs, {"JAX (jaxattn)", "torch (torchref)"}


def _remat_records(rng):
    recs = []
    for pol in ("none", "save_dots", "full"):
        for fw, target in (("jax", "cpu"), ("jax", "h100"), ("torch", "cpu")):
            m = (
                {"temp_bytes": rng.uniform(1, 9) * 2**30, "residual_bytes": rng.uniform(1, 9) * 2**30}
                if fw == "jax"
                else {"saved_bytes": rng.uniform(1, 9) * 2**30, "peak_mem_bytes": None}
            )
            recs.append(
                {
                    "suite": "remat",
                    "framework": fw,
                    "impl": pol,
                    "target": target,
                    "preset": "1b",
                    "n_layers": 2,
                    "B": 1,
                    "S": 512,
                    "status": "ok",
                    "measured": m,
                    **({"label": "compiled for H100, not run"} if target == "h100" else {}),
                }
            )
    return recs, {
        "jax: XLA temp (cpu)",
        "jax: XLA temp (H100, compiled, not run)",
        "jax: saved residuals",
        "torch: saved for backward (cpu)",
    }


def _decode_records(rng):
    recs, labels = [], set()
    for fw, impl in (("jax", "jaxattn"), ("torch", "torchref"), ("torch", "torchref+compile")):
        for weights in ("fp32", "int8"):
            labels.add(f"{plots.READABLE[f'{fw}:{impl}']} {weights}")
            for b in (1, 4, 64):
                for pss in ("prefill", "decode"):
                    recs.append(
                        {
                            "suite": "decode",
                            "model": "tiny",
                            "weights": weights,
                            "B": b,
                            "prompt_len": 16,
                            "pass": pss,
                            "impl": impl,
                            "framework": fw,
                            "status": "ok",
                            "median_ms": 1.0,
                            "tokens_per_s": 10 ** rng.uniform(1, 5),
                        }
                    )
    return recs, labels


def _kernel_records(rng, part=None):
    recs = []
    for impl, kernels, dtypes in (
        ("flash", ("flash_fwd", "flash_bwd_dq", "flash_bwd_dkv"), ("bf16", "fp32")),
        ("mosaic", ("mosaic_fwd",), ("bf16",)),
    ):
        for d in (64, 128):
            for dt in dtypes:
                for k in kernels:
                    recs.append(
                        {
                            "impl": impl,
                            "kernel": k,
                            "head_dim": d,
                            "dtype": dt,
                            "B": 1,
                            "S": 256,
                            "Hq": 4,
                            "causal": True,
                            "label": "compiled for H100, not run",
                            "status": "ok",
                            "registers": rng.randint(64, 255),
                            "spill_stores": rng.choice([0, 0, 96]),
                            "spill_loads": rng.choice([0, 64]),
                            "smem_bytes": rng.randint(16, 200) * 1024,
                            **({"part": part, "framework": "jax"} if part else {}),
                        }
                    )
    if part:  # the compile suite's program records ride along and are not kernels
        recs.append(
            {
                "part": "program",
                "framework": "jax",
                "impl": "train_step",
                "kind": "train_step",
                "preset": "tiny",
                "status": "ok",
                "peak": 123456,
                "label": "compiled for H100, not run",
            }
        )
    return recs, {"flash bf16", "flash fp32", "mosaic bf16"}


def _attention_records(rng):
    recs = [
        _attn(impl, fw, pss, s, True, rng.uniform(0.1, 10))
        for impl, fw in (("flash", "jax"), ("xla", "jax"), ("sdpa:math", "torch"))
        for pss in ("fwd", "fwd_bwd")
        for s in (128, 512)
    ]
    return recs, {"JAX Pallas flash", "JAX XLA (plain jnp)", "torch SDPA math"}


SYNTHETIC = {
    "train": _train_records,
    "remat": _remat_records,
    "decode": _decode_records,
    "kernels": _kernel_records,
    "compile": lambda rng: _kernel_records(rng, part="kernel"),
    "attention": _attention_records,
}


@pytest.fixture
def drawn(monkeypatch):
    """The figures the plot functions close (the last one is the one just written)."""
    import matplotlib.pyplot as plt

    figs = []
    real_close = plt.close
    monkeypatch.setattr(plt, "close", lambda fig=None: figs.append(fig) or real_close(fig))
    return figs


@pytest.mark.parametrize("suite", sorted(SYNTHETIC))
def test_each_suite_plot_from_synthetic_records(tmp_path, drawn, suite):
    """Fresh random records -> a valid PNG named for the suite, a legend naming every series, one colour (and
    marker) per series in every panel, axis labels with units, a title naming the device, and "compiled, not
    run" wherever H100-compiled figures are drawn."""
    import matplotlib.image

    seed = random.randrange(2**32)
    records, expected = SYNTHETIC[suite](random.Random(seed))
    plot = plots.plot_suite(
        str(tmp_path), suite, records, {"jax_device": "Synthetic GPU 80GB", "target_device": "NVIDIA H100 80GB HBM3"}
    )
    assert plot is not None and plot.path == str(tmp_path / plots.PLOT_FILES[suite]), seed
    png = tmp_path / plots.PLOT_FILES[suite]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    img = matplotlib.image.imread(str(png))
    assert img.ndim == 3 and img.shape[0] > 300 and img.shape[1] > 500
    assert set(plot.labels) == expected, (seed, plot.labels)
    fig = drawn[-1]
    assert [t.get_text() for t in fig.legends[0].get_texts()] == list(plot.labels) and len(fig.legends) == 1
    title = fig._suptitle.get_text().replace("\n", " ")  # wrapped to the figure's width
    assert title.split() == plot.title.split()
    if suite in ("kernels", "compile", "remat"):
        assert "compiled, not run" in title, title
    assert ("NVIDIA H100 80GB HBM3" if suite in ("kernels", "compile") else "Synthetic GPU 80GB") in title, title
    style = {}
    for ax in [a for a in fig.axes if a.get_visible()]:
        assert ax.get_legend() is None  # one figure legend, none per panel
        assert ax.get_xlabel() and ax.get_ylabel()
        assert any(u in ax.get_ylabel() for u in ("tokens/s", "TFLOP/s", "GiB", "MiB", "registers", "bytes", "KiB"))
        got = [
            (line.get_label(), (line.get_color(), line.get_marker(), line.get_linestyle()))
            for line in ax.get_lines()
            if not line.get_label().startswith("_")
        ]
        got += [
            (c.get_label(), (tuple(c.patches[0].get_facecolor()), c.patches[0].get_hatch()))
            for c in ax.containers
            if isinstance(c, BarContainer)  # error bars are containers too, without a series label
        ]
        for label, st in got:
            assert style.setdefault(label, st) == st, (label, seed)
    assert set(style) == expected and len(set(style.values())) == len(style)  # distinct per series


def test_timing_plots_draw_p10_p90_error_bars_and_no_line_through_two_points(tmp_path, drawn):
    """The attention records keep p10/p90: each point gets an error bar spanning the throughput at the p90 and
    the p10 time; two sequence lengths per series: markers only, no line between them."""
    from matplotlib.container import ErrorbarContainer

    records, _ = _attention_records(random.Random(0))
    plots.plot_suite(str(tmp_path), "attention", records, {"jax_device": "cpu"})
    ax = next(a for a in drawn[-1].axes if a.get_visible())
    bars = [c for c in ax.containers if isinstance(c, ErrorbarContainer)]
    assert len(bars) == 3  # one per series
    segs = bars[0].lines[2][0].get_segments()
    (x, lo), (_, hi) = segs[0]
    r = next(r for r in records if r["Sk"] == x and r["impl"] == "flash" and r["pass"] == "fwd")
    assert abs(lo - r["tflops"] / 1.3) < 1e-9 and abs(hi - r["tflops"] / 0.9) < 1e-9
    assert all(line.get_linestyle() == "None" for line in ax.get_lines() if not line.get_label().startswith("_"))
    assert "p10-p90" in drawn[-1]._suptitle.get_text()


def test_unstable_pairs_are_drawn_hollow_and_the_title_says_so(tmp_path, drawn):
    """A point (line plot) or bar (train) whose record carries an ``unstable`` JAX-vs-torch pair is drawn hollow
    (white face, the series' colour as its edge); stable ones stay filled; the title explains the hollow marks."""
    from matplotlib.container import BarContainer

    records, _ = _attention_records(random.Random(2))
    weak = {"ratio": 0.5, "ci": [0.3, 0.9], "unstable": True}
    for r in records:
        if r["Sk"] == 512 and r["pass"] == "fwd" and r["impl"] in ("xla", "sdpa:math"):
            r["paired"] = weak
    plots.plot_suite(str(tmp_path), "attention", records, {"jax_device": "cpu"})
    fig = drawn[-1]
    ax = next(a for a in fig.axes if a.get_visible() and a.get_title().startswith("fwd,"))
    hollow = [ln for ln in ax.get_lines() if ln.get_markerfacecolor() == "white"]
    assert sorted(x for ln in hollow for x in ln.get_xdata()) == [512, 512]
    assert "hollow: an unstable JAX-vs-torch pair" in fig._suptitle.get_text().replace("\n", " ")
    other = next(a for a in fig.axes if a.get_visible() and a.get_title().startswith("fwd_bwd,"))
    assert not [ln for ln in other.get_lines() if ln.get_markerfacecolor() == "white"]

    records, _ = _train_records(random.Random(3))
    for r in records:
        if r["toggle"] == "bf16":
            r["paired"] = weak
    plots.plot_suite(str(tmp_path), "train", records, {"jax_device": "cpu"})
    ax = next(a for a in drawn[-1].axes if a.get_visible())
    bars = [c.patches[0] for c in ax.containers if isinstance(c, BarContainer)]
    faces = [tuple(b.get_facecolor()) for b in bars]
    assert faces.count((1.0, 1.0, 1.0, 1.0)) == 2  # the two bf16 bars (JAX and torch), nothing else


def test_remat_plot_picks_units_that_fit(tmp_path, drawn):
    records, _ = _remat_records(random.Random(1))
    small = [
        dict(r, measured={k: v / 4096 if k.endswith("_bytes") and v else v for k, v in r["measured"].items()})
        for r in records
        if r["target"] != "h100"
    ]  # quick sizes, no H100 bars
    plot = plots.plot_suite(str(tmp_path), "remat", small, {"jax_device": "cpu"})
    ax = next(a for a in drawn[-1].axes if a.get_visible())
    assert ax.get_ylabel() == "memory (MiB)" and "compiled, not run" not in plot.title


@pytest.mark.parametrize("suite", sorted(SYNTHETIC))
def test_no_plot_from_skipped_only_or_empty_records(tmp_path, suite):
    records, _ = SYNTHETIC[suite](random.Random())
    skipped = [dict(r, status="skipped", reason="not here") for r in records]
    assert plots.plot_suite(str(tmp_path), suite, skipped, {}) is None
    assert plots.plot_suite(str(tmp_path), suite, [], {}) is None
    assert list(tmp_path.iterdir()) == []


def test_report_links_every_plot_and_rebuilds_a_compile_dir(results, tmp_path):
    """`report` on a run directory links each suite's plot from report.md; on a `benchmarks compile` directory
    it rewrites that command's report with the kernel plot."""
    rng = random.Random()
    for suite in ("train", "decode", "remat"):
        _write(results, suite, SYNTHETIC[suite](rng)[0], "2026-01-03T00:00:00Z")
    assert cli.main(["report", str(results)]) == 0
    text = (results / "report.md").read_text()
    for suite in ("attention", "train", "decode", "remat"):
        assert f"]({plots.PLOT_FILES[suite]})" in text and (results / plots.PLOT_FILES[suite]).is_file()
    assert "## model" in text and not (results / "model.png").exists()  # no plot asked for the model suite

    compiled = tmp_path / "compiled"
    compiled.mkdir()
    env = {
        "jax_device": "cpu (synthetic)",
        "time_utc": "2026-01-01T00:00:00Z",
        "target": "h100",
        "quick": True,
        "plugin": "0.0",
        "ptxas": "x",
        "target_device": "NVIDIA H100 80GB HBM3",
    }
    recs = _kernel_records(rng)[0]
    for r in recs:
        r.update(threads=128, stack=0, blocks_per_sm=1, occupancy=0.125, sass=None)
    recs[0].update(dtype="bf16", ptx_counts={"setmaxnreg": 2, "wgmma": 32, "wgmma.commit_group": 4, "bar.sync": 15})
    (compiled / "kernels.json").write_text(json.dumps({"env": env, "suite": "kernels", "records": recs}))
    # the other deviceless tools' JSON in the same folder (suite_memory, block_search) keep it a compile report
    mem = [{"suite": "model", "row": "125m fwd", "jax_gib": 1.5}]
    (compiled / "suite_memory.json").write_text(json.dumps({"env": env, "suite": "suite_memory", "records": mem}))
    written = rebuild_report(str(compiled))
    assert sorted(os.path.basename(p) for p in written) == ["kernels.png", "report.md"]
    text = (compiled / "report.md").read_text()
    assert text.startswith("# Compiled for H100, not run") and "`flash_bwd_dkv`" in text
    assert text.rstrip().endswith("![kernels plot](kernels.png)")
    pipeline = text[text.index("## Hopper pipelining") :].splitlines()
    r = recs[0]
    counts = "2 | 32 | 4 / 0 | 0 | 0 | 0 / 0 | 15"  # setmaxnreg, wgmma, commit / wait, TMA, cp.async, mbarrier, bar
    assert f"| {r['impl']} | `{r['kernel']}` | {r['head_dim']} | {r['registers']} | {counts} |" in pipeline


def test_kernel_plot_limits_are_the_h100_limits():
    """The reference lines of the kernel plot (the report room's own constants) are kernel_stats' H100 limits."""
    from benchmarks.tools.kernel_stats import H100_LIMITS

    assert plots.KERNEL_LIMITS == {k: H100_LIMITS[k] for k in plots.KERNEL_LIMITS}
