"""A trainer's checkpoint directory, owned the way ``save_pretrained`` owns its files: a run marker that lists every
checkpoint the run wrote (with sha256 checksums), a lock against a second trainer, and the run-defining flags a
``--resume`` must not change. Shared by both trainers (numpy-free, framework-free).

    rd = RunDir(path, "jax", run={"seed": 0, ...}, resume=False, lock=True)  # the lock, then refuses another run's
    with rd.locked():                                   # (or here without lock=True) a second trainer: RunDirError
        rd.begin(10, ["step_10"]); ...write step 10...; rd.commit(10); rd.prune(keep=3)
    step, problems = rd.latest_valid()                  # newest step whose checksums match, and why newer ones did not

Marker ``train-run.json``: ``{format, framework, run_id, created_utc, run, steps: {"10": {"status", "paths",
"files"}}}``. ``begin`` records a step as *pending* with the paths it will create (which must not exist yet, so
they are provably ours) before anything is written; ``commit`` hashes every file under them and marks the step
*complete*. A kill between the two leaves a pending step, which the next ``prune`` removes. Pruning and
``--overwrite`` delete only what the marker lists — files of complete steps, pending steps' paths — never a file
or folder the run did not write. Every marker write is atomic (``twincore.atomic``). A trainer takes the lock before
it reads the directory (``lock=True``): a second trainer on a live run is refused naming the holder's pid, before it
validates, cleans or deletes anything (a live run's files change under a reader).
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import os
import re
import shutil
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from .atomic import write_text_atomic

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: no lock
    fcntl = None

__all__ = ["MARKER", "LOCK", "RUN_FLAGS", "RunDir", "RunDirError", "StepCheckpointer", "sha256_file"]

MARKER = "train-run.json"
LOCK = ".train-run.lock"
FORMAT = 1
# The flags that define a run: a --resume must keep them (the data position indexes this stream, the optimizer
# state has this layout). Everything else (lr, steps, schedule, logging, checkpoint cadence, mesh / parallel
# layout, attention backend, remat, clipping) may change on --resume.
RUN_FLAGS = ("data", "seed", "batch_size", "seq_len", "packing", "optimizer", "precision")


# flock belongs to the open file description, which a fork shares: a worker process that outlives a killed trainer
# would keep the directory locked, so every child closes the lock descriptors it inherits
_LOCK_FDS: set[int] = set()


def _close_inherited_locks() -> None:
    for fd in list(_LOCK_FDS):
        with contextlib.suppress(OSError):
            os.close(fd)
    _LOCK_FDS.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_close_inherited_locks)


def _holder(fd: int, wait: float = 2.0) -> str:
    """The lock holder's line ("pid N on HOST"): a holder between its flock and its write has not signed yet, so an
    empty file is read again for up to ``wait`` seconds before it is just "another process"."""
    deadline = time.monotonic() + wait
    while True:
        text = os.pread(fd, 200, 0).decode(errors="replace")
        line = text.splitlines()[0].strip() if text.strip() else ""
        if line or time.monotonic() >= deadline:
            return line or "another process"
        time.sleep(0.01)


_CHECKPOINT_NAME = re.compile(r"step_\d+|torchref-step-\d+\.pt")


class RunDirError(ValueError):
    """A checkpoint directory that this run may not use, or holds no valid checkpoint; the message says why."""


def sha256_file(path: str, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _files_under(root: str, rel: str) -> list[str]:
    """Relative paths of every regular file at or under ``root/rel``, sorted."""
    full = os.path.join(root, rel)
    if os.path.isfile(full):
        return [rel]
    out = []
    for dirpath, _, names in os.walk(full):
        out += [os.path.relpath(os.path.join(dirpath, n), root) for n in names]
    return sorted(out)


class RunDir:
    """The checkpoint directory of one training run (see the module docstring)."""

    def __init__(
        self,
        path: str,
        framework: str,
        run: Mapping[str, Any],
        *,
        resume: bool,
        overwrite: bool = False,
        flag: str = "--checkpoint-dir",
        lock: bool = False,
    ):
        self.path, self.framework, self.flag = os.path.abspath(path), framework, flag
        self.run = json.loads(json.dumps(dict(run), default=str))  # JSON-normalised, comparable with the marker's
        self.resume, self.overwrite = resume, overwrite
        self.marker_path = os.path.join(self.path, MARKER)
        self._lock_fd, self._replaced, self.marker = None, None, None
        if lock:
            self.acquire()  # the lock first: a live trainer's directory is refused before anything of it is read
        else:
            self._open()

    def _open(self) -> None:
        """Read the marker and check that this run may use the directory (another run's is refused)."""
        old = self._read() if os.path.isfile(self.marker_path) else None
        where = f"{self.flag} {self.path!r}"
        framework = self.framework
        if self.resume:
            if old is None:
                raise RunDirError(
                    f"--resume: {where} holds no training run of ours (no {MARKER}); nothing to "
                    f"resume — start without --resume"
                )
            if old["framework"] != framework:
                raise RunDirError(
                    f"--resume: {where} holds a run of the {old['framework']} trainer; this is the "
                    f"{framework} trainer (checkpoints do not move between the frameworks)"
                )
            changed = [
                f"{k}: {old['run'].get(k)!r} in the checkpoint, {self.run.get(k)!r} now"
                for k in sorted(set(old["run"]) | set(self.run))
                if old["run"].get(k) != self.run.get(k)
            ]
            if changed:
                raise RunDirError(
                    f"--resume: the flags that define the run in {where} changed ("
                    + "; ".join(changed)
                    + "); resume with the original ones, or start a new run in "
                    "a new directory. lr, steps, schedule, logging, checkpoint cadence and the "
                    "mesh / parallel layout may change on --resume"
                )
            self.marker, self._replaced = old, None
            return
        if old is not None and any(s["status"] == "complete" for s in old["steps"].values()):
            if not self.overwrite:
                steps = sorted(int(s) for s, v in old["steps"].items() if v["status"] == "complete")
                raise RunDirError(
                    f"{where} holds the checkpoints of another run ({old['framework']}, started "
                    f"{old['created_utc']}, steps {steps}): continue it with --resume, or use a new "
                    f"directory, or replace its checkpoints with --overwrite"
                )
        self._replaced = old  # --overwrite, or a run that never completed a checkpoint: its files go (under the lock)
        theirs = [n for n in self._our_looking(os.listdir(self.path) if os.path.isdir(self.path) else [])]
        if old is not None:
            listed = {p for v in old["steps"].values() for p in v["paths"]}
            theirs = [n for n in theirs if n not in listed]
        if theirs:
            raise RunDirError(
                f"{where} holds checkpoint files no run of ours recorded ({', '.join(theirs[:5])}): "
                f"they may be another trainer's; use a new directory"
            )
        self.marker = {
            "format": FORMAT,
            "framework": framework,
            "run_id": uuid.uuid4().hex,
            "created_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "run": self.run,
            "steps": {},
        }

    @staticmethod
    def _our_looking(names: Sequence[str]) -> list[str]:
        """Names a trainer's checkpoint would have (``step_<N>``, ``torchref-step-<N>.pt``)."""
        return sorted(n for n in names if _CHECKPOINT_NAME.fullmatch(n))

    # ------------------------------------------------------------------------------------------------ marker
    def _read(self) -> dict:
        try:
            with open(self.marker_path) as f:
                m = json.load(f)
            assert m.get("format") == FORMAT and isinstance(m.get("steps"), dict)
        except (OSError, ValueError, AssertionError) as e:
            raise RunDirError(
                f"{self.flag}: {self.marker_path} is not a readable run marker ({e or 'bad format'}); "
                f"use a new directory"
            ) from None
        return m

    def _write(self) -> None:
        os.makedirs(self.path, exist_ok=True)
        write_text_atomic(self.marker_path, json.dumps(self.marker, indent=1, sort_keys=True) + "\n")

    @property
    def held(self) -> bool:
        """This object holds the directory's lock."""
        return self._lock_fd is not None

    def acquire(self) -> None:
        """Take the directory's lock (an exclusive ``flock``, released by :meth:`release` or when the process ends,
        even by SIGKILL), then read the marker again and check it: what another trainer wrote before it let go
        counts. A directory in use is refused before anything of it is read."""
        if self._lock_fd is not None:
            return
        os.makedirs(self.path, exist_ok=True)
        fd = os.open(os.path.join(self.path, LOCK), os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o666)
        _LOCK_FDS.add(fd)  # a forked child (a DataLoader worker) closes its copy: the lock ends with this process
        try:
            if fcntl is not None:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    holder = _holder(fd)
                    raise RunDirError(
                        f"{self.flag} {self.path!r} is in use by another trainer ({holder}); "
                        f"two runs must not share a checkpoint directory"
                    ) from None
            line = f"pid {os.getpid()} on {os.uname().nodename}\n".encode()
            os.pwrite(fd, line, 0)  # then cut the last holder's longer line: the file is never empty once signed
            os.ftruncate(fd, len(line))
            on_disk = self._read() if os.path.isfile(self.marker_path) else None
            if self.marker is None or self.resume or (on_disk or {}).get("run_id") != self.marker["run_id"]:
                self._open()  # read under the lock (a marker this object wrote is already its own)
        except BaseException:
            _LOCK_FDS.discard(fd)
            os.close(fd)
            raise
        self._lock_fd = fd

    def release(self) -> None:
        """Let the directory's lock go (a no-op when not held)."""
        fd, self._lock_fd = self._lock_fd, None
        if fd is not None:
            _LOCK_FDS.discard(fd)
            with contextlib.suppress(OSError):
                os.close(fd)  # releases the flock

    def __del__(self) -> None:
        try:  # no contextlib here: at interpreter exit the module's globals may already be None
            self.release()
        except Exception:
            pass

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Hold the directory's lock for the block (taken unless :meth:`acquire` took it already; released at its
        end). The files of a run that ``--overwrite`` replaces are deleted here, when training starts."""
        self.acquire()
        try:
            if self._replaced is not None:
                for step in sorted(self._replaced["steps"], key=int):
                    self._remove(self._replaced, step)
                self._replaced = None
                self._write()
            elif not os.path.isfile(self.marker_path):
                self._write()
            yield
        finally:
            self.release()

    # ------------------------------------------------------------------------------------------------ steps
    def complete_steps(self) -> list[int]:
        return sorted(int(s) for s, v in self.marker["steps"].items() if v["status"] == "complete")

    def begin(self, step: int, paths: Sequence[str]) -> None:
        """Record ``step`` as pending, owning ``paths`` (relative; none may exist unless a step of ours owns it)."""
        key = str(int(step))
        if key in self.marker["steps"]:
            self._remove(self.marker, key)  # an earlier write of this step by this run (a resumed run redoes it)
        for p in paths:
            if os.path.lexists(os.path.join(self.path, p)):
                raise RunDirError(
                    f"{self.flag} {self.path!r}: {p} exists and no checkpoint of this run wrote it; "
                    f"move it away or use a new directory"
                )
        self.marker["steps"][key] = {"status": "pending", "paths": list(paths), "files": {}}
        self._write()

    def commit(self, step: int) -> None:
        """Checksum every file the step wrote and mark it complete (the step is valid from here on)."""
        entry = self.marker["steps"][str(int(step))]
        files = [f for p in entry["paths"] for f in _files_under(self.path, p)]
        entry["files"] = {f: sha256_file(os.path.join(self.path, f)) for f in files}
        entry["status"] = "complete"
        self._write()

    def abort(self, step: int) -> None:
        """Remove what a failed write of ``step`` left (it is ours: recorded as pending first)."""
        key = str(int(step))
        if key in self.marker["steps"]:
            self._remove(self.marker, key)
            self._write()

    def _remove(self, marker: dict, key: str) -> None:
        entry = marker["steps"].pop(key)
        for p in entry["paths"]:
            full = os.path.join(self.path, p)
            if entry["status"] == "pending":  # created by us after begin() saw it absent: wholly ours
                if os.path.isdir(full) and not os.path.islink(full):
                    shutil.rmtree(full, ignore_errors=True)
                elif os.path.lexists(full):
                    os.unlink(full)
                continue
            for f in entry["files"]:
                if f == p or f.startswith(p + os.sep):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(os.path.join(self.path, f))
            for dirpath, _, _ in sorted(os.walk(full), key=lambda t: -len(t[0])):  # empty dirs, deepest first
                with contextlib.suppress(OSError):
                    os.rmdir(dirpath)  # only succeeds when empty: a file we did not write keeps its folder

    def prune(self, keep: int) -> list[int]:
        """Delete this run's complete steps beyond the newest ``keep``, and its pending leftovers; returns them."""
        gone = [s for s in self.complete_steps()[:-keep]]
        gone += [int(s) for s, v in self.marker["steps"].items() if v["status"] == "pending"]
        for step in gone:
            self._remove(self.marker, str(step))
        if gone:
            self._write()
        return sorted(gone)

    def verify(self, step: int) -> str | None:
        """None when every file of ``step`` is present with its recorded checksum, else what is wrong."""
        entry = self.marker["steps"].get(str(int(step)))
        if entry is None or entry["status"] != "complete":
            return "not a complete checkpoint of this run"
        for f, digest in sorted(entry["files"].items()):
            full = os.path.join(self.path, f)
            if not os.path.isfile(full):
                return f"{f} is missing"
            if sha256_file(full) != digest:
                return f"{f} does not match its checksum (corrupt or changed since it was written)"
        return None

    def latest_valid(self, max_step: int | None = None) -> tuple[int | None, list[str]]:
        """``(newest complete step that verifies (and is <= max_step), [why each newer one was skipped])``."""
        problems = []
        for step in reversed(self.complete_steps()):
            if max_step is not None and step > max_step:
                problems.append(f"step {step} is past --steps {max_step}")
                continue
            why = self.verify(step)
            if why is None:
                return step, problems
            problems.append(f"step {step}: {why}")
        return None, problems


class StepCheckpointer:
    """What both twins' ``Checkpointer`` share: a :class:`RunDir` in ``directory`` (the lock taken at construction
    by the writer, then another run refused), ``keep`` checked, and the step lookup. A twin sets ``FRAMEWORK`` and
    writes and reads its steps (``save`` / ``restore`` or ``load``, ``path``).

    ``run``: the run-defining flags (:data:`RUN_FLAGS`); ``resume``: continue the run recorded there (else a new run:
    another run's checkpoints are refused unless ``overwrite``); ``writer``: this process writes the marker and holds
    the lock (process / rank 0; the others share its run)."""

    FRAMEWORK = ""

    def __init__(
        self,
        directory: str,
        keep: int = 3,
        *,
        run: Mapping[str, Any] | None = None,
        resume: bool = False,
        overwrite: bool = False,
        writer: bool = True,
    ):
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep={keep!r} must be an int >= 1 (checkpoints to keep)")
        self.directory, self.keep, self.writer = os.path.abspath(directory), keep, writer
        # the lock before anything is read: held until close() or the end of locked()
        self.run_dir = RunDir(
            self.directory, self.FRAMEWORK, run or {}, resume=resume, overwrite=overwrite, lock=writer
        )
        self.problems: list[str] = []

    def locked(self):
        """The directory's lock (taken at construction) held for the block, released at its end (the writer)."""
        return self.run_dir.locked() if self.writer else contextlib.nullcontext()

    def latest_step(self) -> int | None:
        """The newest step of this run whose files match their checksums; why newer ones were skipped is in
        :attr:`problems`."""
        step, self.problems = self.run_dir.latest_valid()
        return step

    def all_steps(self) -> list[int]:
        return self.run_dir.complete_steps()

    def close(self) -> None:
        """Let the directory's lock go."""
        self.run_dir.release()
