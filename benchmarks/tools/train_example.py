"""The README's training example: both CLIs train the tiny Llama on a small text file, loss curves side by side.

    python -m benchmarks train-example                 # or python -m benchmarks.train_example; 300 steps
    python -m benchmarks train-example --steps 50 --out /tmp/ex

The data is ``benchmarks/data/train-example.txt``, a frozen copy of an early README.md (never edited: the committed
``summary.json`` pins its sha256, ``parity_tests/test_examples.py``), so a user's run reproduces the README's losses.
Both runs start from one ``--init`` written by :data:`INIT_RECIPE` (the README's one-liner) with identical flags; writes
``jax.jsonl``, ``torch.jsonl``, ``summary.json`` and ``loss.png`` into ``--out`` (default
``benchmarks/results/local/train-example/``, untracked; the README's figures come from the committed
``benchmarks/results/train-example/``), each file moved into place when complete (details: benchmarks/NOTES.md).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from ..report.records import RESULTS_DIR, default_out

DEFAULT_OUT = default_out("train-example")  # untracked; the committed record: --out benchmarks/results/train-example
ROOT = os.path.dirname(os.path.dirname(str(RESULTS_DIR)))  # the repository
DATA = os.path.join(ROOT, "benchmarks", "data", "train-example.txt")
# The README's recipe for the shared --init: the tiny preset's torch initialisation under seed 0, saved as a Hugging
# Face directory that both trainers load.
INIT_DIR = "runs/tiny-init"
INIT_RECIPE = (
    "import torch, torchref; torch.manual_seed(0); torchref.save_pretrained("
    f"torchref.LlamaForCausalLM(torchref.ModelConfig.preset('tiny')), '{INIT_DIR}')"
)


def _replace(path: str, write) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    write(tmp)
    os.replace(tmp, path)


def _read(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _plot(jax_log: list[dict], torch_log: list[dict], png: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    runs = (
        ("JAX (python -m jaxattn.train)", jax_log, "tab:blue"),
        ("PyTorch (python -m torchref.train)", torch_log, "tab:red"),
    )
    for ax, (name, log, color), (_, other, other_color) in zip(axes, runs, runs[::-1]):
        ax.plot([r["step"] for r in other], [r["loss"] for r in other], "--", color=other_color, lw=1, alpha=0.6)
        ax.plot([r["step"] for r in log], [r["loss"] for r in log], color=color, lw=1.5)
        tps = statistics.median(r["tokens_per_s"] for r in log[5:] or log if r["tokens_per_s"])
        ax.set_title(f"{name}\nfinal loss {log[-1]['loss']:.3f}, median {tps:,.0f} tokens/s", fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("train loss (nats / byte)")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    _replace(png, lambda tmp: fig.savefig(tmp, dpi=120, format="png"))
    plt.close(fig)


def main(argv=None, prog: str = "python -m benchmarks.train_example") -> int:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    p.add_argument("--data", default=DATA, help="the text file to train on (default benchmarks/data/train-example.txt)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument(
        "--out", default=DEFAULT_OUT, help="output directory (default benchmarks/results/local/train-example)"
    )
    a = p.parse_args(argv)
    if not os.path.isfile(a.data):
        p.error(f"--data {a.data!r}: no such file")
    os.makedirs(a.out, exist_ok=True)

    env = {**os.environ, "JAX_SKIP_CUDA_CONSTRAINTS_CHECK": "1"}
    init_tmp = tempfile.TemporaryDirectory(prefix="train-example-init-")
    init = os.path.join(init_tmp.name, "tiny-init")
    recipe = INIT_RECIPE.replace(repr(INIT_DIR), repr(init))
    subprocess.run([sys.executable, "-c", recipe], cwd=ROOT, env=env, check=True)
    flags = [
        "--init",
        init,
        "--data",
        a.data,
        "--steps",
        str(a.steps),
        "--seq-len",
        str(a.seq_len),
        "--batch-size",
        str(a.batch_size),
        "--lr",
        str(a.lr),
        "--warmup",
        str(max(1, a.steps // 20)),
        "--schedule",
        "cosine",
        "--optimizer",
        "adamw",
        "--precision",
        "fp32",
        "--seed",
        "0",
        "--no-progress",
    ]
    summary = {
        "data": os.path.relpath(a.data, ROOT),
        "commands": {},
        "wall_s": {},
        "init": f'python -c "{INIT_RECIPE}"',
    }
    with open(a.data, "rb") as f:
        summary["data_sha256"] = hashlib.sha256(f.read()).hexdigest()
    logs = {}
    for fw, module in (("jax", "jaxattn.train"), ("torch", "torchref.train")):
        tmp_log = os.path.join(a.out, f".{fw}.jsonl.tmp-{os.getpid()}")
        cmd = [sys.executable, "-m", module, *flags, "--log-json", tmp_log]
        t0 = time.perf_counter()
        subprocess.run(cmd, cwd=ROOT, env=env, check=True)
        summary["wall_s"][fw] = round(time.perf_counter() - t0, 1)
        shown = [(INIT_DIR if x == init else os.path.relpath(x, ROOT) if x == a.data else x) for x in flags]
        summary["commands"][fw] = " ".join(["python", "-m", module, *shown, "--log-json", f"{fw}.jsonl"])
        logs[fw] = _read(tmp_log)
        if len(logs[fw]) != a.steps:
            raise SystemExit(f"{fw} run logged {len(logs[fw])} steps, expected {a.steps}; nothing replaced")
        os.replace(tmp_log, os.path.join(a.out, f"{fw}.jsonl"))
    gap = max(abs(j["loss"] - t["loss"]) for j, t in zip(logs["jax"], logs["torch"]))
    summary.update(
        {
            "final_loss": {fw: logs[fw][-1]["loss"] for fw in logs},
            "max_per_step_loss_gap": gap,
            # the first steps compile and warm up; a run too short to leave them out uses every step
            "median_tokens_per_s": {
                fw: statistics.median(r["tokens_per_s"] for r in logs[fw][5:] or logs[fw]) for fw in logs
            },
            "device": "cpu",
            "preset": "tiny",
        }
    )
    _replace(
        os.path.join(a.out, "summary.json"), lambda tmp: open(tmp, "w").write(json.dumps(summary, indent=2) + "\n")
    )
    _plot(
        logs["jax"],
        logs["torch"],
        os.path.join(a.out, "loss.png"),
        f"tiny Llama, byte-level {summary['data']}, same --init and seed, fp32 AdamW; "
        f"largest per-step loss gap {gap:.1e}",
    )
    init_tmp.cleanup()
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
