"""Benchmark command line: ``python -m pipeline.tools.bench [--suite NAME] [--out DIR]
[--only REGEX]
[--dry-run] [--fresh] [--timeout S]``.

    python -m pipeline.tools.bench --suite smoke --fresh        # toy model, about a minute
    python -m pipeline.tools.bench --suite search --only 'mesh=8 '
    python -m pipeline.tools.bench --suite solvers --dry-run    # list the cases, run nothing
    snakemake bench --config suite=big                    # the same, through Snakemake

Exit codes: 0 when every case succeeded; 1 when a case exited non-zero or was killed
by ``--timeout`` (its row has status ``Error``; the runner goes on with the next case);
130 / 143 after Ctrl-C or SIGTERM (the running case, in its own process group, is
killed and recorded as ``Error`` (interrupted), the tables are kept). A bad ``--suite``
or ``--only`` prints one line and exits 2.
"""

from __future__ import annotations

import argparse
import re
import shlex
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pipeline.tools.bench.runner import run_suite
from pipeline.tools.bench.suites import DEFAULT_SUITE, SUITES, Case, Suite

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m pipeline.tools.bench",
        description="Run a benchmark suite, one fresh `python -m pipeline` process per "
                    "case; write <out>/<suite>.parquet and <out>/<suite>.md.")
    p.add_argument("--suite", default=DEFAULT_SUITE,
                   help=f"one of {', '.join(SUITES)} (default {DEFAULT_SUITE})")
    p.add_argument("--out", default="results/bench", type=Path,
                   help="output directory (default results/bench)")
    p.add_argument("--only", default=None, metavar="REGEX",
                   help="run the cases whose overrides, joined by spaces and followed by "
                        "one space, match REGEX (re.search), e.g. 'mesh=8 '")
    p.add_argument("--dry-run", action="store_true",
                   help="list the selected cases and their commands; run nothing")
    p.add_argument("--fresh", action="store_true",
                   help="an empty results directory per case: nothing is reused")
    p.add_argument("--timeout", type=float, default=None, metavar="S",
                   help="kill a case after S seconds (recorded as Error); default none")
    return p


def _fail(message: str) -> int:
    print(" ".join(message.split()), file=sys.stderr)
    return 2


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m pipeline.tools.bench``; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    if args.suite not in SUITES:
        return _fail(f"--suite={args.suite}: allowed {', '.join(SUITES)}")
    if args.timeout is not None and not args.timeout > 0:
        return _fail(f"--timeout={args.timeout:g}: allowed a number of seconds > 0")
    suite = SUITES[args.suite]
    try:
        pattern = re.compile(args.only) if args.only is not None else None
    except re.error as err:
        return _fail(f"--only={args.only}: not a regular expression ({err})")
    selected = [(i, c) for i, c in enumerate(suite.cases, 1)
                if pattern is None or pattern.search(c.label + " ")]
    if not selected:
        return _fail(f"--only={args.only}: matches none of the {len(suite.cases)} cases of "
                     f"suite {suite.name} (see --dry-run without --only)")
    out = Path(args.out)
    if args.dry_run:
        return _dry_run(suite, selected, out.resolve(), args.fresh)
    command = shlex.join(["python", "-m", "pipeline.tools.bench", *argv])
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        return run_suite(suite, selected, out, args.fresh, args.timeout, command)
    except KeyboardInterrupt:
        return 130
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 1
    finally:
        signal.signal(signal.SIGTERM, previous)


def _on_sigterm(signum: int, frame: Any) -> None:
    """SIGTERM (e.g. from Snakemake or a batch system) stops the runner like Ctrl-C: the
    running case, which is in its own process group, is killed and the tables are kept."""
    raise SystemExit(128 + signum)


def _dry_run(suite: Suite, selected: list[tuple[int, Case]], out: Path, fresh: bool) -> int:
    """Print one line per selected case (index, then the command); validate each config."""
    from pipeline.config import ConfigError, load_resolved, override_value

    bad = 0
    for index, case in selected:
        results_dir = (out / "fresh" / suite.name / f"{index:02d}-{case.slug}" if fresh
                       else out / "results")
        overrides = [*case.overrides,
                     f"results_dir={override_value(str(results_dir), quote='path')}"]
        note = ""
        try:
            load_resolved(overrides)
        except ConfigError as err:
            note, bad = f"   # invalid: {err}", bad + 1
        print(f"#{index:<3d}python -m pipeline {shlex.join(overrides)}{note}")
    return 1 if bad else 0

