"""The solver layer: numpy only, graph-agnostic (it never imports torch).

Every solver minimises the pairwise MRF of :mod:`pipeline.solvers.mrf` and is
called the same way, ``solve(mrf, options) -> SolverResult``, through
:mod:`pipeline.solvers.registry` (name -> solver; options in
:mod:`pipeline.solvers.options`, result in :mod:`pipeline.solvers.result`,
status words in :mod:`pipeline.solvers.status`).

* ``trws.py`` (+ ``layout.py``, ``batches.py``, ``compiled.py``, ``local_search.py``):
  TRW-S and the local-search polish (solver ``approx``).
* ``ilp/``: the exact integer program and its LP relaxation (``ilp``, ``lp``).
* ``lagrangian.py``: linear rows for a solver that ignores them (``lagrangian``).
* ``brute.py``: enumeration, the test oracle (``brute_force``).
* ``pruning.py``: exact reduced-cost fixing from TRW-S's dual before an ILP/LP.

This package file imports nothing, so ``pipeline.solvers.options`` stays cheap to
import (the config validation uses its backend list).
"""
