"""The memory model of one topology, ready for the costs and solve stages.

:func:`memory_model` bundles the static facts (:mod:`.graph`), the linear terms
(:mod:`.terms`) and the options; the costs stage asks it for activation
checkpointing's recomputation masks and, with ``constraints.device_memory``, for the
row's coefficients, the solve stage for the liveness walk of the plan it found.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from pipeline.memory.graph import StepGraph, step_graph
from pipeline.memory.liveness import Liveness, walk
from pipeline.memory.options import MemoryOptions
from pipeline.memory.terms import LinearTerms, SlotBytes, linear_terms

__all__ = ["MemoryModel", "memory_model"]


@dataclass
class MemoryModel:
    """A topology's memory model under fixed options.

    Attributes:
        options: optimizer, checkpointing, FSDP resharding.
        graph, terms, sizes: the static facts, the linear terms, the byte sizes.
        group_of, domain: the node -> group map and the group domain sizes.
        limit, limit_text: ``constraints.device_memory`` in bytes and as written (None
            without a limit).
    """

    options: MemoryOptions
    graph: StepGraph
    terms: LinearTerms
    sizes: SlotBytes
    topology: Any
    group_of: np.ndarray
    domain: np.ndarray
    limit: float | None = None
    limit_text: str | None = None

    def coef(self) -> dict[int, np.ndarray]:
        """The device-memory row's coefficients per group (bytes per label)."""
        return self.terms.group_coef(self.group_of, self.domain)

    def recompute(self) -> tuple[np.ndarray, np.ndarray] | None:
        """Activation checkpointing's recomputed nodes and edges (for the cost model), or
        None when nothing is recomputed."""
        if self.options.checkpointing == "none":
            return None
        return self.graph.recomputed_nodes(), self.graph.recomputed_edges()

    def walk(self, strategy: np.ndarray) -> Liveness:
        """The liveness walk of a plan given per node."""
        return walk(self.topology, self.graph, self.options, strategy, self.sizes)

    def walk_labels(self, labels: np.ndarray) -> Liveness:
        """The liveness walk of a plan given per group."""
        return self.walk(np.asarray(labels, dtype=np.int64)[self.group_of])

    def peak_coef(self, live: Liveness) -> dict[int, np.ndarray]:
        """The memory live at a walk's peak as a row over the groups (bytes per label):
        each live allocation priced by the strategy of its node."""
        state = self.options.state_tensors * self.options.state_itemsize
        coef: dict[int, np.ndarray] = {}
        for source in live.peak_sources:
            g = int(self.group_of[source[1]])
            c = self.sizes.of_source(source, state)
            acc = coef.get(g)
            if acc is None:
                coef[g] = np.array(c, dtype=np.float64)
            else:
                acc += c
        return dict(sorted(coef.items()))


def memory_model(topology: Any, group_of: np.ndarray, domain: np.ndarray,
                 options: MemoryOptions, limit: float | None = None,
                 limit_text: str | None = None) -> MemoryModel:
    """Build the memory model of ``topology`` (module docstring)."""
    graph = step_graph(topology, options.checkpointing)
    sizes = SlotBytes(topology)
    terms = linear_terms(topology, graph, options, sizes)
    return MemoryModel(options, graph, terms, sizes, topology,
                       np.asarray(group_of, dtype=np.int64), np.asarray(domain), limit,
                       limit_text)
