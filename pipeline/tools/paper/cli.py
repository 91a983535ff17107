"""Command line of the paper tool, ``python -m pipeline.tools.paper`` (:func:`main`)."""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Sequence

from pipeline.config import ConfigError
from pipeline.tools.paper.build import make_paper
from pipeline.tools.paper.experiment import PaperError


class _OneLineParser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        print(f"{self.prog}: {' '.join(message.split())}", file=sys.stderr)
        sys.exit(2)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m pipeline.tools.paper``; returns the exit code."""
    parser = _OneLineParser(
        prog="python -m pipeline.tools.paper",
        description="Regenerate the paper's tables and figures from runs.parquet.")
    parser.add_argument("--no-run", action="store_true",
                        help="do not run missing runs; fail if one is missing")
    parser.add_argument("overrides", nargs="*",
                        help="Hydra overrides, e.g. experiment=paper results_dir=results")
    args = parser.parse_args(sys.argv[1:] if argv is None else list(argv))
    from pipeline.stages.runner import configure_logging

    configure_logging()
    try:
        paths = make_paper(args.overrides, run_missing=not args.no_run)
    except (ConfigError, PaperError) as err:
        print(err, file=sys.stderr)
        return 2
    except subprocess.CalledProcessError as err:
        print(f"a run failed: {' '.join(map(str, err.cmd))} (exit {err.returncode})",
              file=sys.stderr)
        return 1
    for p in paths:
        print(p)
    return 0
