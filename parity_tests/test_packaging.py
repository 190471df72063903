"""The two packages stand alone: jaxattn imports without torch, torchref without jax (CONVENTIONS §2)."""
import subprocess
import sys

import pytest

BLOCK = "import sys; sys.modules['{mod}'] = None\n"


@pytest.mark.parametrize("blocked, modules", [
    ("torch", ["jaxattn", "jaxattn.config", "jaxattn.model", "jaxattn.hf", "jaxattn.attention"]),
    ("jax", ["torchref", "torchref.config", "torchref.model", "torchref.hf", "torchref.attention"]),
])
def test_import_without_the_other_framework(blocked, modules):
    code = BLOCK.format(mod=blocked) + "".join(f"import {m}\n" for m in modules)
    code += f"assert sys.modules.get('{blocked}') is None\nprint('ok')\n"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr[-2000:]


def test_blocking_really_blocks():
    """The check above can fail: importing a blocked module raises."""
    res = subprocess.run([sys.executable, "-c", BLOCK.format(mod="torch") + "import torch"], capture_output=True,
                         text=True, timeout=60)
    assert res.returncode != 0 and "ModuleNotFoundError" in res.stderr
