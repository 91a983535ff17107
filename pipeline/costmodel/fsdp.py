"""FSDP2's collective semantics on the edges of the joint graph: parameter units and
their buckets, the backward re-gather, the flattened groups, and the gradient reduce
dtype.

The redistribution of an edge is costed by :mod:`pipeline.costmodel.redistribute` as
DTensor would run it, one collective per tensor. FSDP2 (``torch.distributed.fsdp.
fully_shard``; PyTorch docs "FSDP2", and torchtitan's ``apply_fsdp``) changes four
things for the tensors it manages, the parameters and their gradients:

1. **Buckets.** ``fully_shard(module)`` makes one *FSDP unit* (a parameter group): the
   forward all-gathers all of its parameters in **one** collective (``foreach_all_gather``
   over a flat buffer) and the backward reduce-scatters all of their gradients in one
   collective. Units here: every repeated layer (``layers.N``, the node's ``layer``),
   and every other top-level module of the parameter names (``tok_embeddings``,
   ``norm``, ``output``), as torchtitan wraps them. A bucket is (unit, collective kind,
   mesh dim); its latency is paid once, its bandwidth term is the sum of its members'
   bytes (the alpha-beta model of :mod:`pipeline.costmodel.comm` is affine in the bytes,
   so a bucket of ``n`` member collectives of sizes ``S_i`` costs
   ``lat + sum_i f (n-1)/n S_i / bw``).

   Inside the MRF this is exact for the plans FSDP runs: every *weight edge* (an edge
   out of a parameter or out of a forward op computed from parameters only: the
   compute-dtype cast, its transpose) and every *gradient edge* (an edge carrying an
   output of a backward op that flows only into parameter gradients) of unit ``U`` pays
   its collectives at latency ``lat / n_U``, ``n_U`` the number of parameters of ``U``.
   When the ``n_U`` members all issue the collective (FSDP's all-gather and
   reduce-scatter of a unit; Megatron TP's weights, which issue none) the bucket pays
   exactly ``lat``; a plan where only ``k < n_U`` members issue it is charged
   ``k / n_U`` of one latency. The factor is a per-edge constant, so the unary and
   pairwise factors stay what the solvers see and report (no post-hoc correction).
   ``fsdp.bucket_collectives=false`` gives every collective its own latency.

2. **Re-gather** (``reshard_after_forward=True``, FSDP2's default): the unsharded
   parameter is freed after the unit's forward and all-gathered again before its
   backward, so the redistribution on every edge of the forward weight copy the
   backward reads (:meth:`pipeline.memory.graph.StepGraph.regather_edges`) is paid twice. A
   weight edge recomputed by activation checkpointing is still paid twice, not three
   times (the recomputation reads the re-gathered copy).

3. **Flattened groups** (``costs.flatten_mesh``, default true): ``fully_shard`` takes a
   1-D mesh, so a parameter sharded (or, HSDP/DDP, replicated) over several mesh dims
   runs on their flattened sub-mesh: its all-gather over dims ``(dp, tp)`` of an
   ``8 x 8`` mesh is one 64-rank collective on every rail of a node, as on a flat
   64-rank mesh. :mod:`pipeline.costmodel.redistribute.flatten` prices every edge that
   way (``EdgePolicy.flatten``), the tensors FSDP2 manages and the activations a
   torchtitan-style step places over a flattened mesh alike.

4. **Reduce dtype** (``MixedPrecisionPolicy(reduce_dtype=float32)``): FSDP2 casts the
   unsharded gradient to ``reduce_dtype`` *before* its reduce-scatter. A gradient edge
   whose tensor is narrower than ``model.reduce_dtype`` (the bf16 gradient before the
   traced cast to fp32) pays its reduce-scatters and all-reduces at the reduce dtype's
   bytes (:func:`pipeline.costmodel.redistribute.steps.step_itemsize`), so reducing
   before or after the cast costs the fp32 bytes, as in FSDP2.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["CollectiveOptions", "EdgePolicy", "collective_options_of_config", "edge_policy",
           "param_units"]

_ITEMSIZE = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class CollectiveOptions:
    """FSDP2 behaviour the cost model follows.

    Attributes:
        reshard_after_forward: ``fsdp.reshard_after_forward`` (re-gather for backward).
        bucket: ``fsdp.bucket_collectives`` (one latency per unit, kind and mesh dim).
        reduce_dtype: ``model.reduce_dtype`` (gradients reduced in it), or None.
        flatten: ``costs.flatten_mesh`` (a collective over several mesh dims runs on
            their flattened group).
    """

    reshard_after_forward: bool = True
    bucket: bool = True
    reduce_dtype: str | None = "float32"
    flatten: bool = True


@dataclass
class EdgePolicy:
    """Per graph edge: what FSDP2 changes in its redistribution's cost.

    Attributes:
        regather: bool ``[E]``, paid a second time before the backward.
        reduce_itemsize: int64 ``[E]``, bytes per element of its reductions (0: the
            tensor's own).
        latency_scale: float64 ``[E]``, factor on its collectives' latency.
        unit: per edge, the FSDP unit of a weight or gradient edge (None otherwise).
        kind: per edge, ``"weight"``, ``"gradient"`` or None.
        flatten: bool ``[E]``, a collective over several mesh dims runs on their
            flattened group (:mod:`pipeline.costmodel.redistribute.flatten`).
    """

    regather: np.ndarray
    reduce_itemsize: np.ndarray
    latency_scale: np.ndarray
    unit: list[str | None]
    kind: list[str | None]
    flatten: np.ndarray

    def of(self, e: int) -> tuple[int, float, bool]:
        """``(reduce_itemsize, latency_scale, flatten)`` of edge ``e``."""
        return (int(self.reduce_itemsize[e]), float(self.latency_scale[e]),
                bool(self.flatten[e]))


def collective_options_of_config(cfg: Any) -> CollectiveOptions:
    """:class:`CollectiveOptions` of a resolved run config (``fsdp.*``,
    ``model.reduce_dtype``; missing keys take the defaults)."""
    fsdp = cfg.get("fsdp", None) if hasattr(cfg, "get") else None
    model = cfg.get("model", None) if hasattr(cfg, "get") else None

    def get(node: Any, key: str, default: Any) -> Any:
        if node is None:
            return default
        value = node.get(key, default) if hasattr(node, "get") else getattr(node, key, default)
        return default if value is None else value

    return CollectiveOptions(
        reshard_after_forward=bool(get(fsdp, "reshard_after_forward", True)),
        bucket=bool(get(fsdp, "bucket_collectives", True)),
        flatten=bool(get(cfg.get("costs", None) if hasattr(cfg, "get") else None,
                         "flatten_mesh", True)),
        reduce_dtype=get(model, "reduce_dtype", None))


def _unit_of_param(layer: Any, fqn: Any) -> str | None:
    if isinstance(layer, str) and layer:
        return layer
    if isinstance(fqn, str) and fqn:
        return fqn.split(".")[0]
    return None


def param_units(topology: Any) -> dict[int, str]:
    """Node id of every parameter placeholder -> its FSDP unit (module docstring)."""
    n = topology.nodes
    out: dict[int, str] = {}
    for v, (role, target, layer, fqn) in enumerate(
            zip(n["role"], n["target"], n["layer"], n["fqn"], strict=True)):
        if role == "param" and target == "placeholder":
            unit = _unit_of_param(layer, fqn)
            if unit is not None:
                out[v] = unit
    return out


def _gradient_units(graph: Any, sink_unit: dict[int, str]) -> list[set[str] | None]:
    """Per node: the units of the parameter gradients a backward op feeds, when every
    path out of it ends in a parameter-gradient sink (None otherwise)."""
    consumers: list[list[int]] = [[] for _ in range(graph.num_nodes)]
    for u, _, v, _ in graph.edges:
        consumers[u].append(v)
    out: list[set[str] | None] = [None] * graph.num_nodes
    for v in range(graph.num_nodes - 1, -1, -1):  # graph order: consumers come later
        if v in sink_unit:
            out[v] = {sink_unit[v]}
            continue
        if graph.phase[v] != "bwd" or graph.target[v] in ("placeholder", "output") \
                or not consumers[v]:
            continue
        units: set[str] = set()
        for c in consumers[v]:
            if out[c] is None:
                units = set()
                break
            units |= out[c]
        out[v] = units or None
    return out


def edge_policy(topology: Any, graph: Any, options: CollectiveOptions,
                in_metas: list) -> EdgePolicy:
    """The :class:`EdgePolicy` of a topology under ``options`` (module docstring).

    ``graph``: its :class:`~pipeline.memory.graph.StepGraph`; ``in_metas``: per node, the
    decoded ``in_metas`` of nodes.parquet (the cost model's)."""
    n = topology.nodes
    num_edges = len(graph.edges)
    units = param_units(topology)
    members: dict[str, int] = {}
    for unit in units.values():
        members[unit] = members.get(unit, 0) + 1
    # gradient sinks -> the unit of their parameter (sinks carry the parameter's fqn)
    sink_unit: dict[int, str] = {}
    for v in range(graph.num_nodes):
        if graph.is_sink[v] and n["role"][v] == "grad":
            unit = _unit_of_param(n["layer"][v], n["fqn"][v])
            if unit is not None:
                sink_unit[v] = unit
    grad_units = _gradient_units(graph, sink_unit)

    # a gradient tensor is an output (u, element) of a backward op all of whose readers
    # feed only parameter gradients (per element: a multi-output backward such as the
    # fused RMSNorm backward returns the weight gradient beside the input gradient)
    readers: dict[tuple[int, int], list[int]] = {}
    for u, element, v, _ in graph.edges:
        readers.setdefault((u, element), []).append(v)
    slot_units: dict[tuple[int, int], set[str] | None] = {}
    for (u, element), vs in readers.items():
        if graph.phase[u] != "bwd" or graph.target[u] in ("placeholder", "output"):
            slot_units[(u, element)] = None
            continue
        acc: set[str] = set()
        for v in vs:
            if grad_units[v] is None:
                acc = set()
                break
            acc |= grad_units[v]
        slot_units[(u, element)] = acc or None

    unit_of: list[str | None] = [None] * num_edges
    kind: list[str | None] = [None] * num_edges
    weight_units: dict[int, set[str]] = {}
    for e, (u, element, _v, _) in enumerate(graph.edges):
        if u in units:
            unit_of[e], kind[e] = units[u], "weight"
        elif graph.weight_derived[u]:
            wu = weight_units.get(u)
            if wu is None:
                wu = weight_units[u] = {units[p] for p in graph.weight_source(u) if p in units}
            if len(wu) == 1:
                unit_of[e], kind[e] = next(iter(wu)), "weight"
        elif slot_units[(u, element)] is not None and len(slot_units[(u, element)]) == 1:
            unit_of[e], kind[e] = next(iter(slot_units[(u, element)])), "gradient"

    scale = np.ones(num_edges, dtype=np.float64)
    if options.bucket:
        for e, unit in enumerate(unit_of):
            if unit is not None and members.get(unit, 0) > 1:
                scale[e] = 1.0 / members[unit]
    reduce = np.zeros(num_edges, dtype=np.int64)
    want = _ITEMSIZE.get(str(options.reduce_dtype), 0) if options.reduce_dtype else 0
    if want:
        for e, (_u, _, v, a) in enumerate(graph.edges):
            if kind[e] == "gradient":
                metas = in_metas[v]
                meta = metas[a] if metas is not None and a < len(metas) else None
                have = _ITEMSIZE.get(str(meta.get("dtype")), 0) if meta else 0
                if have and have < want:
                    reduce[e] = want
    regather = graph.regather_edges() if options.reshard_after_forward \
        else np.zeros(num_edges, dtype=bool)
    flatten = np.full(num_edges, bool(options.flatten))
    return EdgePolicy(np.asarray(regather, dtype=bool), reduce, scale, unit_of, kind, flatten)

