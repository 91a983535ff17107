"""The group MRF's factors: how the cost model's node and edge costs fold into groups,
and the provider that builds the group factors (all at once, or on first use).

Groups (topology stage) turn node factors into group factors: a group's unary
is the sum of its members' unaries; an edge whose two ends are in the same
group contributes its diagonal ``B(k, k)`` to that unary; edges between two
groups accumulate into one factor over the joint classes of the member edges.
Every sum runs in graph-edge order, so eager and lazy costs give bit-identical
factors.

Eager: every group factor is built by the costs stage (:meth:`FactorProvider.materialise_all`,
in several processes when ``workers`` > 1). Lazy: the solver asks for a group factor on
first use (:meth:`FactorProvider.factor`), and edge tables are memoised by signature (the
edge classes of :meth:`pipeline.costmodel.model.CostModel.edge_classes`), so the copies of
a repeated layer share one table. A lazy group factor gathers one member edge per edge
class and adds it once per member, in graph-edge order, so its cost grows with depth only
by those additions and the values equal the eager ones bit for bit.

``factor_build`` (the run record's phase) is the time spent building pairwise group
factors (:attr:`FactorProvider.factor_seconds`): in the costs stage when eager, inside
the solver when lazy.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pipeline.core import progress, runtime
from pipeline.core.parallel import balanced_chunks, map_chunks
from pipeline.costmodel.model import CostModel
from pipeline.costmodel.redistribute import clear_caches
from pipeline.solvers.mrf import PairwiseFactor

__all__ = ["PARALLEL_MIN_WORK", "FactorProvider", "GroupStructure", "group_structure"]

@dataclass
class GroupStructure:
    """How graph nodes and edges fold into groups (no costs)."""

    group_of: np.ndarray  # int64 [num_nodes]
    members: list[list[int]]  # per group, node ids in order
    domain: np.ndarray  # int64 [G]
    edges: np.ndarray  # int64 [E, 2] (lo, hi)
    edge_members: list[list[tuple[int, bool]]]  # per group edge: (graph edge, flipped)
    self_edges: list[list[int]]  # per group: graph edges inside it
    num_graph_edges: int = 0
    extra: dict = field(default_factory=dict)


def group_structure(topology: Any) -> GroupStructure:
    """Fold the node graph into the group graph (see module docstring)."""
    n = topology.nodes
    group_of = np.asarray(n["group"], dtype=np.int64)
    num_groups = int(group_of.max()) + 1 if len(group_of) else 0
    members: list[list[int]] = [[] for _ in range(num_groups)]
    for node, g in enumerate(group_of.tolist()):
        members[g].append(node)
    domain = np.array([n["num_strategies"][m[0]] for m in members], dtype=np.int64)
    index: dict[tuple[int, int], int] = {}
    pairs: list[tuple[int, int]] = []
    edge_members: list[list[tuple[int, bool]]] = []
    self_edges: list[list[int]] = [[] for _ in range(num_groups)]
    e = topology.edges
    for k, (u, v) in enumerate(zip(e["producer"], e["consumer"])):
        gu, gv = int(group_of[u]), int(group_of[v])
        if gu == gv:
            self_edges[gu].append(k)
            continue
        key = (min(gu, gv), max(gu, gv))
        if key not in index:
            index[key] = len(pairs)
            pairs.append(key)
            edge_members.append([])
        edge_members[index[key]].append((k, gu > gv))
    return GroupStructure(group_of, members, domain,
                          np.asarray(pairs, dtype=np.int64).reshape(len(pairs), 2),
                          edge_members, self_edges, len(e["producer"]))


#: Below this many edge-table entries the group factors are built in one process (a
#: fork costs tens of milliseconds; llama1b on 8x8 has ~5 M, the toy model ~0.1 M).
PARALLEL_MIN_WORK = 1_000_000


class FactorProvider:
    """Computes group unaries and group factors from a CostModel, memoised.

    ``factor(e)`` is the MRF's pairwise callable; in lazy mode it is called by
    the solver on first use. ``factor_seconds`` accumulates the time spent building
    pairwise group factors (the ``factor_build`` phase), ``unary_seconds`` the time
    spent on the group unaries.
    """

    def __init__(self, cost_model: CostModel, groups: GroupStructure):
        self.cost_model = cost_model
        self.groups = groups
        self._factors: dict[int, PairwiseFactor] = {}
        self._readers: dict[int, int] | None = None
        self.unary_seconds = 0.0
        self.factor_seconds = 0.0
        #: True: once every factor exists, keep the redistribution planner's caches
        #: until :meth:`release_caches` (the step-time search's surrogate computes the
        #: FSDP edges' redistribution tables again, pipeline/costmodel/reweight.py:
        #: llama1b 2x4x8, 1.4 s with the caches against 13.6 s without, 2026-12-03,
        #: loaded 2-core EPYC); False (default): drop them then.
        self.hold_caches = False
        self._held = False

    def _read(self, classes: set[int], edge_of: dict[int, int]) -> None:
        """Memoised costs: one group factor that read the edge classes ``classes`` is
        built; a class no unbuilt group factor reads leaves the cost model's memo
        (:meth:`CostModel.forget`; ``edge_of``: a member edge of each class)."""
        if self._readers is None:
            cls = self.cost_model.edge_classes()
            self._readers = {}
            for members in self.groups.edge_members:
                for c in {int(cls[e]) for e, _ in members}:
                    self._readers[c] = self._readers.get(c, 0) + 1
        for c in classes:
            self._readers[c] -= 1
            if self._readers[c] == 0:
                self.cost_model.forget(edge_of[c])

    @property
    def num_built(self) -> int:
        """Group factors built so far."""
        return len(self._factors)

    def unaries(self) -> list[np.ndarray]:
        start = time.perf_counter()
        out = []
        for g, mem in enumerate(self.groups.members):
            u = np.zeros(int(self.groups.domain[g]))
            for node in mem:
                u = u + self.cost_model.unary(node)
            for e in self.groups.self_edges[g]:
                r, c, t = self.cost_model.edge_table(e)
                u = u + t[r, c]
            out.append(u)
        self.unary_seconds += time.perf_counter() - start
        return out

    def factor(self, ge: int) -> PairwiseFactor:
        hit = self._factors.get(ge)
        if hit is not None:
            return hit
        start = time.perf_counter()
        members = self.groups.edge_members[ge]
        # Distinct member edges: with memoised costs, one per (edge class, flipped), so
        # the copies of a repeated layer are gathered once; eager costs keep one per
        # graph edge (its own table), so lazy == eager checks the class key. Dropping
        # repeated class columns leaves the joint classes (np.unique over rows, in
        # lexicographic order) and their order unchanged.
        if self.cost_model.memoise:
            cls = self.cost_model.edge_classes()
            slot: dict[tuple[int, bool], int] = {}
            seq = [slot.setdefault((int(cls[e]), flipped), len(slot)) for e, flipped in members]
            distinct = [None] * len(slot)
            for (e, flipped), k in zip(members, seq):
                if distinct[k] is None:
                    distinct[k] = (e, flipped)
        else:
            seq = list(range(len(members)))
            distinct = list(members)
        rows, cols, tables = [], [], []
        for e, flipped in distinct:
            r, c, t = self.cost_model.edge_table(e)
            if flipped:
                r, c, t = c, r, t.T
            rows.append(r)
            cols.append(c)
            tables.append(t)
        if len(members) == 1:
            f = PairwiseFactor(rows[0], cols[0], np.ascontiguousarray(tables[0]))
        else:
            ur, rinv = np.unique(np.stack(rows, axis=1), axis=0, return_inverse=True)
            uc, cinv = np.unique(np.stack(cols, axis=1), axis=0, return_inverse=True)
            # graph-edge order, one addition per member edge; each member's part is
            # gathered when it is added (no list of [R, C] parts) and added in place
            # (the same sums as ``table = table + part``)
            table = np.zeros((len(ur), len(uc)))
            for k in seq:
                np.add(table, tables[k][np.ix_(ur[:, k], uc[:, k])], out=table)
            f = PairwiseFactor(rinv.reshape(-1).astype(np.int32),
                               cinv.reshape(-1).astype(np.int32), table)
        self._factors[ge] = f
        if self.cost_model.memoise:
            cls = self.cost_model.edge_classes()
            self._read({int(cls[e]) for e, _ in members},
                       {int(cls[e]): e for e, _ in members})
        self.cost_model.stats.group_factors += 1
        if self.cost_model.memoise and len(self._factors) == len(self.groups.edge_members):
            self._release()
        self.factor_seconds += time.perf_counter() - start
        return f

    def _release(self) -> None:
        """Every group factor exists: drop the redistribution planner's caches (pair
        records, plans, interned placements: pipeline/costmodel/redistribute/interner.py;
        recomputed, with equal values, if asked again) and return the freed heap; with
        :attr:`hold_caches`, only note that they may go (:meth:`release_caches`)."""
        if self.hold_caches:
            self._held = True
            return
        clear_caches()
        runtime.release_free_memory()

    def release_caches(self) -> None:
        """End :attr:`hold_caches`: drop the caches now if every factor exists (they
        were held), else when the last one is built."""
        self.hold_caches = False
        if self._held:
            self._held = False
            self._release()

    def share(self, ge: int, table: np.ndarray) -> None:
        """:attr:`MRF.share`: keep ``table`` (a solver's copy, equal to group factor
        ``ge``'s table) in place of the factor's own, which is then freed: the tables
        live once, in the solver's store."""
        f = self._factors.get(ge)
        if f is not None and f.table.shape == table.shape:
            self._factors[ge] = PairwiseFactor(f.row_cls, f.col_cls, table)
        if ge == len(self.groups.edge_members) - 1:  # the solver offers in edge order
            runtime.release_free_memory()

    def materialise_all(self, workers: int = 1) -> list[PairwiseFactor]:
        """Every group factor, in group-edge order; a progress bar on a terminal
        (pipeline/core/progress.py) when built in this process alone. ``workers`` > 1 builds
        them in that many processes (:meth:`build_parallel`)."""
        edges = range(len(self.groups.edge_members))
        if workers > 1:
            self.build_parallel(workers, PARALLEL_MIN_WORK)
        with progress.bar(edges, desc="costs: factors", unit="factor") as bar:
            return [self.factor(e) for e in bar]

    def work_chunks(self, parts: int) -> tuple[list[list[int]], float]:
        """The unbuilt group factors split into at most ``parts`` chunks of about equal
        work, for :meth:`build_parallel`, and the total work (table entries).

        The redistribution planner's caches are per tensor rank (one
        :class:`~pipeline.costmodel.redistribute.records.TableContext` per mesh and
        ndim): the pairs planned for one table are reused by every other table of that
        rank. So the factors are grouped by the ranks of their member tensors (factors
        with a rank in common in one group: union-find) and whole groups go to the
        chunks, heaviest first; a factor's work is the size of its distinct member
        edge tables."""
        todo = [ge for ge in range(len(self.groups.edge_members)) if ge not in self._factors]
        cm = self.cost_model
        cls = cm.edge_classes() if cm.memoise else None
        parent: dict[int, int] = {}

        def root(k: int) -> int:
            parent.setdefault(k, k)
            while parent[k] != k:
                parent[k] = parent[parent[k]]
                k = parent[k]
            return k

        rank_of: dict[int, int] = {}  # factor -> one of its member tensors' ranks
        work: dict[int, float] = {}
        seen: set[int] = set()
        for ge in todo:
            for e, _ in self.groups.edge_members[ge]:
                u, element, v, a = cm.edges[e]
                ndim = len(cm.in_metas[v][a]["shape"])
                if ge in rank_of:
                    parent[root(ndim)] = root(rank_of[ge])
                else:
                    rank_of[ge] = ndim
                    root(ndim)
                key = int(cls[e]) if cls is not None else -1 - e
                if key not in seen:
                    seen.add(key)
                    work[ge] = work.get(ge, 0.0) + float(
                        len(cm.out_classes(u, element)[1]) * len(cm.in_classes(v, a)[1]))
        groups: dict[int, list[int]] = {}
        for ge in todo:
            groups.setdefault(root(rank_of.get(ge, -1)), []).append(ge)
        keys = sorted(groups, key=lambda r: groups[r][0])
        weight = [sum(work.get(ge, 0.0) for ge in groups[r]) + 1.0 for r in keys]
        chunks = balanced_chunks(weight, parts)
        return ([sorted(ge for c in chunk for ge in groups[keys[c]]) for chunk in chunks],
                float(sum(work.values())))

    def build_parallel(self, workers: int, min_work: float = 0.0) -> None:
        """Build every unbuilt group factor in ``workers`` processes (pipeline/core/parallel.py:
        forked children inherit this provider); the tables are those :meth:`factor`
        builds in this process (the same code on the same inputs). The counters add the
        children's work; ``factor_seconds`` grows by the wall time."""
        if workers <= 1:
            return
        chunks, work = self.work_chunks(workers)
        if len(chunks) <= 1 or work < min_work:
            return
        start = time.perf_counter()
        before = self.factor_seconds
        stats = self.cost_model.stats

        def build(chunk: list[int]) -> tuple[list[tuple[int, PairwiseFactor]], int, int]:
            tables, factors = stats.edge_tables, stats.group_factors
            built = [(ge, self.factor(ge)) for ge in chunk]
            return built, stats.edge_tables - tables, stats.group_factors - factors

        results = map_chunks(build, chunks)
        for built, tables, factors in results[1:]:  # the first chunk ran here
            for ge, f in built:
                self._factors[ge] = f
            stats.edge_tables += tables
            stats.group_factors += factors
        if self.cost_model.memoise and len(self._factors) == len(self.groups.edge_members):
            self._release()
        self.factor_seconds = before + time.perf_counter() - start
