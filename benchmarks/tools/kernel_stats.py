"""What a GPU kernel compiled without a GPU costs: registers, spills, shared memory, occupancy, tensor-core
instructions.  Reads XLA's ``--xla_dump_to`` directory (per-kernel PTX, launch dimensions) and Mosaic GPU's
PTX printed on stdout, runs ``ptxas -v`` and ``cuobjdump -sass`` from the NVIDIA pip wheels.

    stats = kernel_stats.from_xla_dump("/tmp/dump", names=("flash_fwd", "flash_bwd_dq", "flash_bwd_dkv"))
    stats["flash_fwd"]["registers"], stats["flash_fwd"]["occupancy"], stats["flash_fwd"]["sass"]["HGMMA"]

Figures are "compiled for H100, not run": nothing here executes a kernel.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import math
import os
import re
import shutil
import subprocess
import tempfile
import types
from collections.abc import Iterable, Iterator

from jaxattn.gpu_target import tool_path

__all__ = [
    "H100_LIMITS",
    "occupancy",
    "ptxas_stats",
    "sass_counts",
    "xla_launches",
    "from_xla_dump",
    "NoPtxDump",
    "from_ptx",
    "capture_fd_output",
    "split_ptx_modules",
    "mosaic_smem_sizes",
    "mosaic_records",
]

# Per-SM limits of Hopper (sm_90): registers, shared memory usable by blocks (228 KB; 227 KB per block),
# threads, resident blocks; CUDA reserves 1 KB of shared memory per resident block.
H100_LIMITS = dict(
    registers=65536,
    smem=233472,
    smem_per_block=232448,
    threads=2048,
    blocks=32,
    warps=64,
    smem_reserved_per_block=1024,
    reg_alloc_unit=256,
    max_regs_per_thread=255,
)
# SASS opcodes counted: wgmma (Hopper tensor cores), mma.sync (pre-Hopper tensor cores), TMA bulk tensor loads,
# cp.async (LDGSTS).
SASS_OPS = ("HGMMA", "HMMA", "UTMALDG", "LDGSTS")
_ENTRY = re.compile(r"^\s*\.visible\s+\.entry\s+([\w$.]+)\s*\(", re.M)
_MAXNTID = re.compile(r"\.maxntid\s+(\d+)(?:,\s*(\d+))?(?:,\s*(\d+))?")


def occupancy(registers: int, smem_bytes: int, threads: int, limits: dict = H100_LIMITS) -> dict:
    """Resident blocks per SM and achievable occupancy (resident warps / max warps) from one block's
    registers per thread, shared memory and threads, with the SM limits (CUDA occupancy calculator rules:
    registers allocated per warp in units of 256, 1 KB shared memory reserved per block)."""
    if threads <= 0:
        raise ValueError(f"threads must be positive, got {threads}")
    warps = math.ceil(threads / 32)
    regs_per_warp = math.ceil(max(registers, 1) * 32 / limits["reg_alloc_unit"]) * limits["reg_alloc_unit"]
    by = {
        "registers": limits["registers"] // (regs_per_warp * warps),
        "smem": (
            limits["smem"] // (smem_bytes + limits["smem_reserved_per_block"])
            if smem_bytes <= limits["smem_per_block"]
            else 0
        ),
        "threads": limits["threads"] // threads,
        "blocks": limits["blocks"],
    }
    blocks = min(by.values())
    limiter = min(by, key=lambda k: by[k])
    return {
        "blocks_per_sm": blocks,
        "occupancy": blocks * warps / limits["warps"],
        "limited_by": limiter,
        "fits": blocks >= 1 and registers <= limits["max_regs_per_thread"],
    }


_PTXAS_FUNC = re.compile(r"Compiling entry function '([\w$.]+)'")
_PTXAS_PROPS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_PTXAS_USED = re.compile(r"Used (\d+) registers(?:, used (\d+) barriers)?(?:.*?(\d+) bytes smem)?")
# ptxas gives up overlapping a kernel's wgmma (each waits for the one before): printed before the entry's report,
# "in the function" (C7509, C7513, ...) or "for the function" (C7512, insufficient register resources)
_PTXAS_SERIAL = re.compile(
    r"wgmma\.mma_async instructions are serialized due to (.+?) (?:in|for) the function '([\w$.]+)'"
)
# ptxas drops a kernel's setmaxnreg (the register split between warpgroups), e.g. C7504 "to maintain compatibility
# across compilation units" (a relocatable compile, as jaxlib 0.12's Mosaic GPU does) or C7508; the line names no
# function: it belongs to the entry reported next
_PTXAS_NO_SETMAXNREG = re.compile(r"'setmaxnreg' ignored(?: to |; )?(.*?)\.?$")


def parse_ptxas(text: str) -> dict[str, dict]:
    """``{entry: {registers, spill_stores, spill_loads, stack, static_smem, barriers}}`` from ``ptxas -v``;
    ``wgmma_serialized`` (ptxas's reason: C7509 / C7512 / C7513, ...) for an entry whose wgmma ptxas serialized, and
    ``setmaxnreg_ignored`` (its reason: C7504 / C7508) for an entry whose ``setmaxnreg`` ptxas dropped."""
    out: dict[str, dict] = {}
    current = None
    no_setmaxnreg = None  # a reason waiting for the entry it belongs to
    for line in text.splitlines():
        m = _PTXAS_NO_SETMAXNREG.search(line)
        if m:
            no_setmaxnreg = m.group(1) or "no reason given"
            continue
        m = _PTXAS_SERIAL.search(line) or _PTXAS_FUNC.search(line)
        if m and no_setmaxnreg is not None:
            out.setdefault(m.group(m.lastindex), {})["setmaxnreg_ignored"] = no_setmaxnreg
            no_setmaxnreg = None
        if m and m.re is _PTXAS_SERIAL:
            out.setdefault(m.group(2), {})["wgmma_serialized"] = m.group(1)
            continue
        if m:
            current = out.setdefault(m.group(1), {})
            continue
        if current is None:
            continue
        m = _PTXAS_PROPS.search(line)
        if m:
            current.update(stack=int(m.group(1)), spill_stores=int(m.group(2)), spill_loads=int(m.group(3)))
        m = _PTXAS_USED.search(line)
        if m:
            current.update(registers=int(m.group(1)), barriers=int(m.group(2) or 0), static_smem=int(m.group(3) or 0))
    return out


def _ptxas_candidates() -> list:
    """The wheel's ptxas first (what jax's XLA uses), then newer ones for newer PTX (Mosaic GPU emits PTX
    ISA 9.0, which needs CUDA 13's ptxas): PATH, /usr/local/cuda*/bin."""
    found = [tool_path("ptxas"), shutil.which("ptxas")] + sorted(glob.glob("/usr/local/cuda*/bin/ptxas"), reverse=True)
    return list(dict.fromkeys(p for p in found if p))


_PTX_VERSION_LINE = re.compile(r"^(\s*\.version\s+)\d+\.\d+", re.M)
_PTXAS_TOO_OLD = re.compile(r"Unsupported \.version \d+\.\d+; current version is '(\d+\.\d+)'")


def ptxas_stats(ptx_path: str, arch: str = "sm_90a", cubin_path: str | None = None) -> dict[str, dict]:
    """Run ``ptxas -v --gpu-name=<arch>`` on a PTX file; returns :func:`parse_ptxas` of its report and keeps
    the cubin at ``cubin_path`` (for :func:`sass_counts`) when given.  A ptxas too old for the file's PTX
    version is skipped for the next one found.  When none here knows that version, the ``.version`` directive is
    lowered to the newest one the first ptxas accepts and assembled again, as XLA does before it runs ptxas
    (jaxlib >= 0.11's LLVM writes PTX ISA 9.4, its dump keeps that, CUDA 12.9's ptxas reads up to 8.8)."""
    candidates = _ptxas_candidates()
    if not candidates:
        raise RuntimeError("ptxas not found: pip install nvidia-cuda-nvcc-cu12 (the gpu-compile extra)")

    def run(ptxas: str, path: str):
        return subprocess.run(
            [ptxas, "-v", f"--gpu-name={arch}", path, "-o", cubin_path or os.devnull],
            capture_output=True,
            text=True,
        )

    errors, too_old = [], []
    for ptxas in candidates:
        res = run(ptxas, ptx_path)
        if res.returncode == 0:
            return parse_ptxas(res.stderr + res.stdout)
        errors.append(f"{ptxas}: {res.stderr.strip()[-300:]}")
        m = _PTXAS_TOO_OLD.search(res.stderr)
        if m is None:
            break
        too_old.append((ptxas, m.group(1)))
    else:
        with open(ptx_path) as f:
            ptx = f.read()
        for ptxas, version in too_old:
            fd, lowered = tempfile.mkstemp(suffix=".ptx", dir=os.path.dirname(ptx_path) or None)
            try:
                with os.fdopen(fd, "w") as f:
                    f.write(_PTX_VERSION_LINE.sub(rf"\g<1>{version}", ptx, count=1))
                res = run(ptxas, lowered)
            finally:
                os.unlink(lowered)
            if res.returncode == 0:
                return parse_ptxas(res.stderr + res.stdout)
            errors.append(f"{ptxas} (.version {version}): {res.stderr.strip()[-300:]}")
    raise RuntimeError(f"ptxas failed on {ptx_path}: " + " | ".join(errors))


def sass_counts(cubin_path: str) -> dict[str, dict[str, int]] | None:
    """``{function: {opcode: count}}`` for :data:`SASS_OPS` from ``cuobjdump -sass``, or None when cuobjdump
    (``nvidia-cuda-cuobjdump``) or its ``nvdisasm`` (``nvidia-cuda-nvdisasm``) is not installed."""
    cuobjdump, nvdisasm = tool_path("cuobjdump"), tool_path("nvdisasm")
    if cuobjdump is None or nvdisasm is None:
        return None
    env = dict(os.environ, PATH=os.path.dirname(nvdisasm) + os.pathsep + os.environ.get("PATH", ""))
    res = subprocess.run([cuobjdump, "-sass", cubin_path], capture_output=True, text=True, env=env)
    if res.returncode != 0:
        return None
    out: dict[str, dict[str, int]] = {}
    current: dict[str, int] | None = None
    for line in res.stdout.splitlines():
        m = re.search(r"Function : ([\w$.]+)", line)
        if m:
            current = out.setdefault(m.group(1), {op: 0 for op in SASS_OPS})
            continue
        if current is None:
            continue
        m = re.search(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", line)
        if m and m.group(1) in current:
            current[m.group(1)] += 1
    return out


# PTX instructions that show how a Hopper kernel pipelines (FlashAttention-3's ingredients): tensor-core and TMA
# work, then the warp-specialised register split (setmaxnreg: a producer warpgroup gives registers to consumers),
# async wgmma groups and their waits, and the mbarrier / named-barrier synchronisation between warpgroups.
PTX_OPS = {
    "wgmma": r"\bwgmma\.mma_async",
    "mma.sync": r"\bmma\.sync",
    "cp.async.bulk.tensor": r"\bcp\.async\.bulk\.tensor",
    "cp.async": r"\bcp\.async\.(?:ca|cg)",
    "setmaxnreg": r"\bsetmaxnreg\.",
    "wgmma.commit_group": r"\bwgmma\.commit_group",
    "wgmma.wait_group": r"\bwgmma\.wait_group",
    "wgmma.wait_group>0": r"\bwgmma\.wait_group\.sync\.aligned\s+[1-9]",  # a wait that leaves a group in flight
    "mbarrier.try_wait": r"\bmbarrier\.try_wait",
    "mbarrier.arrive": r"\bmbarrier\.arrive",
    "bar.sync": r"\b(?:bar|barrier)\.(?:sync|arrive)\b",
}


def ptx_counts(ptx: str) -> dict[str, int]:
    """Static PTX instruction counts of :data:`PTX_OPS` (tensor cores and TMA also a fallback when SASS is not
    available). Static: an instruction inside a loop counts once."""
    return {name: len(re.findall(pattern, ptx)) for name, pattern in PTX_OPS.items()}


_THUNK = re.compile(
    r"(kCustomKernel|kKernel)\s*\[[^\]]*\]\s+([\w$.]+)\s+grid:\s*\[([\d, ]+)\]\s+"
    r"threads:\s*\[([\d, ]+)\]\s+shared_memory:\s*(\d+)"
)


def xla_launches(dump_dir: str) -> list:
    """Kernel launches of the compiled program, from XLA's ``*thunk_sequence.txt``: ``[{name, grid, threads,
    shared_memory}]`` (one per launch; custom calls such as Mosaic GPU's are ``{"name": "custom_call"}``, cuDNN
    graphs ``{"name": "cudnn"}``)."""
    files = sorted(glob.glob(os.path.join(dump_dir, "*thunk_sequence.txt")))
    files = [f for f in files if "after_thunk_passes" not in f] or files
    out = []
    for path in files:
        with open(path) as f:
            for line in f:
                m = _THUNK.search(line)
                if m:
                    grid = [int(t) for t in m.group(3).split(",")]
                    threads = [int(t) for t in m.group(4).split(",")]
                    out.append(
                        {
                            "name": m.group(2),
                            "grid": grid,
                            "threads": math.prod(threads),
                            "shared_memory": int(m.group(5)),
                        }
                    )
                elif "kCustomCall" in line:
                    out.append({"name": "custom_call"})
                elif "kCuDnn" in line:
                    out.append({"name": "cudnn"})
    return out


def _kernel_record(
    name: str,
    ptxas: dict,
    launch: dict | None,
    sass: dict | None,
    ptx: str,
    smem_dynamic: int | None = None,
    threads: int | None = None,
) -> dict:
    threads = threads if threads is not None else (launch or {}).get("threads")
    smem = smem_dynamic if smem_dynamic is not None else (launch or {}).get("shared_memory", 0)
    smem_total = smem + ptxas.get("static_smem", 0)
    rec = {
        "kernel": name,
        "registers": ptxas.get("registers"),
        "spill_stores": ptxas.get("spill_stores", 0),
        "spill_loads": ptxas.get("spill_loads", 0),
        "stack": ptxas.get("stack", 0),
        "barriers": ptxas.get("barriers", 0),
        "wgmma_serialized": ptxas.get("wgmma_serialized"),
        "setmaxnreg_ignored": ptxas.get("setmaxnreg_ignored"),
        "smem_bytes": smem_total,
        "threads": threads,
        "sass": sass,
        "ptx_counts": ptx_counts(ptx),
    }
    if threads and rec["registers"] is not None:
        rec.update(occupancy(rec["registers"], smem_total, threads))
        rec["regs_x_threads"] = rec["registers"] * threads
    return rec


def from_ptx(
    ptx: str,
    workdir: str,
    *,
    threads: int | None = None,
    smem_dynamic: int | None = None,
    launches: dict | None = None,
    arch: str = "sm_90a",
    ptxas_report: str | None = None,
) -> dict[str, dict]:
    """Records for every ``.entry`` of one PTX module (see :func:`_kernel_record`).  ``ptxas_report``: the
    ``ptxas -v`` output of the compile that was really used (Mosaic GPU prints its own with
    ``MOSAIC_GPU_DUMP_PTXAS=1``); it wins over ours, and when no ptxas here accepts the PTX the SASS counts are
    None (the PTX counts remain)."""
    names = _ENTRY.findall(ptx)
    fd, ptx_path = tempfile.mkstemp(suffix=".ptx", dir=workdir)
    with os.fdopen(fd, "w") as f:
        f.write(ptx)
    cubin = ptx_path[:-4] + ".cubin"
    try:
        stats = ptxas_stats(ptx_path, arch, cubin)
        sass = sass_counts(cubin)
    except RuntimeError:
        if ptxas_report is None:
            raise
        stats, sass = {}, None
    if ptxas_report is not None:
        stats = {**stats, **parse_ptxas(ptxas_report)}
    if threads is None:
        m = _MAXNTID.search(ptx)
        threads = math.prod(int(g) for g in m.groups() if g) if m else None
    out = {}
    for name in names:
        launch = (launches or {}).get(name)
        out[name] = _kernel_record(
            name,
            stats.get(name, {}),
            launch,
            None if sass is None else sass.get(name),
            ptx,
            smem_dynamic=smem_dynamic,
            threads=threads if launch is None else None,
        )
    return out


class NoPtxDump(RuntimeError):
    """An XLA dump with compiled modules but no ``*.ptx`` file: jaxlib >= 0.11's GPU compiler writes the thunk list
    (kernel names, grid, threads, shared memory) under ``xla_dump_to`` but the kernels' PTX only with
    ``xla_dump_emitter_re`` matching ``"ptx"`` (which :func:`jaxattn.gpu_target.compile` sets), so registers, spills
    and SASS counts of XLA-compiled kernels (our Triton ones) cannot be read from a dump made without it."""


def from_xla_dump(dump_dir: str, names: Iterable[str] | None = None, arch: str = "sm_90a") -> dict[str, dict]:
    """Records for the kernels XLA compiled into ``dump_dir`` (all PTX entries, or only ``names``): registers
    and spills from ``ptxas -v``, threads and dynamic shared memory from the launch list, occupancy, SASS
    counts.  Fusions XLA generated itself are included when ``names`` is None.  Raises :class:`NoPtxDump` when
    the dump holds compiled modules but no PTX (an empty answer would read as "no kernels, nothing spills")."""
    if not glob.glob(os.path.join(dump_dir, "*.ptx")) and glob.glob(os.path.join(dump_dir, "*after_optimizations.txt")):
        import jaxlib

        raise NoPtxDump(
            f"no PTX in the XLA dump {dump_dir}: jaxlib {jaxlib.__version__}'s GPU compiler writes it only with "
            "xla_dump_emitter_re='ptx' (gpu_target.compile sets it with xla_dump_to)"
        )
    launches = {}
    for launch in xla_launches(dump_dir):
        launches.setdefault(launch["name"], launch)
    wanted = None if names is None else set(names)
    out: dict[str, dict] = {}
    for path in sorted(glob.glob(os.path.join(dump_dir, "*.ptx"))):
        with open(path) as f:
            ptx = f.read()
        entries = _ENTRY.findall(ptx)
        if not entries or (wanted is not None and not wanted.intersection(entries)):
            continue
        for name, rec in from_ptx(ptx, dump_dir, launches=launches, arch=arch).items():
            if wanted is None or name in wanted:
                out[name] = rec
    order = list(names) if names is not None else sorted(out)
    return {n: out[n] for n in order if n in out}


def split_ptx_modules(text: str) -> list:
    """PTX modules printed one after another (Mosaic GPU's ``MOSAIC_GPU_DUMP_PTX=1``), each starting at
    ``// Generated by LLVM NVPTX Back-End``; text after a module's last closing brace (a function's, or a debug
    section's: a kernel with inlined calls names them in ``.debug_str``, which its ``.loc`` lines cite) is
    dropped."""
    parts = re.split(r"(?m)^//\n// Generated by LLVM NVPTX Back-End\n", text)
    mods = []
    for part in parts[1:]:
        ends = [m.end() for m in _PTX_BLOCK_END.finditer(part)]
        mods.append("//\n// Generated by LLVM NVPTX Back-End\n" + (part[: ends[-1]] if ends else part) + "\n")
    return mods


# a line that closes a PTX block: "}" alone, or a one-line section such as ".section .debug_macinfo { }"
_PTX_BLOCK_END = re.compile(r"(?m)^[ \t]*(?:\.section[^\n{]*\{[ \t]*)?\}[ \t]*$")


@contextlib.contextmanager
def capture_fd_output(path: str) -> Iterator[None]:
    """Send this process's file descriptors 1 and 2 (C/C++ writes included, e.g. Mosaic GPU's PTX dumps) to
    ``path`` for the duration of the block."""
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    with open(path, "ab") as f:
        os.dup2(f.fileno(), 1)
        os.dup2(f.fileno(), 2)
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)


@contextlib.contextmanager
def mosaic_smem_sizes():
    """The dynamic shared memory of each Mosaic GPU kernel lowered inside the block, in lowering order: the size
    Mosaic itself computes from the kernel's scratch buffers (the PTX only says "dynamic"). Reads a private seam
    (``mosaic.gpu.core._launch``); where a jax moved it the list stays empty and the caller says so."""
    sizes: list = []
    try:
        from jax.experimental.mosaic.gpu import core

        orig, tree_size = core._launch, core._smem_tree_size
    except (ImportError, AttributeError):
        yield sizes
        return

    def launch(*args, **kwargs):
        bufs = kwargs["smem_buffers"] if "smem_buffers" in kwargs else args[4]
        sizes.append(int(tree_size(bufs)))
        return orig(*args, **kwargs)

    core._launch = launch
    try:
        yield sizes
    finally:
        core._launch = orig


@contextlib.contextmanager
def fresh_mosaic_kernel_ids():
    """Mosaic GPU compiles a kernel once per process: its custom call caches the compiled module under the sha256 of
    the module's bytecode (``kernel_hash``), so a kernel compiled before prints no PTX and no ptxas report, and
    ``jax.clear_caches()`` does not reach that cache. Inside the block the hash is salted, new for each block, so
    every kernel lowered there is compiled again (the module itself is unchanged). Reads a private seam
    (``mosaic.gpu.core.hashlib``); where a jax moved it, nothing is patched."""
    try:
        from jax.experimental.mosaic.gpu import core
    except ImportError:
        yield
        return
    orig = getattr(core, "hashlib", None)
    if orig is None or not hasattr(orig, "sha256"):
        yield
        return
    salt = os.urandom(16)
    core.hashlib = types.SimpleNamespace(sha256=lambda data=b"": hashlib.sha256(salt + bytes(data)))
    try:
        yield
    finally:
        core.hashlib = orig


def mosaic_records(compile_thunk, names, workdir: str | None = None, lowering=None) -> dict:
    """Records of the Mosaic GPU kernels ``compile_thunk()`` compiles, named ``names`` in compile order: PTX from
    Mosaic's own dump (``MOSAIC_GPU_DUMP_PTX=1`` prints each module on stdout while XLA compiles the custom call),
    registers and spills from the ``ptxas -v`` report printed after it, dynamic shared memory from
    :func:`mosaic_smem_sizes`, which comes in lowering order: ``lowering``, the same names in the order the program
    lowers the kernels (default ``names``; XLA compiles a program's independent custom calls in an order of its
    own, e.g. a dkv kernel before the dq kernel the program called first)."""
    lowering = tuple(names if lowering is None else lowering)
    if sorted(lowering) != sorted(names):
        raise ValueError(f"lowering {lowering} must name the kernels of names {tuple(names)}")
    import jax

    jax.clear_caches()  # Mosaic GPU prints a module when it compiles it, not when jax's in-memory cache has it
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        log = os.path.join(tmp, "mosaic.log")
        flags = ("MOSAIC_GPU_DUMP_PTX", "MOSAIC_GPU_DUMP_PTXAS")
        old = {k: os.environ.get(k) for k in flags}
        os.environ.update({k: "1" for k in flags})
        try:
            with capture_fd_output(log), mosaic_smem_sizes() as smem, fresh_mosaic_kernel_ids():
                compile_thunk()
        finally:
            for k, v in old.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        with open(log, errors="replace") as f:
            text = f.read()
        modules = split_ptx_modules(text)
        if not modules:
            raise RuntimeError(
                "Mosaic GPU printed no PTX: MOSAIC_GPU_DUMP_PTX=1 had no effect in this jax, or its kernel cache kept "
                "a module compiled before in this process (fresh_mosaic_kernel_ids found no seam to salt)"
            )
        if len(modules) != len(names):
            raise RuntimeError(f"Mosaic GPU compiled {len(modules)} kernels, expected {len(names)} ({names})")
        # each module's own ptxas report: the "ptxas" lines between it and the next module
        chunks = text.split("// Generated by LLVM NVPTX Back-End")[1:]
        out = {}
        for name, ptx, chunk in zip(names, modules, chunks):
            report = "\n".join(line for line in chunk.splitlines() if line.startswith(("ptxas", "    ")))
            size = smem[lowering.index(name)] if len(smem) == len(modules) else None
            (rec,) = from_ptx(ptx, tmp, smem_dynamic=size, ptxas_report=report or None).values()
            rec["kernel"] = name
            rec["smem_source"] = (
                "Mosaic's scratch allocation (mosaic.gpu.core)" if size is not None else "unknown (Mosaic moved)"
            )
            out[name] = rec
    return out
