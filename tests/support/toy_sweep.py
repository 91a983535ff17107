"""The small sweep the live SLURM test and the HTML-report test share: the toy model,
meshes 8 and 2x4, solvers approx and ilp, written as a paper experiment so that one
Snakemake invocation has all four runs as jobs of the stage rules (and rule paper has
every run set it needs), in a copy of this checkout's code."""

from __future__ import annotations

import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MESHES = ("8", "2x4")
SOLVERS = ("approx", "ilp")
#: The four runs, in Hydra's job order (the last swept key varies fastest).
CONFIGS = [(f"mesh={m}", f"solver={s}") for m in MESHES for s in SOLVERS]
NAME = "toy_sweep"

#: Every run set is the sweep or one run of it; the table mesh 2x4 has one lazy
#: (approx) and one eager (ilp) run.
EXPERIMENT = f"""\
# @package _global_
defaults:
  - override /model: toy
  - override /solver: approx
experiment: {NAME}
paper:
  table_mesh: 2x4
  runs:
    eager_vs_lazy:
      - mesh=8,2x4
      - solver=approx,ilp
    solvers:
      - mesh=8,2x4
      - solver=approx,ilp
    depth:
      - mesh=2x4
      - solver=approx
    scale:
      - mesh=2x4
      - solver=approx
"""


def checkout_with_sweep(dest: Path) -> Path:
    """Copy the code and configs of this checkout to ``dest`` and add the sweep as
    experiment :data:`NAME`; ``dest``."""
    for part in ("pipeline", "conf", "workflow"):
        shutil.copytree(ROOT / part, dest / part,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    (dest / "conf" / "experiment" / f"{NAME}.yaml").write_text(EXPERIMENT)
    return dest
