"""README.md's results section is generated from the committed JSON (``python -m benchmarks.readme``), never typed."""

import json
import os
import random
import statistics

import pytest

from benchmarks.report import readme


def test_results_section_matches_the_committed_json():
    with open(readme.README) as f:
        text = f.read()
    assert text == readme.splice(text, readme.render()), (
        "README.md's results section does not match the committed JSON under benchmarks/results/ (the benchmark "
        "commands write to the untracked benchmarks/results/local/ by default, so running them cannot cause this). "
        "If you changed a committed file there or the section on purpose, run `python -m benchmarks.readme` and "
        "commit README.md with the JSON; if not, `git checkout -- README.md benchmarks/results` restores both."
    )


def test_splice_replaces_only_between_the_markers_and_needs_them():
    text = f"head\n{readme.BEGIN}\nold\n{readme.END}\ntail\n"
    assert readme.splice(text, "new\n") == f"head\n{readme.BEGIN}\nnew\n{readme.END}\ntail\n"
    with pytest.raises(ValueError, match="markers"):
        readme.splice("no markers here", "x")


def _write_suite(tmp_path, suite, records, when):
    env = {
        "jax_device": "cpu (x86_64)",
        "torch_device": "cpu",
        "jax": "9.9.1",
        "torch": "8.8.2+cpu",
        "time_utc": when,
        "quick": True,
    }
    (tmp_path / f"{suite}.json").write_text(json.dumps({"env": env, "suite": suite, "records": records}))


def test_cpu_quick_section_is_built_from_the_json_with_torch_over_jax_time(tmp_path):
    """Fresh random times: the section's speed-up must be the median / min / max over the paired rows of the
    fastest torch median over the fastest JAX median (report.md's column), never JAX/torch or a mean."""
    rng = random.Random()
    recs, expected = [], []
    for s in (64, 128, 256, 512, 1024, 2048):  # an even number of paired rows: the median is a mean of two
        jax_ms = [rng.uniform(1.0, 2.0), rng.uniform(1.0, 2.0)]  # two JAX impls: the fastest counts
        torch_ms = rng.uniform(2.5, 9.0)
        recs += [
            dict(
                suite="model",
                S=s,
                **{"pass": "fwd"},
                framework="jax",
                impl="a",
                median_ms=jax_ms[0],
                tokens_per_s=s / jax_ms[0],
            ),
            dict(suite="model", S=s, **{"pass": "fwd"}, framework="jax", impl="b", median_ms=jax_ms[1]),
            dict(suite="model", S=s, **{"pass": "fwd"}, framework="torch", impl="ref", median_ms=torch_ms),
            dict(
                suite="model",
                S=s,
                **{"pass": "fwd"},
                framework="torch",
                impl="slow",
                status="skipped",
                reason="not here",
            ),
        ]
        expected.append(torch_ms / min(jax_ms))
    recs.append(dict(suite="model", S=4096, **{"pass": "fwd"}, framework="jax", impl="a", median_ms=0.5))  # unpaired
    _write_suite(tmp_path, "model", recs, "2031-01-02T03:04:05Z")
    _write_suite(
        tmp_path,
        "plan",
        [dict(suite="plan", framework="jax", impl="fsdp", mesh="fsdp=8", measured={"peak": 1})],
        "2031-01-02T03:09:00Z",
    )
    (tmp_path / "attention_tflops.png").write_bytes(b"")  # no attention JSON: not linked
    text = "\n".join(readme.cpu_quick_section(str(tmp_path)))
    row = next(line for line in text.splitlines() if line.startswith("| model |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1] == "S, pass" and cells[2] == "a, b vs ref" and cells[3] == "6 (not paired)"  # rows (unstable)
    want = f"{statistics.median(expected):.2f}× / {min(expected):.2f}× / {max(expected):.2f}×"
    assert cells[4] == want, (cells[4], want)
    assert cells[5] == "— / —" and cells[6] == "—"  # no p10/p90, no load average in these records
    assert statistics.median(expected) > 1  # torch is slower by construction: the inverse ratio would fail here
    assert "jax 9.9.1, torch 8.8.2+cpu" in text and "cpu (x86_64)" in text
    assert "runs started 2031-01-02T03:04:05Z to 2031-01-02T03:09:00Z" in text and "not a GPU result" in text
    assert "- `plan`: JAX only" in text and "attention_tflops.png" not in text
    assert readme.cpu_quick_section(str(tmp_path / "missing")) == []


def test_setup_times_come_from_the_committed_record():
    """The README's two "N min M s measured" figures are the set-up commands' seconds in
    ``benchmarks/results/setup-times/setup_times.json``, in the README's order (main job, then tests)."""
    import re

    recs = json.load(open("benchmarks/results/setup-times/setup_times.json", encoding="utf-8"))["records"]
    text = open("README.md", encoding="utf-8").read()
    quoted = [int(m) * 60 + int(sec) for m, sec in re.findall(r"(\d+) min (\d+) s measured", text)]
    assert quoted == [round(r["seconds"]) for r in recs], (quoted, [r["seconds"] for r in recs])


def test_gpu_attention_section_from_several_runs(tmp_path):
    """The GPU attention table: TFLOP/s of every implementation per shape and the speed-ups (torch time / JAX
    time of each side's fastest among the named implementations, median / min / max over the shapes), forward and
    forward+backward, from two runs of the suite in one folder; nothing for a folder without GPU records."""
    rng = random.Random()
    impls = {"a": ("flash", "sdpa:flash"), "b": ("mosaic", "cudnn", "jax.nn:cudnn", "sdpa:cudnn")}
    shapes = [(s, c, p) for s in (512, 1024, 2048) for c in (False, True) for p in ("fwd", "fwd_bwd")]
    times = {(shape, impl): rng.uniform(0.5, 3.0) for shape in shapes for ii in impls.values() for impl in ii}
    for name, names in impls.items():
        recs = [
            dict(
                suite="attention",
                impl=impl,
                framework="torch" if impl.startswith("sdpa") else "jax",
                **{"pass": p},
                dtype="bfloat16",
                B=2,
                Hq=4,
                Hkv=4,
                Sq=s,
                Sk=s,
                D=128,
                causal=c,
                median_ms=times[(s, c, p), impl],
                tflops=100.0 / times[(s, c, p), impl],
                status="ok",
            )
            for s, c, p in shapes
            for impl in names
        ]
        env = dict(jax_device="NVIDIA H200", torch_device="NVIDIA H200", jax_backend="gpu", jax="9.1", torch="8.2")
        env["time_utc"] = f"2031-01-01T00:0{len(name)}:{'05' if name == 'b' else '00'}Z"
        (tmp_path / f"attention-{name}.json").write_text(
            json.dumps({"env": env, "suite": "attention", "records": recs})
        )
    text = "\n".join(readme.gpu_attention_section(str(tmp_path)))
    assert "### Attention on one NVIDIA H200 (measured)" in text and "jax 9.1" in text and "torch 8.2" in text
    assert "`attention-a.json` (`flash`, `sdpa:flash`; 2031-01-01T00:01:00Z)" in text
    head = next(line for line in text.splitlines() if line.startswith("| D | S |"))
    assert head.endswith(
        "| ours: flash | ours: mosaic | ours: cudnn | jax.nn:cudnn | torch sdpa:flash | torch sdpa:cudnn |"
    )
    row = next(line for line in text.splitlines() if line.startswith("| 128 | 1024 | 2 × 4 | yes | forward+backward |"))
    t = {impl: times[(1024, True, "fwd_bwd"), impl] for ii in impls.values() for impl in ii}
    want = [f"{100.0 / t[i]:.0f}" for i in ("flash", "mosaic", "cudnn", "jax.nn:cudnn", "sdpa:flash", "sdpa:cudnn")]
    assert row.strip("|").split("|")[5:] == [f" {w} " for w in want]

    def speedup(jax_names, torch_names, p):
        r = [
            min(times[(s, c, p), i] for i in torch_names) / min(times[(s, c, p), i] for i in jax_names)
            for s, c, pp in shapes
            if pp == p
        ]
        return f"{statistics.median(r):.2f}× ({min(r):.2f}–{max(r):.2f}), {len(r)} shapes"

    torch_all = ("sdpa:flash", "sdpa:cudnn")
    lines = {line.split(" | ")[0][2:]: line for line in text.splitlines() if line.startswith("| ")}
    for label, j, tt in (
        ("our best Pallas kernel / torch's best", ("flash", "mosaic"), torch_all),
        ("JAX's best (cuDNN included) / torch's best", ("flash", "mosaic", "cudnn", "jax.nn:cudnn"), torch_all),
        ("JAX cuDNN (ours: `cudnn`) / torch cuDNN (`sdpa:cudnn`)", ("cudnn",), ("sdpa:cudnn",)),
    ):
        assert lines[label] == f"| {label} | {speedup(j, tt, 'fwd')} | {speedup(j, tt, 'fwd_bwd')} |"
    assert readme.gpu_attention_section(str(tmp_path / "missing")) == []
    for f in tmp_path.glob("*.json"):  # the same records measured on a CPU: not a GPU table
        d = json.loads(f.read_text())
        d["env"]["jax_backend"] = "cpu"
        f.write_text(json.dumps(d))
    assert readme.gpu_attention_section(str(tmp_path)) == []


def test_readme_says_which_gpu_ran_what():
    """With the committed H100 and H200 records the README shows their tables and says what each session left out."""
    text = readme.render()
    assert "### Attention on one NVIDIA H200 (measured)" in text
    assert "No GPU has run this code yet" not in text
    assert "Suites have run on a GPU (NVIDIA H100 80GB HBM3, NVIDIA H200: the first tables below)" in text
    for suite in ("Model", "Train", "Decode"):  # the H100 session's suites, each with its set-up and its gaps
        assert f"### {suite} suite on one NVIDIA H100 80GB HBM3 (measured)" in text
    assert "JAX computes fp32 dots in TF32 and torch in full fp32" in text
    assert "no `torch.compile`d decode step was measured here" in text
    # H100: model, train, attention (not decode); H200: model in `model.json` (moe-350m ran again alone). The H200's
    # decode stopped at its own budget, so its rows say they were skipped, and why (from the committed record)
    assert text.count("the session's time budget stopped the suite") == 4
    with open(os.path.join(readme.ROOT, "benchmarks", "results", "nvidia-h200", "decode.json")) as f:
        skipped = [r for r in json.load(f)["records"] if r.get("status") == "skipped"]
    assert skipped and f"Note: {len(skipped)} rows skipped ({skipped[0]['reason']})." in text
    assert "stopped the suite in `model.json`: the rows that run had not reached are not in it" in text
    assert (
        "From `benchmarks/results/nvidia-h200/model-moe-350m.json`, `benchmarks/results/nvidia-h200/model.json`" in text
    )


def test_citations_resolve_to_the_design_doc():
    """Every "§N" in the code and docs names a section of docs/design.md, and nothing cites a design file the
    repository does not have (the frozen training text in benchmarks/data/ is data, not a citation)."""
    import re
    import subprocess

    stale = "CONVEN" + "TIONS"  # the old design file's name, spelled so that this test does not cite it
    files = subprocess.run(
        ["git", "ls-files", "*.py", "*.md", "*.sh", "*.toml"], capture_output=True, text=True, check=True
    ).stdout.split()
    files = [f for f in files if not f.startswith(("benchmarks/data/", "benchmarks/results/"))]
    sections = set(re.findall(r"^## (\d+)\. ", open("docs/design.md", encoding="utf-8").read(), re.M))
    bad = []
    for f in files:
        text = open(f, encoding="utf-8").read()
        if stale in text:
            bad.append(f"{f}: cites {stale} (the design is docs/design.md)")
        bad += [
            f"{f}: §{n} is not a section of docs/design.md" for n in re.findall(r"§ ?(\d+)", text) if n not in sections
        ]
    assert sections and not bad, bad


def test_gpu_device_time_section_splits_the_off_gpu_time_when_a_trace_has_it(tmp_path):
    """README's "On the GPU itself": from the newest traced kernel_profile file, device TFLOP/s and off-GPU µs per
    row; a file with the per-call timeline adds each side's launch / tail and the frameworks' floor call."""
    import shutil

    from benchmarks.report import readme as rr

    src = os.path.join(rr.ROOT, "benchmarks", "results", "nvidia-h200", "kernel_profile-call3.json")
    shutil.copy(src, tmp_path / "kernel_profile.json")
    plain = rr.gpu_device_time_section(str(tmp_path))
    assert plain and "launch / tail" not in "\n".join(plain) and "smallest synchronized call" not in "\n".join(plain)
    with open(src) as f:
        res = json.load(f)
    for row in res["rows"]:
        for name, rec in row["variants"].items():
            if rec.get("kernels"):  # JAX's tail 300 µs, torch's 20; launches 40 / 10
                jax_side = name.startswith("jax")
                rec["timeline"] = dict(aligned=True, calls=3, launch_us=40.0 if jax_side else 10.0, busy_us=1.0)
                rec["timeline"] |= dict(gaps_us=0.0, tail_us=300.0 if jax_side else 20.0)
    add = {"median_s": 60e-6, "timeline": dict(aligned=True, calls=3, launch_us=25.0, busy_us=2.0, gaps_us=0.0)}
    res["floor"] = {"variants": {"jax:add": dict(add, timeline=dict(add["timeline"], tail_us=33.0))}}
    res["floor"]["variants"]["torch:add"] = {"median_s": 15e-6, "timeline": {"aligned": False, "reason": "x"}}
    with open(tmp_path / "kernel_profile.json", "w") as f:
        json.dump(res, f)
    lines = rr.gpu_device_time_section(str(tmp_path))
    table = [ln for ln in lines if ln.startswith("| ")]
    assert table[0].endswith("| launch / tail µs: JAX cudnn | torch |")
    assert len(table) == len([ln for ln in plain if ln.startswith("| ")]) > 2
    assert all(ln.endswith("| launch 40 / tail 300 | launch 10 / tail 20 |") for ln in table[1:]), table
    assert lines[-1].startswith(
        "The smallest synchronized call of each framework (`x + 1` on 1024 float32 values): JAX 60 µs (launch 25 / "
        "tail 33), torch 15 µs. Launch: from the call to its first kernel"
    ), lines[-1]
