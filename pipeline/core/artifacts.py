"""The contracts between stages: every artifact's file name, schema version, writer and
reader.

Each stage reads only the artifacts of earlier stages from their directories
(:func:`pipeline.config.stage_dirs`) and writes its own atomically
(pipeline/core/runtime.py); the file it writes last, its *sentinel*
(:data:`SENTINELS`), tells that the stage is complete. Stages, the CLI, the
benchmark and profiling tools and the Snakemake rules take the names from here.

========  ==========================  =============================================
stage     artifact                    content
========  ==========================  =============================================
trace     ``graph.parquet``           graph IR, one row per FX node (sentinel)
topology  ``nodes.parquet``           one row per MRF node: group, strategy list
topology  ``strategies.parquet``      one row per strategy of each strategy list
topology  ``edges.parquet``           producer -> consumer edges
topology  ``topology.json``           counts, pins, fallbacks, seconds (sentinel)
costs     ``factors.npz``             eager only: the complete MRF (unaries,
                                      pairwise factors, constraint rows)
costs     ``costs.json``              resolved cost model, counts, the budget,
                                      seconds (sentinel)
solve     ``model.mps``               ilp / lp only: the program that was solved
solve     ``solution.parquet``        one row per node: chosen placements, costs
solve     ``redistributions.parquet`` one row per edge whose placements differ
solve     ``plan.json``               the plan in a loadable, versioned form
                                      (pipeline/plan/format.py, docs/plan.md)
solve     ``run.json``                the run record (sentinel)
solve     ``plan.png``, ``plan.svg``  a picture of the plan, drawn by the report
                                      step (pipeline/stages/report/picture.py)
report    ``runs.parquet``            one row per run record under ``runs/``
report    ``placements.parquet``      the union of every ``solution.parquet``
report    ``redistributions.parquet`` the union of every run's redistributions
========  ==========================  =============================================

Schema versions: a JSON artifact carries ``schema_version`` at its top level, a Parquet
artifact in its ``pipeline`` schema metadata and ``factors.npz`` as an array of that
name; :func:`write_json` and :func:`write_table` stamp them. Bump an artifact's version
when its columns or keys change meaning; a reader that needs a given version checks it
with :func:`check_schema`. (The trace and topology stages write their artifacts with
:mod:`pipeline.core.runtime` directly and do not stamp them yet.)
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.core import runtime
from pipeline.core.errors import PlanError


@dataclass(frozen=True)
class Artifact:
    """One file a stage writes into its directory.

    Attributes:
        name: the file name (the same in every run's stage directory).
        stage: the stage whose directory holds it.
        schema_version: version of its columns / keys.
        writer, reader: dotted names of the functions that write and read it.
        when: ``"always"``, ``"eager"`` (eager costs only), ``"ilp,lp"`` (those
            solvers only) or ``"report"`` (written into the stage's directory by the
            report step, so not an output of the stage's own rule).
    """

    name: str
    stage: str
    schema_version: int
    writer: str
    reader: str | None = None
    when: str = "always"

    def path(self, directory: Path | str) -> Path:
        """``directory / name``."""
        return Path(directory) / self.name


GRAPH = Artifact("graph.parquet", "trace", 1, "pipeline.stages.trace.stage.run_trace",
                 "pipeline.core.ir.read_graph")
NODES = Artifact("nodes.parquet", "topology", 1, "pipeline.stages.topology.write_topology",
                 "pipeline.stages.topology.read_topology")
STRATEGIES = Artifact("strategies.parquet", "topology", 1,
                      "pipeline.stages.topology.write_topology",
                      "pipeline.stages.topology.read_topology")
EDGES = Artifact("edges.parquet", "topology", 1, "pipeline.stages.topology.write_topology",
                 "pipeline.stages.topology.read_topology")
TOPOLOGY = Artifact("topology.json", "topology", 1, "pipeline.stages.topology.write_topology",
                    "pipeline.stages.topology.read_topology")
FACTORS = Artifact("factors.npz", "costs", 1, "pipeline.stages.costs.factors_file.save_factors",
                   "pipeline.stages.costs.factors_file.load_factors", when="eager")
COSTS = Artifact("costs.json", "costs", 1, "pipeline.stages.costs.stage.run_costs",
                 "pipeline.stages.costs.stage.load_costs")
MODEL_MPS = Artifact("model.mps", "solve", 1, "pipeline.solvers.ilp.solve_ilp",
                     when="ilp,lp")
SOLUTION = Artifact("solution.parquet", "solve", 1, "pipeline.stages.solve.stage.run_solve",
                    "pipeline.stages.report.stage.run_report")
REDISTRIBUTIONS = Artifact("redistributions.parquet", "solve", 1,
                           "pipeline.stages.solve.stage.redistribution_table",
                           "pipeline.stages.report.stage.run_report")
PLAN = Artifact("plan.json", "solve", 1, "pipeline.plan.format.write_plan",
                "pipeline.plan.format.load")
RUN = Artifact("run.json", "solve", 1, "pipeline.stages.solve.stage.run_solve",
               "pipeline.stages.report.stage.run_rows")
PLAN_PICTURE = Artifact("plan.png", "solve", 1, "pipeline.stages.report.picture.write_plan_picture",
                        when="report")
PLAN_SVG = Artifact("plan.svg", "solve", 1, "pipeline.stages.report.picture.write_plan_picture",
                    when="report")
RUNS = Artifact("runs.parquet", "report", 1, "pipeline.stages.report.stage.run_report",
                "pipeline.tools.paper.read_runs")
PLACEMENTS = Artifact("placements.parquet", "report", 1, "pipeline.stages.report.stage.run_report")
REPORT_REDISTRIBUTIONS = Artifact("redistributions.parquet", "report", 1,
                                  "pipeline.stages.report.stage.run_report")

#: Every artifact, in stage order.
ARTIFACTS: tuple[Artifact, ...] = (
    GRAPH, NODES, STRATEGIES, EDGES, TOPOLOGY, FACTORS, COSTS, MODEL_MPS, SOLUTION,
    REDISTRIBUTIONS, PLAN, RUN, PLAN_PICTURE, PLAN_SVG, RUNS, PLACEMENTS, REPORT_REDISTRIBUTIONS)

# File names, for the modules that join them to a directory themselves.
GRAPH_FILE = GRAPH.name
NODES_FILE = NODES.name
STRATEGIES_FILE = STRATEGIES.name
EDGES_FILE = EDGES.name
TOPOLOGY_FILE = TOPOLOGY.name
FACTORS_FILE = FACTORS.name
COSTS_FILE = COSTS.name
MODEL_MPS_FILE = MODEL_MPS.name
SOLUTION_FILE = SOLUTION.name
REDISTRIBUTIONS_FILE = REDISTRIBUTIONS.name
PLAN_FILE = PLAN.name
RUN_FILE = RUN.name
RUNS_FILE = RUNS.name
PLACEMENTS_FILE = PLACEMENTS.name

#: The artifact each stage writes last; its presence means the stage is complete.
SENTINEL_ARTIFACTS: dict[str, Artifact] = {
    "trace": GRAPH, "topology": TOPOLOGY, "costs": COSTS, "solve": RUN, "report": RUNS}
#: File name of each stage's sentinel.
SENTINELS: dict[str, str] = {stage: a.name for stage, a in SENTINEL_ARTIFACTS.items()}

#: Bookkeeping files of a stage directory (pipeline/stages/runner.py): the stamp (the hash of the
#: code that wrote the artifacts, and each artifact's checksum and schema version,
#: :func:`write_stamp`), and the lock a second process waits on.
CODE_STAMP = ".code"
LOCK_FILE = ".lock"
#: Version of the stamp's own layout.
STAMP_VERSION = 1


def stage_outputs(stage: str, lazy_costs: bool) -> list[Artifact]:
    """The artifacts ``stage`` always writes under the given cost mode (the outputs its
    Snakemake rule declares), sentinel last. Solver-specific files (``model.mps``) are
    left out."""
    wanted = ("always", "lazy" if lazy_costs else "eager")
    out = [a for a in ARTIFACTS if a.stage == stage and a.when in wanted
           and a is not SENTINEL_ARTIFACTS[stage]]
    return out + [SENTINEL_ARTIFACTS[stage]]


def file_digest(path: Path | str) -> str:
    """SHA-256 (hex) of a file's content, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def write_stamp(directory: Path | str, code: str, outputs: list[Artifact]) -> Path:
    """Write the stage directory's stamp (:data:`CODE_STAMP`) atomically, after every
    artifact: the code hash and, per artifact, its byte count, SHA-256 and schema version.
    A reader trusts an artifact only when it matches its stamp (:func:`stamp_problem`)."""
    directory = Path(directory)
    files = {}
    for a in outputs:
        path = a.path(directory)
        files[a.name] = {"bytes": path.stat().st_size, "sha256": file_digest(path),
                         "schema_version": a.schema_version}
    path = directory / CODE_STAMP
    text = dumps({"stamp_version": STAMP_VERSION, "code": code, "files": files})
    with runtime.atomic_path(path) as tmp:
        tmp.write_text(text)
    return path


def read_stamp(directory: Path | str) -> dict[str, Any] | None:
    """The stamp of a stage directory, ``None`` if it is missing or not a stamp of this
    layout (e.g. written by older code)."""
    path = Path(directory) / CODE_STAMP
    try:
        stamp = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    ok = (isinstance(stamp, dict) and stamp.get("stamp_version") == STAMP_VERSION
          and isinstance(stamp.get("files"), dict))
    return stamp if ok else None


def stamp_problem(directory: Path | str, outputs: list[Artifact],
                  stamp: dict[str, Any]) -> str | None:
    """Why the artifacts in ``directory`` cannot be trusted against ``stamp``, or ``None``
    when each exists with its stamped size, checksum and the current schema version.
    The answer is one line naming the file, e.g. ``.../graph.parquet: 1024 bytes, the
    stamp says 2048 (truncated or changed since it was written)``."""
    for a in outputs:
        path = a.path(directory)
        entry = stamp["files"].get(a.name)
        if not path.exists():
            return f"{path}: missing"
        if not isinstance(entry, dict):
            return f"{path}: not in the stamp {Path(directory) / CODE_STAMP}"
        if entry.get("schema_version") != a.schema_version:
            return (f"{path}: schema_version={entry.get('schema_version')}, this code "
                    f"reads {a.schema_version}")
        size = path.stat().st_size
        if size != entry.get("bytes"):
            return (f"{path}: {size} bytes, the stamp says {entry.get('bytes')} "
                    "(truncated or changed since it was written)")
        if file_digest(path) != entry.get("sha256"):
            return f"{path}: checksum differs from the stamp (changed since it was written)"
    return None


def check_schema(artifact: Artifact, found: Any, path: Path | str) -> None:
    """Raise PlanError (one line) unless ``found`` is the artifact's schema version."""
    if found != artifact.schema_version:
        raise PlanError(f"{path}: schema_version={found}, this code reads "
                        f"{artifact.schema_version}; rerun the {artifact.stage} stage")


def strict(obj: Any) -> Any:
    """``obj`` with every value JSON can hold: numpy scalars and arrays as Python values,
    paths as text and a non-finite float (``inf``, ``-inf``, ``nan``, which strict JSON
    has no spelling for) as ``None``."""
    import numpy as np

    if isinstance(obj, dict):
        return {str(k): strict(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [strict(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return strict(obj.tolist())
    if isinstance(obj, np.generic):
        return strict(obj.item())
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj


def dumps(obj: Any) -> str:
    """Strict JSON text of ``obj`` (indented, sorted keys; non-finite floats as ``null``,
    :func:`strict`); parsers that refuse ``Infinity`` / ``NaN`` read it."""
    return json.dumps(strict(obj), indent=2, sort_keys=True, allow_nan=False) + "\n"


def write_json(artifact: Artifact, directory: Path | str, obj: dict[str, Any]) -> Path:
    """Write a JSON artifact atomically with its ``schema_version`` as strict JSON
    (:func:`dumps`); its path."""
    path = artifact.path(directory)
    text = dumps({**obj, "schema_version": artifact.schema_version})
    with runtime.atomic_path(path) as tmp:
        tmp.write_text(text)
    return path


def read_json(artifact: Artifact, directory: Path | str) -> dict[str, Any]:
    """Read a JSON artifact and check its ``schema_version``."""
    path = artifact.path(directory)
    obj = json.loads(path.read_text())
    check_schema(artifact, obj.get("schema_version"), path)
    return obj


def write_table(artifact: Artifact, directory: Path | str, table: Any,
                metadata: dict[str, Any] | None = None,
                group: runtime.AtomicGroup | None = None) -> Path:
    """Write a Parquet artifact atomically (with ``group``: renamed into place with the
    group's other files, :func:`pipeline.core.runtime.atomic_group`); ``metadata`` plus
    ``schema_version`` go in the ``pipeline`` schema metadata. Returns its path."""
    path = artifact.path(directory)
    runtime.write_parquet(path, table,
                          metadata={**(metadata or {}), "schema_version": artifact.schema_version},
                          group=group)
    return path


def table_metadata(artifact: Artifact, directory: Path | str) -> dict[str, Any]:
    """The ``pipeline`` schema metadata of a Parquet artifact, read from its footer
    only (the table itself is not loaded)."""
    import pyarrow.parquet as pq

    meta = pq.read_schema(artifact.path(directory)).metadata or {}
    return json.loads(meta.get(b"pipeline", b"{}"))
