"""The packages stand alone: jaxattn imports without torch, torchref without jax, torchref imports nothing of jaxattn
but the framework-neutral ``jaxattn.spec`` subpackage, and no package has an import circle."""
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


JAXATTN, TORCHREF, SPEC = _modules("jaxattn"), _modules("torchref"), _modules("jaxattn/spec")


def _run(code: str, timeout: int = 300):
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stderr[-2000:]
    return res.stdout


def test_module_discovery_finds_the_packages():
    assert {"jaxattn.train", "jaxattn.train_step", "jaxattn.attention", "jaxattn.spec.params"} <= set(JAXATTN)
    assert {"torchref.train", "torchref.train_step", "torchref.parallel"} <= set(TORCHREF)
    assert set(SPEC) < set(JAXATTN) and "jaxattn.spec.cli" in SPEC


@pytest.mark.parametrize("blocked, modules", [("torch", JAXATTN), ("jax", TORCHREF)])
def test_import_without_the_other_framework(blocked, modules):
    code = BLOCK.format(mod=blocked) + "".join(f"import {m}\n" for m in modules)
    code += f"assert sys.modules.get('{blocked}') is None\nprint('ok')\n"
    _run(code)


def test_torchref_imports_only_the_neutral_subpackage_of_jaxattn():
    code = "import sys\n" + "".join(f"import {m}\n" for m in TORCHREF)
    code += ("import torchref\nfor name in torchref.__all__: getattr(torchref, name)\n"
             "bad = sorted(m for m in sys.modules if m.startswith('jaxattn') and m != 'jaxattn'"
             " and not m.startswith('jaxattn.spec'))\n"
             "assert not bad, bad\nassert 'jax' not in sys.modules\nprint('ok')\n")
    _run(code)


def test_spec_imports_without_either_framework():
    code = BLOCK.format(mod="torch") + BLOCK.format(mod="jax").replace("import sys; ", "")
    code += "".join(f"import {m}\n" for m in SPEC)
    code += "print(jaxattn.spec.ModelConfig.preset('tiny').dim, 'ok')\n"
    assert _run(code).split()[0] == "64"


def test_blocking_really_blocks():
    """The checks above can fail: importing a blocked module raises."""
    res = subprocess.run([sys.executable, "-c", BLOCK.format(mod="torch") + "import torch"], capture_output=True,
                         text=True, timeout=60)
    assert res.returncode != 0 and "ModuleNotFoundError" in res.stderr


# ------------------------------------------------------------------------------------------------ import circles
def import_graph(packages=("jaxattn", "torchref", "benchmarks")) -> dict[str, set[str]]:
    """module -> the project modules it imports, at module level AND inside functions (a lazy import closes a
    circle as surely as a top-level one), relative and absolute, read with ``ast`` (nothing is run). An import of
    a package counts as an import of its ``__init__``; ``from pkg import mod`` of the submodule ``pkg.mod``."""
    files = {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p
             for pkg in packages for p in (ROOT / pkg).rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        is_pkg = path.name == "__init__.py"
        base = name.split(".") if is_pkg else name.split(".")[:-1]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                mod = ".".join(base[:len(base) - node.level + 1] + ([node.module] if node.module else [])) \
                    if node.level else node.module
                targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in files else mod for a in node.names]
            else:
                continue
            deps.update(t for t in targets if t in files and t != name)
        graph[name] = deps
    return graph


def find_cycle(graph: dict[str, set[str]]):
    """One import circle as a list of modules, or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n):
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state:
                found = visit(m)
                if found:
                    return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state:
            found = visit(n)
            if found:
                return found
    return None


def test_no_import_circles():
    graph = import_graph()
    assert graph["jaxattn.train"] >= {"jaxattn.train_step", "jaxattn.sharding"}  # the reader sees imports
    # __init__ files import their submodules lazily by name (import_module): not edges, so not circles
    cycle = find_cycle({k: {d for d in v if not k.startswith(d + ".")} for k, v in graph.items()})
    assert cycle is None, " -> ".join(cycle)


def test_the_circle_finder_finds_circles():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
