"""``python -m parity_tests.diff``, the porting debugger: it captures every named intermediate of both twins without
changing them, its float64 reference is really float64, correct twins pass (fp32, bf16, fp16, a mixed policy, a
Pallas backend; tiny, a transformers-written GQA Llama, SmolLM2), a planted bug is found at its layer and tensor in
either twin, bad input is one line, and the README's section is the committed record's.

Why correct twins give ratios near 1: both make rounding errors of the same size against the float64 run, measured
in units of the dtype's unit roundoff (``diff.rounding_error``); the tests below assert the tiny model's worst ratio
is under §7's one-op rule (2), stricter than the tool's whole-model default (4, see ``diff``'s docstring).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

import jaxattn  # noqa: F401  (first: quiet jax where the CUDA plugin is installed)
from parity_tests import diff
from parity_tests.test_examples import ROOT, _env, _init_line, example

RECORDS = os.path.join(ROOT, "benchmarks", "results", "porting-diff")
IDS = "3 17 250 4 99 42 7 7 128 5 61"  # 11 tokens of tiny's 256-id vocabulary


def _run(tmp_path, *argv: str) -> tuple[int, dict]:
    out = tmp_path / "diff.json"
    rc = diff.main([*argv, "--json", str(out)])
    return rc, json.loads(out.read_text())


def _key(row) -> tuple:
    return row["tensor"], row["layer"]


def test_tiny_fp32_every_intermediate_and_gradient_is_captured_and_within_rounding(tmp_path, capsys):
    rc, rec = _run(tmp_path, "--preset", "tiny", "--tokens", IDS, "--grads")
    out = capsys.readouterr().out
    assert rc == 0 and rec["passed"] and rec["first_mismatch"] is None
    n = rec["n_layers"]
    forward = [("embed", None)] + [(k, i) for i in range(n) for k in diff.LAYER_KINDS]
    forward += [("final_norm", None), ("logits", None)]
    grads = [_key(r) for r in rec["rows"] if r["tensor"].startswith("grad ")]
    assert [_key(r) for r in rec["rows"][: len(forward)]] == forward
    assert len(grads) == 9 * n + 3 and ("grad self_attn.q_proj", 1) in grads and ("grad lm_head", None) in grads
    assert max(r["ratio"] for r in rec["rows"]) < diff.KERNEL_RULE
    # fp32 rounding is a few units: neither twin is exact, neither is far
    assert all(r["torch_err"] < 50 and r["jax_err"] < 50 for r in rec["rows"])
    assert all(0 < r["torch_err"] and 0 < r["jax_err"] for r in rec["rows"] if r["tensor"] != "embed")
    shapes = {_key(r): r["shape"] for r in rec["rows"]}
    assert shapes[("q_rope", 0)] == [1, 11, 4, 16] and shapes[("k_rope", 0)] == [1, 11, 2, 16]
    assert shapes[("attn_output", 1)] == [1, 11, 64] and shapes[("logits", None)] == [1, 11, 256]
    assert f"all {len(rec['rows'])} tensors within 4x the rounding floor" in out.splitlines()[-1]


def test_capture_gives_the_models_own_numbers_and_restores_everything():
    """The captured logits are the plain models' (bit for bit), and every wrapped name, hook and
    ``Tensor.float`` is back afterwards."""
    import jaxattn.model as jm
    import torchref.model as tm
    from benchmarks.twins import jitted, twin_models
    from torchref.config import ModelConfig

    ids = np.asarray([[int(t) for t in IDS.split()]])
    tmodel, jmodel = twin_models(ModelConfig.preset("tiny"), seed=1)

    def wrapped():  # every name the captures wrap or patch
        return (
            jm.checkpoint_name,
            jm.dot_product_attention,
            jm.decoder_layer,
            jm.Llama.features,
            tm.dot_product_attention,
            torch.Tensor.float,
        )

    before = wrapped()
    t_out, j_out = diff.capture_torch(tmodel, ids), diff.capture_jax(jmodel, ids)
    ref = diff.capture_torch(tmodel.double(), ids)
    assert before == wrapped()
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in tmodel.modules())
    with torch.no_grad():
        assert np.array_equal(t_out[("logits", None)], tmodel.float()(torch.as_tensor(ids)).double().numpy())
    assert np.array_equal(j_out[("logits", None)], np.asarray(jitted(jmodel)(ids), np.float64))
    assert set(t_out) == set(j_out) == set(ref)
    # The reference is float64 through the norms (their .float() upcasts kept float64): its final norm is an
    # independent float64 RMSNorm of its last layer's output to 1e-12, far below float32's 6e-8.
    x = ref[("decoder_layer_output", 1)]
    w = tmodel.model.norm.weight.detach().double().numpy()
    norm = w * x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + tmodel.config.norm_eps)
    assert np.abs(norm - ref[("final_norm", None)]).max() < 1e-12 * np.abs(norm).max()


def test_compare_marks_a_ratio_just_past_the_tolerance_and_blames_the_worse_twin(rng):
    """``ok`` is ``ratio <= tolerance`` at its edge: one twin 3 units of roundoff off the reference and the other
    exact gives ratio 3 (the floor is one unit); it passes a tolerance of 4 and fails one of 2.5; ``worse`` names it."""
    u = 2.0**-24
    ref = rng.standard_normal((4, 8))
    scale = np.abs(ref) + np.sqrt(np.mean(ref**2))
    off = ref + 3 * u * scale  # every element 3 units off, relative to its own size: rounding_error = 3
    assert diff.rounding_error(off, ref, u) == pytest.approx(3.0, rel=1e-6)
    for torch_out, jax_out, worse in ((off, ref, "torch"), (ref, off, "jax")):
        for tol, ok in ((4.0, True), (2.5, False)):
            (row,) = diff.compare({("x", 0): torch_out}, {("x", 0): jax_out}, {("x", 0): ref}, unit_roundoff=u,
                                  tolerance=tol)  # fmt: skip
            assert row["ratio"] == pytest.approx(3.0, rel=1e-6) and row["ok"] is ok and row["worse"] == worse
    assert diff.first_mismatch([{"ok": True}, {"ok": False, "i": 1}, {"ok": False, "i": 2}])["i"] == 1


def test_planted_rope_bug_in_torchs_layer_1_is_named(tmp_path, monkeypatch, capsys):
    """The issue's demo: RoPE's sin with the wrong sign in layer 1 of the torch twin (its low-precision run, not the
    float64 reference) -> the first mismatch is layer 1's q after RoPE, torch's, exit 1; everything before passes."""
    import torchref.model as tm

    real, calls = tm.apply_rope, [0]

    def wrong_in_layer_1(x, cos, sin):
        if x.dtype == torch.float64:
            return real(x, cos, sin)
        layer = calls[0] // 2 % 2  # twice per layer (q, k), tiny has 2 layers
        calls[0] += 1
        return real(x, cos, -sin if layer == 1 else sin)

    monkeypatch.setattr(tm, "apply_rope", wrong_in_layer_1)
    rc, rec = _run(tmp_path, "--preset", "tiny", "--tokens", IDS, "--grads")
    first = rec["first_mismatch"]
    assert rc == 1 and not rec["passed"]
    assert (first["tensor"], first["layer"], first["worse"]) == ("q_rope", 1, "torch") and first["ratio"] > 1e3
    rows = rec["rows"]
    assert all(r["ok"] for r in rows[: rows.index(first)])
    assert "first mismatch: layer 1 q_rope: torch's error" in capsys.readouterr().out
    # --plant-rope-bug 1 is the same bug: the same rows
    monkeypatch.setattr(tm, "apply_rope", real)
    rc2, rec2 = _run(tmp_path, "--preset", "tiny", "--tokens", IDS, "--grads", "--plant-rope-bug", "1")
    assert rc2 == 1 and rec2["rows"] == rows


def test_planted_output_projection_bug_is_named_at_its_projection_not_the_mlp(tmp_path, monkeypatch):
    """A bug in layer 1's attention output projection (torch's o_proj output 1% too large, its low-precision run
    only) is named there: the first mismatch is layer 1's ``o_proj``, torch's, and everything before it passes
    (with no tap after ``o_proj`` it surfaced at the next tap, layer 1's MLP input)."""
    import torchref.model as tm

    real_attention, real_linear = tm.LlamaAttention.forward, torch.nn.Linear.forward
    state = {"calls": 0, "o_proj": None}

    def attention(self, *args, **kw):
        layer = state["calls"] % 2  # tiny has 2 layers: calls alternate 0, 1
        state["calls"] += 1
        state["o_proj"] = self.o_proj if layer == 1 and self.o_proj.weight.dtype != torch.float64 else None
        return real_attention(self, *args, **kw)

    def linear(self, x):
        y = real_linear(self, x)
        return y * 1.01 if self is state["o_proj"] else y

    monkeypatch.setattr(tm.LlamaAttention, "forward", attention)
    monkeypatch.setattr(torch.nn.Linear, "forward", linear)
    rc, rec = _run(tmp_path, "--preset", "tiny", "--tokens", IDS)
    first = rec["first_mismatch"]
    assert rc == 1 and (first["tensor"], first["layer"], first["worse"]) == ("o_proj", 1, "torch"), first
    rows = rec["rows"]
    assert all(r["ok"] for r in rows[: rows.index(first)])
    assert [_key(r) for r in rows[rows.index(first) - 1 : rows.index(first) + 2]] == [
        ("attn_output", 1),
        ("o_proj", 1),
        ("attention_residual", 1),
    ]


def test_planted_rope_bug_in_jax_is_named(tmp_path, monkeypatch):
    import jaxattn.model as jm

    real = jm.apply_rope
    monkeypatch.setattr(jm, "apply_rope", lambda x, cos, sin: real(x, cos, -sin))
    rc, rec = _run(tmp_path, "--preset", "tiny", "--tokens", IDS)
    first = rec["first_mismatch"]
    assert rc == 1 and (first["tensor"], first["layer"], first["worse"]) == ("q_rope", 0, "jax")
    assert [r["ok"] for r in rec["rows"][:4]] == [True] * 4  # embed, q/k/v projections: before RoPE


@pytest.mark.parametrize(
    "flags",
    [
        ("--dtype", "bf16", "--grads"),
        ("--dtype", "fp16"),
        ("--precision-policy", "bf16", "--backend", "flash"),  # JAX's Pallas kernel (interpreted), torch SDPA flash
    ],
    ids=["bf16", "fp16", "bf16-policy-flash"],
)
def test_low_precision_correct_twins_pass(tmp_path, flags):
    rc, rec = _run(tmp_path, "--preset", "tiny", "--tokens", IDS, *flags)
    assert rc == 0 and rec["compute_dtype"] in ("bfloat16", "float16")
    assert max(r["ratio"] for r in rec["rows"]) < diff.KERNEL_RULE
    if "--backend" in flags:
        assert rec["backend"] == {"jax": "flash", "torch": "flash"}


def test_a_transformers_gqa_llama_directory(tmp_path):
    """A Llama written by ``transformers`` itself (GQA 6:2, untied head, perturbed norms), loaded by each twin's own
    loader, fp32 with gradients."""
    from parity_tests.twins import hf_llama_dir

    hf_llama_dir(
        tmp_path / "hf",
        seed=0,
        vocab_size=300,
        hidden_size=96,
        intermediate_size=200,
        num_hidden_layers=3,
        num_attention_heads=6,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    )
    rc, rec = _run(tmp_path, "--init", str(tmp_path / "hf"), "--tokens", "1 5 7 9 200 13 4 4 8 299", "--grads")
    assert rc == 0 and rec["n_layers"] == 3 and len(rec["rows"]) == 1 + 12 * 3 + 2 + 9 * 3 + 3  # 12 taps a layer
    assert max(r["ratio"] for r in rec["rows"]) < diff.KERNEL_RULE
    shapes = {_key(r): r["shape"] for r in rec["rows"]}
    assert shapes[("k_proj", 2)] == [1, 10, 32] and shapes[("grad self_attn.k_proj", 2)] == [32, 96]


@pytest.mark.slow  # 35 s; the committed records (test_readme_section_is_the_committed_record) are this run's
def test_smollm2_bf16_passes_and_a_planted_bug_is_found_at_its_layer(tmp_path):
    from parity_tests.twins import smollm2_path

    gguf = smollm2_path()  # skips, naming the wheel, where it is absent
    rc, rec = _run(tmp_path, "--init", gguf, "--dtype", "bf16")
    assert rc == 0 and rec["n_layers"] == 30 and len(rec["rows"]) == 363
    rc, rec = _run(tmp_path, "--init", gguf, "--plant-rope-bug", "7")
    first = rec["first_mismatch"]
    assert rc == 1 and (first["tensor"], first["layer"], first["worse"]) == ("q_rope", 7, "torch")
    assert all(r["ok"] for r in rec["rows"][: rec["rows"].index(first)])


BAD = [
    (["--init", "no/such/dir"], "--init 'no/such/dir': no such directory or .gguf file"),
    (["--preset", "tiny", "--init", "x"], "argument --init: not allowed with argument --preset"),
    (["--preset", "tiny", "--tokens", "1,x"], "--tokens '1,x': integers separated by commas or spaces"),
    (["--preset", "tiny", "--tokens", "256"], "--tokens: id 256 is outside the model's vocabulary [0, 256)"),
    (["--preset", "tiny", "--tokens", " "], "--tokens ' ': give at least one token id"),
    (["--preset", "tiny", "--text", ""], "--text '': encodes to no tokens"),
    (["--preset", "tiny", "--tokens", "5", "--grads"], "--grads: the next-token loss needs at least 2 tokens"),
    (["--preset", "tiny", "--dtype", "bf16", "--precision-policy", "bf16"], "give one"),
    (["--preset", "tiny", "--plot", "d.jpg"], "--plot 'd.jpg': must end in .png"),
    (["--preset", "tiny", "--json", ""], "--json '': an empty path"),
    (["--preset", "tiny", "--backend", "nope"], "--backend: unknown attention backend 'nope'"),
    (
        ["--preset", "tiny", "--torch-backend", "mosaic"],
        "--torch-backend: 'mosaic' (Pallas Mosaic GPU) has no torch twin",
    ),
    (["--preset", "tiny", "--backend", "chunked"], "--backend chunked: torch cannot run this attention backend here"),
    (["--preset", "tiny", "--backend", "mosaic", "--torch-backend", "xla"], "--backend mosaic: JAX cannot run"),
    (["--preset", "tiny", "--plant-rope-bug", "2"], "--plant-rope-bug 2: the model's layers are 0..1"),
    (["--preset", "tiny", "--tolerance", "nan"], "--tolerance nan: must be a finite number >= 1"),
    (["--preset", "moe-tiny"], "--preset moe-tiny: a Mixture-of-Experts model (model_type 'mixtral', 4 experts)"),
]


@pytest.mark.parametrize("argv,message", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_input_is_one_line_and_exit_2(argv, message, tmp_path, capsys):
    if "--json" not in argv:
        argv = [*argv, "--json", str(tmp_path / "d.json")]
    assert diff.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("python -m parity_tests.diff: error: ") and message in err[0], err
    assert not (tmp_path / "d.json").exists()


def _gpt2_dir(tmp_path) -> str:
    """A GPT-2 directory: another architecture's config.json (and a weights file)."""
    import safetensors.numpy

    d = tmp_path / "gpt2"
    d.mkdir()
    hf = {"model_type": "gpt2", "vocab_size": 50257, "n_embd": 768, "n_layer": 12, "n_head": 12}
    (d / "config.json").write_text(json.dumps(hf))
    safetensors.numpy.save_file({"wte.weight": np.zeros((4, 4), np.float32)}, str(d / "model.safetensors"))
    return str(d)


def _saved_tiny(tmp_path, preset="tiny", nan=None) -> str:
    """A preset's random weights saved by torchref; ``nan``: the HF tensor given a NaN."""
    from torchref import hf as thf
    from torchref.config import ModelConfig
    from torchref.model import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(ModelConfig.preset(preset))
    if nan is not None:
        with torch.no_grad():
            dict(model.named_parameters())[nan].view(-1)[3] = float("nan")
    return thf.save_pretrained(model, str(tmp_path / preset))


BAD_CHECKPOINTS = [
    (_gpt2_dir, ["model_type='gpt2'", "supported are llama, mistral, "]),
    (
        lambda t: _saved_tiny(t, nan="model.layers.1.mlp.up_proj.weight"),
        ["non-finite weights", "model.layers.1.mlp.up_proj.weight (1 NaN, 0 inf of 10240)"],
    ),
    (lambda t: _saved_tiny(t, "moe-tiny"), ["a Mixture-of-Experts model (model_type 'mixtral', 4 experts)"]),
]


@pytest.mark.parametrize("build,fragments", BAD_CHECKPOINTS, ids=["gpt2", "nan-weights", "moe"])
def test_bad_checkpoint_is_one_line_and_exit_2(build, fragments, tmp_path, capsys):
    """Another architecture, non-finite weights and an MoE are refused naming the checkpoint, not compared."""
    path = build(tmp_path)
    assert diff.main(["--init", path, "--tokens", "1 2 3", "--json", str(tmp_path / "d.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"python -m parity_tests.diff: error: --init {path!r}: "), err
    assert all(f in err[0] for f in fragments), err
    assert not (tmp_path / "d.json").exists()


def test_plot_and_json_are_written(tmp_path):
    rc = diff.main(["--preset", "tiny", "--tokens", IDS, "--plant-rope-bug", "1", "--plot", str(tmp_path / "d.png")])
    assert rc == 1 and (tmp_path / "d.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ----------------------------------------------------------------------------------------------------- README
def test_readme_section_is_the_committed_record():
    """The README's table excerpt and verdict lines are ``format_table`` of the committed record, and its command is
    the one that wrote it (with ``runs/`` paths)."""
    rec = json.load(open(os.path.join(RECORDS, "smollm2-rope-bug.json")))
    assert rec["plant_rope_bug"] == 7 and rec["first_mismatch"]["layer"] == 7
    table = diff.format_table(rec["rows"], rec["tolerance"]).splitlines()
    readme = open(os.path.join(ROOT, "README.md")).read()
    m = re.search(r"<!-- diff-excerpt -->\n```text\n(.*?)```", readme, re.S)
    assert m, "README.md has no <!-- diff-excerpt --> block"
    excerpt = [line for line in m.group(1).splitlines() if line.strip() and line.strip() != "..."]
    assert len(excerpt) >= 6 and all(line in table for line in excerpt), [x for x in excerpt if x not in table]
    assert table[-1] in excerpt  # the verdict line
    assert "benchmarks/results/porting-diff/smollm2-rope-bug.png" in readme
    bf16 = json.load(open(os.path.join(RECORDS, "smollm2-bf16.json")))
    band = [r for r in bf16["rows"] if r["ratio"] > diff.KERNEL_RULE]
    assert bf16["passed"] and bf16["dtype"] == "bf16" and len(bf16["rows"]) == 635 and "635 tensors, exit 0" in readme
    named = [("grad input_layernorm", 9), ("grad input_layernorm", 14), ("grad self_attn.k_proj", 19)]
    assert [(r["tensor"], r["layer"]) for r in band] == named and "three rows exceed 2, all gradients" in readme
    at = {(r["tensor"], r["layer"]): f"{r['ratio']:.2f}" for r in band}
    assert f"layer 14's `input_layernorm` gradient at {at[named[1]]}, layer 9's at {at[named[0]]}" in readme
    assert f"layer 19's `k_proj` gradient at {at[named[2]]}" in readme
    fp32 = json.load(open(os.path.join(RECORDS, "smollm2-fp32.json")))
    forward = [r for r in fp32["rows"] if not r["tensor"].startswith("grad ")]
    grads = [r for r in fp32["rows"] if r["tensor"].startswith("grad ")]
    assert not fp32["passed"] and all(r["ok"] for r in forward) and all(r["worse"] == "torch" for r in grads)
    ratios = sorted(r["ratio"] for r in grads)
    assert len(grads) == 272 and f"{ratios[0]:.2f}–{ratios[-1]:.2f}× JAX's error" in readme
    top = max(forward, key=lambda r: r["ratio"])
    assert top["tensor"] == "logits" and f"({top['ratio']:.2f} at the logits, its largest)" in readme
    assert f"({sum(r > 4 for r in ratios)} above 4)" in readme
    assert os.path.isfile(os.path.join(RECORDS, "smollm2-rope-bug.png"))


@pytest.mark.slow  # 14 s: a subprocess trains both twins; CI runs it with the slow_feature set
@pytest.mark.slow_feature
def test_readme_example_tiny_line_runs_as_written(tmp_path):
    """The block's tiny-init line, as written (runs/ under tmp), exits 0; the SmolLM2 lines run under slow."""
    subprocess.run(["bash", "-c", _init_line()], cwd=tmp_path, env=_env(), check=True, timeout=300)
    _, code = example("porting-diff")
    line = next(x for x in code.splitlines() if x.startswith("python -m parity_tests.diff --init runs/tiny-init"))
    proc = subprocess.run(
        ["bash", "-c", line.replace("runs/", f"{tmp_path}/runs/")],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "tensors within 4x the rounding floor" in proc.stdout


@pytest.mark.slow
def test_readme_example_runs_as_written(tmp_path):
    """The whole block: the tiny line exits 0, the planted-bug line exits 1 and reproduces the committed record's
    first mismatch, the plot and JSON appear under runs/."""
    from parity_tests.twins import smollm2_path

    smollm2_path()
    subprocess.run(["bash", "-c", _init_line()], cwd=tmp_path, env=_env(), check=True, timeout=300)
    _, code = example("porting-diff")
    prelude, rcs = [], []
    for line in (x for x in code.splitlines() if x.strip() and not x.startswith(("pip ", "#"))):
        line = line.split("  # ")[0].replace("runs/", f"{tmp_path}/runs/")
        if not line.startswith("python -m parity_tests.diff"):
            prelude.append(line)
            continue
        script = "\n".join([*prelude, line])
        proc = subprocess.run(["bash", "-c", script], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=900)
        assert proc.returncode in (0, 1), proc.stderr[-3000:]
        rcs.append(proc.returncode)
    assert rcs == [0, 1]
    committed = json.load(open(os.path.join(RECORDS, "smollm2-rope-bug.json")))
    fresh = json.load(open(tmp_path / "runs" / "diff-bug.json"))
    assert _key(fresh["first_mismatch"]) == _key(committed["first_mismatch"])
    assert [r["ok"] for r in fresh["rows"]] == [r["ok"] for r in committed["rows"]]
    assert (tmp_path / "runs" / "diff-bug.png").is_file()


def test_help_names_every_flag():
    proc = subprocess.run(
        [sys.executable, "-m", "parity_tests.diff", "--help"], cwd=ROOT, env=_env(), capture_output=True, text=True
    )
    assert proc.returncode == 0
    for flag in ("--init", "--preset", "--tokens", "--text", "--dtype", "--precision-policy", "--grads", "--backend"):
        assert flag in proc.stdout
