"""The points of a sweep: what each one ended with, and the summary a sweep ends with.

A sweep (``python -m pipeline -m ...``, ``python -m pipeline.tools.shapes``) plans N
points. A point that fails at run time does not stop the sweep: its outcome is recorded
(its overrides and its one-line reason), the other points run, the report covers the
points that ran, and the sweep ends with :func:`summary_lines`::

    sweep: planned 3, ok 2, failed 1
    failed: mesh=2 constraints.device_memory=300MiB: <its one line>

A point's outcome is one JSON file, ``<index>.json`` in the sweep's outcome directory
(:func:`record_outcome`), written by the process that ran the point: with Hydra's joblib
or submitit launcher that is a worker process or a SLURM job, which finds the directory
in the environment variable :data:`ENV_VAR` (set by the sweep's own process; a SLURM job
inherits the submitting environment). A planned point with no outcome file (its process
died) counts as failed.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from pipeline.core.runtime import atomic_path

#: The outcome directory of the sweep a process runs a point of.
ENV_VAR = "PIPELINE_SWEEP_OUTCOMES"
#: The reason of a planned point that left no outcome.
NO_OUTCOME = "no outcome recorded (the point's process ended before it finished)"


@dataclass(frozen=True)
class PointOutcome:
    """How one point of a sweep ended: ``reason`` is None when it planned, else the
    one-line reason it failed."""

    point: str
    reason: str | None = None

    @property
    def ok(self) -> bool:
        return self.reason is None


def one_line(err: BaseException, with_type: bool = False) -> str:
    """The first line of an error's message (its type name when it has none);
    ``with_type``: prefixed ``<Type>: `` (an error that is not a user error)."""
    text = str(err).strip()
    first = text.splitlines()[0] if text else type(err).__name__
    return f"{type(err).__name__}: {first}" if with_type and text else first


def record_outcome(directory: Path | str, index: int, outcome: PointOutcome) -> Path:
    """Write the outcome of point ``index`` (0-based, in the sweep's order) atomically."""
    path = Path(directory) / f"{int(index)}.json"
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps({"point": outcome.point, "reason": outcome.reason}) + "\n")
    return path


def read_outcomes(directory: Path | str) -> dict[int, PointOutcome]:
    """The outcomes recorded in ``directory``, by point index (none if it is absent)."""
    out: dict[int, PointOutcome] = {}
    root = Path(directory)
    if not root.is_dir():
        return out
    for path in root.glob("*.json"):
        if path.stem.isdigit():
            doc = json.loads(path.read_text())
            out[int(path.stem)] = PointOutcome(str(doc["point"]), doc.get("reason"))
    return out


def summary_lines(planned: Sequence[str], outcomes: Mapping[int, PointOutcome],
                  what: str = "sweep") -> list[str]:
    """``<what>: planned N, ok K, failed F`` then one ``failed: <point>: <reason>`` line
    per failed point, in the sweep's order. ``planned``: the points' overrides as text,
    in order; a point without an outcome failed (:data:`NO_OUTCOME`)."""
    failed = []
    for i, point in enumerate(planned):
        got = outcomes.get(i)
        if got is None:
            failed.append((point, NO_OUTCOME))
        elif not got.ok:
            failed.append((got.point or point, str(got.reason)))
    ok = len(planned) - len(failed)
    return ([f"{what}: planned {len(planned)}, ok {ok}, failed {len(failed)}"]
            + [f"failed: {p}: {r}" for p, r in failed])
