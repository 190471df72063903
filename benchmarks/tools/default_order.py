"""What the GPU default attention order should be, by evidence: reads the ``gpu`` test log and the attention
suite's JSON from one GPU session and prints the order the measurements support beside the current one.

    python -m benchmarks.tools.default_order --tests out/gpu_tests.log --attention out/results/<device>/attention.json

A backend may enter the default list only if its compiled ``gpu`` tests passed in that log (design §4);
among those, the order is by median time relative to the fastest over the shapes and passes every candidate ran.
Two backends within ``TIE`` of each other keep the current order (a 2% lead in one session is not evidence).
Prints advice only: changing the GPU ranks in ``twincore.attention.BACKENDS`` stays a reviewed commit.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys

from twincore.attention import backend_names, default_order

_GPU_DEFAULT = default_order("gpu")  # the backend table's GPU ranks
JAX_BACKENDS = backend_names(forward_only=False)  # the trainable ones (flash_decode is forward-only, opt-in)
TIE = 1.05  # medians of relative time closer than this are a tie: the incumbent keeps its place


# The backend a `gpu` test checks, by file (test_attention's tests name theirs in their ids); parity_tests/conftest.py
# prints its per-backend summary with the same mapping.
TEST_FILES = {
    "test_flash.py": "flash",
    "test_mosaic.py": "mosaic",
    "test_flash_decode.py": "decode",
    "test_grouped_matmul.py": "grouped matmul",
    "test_precision.py": "precision",
}


def backend_of_test(nodeid: str) -> str:
    """The backend a ``gpu`` test checks, from its node id: test_attention's parametrized JAX backend
    (``test_gpu_backends_bf16[<case>-<backend>]``), ``torch sdpa`` for its torch test, else by file."""
    path, _, name = nodeid.partition("::")
    if name.startswith("test_gpu_backends_bf16["):
        return name[:-1].rsplit("-", 1)[-1]
    if name.startswith("test_gpu_torch_sdpa_bf16["):
        return "torch sdpa"
    base = path.rsplit("/", 1)[-1]
    return TEST_FILES.get(base, base)


def tests_passed(log_text: str) -> dict:
    """``{backend: True/False/None}`` over the JAX backends: whether every ``gpu`` test of the backend in a
    ``pytest -rA`` log passed (None: none ran). torch's own SDPA tests count for no JAX backend."""
    seen: dict[str, list[bool]] = {}
    for m in re.finditer(r"^(PASSED|FAILED|ERROR) (\S+)", log_text, re.M):
        seen.setdefault(backend_of_test(m.group(2)), []).append(m.group(1) == "PASSED")
    return {name: (all(seen[name]) if name in seen else None) for name in JAX_BACKENDS}


def relative_times(records: list) -> dict:
    """``{backend: median of (its time / the fastest time)}`` over the rows (shape and pass) it ran."""
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
    return {impl: statistics.median(v) for impl, v in rel.items()}


def ranking(records: list, current: tuple = _GPU_DEFAULT) -> list:
    """Backends ordered by :func:`relative_times`; where the next one is within ``TIE`` of the one before it,
    the one earlier in ``current`` (the present default order; a backend not in it counts as last) goes first."""
    med = relative_times(records)
    order = sorted(med, key=lambda impl: (med[impl], impl))
    place = {b: i for i, b in enumerate(current)}
    for i in range(len(order) - 1):
        a, b = order[i], order[i + 1]
        if med[b] <= med[a] * TIE and place.get(b, len(current)) < place.get(a, len(current)):
            order[i], order[i + 1] = b, a
    return order


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.tools.default_order",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--tests", required=True, action="append", help="log of `pytest -m gpu -rA` from the GPU session (repeatable)"
    )
    p.add_argument("--attention", required=True, help="attention.json written by the attention suite")
    args = p.parse_args(argv)
    text = ""
    for path in args.tests:
        with open(path, errors="replace") as f:
            text += f.read() + "\n"
    passed = tests_passed(text)
    with open(args.attention) as f:
        records = json.load(f)["records"]
    ranked = [b for b in ranking(records) if passed.get(b)]
    proposal = tuple(ranked + [b for b in ("chunked", "xla") if b not in ranked and passed.get(b) is not False])
    print(f"gpu tests passed: {passed}")
    print(f"current GPU default: {_GPU_DEFAULT}")
    med = relative_times(records)
    print("median time / fastest: " + ", ".join(f"{b} {med[b]:.3f}" for b in ranked))
    print(
        f"by these measurements: {proposal} (backends whose gpu tests did not all pass are left out; within "
        f"{TIE:.2f}x the current order stands)"
    )
    if proposal and proposal != _GPU_DEFAULT:
        print("-> change the GPU ranks in twincore.attention.BACKENDS if the committed records agree")
    else:
        print("-> no change")
    return 0


if __name__ == "__main__":
    sys.exit(main())
