"""The size of a placement problem, estimated from the topology before any factor is built.

A 4-d mesh multiplies the strategies of every node (``mesh=2,2,4,8`` on the toy model:
~500k group labels against ~71k at 2x4x8) and the edge tables grow with the product of
both ends' placement classes, so the costs stage could run out of memory long after it
started. :func:`estimate` reads the topology artifacts (``nodes.parquet``,
``strategies.parquet``, ``edges.parquet``: pipeline/core/artifacts.py) and counts

* ``labels``: the group labels, ``sum_g |D_g|`` (the MRF's label space);
* ``class_pairs``: ``sum_e R_e * C_e`` over graph edges ``e = (u, v)``, with ``R_e`` the
  producer's distinct output placements (its row classes) and ``C_e`` the consumer's
  distinct expected placements of that argument (its column classes): the entries of
  the edge tables the cost model computes (pipeline/costmodel/model.py), before memoisation;
* ``group_edges`` and ``message_labels``, ``sum_(g,h) |D_g| + |D_h|`` over group edges
  (TRW-S keeps two messages and two class maps per group edge);
* ``group_pairs``, ``sum_f R_f * C_f`` over the group factors ``f`` (joint classes of
  their member edges, :func:`group_class_pairs`): the entries of the tables the solver
  holds, and ``largest_table``, the largest ``R_e * C_e`` of one graph edge.

``bytes`` is :data:`BYTES_PER_GROUP_PAIR` per group-factor entry (the float64 table,
held once: the lazy factor provider and the solver's store share it, plus the
temporaries of building and sweeping it), :data:`BYTES_PER_LARGEST_PAIR` per entry of
the largest edge table (the redistribution planner's pair records and the cost
model's temporaries while it is computed, freed after), :data:`BYTES_PER_LABEL` per
label (unaries, labels' costs and bounds) and :data:`BYTES_PER_MESSAGE_LABEL` per
message label (two float64 messages and an int32 class map), plus :data:`BASE_BYTES`
for the process (torch, the trace, the topology). The edge tables themselves
(``class_pairs``) are not held: a memoised table leaves the cost model once the group
factors reading it are built (pipeline/costmodel/factors.py). Calibrated on this 2-core Intel Xeon
(24 GiB, shared with other jobs), lazy costs, TRW-S, ``python -m pipeline`` in one
process, peak RSS by ``/usr/bin/time -v``:

==========================================  ===========  ============  =========  =========
case                                        group pairs  largest edge  peak RSS   estimate
==========================================  ===========  ============  =========  =========
toy 2x4x8                                   11.9e6       0.28e6        0.70 GiB   0.71 GiB
toy 2x2x4x8 (pp,dp,cp,tp)                   452e6        13.6e6        7.97 GiB   8.52 GiB
examples TinyLM dim 16, 2x2x2x2             14.6e6       4.13e6        1.07 GiB   1.10 GiB
one nn.Linear 16 -> 32, 2x2x2x2             0.83e6       0.16e6        0.58 GiB   0.53 GiB
==========================================  ===========  ============  =========  =========

(Before the tables were held once, toy 2x4x8 peaked at 1.25 GiB and 2x2x4x8 was
killed by the kernel at 20.9 GB.) Lazy costs share the tables of repeated layers, so
deep models stay below the estimate. :func:`check_fits` refuses a problem whose
estimate exceeds ``solver.max_memory`` (default: :data:`DEFAULT_FRACTION` of this
machine's physical memory) in one line.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.core import runtime
from pipeline.core.artifacts import EDGES, NODES, STRATEGIES
from pipeline.core.errors import PlanError

BYTES_PER_GROUP_PAIR = 16
BYTES_PER_LARGEST_PAIR = 96
BYTES_PER_LABEL = 64
BYTES_PER_MESSAGE_LABEL = 24
BASE_BYTES = 512 << 20
#: ``solver.max_memory: null``: this fraction of the machine's physical memory.
DEFAULT_FRACTION = 0.8


@dataclass(frozen=True)
class ProblemSize:
    """Counts of :func:`estimate` and the bytes they imply (module docstring)."""

    labels: int
    class_pairs: int
    group_edges: int
    message_labels: int
    group_pairs: int = 0
    largest_table: int = 0

    @property
    def bytes(self) -> int:
        return (BASE_BYTES + BYTES_PER_GROUP_PAIR * self.group_pairs
                + BYTES_PER_LARGEST_PAIR * self.largest_table
                + BYTES_PER_LABEL * self.labels
                + BYTES_PER_MESSAGE_LABEL * self.message_labels)


def _distinct_counts(slist: Any, arg: Any, values: Any) -> dict[tuple[int, int], int]:
    """``{(strategy list, argument): number of distinct values}`` over parallel columns."""
    import pyarrow as pa

    t = pa.table({"s": pa.array(slist), "a": pa.array(arg), "v": values})
    agg = t.group_by(["s", "a"]).aggregate([("v", "count_distinct")])
    return {(int(s), int(a)): int(n) for s, a, n in zip(
        agg["s"].to_pylist(), agg["a"].to_pylist(), agg["v_count_distinct"].to_pylist())}


def estimate(topology_dir: Path | str) -> ProblemSize:
    """:class:`ProblemSize` of the topology in ``topology_dir`` (module docstring)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    directory = Path(topology_dir)
    nodes = runtime.read_parquet(NODES.path(directory),
                          columns=["id", "slist", "group", "num_strategies"]).to_pydict()
    strategies = runtime.read_parquet(STRATEGIES.path(directory), columns=["slist", "output",
                                                                    "inputs"])
    edges = runtime.read_parquet(EDGES.path(directory)).to_pydict()

    # Row classes per (strategy list, output element); a tuple output is "(A|B|-)".
    outputs = strategies["output"].to_pylist()
    slists = strategies["slist"].to_pylist()
    tuple_rows = [i for i, o in enumerate(outputs) if o.startswith("(")]
    rows = _distinct_counts(slists, [0] * len(slists), strategies["output"])
    elems: dict[tuple[int, int], set[str]] = {}
    for i in tuple_rows:
        for k, part in enumerate(outputs[i][1:-1].split("|")):
            elems.setdefault((slists[i], k), set()).add(part)
    rows.update({key: len(v) for key, v in elems.items()})

    # Column classes per (strategy list, argument).
    inputs = strategies["inputs"].combine_chunks() if isinstance(
        strategies["inputs"], pa.ChunkedArray) else strategies["inputs"]
    flat = pc.list_flatten(inputs)
    parent = np.asarray(pc.list_parent_indices(inputs))
    offsets = np.asarray(inputs.offsets)[:-1]
    position = np.arange(len(parent)) - offsets[parent] if len(parent) else parent
    slist_of = np.asarray(slists)[parent] if len(parent) else parent
    cols = _distinct_counts(slist_of, position, flat)

    slist = dict(zip(nodes["id"], nodes["slist"]))
    group = dict(zip(nodes["id"], nodes["group"]))
    domain = {}
    for g, k in zip(nodes["group"], nodes["num_strategies"]):
        domain.setdefault(g, int(k))
    pairs, largest, group_edges = 0, 0, set()
    for u, el, v, a in zip(edges["producer"], edges["element"], edges["consumer"],
                           edges["arg"]):
        r = rows.get((slist[u], max(int(el), 0)), 1)  # element -1: not a tuple output
        c = cols.get((slist[v], int(a)), 1)
        pairs += r * c
        largest = max(largest, r * c)
        if group[u] != group[v]:
            group_edges.add((min(group[u], group[v]), max(group[u], group[v])))
    message = sum(domain[g] + domain[h] for g, h in group_edges)
    return ProblemSize(labels=sum(domain.values()), class_pairs=int(pairs),
                       group_edges=len(group_edges), message_labels=int(message),
                       group_pairs=group_class_pairs(directory), largest_table=int(largest))


def group_class_pairs(topology_dir: Path | str) -> int:
    """``sum_f R_f * C_f`` over the group factors ``f``: the entries of the pairwise
    tables the solver holds (pipeline/costmodel/factors.py :class:`FactorProvider`), with ``R_f``
    (``C_f``) the joint row (column) classes of the factor's member edges, the distinct
    rows of their stacked class vectors. Counted from the class vectors alone (no cost
    is computed); member edges with the same strategy lists, output element and
    argument have equal class vectors and are stacked once."""
    import numpy as np

    from pipeline.costmodel.factors import group_structure
    from pipeline.memory.terms import element_text
    from pipeline.stages.topology import read_topology

    topology = read_topology(Path(topology_dir))
    ndim = len(topology.summary["mesh"])
    slist = topology.nodes["slist"]
    e = topology.edges
    groups = group_structure(topology)
    memo: dict[tuple, np.ndarray] = {}

    def classes(kind: str, s: int, k: int) -> np.ndarray:
        hit = memo.get((kind, s, k))
        if hit is None:
            if kind == "out":
                texts = topology.slist_outputs[s]
                if k >= 0:
                    texts = [element_text(t, k, ndim) for t in texts]
            else:
                texts = [ins[k] for ins in topology.slist_inputs[s]]
            hit = memo[(kind, s, k)] = np.unique(texts, return_inverse=True)[1].reshape(-1)
        return hit

    total = 0
    for members in groups.edge_members:
        seen: set[tuple] = set()
        rows, cols = [], []
        for k, flipped in members:
            u, el, v, a = (int(e["producer"][k]), int(e["element"][k]),
                           int(e["consumer"][k]), int(e["arg"][k]))
            key = (slist[u], el, slist[v], a, flipped)
            if key in seen:
                continue
            seen.add(key)
            r, c = classes("out", slist[u], el), classes("in", slist[v], a)
            if flipped:
                r, c = c, r
            rows.append(r)
            cols.append(c)
        n_rows = len(np.unique(np.stack(rows, axis=1), axis=0))
        n_cols = len(np.unique(np.stack(cols, axis=1), axis=0))
        total += n_rows * n_cols
    return int(total)


def physical_memory() -> int | None:
    """Bytes of physical memory of this machine (``None`` where sysconf cannot tell)."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return None


def memory_limit(value: Any) -> tuple[int | None, str]:
    """``(bytes, how it is shown)`` of ``solver.max_memory``: a size, or ``null`` for
    :data:`DEFAULT_FRACTION` of the physical memory (``(None, ...)`` if unknown)."""
    from pipeline.memory.options import format_bytes, parse_bytes

    if value is None:
        phys = physical_memory()
        if phys is None:
            return None, "null"
        limit = int(DEFAULT_FRACTION * phys)
        return limit, (f"null ({format_bytes(limit)}, {DEFAULT_FRACTION:.0%} of this "
                       "machine's memory)")
    limit = parse_bytes(value, "solver.max_memory")
    return limit, f"{value}"


def check_fits(size: ProblemSize, max_memory: Any, mesh: str) -> None:
    """Refuse, in one line, a problem whose estimate exceeds ``solver.max_memory``.

    Raises:
        PlanError: ``solver.max_memory=...: mesh 2x2x4x8 is estimated at ...``.
    """
    from pipeline.memory.options import format_bytes

    limit, shown = memory_limit(max_memory)
    if limit is None or size.bytes <= limit:
        return
    raise PlanError(
        f"solver.max_memory={shown}: mesh {mesh} is estimated at {format_bytes(size.bytes)} "
        f"({size.labels:,} group labels, {size.group_pairs:,} class pairs in "
        f"{size.group_edges:,} group factors), more than allowed; allowed a problem within "
        "the limit: a larger solver.max_memory, a smaller mesh, or fewer candidate "
        "placements (constraints.inputs / constraints.nodes pins)")
