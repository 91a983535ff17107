"""Benchmark suites.

A *suite* is a named list of *cases*; a case is a list of Hydra overrides, exactly what
``python -m pipeline`` takes. The suites are data in this module (:data:`SUITES`):

``search`` (default)
    llama1b on meshes 8, 8x8 and 2x4x8, approx, lazy and eager costs; then a depth sweep
    of the llama1b shapes at ``model.n_layers`` 2, 4, 8, 32, 64 on 2x4x8, lazy. The
    16-layer point of the sweep is the ``mesh=2x4x8 ... lazy_costs=true`` case (the same
    resolved config, so it is not run twice).
``solvers``
    llama1b on meshes 8, 8x8, 2x4x8 with approx, ILP/HiGHS and ILP/CBC (600 s limit).
``big``
    llama8b and llama70b on 2x4x8, approx, lazy costs.
``smoke``
    the toy model on meshes 8 and 2x4: approx lazy, approx eager, ILP (HiGHS). Fast; run
    by ``tests/e2e/test_bench.py``.
``models``
    transformers architectures beside the built-in model on 2x4x8, approx, lazy:
    llama1b, ``hf/gpt2`` (GPT-2 small, 12 layers) and ``hf/qwen2`` (Qwen2-0.5B, 24
    layers), real shapes. Before the cases the import of transformers is timed on its
    own (:data:`IMPORT_PROBES`, fresh processes, after ``import torch``), since every
    ``hf`` trace pays it.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["DEFAULT_SUITE", "IMPORT_PROBES", "SUITES", "Case", "Suite"]


@dataclass(frozen=True)
class Case:
    """One benchmark case: Hydra overrides for ``python -m pipeline``."""

    overrides: tuple[str, ...]

    @property
    def label(self) -> str:
        """The overrides joined by single spaces (what ``--only`` matches)."""
        return " ".join(self.overrides)

    @property
    def slug(self) -> str:
        """A file-name-safe form of the label (used for log and results directories)."""
        text = self.label.replace("=", "-").replace(" ", "_")
        return re.sub(r"[^A-Za-z0-9._-]", "", text)[:120]


@dataclass(frozen=True)
class Suite:
    name: str
    description: str
    cases: tuple[Case, ...]
    imports: tuple[str, ...] = ()  # keys of IMPORT_PROBES timed before the cases


def _suite(name: str, description: str, rows: Sequence[str],
           imports: tuple[str, ...] = ()) -> Suite:
    return Suite(name, description, tuple(Case(tuple(r.split())) for r in rows), imports)


#: Import probes: the statements a trace of the family runs before building a model,
#: timed in a fresh process after ``import torch`` (which every case pays anyway).
IMPORT_PROBES: dict[str, str] = {
    "transformers": ("import transformers; from transformers import AutoConfig, "
                     "AutoModelForCausalLM, AttentionInterface; "
                     "from transformers.masking_utils import AttentionMaskInterface"),
}


_LLAMA1B_MESHES = ("8", "8x8", "2x4x8")

#: The benchmark suites (see the module docstring). Keys are always written in the order
#: model, model.*, mesh, solver, solver.*, lazy_costs, so ``--only 'mesh=8 '`` selects
#: mesh 8 and not 8x8.
SUITES: dict[str, Suite] = {s.name: s for s in (
    _suite("search", "llama1b search time by mesh and cost mode, and by depth",
           [f"model=llama1b mesh={m} solver=approx lazy_costs={lazy}"
            for m in _LLAMA1B_MESHES for lazy in ("true", "false")]
           # depth sweep; n_layers=16 is the mesh=2x4x8 lazy case above
           + [f"model=llama1b model.n_layers={n} mesh=2x4x8 solver=approx lazy_costs=true"
              for n in (2, 4, 8, 32, 64)]),
    _suite("solvers", "approx vs exact ILP (HiGHS, CBC) on llama1b",
           [f"model=llama1b mesh={m} {s}" for m in _LLAMA1B_MESHES for s in (
               "solver=approx",
               "solver=ilp solver.backend=highs solver.time_limit_s=600",
               "solver=ilp solver.backend=cbc solver.time_limit_s=600")]),
    _suite("big", "llama8b and llama70b on 2x4x8, approx, lazy costs",
           [f"model={m} mesh=2x4x8 solver=approx lazy_costs=true"
            for m in ("llama8b", "llama70b")]),
    _suite("smoke", "toy model, meshes 8 and 2x4: approx lazy / eager, ILP (fast; tested)",
           [f"model=toy mesh={m} {s}" for m in ("8", "2x4") for s in (
               "solver=approx lazy_costs=true",
               "solver=approx lazy_costs=false",
               "solver=ilp solver.backend=highs")]),
    _suite("models", "issue 11: transformers architectures (GPT-2 small, Qwen2-0.5B) beside "
           "llama1b on 2x4x8, approx, lazy costs",
           [f"model={m} mesh=2x4x8 solver=approx lazy_costs=true"
            for m in ("llama1b", "hf/gpt2", "hf/qwen2")], imports=("transformers",)),
)}

DEFAULT_SUITE = "search"
