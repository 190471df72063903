"""``save_pretrained`` follows Hugging Face's directory semantics and is crash-safe, in both packages.

It writes into the directory and keeps every file it does not own; bad paths and arguments get clear errors;
permissions come from the umask; every intermediate state of a save (snapshotted before each rename, link and
unlink), a SIGKILL at random instants and concurrent writers all leave a directory that loads as exactly the old
or the new checkpoint. Loaders name the file behind a JSON error and refuse non-float tensors alike.
"""

import contextlib
import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")
safetensors_numpy = pytest.importorskip("safetensors.numpy")
safetensors_torch = pytest.importorskip("safetensors.torch")

import jax.numpy as jnp  # noqa: E402

import jaxattn  # noqa: E402
import jaxattn.hf  # noqa: E402
import torchref  # noqa: E402
import torchref.hf  # noqa: E402
from parity_tests.save_child import VARIANTS, spec_save, variant  # noqa: E402
from twincore import hf_format  # noqa: E402
from twincore.config import ModelConfig  # noqa: E402
from twincore.hf_format import CheckpointError  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PKGS = {"torch": torchref, "jax": jaxattn}
OWNED = {hf_format.CONFIG_NAME, hf_format.SINGLE_FILE, hf_format.INDEX_FILE}


def _model(pkg: str, i: int):
    cfg, tensors, _ = variant(i)
    if pkg == "torch":
        return torchref.hf.from_state_dict(cfg, {k: torch.from_numpy(v) for k, v in tensors.items()})
    return jaxattn.hf.from_state_dict(cfg, tensors)


def _save(pkg: str, i: int, path, **kw):
    kw.setdefault("max_shard_bytes", variant(i)[2])
    return PKGS[pkg].save_pretrained(_model(pkg, i), path, **kw)


def _loaded(path, pkg: str = "spec") -> tuple[ModelConfig, dict]:
    """(config, numpy tensors) as ``pkg``'s loader sees ``path`` ("spec": the shared reader alone)."""
    if pkg == "spec":
        hf_config, tensors = hf_format.read_checkpoint(path, safetensors_numpy.load_file)
        return ModelConfig.from_hf(hf_config), tensors
    model = PKGS[pkg].from_pretrained(path)
    sd = (torchref.hf if pkg == "torch" else jaxattn.hf).to_state_dict(model)
    return model.config, {k: np.asarray(v) for k, v in sd.items()}


def _loads_as(path, candidates, pkg: str = "spec") -> int:
    """The variant in ``candidates`` that ``path`` loads as: same config and bit-identical tensors."""
    cfg, tensors = _loaded(path, pkg)
    for i in candidates:
        want_cfg, want, _ = variant(i)
        if cfg == want_cfg and tensors.keys() == want.keys() and all(np.array_equal(tensors[k], want[k]) for k in want):
            return i
    raise AssertionError(f"{path} ({sorted(os.listdir(path))}) loads as none of the variants {list(candidates)}")


def _ours(path) -> set:
    return {f for f in os.listdir(path) if f in OWNED or hf_format._SHARD_RE.fullmatch(f)}


def _n_shards(i: int) -> int:
    _, tensors, max_shard = variant(i)
    return len(hf_format.plan_shards({k: v.nbytes for k, v in tensors.items()}, max_shard))


def _expected_files(i: int) -> set:
    n = _n_shards(i)
    if n == 1:
        return {hf_format.CONFIG_NAME, hf_format.SINGLE_FILE}
    return {hf_format.CONFIG_NAME, hf_format.INDEX_FILE} | {hf_format.shard_name(j, n) for j in range(1, n + 1)}


def _add_foreign_files(d):
    """Files a user keeps beside a checkpoint; returns name -> bytes (folders as 'logs/...')."""
    os.makedirs(d / "logs" / "run1", exist_ok=True)
    files = {
        "tokenizer.json": b'{"v": 1}',
        "logs/run1/events.txt": b"step 1\n",
        "train.py": b"print(1)\n",
        ".hidden": b"x",
        "model.safetensors.bak": b"mine",
        "model-1-of-2.safetensors": b"not ours",
        "pytorch_model.bin": b"old",
    }
    for name, data in files.items():
        (d / name).write_bytes(data)
    return files


def _assert_foreign_intact(d, files):
    for name, data in files.items():
        assert (d / name).read_bytes() == data, name


# ------------------------------------------------------------------------------------ directory semantics


@pytest.mark.parametrize("pkg", list(PKGS))
def test_unrelated_files_survive_and_stale_weights_go(tmp_path, pkg):
    d = tmp_path / "ckpt"
    os.makedirs(d)
    foreign = _add_foreign_files(d)
    for i in (0, 1, 3, 2, 4, 0):  # single -> 5 shards -> 3 shards (tied) -> 5 shards -> single (tied) -> single
        assert _save(pkg, i, d) == str(d)
        _assert_foreign_intact(d, foreign)
        assert _ours(d) == _expected_files(i), i  # stale shards, index or single file of the last save are gone
        assert set(os.listdir(d)) == _expected_files(i) | {"logs"} | {f for f in foreign if "/" not in f}
        assert _loads_as(d, [i], pkg) == i


@pytest.mark.parametrize("pkg", list(PKGS))
def test_int8_quantized_model_is_refused_before_the_directory_is_touched(tmp_path, pkg):
    """``save_pretrained(quant.quantize(model))`` would write int8 tensors under a Llama config.json nothing loads
    (over a good checkpoint): refused with a TypeError naming the model and the way out; an existing checkpoint and
    its neighbours stay byte for byte, and a new directory is not even created."""
    from jaxattn import quant as jq
    from torchref import quant as tq

    d = tmp_path / "ckpt"
    _save(pkg, 0, d)
    foreign = _add_foreign_files(d)
    before = {f: (d / f).read_bytes() for f in _ours(d)}
    stats = {f: os.stat(d / f).st_mtime_ns for f in os.listdir(d)}
    qmodel = (tq if pkg == "torch" else jq).quantize(_model(pkg, 0))
    name = "torchref" if pkg == "torch" else "jaxattn"
    for target in (d, tmp_path / "new"):
        with pytest.raises(TypeError) as info:
            PKGS[pkg].save_pretrained(qmodel, target)
        msg = str(info.value)
        for fragment in ("model is int8-quantized", f"{name}.quant.quantize", "Save the float model", "nothing was"):
            assert fragment in msg, msg
    assert not (tmp_path / "new").exists()
    assert {f: (d / f).read_bytes() for f in _ours(d)} == before
    assert {f: os.stat(d / f).st_mtime_ns for f in os.listdir(d)} == stats
    _assert_foreign_intact(d, foreign)
    assert _loads_as(d, [0], pkg) == 0


@pytest.mark.parametrize("pkg", list(PKGS))
def test_save_into_current_directory(tmp_path, monkeypatch, pkg):
    foreign = _add_foreign_files(tmp_path)
    monkeypatch.chdir(tmp_path)
    assert _save(pkg, 1, ".") == str(tmp_path)
    _assert_foreign_intact(tmp_path, foreign)
    assert _loads_as(tmp_path, [1]) == 1


@pytest.mark.parametrize("pkg", list(PKGS))
def test_bad_paths_are_clear_errors(tmp_path, pkg):
    with pytest.raises(ValueError, match="path='' is empty"):
        _save(pkg, 0, "")
    file = tmp_path / "weights"
    file.write_bytes(b"precious")
    with pytest.raises(FileExistsError, match=re.escape(f"path='{file}' is a file")):
        _save(pkg, 0, file)
    with pytest.raises(FileExistsError, match="cannot create checkpoint directory"):
        _save(pkg, 0, file / "sub")
    os.symlink(tmp_path / "nowhere", tmp_path / "dangling")
    with pytest.raises(FileExistsError, match="symbolic link to a non-directory"):
        _save(pkg, 0, tmp_path / "dangling")
    assert file.read_bytes() == b"precious"
    assert sorted(os.listdir(tmp_path)) == ["dangling", "weights"]  # nothing moved aside, nothing created


@pytest.mark.parametrize("pkg", list(PKGS))
def test_symlink_to_directory_is_followed(tmp_path, pkg):
    os.makedirs(tmp_path / "real")
    os.symlink("real", tmp_path / "link")
    assert _save(pkg, 2, tmp_path / "link") == str(tmp_path / "link")
    assert os.path.islink(tmp_path / "link") and os.readlink(tmp_path / "link") == "real"
    assert _ours(tmp_path / "real") == _expected_files(2)
    assert _loads_as(tmp_path / "link", [2], pkg) == 2


@pytest.mark.parametrize("pkg", list(PKGS))
def test_read_only_directory(tmp_path, pkg):
    if os.geteuid() == 0:
        pytest.skip("root writes into read-only directories; test_write_failure_names_the_directory covers it")
    os.makedirs(tmp_path / "ro")
    os.chmod(tmp_path / "ro", 0o555)
    try:
        with pytest.raises(PermissionError, match=f"{tmp_path / 'ro'}.*not writable"):
            _save(pkg, 0, tmp_path / "ro")
        with pytest.raises(PermissionError, match=str(tmp_path / "ro")):
            _save(pkg, 0, tmp_path / "ro" / "sub")
    finally:
        os.chmod(tmp_path / "ro", 0o755)


@pytest.mark.parametrize("pkg", list(PKGS))
def test_write_failure_names_the_directory(tmp_path, monkeypatch, pkg):
    """A directory the user may not write to, and a write refused midway, both name the directory; the midway
    failure leaves the previous checkpoint and no temp file."""
    d = tmp_path / "ckpt"
    _save(pkg, 0, d)
    before = {f: (d / f).read_bytes() for f in os.listdir(d)}
    with monkeypatch.context() as m:
        m.setattr(os, "access", lambda *a, **k: False)
        with pytest.raises(PermissionError, match=re.escape(f"checkpoint directory '{d}' is not writable")):
            _save(pkg, 1, d)
    real_replace = os.replace

    def refusing_replace(src, dst, *a, **k):
        if os.path.basename(os.fspath(dst)).startswith("model-"):
            raise PermissionError(13, "Permission denied", os.fspath(dst))
        return real_replace(src, dst, *a, **k)

    monkeypatch.setattr(os, "replace", refusing_replace)
    with pytest.raises(PermissionError, match=re.escape(f"cannot write the checkpoint into '{d}'")):
        _save(pkg, 1, d)
    assert {f: (d / f).read_bytes() for f in os.listdir(d)} == before


@pytest.mark.parametrize("pkg", list(PKGS))
@pytest.mark.parametrize("umask", [0o022, 0o002])
def test_permissions_follow_the_umask(tmp_path, pkg, umask):
    old = os.umask(umask)
    try:
        _save(pkg, 1 if umask == 0o022 else 0, tmp_path / "a" / "b")
    finally:
        os.umask(old)
    for d in (tmp_path / "a", tmp_path / "a" / "b"):
        assert stat.S_IMODE(os.stat(d).st_mode) == 0o777 & ~umask, d
    files = os.listdir(tmp_path / "a" / "b")
    assert files and all(stat.S_IMODE(os.stat(tmp_path / "a" / "b" / f).st_mode) == 0o666 & ~umask for f in files)


# ------------------------------------------------------------------------------------ crash safety


@contextlib.contextmanager
def _snapshot_every_step(monkeypatch, target, out):
    """Copy ``target`` to ``out/sNNN`` before every rename, link and unlink of a path inside it: the states a
    SIGKILL between two filesystem operations would leave. Yields the list of snapshot directories."""
    target, snaps = os.path.realpath(target), []

    def snap():
        dst = os.path.join(out, f"s{len(snaps):03d}")
        shutil.copytree(target, dst, symlinks=True)
        snaps.append(dst)

    def wrap(real):
        def op(src, *a, **k):
            if os.path.realpath(os.fspath(src)).startswith(target + os.sep):
                snap()
            return real(src, *a, **k)

        return op

    with monkeypatch.context() as m:
        for name in ("replace", "unlink", "link"):
            m.setattr(os, name, wrap(getattr(os, name)))
        yield snaps
    snap()


TRANSITIONS = [(i, (i + 1) % len(VARIANTS)) for i in range(len(VARIANTS))] + [(1, 1), (3, 0), (0, 2)]


@pytest.mark.parametrize("pkg", list(PKGS))
def test_every_intermediate_state_loads_as_old_or_new(tmp_path, monkeypatch, pkg):
    """Every transition kind (see save_child.VARIANTS), the same shard names (1 -> 1, 1 -> 2) included: each
    state between two filesystem operations loads as exactly the old or the new checkpoint, and the new one
    becomes visible at a single step."""
    for n, (old, new) in enumerate(TRANSITIONS):
        d = tmp_path / f"t{n}"
        spec_save(d, old)
        with _snapshot_every_step(monkeypatch, d, tmp_path / f"snaps{n}") as snaps:
            _save(pkg, new, d)
        seen = [_loads_as(s, [old, new]) for s in snaps]
        assert seen[0] == old and seen[-1] == new, (old, new, seen)
        flips = sum(a != b for a, b in zip(seen, seen[1:]))
        assert old == new or flips == 1, (old, new, seen)
        assert not [f for f in os.listdir(d) if f.startswith(".")], (old, new)
    assert _loads_as(d, [new], pkg) == new  # and the package loader agrees on the last one


def test_kill_between_commit_and_config_then_save_again(tmp_path, monkeypatch):
    """The one window where config.json is stale (weights committed, config not yet renamed): the loader takes
    the temp config the commit point names by hash, the next save finishes the rename first, and a config.json
    edited by hand afterwards is used as it is."""
    d = tmp_path / "ckpt"
    spec_save(d, 3)  # tied embeddings ...
    with _snapshot_every_step(monkeypatch, d, tmp_path / "snaps") as snaps:
        spec_save(d, 4)  # ... to other weights and another rope_theta
    stale = [
        s
        for s in snaps
        if _loads_as(s, [3, 4]) == 4
        and json.loads(open(os.path.join(s, "config.json")).read())["rope_theta"] != 40000.0
    ]
    assert stale, "no snapshot caught the window between commit and config.json"
    crashed = tmp_path / "crashed"
    shutil.copytree(stale[0], crashed)
    assert _loads_as(crashed, [4], "torch") == 4 and _loads_as(crashed, [4], "jax") == 4
    with _snapshot_every_step(monkeypatch, crashed, tmp_path / "snaps2") as snaps2:
        spec_save(crashed, 0)  # a shape change: a stale config.json would not even load
    assert [_loads_as(s, [4, 0]) for s in snaps2][-1] == 0
    assert all(_loads_as(s, [4, 0]) in (4, 0) for s in snaps2)
    cfg = json.loads((crashed / "config.json").read_text())
    cfg["rms_norm_eps"] = 1e-3  # a hand edit wins over the hash the weights recorded
    (crashed / "config.json").write_text(json.dumps(cfg))
    assert torchref.from_pretrained(crashed).config.norm_eps == 1e-3


def _wait_for(log, pattern: str, proc, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if os.path.exists(log) and pattern in open(log).read():
            return
        if proc.poll() is not None:
            raise AssertionError(f"saver exited with {proc.returncode}: {proc.stderr.read().decode()[-3000:]}")
        time.sleep(0.01)
    raise AssertionError(f"saver wrote no {pattern!r} within {timeout} s")


def _allowed(log) -> list[int]:
    """Variants the directory may hold now: the last save finished, or the one under way and the one before."""
    last = open(log).read().split("\n")[-2].split()
    return [int(last[1])] if last[0] == "done" else [int(last[1]), int(last[1]) - 1]


def _spawn(mode: str, d, log, first: int):
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.Popen(
        [sys.executable, "-m", "parity_tests.save_child", mode, str(d), str(log), str(first)],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


def _kill(proc) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)


def test_kill_9_at_random_instants(tmp_path):
    """12 real SIGKILLs of a process saving in a loop (the shared writer; both packages load the result)."""
    rng = np.random.default_rng(0)
    d = tmp_path / "ckpt"
    spec_save(d, 0)
    state, states = 0, []
    for k in range(12):
        log = tmp_path / f"log{k}"
        proc = _spawn("spec", d, log, state + 1)
        try:
            _wait_for(log, f"start {state + 1}\n", proc)
            time.sleep(rng.uniform(0.0, 0.12))
        finally:
            _kill(proc)
        allowed = _allowed(log)
        state = _loads_as(d, [v % len(VARIANTS) for v in allowed], ("torch", "jax")[k % 2])
        state = next(v for v in allowed if v % len(VARIANTS) == state)
        states.append(state)
        ours = (hf_format._TEMP_RE, hf_format._STAGING_RE)  # what a killed save may leave; nothing else
        assert not [f for f in os.listdir(d) if f.startswith(".") and not any(r.fullmatch(f) for r in ours)]
    assert len(set(states)) >= 3, states  # the saves really ran between kills


@pytest.mark.parametrize("pkg", list(PKGS))
def test_kill_9_during_save_pretrained(tmp_path, pkg):
    """A process saving with the package's ``save_pretrained`` in a loop: 6 SIGSTOP snapshots (the directory a
    SIGKILL at that instant leaves), then a real SIGKILL; each loads as the old or the new checkpoint."""
    rng = np.random.default_rng(1)
    d, log = tmp_path / "ckpt", tmp_path / "log"
    spec_save(d, 0)
    proc = _spawn(pkg, d, log, 1)
    snaps = []
    try:
        _wait_for(log, "done 1\n", proc)
        for k in range(6):
            time.sleep(rng.uniform(0.0, 0.1))
            proc.send_signal(signal.SIGSTOP)
            while open(f"/proc/{proc.pid}/stat").read().rsplit(")", 1)[1].split()[0] not in "Tt":
                time.sleep(0.001)
            shutil.copytree(d, tmp_path / f"snap{k}", symlinks=True)
            snaps.append((tmp_path / f"snap{k}", _allowed(log)))
            proc.send_signal(signal.SIGCONT)
        time.sleep(rng.uniform(0.0, 0.1))
    finally:
        _kill(proc)
    snaps.append((d, _allowed(log)))
    for path, allowed in snaps:
        _loads_as(path, [v % len(VARIANTS) for v in allowed], pkg)


@pytest.mark.parametrize("pkg", list(PKGS))
def test_concurrent_writers_and_a_reader(tmp_path, pkg):
    """Two threads save different checkpoints to one directory at once (3 rounds) while a third keeps loading:
    saves are serialised (last writer wins), nothing raises, every load is one whole checkpoint."""
    d = tmp_path / "ckpt"
    spec_save(d, 0)
    models = {i: _model(pkg, i) for i in (1, 3)}
    errors, seen, done = [], [], threading.Event()

    def writer(i, barrier):
        try:
            barrier.wait()
            PKGS[pkg].save_pretrained(models[i], d, max_shard_bytes=variant(i)[2])
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    def reader():
        while not done.is_set():
            try:
                seen.append(_loads_as(d, [0, 1, 3]))
            except BaseException as e:  # noqa: BLE001
                errors.append(e)
                return
            time.sleep(0.002)  # let a waiting writer take the lock

    r = threading.Thread(target=reader)
    r.start()
    for _ in range(3):
        barrier = threading.Barrier(2)
        threads = [threading.Thread(target=writer, args=(i, barrier)) for i in (1, 3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not errors, errors
        assert _loads_as(d, [1, 3], pkg) in (1, 3)
    done.set()
    r.join(timeout=120)
    assert not errors, errors
    assert seen and set(seen) <= {0, 1, 3}
    assert not [f for f in os.listdir(d) if f.startswith(".")]


# ------------------------------------------------------------------------------------ loader and argument errors


@pytest.mark.parametrize("pkg", list(PKGS))
def test_invalid_json_names_the_file(tmp_path, pkg):
    d = tmp_path / "ckpt"
    spec_save(d, 1)  # sharded: has an index
    (d / hf_format.INDEX_FILE).write_text('{"weight_map": {')
    with pytest.raises(CheckpointError, match=re.escape(f"{d / hf_format.INDEX_FILE} is not valid JSON: Expecting")):
        PKGS[pkg].from_pretrained(d)
    spec_save(d, 0)
    (d / "config.json").write_text("{'single': 'quotes'}")
    with pytest.raises(
        CheckpointError, match=re.escape(f"{d / 'config.json'} is not valid JSON: Expecting property name")
    ):
        PKGS[pkg].from_pretrained(d)
    (d / "config.json").write_text("[1, 2]")
    with pytest.raises(CheckpointError, match="config.json must hold a JSON object, got list"):
        PKGS[pkg].from_pretrained(d)
    spec_save(d, 0)  # a save repairs the directory
    (d / hf_format.SINGLE_FILE).write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}      ")
    with pytest.raises(
        CheckpointError, match=re.escape(f"{d / hf_format.SINGLE_FILE} is not a readable safetensors file")
    ):
        PKGS[pkg].from_pretrained(d)


@pytest.mark.parametrize("pkg", list(PKGS))
def test_non_float_tensors_are_refused(tmp_path, pkg):
    cfg, tensors, _ = variant(0)
    tensors = dict(tensors)
    tensors["model.embed_tokens.weight"] = tensors["model.embed_tokens.weight"].astype(np.int32)
    tensors["model.norm.weight"] = tensors["model.norm.weight"].astype(np.float64)
    os.makedirs(tmp_path / "ckpt")
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(cfg.to_hf()))
    safetensors_numpy.save_file(tensors, str(tmp_path / "ckpt" / hf_format.SINGLE_FILE))
    want = (
        "unsupported dtype (2): model.embed_tokens.weight: int32, model.norm.weight: float64; "
        "a checkpoint holds float32, bfloat16, float16"
    )
    with pytest.raises(CheckpointError, match=re.escape(f"checkpoint '{tmp_path / 'ckpt'}' has tensors of {want}")):
        PKGS[pkg].from_pretrained(tmp_path / "ckpt")
    sd = tensors if pkg == "jax" else {k: torch.from_numpy(v) for k, v in tensors.items()}
    with pytest.raises(CheckpointError, match=re.escape(f"state dict has tensors of {want}")):
        PKGS[pkg].hf.from_state_dict(cfg, sd)


@pytest.mark.parametrize("pkg", list(PKGS))
@pytest.mark.parametrize(
    "bad,err", [("1GB", TypeError), (True, TypeError), (1.5, TypeError), (0, ValueError), (-5, ValueError)]
)
def test_max_shard_bytes_must_be_a_positive_int(tmp_path, pkg, bad, err):
    with pytest.raises(err, match=re.escape(f"max_shard_bytes={bad!r} is not supported; use a positive int")):
        _save(pkg, 0, tmp_path / "x", max_shard_bytes=bad)
    assert not os.path.exists(tmp_path / "x")
    _save(pkg, 1, tmp_path / "y", max_shard_bytes=np.int64(120_000))  # numpy ints are ints
    assert _ours(tmp_path / "y") == _expected_files(1)


@pytest.mark.parametrize("pkg", list(PKGS))
def test_dtype_names_are_model_dtypes(tmp_path, pkg):
    d = tmp_path / "ckpt"
    _save(pkg, 0, d, dtype="float16")
    assert _loaded(d)[1]["model.norm.weight"].dtype == np.float16
    for bad in ("float64", "int8", "half"):  # fp16 / bf16 / fp32 are accepted spellings (test_hf)
        with pytest.raises(
            ValueError,
            match=rf"dtype='{bad}' is not supported; use one of float32, bfloat16, float16 \(or fp32, bf16, fp16\)",
        ):
            PKGS[pkg].from_pretrained(d, dtype=bad)
        with pytest.raises(ValueError, match=f"dtype='{bad}'"):
            _save(pkg, 0, tmp_path / "never", dtype=bad)
    native = torch.float64 if pkg == "torch" else jnp.float64
    with pytest.raises(ValueError, match="dtype='float64' is not supported"):
        PKGS[pkg].from_pretrained(d, dtype=native)
    assert not os.path.exists(tmp_path / "never")
