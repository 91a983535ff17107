"""``constraints.model_parallel``: where a plan may issue activation collectives.

``intra_node``: activation collectives only on mesh dims whose groups stay inside one
node (the NVLink domain), the rule of thumb of Megatron-LM (Narayanan et al. 2021,
"Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM",
sec. 3.3 / takeaway #1: tensor model parallelism up to the GPUs of a node, data and
pipeline parallelism across nodes). A mesh dim crosses nodes when its groups span more
than one node (:func:`pipeline.costmodel.comm.mesh_dim_link`: ranks row-major, packed
``hardware.gpus_per_node`` per node).

Which edges carry an *activation* (the classes of pipeline/costmodel/steptime.py): every
edge but the *weight* edges (out of a parameter or a forward op computed from parameters
only: FSDP's all-gathers), the *gradient* edges (from a backward op whose values feed
only parameter gradients, into another such op or a gradient sink: FSDP's
reduce-scatters and all-reduces), the edge into the loss sink and every edge of a 0-d
tensor (the loss and the count of its tokens: the all-reduce of a scalar that any
data-parallel plan runs). On an activation edge, a pair of placements whose redistribution runs a
collective on a cross-node mesh dim is ``+inf`` in the edge table: the placement changes
on that mesh dim from anything but Replicate (``Replicate -> Shard`` and ``Replicate ->
Partial`` are local; DTensor redistributes mesh dim by mesh dim, so an unchanged mesh
dim runs nothing). A strategy that runs a collective inside its op (a vocabulary-
parallel softmax's all-reduces, pipeline/costmodel/op_comm.py) on a cross-node mesh dim
is ``+inf`` in its unary.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pipeline.costmodel.comm import mesh_dim_link

__all__ = ["MODEL_PARALLEL", "activation_edges", "blocked_pairs", "cross_node_dims",
           "op_comm_blocked"]

#: The values of ``constraints.model_parallel`` (None: no restriction).
MODEL_PARALLEL: tuple[str, ...] = ("intra_node",)


def cross_node_dims(mesh_shape: tuple[int, ...], gpus_per_node: int) -> frozenset[int]:
    """The mesh dims whose groups span more than one node."""
    return frozenset(d for d in range(len(mesh_shape))
                     if mesh_shape[d] > 1
                     and mesh_dim_link(mesh_shape, d, gpus_per_node) == "inter")


def activation_edges(graph: Any, in_metas: list) -> np.ndarray:
    """Per graph edge, whether it carries an activation (module docstring). ``graph``:
    the :class:`pipeline.memory.graph.StepGraph` of the topology; ``in_metas``: per node,
    its tensor arguments' metadata (``shape``)."""
    n = graph.num_nodes
    outs: list[list[int]] = [[] for _ in range(n)]
    for u, _, v, _ in graph.edges:
        outs[u].append(v)
    param = [graph.role[v] == "param" and graph.target[v] == "placeholder" for v in range(n)]
    grad_sink = [graph.is_sink[v] and graph.role[v] == "grad" for v in range(n)]
    grad_only = [False] * n
    for v in range(n - 1, -1, -1):
        if graph.target[v] == "placeholder" or graph.is_sink[v] or graph.phase[v] != "bwd" \
                or not outs[v]:
            continue
        grad_only[v] = all(grad_sink[c] or grad_only[c] for c in outs[v])
    out = np.ones(len(graph.edges), dtype=bool)
    for e, (u, _, v, a) in enumerate(graph.edges):
        meta = in_metas[v][a] if a < len(in_metas[v]) else None
        if param[u] or graph.weight_derived[u] or graph.is_sink[v] \
                or not (meta or {}).get("shape") \
                or (grad_only[u] and (grad_only[v] or grad_sink[v])):
            out[e] = False
    return out


def blocked_pairs(srcs: list, dsts: list, dims: frozenset[int]) -> np.ndarray:
    """bool ``[len(srcs), len(dsts)]``: the placement pairs whose redistribution runs a
    collective on one of ``dims`` (module docstring). ``srcs`` / ``dsts``: placement
    tuples (one per mesh dim), or None for a non-tensor."""
    out = np.zeros((len(srcs), len(dsts)), dtype=bool)
    for i, s in enumerate(srcs):
        for j, t in enumerate(dsts):
            if s is None or t is None:
                continue
            out[i, j] = any(s[d] != t[d] and not s[d].is_replicate() for d in dims)
    return out


def op_comm_blocked(collectives: list[tuple[str, int, int]], dims: frozenset[int]) -> bool:
    """Whether an op's own collectives (``(kind, bytes, mesh dim)``) use one of ``dims``."""
    return any(m in dims for _, _, m in collectives)
