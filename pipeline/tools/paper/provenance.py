"""Provenance of the paper's artifacts: per run its id, key, config hash and git revision
(:func:`run_provenance`), the record of one artifact (:func:`provenance`), the JSON
sidecar next to each file (:func:`write_sidecar`) and the footer naming the configs
(:func:`describe_runs`).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from pipeline.config import config_hash, stage_code_hash
from pipeline.tools.paper.experiment import SIDECAR_SUFFIX
from pipeline.tools.paper.tables import mesh_order, row_config, row_layers, row_value, row_width


def run_provenance(runs: Any) -> list[dict[str, Any]]:
    """Per run: id, key, config hash, git revision and dirty flag, revision label, and
    the readable config keys."""
    out = []
    for _, row in runs.iterrows():
        cfg = row_config(row)
        dirty = row_value(row, "git.dirty")
        out.append({
            "run_id": row_value(row, "run_id"),
            "run_key": row_value(row, "run_key"),
            "config_hash": config_hash(cfg) if cfg else None,
            "git_revision": row_value(row, "git.revision"),
            "git_dirty": None if dirty is None else bool(dirty),
            "revision_label": row_value(row, "revision_label"),
            "model": row_value(row, "model"),
            "n_layers": row_layers(row, cfg),
            "mesh": row_value(row, "mesh"),
            "hardware": row_value(row, "hardware"),
            "cost_mode": row_value(row, "cost_mode"),
            "solver": row_value(row, "solver"),
        })
    return out


def provenance(runs: Any, artifact: str, experiment: str | None = None,
               source: dict[str, Any] | None = None) -> dict[str, Any]:
    """The provenance record of one artifact built from the rows ``runs``."""
    from pipeline.core import runtime

    per_run = run_provenance(runs)
    revisions = sorted({r["git_revision"] for r in per_run if r["git_revision"]})
    return {
        "artifact": artifact,
        "experiment": experiment,
        "run_ids": [r["run_id"] for r in per_run],
        "config_hashes": [r["config_hash"] for r in per_run],
        "git_revisions": revisions,
        "runs": per_run,
        "source": source or {},
        "built_by": {"module": "pipeline.tools.paper", "code_hash": stage_code_hash("paper"),
                     "git": runtime.git_revision()},
    }


def describe_runs(runs: Any) -> str:
    """One or two lines naming the configs of ``runs`` (the figure footer)."""
    def values(col: str) -> list[str]:
        if col not in runs:
            return []
        return [str(v) for v in dict.fromkeys(row_value({col: v}, col)
                                               for v in runs[col].tolist()) if v is not None]

    cfgs = [row_config(row) for _, row in runs.iterrows()]
    models = []
    for row, cfg in zip(runs.to_dict("records"), cfgs):
        text = (f"{row_value(row, 'model') or '?'} ({row_layers(row, cfg) or '?'} layers, "
                f"dim {row_width(row, cfg) or '?'})")
        if text not in models:
            models.append(text)
    meshes = sorted(values("mesh"), key=mesh_order)
    revs = []
    for row in runs.to_dict("records"):
        label = row_value(row, "revision_label")
        rev = str(label) if label is not None else str(row_value(row, "git.revision")
                                                        or "unknown")[:8]
        rev += "+dirty" if row_value(row, "git.dirty") and label is None else ""
        if rev not in revs:
            revs.append(rev)
    parts = [
        "model " + ", ".join(models),
        "hardware " + ", ".join(values("hardware")),
        "mesh " + ", ".join(meshes),
        "solver " + ", ".join(values("solver")),
        "costs " + ", ".join(values("cost_mode")),
    ]
    ids = ", ".join(str(row_value({"id": v}, "id")) for v in runs["run_id"].tolist()) \
        if "run_id" in runs else ""
    return "; ".join(parts) + f"\nruns {ids}; git {', '.join(revs)}"


def sidecar_path(path: Path) -> Path:
    """``fig_phases.png`` -> ``fig_phases.provenance.json``."""
    return path.with_name(path.name.split(".")[0] + SIDECAR_SUFFIX)


def write_sidecar(path: Path, prov: dict[str, Any]) -> None:
    """Write ``prov`` to the JSON sidecar of ``path`` (:func:`sidecar_path`)."""
    from pipeline.core import runtime

    runtime.write_json(sidecar_path(path), prov)


def file_sha256(path: Path) -> str:
    """SHA-256 (hex) of a file's bytes (the ``runs.parquet`` an artifact was built from)."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
