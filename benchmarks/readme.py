"""``python -m benchmarks.readme`` — regenerate README.md's results section from the committed JSON.

Everything between ``<!-- results:begin -->`` and ``<!-- results:end -->`` is written here from
``benchmarks/results/*/*.json``, never by hand; ``parity_tests/test_readme.py`` fails when the README and the JSON
disagree. ``--check`` exits 1 instead of writing when the section is stale.

    python -m benchmarks.readme            # rewrite the section
    python -m benchmarks.readme --check    # CI: is it up to date?
"""
from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
README = os.path.join(ROOT, "README.md")
BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"
COMPILED = "compiled for H100, not run"


def _load(*parts):
    path = os.path.join(RESULTS, *parts)
    if not os.path.isfile(path):
        return None, os.path.relpath(path, ROOT)
    with open(path) as f:
        return json.load(f), os.path.relpath(path, ROOT)


def _gib(b) -> str:
    return f"{b / 2**30:.2f}"


def _env_line(env: dict) -> str:
    keys = ("jax", "jaxlib", "flax", "torch", "plugin", "ptxas", "target_device", "time_utc")
    return ", ".join(f"{k} {env[k]}" for k in keys if env.get(k))


def kernels_section() -> list[str]:
    d, path = _load("h100-compiled", "kernels.json")
    if d is None:
        return [f"_No `{path}` yet: run `python -m benchmarks compile`._"]
    out = [f"### Kernels ({COMPILED})", "",
           f"From `{path}` ({_env_line(d['env'])}). B=1, S=4096, 16 heads, causal. HGMMA = wgmma (Hopper tensor "
           "cores), HMMA = mma.sync; occupancy on the H100 limits.", "",
           "| impl | kernel | D | dtype | threads | regs | spill st/ld B | smem B | occupancy | HGMMA | HMMA |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in d["records"]:
        if r.get("status") != "ok":
            continue
        sass = r.get("sass") or {}
        out.append(f"| {r['impl']} | `{r['kernel']}` | {r['head_dim']} | {r['dtype']} | {r['threads']} | "
                   f"{r['registers']} | {r['spill_stores']}/{r['spill_loads']} | {r['smem_bytes']:,} | "
                   f"{r['occupancy']:.3f} | {sass.get('HGMMA', '—')} | {sass.get('HMMA', '—')} |")
    png = os.path.join(RESULTS, "h100-compiled", "kernels.png")  # drawn from the same JSON by `benchmarks report`
    if os.path.isfile(png):
        out += ["", f"![registers, spills and shared memory per kernel, {COMPILED}]({os.path.relpath(png, ROOT)})"]
    return out


def programs_section() -> list[str]:
    d, path = _load("h100-compiled", "programs.json")
    if d is None:
        return []
    out = [f"### Whole programs ({COMPILED})", "", f"From `{path}`: bf16, flash attention, AdamW for train steps. "
           "FLOPs ratio = XLA's count of the compiled module / the analytic count (the scanned layer counted once).",
           "", "| preset | program | batch × seq | temp GiB | peak GiB | launches | FLOPs ratio |", "|---|---|---|---|---|---|---|"]
    for r in d["records"]:
        if r.get("status") != "ok":
            continue
        out.append(f"| {r['preset']} | {r['kind']} | {r['batch']}×{r['seq']} | {_gib(r['temp'])} | {_gib(r['peak'])} | "
                   f"{r['launches']} | {r['flops_ratio']:.3f} |")
    return out


def plan_section() -> list[str]:
    d, path = _load("h100-compiled", "plan.json")
    if d is None:
        return []
    out = [f"### Scaling plans on 8 H100s ({COMPILED})", "",
           f"From `{path}` (`python -m benchmarks run --suite plan`): per-device memory and the collectives of the "
           "compiled sharded train step (full-buffer bytes per step, a layer-loop op counted once per layer).", "",
           "| mesh | preset | batch × seq | remat | peak GiB / device | all-gather / all-reduce / reduce-scatter GiB "
           "per step | fits 80 GB |", "|---|---|---|---|---|---|---|"]
    for r in d["records"]:
        if r.get("status") != "ok":
            continue
        m, c = r["measured"], r["measured"]["collectives"]
        peak = m["per_device_memory"]["peak"]
        traffic = " / ".join(_gib(c[k].get("bytes_per_step", c[k]["bytes"]))
                             for k in ("all-gather", "all-reduce", "reduce-scatter"))
        out.append(f"| `{r['mesh']}` | {r['preset']} | {r['batch']}×{r['seq']} | {r['remat']} | {_gib(peak)} | "
                   f"{traffic} | {'yes' if peak < 80e9 else 'no'} |")
    return out


def train_example_section() -> list[str]:
    d, path = _load("train-example", "summary.json")
    if d is None:
        return []
    return ["### Train example (CPU)", "",
            f"From `{path}`: {d['preset']} preset on `{d['data']}`, same `--init` and seed, fp32 AdamW. Largest "
            f"per-step loss gap torch vs JAX {d['max_per_step_loss_gap']:.2g}; final loss JAX "
            f"{d['final_loss']['jax']:.4f}, torch {d['final_loss']['torch']:.4f}; median tokens/s JAX "
            f"{d['median_tokens_per_s']['jax']:,.0f}, torch {d['median_tokens_per_s']['torch']:,.0f} "
            f"(JAX speed-up {d['median_tokens_per_s']['jax'] / d['median_tokens_per_s']['torch']:.2f}×, on a "
            "shared 2-core CPU)."]


def render() -> str:
    parts = ["## Results (generated by `python -m benchmarks.readme` from committed JSON)", "",
             "No GPU has run this code yet: every GPU figure below is from a deviceless compile on a CPU host.", ""]
    for section in (train_example_section(), kernels_section(), programs_section(), plan_section()):
        if section:
            parts += section + [""]
    return "\n".join(parts).rstrip() + "\n"


def splice(readme: str, body: str) -> str:
    if BEGIN not in readme or END not in readme:
        raise ValueError(f"README.md has no {BEGIN} ... {END} markers")
    head, rest = readme.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{body}{END}{tail}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.readme", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="exit 1 if README.md's section is stale")
    args = parser.parse_args(argv)
    with open(README) as f:
        old = f.read()
    new = splice(old, render())
    if args.check:
        if new != old:
            print("README.md results section is stale: run `python -m benchmarks.readme`", file=sys.stderr)
            return 1
        return 0
    if new != old:
        tmp = README + ".tmp"
        with open(tmp, "w") as f:
            f.write(new)
        os.replace(tmp, README)
    print("README.md results section up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
