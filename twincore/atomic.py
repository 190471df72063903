"""Crash-safe file writes: a file appears whole or not at all (write a temporary name beside it, fsync, rename).

    with atomic_path("out/results.json") as tmp:         # a temporary path in out/
        write(tmp)                                        # on success fsynced and renamed onto results.json
    write_text_atomic("out/report.md", text)

The temporary file is ``.<name>.tmp-<pid>-<hex>`` in the target's directory (:func:`temp_name`, so a crash leaves a
name its writer can recognise and remove), created with the umask's permissions; the rename is ``os.replace``
(atomic on POSIX) and the directory is fsynced after it. If the block raises, the temporary file is removed and
the target is untouched. Used by the HF checkpoint writer, torch's training checkpoints and the benchmark results.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import tempfile
from collections.abc import Iterator

__all__ = [
    "atomic_path",
    "check_writable",
    "write_bytes_atomic",
    "write_text_atomic",
    "fsync_path",
    "temp_name",
    "temp_pid",
]

_TEMP = re.compile(r"\.(?P<final>.+)\.tmp-(?P<pid>\d+)-[0-9a-f]+")


def check_writable(path: str, flag: str, *, is_dir: bool) -> str:
    """``path`` as an absolute path, after proving that it can be written now (not after the work it will hold):
    not empty, not an existing entry of the other kind, and its nearest existing ancestor accepts a new file
    (probed by creating and removing one, which also catches read-only file systems and root on them).
    Raises ValueError naming ``flag``, the path and the reason; creates nothing."""
    if not isinstance(path, str) or not path.strip():
        raise ValueError(f"{flag} {path!r}: an empty path; give a {'directory' if is_dir else 'file path'}")
    full = os.path.abspath(path)
    if os.path.exists(full) and os.path.isdir(full) != is_dir:
        raise ValueError(f"{flag} {path!r}: exists and is {'not ' if is_dir else ''}a directory")
    probe = full if is_dir else os.path.dirname(full)
    while not os.path.exists(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        raise ValueError(f"{flag} {path!r}: cannot be created, {probe} is not a directory")
    try:
        fd, tmp = tempfile.mkstemp(prefix=".write-probe-", dir=probe)
        os.close(fd)
        os.remove(tmp)
    except OSError as e:
        raise ValueError(
            f"{flag} {path!r}: is not writable, cannot create a file in {probe} ({e.strerror or e})"
        ) from None
    return full


def temp_name(final: str) -> str:
    """The temporary name (no directory) a write to the file named ``final`` goes through."""
    return f".{os.path.basename(final)}.tmp-{os.getpid()}-{secrets.token_hex(4)}"


def temp_pid(name: str, final_pattern: str = ".+"):
    """The writer's pid if ``name`` is a temporary name of a file matching ``final_pattern`` (a regex), else None."""
    m = _TEMP.fullmatch(name)
    return int(m["pid"]) if m and re.fullmatch(final_pattern, m["final"]) else None


def fsync_path(path: str) -> None:
    """fsync a file or a directory (a no-op where the platform refuses to fsync a directory)."""
    flags = os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if os.path.isdir(path) else 0)
    try:
        fd = os.open(path, flags)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_path(path: str) -> Iterator[str]:
    """Yields a new, empty temporary path beside ``path``; when the block completes the file is fsynced and moved
    onto ``path``; when it raises the file is removed and ``path`` is left as it was."""
    directory = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(directory, temp_name(path))
    with open(tmp, "xb"):  # a new file with the umask's permissions
        pass
    try:
        yield tmp
        fsync_path(tmp)
        os.replace(tmp, path)  # the commit
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    fsync_path(directory)


def write_bytes_atomic(path: str, data: bytes) -> str:
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        f.write(data)
    return path


def write_text_atomic(path: str, text: str) -> str:
    return write_bytes_atomic(path, text.encode())
