"""The packages stand alone (CONVENTIONS §2): jaxattn imports without torch, torchref without jax, and
torchref imports nothing of jaxattn but the framework-neutral ``jaxattn.spec`` subpackage."""
import subprocess
import sys

import pytest

BLOCK = "import sys; sys.modules['{mod}'] = None\n"
TORCHREF = ["torchref", "torchref.config", "torchref.model", "torchref.hf", "torchref.attention",
            "torchref.precision", "torchref.train", "torchref.remat", "torchref.optim", "torchref.gguf",
            "torchref.data", "torchref.checkpoint", "torchref.seed", "torchref.trainer", "torchref.kv_cache",
            "torchref.generate", "torchref.quant", "torchref.parallel"]


def _run(code: str, timeout: int = 300):
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stderr[-2000:]
    return res.stdout


@pytest.mark.parametrize("blocked, modules", [
    ("torch", ["jaxattn", "jaxattn.config", "jaxattn.model", "jaxattn.hf", "jaxattn.attention",
               "jaxattn.precision", "jaxattn.loss_scale", "jaxattn.train", "jaxattn.remat", "jaxattn.optim",
               "jaxattn.gguf", "jaxattn.data", "jaxattn.checkpoint", "jaxattn.seed", "jaxattn.trainer",
               "jaxattn.kv_cache", "jaxattn.generate", "jaxattn.quant", "jaxattn.sharding"]),
    ("jax", TORCHREF),
])
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
    code += ("import jaxattn.spec, jaxattn.spec.config, jaxattn.spec.hf_format, jaxattn.spec.batch, "
             "jaxattn.spec.dtypes, jaxattn.spec.remat, jaxattn.spec.optim, jaxattn.spec.gguf, jaxattn.spec.data, "
             "jaxattn.spec.cli, jaxattn.spec.runlog, jaxattn.spec.seed, jaxattn.spec.grad_accum, "
             "jaxattn.spec.generate, jaxattn.spec.attention\nprint(jaxattn.spec.ModelConfig.preset('tiny').dim, 'ok')\n")
    assert _run(code).split()[0] == "64"


def test_blocking_really_blocks():
    """The checks above can fail: importing a blocked module raises."""
    res = subprocess.run([sys.executable, "-c", BLOCK.format(mod="torch") + "import torch"], capture_output=True,
                         text=True, timeout=60)
    assert res.returncode != 0 and "ModuleNotFoundError" in res.stderr
