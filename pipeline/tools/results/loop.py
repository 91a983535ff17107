"""The predicted-versus-measured page: ``predicted_vs_measured.json`` of
``python -m pipeline.verify.sweep`` (one row per mesh and plan: the step time the cost
model predicted under the run's hardware, the measured median, min, max and quartiles
of the applied step on gloo processes, their ratio, the load average).

Derived here, from the rows only: ``within`` (``|ratio - 1| <= 0.25``, the target of
issue #25) and, per mesh, whether the plans rank in the same order by prediction and by
measured median (``same order``; ties broken by plan name).
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

from pipeline.tools.results.page import NOT_RECORDED, Column, Page

__all__ = ["LOOP_COLUMNS", "TOLERANCE", "loop_page", "rank_agreement"]

#: ``|predicted / measured - 1|`` accepted (issue #25).
TOLERANCE = 0.25

LOOP_COLUMNS: tuple[Column, ...] = (
    Column("mesh", "mesh"), Column("plan", "plan"),
    Column("predicted_ms", "predicted ms", "num"),
    Column("median_ms", "measured median ms", "num"),
    Column("spread", "min-max ms (IQR)"), Column("ratio", "predicted / median", "num"),
    Column("min_ratio", "predicted / min", "num"), Column("within", "within 25 %"),
    Column("cpu", "rank CPU ms (median)"),
    Column("load", "load (1 min) before, after"), Column("error", "error"),
)


def rank_agreement(rows: list[dict[str, Any]]) -> dict[str, bool]:
    """Per mesh: the plans in the same order by ``predicted_ms`` and by ``median_ms``
    (rows without both are left out)."""
    out = {}
    for mesh in dict.fromkeys(r["mesh"] for r in rows):
        ok = [r for r in rows if r["mesh"] == mesh and r.get("predicted_ms") is not None
              and r.get("median_ms") is not None]
        by_pred = [r["plan"] for r in sorted(ok, key=lambda r: (r["predicted_ms"], r["plan"]))]
        by_meas = [r["plan"] for r in sorted(ok, key=lambda r: (r["median_ms"], r["plan"]))]
        out[mesh] = by_pred == by_meas
    return out


def _row(r: dict[str, Any]) -> dict[str, Any]:
    out = dict(r)
    if r.get("median_ms") is not None:
        out["spread"] = (f"{r['min_ms']:.1f}-{r['max_ms']:.1f} "
                         f"({r['q1_ms']:.1f}-{r['q3_ms']:.1f})")
        if r.get("predicted_ms") is not None:
            out["min_ratio"] = r["predicted_ms"] / r["min_ms"]
            out["within"] = "yes" if abs(r["ratio"] - 1) <= TOLERANCE else "no"
    if r.get("cpu_median_ms"):
        out["cpu"] = ", ".join(f"{c:.1f}" for c in r["cpu_median_ms"])
    load = r.get("load_average") or {}
    if load:
        out["load"] = f"{load['before'][0]:.1f}, {load['after'][0]:.1f} on {load['cores']} cores"
    return out


def loop_page(path: Path, name: str | None, page_command: str,
              title: str | None = None) -> Page:
    """The page of a sweep's ``predicted_vs_measured.json`` (module docstring); default
    name ``predicted-vs-measured``."""
    data = json.loads(Path(path).read_text())
    rows = [_row(r) for r in data["rows"]]
    env = data.get("environment") or {}
    git = data.get("git") or {}
    machine = (f"{env.get('cpu_model')}, {env.get('cpu_count')} logical CPUs"
               if env.get("cpu_model") else NOT_RECORDED)
    ranks = rank_agreement(rows)
    done = [r for r in rows if r.get("within") is not None]
    worst = max((abs(r["ratio"] - 1) for r in done), default=None)
    factors = [1 / r["ratio"] for r in done if r["ratio"]]
    hardware = sorted({str(r.get("hardware")) for r in rows})
    notes = (
        f"predicted: run.json step_time_us under hardware={','.join(hardware)} (overlap "
        f"{sorted({str(r.get('overlap')) for r in rows})}); measured: the applied step "
        f"(zero_grad, forward + loss, backward) on gloo processes, {data.get('warmup')} "
        f"warm-up then {data.get('steps')} timed steps, each step's slowest rank, between "
        "barriers (pipeline/verify/timing.py)",
        f"within 25 %: {sum(r['within'] == 'yes' for r in done)} of {len(done)} plans; "
        + (f"largest |ratio - 1| {worst:.2f}; measured median / predicted from "
           f"{min(factors):.1f}x to {max(factors):.1f}x" if worst is not None and factors
           else "no plan measured"),
        "same ranking by prediction and by measured median, per mesh: "
        + ", ".join(f"{m}: {'yes' if ok else 'no'}" for m, ok in ranks.items()),
        "overrides: " + " ".join(data.get("overrides") or []),
    )
    listing = [f"{r['mesh']} {r['plan']}: `{r['verify']}`" for r in rows]
    return Page(name=name or "predicted-vs-measured",
                title=title or "Predicted versus measured step time",
                page_command=page_command, source=Path(path),
                produced_by=shlex.join(["python", "-m", "pipeline.verify.sweep",
                                        "--meshes", ",".join(data.get("meshes") or []),
                                        "--plans", ",".join(data.get("plans") or []),
                                        "--steps", str(data.get("steps")),
                                        "--warmup", str(data.get("warmup"))]),
                revisions=(str(git.get("revision", NOT_RECORDED))[:10]
                           + (" (dirty)" if git.get("dirty") else ""),),
                machines=(machine,), columns=LOOP_COLUMNS, rows=tuple(rows), notes=notes,
                listing_title="verify.json of each row", listing=tuple(listing))
