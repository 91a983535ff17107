"""A synthetic ``runs.parquet`` table with known numbers for the paper's tests
(tests/e2e/test_paper.py, tests/unit/test_paper_fuzz.py): one row per run of an
experiment, its phases, objective, status and provenance chosen by rule."""

from __future__ import annotations

import json

import pandas as pd
from omegaconf import OmegaConf

from pipeline.config import stage_dirs
from pipeline.tools import paper

#: The git revision every synthetic run records.
GIT = "0123456789abcdef0123456789abcdef01234567"


def synthetic_phases(cfg) -> dict[str, float]:
    """Known phase seconds: eager builds factors in cost_build, lazy in factor_build;
    trace grows with depth; ilp solves slower."""
    lazy = bool(cfg.lazy_costs)
    p = {"trace": 2.0 * cfg.model.n_layers, "topology": 1.0,
         "cost_build": 0.5 if lazy else 6.0, "factor_build": 3.0 if lazy else 0.0,
         "solve": 2.0 if cfg.solver.name == "approx" else 9.0}
    p["search_total"] = sum(p.values())
    return p


def synthetic_runs(exp: paper.Experiment) -> pd.DataFrame:
    """One runs.parquet-like row per run of ``exp`` with known values."""
    rows = []
    for i, run in enumerate(exp.runs()):
        cfg = run.cfg
        lazy = bool(cfg.lazy_costs)
        ilp = cfg.solver.name == "ilp"
        rows.append({
            "run_id": f"{i:08x}", "solve_dir": str(stage_dirs(cfg).solve),
            "model": cfg.model.name, "mesh": "x".join(map(str, cfg.mesh)),
            "hardware": cfg.hardware.name, "cost_mode": "lazy" if lazy else "eager",
            "solver": cfg.solver.name, "status": "Optimal" if ilp else "Heuristic",
            "objective": 2000.0 + 100.0 * len(cfg.mesh), "gap": 0.0 if ilp else 0.0125,
            "certified": ilp,
            **{f"phases.{k}": v for k, v in synthetic_phases(cfg).items()},
            "peak_rss_bytes.max": (400 if lazy else 1000) * 2**20,
            "git.revision": GIT, "git.dirty": False, "revision_label": None,
            "config_json": json.dumps(OmegaConf.to_container(cfg, resolve=True),
                                      sort_keys=True),
        })
    return pd.DataFrame(rows)
