"""Result records on disk: ``<out>/<suite>.json`` (environment + records), written atomically, read back.

    write_results("benchmarks/results/cpu", "model", records, env_info())   # -> .../cpu/model.json

A record is a flat dict; every file is written to a temporary file beside it and moved into place
(``os.replace``) only when complete, so a result is never replaced by an empty or partial one (design §9).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from jaxattn.spec.atomic import atomic_path, write_text_atomic  # noqa: F401 - the benchmarks' writes

# The committed results: benchmarks/results/<device>[-quick]/, <target>-compiled/, train-example/.
RESULTS_DIR = Path(os.path.abspath(__file__)).parent.parent / "results"


def impl_label(r: dict) -> str:
    """``framework:impl`` of a record: its column in the report table and its series in a plot."""
    return f"{r.get('framework', '?')}:{r.get('impl', '?')}"


def check_out_dir(out_dir: str) -> str:
    """``out_dir`` as an absolute path, after checking that results can be written there (before any work).

    The directory may not exist yet (it is created when the first result is written); then its nearest
    existing parent must be a writable directory. Checked by creating and removing a probe file, which also
    catches read-only filesystems and root on them. Raises ValueError naming the path and the reason."""
    path = os.path.abspath(out_dir)
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"--out {out_dir!r}: {path} exists and is not a directory")
    probe = path
    while not os.path.exists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    if not os.path.isdir(probe):
        raise ValueError(f"--out {out_dir!r}: cannot create it, {probe} is not a directory")
    try:
        fd, tmp = tempfile.mkstemp(prefix=".benchmarks-write-test-", dir=probe)
        os.close(fd)
        os.remove(tmp)
    except OSError as e:
        raise ValueError(
            f"--out {out_dir!r} is not writable: cannot create a file in {probe} "
            f"({e.strerror or e}); pick a writable directory"
        ) from None
    return path


def write_results(out_dir: str, suite: str, records: list[dict], info: dict) -> str:
    """Writes ``<out_dir>/<suite>.json`` atomically; refuses an empty record list (it would erase a result)."""
    if not records:
        raise ValueError(
            f"write_results: no records for suite {suite!r}; refusing to replace "
            f"{os.path.join(out_dir, suite + '.json')} with an empty result"
        )
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{suite}.json")
    text = json.dumps({"env": info, "suite": suite, "records": records}, indent=1, default=str)
    return write_text_atomic(path, text)


def read_results(out_dir: str) -> dict[str, dict]:
    """``{suite: {"env", "suite", "records"}}`` for every readable ``<suite>.json`` in ``out_dir``."""
    found = {}
    for name in sorted(os.listdir(out_dir)) if os.path.isdir(out_dir) else []:
        if not name.endswith(".json") or name.startswith("."):
            continue
        try:
            with open(os.path.join(out_dir, name)) as f:
                data = json.load(f)
        except (OSError, ValueError):
            continue
        if isinstance(data, dict) and isinstance(data.get("records"), list) and data.get("suite"):
            found[data["suite"]] = data
    return found
