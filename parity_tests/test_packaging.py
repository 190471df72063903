"""The packages stand alone: jaxattn imports without torch, torchref without jax and without jaxattn (the core both
share is the top-level ``twincore``, which imports neither framework), importing torchref changes nothing in the
process (no import hook, no environment variable), and no package has an import circle."""

import ast
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
BLOCK = "import sys; sys.modules['{mod}'] = None\n"
# Modules that need an optional extra (the CUDA plugin) or are entry points: imported by their own tests.
OPTIONAL = {"jaxattn.gpu_target"}


def _modules(package: str) -> list[str]:
    """Every module of ``package`` found on disk (``__main__`` and the optional ones left out)."""
    out = []
    for path in sorted((ROOT / package).rglob("*.py")):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        if not name.endswith("__main__") and name not in OPTIONAL:
            out.append(name)
    return out


JAXATTN, TORCHREF, CORE = _modules("jaxattn"), _modules("torchref"), _modules("twincore")


def _run(code: str, timeout: int = 300):
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stderr[-2000:]
    return res.stdout


def test_module_discovery_finds_the_packages():
    assert {"jaxattn.train", "jaxattn.train_step", "jaxattn.attention", "jaxattn.cuda_quiet"} <= set(JAXATTN)
    assert {"torchref.train", "torchref.train_step", "torchref.parallel"} <= set(TORCHREF)
    assert {"twincore", "twincore.cli", "twincore.params"} <= set(CORE)


@pytest.mark.parametrize("blocked, modules", [("torch", JAXATTN), ("jax", TORCHREF)])
def test_import_without_the_other_framework(blocked, modules):
    code = BLOCK.format(mod=blocked) + "".join(f"import {m}\n" for m in modules)
    code += f"assert sys.modules.get('{blocked}') is None\nprint('ok')\n"
    _run(code)


def test_torchref_imports_nothing_of_jaxattn_and_changes_nothing_in_the_process():
    """Every torchref module and public name imported: no jaxattn module, no jax, no new import hook (jaxattn's
    CUDA-quiet hook is installed by ``import jaxattn`` alone) and no environment variable set or changed. Nor
    ``torch.distributed.checkpoint`` / ``.tensor`` (about 1 s of every ``python -m torchref.train`` start): the
    trainer imports them where it saves or resumes, the parallel modes where they shard."""
    code = "import os, sys\nhooks, env = list(sys.meta_path), dict(os.environ)\n"
    code += "".join(f"import {m}\n" for m in TORCHREF)
    code += (
        "import torchref\nfor name in torchref.__all__: getattr(torchref, name)\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] == 'jaxattn')\n"
        "assert not bad, bad\nassert 'jax' not in sys.modules\n"
        "assert 'twincore' in sys.modules\n"
        "slow = [m for m in ('torch.distributed.checkpoint', 'torch.distributed.tensor') if m in sys.modules]\n"
        "assert not slow, slow\n"
        "new = [h for h in sys.meta_path if h not in hooks]\nassert not new, new\n"
        "changed = sorted(k for k in set(env) | set(os.environ) if env.get(k) != os.environ.get(k))\n"
        "assert not changed, changed\nprint('ok')\n"
    )
    _run(code)


def test_jaxattn_import_installs_the_cuda_quiet_hook_once_where_it_applies():
    """``import jaxattn`` puts the hook before jax's import where the CUDA plugin is installed without a GPU (CI's
    extras), and nowhere else; importing it again adds no second one."""
    code = "import sys, importlib\nimport jaxattn\nfrom jaxattn import cuda_quiet\n"
    code += "def n(): return sum(type(h).__module__ == 'jaxattn.cuda_quiet' for h in sys.meta_path)\n"
    code += "want = 1 if cuda_quiet.applies() else 0\nassert n() == want, sys.meta_path\n"
    code += "importlib.reload(jaxattn)\nassert n() == want, sys.meta_path\nprint('ok')\n"
    _run(code)


def test_twincore_imports_without_either_framework():
    code = BLOCK.format(mod="torch") + BLOCK.format(mod="jax").replace("import sys; ", "")
    code += "".join(f"import {m}\n" for m in CORE)
    code += "print(twincore.ModelConfig.preset('tiny').dim, 'ok')\n"
    assert _run(code).split()[0] == "64"


def test_blocking_really_blocks():
    """The checks above can fail: importing a blocked module raises."""
    res = subprocess.run(
        [sys.executable, "-c", BLOCK.format(mod="torch") + "import torch"], capture_output=True, text=True, timeout=60
    )
    assert res.returncode != 0 and "ModuleNotFoundError" in res.stderr


# ------------------------------------------------------------------------------------------------ import circles
def import_graph(root=ROOT, packages=("jaxattn", "torchref", "benchmarks")) -> dict[str, set[str]]:
    """``{module: {project modules it imports}}`` from the source of every ``package/**/*.py`` under ``root``: every
    ``import`` / ``from ... import`` anywhere in a module (top level AND inside functions: a lazy import closes a
    circle as surely as a top-level one), absolute or relative; ``from pkg import name`` counts as importing the
    module ``pkg.name`` when that is a module. Read with ``ast``: nothing is run."""
    root = pathlib.Path(root)
    mods = {}
    for pkg in packages:
        for path in (root / pkg).rglob("*.py"):
            parts = path.relative_to(root).with_suffix("").parts
            mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {}
    for name, path in mods.items():
        here = name if path.name == "__init__.py" else name.rpartition(".")[0]  # the package it lives in
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                src = node.module or ""
                if node.level:
                    base = ".".join(here.split(".")[: len(here.split(".")) - node.level + 1])
                    src = base + ("." + src if src else "")
                targets = [f"{src}.{a.name}" if f"{src}.{a.name}" in mods else src for a in node.names]
            else:
                continue
            for t in targets:
                while t not in mods and "." in t:  # `import pkg.x.y` imports the module pkg.x.y
                    t = t.rpartition(".")[0]
                if t in mods and t != name:
                    deps.add(t)
        graph[name] = deps
    return graph


def find_cycle(graph: dict) -> list | None:
    """One import circle ``[a, b, ..., a]`` of ``graph``, or None. A module's import of its own parent package
    is not an edge: Python runs the package's ``__init__`` before the module anyway."""
    state, stack = {}, []

    def visit(n):
        state[n] = "open"
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if n.startswith(m + "."):
                continue
            if state.get(m) == "open":
                return stack[stack.index(m) :] + [m]
            if m not in state:
                found = visit(m)
                if found:
                    return found
        state[n] = "done"
        stack.pop()
        return None

    for n in sorted(graph):
        if n not in state:
            found = visit(n)
            if found:
                return found
    return None


def test_no_import_circles():
    """No module of jaxattn, torchref or benchmarks imports itself back through others; the rooms of benchmarks
    depend one way (``__main__`` -> suites / tools -> report: the report room imports no other room)."""
    graph = import_graph()
    assert graph["jaxattn.train"] >= {"jaxattn.train_step", "jaxattn.sharding"}  # the reader sees the imports
    assert {"benchmarks.__main__", "benchmarks.report.tables", "jaxattn.attention.flash"} <= set(graph)
    cycle = find_cycle(graph)
    assert cycle is None, " -> ".join(cycle)
    outside = {
        (m, d)
        for m, deps in graph.items()
        if m.startswith("benchmarks.report")
        for d in deps
        if d.startswith("benchmarks.") and not d.startswith("benchmarks.report")
    }
    assert not outside, f"the report room imports other rooms: {sorted(outside)}"


def test_the_circle_finder_finds_circles(tmp_path):
    """The check above sees circles through relative imports inside functions and through ``from pkg import mod``."""
    pkg = tmp_path / "benchmarks"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .sub import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from ..c import g\n")
    (pkg / "c.py").write_text("import benchmarks.a\ndef g():\n    pass\n")
    (pkg / "d.py").write_text("from . import c\n")
    graph = import_graph(tmp_path, ("benchmarks",))
    assert graph["benchmarks.sub.b"] == {"benchmarks.c"} and graph["benchmarks.d"] == {"benchmarks.c"}
    assert find_cycle(graph) == ["benchmarks.a", "benchmarks.sub.b", "benchmarks.c", "benchmarks.a"]
    (pkg / "c.py").write_text("def g():\n    pass\n")
    assert find_cycle(import_graph(tmp_path, ("benchmarks",))) is None


# --- a CPU machine with the gpu-compile extra starts jax quietly through jaxattn (jaxattn/cuda_quiet.py) ---
_NOISE_LINES = [
    "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR",
    "I0000 00:00:1795488504.688880    6425 cudart_stub.cc:31] Could not find cuda drivers on your machine, GPU will "
    "not be used.",
]


def test_quiet_filter_drops_only_the_plugin_lines():
    from jaxattn import cuda_quiet

    text = "\n".join([_NOISE_LINES[0], "a real warning", _NOISE_LINES[1], "cudart_stub.cc:31] other", ""])
    assert cuda_quiet.filter_lines(text) == "a real warning\ncudart_stub.cc:31] other\n"


def test_quiet_loader_keeps_what_else_the_import_writes_to_fd_2(capfd):
    import os

    from jaxattn import cuda_quiet

    class Noisy:
        def create_module(self, spec):
            return None

        def exec_module(self, module):
            for line in [_NOISE_LINES[0], "kept 1", _NOISE_LINES[1], "kept 2"]:
                os.write(2, (line + "\n").encode())
            module.done = True

    module = type(sys)("noisy")
    cuda_quiet._QuietLoader(Noisy()).exec_module(module)
    assert module.done and capfd.readouterr().err == "kept 1\nkept 2\n"


def _start_jax(code: str, **env) -> str:
    import os

    full = {k: v for k, v in os.environ.items() if k not in ("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "JAXATTN_CUDA_QUIET")}
    proc = subprocess.run(
        [sys.executable, "-c", code + "; print(jax.devices())"],
        env={**full, **env, "PYTHONPATH": str(ROOT)},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0 and "CpuDevice" in proc.stdout, proc.stderr[-2000:]
    return proc.stderr


def test_jax_starts_quietly_through_jaxattn_where_the_cuda_plugin_has_no_driver():
    import importlib.util
    import os

    if importlib.util.find_spec("jax_cuda12_plugin") is None:
        pytest.skip("the CUDA plugin (gpu-compile extra) is not installed: jax starts quietly by itself")
    if os.path.exists("/proc/driver/nvidia"):
        pytest.skip("an NVIDIA driver is present: the plugin starts for real and nothing is filtered")
    # What a plain `import jax` prints here: the test sees the noise it removes. jaxlib 0.10 also logs "Could not find
    # cuda drivers" lines while the plugin loads; 0.11+ logs only the plugin's failed version check (a traceback).
    loud = _start_jax("import jax")
    assert "Jax plugin configuration error" in loud
    assert _start_jax("import jaxattn.model, jax").strip() == ""  # a CLI's start: jaxattn first
    assert "Jax plugin configuration error" in _start_jax("import jaxattn, jax", JAXATTN_CUDA_QUIET="0")


def test_no_tpu_client_starts_where_libtpu_has_no_chip():
    """With the tpu-compile extra (libtpu) on a machine without a TPU chip, jax started through jaxattn prints
    nothing from libtpu (its host search would, whenever no other process holds libtpu's lock) and says why no TPU
    backend is there; the deviceless TPU compile's topologies still load (test_tpu_compile.py compiles with them)."""
    import importlib.util
    import os

    if importlib.util.find_spec("libtpu") is None:
        pytest.skip("libtpu (the tpu-compile extra) is not installed: no TPU client is tried")
    if os.path.exists("/dev/accel0") or os.path.exists("/dev/vfio/0"):
        pytest.skip("a TPU chip is visible: its client starts for real")
    err = _start_jax("import jaxattn, jax")
    assert "host bounds" not in err and "TPU" not in err, err
    probe = "import jaxattn, jax\ntry:\n    jax.devices('tpu')\nexcept RuntimeError as e:\n    print('refused:', e)\n"
    out = subprocess.run(
        [sys.executable, "-c", probe + "print(jax.devices())"],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "refused:" in out.stdout and "no TPU chip on this machine" in out.stdout, out.stdout + out.stderr
