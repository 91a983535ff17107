"""The per-layer profile of a solved plan: what a pipeline stage built from some of the
model's layers costs per microbatch (docs/pipelining.md, "Pipelined runs").

The run record's ``layer_profile`` (not flattened into ``runs.parquet``). The plan's
nodes fall into *segments*: each repeated layer (the ``layer`` column of
``nodes.parquet``), ``first`` (what precedes the layers in the forward: the embedding,
and its backward) and ``last`` (the final norm, head and loss, and their backward).
A node outside every layer is placed by graph order: a forward node before the first
layer node is ``first``, after the last ``last``; a backward node before the first
backward layer node is ``last`` (the loss and head backward run first), after it
``first``. A graph input or weight-derived node (a parameter, its cast) takes the segment
of its first consumer, an output sink (a gradient) its producer's.

Per segment and phase (``fwd``, ``bwd``), with the plan's own numbers
(:class:`pipeline.costmodel.steptime.StepInputs`: each node's compute and each
redistribution's time, the same as the step-time simulation's):

* ``fwd_us`` / ``bwd_us``: the compute of the segment's nodes plus the activation
  redistributions they wait for (edges of kind ``activation``, by consumer): the time the
  segment holds the compute stream per microbatch when the FSDP collectives are hidden;
* ``gather_us``: the weight edges (FSDP all-gathers) read by the segment, by consumer;
* ``reduce_us``: the gradient edges (reduce-scatters, all-reduces) by producer;
* ``bytes``: the linear memory terms of its nodes by kind
  (:data:`pipeline.memory.terms.KINDS`);
* ``gathered_bytes``: what its FSDP all-gathers produce: for each tensor whose weight
  edges redistribute (a parameter or its cast), the largest consumer input it is
  gathered to, local bytes under the consumer's placement (:func:`edge_input_bytes`),
  in the segment of its first such consumer. It is what FSDP2 holds unsharded for the
  segment (the gathered parameters; the accumulated gradient has their shape).

``transient_bytes`` per segment (with the liveness walk's bytes live per node): the most
the live bytes rise within one contiguous run of the segment's nodes in graph order
(a layer's forward, its backward with the recomputation of activation checkpointing,
the head and the loss with their logits), ``max live - live at the run's first node``:
what the segment's ops hold on top of what was live when it started. Without the walk,
every segment gets the plan's ``peak_minus_linear_bytes`` (the top-level
``transient_bytes``, at least 0).
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from pipeline.costmodel.steptime import StepInputs, classify

__all__ = ["SEGMENT_FIELDS", "edge_input_bytes", "layer_profile", "plan_profile", "segments"]

#: Per-segment fields (microseconds; ``bytes`` is a dict by kind).
SEGMENT_FIELDS = ("fwd_us", "bwd_us", "gather_us", "reduce_us")


def _layer_key(name: str) -> tuple[int, str]:
    m = re.search(r"(\d+)$", name)
    return (int(m.group(1)) if m else -1, name)


def segments(g: StepInputs) -> list[str]:
    """Each node's segment (module docstring)."""
    n = len(g.names)
    ins: list[list[int]] = [[] for _ in range(n)]
    outs: list[list[int]] = [[] for _ in range(n)]
    for u, v in g.edges:
        ins[v].append(u)
        outs[u].append(v)
    placed = [not (g.placeholder[i] or g.weight_derived[i] or g.sink[i]) for i in range(n)]
    first_layer = {ph: next((i for i in range(n)
                             if placed[i] and g.phase[i] == ph and g.layer[i]), n)
                   for ph in ("fwd", "bwd")}
    seg: list[str | None] = [None] * n
    for i in range(n):
        if g.layer[i]:
            seg[i] = g.layer[i]
        elif placed[i]:
            before = i < first_layer.get(g.phase[i], n)
            seg[i] = ("first" if before else "last") if g.phase[i] == "fwd" else (
                "last" if before else "first")
    for i in range(n):  # sinks: their producer's
        if seg[i] is None and g.sink[i] and ins[i]:
            seg[i] = seg[ins[i][0]]
    for i in range(n - 1, -1, -1):  # inputs and weight-derived nodes: their first consumer's
        if seg[i] is None:
            known = [v for v in sorted(outs[i]) if seg[v] is not None]
            seg[i] = seg[known[0]] if known else "first"
    return [str(s) for s in seg]


def edge_input_bytes(topology: Any, cost_model: Any, strategy: np.ndarray,
                     sizes: Any) -> list[float]:
    """Per edge of ``cost_model.edges``, the local bytes of the consumer's input under
    its chosen input placement (``sizes``: :class:`pipeline.memory.terms.SlotBytes`)."""
    slist = topology.nodes["slist"]
    out = []
    for _, _, v, a in cost_model.edges:
        meta = cost_model.in_metas[v][a]
        text = topology.slist_inputs[slist[v]][int(strategy[v])][a]
        out.append(float(sizes.bytes_of(list(meta["shape"]), str(meta["dtype"]), text)))
    return out


def _rises(g: StepInputs, seg: list[str], live: Any) -> dict[str, float]:
    """Per segment, the largest rise of the live bytes within one of its runs."""
    out: dict[str, float] = {}
    run, base, top = None, 0.0, 0.0
    for i in range(len(g.names)):
        if g.placeholder[i] or g.sink[i]:
            continue
        key = (seg[i], g.phase[i])
        if key != run:
            if run is not None:
                out[run[0]] = max(out.get(run[0], 0.0), top - base)
            run, base, top = key, float(live[i]), float(live[i])
        top = max(top, float(live[i]))
    if run is not None:
        out[run[0]] = max(out.get(run[0], 0.0), top - base)
    return out


def layer_profile(g: StepInputs, terms: Any, strategy: np.ndarray,
                  transient_bytes: float, edge_bytes: list[float] | None = None,
                  live_bytes: Any = None) -> dict[str, Any]:
    """The ``layer_profile`` entry (module docstring).

    Args:
        g: the plan's simulator inputs (:func:`pipeline.costmodel.steptime.plan_step_inputs`).
        terms: the memory model's :class:`pipeline.memory.terms.LinearTerms` (None: no
            memory model, every ``bytes`` empty).
        strategy: the plan, per node.
        transient_bytes: ``peak_minus_linear_bytes`` of the plan's memory record.
        edge_bytes: :func:`edge_input_bytes` (None: no ``gathered_bytes``).
        live_bytes: per node, the bytes live while it runs (None: every segment's
            transient is ``transient_bytes``).
    """
    seg = segments(g)
    edge_kind = classify(g).edge_kind
    names = sorted({s for s in seg if s not in ("first", "last")}, key=_layer_key)
    keys = ["first", *names, "last"]
    out: dict[str, dict[str, Any]] = {
        k: {**{f: 0.0 for f in SEGMENT_FIELDS}, "bytes": {}, "gathered_bytes": 0.0,
            "transient_bytes": max(0.0, float(transient_bytes))} for k in keys}
    if live_bytes is not None:
        for k, rise in _rises(g, seg, live_bytes).items():
            out[k]["transient_bytes"] = rise
    gathered: dict[int, tuple[str, float]] = {}  # producer -> (segment, bytes)
    for i, us in enumerate(g.compute_us):
        out[seg[i]]["fwd_us" if g.phase[i] == "fwd" else "bwd_us"] += float(us)
    for e, (u, v) in enumerate(g.edges):
        us = float(sum(t for _, t in g.steps[e]))
        if us == 0.0:
            continue
        kind = edge_kind[e]
        if kind == "activation":
            out[seg[v]]["fwd_us" if g.phase[v] == "fwd" else "bwd_us"] += us
        elif kind == "weight":
            out[seg[v]]["gather_us"] += us
            if edge_bytes is not None:
                where, most = gathered.get(u, (seg[v], 0.0))
                gathered[u] = (where, max(most, float(edge_bytes[e])))
        else:
            out[seg[u]]["reduce_us"] += us
    for where, nbytes in gathered.values():
        out[where]["gathered_bytes"] += nbytes
    if terms is not None:
        for kind, rows in terms.terms.items():
            for v, c in rows:
                b = out[seg[v]]["bytes"]
                b[kind] = b.get(kind, 0.0) + float(c[int(strategy[v])])
    return {"layers": names, "first": out["first"], "last": out["last"],
            "per_layer": {f: [out[k][f] for k in names] for f in SEGMENT_FIELDS}
            | {"bytes": [out[k]["bytes"] for k in names],
               "gathered_bytes": [out[k]["gathered_bytes"] for k in names],
               "transient_bytes": [out[k]["transient_bytes"] for k in names]},
            "transient_bytes": max(0.0, float(transient_bytes))}


def plan_profile(g: StepInputs, topology: Any, cost_model: Any, memory: Any,
                 strategy: np.ndarray, memory_record: dict[str, Any] | None,
                 memory_cols: dict[str, Any]) -> dict[str, Any]:
    """:func:`layer_profile` of a solved plan, from what the solve stage has: the memory
    model (``memory``: :class:`pipeline.memory.model.MemoryModel` or None), its record
    and its per-node columns (``live_bytes``)."""
    if memory is None:
        return layer_profile(g, None, strategy, 0.0)
    return layer_profile(g, memory.terms, strategy,
                         (memory_record or {}).get("peak_minus_linear_bytes", 0.0),
                         edge_input_bytes(topology, cost_model, strategy, memory.sizes),
                         memory_cols.get("live_bytes"))
