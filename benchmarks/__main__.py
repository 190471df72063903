"""``python -m benchmarks run [--suite NAME ...] [--quick] [--out DIR] [--repeat N]`` — measure both frameworks on this
machine (``--repeat N``: in N fresh processes, pooled into one record per row, ``benchmarks/tools/repeat.py``);
``python -m benchmarks report DIR`` — rebuild ``DIR/report.md`` and its plots from the JSON already there;
``python -m benchmarks compile ...`` — compile for an H100/H200 without a GPU (its own flags, see ``--help``);
``python -m benchmarks readme [--check]`` — regenerate README.md's results section from the committed JSON;
``python -m benchmarks train-example ...`` — the README's training example (both CLIs, loss curves);
``python -m benchmarks check-stability --suite NAME [--runs 3] [--quick]`` — run suites in fresh processes and
report how much each JAX speed-up moved between runs (``benchmarks/tools/stability.py``).

Suites: ``model``, ``attention``, ``remat``, ``decode``, ``plan``, ``train``, ``compile`` (one module each in
``benchmarks/suites/``); ``all`` runs each and skips with a note a suite this machine cannot serve (``plan`` and
``compile`` without the gpu-compile extra). Results go to ``--out`` (default ``benchmarks/results/local/<device>/``,
or ``<device>-quick/`` with ``--quick``, tiny shapes for a CPU pass of a few minutes; ``local/`` is untracked, and
the committed records change only with an explicit ``--out benchmarks/results/...``): one JSON per suite,
``report.md`` (JAX and torch side by side, "JAX speed-up = torch time / JAX time") and plots. A bad filter or an
unwritable ``--out`` fails before anything is measured; a suite that measures nothing exits non-zero and writes
nothing; every file is replaced atomically, only by a complete result (more in benchmarks/NOTES.md).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time

# jax and torch share the GPU in one process: without this jax grabs 75% of device memory at start-up and torch
# SDPA runs out at long sequences. Must be set before jax is imported.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

from . import measure  # noqa: E402
from .report import readme  # noqa: E402
from .report.build import rebuild_report, write_report  # noqa: E402
from .report.plots import plot_suite  # noqa: E402
from .report.records import LiveRows, check_out_dir, default_out, read_results, write_results  # noqa: E402
from .report.tables import suite_table  # noqa: E402
from .suites import SUITES, attention, decode, model, train  # noqa: E402
from .tools import train_example  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run benchmark suites and write JSON + report.md")
    run.add_argument(
        "--suite", action="append", choices=SUITES + ("all",), help="suite to run (repeatable; default: all)"
    )
    run.add_argument("--quick", action="store_true", help="tiny shapes (CPU smoke run)")
    run.add_argument(
        "--impl",
        action="append",
        default=None,
        help="attention suite: keep only these implementations (repeatable, e.g. flash, sdpa:flash)",
    )
    run.add_argument(
        "--decode-impl",
        action="append",
        default=None,
        help="decode suite: which extras run beside the jaxattn/torchref pair (repeatable: jaxattn+flash_decode, "
        "torchref+compile, torchref+cudagraphs; default all)",
    )
    run.add_argument(
        "--preset",
        action="append",
        default=None,
        help="model suite: only these presets (repeatable, e.g. 350m, moe-350m; default: all of the suite's)",
    )
    run.add_argument(
        "--toggle",
        action="append",
        default=None,
        help="train suite: only these technique toggles (repeatable, e.g. baseline, bf16; default: all)",
    )
    run.add_argument(
        "--max-seq",
        type=int,
        default=None,
        help="attention suite: skip shapes with a longer sequence (to split a long GPU sweep)",
    )
    run.add_argument(
        "--head-dim",
        type=int,
        action="append",
        default=None,
        metavar="D",
        help="attention suite: only shapes with this head dim (repeatable; the suite has 64 and 128)",
    )
    run.add_argument(
        "--out",
        default=None,
        help="output directory (default benchmarks/results/local/<device>[-quick], untracked)",
    )
    run.add_argument(
        "--batch",
        type=int,
        action="append",
        metavar="B",
        help="decode suite: only these batch sizes, in this order (repeatable; default 1 and 64, --quick 1 and 4)",
    )
    run.add_argument(
        "--repeat",
        type=int,
        default=1,
        metavar="N",
        help="measure in N fresh processes and pool them: one record per row, its pair's interval over the "
        "processes, `unstable` where they disagree (default 1: this process)",
    )
    run.add_argument(
        "--budget-s",
        type=float,
        default=None,
        metavar="S",
        help="train / decode suites: rows not started within S seconds are recorded as skipped (train's default: "
        "480 outside --quick; decode's: none)",
    )
    run.add_argument(
        "--no-report",
        action="store_true",
        help="write only the suites' JSON (no report.md, no plots): `python -m benchmarks report DIR` builds them",
    )
    rep = sub.add_parser("report", help="rebuild report.md and plots from the JSON in DIR (runs nothing)")
    rep.add_argument("dir", metavar="DIR", help="a results directory holding <suite>.json files")
    sub.add_parser("compile", help="compile for an H100/H200 without a GPU (python -m benchmarks compile --help)")
    sub.add_parser("readme", help="regenerate README.md's results section (python -m benchmarks readme --help)")
    sub.add_parser("train-example", help="the README's training example (python -m benchmarks train-example --help)")
    sub.add_parser(
        "check-stability",
        help="run suites N times in fresh processes; how much each JAX speed-up moved (check-stability --help)",
    )
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["compile"]:  # its own flags: benchmarks/tools/compile.py, imported here because it imports jax
        from .tools.compile import main as compile_main

        return compile_main(argv[1:])
    if argv[:1] == ["readme"]:
        return readme.main(argv[1:], prog="python -m benchmarks readme")
    if argv[:1] == ["train-example"]:
        return train_example.main(argv[1:], prog="python -m benchmarks train-example")
    if argv[:1] == ["check-stability"]:
        from .tools.stability import main as stability_main

        return stability_main(argv[1:])
    args = parser.parse_args(argv)
    if args.command == "report":
        try:
            written = rebuild_report(args.dir)
        except ValueError as e:
            rep.error(str(e))
        print("\n".join(f"wrote {p}" for p in written))
        return 0

    suites = list(SUITES) if not args.suite or "all" in args.suite else list(dict.fromkeys(args.suite))
    explicit = bool(args.suite) and "all" not in args.suite
    # Everything that can be wrong with the command line fails here, before jax/torch are imported or anything
    # is measured, and writes nothing.
    if (args.impl is not None or args.max_seq is not None or args.head_dim is not None) and "attention" not in suites:
        run.error(f"--impl/--max-seq/--head-dim filter the attention suite, which is not selected (suites: {suites})")
    if args.decode_impl is not None and "decode" not in suites:
        run.error(f"--decode-impl picks decode suite rows; the decode suite is not selected (suites: {suites})")
    if args.batch is not None and "decode" not in suites:
        run.error(f"--batch picks decode suite rows; the decode suite is not selected (suites: {suites})")
    if args.preset is not None and "model" not in suites:
        run.error(f"--preset picks model suite rows; the model suite is not selected (suites: {suites})")
    if args.toggle is not None and "train" not in suites:
        run.error(f"--toggle picks train suite rows; the train suite is not selected (suites: {suites})")
    try:
        attention.check_filters(args.quick, args.impl, args.max_seq, args.head_dim)
        decode.check_impls(args.decode_impl)
        if args.batch is not None:
            decode.check_batches(args.batch)
        if args.toggle is not None:
            train.check_toggles(args.toggle)
        if args.preset is not None:
            model.check_presets(args.quick, args.preset)
    except ValueError as e:
        run.error(
            str(e)
            .replace("impls:", "--impl:")
            .replace("max_seq", "--max-seq")
            .replace("head_dims:", "--head-dim:")
            .replace("batches:", "--batch:")
        )
    try:
        if args.out is not None:
            check_out_dir(args.out)
    except ValueError as e:
        run.error(str(e))
    if args.budget_s is not None and (args.budget_s <= 0 or not {"train", "decode"} & set(suites)):
        run.error(f"--budget-s {args.budget_s}: give seconds > 0 for the train or decode suite (suites: {suites})")
    if args.repeat < 1:
        run.error(f"--repeat {args.repeat}: give a number of processes >= 1")

    info = measure.env_info()
    info["quick"] = args.quick
    out = (
        args.out if args.out is not None else default_out(measure.device_slug(info) + ("-quick" if args.quick else ""))
    )
    try:
        out = check_out_dir(out)
    except ValueError as e:
        run.error(str(e))
    print(f"device: {info['jax_device']} | jax {info['jax']} | torch {info['torch']} | out: {out}", flush=True)
    if args.repeat > 1:
        return _run_repeated(args, out)
    results, failed = {}, []
    from tqdm import tqdm

    # one step per suite on stderr (the suites print their rows on stdout); off when stderr is not a terminal
    bar = tqdm(suites, desc="benchmarks", unit="suite", file=sys.stderr, disable=None, dynamic_ncols=True)
    for suite in bar:
        bar.set_postfix_str(suite)
        t0, load0 = time.perf_counter(), list(os.getloadavg())
        kwargs = (
            {"impls": args.impl, "max_seq": args.max_seq, "head_dims": args.head_dim} if suite == "attention" else {}
        )
        if suite == "decode":
            kwargs["impls"] = args.decode_impl
            kwargs["batches"] = args.batch
        if suite == "train":
            kwargs["toggles"] = args.toggle
        if suite == "model":
            kwargs["presets"] = args.preset
        if suite in ("train", "decode") and args.budget_s is not None:
            kwargs["budget_s"] = args.budget_s
        # the suite's JSON is rewritten after each row ("complete": false), so a kill keeps the rows before it
        measure._ROWS = LiveRows(out, suite, {**info, "loadavg": load0})
        try:
            records = importlib.import_module(f"benchmarks.suites.{suite}").run(quick=args.quick, **kwargs)
        finally:
            measure._ROWS = None
        if not any(r.get("status", "ok") == "ok" for r in records):
            # never replace a result with an empty one or one made only of skips
            reasons = sorted({str(r.get("reason")) for r in records})
            why = f"({len(records)} records, all skipped" + (f": {'; '.join(reasons)[:500]}" if reasons else "") + ")"
            if explicit or not records or any(r.get("status") == "error" for r in records):
                print(
                    f"error: suite {suite!r} measured nothing {why}; nothing written for it",
                    file=sys.stderr,
                    flush=True,
                )
                failed.append(suite)
            else:  # part of `all` and not servable on this machine (e.g. `plan` without the gpu-compile extra)
                print(f"note: suite {suite!r} skipped on this machine {why}", flush=True)
            continue
        results[suite] = records
        # the machine's load (1/5/15-min averages) as this suite started and ended: a busy machine moves the times
        write_results(out, suite, records, {**info, "loadavg": load0, "loadavg_end": list(os.getloadavg())})
        print(f"\n## {suite} ({time.perf_counter() - t0:.0f} s)\n\n{suite_table(suite, records)}", flush=True)
        if args.no_report:
            print(f"wrote {os.path.join(out, suite + '.json')}", flush=True)
            continue
        plot = plot_suite(out, suite, records, info)
        if plot:
            print(f"plot: {plot.path}", flush=True)
    if results and not args.no_report:
        print(f"\nreport: {write_report(out, results, info)}")
    return 1 if failed else 0


def _run_repeated(args, out: str) -> int:
    """``run --repeat N``: the same command (without ``--repeat``) in N fresh processes writing to a temporary
    directory (removed after), pooled into ``out`` (``benchmarks/tools/repeat.py``)."""
    import shutil
    import tempfile

    from .tools.repeat import run_processes, write_pooled

    extra = [a for i in args.impl or () for a in ("--impl", i)]
    extra += ["--max-seq", str(args.max_seq)] if args.max_seq is not None else []
    extra += [a for d in args.head_dim or () for a in ("--head-dim", str(d))]
    for flag, values in (("--decode-impl", args.decode_impl), ("--batch", args.batch), ("--toggle", args.toggle)):
        extra += [a for v in values or () for a in (flag, str(v))]
    extra += [a for p in args.preset or () for a in ("--preset", p)]
    extra += ["--budget-s", str(args.budget_s)] if args.budget_s is not None else []
    tmp = tempfile.mkdtemp(prefix="benchmarks-repeat-")
    try:
        runs = run_processes(args.suite or ["all"], args.repeat, args.quick, tmp, extra)
        written = write_pooled(runs, out)
    except (RuntimeError, ValueError) as e:
        print(f"error: {e}; nothing written", file=sys.stderr, flush=True)
        return 1
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # only what the processes above wrote
    for suite, d in read_results(out).items():
        if suite in runs[0]:
            print(f"\n## {suite} (pooled over {args.repeat} processes)\n\n{suite_table(suite, d['records'])}")
    print("\n" + "\n".join(f"wrote {p}" for p in written))
    return 0


if __name__ == "__main__":
    sys.exit(main())
