"""Benchmark runner: ``python -m pipeline.tools.bench [--suite NAME] [--out DIR] [--only REGEX]
[--dry-run] [--fresh] [--timeout S]`` runs a suite of cases, one fresh
``python -m pipeline`` process per case, and writes ``<out>/<suite>.parquet`` and
``<out>/<suite>.md``.

=================================  ===================================================
module                             job
=================================  ===================================================
:mod:`pipeline.tools.bench.suites`       :class:`Case`, :class:`Suite`, the suites
                                   (:data:`SUITES`) and the import probes
:mod:`pipeline.tools.bench.runner`       one case in a fresh process (:func:`run_case`:
                                   wall, CPU, peak RSS, the run record), a suite case
                                   by case (:func:`run_suite`), :func:`machine_info`,
                                   :func:`code_hash`
:mod:`pipeline.tools.bench.table`        the output columns (:data:`COLUMNS`), units, the
                                   Parquet and Markdown writers
:mod:`pipeline.tools.bench.cli`          the command line (:func:`main`, ``--dry-run``,
                                   exit codes)
=================================  ===================================================
"""

from __future__ import annotations

from pipeline.tools.bench.cli import main
from pipeline.tools.bench.runner import (  # and two private names tests use (bench._SENTINELS)
    _SENTINELS as _SENTINELS,
)
from pipeline.tools.bench.runner import _child_env as _child_env
from pipeline.tools.bench.runner import code_hash, import_seconds, machine_info, run_case, run_suite
from pipeline.tools.bench.suites import DEFAULT_SUITE, IMPORT_PROBES, SUITES, Case, Suite
from pipeline.tools.bench.table import COLUMNS, PHASE_COLUMNS, UNITS

__all__ = ["COLUMNS", "DEFAULT_SUITE", "IMPORT_PROBES", "PHASE_COLUMNS", "SUITES", "UNITS",
           "Case", "Suite", "code_hash", "import_seconds", "machine_info", "main", "run_case",
           "run_suite"]
