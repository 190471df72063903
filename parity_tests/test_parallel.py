"""``torchref.parallel`` under ``torchrun`` (2 processes, gloo, CPU): DDP, FSDP2, tensor parallel and FSDP+TP give
the one-process losses and gradient norms within 1e-5 over 3 AdamW steps with clipping (one launch for all modes,
``parity_tests/parallel_child.py``). With 2 processes the 2-D ``fsdp+tp`` mesh is (dp=1, tp=2)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("torch")
HERE = os.path.dirname(os.path.abspath(__file__))
MODES = ("ddp", "fsdp", "tp", "fsdp+tp")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("parallel") / "out.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           os.path.join(HERE, "parallel_child.py"), ",".join(MODES), str(out)],
                          env=env, capture_output=True, text=True, timeout=300, cwd=os.path.dirname(HERE))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("mode", MODES)
def test_parallel_mode_matches_one_process(mode, results):
    ref_losses, ref_norms = results["reference"]
    losses, norms = results[mode]
    assert len(losses) == 3
    np.testing.assert_allclose(losses, ref_losses, rtol=0, atol=1e-5)
    np.testing.assert_allclose(norms, ref_norms, rtol=0, atol=1e-5)


def test_bad_mode_and_tp_divisibility():
    import torch
    from jaxattn.spec.config import ModelConfig
    from torchref import parallel

    with pytest.raises(ValueError, match=r"parallel mode 'zero' is not known; use one of \('ddp', 'fsdp', 'tp'"):
        parallel.parallelize(torch.nn.Linear(2, 2), "zero", None)
    with pytest.raises(ValueError, match=r"ModelConfig.n_kv_heads=2 is not divisible by the tensor-parallel size tp=4"):
        parallel._check_tp(ModelConfig.preset("tiny"), 4)


@pytest.mark.parametrize("mode", ["fsdp", pytest.param("ddp", marks=pytest.mark.slow),
                                  pytest.param("tp", marks=pytest.mark.slow)])
def test_cli_parallel_under_torchrun_matches_one_process(mode, tmp_path):
    """``torchrun --nproc-per-node 2 -m torchref.train --parallel MODE`` logs the one-process losses within 1e-5
    (packed synthetic data: the ranks hold different numbers of real targets, so each divides its loss sum by
    the WHOLE batch's count / dp — ``torchref.trainer.Run.denominator``)."""
    from torchref import trainer

    argv = ["--steps", "2", "--seq-len", "16", "--batch-size", "4", "--no-progress"]
    single = trainer.run(argv)["losses"]
    log = tmp_path / "log.jsonl"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "-m", "torchref.train", "--parallel", mode, "--log-json", str(log), *argv],
                          env=env, capture_output=True, text=True, timeout=300, cwd=os.path.dirname(HERE))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    losses = [json.loads(line)["loss"] for line in log.read_text().splitlines()]
    np.testing.assert_allclose(losses, single, rtol=0, atol=1e-5)
