"""``torchref.parallel`` under ``torchrun`` (2 processes, gloo, CPU): DDP, FSDP2, tensor parallel and FSDP+TP give
the one-process losses and gradient norms within 1e-5 over 3 AdamW steps with clipping (one launch for all modes,
``parity_tests/parallel_child.py``). With 2 processes the 2-D ``fsdp+tp`` mesh is (dp=1, tp=2)."""

from __future__ import annotations

import json
import os
import re

import numpy as np
import pytest

pytest.importorskip("torch")

from parity_tests.twins import assert_exports_agree, jsonl_losses, torchrun  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
MODES = ("ddp", "fsdp", "tp", "fsdp+tp")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("parallel") / "out.json"
    torchrun(os.path.join(HERE, "parallel_child.py"), ",".join(MODES), str(out))
    return json.loads(out.read_text())


@pytest.mark.parametrize("mode", MODES)
def test_parallel_mode_matches_one_process(mode, results):
    ref_losses, ref_norms = results["reference"]
    losses, norms = results[mode]
    assert len(losses) == 3
    np.testing.assert_allclose(losses, ref_losses, rtol=0, atol=1e-5)
    np.testing.assert_allclose(norms, ref_norms, rtol=0, atol=1e-5)


def test_adamw8bit_refuses_column_shards(results):
    """Tensor parallel's column shards would cut AdamW8bit's blocks across ranks: its step refuses them, naming the
    shape, the placements and what it takes."""
    assert re.search(
        r"AdamW8bit: a DTensor parameter of shape \[\d+, \d+\] with placements \(Shard\(dim=1\),\) on a 1-D mesh of 2 "
        r"ranks .*its 8-bit blocks take the rows of a 1-D mesh \(FSDP2's Shard\(0\)\)",
        results["adamw8bit_tp"],
    ), results["adamw8bit_tp"]


def test_bad_mode_and_tp_divisibility():
    import torch

    from torchref import parallel
    from twincore.config import ModelConfig

    with pytest.raises(ValueError, match=r"parallel mode 'zero' is not known; use one of \('ddp', 'fsdp', 'tp'"):
        parallel.parallelize(torch.nn.Linear(2, 2), "zero", None)
    with pytest.raises(ValueError, match=r"offload=True needs an FSDP mode \('fsdp', 'fsdp\+tp'\), got mode 'ddp'"):
        parallel.parallelize(torch.nn.Linear(2, 2), "ddp", None, offload=True)
    with pytest.raises(ValueError, match=r"ModelConfig.n_kv_heads=2 is not divisible by the tensor-parallel size tp=4"):
        parallel._check_tp(ModelConfig.preset("tiny"), 4)


@pytest.mark.parametrize(
    "mode",
    [
        pytest.param("fsdp", marks=pytest.mark.slow),  # fsdp with one more flag, below, in CI's slow_feature run
        pytest.param("ddp", marks=pytest.mark.slow),
        pytest.param("tp", marks=pytest.mark.slow),
        pytest.param("fsdp+tp", marks=pytest.mark.slow),
        pytest.param("fsdp --offload-optimizer", marks=(pytest.mark.slow, pytest.mark.slow_feature)),
        pytest.param(  # the fused loss under FSDP2 = the dense loss of one process
            "fsdp --loss fused --loss-chunk 24", marks=(pytest.mark.slow, pytest.mark.slow_feature)
        ),
        pytest.param("ddp --loss fused", marks=pytest.mark.slow),
    ],
)
def test_cli_parallel_under_torchrun_matches_one_process(mode, tmp_path):
    """``torchrun --nproc-per-node 2 -m torchref.train --parallel MODE`` logs the one-process losses within 1e-5
    (packed synthetic data: the ranks hold different numbers of real targets, so each divides its loss sum by
    the WHOLE batch's count / dp — ``torchref.train.Trainer.denominator``), and the one-process ``--eval-data``
    loss over the same number of targets (each rank scores its rows; tensor-parallel copies divided out)."""
    from torchref import train as trainer
    from twincore.runlog import read_log

    held_out = tmp_path / "held-out.txt"
    held_out.write_text(open("README.md", encoding="utf-8").read()[:600], encoding="utf-8")
    argv = ["--steps", "2", "--seq-len", "16", "--batch-size", "4", "--no-progress", "--eval-data", str(held_out)]
    single = trainer.run(argv)
    log = tmp_path / "log.jsonl"
    torchrun("-m", "torchref.train", "--parallel", *mode.split(), "--log-json", str(log), *argv)
    np.testing.assert_allclose(jsonl_losses(log), single["losses"], rtol=0, atol=1e-5)
    (got,), (want,) = read_log(str(log), "eval"), single["evals"]
    assert got["eval_tokens"] == want["eval_tokens"] and abs(got["eval_loss"] - want["eval_loss"]) <= 1e-5


@pytest.mark.slow  # 2 x 6 s; CI runs it (slow_feature)
@pytest.mark.slow_feature
@pytest.mark.parametrize("optimizer", ["adafactor", "adamw8bit"])
def test_ddp_runs_the_optimizers_that_refuse_dtensors(optimizer, tmp_path):
    """torch's Adafactor fails on DTensor parameters and our AdamW8bit takes only fsdp's row shards, so the CLI
    refuses them with the other modes but ddp and pp (``test_trainer``'s bad flags); under ddp they log the
    one-process losses within 1e-5."""
    from torchref import train as trainer

    argv = ["--steps", "2", "--seq-len", "16", "--batch-size", "4", "--no-progress", "--optimizer", optimizer]
    single = trainer.run(argv + ["--num-workers", "0"])
    log = tmp_path / "log.jsonl"
    torchrun("-m", "torchref.train", "--parallel", "ddp", "--log-json", str(log), *argv)
    np.testing.assert_allclose(jsonl_losses(log), single["losses"], rtol=0, atol=1e-5)


def test_fsdp_runs_adamw8bit_with_the_one_process_blocks(results):
    """AdamW8bit on FSDP2's row shards (2 ranks): each rank updates its rows with the 8-bit blocks of those rows (the
    tiny preset's shards are whole blocks), so the losses and gradient norms are the one-process run's within 1e-5 and
    every weight agrees within AdamW's rounding bound (all but < 0.1% of entries to 1e-5; lr 1e-3, 3 steps). The
    8-bit codes and absmaxes are DTensors split by rows like their parameters (what a checkpoint's full state dict
    gathers into the one-process state: ``test_fsdp_adamw8bit_checkpoint_resumes_in_one_process``)."""
    run = results["adamw8bit_fsdp"]
    np.testing.assert_allclose(run["fsdp"], run["reference"], rtol=0, atol=1e-5)
    for name, (largest, share) in run["weights"].items():
        assert largest <= 2 * 1e-3 * 3 and share < 1e-3, (name, largest, share)
    assert len(run["states"]) == 4 * 12 and set(run["states"]) == {"rows"}, run["states"]  # 12 weights of >= 4096


@pytest.mark.slow  # 15 s: a torchrun run, then a resume in one process; CI runs it (slow_feature)
@pytest.mark.slow_feature
def test_fsdp_adamw8bit_checkpoint_resumes_in_one_process(tmp_path):
    """The CLI's ``--parallel fsdp --optimizer adamw8bit`` logs the one-process losses. Its 8-bit state is DTensors
    row-sharded like the parameters, so the checkpoint's full state dict gathers the one-process codes and absmaxes:
    ONE process resumes it at step 2 and logs the one-process losses to step 4 within 1e-5, and both exports agree
    within AdamW's rounding bound."""
    from torchref import train as trainer

    argv = ["--seq-len", "16", "--batch-size", "4", "--no-progress", "--optimizer", "adamw8bit", "--lr", "1e-3"]
    argv += ["--schedule", "constant"]
    ck, log = tmp_path / "ck", tmp_path / "log.jsonl"
    torchrun(
        "-m", "torchref.train", "--parallel", "fsdp", "--log-json", str(log), "--steps", "4",
        "--checkpoint-dir", str(ck), "--checkpoint-every", "2", "--keep-checkpoints", "2", *argv,
    )  # fmt: skip
    os.remove(ck / "torchref-step-00000004.pt")  # resume from step 2, in one process
    resumed = trainer.run(["--steps", "4", "--resume", "--checkpoint-dir", str(ck), *argv])
    ref = trainer.run(["--steps", "4", "--checkpoint-dir", str(tmp_path / "ref"), *argv])
    assert resumed["start"] == 2
    np.testing.assert_allclose(jsonl_losses(log), ref["losses"], rtol=0, atol=1e-5)
    np.testing.assert_allclose(resumed["losses"], ref["losses"][2:], rtol=0, atol=1e-5)
    assert_exports_agree(ck / "final", tmp_path / "ref" / "final", lr=1e-3, steps=4)


@pytest.mark.slow  # 13 s: a torchrun run, then a resume in one process; CI runs it (slow_feature)
@pytest.mark.slow_feature
def test_torchrun_checkpoint_resumes_in_one_process_and_exports(tmp_path):
    """A ``--parallel fsdp`` run under ``torchrun`` (2 ranks) saves full state dicts by parameter name (rank 0
    writes); ONE process resumes it to step 3 and matches a one-process run throughout (losses within 1e-5, the
    exported weights within AdamW's rounding bound, ``twins.assert_exports_agree``); ``--profile`` writes one trace per
    rank; only rank 0 logs."""
    from torchref import train as trainer

    argv = ["--seq-len", "16", "--batch-size", "4", "--no-progress", "--schedule", "constant", "--lr", "1e-3"]
    ck, log = tmp_path / "ck", tmp_path / "log.jsonl"
    torchrun(
        "-m",
        "torchref.train",
        "--parallel",
        "fsdp",
        "--log-json",
        str(log),
        "--steps",
        "4",
        "--checkpoint-dir",
        str(ck),
        "--checkpoint-every",
        "2",
        "--keep-checkpoints",
        "2",
        "--profile",
        str(tmp_path / "prof"),
        *argv,
    )
    parallel_losses = jsonl_losses(log)
    traces = [f for f in os.listdir(tmp_path / "prof") if f.endswith(".pt.trace.json")]
    assert len(traces) == 2, traces  # one per rank (tensorboard_trace_handler names them host_pid)
    os.remove(ck / "torchref-step-00000004.pt")  # resume from step 2, in one process
    resumed = trainer.run(["--steps", "4", "--resume", "--checkpoint-dir", str(ck), *argv])
    ref = trainer.run(["--steps", "4", "--checkpoint-dir", str(tmp_path / "ref"), *argv])
    assert resumed["start"] == 2
    np.testing.assert_allclose(parallel_losses, ref["losses"], rtol=0, atol=1e-5)
    np.testing.assert_allclose(resumed["losses"], ref["losses"][2:], rtol=0, atol=1e-5)
    assert_exports_agree(ck / "final", tmp_path / "ref" / "final", lr=1e-3, steps=4)


@pytest.mark.slow
@pytest.mark.slow_feature
def test_sharded_jax_and_sharded_torch_agree(tmp_path):
    """The same ``--init`` checkpoint and data: ``python -m jaxattn.train --mesh data=2,fsdp=2,tensor=2`` (8 CPU
    devices, in this process) and ``torchrun --nproc-per-node 2 -m torchref.train --parallel fsdp+tp`` (dp=1 x
    tp=2) log the same losses and ``--eval-data`` losses at the training tolerance (fp32, §7's 1e-4 for a full-model
    forward)."""
    from benchmarks.twins import twin_models
    from jaxattn import train as jt
    from torchref.config import ModelConfig
    from torchref.hf import save_pretrained

    tm, _ = twin_models(ModelConfig.preset("tiny", n_kv_heads=2), seed=1)
    init = save_pretrained(tm, tmp_path / "init")
    held_out = tmp_path / "held-out.txt"
    held_out.write_text(open("README.md", encoding="utf-8").read()[:600], encoding="utf-8")
    argv = [
        "--eval-data",
        str(held_out),
        "--init",
        str(init),
        "--data",
        "README.md",
        "--steps",
        "4",
        "--seq-len",
        "16",
        "--batch-size",
        "4",
        "--lr",
        "3e-3",
        "--no-progress",
    ]
    log = tmp_path / "torch.jsonl"
    proc = torchrun("-m", "torchref.train", "--parallel", "fsdp+tp", "--log-json", str(log), *argv)
    # FSDP2's "returned a view tensor" warning is silenced where it is a false alarm (torchref/parallel.py): the
    # losses below, equal to JAX's, are the evidence that the gradients are right
    assert "returned a view tensor" not in proc.stderr
    torch_losses = jsonl_losses(log)
    jax_out = jt.run(argv + ["--mesh", "data=2,fsdp=2,tensor=2"])
    jax_losses = jax_out["losses"]
    assert len(torch_losses) == len(jax_losses) == 4
    np.testing.assert_allclose(jax_losses, torch_losses, rtol=0, atol=1e-4)
    from twincore.runlog import read_log

    (t_eval,), (j_eval,) = read_log(str(log), "eval"), jax_out["evals"]
    assert t_eval["eval_tokens"] == j_eval["eval_tokens"] == len(held_out.read_bytes()) - 1
    assert abs(t_eval["eval_loss"] - j_eval["eval_loss"]) <= 1e-4
