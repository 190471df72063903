"""Result records on disk: ``<out>/<suite>.json`` (environment + records), written atomically, read back.

    write_results("benchmarks/results/cpu", "model", records, env_info())   # -> .../cpu/model.json

A record is a flat dict; every file is written to a temporary file beside it and moved into place
(``os.replace``), so a reader never sees half a file. While a suite runs, :class:`LiveRows` rewrites its file after
every finished row with ``"complete": false`` (a timeout or an out-of-memory kill keeps the rows before it); the
suite's end writes it with ``"complete": true``. Nothing is written until a row has been measured, so a run that
measures nothing never replaces a result (design §9).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from twincore.atomic import atomic_path, check_writable, write_text_atomic  # noqa: F401 - the benchmarks' writes

# The committed results: benchmarks/results/cpu-quick/, cpu/, h100-compiled/, h100-plan/, train-example/, written
# only by an explicit `--out benchmarks/results/...` (a maintainer's refresh, then `python -m benchmarks.readme`).
RESULTS_DIR = Path(os.path.abspath(__file__)).parent.parent / "results"
# Where every command writes by default: git-ignored, so running the README's commands never changes a tracked file.
LOCAL_DIR = RESULTS_DIR / "local"


# python -m benchmarks run --suite NAME: one module each in benchmarks/suites/, run (and reported) in this order
SUITES = ("model", "attention", "remat", "decode", "plan", "train", "compile")


def default_out(name: str) -> str:
    """The default ``--out`` of a command: ``benchmarks/results/local/<name>`` (untracked)."""
    return str(LOCAL_DIR / name)


def impl_label(r: dict) -> str:
    """``framework:impl`` of a record: its column in the report table and its series in a plot; a record that ran
    at another dtype than its row's says so (``jax:pallas:mgpu as float16``: that peer has float16 buffers only)."""
    other = f" as {r['run_dtype']}" if r.get("run_dtype") else ""
    return f"{r.get('framework', '?')}:{r.get('impl', '?')}{other}"


def check_out_dir(out_dir: str) -> str:
    """``out_dir`` as an absolute path, after checking that results can be written there (before any work; it may
    not exist yet). Raises ValueError naming ``--out``, the path and the reason (``twincore.atomic.check_writable``)."""
    return check_writable(out_dir, "--out", is_dir=True)


def write_results(out_dir: str, suite: str, records: list[dict], info: dict, *, complete: bool = True) -> str:
    """Writes ``<out_dir>/<suite>.json`` atomically; refuses an empty record list (it would erase a result).
    ``complete=False``: the suite is still running (or was stopped); the file says so."""
    if not records:
        raise ValueError(
            f"write_results: no records for suite {suite!r}; refusing to replace "
            f"{os.path.join(out_dir, suite + '.json')} with an empty result"
        )
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{suite}.json")
    data = {"env": info, "suite": suite, "complete": complete, "records": list(records)}
    return write_text_atomic(path, json.dumps(data, indent=1, default=str))


class LiveRows(list):
    """The record list a suite appends to while it runs: after each finished row (``append``/``extend``) the
    suite's JSON is rewritten (``complete: false``) and one progress line is printed, once at least one row is
    ``ok`` (a run of skips only never replaces a result).

        rows = LiveRows(out_dir, "model", env_info())      # a suite does ``records = measure.rows()``
    """

    def __init__(self, out_dir: str, suite: str, info: dict, log=None):
        super().__init__()
        self.out_dir, self.suite, self.info = out_dir, suite, info
        self.log = log or (lambda line: print(line, flush=True))
        self.t0 = time.perf_counter()
        self.path = None

    def append(self, record: dict) -> None:
        super().append(record)
        self._flush([record])

    def extend(self, records) -> None:
        new = list(records)
        super().extend(new)
        self._flush(new)

    def _flush(self, new: list[dict]) -> None:
        if not new:
            return
        if any(r.get("status", "ok") == "ok" for r in self):  # on disk before its line is printed
            self.path = write_results(self.out_dir, self.suite, self, self.info, complete=False)
        for i, r in enumerate(new, len(self) - len(new) + 1):
            self.log(f"[{self.suite} row {i}, {time.perf_counter() - self.t0:.1f} s] {row_line(r)}")


def row_line(r: dict) -> str:
    """One line naming a record: its framework:impl, its shape fields, and its time or why it was skipped."""
    keys = ("preset", "model", "toggle", "weights", "pass", "B", "S", "D", "causal")
    shape = " ".join(f"{k}={r[k]}" for k in keys if k in r)
    if r.get("status", "ok") != "ok":
        return f"{impl_label(r)} {shape}: {r.get('status')} ({str(r.get('reason', ''))[:160]})"
    t = r.get("median_ms")
    return f"{impl_label(r)} {shape}: " + (f"{t:.3f} ms" if isinstance(t, (int, float)) else "ok")


def read_results(out_dir: str) -> dict[str, dict]:
    """``{suite: {"env", "suite", "records", "files"}}`` for every suite with a readable JSON in ``out_dir``.

    A suite measured in several runs (e.g. ``attention-flash-vs-sdpa-flash.json`` and
    ``attention-mosaic-cudnn-vs-sdpa-cudnn.json``, each ``run --suite attention --impl ...``) is one entry: its
    records merged in file-name order, ``env`` the most recent file's (by ``time_utc``) and ``files`` every file's
    ``{"file", "env", "records", "complete"}`` (name, its own environment, its number of records, whether its run
    finished) in that order; a suite of
    one file has one entry in ``files``."""
    found: dict[str, dict] = {}
    for name in sorted(os.listdir(out_dir)) if os.path.isdir(out_dir) else []:
        if not name.endswith(".json") or name.startswith("."):
            continue
        try:
            with open(os.path.join(out_dir, name)) as f:
                data = json.load(f)
        except (OSError, ValueError):
            continue
        if not (isinstance(data, dict) and isinstance(data.get("records"), list) and data.get("suite")):
            continue
        env = data.get("env") or {}
        source = {"file": name, "env": env, "records": len(data["records"]), "complete": data.get("complete", True)}
        if data["suite"] not in found:
            found[data["suite"]] = {**data, "files": [source]}
            continue
        merged = found[data["suite"]]
        merged["records"] = merged["records"] + data["records"]
        if data.get("complete") is False:  # one stopped file makes the merged suite incomplete
            merged["complete"] = False
        merged["files"].append(source)
        merged["env"] = max((f["env"] for f in merged["files"]), key=lambda e: str(e.get("time_utc", "")))
    return found
