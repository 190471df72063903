"""The Hugging Face Llama checkpoint directory format, framework-neutral (no jax, no torch).

Shared by ``jaxattn.hf`` and ``torchref.hf`` so both read and write byte-identical layouts: ``config.json`` plus
``model.safetensors`` or ``model-0000i-of-0000n.safetensors`` shards with ``model.safetensors.index.json``.
The tensor files themselves are read and written by ``safetensors`` (a callback per framework); this module
knows names, shapes, dtypes, sharding and the save protocol. ``transformers``' own loader needs its model
classes; we only need the file layout.

    cfg, tensors = read_checkpoint("ckpt", safetensors.numpy.load_file)

Directory semantics (as ``transformers``): a save writes INTO the directory, creating it and its parents, and
touches only the files it owns (``config.json``, ``model.safetensors``, ``model-NNNNN-of-NNNNN.safetensors``,
``model.safetensors.index.json``, its staging folder ``.save.tmp-<pid>-<hex>/`` and temp shards
``.<shard>.tmp-<pid>-<hex>``); every other file stays. Permissions come from the umask. Saves to one directory
are serialised by an ``flock`` on the directory itself (no lock file; last writer wins); loads take the shared
lock, so they never see a half-cleaned directory.

Crash safety (a SIGKILL at any instant leaves the old or the new checkpoint). What loads is decided by ONE
file, the *commit point*: ``model.safetensors`` when it exists (``transformers`` looks there first too), else
the index. A save (1) writes every new file into its staging folder and fsyncs it, (2) renames new shards to
names the live index does not reference (when the names collide with live ones it moves them to temp names,
commits an index naming those, then hard-links them into place), (3) commits with one ``os.replace`` of the
commit point, or the ``unlink`` of ``model.safetensors`` when going single -> sharded, (4) renames
``config.json`` in, (5) removes stale weight files of ours and the staging folder. The commit point records the
sha256 of the ``config.json`` it was saved with; if a kill fell between (3) and (4), the loader takes the staged
config of that hash (the next save renames it in first), so config and weights never mismatch. A hand-edited
``config.json`` (hash differs, no such staged file) is used as it is. The loader reads nothing the commit point
does not name, and the next save removes what a killed one left.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import numbers
import os
import re
import shutil
import stat
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

from . import params
from .atomic import fsync_path, temp_name, write_bytes_atomic
from .dtypes import MODEL_DTYPES

try:
    import fcntl
except ImportError:  # Windows: saves to one directory are not serialised
    fcntl = None

CONFIG_NAME = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3
SAFETENSORS_METADATA = {"format": "pt"}  # transformers refuses files without a known format tag
CONFIG_HASH_KEY = "jaxattn_config_sha256"  # in the commit point's metadata: sha256 of config.json's bytes

_SHARD_RE = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
_OWNED = r"config\.json|model\.safetensors|model-\d{5}-of-\d{5}\.safetensors|model\.safetensors\.index\.json"
_TEMP_RE = re.compile(rf"\.(?P<final>{_OWNED})\.tmp-\d+-[0-9a-f]+")  # shards an index may name mid-save
_STAGING_RE = re.compile(r"\.save\.tmp-\d+-[0-9a-f]+")  # a save's private folder for its new files


class CheckpointError(ValueError):
    """A checkpoint directory or state dict does not match the model configuration, or cannot be parsed."""


# ----------------------------------------------------------------------------------------------- checks


def expected_shapes(cfg) -> dict[str, tuple[int, ...]]:
    """HF key -> shape for ``cfg`` (the parameter table's :func:`~twincore.params.hf_shapes`)."""
    return params.hf_shapes(cfg)


def check_state_shapes(cfg, shapes: Mapping[str, Sequence[int]], where: str = "state dict") -> None:
    """Raise ``CheckpointError`` listing every missing, unexpected and mis-shaped tensor.

    With tied embeddings a stored ``lm_head.weight`` is tolerated (HF writers differ); the embedding wins.
    Rotary ``inv_freq`` buffers written by old transformers versions are ignored.
    """
    want = expected_shapes(cfg)
    ignorable = {"lm_head.weight"} if cfg.tie_embeddings else set()
    have = {k: tuple(v) for k, v in shapes.items() if not k.endswith("rotary_emb.inv_freq")}
    missing = sorted(set(want) - set(have))
    unexpected = sorted(set(have) - set(want) - ignorable)
    wrong = sorted(f"{k}: expected {want[k]}, got {have[k]}" for k in set(want) & set(have) if want[k] != have[k])
    if cfg.tie_embeddings and "lm_head.weight" in have and have["lm_head.weight"] != want["model.embed_tokens.weight"]:
        wrong.append(
            f"lm_head.weight: expected {want['model.embed_tokens.weight']} (tied), got {have['lm_head.weight']}"
        )
    if missing or unexpected or wrong:
        parts = [f"{where} does not match the model config:"]
        for title, items in (("missing", missing), ("unexpected", unexpected), ("wrong shape", wrong)):
            if items:
                parts.append(
                    f"  {title} ({len(items)}): " + ", ".join(items[:20]) + (" ..." if len(items) > 20 else "")
                )
        raise CheckpointError("\n".join(parts))


def dtype_name(dtype) -> str:
    """``'float32'`` for a numpy, jax or torch dtype (``torch.float32`` loses its prefix)."""
    return str(dtype).removeprefix("torch.")


def check_state_dtypes(dtypes: Mapping[str, object], where: str = "state dict") -> None:
    """Raise ``CheckpointError`` naming every tensor whose dtype is not one of ``MODEL_DTYPES``.

    ``dtypes`` maps key -> dtype (any framework's, or its name). Both packages refuse the same tensors: an
    int32 embedding would otherwise load into an int Param on one side and fail on the other.
    """
    bad = sorted(f"{k}: {dtype_name(d)}" for k, d in dtypes.items() if dtype_name(d) not in MODEL_DTYPES)
    if bad:
        raise CheckpointError(
            f"{where} has tensors of unsupported dtype ({len(bad)}): "
            + ", ".join(bad[:20])
            + (" ..." if len(bad) > 20 else "")
            + f"; a checkpoint holds {', '.join(MODEL_DTYPES)}"
        )


def quantized_model_error(package: str) -> TypeError:
    """``save_pretrained``'s refusal of a model ``{package}.quant.quantize`` made int8 (the same words in both twins):
    a Llama checkpoint holds float weights, so the int8 weights and scales would load as nothing."""
    return TypeError(
        f"save_pretrained: model is int8-quantized by {package}.quant.quantize (int8 weights with per-channel "
        f"scales), which a Hugging Face Llama checkpoint cannot hold; nothing was written. Save the float model "
        f"instead and quantize after loading: {package}.quant.quantize({package}.from_pretrained(path))"
    )


def check_max_shard_bytes(max_shard_bytes) -> int:
    """``max_shard_bytes`` if it is a positive int (bool refused), else a TypeError/ValueError naming it."""
    if isinstance(max_shard_bytes, bool) or not isinstance(max_shard_bytes, numbers.Integral):
        raise TypeError(
            f"max_shard_bytes={max_shard_bytes!r} is not supported; use a positive int number of "
            f"bytes (e.g. 5 * 1024**3 for 5 GiB)"
        )
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes={max_shard_bytes!r} is not supported; use a positive int number of bytes")
    return int(max_shard_bytes)


# ----------------------------------------------------------------------------------------------- reading


def _read_json(file: str) -> dict:
    try:
        with open(file, "rb") as f:
            data = json.loads(f.read())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{file} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise CheckpointError(f"{file} must hold a JSON object, got {type(data).__name__}")
    return data


def _safetensors_metadata(file: str) -> dict:
    """The ``__metadata__`` of a safetensors file ({} when the header is unreadable: loading reports that)."""
    try:
        with open(file, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if not 2 <= n <= 100_000_000:
                return {}
            meta = json.loads(f.read(n)).get("__metadata__")
    except (OSError, ValueError, AttributeError):
        return {}
    return meta if isinstance(meta, dict) else {}


class _Live(NamedTuple):
    kind: str | None  # "single", "index" or None (nothing committed)
    files: frozenset  # names the commit point references, itself included
    weights: tuple  # the safetensors files to load, in order
    config_sha: str | None  # sha256 of config.json recorded at commit, None for foreign checkpoints


def _live(path: str) -> _Live:
    """What loads from ``path`` now: ``model.safetensors`` if present (as in transformers), else the index."""
    single = os.path.join(path, SINGLE_FILE)
    if os.path.isfile(single):
        return _Live(
            "single", frozenset([SINGLE_FILE]), (SINGLE_FILE,), _safetensors_metadata(single).get(CONFIG_HASH_KEY)
        )
    index = os.path.join(path, INDEX_FILE)
    if not os.path.isfile(index):
        return _Live(None, frozenset(), (), None)
    data = _read_json(index)
    weight_map = data.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{index} has no 'weight_map'")
    odd = [
        n
        for n in set(weight_map.values())
        if not isinstance(n, str) or os.path.basename(n) != n or n in ("", ".", "..")
    ]
    if odd:
        raise CheckpointError(f"{index} names shard files outside the directory: {odd}")
    names = sorted(set(weight_map.values()))
    meta = data.get("metadata")
    sha = meta.get(CONFIG_HASH_KEY) if isinstance(meta, dict) else None
    return _Live("index", frozenset(names) | {INDEX_FILE}, tuple(names), sha)


def _sha256(file: str) -> str | None:
    try:
        with open(file, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()
    except OSError:
        return None


def _committed_config_file(path: str, live: _Live) -> str:
    """``config.json``, or the staged config the commit point names by hash after a kill between steps 3 and 4."""
    cfg = os.path.join(path, CONFIG_NAME)
    if live.config_sha is None or _sha256(cfg) == live.config_sha:
        return cfg
    for name in sorted(os.listdir(path)):
        staged = os.path.join(path, name, CONFIG_NAME)
        if _STAGING_RE.fullmatch(name) and _sha256(staged) == live.config_sha:
            return staged
    return cfg  # config.json edited by hand after the save: it wins


def _check_dir(path) -> str:
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"checkpoint path {path!r} is not a directory")
    return path


def _read_config(path: str, live: _Live) -> dict:
    file = _committed_config_file(path, live)
    if not os.path.isfile(file):
        raise FileNotFoundError(f"checkpoint directory {path!r} has no {CONFIG_NAME}")
    return _read_json(file)


def _weight_paths(path: str, live: _Live) -> list[str]:
    if live.kind is None:
        raise FileNotFoundError(
            f"checkpoint directory {path!r} has neither {SINGLE_FILE} nor {INDEX_FILE} "
            f"(found: {sorted(os.listdir(path))})"
        )
    absent = [f for f in live.weights if not os.path.isfile(os.path.join(path, f))]
    if absent:
        raise CheckpointError(f"{os.path.join(path, INDEX_FILE)} names shard files that are missing: {absent}")
    return [os.path.join(path, f) for f in live.weights]


def read_config(path: str | os.PathLike) -> dict:
    """The committed ``config.json`` of a checkpoint directory, parsed."""
    path = _check_dir(path)
    with _dir_lock(path, exclusive=False):
        return _read_config(path, _live(path))


def weight_files(path: str | os.PathLike) -> list[str]:
    """The safetensors files that load from ``path``: ``model.safetensors``, else the shards the index names."""
    path = _check_dir(path)
    with _dir_lock(path, exclusive=False):
        return _weight_paths(path, _live(path))


def read_checkpoint(path: str | os.PathLike, load_file: Callable[[str], dict]) -> tuple[dict, dict]:
    """``(hf_config, tensors)`` of a checkpoint directory, read under the shared lock.

    ``load_file(filename)`` reads one safetensors file (``safetensors.numpy.load_file`` or the torch one).
    Files the commit point does not name (temp files, stale shards, anything else) are never read.
    """
    path = _check_dir(path)
    with _dir_lock(path, exclusive=False):
        live = _live(path)
        config = _read_config(path, live)
        tensors: dict = {}
        for file in _weight_paths(path, live):
            try:
                tensors.update(load_file(file))
            except (OSError, MemoryError):
                raise
            except Exception as e:  # safetensors' own errors do not name the file
                raise CheckpointError(f"{file} is not a readable safetensors file: {e}") from e
    return config, tensors


def load_checked(path: str | os.PathLike, load_file: Callable[[str], dict]):
    """``(ModelConfig, tensors)`` of a checkpoint directory (:func:`read_checkpoint`), every tensor's name, shape
    and dtype checked against the config: both twins' ``from_pretrained`` before they build a model."""
    from .config import ModelConfig

    hf_config, tensors = read_checkpoint(path, load_file)
    config = ModelConfig.from_hf(hf_config)
    where = f"checkpoint {os.fspath(path)!r}"
    check_state_shapes(config, {k: tuple(v.shape) for k, v in tensors.items()}, where)
    check_state_dtypes({k: v.dtype for k, v in tensors.items()}, where)
    return config, tensors


# ----------------------------------------------------------------------------------------------- writing


def _natural_key(name: str):
    return [int(p) if p.isdigit() else p for p in str(name).split(".")]


def plan_shards(sizes: Mapping[str, int], max_shard_bytes: int) -> list[list[str]]:
    """Split tensor names, in natural order (layer 2 before layer 10), into shards of at most
    ``max_shard_bytes``; the order is canonical so both frameworks write identical files."""
    check_max_shard_bytes(max_shard_bytes)
    shards: list[list[str]] = [[]]
    used = 0
    for name in sorted(sizes, key=_natural_key):
        size = sizes[name]
        if shards[-1] and used + size > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += size
    return shards


def shard_name(i: int, n: int) -> str:
    return f"model-{i:05d}-of-{n:05d}.safetensors"


@contextlib.contextmanager
def _dir_lock(path: str, exclusive: bool):
    """``flock`` on the directory itself; best effort where the filesystem has no flock (then unlocked)."""
    fd = None
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        if fcntl is not None:
            fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
    except OSError:
        pass
    try:
        yield
    finally:
        if fd is not None:
            os.close(fd)


def _prepare_dir(path) -> str:
    """Create ``path`` (and parents) with umask permissions; clear errors for "", files and read-only dirs."""
    p = os.fspath(path)
    if not isinstance(p, str):
        raise TypeError(f"path={path!r} must be a str or os.PathLike of str")
    if p == "":
        raise ValueError("path='' is empty; name the checkpoint directory (use '.' for the current directory)")
    if os.path.lexists(p) and not os.path.isdir(p):
        what = "a symbolic link to a non-directory" if os.path.islink(p) else "a file"
        raise FileExistsError(
            f"path={p!r} is {what}; save_pretrained writes into a directory (it never replaces a file)"
        )
    try:
        os.makedirs(p, exist_ok=True)
    except PermissionError as e:
        raise PermissionError(f"cannot create checkpoint directory {p!r}: {e.strerror}") from e
    except OSError as e:  # a parent is a file, a dangling link, ...
        raise FileExistsError(f"cannot create checkpoint directory {p!r}: {e}") from e
    if not os.access(p, os.W_OK | os.X_OK):
        raise PermissionError(f"checkpoint directory {p!r} is not writable")
    return p


def _recover(path: str) -> _Live:
    """Finish an interrupted save (config.json of the committed hash) and remove stale temp files of ours."""
    try:
        live = _live(path)
    except CheckpointError:  # an unreadable index: nothing loads, nothing to keep consistent
        live = _Live("index", frozenset([INDEX_FILE]), (), None)
    cfg = _committed_config_file(path, live)
    if cfg != os.path.join(path, CONFIG_NAME):  # a kill fell between commit and config.json: finish it
        os.replace(cfg, os.path.join(path, CONFIG_NAME))
    for name in os.listdir(path):
        if _STAGING_RE.fullmatch(name):
            shutil.rmtree(os.path.join(path, name), ignore_errors=True)
        elif _TEMP_RE.fullmatch(name) and name not in live.files:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(path, name))
    return live


def _json_bytes(obj: dict) -> bytes:
    return (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode()


def _index(weight_map: dict, total: int, config_sha: str) -> dict:
    return {"metadata": {"total_size": int(total), CONFIG_HASH_KEY: config_sha}, "weight_map": weight_map}


def _commit(
    path: str,
    live: _Live,
    hf_config: dict,
    tensors: Mapping[str, object],
    sizes: Mapping[str, int],
    save_file: Callable[[dict, str, dict], None],
    shards: list[list[str]],
) -> None:
    """Steps 1-5 of the protocol in the module docstring; the caller holds the lock, ``live`` is ``_recover``'s.

    New files are written in a private staging folder (``safetensors`` makes its own temp file beside the
    target, owner-only: inside our folder a kill leaves nothing unrecognisable), then moved in by rename.
    """
    join = lambda name: os.path.join(path, name)  # noqa: E731
    config_bytes = _json_bytes(hf_config)
    sha = hashlib.sha256(config_bytes).hexdigest()
    stage = join(temp_name("save"))  # ".save.tmp-<pid>-<hex>"
    os.mkdir(stage)
    staged = lambda name: os.path.join(stage, name)  # noqa: E731

    # 1. every new file in the staging folder, fsynced, with the permissions a new file gets (umask)
    write_bytes_atomic(staged(CONFIG_NAME), config_bytes)
    mode = stat.S_IMODE(os.stat(staged(CONFIG_NAME)).st_mode)
    finals = [SINGLE_FILE] if len(shards) == 1 else [shard_name(i, len(shards)) for i in range(1, len(shards) + 1)]
    for final, names in zip(finals, shards):
        meta = {**SAFETENSORS_METADATA, CONFIG_HASH_KEY: sha} if len(shards) == 1 else dict(SAFETENSORS_METADATA)
        save_file({k: tensors[k] for k in names}, staged(final), meta)
        if stat.S_IMODE(os.stat(staged(final)).st_mode) != mode:
            os.chmod(staged(final), mode)
        fsync_path(staged(final))
    total = sum(sizes[k] for names in shards for k in names)

    def move_index(files: list[str]) -> None:  # stage an index naming ``files`` and rename it in
        weight_map = {k: f for f, names in zip(files, shards) for k in names}
        write_bytes_atomic(staged(INDEX_FILE), _json_bytes(_index(weight_map, total, sha)))
        os.replace(staged(INDEX_FILE), join(INDEX_FILE))

    if len(shards) == 1:
        new_files = {SINGLE_FILE}
        os.replace(staged(SINGLE_FILE), join(SINGLE_FILE))  # 3. commit: model.safetensors wins over any index
    else:
        new_files = {*finals, INDEX_FILE}
        if live.kind == "index" and live.files & set(finals):
            # 2'. the shard names are live: commit an index naming temp names first, then link them into place
            temps = [temp_name(f) for f in finals]
            for tmp, final in zip(temps, finals):
                os.replace(staged(final), join(tmp))
            fsync_path(path)
            move_index(temps)  # 3. commit
            os.replace(staged(CONFIG_NAME), join(CONFIG_NAME))  # 4.
            for tmp, final in zip(temps, finals):
                link = staged(final)
                try:
                    os.link(join(tmp), link)
                except OSError:  # no hard links on this filesystem: copy
                    shutil.copyfile(join(tmp), link)
                    fsync_path(link)
                os.replace(link, join(final))
        else:
            for final in finals:  # 2. names nothing live references
                os.replace(staged(final), join(final))
        fsync_path(path)
        move_index(finals)  # 3. commit (unless model.safetensors exists)
        if os.path.lexists(join(SINGLE_FILE)):
            os.unlink(join(SINGLE_FILE))  # 3. commit when the old checkpoint was a single file
    if os.path.lexists(staged(CONFIG_NAME)):
        os.replace(staged(CONFIG_NAME), join(CONFIG_NAME))  # 4.
    fsync_path(path)
    for name in os.listdir(path):  # 5. stale weight files and temp files of ours
        owned = name in (SINGLE_FILE, INDEX_FILE) or _SHARD_RE.fullmatch(name) or _TEMP_RE.fullmatch(name)
        if owned and name not in new_files:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(join(name))
    shutil.rmtree(stage, ignore_errors=True)


def write_checkpoint(
    path: str | os.PathLike,
    hf_config: dict,
    tensors: Mapping[str, object],
    sizes: Mapping[str, int],
    save_file: Callable[[dict, str, dict], None],
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> str:
    """Write ``config.json`` and the safetensors file(s) into ``path`` crash-safely; return its absolute path.

    ``save_file(tensors_subset, filename, metadata)`` writes one safetensors file (framework-specific). Only
    the files this module owns are touched (see the module docstring); a symlink to a directory is followed.
    """
    shards = plan_shards(sizes, max_shard_bytes)
    p = _prepare_dir(path)
    with _dir_lock(p, exclusive=True):
        try:
            _commit(p, _recover(p), hf_config, tensors, sizes, save_file, shards)
        except BaseException as e:
            with contextlib.suppress(Exception):
                _recover(p)  # roll a committed save forward, drop our temp files
            if isinstance(e, PermissionError):
                raise PermissionError(f"cannot write the checkpoint into {p!r}: {e}") from e
            if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS):
                raise OSError(e.errno, f"cannot write the checkpoint into {p!r}: {e.strerror}") from e
            raise
    return os.path.abspath(p)
