"""A trainer's checkpoint directory (``twincore.rundir``, used by both ``Checkpointer`` twins and trainers):
only what the run wrote is ever deleted, another run's directory is refused, a corrupt latest checkpoint is skipped
for the previous valid one, and a diverged run stops with exit 1 and writes nothing of its weights.

The command-line refusals (another run's directory, changed run flags, a directory in use, unwritable paths) are
rows of ``test_bad_inputs.py``; here are the library cases and the runs that train.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from twincore.rundir import MARKER, RunDir, RunDirError
from twincore.runlog import read_log

torch = pytest.importorskip("torch")

from jaxattn.checkpoint import Checkpointer as JaxCheckpointer  # noqa: E402
from torchref.checkpoint import Checkpointer as TorchCheckpointer  # noqa: E402

RUN = {"seed": 0, "data": "synthetic", "batch_size": 2}


# ------------------------------------------------------------------------------------------------ the two writers
class _Jax:
    """Checkpointer adapter: ``save(step, value)`` / ``load(step) -> value`` over either twin."""

    def __init__(self, path, **kw):
        self.ck = JaxCheckpointer(str(path), **kw)

    def save(self, step, value):
        self.ck.save(step, {"w": np.full(4, float(value), np.float32)}, {"step": step})

    def load(self, step):
        tree, _ = self.ck.restore(step, {"w": np.zeros(4, np.float32)})
        return float(np.asarray(tree["w"])[0])

    def files(self, step):
        return [
            os.path.join(dp, n) for dp, _, ns in os.walk(os.path.join(self.ck.directory, f"step_{step}")) for n in ns
        ]


class _Torch:
    def __init__(self, path, **kw):
        self.ck = TorchCheckpointer(str(path), **kw)

    def save(self, step, value):
        self.ck.save(step, {"w": torch.full((4,), float(value))})

    def load(self, step):
        return float(self.ck.load(step)["w"][0])

    def files(self, step):
        return [self.ck.path(step)]


TWINS = {"jax": _Jax, "torch": _Torch}


def _flip(path, n=64):
    """Flip ``n`` bytes in the middle of ``path`` (a disk or copy error)."""
    data = bytearray(open(path, "rb").read())
    mid = max(0, len(data) // 2 - n // 2)
    for i in range(mid, min(len(data), mid + n)):
        data[i] ^= 0xFF
    open(path, "wb").write(bytes(data))


# ------------------------------------------------------------------------------------------------ RunDir
def test_prune_keeps_numeric_user_folders_and_files(tmp_path, twin):
    for name in ("3", "99", "step_notes.txt"):
        (tmp_path / name).mkdir() if name.isdigit() else (tmp_path / name).write_text("mine")
    (tmp_path / "3" / "data.bin").write_bytes(b"user data")
    ck = TWINS[twin](tmp_path, keep=2, run=RUN)
    for step in range(1, 6):
        ck.save(step, step)
    assert ck.ck.all_steps() == [4, 5] and ck.load(4) == 4.0
    assert (tmp_path / "3" / "data.bin").read_bytes() == b"user data"
    assert (tmp_path / "99").is_dir() and (tmp_path / "step_notes.txt").read_text() == "mine"


def test_a_new_run_refuses_another_runs_directory_and_overwrite_removes_only_its_files(tmp_path, twin):
    ck = TWINS[twin](tmp_path, keep=3, run=RUN)
    ck.save(1, 1)
    ck.save(2, 2)
    written = ck.files(2)
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(RunDirError, match=r"is in use by another trainer"):  # the writer holds the lock until closed
        TWINS[twin](tmp_path, keep=3, run=RUN)
    ck.ck.close()
    with pytest.raises(
        RunDirError, match=r"holds the checkpoints of another run .*steps \[1, 2\].*--resume.*--overwrite"
    ):
        TWINS[twin](tmp_path, keep=3, run=RUN)
    if twin == "jax":  # a file of the user's inside a step folder: the folder stays for it
        (tmp_path / "step_2" / "my-notes.txt").write_text("mine too")
    fresh = TWINS[twin](tmp_path, keep=3, run={**RUN, "seed": 1}, overwrite=True)
    with fresh.ck.locked():  # the replaced run's files go under the lock
        assert fresh.ck.all_steps() == []
        assert not any(os.path.exists(f) for f in written)
        fresh.save(1, 10.0)
    assert (tmp_path / "notes.txt").read_text() == "mine"
    if twin == "jax":
        assert (tmp_path / "step_2" / "my-notes.txt").read_text() == "mine too"
    again = TWINS[twin](tmp_path, keep=3, run={**RUN, "seed": 1}, resume=True)
    assert again.ck.latest_step() == 1 and again.load(1) == 10.0


def test_resume_refuses_changed_run_flags_with_old_and_new(tmp_path):
    RunDir(str(tmp_path), "jax", RUN, resume=False)._write()
    with pytest.raises(RunDirError) as info:
        RunDir(str(tmp_path), "jax", {**RUN, "seed": 3, "batch_size": 4}, resume=True)
    msg = str(info.value)
    assert "batch_size: 2 in the checkpoint, 4 now; seed: 0 in the checkpoint, 3 now" in msg, msg
    assert "lr, steps, schedule" in msg  # what may change is said too


def test_second_lock_is_refused_and_released_when_the_first_ends(tmp_path):
    first = RunDir(str(tmp_path), "torch", RUN, resume=False)
    with first.locked():
        second = RunDir(str(tmp_path), "torch", RUN, resume=False)  # no complete step yet: allowed to start
        with pytest.raises(RunDirError, match=rf"in use by another trainer \(pid {os.getpid()} on "):
            with second.locked():
                pass
    with second.locked():  # released
        pass


def test_latest_valid_skips_a_corrupt_or_missing_checkpoint(tmp_path, twin):
    ck = TWINS[twin](tmp_path, keep=3, run=RUN)
    for step in (1, 2, 3):
        ck.save(step, step)
    _flip(max(ck.files(3), key=os.path.getsize))
    ck.ck.close()
    resumed = TWINS[twin](tmp_path, keep=3, run=RUN, resume=True)
    assert resumed.ck.latest_step() == 2 and resumed.load(2) == 2.0
    assert len(resumed.ck.problems) == 1 and "step 3: " in resumed.ck.problems[0]
    assert "does not match its checksum" in resumed.ck.problems[0]
    for f in ck.files(2):
        os.unlink(f)
    assert resumed.ck.latest_step() == 1
    assert "step 2: " in resumed.ck.problems[1] and "is missing" in resumed.ck.problems[1]
    open(ck.files(1)[0], "wb").close()  # truncated to nothing
    assert resumed.ck.latest_step() is None and len(resumed.ck.problems) == 3
    if twin == "torch":  # a corrupt file is never unpickled
        with pytest.raises(FileNotFoundError, match=r"no valid checkpoint for step 3 .*checksum"):
            resumed.ck.load(3)


def test_a_killed_write_is_pending_and_removed_by_the_next_prune(tmp_path, twin):
    ck = TWINS[twin](tmp_path, keep=2, run=RUN)
    ck.save(1, 1)
    name = "step_2" if twin == "jax" else os.path.basename(ck.ck.path(2))
    ck.ck.run_dir.begin(2, [name])  # the kill: recorded, partly written, never committed
    (tmp_path / name).mkdir() if twin == "jax" else (tmp_path / name).write_bytes(b"half")
    marker = json.loads((tmp_path / MARKER).read_text())
    assert marker["steps"]["2"]["status"] == "pending"
    ck.ck.close()  # the kill
    resumed = TWINS[twin](tmp_path, keep=2, run=RUN, resume=True)
    assert resumed.ck.latest_step() == 1 and resumed.ck.problems == []
    resumed.save(3, 3)
    assert not (tmp_path / name).exists() and resumed.ck.all_steps() == [1, 3]


def test_begin_refuses_a_path_the_run_did_not_write(tmp_path):
    (tmp_path / "step_5").mkdir()
    with pytest.raises(RunDirError, match=r"holds checkpoint files no run of ours recorded \(step_5\)"):
        RunDir(str(tmp_path), "jax", RUN, resume=False)
    rd = RunDir(str(tmp_path / "sub"), "jax", RUN, resume=False)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "step_7").write_text("user's")
    with pytest.raises(RunDirError, match=r"step_7 exists and no checkpoint of this run wrote it"):
        rd.begin(7, ["step_7"])
    assert (tmp_path / "sub" / "step_7").read_text() == "user's"


def test_resume_needs_a_run_of_ours(tmp_path):
    with pytest.raises(RunDirError, match=rf"holds no training run of ours \(no {MARKER}\)"):
        RunDir(str(tmp_path), "jax", RUN, resume=True)
    (tmp_path / MARKER).write_text("{junk")
    with pytest.raises(RunDirError, match=r"is not a readable run marker"):
        RunDir(str(tmp_path), "jax", RUN, resume=True)


@pytest.fixture(params=sorted(TWINS))
def twin(request):
    return request.param


# ------------------------------------------------------------------------------------------------ the trainers
def _main(twin):
    if twin == "jax":
        from jaxattn.train import main
    else:
        from torchref.train import main
    return main


TRAIN = ["--preset", "tiny", "--seq-len", "16", "--batch-size", "2", "--no-progress"]


def test_resume_past_a_corrupt_latest_checkpoint_repeats_the_run(tmp_path, twin, capsys):
    main = _main(twin)
    ck, log = str(tmp_path / "ck"), str(tmp_path / "log.jsonl")
    argv = [*TRAIN, "--steps", "4", "--checkpoint-dir", ck, "--checkpoint-every", "2", "--log-json", log]
    assert main(argv) == 0
    want = [r["loss"] for r in read_log(log)]
    steps = json.loads(open(os.path.join(ck, MARKER)).read())["steps"]
    latest = max(steps["4"]["files"], key=lambda f: os.path.getsize(os.path.join(ck, f)))
    _flip(os.path.join(ck, latest))
    assert main(argv) == 2  # a fresh run into it is refused
    assert "holds the checkpoints of another run" in capsys.readouterr().err
    assert main([*argv, "--resume"]) == 0
    err = capsys.readouterr().err
    assert "warning: --resume skips a checkpoint: step 4: " in err and "does not match its checksum" in err, err
    got = [r["loss"] for r in read_log(log)]
    assert got == want  # resumed from step 2, the same numbers as the uninterrupted run


def _nan_init(twin, dst):
    """The tiny model's Hugging Face directory with one weight NaN (a broken --init)."""
    from twincore.config import ModelConfig

    if twin == "jax":
        from flax import nnx

        from jaxattn import hf
        from jaxattn.model import Llama

        model = Llama(ModelConfig.preset("tiny"), rngs=nnx.Rngs(0))
        model.layers.w_down.value = model.layers.w_down.value.at[0, 0, 0].set(np.nan)
        hf.save_pretrained(model, str(dst))
    else:
        from torchref import hf
        from torchref.model import LlamaForCausalLM

        model = LlamaForCausalLM(ModelConfig.preset("tiny"))
        with torch.no_grad():
            model.model.layers[0].mlp.down_proj.weight[0, 0] = float("nan")
        hf.save_pretrained(model, str(dst))


def test_a_diverged_run_stops_with_exit_1_and_writes_no_weights(tmp_path, twin, capsys):
    _nan_init(twin, tmp_path / "init")
    ck, log = tmp_path / "ck", tmp_path / "log.jsonl"
    argv = [*TRAIN, "--steps", "8", "--init", str(tmp_path / "init"), "--checkpoint-dir", str(ck)]
    assert _main(twin)([*argv, "--log-json", str(log), "--max-nonfinite-steps", "2"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].endswith(
        "error: training diverged: the loss or the gradient norm was not finite for 2 consecutive steps (1..2; "
        "last loss nan, grad_norm nan); stopped without writing a checkpoint or an export of these weights. "
        "Lower --lr, keep --clip-grad on, or check the --init weights (--max-nonfinite-steps 2 sets how many "
        "steps are tolerated)"
    ), err[-1]
    assert sorted(os.listdir(ck)) == [".train-run.lock", MARKER]  # no step, no final/
    lines = log.read_text().splitlines()
    assert len(lines) == 2 and all(json.loads(line)["loss"] is None for line in lines)  # strict JSON: null
    assert "NaN" not in log.read_text()
    # with checkpoints every step, the first save refuses the non-finite weights
    assert _main(twin)([*argv, "--overwrite", "--checkpoint-every", "1"]) == 1
    assert "the weights are not finite after step 1: no checkpoint of them is written" in capsys.readouterr().err
    assert sorted(os.listdir(ck)) == [".train-run.lock", MARKER]


def test_a_full_disk_at_a_save_is_one_line_and_exit_1(tmp_path, twin, capsys, monkeypatch):
    import errno

    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    if twin == "jax":
        import orbax.checkpoint as ocp

        monkeypatch.setattr(ocp.CheckpointManager, "save", no_space)
    else:
        monkeypatch.setattr(torch, "save", no_space)
    ck = tmp_path / "ck"
    assert _main(twin)([*TRAIN, "--steps", "2", "--checkpoint-dir", str(ck)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].endswith(
        f"error: cannot write the checkpoint of step 2 in --checkpoint-dir {str(ck)!r}: No space left on device"
    ), err[-1]
    marker = json.loads((ck / MARKER).read_text())
    assert marker["steps"] == {} and sorted(os.listdir(ck)) == [".train-run.lock", MARKER]  # nothing half-written


@pytest.mark.parametrize(
    "twin_",
    ["jax", pytest.param("torch", marks=(pytest.mark.slow, pytest.mark.slow_feature))],  # 8 s each
)
def test_a_peer_that_never_arrives_ends_the_wait_with_one_line(twin_, tmp_path):
    import socket
    import subprocess
    import sys

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "JAXATTN_TEST": "1"}
    argv = [*TRAIN, "--steps", "1", "--distributed-timeout", "2"]
    if twin_ == "jax":
        cmd = ["-m", "jaxattn.train", *argv, "--mesh", "data=2", "--num-processes", "2", "--process-id", "1"]
        cmd += ["--coordinator", f"127.0.0.1:{port}"]
        want = f"jaxattn: error: process 1: the 2 processes did not all meet at 127.0.0.1:{port} within 2 s"
    else:
        cmd = ["-m", "torchref.train", *argv, "--parallel", "ddp"]
        env.update(RANK="1", LOCAL_RANK="1", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        want = f"torchref.train: error: rank 1: the 2 ranks did not all meet at 127.0.0.1:{port} within 2 s"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, *cmd], cwd=root, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr[-3000:]
    lines = r.stderr.strip().splitlines()
    assert any("waiting up to 2 s for all 2" in line for line in lines), r.stderr[-3000:]
    assert want in lines[-1], r.stderr[-3000:]


def test_divergence_guard_counts_consecutive_nonfinite_steps_but_not_loss_scale_skips():
    from twincore.runlog import DivergenceGuard, TrainingError

    def rec(step, loss, norm, skipped=False):
        return {"step": step, "loss": loss, "grad_norm": norm, "skipped": skipped}

    guard = DivergenceGuard(2)
    guard.check(rec(1, float("nan"), 1.0))
    guard.check(rec(2, 2.0, 1.0))  # a finite step resets the count
    for step in range(3, 9):
        guard.check(rec(step, 2.0, float("inf"), skipped=True))  # fp16 overflow: the loss scale skipped it
    guard.check(rec(9, 2.0, float("inf")))
    with pytest.raises(TrainingError, match=r"for 2 consecutive steps \(9\.\.10; last loss 2\.0, grad_norm nan\)"):
        guard.check(rec(10, 2.0, float("nan")))


def test_a_forked_child_does_not_keep_the_lock(tmp_path):
    """A DataLoader worker forked while the lock is held must not hold it after the trainer ends (a killed torch
    trainer's worker outlived it and the --resume was refused as 'in use')."""
    import signal
    import time

    first = RunDir(str(tmp_path), "torch", RUN, resume=False)
    ready_r, ready_w = os.pipe()
    with first.locked():
        pid = os.fork()
        if pid == 0:  # the worker: outlives the lock holder's release
            os.write(ready_w, b"1")  # running (the fork hooks have run)
            time.sleep(30)
            os._exit(0)
        assert os.read(ready_r, 1) == b"1"
    try:
        with RunDir(str(tmp_path), "torch", RUN, resume=False).locked():
            pass
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(ready_r)
        os.close(ready_w)


def _tree_bytes(root):
    """``{relative path: bytes}`` of every file under ``root`` (directories included as ``None``)."""
    out = {}
    for dirpath, dirs, names in os.walk(root):
        for d in dirs:
            out[os.path.relpath(os.path.join(dirpath, d), root)] = None
        for n in names:
            with open(os.path.join(dirpath, n), "rb") as f:
                out[os.path.relpath(os.path.join(dirpath, n), root)] = f.read()
    return out


def test_a_second_trainer_on_a_live_run_is_refused_and_touches_nothing(tmp_path, twin, capsys, monkeypatch):
    """A trainer holding the directory mid-save (an in-flight ``step_9``, its checkpoints complete): a second
    ``--resume`` or ``--overwrite`` is refused naming the holder's pid before it reads, validates, cleans or
    deletes anything (orbax's temporary-directory cleanup included)."""
    main = _main(twin)
    ck = tmp_path / "ck"
    argv = [*TRAIN, "--steps", "4", "--checkpoint-dir", str(ck), "--checkpoint-every", "2"]
    assert main(argv) == 0
    capsys.readouterr()
    live = RunDir(str(ck), twin, json.loads((ck / MARKER).read_text())["run"], resume=True)
    validated = []
    real = RunDir.latest_valid
    monkeypatch.setattr(RunDir, "latest_valid", lambda self, *a: validated.append(self) or real(self, *a))
    with live.locked():  # the live trainer, writing step 9
        if twin == "jax":
            live.begin(9, ["step_9"])
            (ck / "step_9.orbax-checkpoint-tmp" / "state").mkdir(parents=True)
            (ck / "step_9.orbax-checkpoint-tmp" / "state" / "half").write_bytes(b"in flight")
        else:
            live.begin(9, ["torchref-step-00000009.pt"])
            (ck / f".torchref-step-00000009.pt.tmp-{os.getpid()}-abcd").write_bytes(b"in flight")
        before = _tree_bytes(ck)
        for flag in ("--resume", "--overwrite"):
            assert main([*argv, "--steps", "12", flag]) == 2
            err = capsys.readouterr().err.strip().splitlines()
            assert len(err) == 1 and f"is in use by another trainer (pid {os.getpid()} on " in err[0], err
            assert _tree_bytes(ck) == before, flag
        assert validated == []  # never read for a checkpoint while another trainer writes them


def test_a_locking_run_dir_is_refused_before_it_reads_the_directory(tmp_path):
    """``lock=True`` (the trainers): the lock comes first, so a directory in use is refused naming its holder even
    where reading it would fail (a marker mid-write by the live trainer), and nothing of it is read or changed."""
    first = RunDir(str(tmp_path), "jax", RUN, resume=False, lock=True)
    (tmp_path / MARKER).write_text("{half-written")
    for resume in (True, False):
        with pytest.raises(RunDirError, match=rf"is in use by another trainer \(pid {os.getpid()} on "):
            RunDir(str(tmp_path), "jax", RUN, resume=resume, overwrite=True, lock=True)
    assert (tmp_path / MARKER).read_text() == "{half-written"
    first.release()
    with pytest.raises(RunDirError, match=r"is not a readable run marker"):  # read once the lock is held
        RunDir(str(tmp_path), "jax", RUN, resume=True, lock=True)
    (tmp_path / MARKER).unlink()
    RunDir(str(tmp_path), "jax", RUN, resume=False, lock=True).release()  # the refusal let the lock go


def test_a_lock_taken_but_not_yet_signed_names_its_holder_once_signed(tmp_path):
    """Between a trainer's flock and the write of its pid the lock file is empty (a new one) or holds the last
    holder's line: a second trainer waits briefly for the new holder's line instead of saying "another process"."""
    import fcntl
    import threading

    from twincore.rundir import LOCK

    fd = os.open(tmp_path / LOCK, os.O_RDWR | os.O_CREAT)  # a trainer that has the flock but not yet its pid line
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    signer = threading.Timer(0.2, lambda: os.pwrite(fd, b"pid 4242 on elsewhere\n", 0))
    signer.start()
    try:
        with pytest.raises(RunDirError, match=r"is in use by another trainer \(pid 4242 on elsewhere\)"):
            RunDir(str(tmp_path), "jax", RUN, resume=False, lock=True)
    finally:
        signer.join()
        os.close(fd)
