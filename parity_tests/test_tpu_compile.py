"""Compile for a TPU without one (``jaxattn.tpu_target``, ``python -m benchmarks compile --target v5e``): splash
attention forward+backward and the tiny model's programs compiled for one v5e chip with libtpu's topology, their
records and report, jax's and tokamax's TPU attention beside splash; skipped, naming the extra, where libtpu is not
installed (``.ci/run`` installs it)."""

import json

import pytest

from jaxattn import tpu_target

needs_libtpu = pytest.mark.skipif(
    tpu_target.unavailable_reason() is not None, reason=f"{tpu_target.unavailable_reason()}"
)


def test_unavailable_reason_names_the_extra(monkeypatch):
    monkeypatch.setattr(tpu_target, "_version", lambda dist: None)
    reason = tpu_target.unavailable_reason()
    assert "libtpu is not installed" in reason and "tpu-compile" in reason
    with pytest.raises(RuntimeError, match="cannot compile for a TPU without one: libtpu"):
        tpu_target.devices("v5e")
    with pytest.raises(ValueError, match="chip must be one of"):
        tpu_target.devices("v4x")


def test_unavailable_reason_names_both_versions_when_libtpu_does_not_match_jax(monkeypatch):
    import jax

    monkeypatch.setattr(tpu_target, "_version", lambda dist: "0.0.1")
    monkeypatch.setattr(tpu_target, "_libtpu_wanted", lambda: "==0.0.42.*")
    reason = tpu_target.unavailable_reason()
    assert reason == f"libtpu 0.0.1 is installed, jax {jax.__version__} wants libtpu==0.0.42.* (pip install " + (
        f"'jax[tpu]=={jax.__version__}')"
    )
    monkeypatch.setattr(tpu_target, "_version", lambda dist: "0.0.42.1")
    assert tpu_target.unavailable_reason() is None


@pytest.mark.slow
@pytest.mark.tpu_compile
@needs_libtpu
def test_peers_compile_beside_splash_for_a_v5e_chip():
    """The TPU kernel table's peers: splash is three Mosaic TPU kernels (forward, dq, dkv), jax's Pallas TPU
    flash_attention three too, XLA's attention none and the S×S scores in scratch; tokamax's (where installed)
    wraps splash with a fused dq+dkv backward: two."""
    from benchmarks.tools import tpu_compile as tc
    from benchmarks.tools.deviceless import AttnShape

    impls = ("splash", "pallas.ops.tpu:flash", "xla", "tokamax:mosaic")
    cases = [(impl, 128, "bf16") for impl in impls]
    devs = tpu_target.devices("v5e")[:1]
    recs = {r["impl"]: r for r in tc.kernel_records(devs, cases, AttnShape(1, 4096, 4, 4), "v5e", log=lambda *a: None)}
    assert all(r["status"] in ("ok", "skipped") for r in recs.values()), [r.get("error") for r in recs.values()]
    assert recs["splash"]["tpu_custom_calls"] == recs["pallas.ops.tpu:flash"]["tpu_custom_calls"] == 3
    assert recs["xla"]["tpu_custom_calls"] == 0
    scores = 4 * 4096 * 4096 * 4  # one float32 [H, S, S] tensor
    assert recs["xla"]["temp"] >= scores > recs["splash"]["temp"]
    tk = recs["tokamax:mosaic"]
    if tk["status"] == "skipped":
        assert "tokamax is not installed" in tk["reason"]
    else:
        assert tk["status"] == "ok" and tk["tpu_custom_calls"] == 2, tk


@pytest.mark.slow  # the CLI's files; splash compiled for TPU chips stays in the default (the plan test); CI runs it
@pytest.mark.slow_feature
@pytest.mark.tpu_compile
@needs_libtpu
def test_compile_for_v5e_writes_splash_and_program_records(tmp_path):
    from benchmarks.report.build import rebuild_report
    from benchmarks.tools.compile import main

    assert main(["--target", "v5e", "--quick", "--out", str(tmp_path)]) == 0
    kernels = json.loads((tmp_path / "tpu_kernels.json").read_text())
    programs = json.loads((tmp_path / "tpu_programs.json").read_text())
    assert kernels["env"]["target_device"] == "TPU v5 lite" and kernels["env"]["hbm_bytes"] == 16 * 2**30
    (k,) = kernels["records"]
    assert k["status"] == "ok" and k["impl"] == "splash" and k["tpu_custom_calls"] >= 3  # fwd, dq, dkv
    # libtpu 0.0.50 (jax 0.12) keeps this tiny kernel's scratch out of XLA's temp (0 B); 0.0.42 reported some
    assert 0 <= k["temp"] < k["peak"] and k["label"] == "compiled for v5e, not run"
    for r in programs["records"]:
        assert r["status"] == "ok" and r["attention"] == "splash" and r["tpu_custom_calls"] >= 1, r
        assert r["fits"] and 0 < r["peak"] <= r["hbm_bytes"] and r["xla_flops"] > 0
        assert r["compiler_estimate_s"] is None or r["compiler_estimate_s"] > 0
    text = (tmp_path / "report.md").read_text()
    assert "# Compiled for v5e, not run" in text and "| 128 | bf16 |" in text and "compiler estimate" in text
    rebuild_report(str(tmp_path))
    assert (tmp_path / "report.md").read_text() == text  # `python -m benchmarks report DIR` writes the same


def test_tpu_session_script_parses_and_refuses_an_unknown_step():
    import subprocess

    script = "benchmarks/tools/tpu_session.sh"
    assert subprocess.run(["bash", "-n", script]).returncode == 0
    r = subprocess.run(["bash", script, "nope"], capture_output=True, text=True, env={"OUT": "/nonexistent/x"})
    assert r.returncode == 2 and "unknown step 'nope'; steps: tests attention model train decode compile" in r.stderr


def test_refused_for_memory_reads_the_tpu_compilers_refusal():
    err = RuntimeError(
        "RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO temporaries (40.60G) "
        "exceeds available HBM (15.75G)."
    )
    assert tpu_target.refused_for_memory(err) == (40.60, 15.75)
    assert tpu_target.refused_for_memory(RuntimeError("INTERNAL: something else")) is None


def test_readme_sections_show_tpu_programs_and_pods_that_do_not_fit(tmp_path, monkeypatch):
    """The README's TPU and plan tables come from the committed JSON: a program or plan the TPU compiler refused
    shows what the compiler said it needs and "no"."""
    from benchmarks.report import readme

    env = {"jax": "9.9", "libtpu": "0.0.1", "target": "v5e", "hbm_bytes": 16 * 2**30}
    splash = {"status": "ok", "head_dim": 128, "dtype": "bf16", "tpu_custom_calls": 3, "temp": 2**20}
    ok = {"status": "ok", "preset": "tiny", "kind": "train_step", "loss": "dense", "batch": 2, "seq": 128}
    ok.update(peak=2**30, hbm_bytes=16 * 2**30, fits=True, compiler_estimate_s=0.002)
    refused = dict(ok, status="does_not_fit", preset="8b", required_temp_gib=181.95, fits=False)
    (tmp_path / "v5e-compiled").mkdir()
    for name, recs in (("tpu_kernels", [splash]), ("tpu_programs", [ok, refused])):
        (tmp_path / "v5e-compiled" / f"{name}.json").write_text(json.dumps({"env": env, "records": recs}))
    plan = {
        "status": "does_not_fit",
        "target": "v5e",
        "topology": "16x16",
        "mesh": "fsdp=256",
        "preset": "70b",
        "batch": 256,
        "seq": 4096,
        "remat": "full",
        "loss": "dense",
        "required_temp_gib": 30.5,
    }
    (tmp_path / "h100-plan").mkdir()
    (tmp_path / "h100-plan" / "plan.json").write_text(json.dumps({"env": env, "records": [plan]}))
    monkeypatch.setattr(readme, "RESULTS", str(tmp_path))
    text = "\n".join(readme.tpu_section())
    assert "| v5e | 3 / 1.0 | tiny train_step | dense | 2×128 | 1.00 / 16.00 | yes | 2 |" in text
    assert "| 8b train_step | dense | 2×128 | needs 181.95 / 16.00 (refused) | no | — |" in text
    text = "\n".join(readme.plan_section())
    assert "| v5e `16x16` | `fsdp=256` | 70b | 256×4096 | full | dense | needs 30.5 (refused) | — | no |" in text


@pytest.mark.tpu_compile
@needs_libtpu
def test_plan_compiles_for_tpu_chips_with_splash():
    """The plan suite's pod rows, at a size CI affords: the tiny step sharded fsdp=4 over a v5p host (4 chips)."""
    from benchmarks.suites import plan

    devs = plan._pod_devices("v5p", "2x2x1")
    assert len(devs) == 4 and devs[0].platform == "tpu"
    rec = plan.compile_plan(devs, "fsdp=4", "tiny", 4, 128, target="v5p", topology="2x2x1")
    assert rec["attention"] == "splash" and rec["target"] == "v5p" and rec["devices"] == 4
    assert rec["device_memory_bytes"] == 95 * 2**30 and rec["label"] == "compiled for v5p, not run"
    assert 0 < rec["measured"]["per_device_memory"]["peak"] < 2**30
    # the collectives read out of the TPU program follow the same FSDP formulas as the GPU one (test_plan.py):
    # weights gathered in the forward and again in the backward, gradients reduce-scattered (the TPU compiler
    # writes those as fusions calling an all-reduce + slice, and puts the layer loop's collectives in fusions)
    import jax
    import numpy as np
    from flax import nnx

    from jaxattn.config import ModelConfig
    from jaxattn.model import Llama

    cfg = ModelConfig.preset("tiny")
    model = nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0)))
    n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    got = {k: v["bytes_per_step"] / n for k, v in rec["measured"]["collectives"].items()}
    table = cfg.vocab_size * cfg.dim / n  # the embedding table's share of the parameters
    # gradients: the TPU compiler all-reduces some where the GPU one reduce-scatters (the float32 embedding gradient),
    # so their sum is what the formula fixes
    assert got["reduce-scatter"] + got["all-reduce"] == pytest.approx(2 * (1 - table) + 4 * table, rel=0.01), got
    # weights, plus small gathers besides them (the token ids among them; 3.4% of N more at tiny)
    assert 1.0 <= got["all-gather"] / (4 * (1 - table) + 2 * table) <= 1.05, got
    assert rec["measured"]["collectives"]["all-gather"]["ops_in_loop"] > 0


@pytest.mark.tpu_compile
@needs_libtpu
def test_mesh_axes_that_do_not_fit_the_torus_split_physical_axes():
    """data=8 x fsdp=8 on a 4x4x4 v5p slice: no physical axis holds 8 chips, so jax.make_mesh refuses; make_mesh
    lets an axis span two physical ones instead, every chip once."""
    from jaxattn import sharding

    devs = tpu_target.devices("v5p", "4x4x4")
    mesh = sharding.make_mesh("data=8,fsdp=8", devices=devs)
    assert dict(mesh.shape) == {"stage": 1, "data": 8, "fsdp": 8, "expert": 1, "tensor": 1}
    assert sorted(d.id for d in mesh.devices.flat) == sorted(d.id for d in devs)


@pytest.mark.slow
@pytest.mark.tpu_compile
@needs_libtpu
def test_block_search_tells_which_splash_blocks_fit_the_scoped_vmem():
    """The search's knob and reading at its hardest case: D=256 float32 on v5e, where a 1024 block overflows the
    scoped VMEM (the compiler's CompileTimeScopedVmemOom) and 512 fits, which is the cap VMEM_CAPS holds."""
    from benchmarks.tools import tpu_compile as tc
    from jaxattn.attention import splash

    devs = tpu_target.devices("v5e")[:1]
    recs = tc.block_search(devs, [(256, "fp32")], "v5e", blocks=(1024, 512), log=lambda *a: None)
    assert [(r["block"], r["status"]) for r in recs] == [(1024, "vmem_oom"), (512, "ok")], recs
    assert tc.vmem_caps(recs) == {(256, "float32"): 512} and recs[1]["temp"] > 0
    assert splash.vmem_cap(256, "float32", devs[0].device_kind) == 512
