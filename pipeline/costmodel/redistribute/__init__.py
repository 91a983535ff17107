"""Cost of redistributing a tensor between two DTensor placements on a mesh, in µs.

A redistribution ``src -> dst`` is planned into the per-mesh-dim steps DTensor itself
runs, each step is a collective (or a local op) on one mesh dim, and its time is the
alpha-beta cost of that collective plus any local reshuffle. One module per job:

=================  ===================================================================
module             job
=================  ===================================================================
:mod:`.steps`      what one step is: placement categories, legality rules (DTensor's),
                   the step table (collective and buffer ``S`` per step), per-step
                   bytes ``G`` / ``L`` / ``S`` and cost (collectives from
                   :mod:`pipeline.costmodel.comm`)
:mod:`.interner`   :class:`PlacementInterner`: interned placement ids and every cache
                   built on them, one object with one :meth:`~PlacementInterner.clear`
:mod:`.planner`    :func:`plan`: DTensor's greedy planner on interned ids, the plan
                   cache, the strided-shard dispatch
:mod:`.graph`      DTensor's graph (Dijkstra) planner on interned ids
:mod:`.flatten`    flattened collectives: a redistribution that changes several mesh
                   dims the same way (or a run of one collective over several) as one
                   collective over their flattened group (``flatten=True``)
:mod:`.cost`       :func:`redistribute_us` / :func:`redistribute_steps`: one
                   redistribution, scalar
:mod:`.records`    :class:`~.records.TableContext`: every (src, dst) pair planned once
                   per mesh and tensor ndim and compiled into a record of step ids,
                   shared by all tables
:mod:`.tables`     :func:`redistribute_table` (all pairs, vectorised, bit-identical to
                   :func:`redistribute_us`: the records' steps costed and summed) and
                   :func:`placements_differ`
=================  ===================================================================

Every public function takes an optional ``interner=``; without one the module-level
:data:`DEFAULT_INTERNER` is used (the single place the caches live in a process;
:func:`clear_caches` clears it). DTensor's own planner, the reference the planners
are checked against, lives in the tests (``tests/support/dtensor_reference.py``).

The transition penalty of the pairwise factor (1.0 when placements differ) is *not*
added here; the caller adds it.
"""

from pipeline.costmodel.redistribute.cost import StepCost, redistribute_steps, redistribute_us
from pipeline.costmodel.redistribute.interner import (
    DEFAULT_INTERNER,
    PlacementInterner,
    clear_caches,
    normalize_placements,
)
from pipeline.costmodel.redistribute.planner import plan
from pipeline.costmodel.redistribute.steps import KINDS, Step
from pipeline.costmodel.redistribute.tables import placements_differ, redistribute_table

__all__ = [
    "DEFAULT_INTERNER",
    "KINDS",
    "PlacementInterner",
    "Step",
    "StepCost",
    "clear_caches",
    "normalize_placements",
    "placements_differ",
    "plan",
    "redistribute_steps",
    "redistribute_table",
    "redistribute_us",
]
