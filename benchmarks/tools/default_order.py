"""What the GPU default attention order should be, by evidence: reads the ``gpu`` test log and the attention
suite's JSON from one GPU session and prints the order the measurements support beside the current one.

    python -m benchmarks.tools.default_order --tests out/gpu_tests.log --attention out/results/<device>/attention.json

A backend may enter the default list only if its compiled ``gpu`` tests passed in that log (design §4);
among those, the order is by median time over the shapes every candidate ran (fwd+bwd first, then fwd).
Prints advice only: changing the GPU ranks in ``jaxattn.spec.attention.BACKENDS`` stays a reviewed commit.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys

from jaxattn.spec.attention import backend_names, default_order

_GPU_DEFAULT = default_order("gpu")  # the backend table's GPU ranks
JAX_BACKENDS = backend_names(forward_only=False)  # the trainable ones (flash_decode is forward-only, opt-in)


def tests_passed(log_text: str) -> dict:
    """``{backend: True/False/None}``: whether every ``gpu`` test naming the backend passed (None: none ran)."""
    out = {}
    for name in JAX_BACKENDS:
        lines = [
            ln
            for ln in log_text.splitlines()
            if re.search(rf"\b{name}\b", ln, re.I) and re.search(r"\b(PASSED|FAILED|ERROR)\b", ln)
        ]
        out[name] = None if not lines else not any(re.search(r"\b(FAILED|ERROR)\b", ln) for ln in lines)
    return out


def ranking(records: list) -> list:
    """Backends ordered by their median time relative to the fastest, over the shapes all of them ran."""
    ok = [
        r
        for r in records
        if r.get("framework") == "jax"
        and r.get("status") == "ok"
        and r.get("median_ms")
        and r.get("impl") in JAX_BACKENDS
    ]
    by_key = {}
    for r in ok:
        key = (r["pass"], r["dtype"], r["B"], r["Hq"], r["Hkv"], r["Sk"], r["D"], r["causal"])
        by_key.setdefault(key, {})[r["impl"]] = r["median_ms"]
    rel = {}
    for times in by_key.values():
        best = min(times.values())
        for impl, t in times.items():
            rel.setdefault(impl, []).append(t / best)
    return sorted(rel, key=lambda impl: (statistics.median(rel[impl]), impl))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.tools.default_order",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--tests", required=True, help="log of `pytest -m gpu -rA` from the GPU session")
    p.add_argument("--attention", required=True, help="attention.json written by the attention suite")
    args = p.parse_args(argv)
    with open(args.tests, errors="replace") as f:
        passed = tests_passed(f.read())
    with open(args.attention) as f:
        records = json.load(f)["records"]
    ranked = [b for b in ranking(records) if passed.get(b)]
    proposal = tuple(ranked + [b for b in ("chunked", "xla") if b not in ranked and passed.get(b) is not False])
    print(f"gpu tests passed: {passed}")
    print(f"current GPU default: {_GPU_DEFAULT}")
    print(f"by these measurements: {proposal} (backends whose gpu tests did not all pass are left out)")
    if proposal and proposal != _GPU_DEFAULT:
        print(
            "-> change the GPU ranks in jaxattn.spec.attention.BACKENDS if the committed records agree (mosaic "
            "stays opt-in "
            "until its backward is a kernel)"
        )
    else:
        print("-> no change")
    return 0


if __name__ == "__main__":
    sys.exit(main())
