"""Overlap-aware step time of a plan: one compute stream, one communication stream per
mesh dim, simulated in graph order.

The solvers minimise the additive objective ``E(x) = sum compute + sum comm +
transitions`` (pipeline/costmodel/model.py). A real step overlaps part of the communication with
compute; this module estimates by how much, for each candidate plan of the step-time
search (pipeline/stages/solve/objective.py), with the same
node and edge times the objective used (:func:`pipeline.costmodel.breakdown.plan_breakdown`:
each node's ``compute_us``, each redistribution's ``comm_us``; the per-mesh-dim steps
of a redistribution from :func:`pipeline.costmodel.redistribute.redistribute_steps`,
scaled so that they add up to the edge's ``comm_us``). No cost formula is recomputed.

Resources. One compute stream runs every kernel (a node with ``compute_us > 0``) one
at a time. Each mesh dim ``d`` has one communication stream; every step of a
redistribution runs on the stream of its mesh dim (a collective over a flattened group
of several mesh dims, pipeline/costmodel/redistribute/flatten.py, on the stream of the
first of them), in issue order (FIFO, like NCCL
kernels on one communicator's stream), the steps of one redistribution in plan order
(step k+1 is issued when step k ends). A node of zero compute (a view) launches no
kernel: it completes when its inputs arrive.

Edges, by what the tensor is:

* **weight** edges leave a parameter or a *weight-derived* node (a forward op computed
  from parameters only: the compute-dtype cast, a transpose, a gathered weight;
  :attr:`pipeline.memory.graph.StepGraph.weight_derived`). They are FSDP all-gathers
  and are **prefetched one FSDP unit ahead**: a weight edge of unit ``k`` is issued as
  soon as the compute stream reaches unit ``k-1`` (every kernel before it done) and its
  producer is done. This is
  FSDP2's default: implicit forward prefetching (the all-gathers run on their own
  stream, so "layer 1 all-gather can overlap with layer 0 forward compute ... The 1st
  all-gather will not be able to overlap with anything", PyTorch FSDP notes, "FSDP
  Prefetch Nuances", https://docs.pytorch.org/docs/stable/notes/fsdp.html) and explicit
  backward prefetching of one module in reverse post-forward order (pytorch/pytorch
  #128884, ``set_modules_to_backward_prefetch``); torchtitan wraps each transformer
  block, the embedding and norm + output as FSDP units
  (``torchtitan/models/llama3/infra/parallelize.py``, ``apply_fsdp``). The weight
  nodes before the first collective of a weight (the cast FSDP2 does in its all-gather
  copy-in) run on the compute stream as soon as they are released, ahead of the graph
  order; weight nodes after a collective run where the graph uses them.
* **gradient** edges carry a gradient contribution (their producer and consumer feed
  only parameter gradients): reduce-scatters / all-reduces of gradients, issued when the
  producer is done and **overlapped with the rest of the backward**; the kernels after
  them (casts of the reduced gradient, FSDP2's post-reduce copy) run when it arrives,
  ahead of the graph order, never holding the compute stream back.
* **activation** edges, everything else, are on the critical path: issued when the
  compute stream reaches the consumer (every earlier kernel of graph order done) and
  the consumer waits for them (DTensor redistributes when the op is dispatched).

FSDP units are the segments of graph order with one ``(phase, layer)``: each repeated
layer (the ``layer`` of ``nodes.parquet``, from the module paths of the repeated
blocks) is one unit per phase, and a run of nodes outside every layer (embedding;
final norm, head and loss) another; a weight node belongs to the unit of the first
kernel that reads it. Units run forward then backward, in graph order.

Scheduling rule of the compute stream (a greedy list schedule): when it is free, it runs
a released weight kernel or a post-reduce kernel that is ready (earliest ready first,
then graph order), else the next kernel of graph order once its inputs have arrived.
Activation checkpointing's recomputation and any second run of an edge
(``CostModel.edge_times``) are paid at the node's place in graph order (their times
already include every run).

No overlap (``hardware.overlap=false``, a CPU / gloo profile, pipeline/costmodel/
hardware.py): every redistribution step blocks the compute stream, one stream in graph
order, each node's incoming steps (edge order, step order) before its kernel:
``step_time_us = compute_us + comm_us``, ``exposed_comm_us = comm_us``.

Reported (``run.json`` ``step_time``; the top-level ``step_time_us``,
``exposed_comm_us``, ``tokens_per_s_per_device``): ``step_time_us`` (the makespan),
``compute_us`` (the compute stream's busy time, the sum of the nodes' compute: equal to
the objective's compute part), ``comm_us`` (the sum of every redistribution: the
objective's comm part), ``exposed_comm_us = step_time_us - compute_us`` (the time the
compute stream waits), per-stream busy time and the comm by edge kind. As every task
starts at the end (or the issue) of another, the makespan is covered by busy intervals:
``max(compute_us, busiest stream) <= step_time_us <= compute_us + comm_us <= E(x)``.
``tokens_per_s_per_device = batch * seq_len / world size / step time``.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from typing import Any

from pipeline.core.dtypes import itemsize

__all__ = [
    "EDGE_KINDS",
    "Classes",
    "StepInputs",
    "StepTime",
    "global_tokens",
    "plan_step_inputs",
    "classify",
    "simulate",
    "step_time_record",
]

#: Edge kinds of the simulation (module docstring).
EDGE_KINDS: tuple[str, ...] = ("weight", "activation", "gradient")

_SOURCE, _MAIN, _SIDE, _INSTANT = range(4)
_WEIGHT, _ACTIVATION, _GRADIENT = range(3)


@dataclass
class StepInputs:
    """A plan as the simulator sees it: per node and per edge, plain lists.

    Nodes are in graph order (producers before consumers), output sinks included.

    Attributes:
        names: node names (for messages).
        phase: ``fwd`` / ``bwd`` per node.
        layer: repeated-layer id per node (``layers.3``) or None.
        role: ``param``, ``buffer``, ``input``, ``tangent``, ``activation``, ``grad``,
            ``loss``, ... (as in ``nodes.parquet``).
        placeholder: per node, a graph input (parameter, buffer, model input, tangent).
        sink: per node, an output sink (the loss, a gradient).
        weight_derived: per node, a forward op computed from parameters only.
        compute_us: per node, its compute (all runs).
        edges: ``(producer, consumer)`` per graph edge.
        steps: per edge, ``(mesh dim, µs)`` of each redistribution step in order
            (empty: no redistribution).
        num_dims: mesh dims (communication streams).
        overlap: communication overlaps compute (``hardware.overlap``); false: every
            redistribution step blocks the compute stream (module docstring).
    """

    names: list[str]
    phase: list[str]
    layer: list[str | None]
    role: list[str]
    placeholder: list[bool]
    sink: list[bool]
    weight_derived: list[bool]
    compute_us: list[float]
    edges: list[tuple[int, int]]
    steps: list[list[tuple[int, float]]]
    num_dims: int
    overlap: bool = True


@dataclass
class StepTime:
    """The simulated step (module docstring); times in µs.

    Attributes:
        step_time_us: the makespan.
        compute_us: compute-stream busy time (sum of compute).
        comm_us: sum of every redistribution step.
        exposed_comm_us: ``step_time_us - compute_us``.
        stream_busy_us: per mesh dim, the busy time of its communication stream.
        comm_us_by_kind: comm summed per edge kind (``weight``, ``activation``,
            ``gradient``).
        units: FSDP units (graph-order segments, forward and backward).
        node_start_us, node_end_us: per node (kernels: on the compute stream; others:
            when they complete).
    """

    step_time_us: float
    compute_us: float
    comm_us: float
    exposed_comm_us: float
    stream_busy_us: list[float]
    comm_us_by_kind: dict[str, float]
    units: int
    node_start_us: list[float] = field(repr=False, default_factory=list)
    node_end_us: list[float] = field(repr=False, default_factory=list)


# --------------------------------------------------------------------------- classes


@dataclass
class Classes:
    """What the simulation makes of a plan's nodes and edges (module docstring).

    Attributes:
        kernel: per node, whether it runs on the compute stream (a kernel of graph order
            or a released weight / post-reduce kernel).
        main: per node, a kernel of graph order (the compute stream's order).
        unit: per node, its FSDP unit (None outside every unit).
        edge_kind: per edge, ``weight``, ``activation`` or ``gradient``.
    """

    kernel: list[bool]
    main: list[bool]
    unit: list[int | None]
    edge_kind: list[str]


def classify(g: StepInputs) -> Classes:
    """The node kinds, units and edge kinds of the simulation of ``g``."""
    kind, ekind, _, unit = _classify(g)
    names = {_WEIGHT: "weight", _ACTIVATION: "activation", _GRADIENT: "gradient"}
    return Classes(kernel=[k in (_MAIN, _SIDE) and c > 0 for k, c in zip(kind, g.compute_us)],
                   main=[k == _MAIN for k in kind], unit=list(unit),
                   edge_kind=[names[k] for k in ekind])


def _classify(g: StepInputs) -> tuple[list[int], list[int], list[int], list[int | None]]:
    """(node kind, edge kind, compute-stream order of the kernels, unit per node)."""
    n = len(g.names)
    ins: list[list[int]] = [[] for _ in range(n)]
    outs: list[list[int]] = [[] for _ in range(n)]
    for e, (u, v) in enumerate(g.edges):
        ins[v].append(e)
        outs[u].append(e)
    param = [g.placeholder[v] and g.role[v] == "param" for v in range(n)]
    weightish = [param[v] or g.weight_derived[v] for v in range(n)]
    grad_sink = [g.sink[v] and g.role[v] == "grad" for v in range(n)]
    grad_only = [False] * n
    for v in range(n - 1, -1, -1):
        if g.placeholder[v] or g.sink[v] or g.phase[v] != "bwd" or not outs[v]:
            continue
        grad_only[v] = all(grad_sink[c] or grad_only[c] for c in (g.edges[e][1] for e in outs[v]))
    has_comm = [any(us > 0 for _, us in s) for s in g.steps]
    ekind = []
    for u, v in g.edges:
        if weightish[u]:
            ekind.append(_WEIGHT)
        elif grad_only[u] and (grad_only[v] or grad_sink[v]):
            ekind.append(_GRADIENT)
        else:
            ekind.append(_ACTIVATION)
    pre_gather = [False] * n
    post_reduce = [False] * n
    for v in range(n):
        if g.weight_derived[v]:
            pre_gather[v] = all(not has_comm[e] and (param[g.edges[e][0]]
                                                     or pre_gather[g.edges[e][0]])
                                for e in ins[v])
        elif grad_only[v]:
            post_reduce[v] = any((ekind[e] == _GRADIENT and has_comm[e])
                                 or post_reduce[g.edges[e][0]] for e in ins[v])
    kind = []
    for v in range(n):
        kernel = g.compute_us[v] > 0
        if g.placeholder[v]:
            kind.append(_SOURCE)
        elif g.sink[v]:
            kind.append(_INSTANT)
        elif pre_gather[v] or post_reduce[v]:
            kind.append(_SIDE if kernel else _INSTANT)
        elif g.weight_derived[v]:
            kind.append(_MAIN if kernel else _INSTANT)
        else:
            kind.append(_MAIN)
    # A weight node's anchor: the first non-weight node that (transitively) reads it.
    anchor: list[int] = list(range(n))
    for v in range(n - 1, -1, -1):
        if g.weight_derived[v] or param[v]:
            firsts = [anchor[c] if g.weight_derived[c] else c
                      for c in (g.edges[e][1] for e in outs[v])]
            anchor[v] = min(firsts) if firsts else v
    order = sorted((v for v in range(n) if kind[v] == _MAIN),
                   key=lambda v: (anchor[v], 0, v) if g.weight_derived[v] else (v, 1, v))
    unit: list[int | None] = [None] * n
    last: tuple[str, str | None] | None = None
    count = -1
    for v in order:
        if g.weight_derived[v]:
            continue
        key = (g.phase[v], g.layer[v])
        if key != last:
            count += 1
            last = key
        unit[v] = count
    for v in range(n):
        if (g.weight_derived[v] or param[v]) and kind[anchor[v]] == _MAIN \
                and not g.weight_derived[anchor[v]]:
            unit[v] = unit[anchor[v]]
    return kind, ekind, order, unit


def gradient_edges(g: StepInputs) -> list[bool]:
    """Per edge, whether it is a **gradient** edge (module docstring): the reductions a
    step without gradient synchronisation skips (pipeline/costmodel/accumulation.py)."""
    return [k == _GRADIENT for k in _classify(g)[1]]


# --------------------------------------------------------------------------- simulation


def simulate(g: StepInputs) -> StepTime:
    """Simulate one step of the plan ``g`` (module docstring).

    Raises:
        ValueError: an edge whose time is not finite (a forbidden pair in the plan).
        RuntimeError: the schedule stalls (a node never runs; a bug, not an input error).
    """
    n = len(g.names)
    for e, s in enumerate(g.steps):
        if any(not math.isfinite(us) or us < 0 for _, us in s):
            u, v = g.edges[e]
            raise ValueError(f"step time: edge {g.names[u]} -> {g.names[v]} has a "
                             f"non-finite redistribution time {s}")
    if not g.overlap:
        return _sequential(g)
    kind, ekind, order, unit = _classify(g)
    ins: list[list[int]] = [[] for _ in range(n)]
    outs: list[list[int]] = [[] for _ in range(n)]
    for e, (u, v) in enumerate(g.edges):
        ins[v].append(e)
        outs[u].append(e)
    num_units = 1 + max((x for x in unit if x is not None), default=-1)
    first_of_unit: dict[int, int] = {}
    for v in order:
        if unit[v] is not None and not g.weight_derived[v]:
            first_of_unit.setdefault(unit[v], v)
    # the unit whose weight edges an edge waits for (its consumer's, else its anchor's)
    edge_unit = [unit[v] if k == _WEIGHT else None for (_, v), k in zip(g.edges, ekind)]

    start = [math.nan] * n
    end = [math.nan] * n
    arrived = [0] * n
    producer_done = [False] * len(g.edges)
    released = [False] * max(num_units, 1)
    waiting_unit: dict[int, list[int]] = {}
    waiting_head: dict[int, list[int]] = {}
    comm_free = [0.0] * g.num_dims
    busy = [0.0] * g.num_dims
    events: list[tuple[float, int, int, int, int]] = []  # (t, seq, type, a, b)
    seq = [0]
    side: list[tuple[float, int]] = []  # (ready, node)
    inputs_ready = [False] * n
    state = {"running": False, "head": 0, "makespan": 0.0}
    position = {v: i for i, v in enumerate(order)}
    kernel_done, step_done = 0, 1

    def push(t: float, typ: int, a: int, b: int = 0) -> None:
        seq[0] += 1
        heapq.heappush(events, (t, seq[0], typ, a, b))

    def head_node() -> int | None:
        return order[state["head"]] if state["head"] < len(order) else None

    def enqueue(e: int, k: int, now: float) -> None:
        steps = g.steps[e]
        while k < len(steps) and steps[k][1] <= 0:
            k += 1
        if k >= len(steps):
            arrive(e, now)
            return
        d, us = steps[k]
        t0 = max(now, comm_free[d])
        comm_free[d] = t0 + us
        busy[d] += us
        push(t0 + us, step_done, e, k)

    def try_issue(e: int, now: float) -> None:
        if not producer_done[e]:
            return
        v = g.edges[e][1]
        if ekind[e] == _WEIGHT and edge_unit[e] is not None and not released[edge_unit[e]]:
            waiting_unit.setdefault(edge_unit[e], []).append(e)
            return
        if ekind[e] == _ACTIVATION and kind[v] == _MAIN and head_node() != v:
            waiting_head.setdefault(v, []).append(e)
            return
        enqueue(e, 0, now)

    def release(k: int, now: float) -> None:
        if k >= num_units or released[k]:
            return
        released[k] = True
        for e in waiting_unit.pop(k, []):
            enqueue(e, 0, now)

    def finish(v: int, now: float) -> None:
        end[v] = now
        state["makespan"] = max(state["makespan"], now)
        for e in outs[v]:
            producer_done[e] = True
            try_issue(e, now)

    def arrive(e: int, now: float) -> None:
        state["makespan"] = max(state["makespan"], now)
        v = g.edges[e][1]
        arrived[v] += 1
        if arrived[v] < len(ins[v]):
            return
        inputs_ready[v] = True
        if kind[v] == _INSTANT:
            start[v] = now
            finish(v, now)
        elif kind[v] == _SIDE:
            heapq.heappush(side, (now, v))

    def start_kernel(v: int, now: float) -> None:
        state["running"] = True
        start[v] = now
        push(now + g.compute_us[v], kernel_done, v)

    def try_compute(now: float) -> None:
        if state["running"]:
            return
        if side:  # a side kernel is queued when it becomes ready
            start_kernel(heapq.heappop(side)[1], now)
            return
        h = head_node()
        if h is not None and inputs_ready[h]:
            start_kernel(h, now)

    def make_head(now: float) -> None:
        h = head_node()
        if h is None:
            return
        if not ins[h]:
            inputs_ready[h] = True
        if unit[h] is not None and first_of_unit.get(unit[h]) == h:
            release(unit[h] + 1, now)  # the stream reached unit k: prefetch unit k + 1
        for e in waiting_head.pop(h, []):
            enqueue(e, 0, now)

    release(0, 0.0)
    for v in range(n):
        if kind[v] == _SOURCE:
            start[v] = 0.0
            finish(v, 0.0)
        elif not ins[v]:  # a node without inputs (a factory op)
            inputs_ready[v] = True
            if kind[v] == _INSTANT:
                start[v] = 0.0
                finish(v, 0.0)
            elif kind[v] == _SIDE:
                heapq.heappush(side, (0.0, v))
    make_head(0.0)
    try_compute(0.0)
    while events:
        t, _, typ, a, b = heapq.heappop(events)
        if typ == kernel_done:
            state["running"] = False
            finish(a, t)
            if kind[a] == _MAIN and head_node() == a:
                state["head"] += 1
                make_head(t)
        elif b + 1 < len(g.steps[a]):
            enqueue(a, b + 1, t)
        else:
            arrive(a, t)
        try_compute(t)
    stalled = [v for v in range(n) if math.isnan(end[v])]
    if stalled:
        raise RuntimeError(f"step time: the schedule stalled at node {g.names[stalled[0]]} "
                           f"({len(stalled)} nodes never ran; position "
                           f"{position.get(stalled[0])})")
    compute = math.fsum(g.compute_us[v] for v in range(n) if kind[v] in (_MAIN, _SIDE))
    by_kind = _comm_by_kind(g, ekind)
    comm = math.fsum(by_kind.values())
    makespan = max(state["makespan"], max(comm_free, default=0.0))
    return StepTime(step_time_us=makespan, compute_us=compute, comm_us=comm,
                    exposed_comm_us=makespan - compute, stream_busy_us=busy,
                    comm_us_by_kind=by_kind, units=num_units,
                    node_start_us=start, node_end_us=end)


def _comm_by_kind(g: StepInputs, ekind: list[int]) -> dict[str, float]:
    names = {_WEIGHT: "weight", _ACTIVATION: "activation", _GRADIENT: "gradient"}
    by_kind = {k: 0.0 for k in EDGE_KINDS}
    for e, s in enumerate(g.steps):
        by_kind[names[ekind[e]]] += math.fsum(us for _, us in s)
    return by_kind


def _sequential(g: StepInputs) -> StepTime:
    """The step without overlap (module docstring)."""
    n = len(g.names)
    kind, ekind, _, unit = _classify(g)
    ins: list[list[int]] = [[] for _ in range(n)]
    for e, (_, v) in enumerate(g.edges):
        ins[v].append(e)
    busy = [0.0] * g.num_dims
    start = [0.0] * n
    end = [0.0] * n
    clock = 0.0
    for v in range(n):
        for e in ins[v]:
            for d, us in g.steps[e]:
                busy[d] += us
                clock += us
        start[v] = clock
        if kind[v] in (_MAIN, _SIDE):
            clock += g.compute_us[v]
        end[v] = clock
    compute = math.fsum(g.compute_us[v] for v in range(n) if kind[v] in (_MAIN, _SIDE))
    by_kind = _comm_by_kind(g, ekind)
    comm = math.fsum(by_kind.values())
    return StepTime(step_time_us=compute + comm, compute_us=compute, comm_us=comm,
                    exposed_comm_us=comm, stream_busy_us=busy, comm_us_by_kind=by_kind,
                    units=1 + max((x for x in unit if x is not None), default=-1),
                    node_start_us=start, node_end_us=end)


# --------------------------------------------------------------------------- from a plan


def plan_step_inputs(topology: Any, cost_model: Any, strategy: Any, parts: Any,
                     weight_derived: list[bool]) -> StepInputs:
    """The simulator's inputs for a solved plan.

    ``topology``: :class:`pipeline.stages.topology.TopologyTables`; ``cost_model``: the run's
    :class:`pipeline.costmodel.model.CostModel`; ``strategy``: int ``[num_nodes]``;
    ``parts``: its
    :class:`pipeline.costmodel.breakdown.PlanBreakdown` (node compute and each redistribution's
    ``comm_us``, the numbers of the objective); ``weight_derived``: per node
    (:class:`pipeline.memory.graph.StepGraph`). Each redistribution's steps come from
    ``redistribute_steps`` on the chosen placements and are scaled to add up to its
    ``comm_us``.
    """
    from pipeline.costmodel.redistribute import redistribute_steps

    nodes = topology.nodes
    strat = [int(s) for s in strategy]
    index = {(int(u), int(el), int(v), int(a)): e
             for e, (u, el, v, a) in enumerate(cost_model.edges)}
    steps: list[list[tuple[int, float]]] = [[] for _ in cost_model.edges]
    memo: dict[tuple, list[tuple[int, float]]] = {}
    for row in parts.redistributions:
        u, el, v, a = row["producer"], row["element"], row["consumer"], row["arg"]
        e = index[(u, el, v, a)]
        total = float(row["comm_us"])
        if total == 0.0:
            continue
        key = (tuple(row["shape"]), row["dtype"], row["src_placement"], row["dst_placement"],
               cost_model.edge_collective_policy(e))
        plan = memo.get(key)
        if plan is None:
            r, srcs = cost_model.out_classes(u, el)
            c, dsts = cost_model.in_classes(v, a)
            meta = cost_model.in_metas[v][a]
            reduce_size, latency_scale, flatten = cost_model.edge_collective_policy(e)
            found = redistribute_steps(meta["shape"], itemsize(meta["dtype"]),
                                       srcs[int(r[strat[u]])], dsts[int(c[strat[v]])],
                                       cost_model.mesh_shape, cost_model.hw,
                                       reduce_itemsize=reduce_size,
                                       latency_scale=latency_scale, flatten=flatten) or []
            plan = memo[key] = [(st.mesh_dim, float(st.us)) for st in found]
        raw = math.fsum(us for _, us in plan)
        if raw > 0 and math.isfinite(total):
            steps[e] = [(d, us * total / raw) for d, us in plan]
        else:  # no step time to share it by (or not finite): one step on the first dim
            steps[e] = [(plan[0][0] if plan else 0, total)]
    layer = [x if isinstance(x, str) else None for x in nodes["layer"]]
    target = list(nodes["target"])
    return StepInputs(
        names=list(nodes["name"]), phase=list(nodes["phase"]), layer=layer,
        role=list(nodes["role"]), placeholder=[t == "placeholder" for t in target],
        sink=[t == "output" for t in target], weight_derived=list(weight_derived),
        # a fused pointwise op runs in its producer's kernel: its compute less the fusion
        # term of its incoming edges (<= 0, never below its remaining memory time)
        compute_us=[max(0.0, float(x) + float(f))
                    for x, f in zip(parts.compute_us, parts.fusion_us, strict=True)], edges=[
            (int(u), int(v)) for u, _, v, _ in cost_model.edges],
        steps=steps, num_dims=len(cost_model.mesh_shape),
        overlap=bool(getattr(cost_model.hw, "overlap", True)))


def global_tokens(model_cfg: Any) -> int | None:
    """Tokens of one step: ``batch_size * seq_len`` (llama, hf), else the first input's
    first two dims (custom); None when the config names neither."""
    batch = model_cfg.get("batch_size") if hasattr(model_cfg, "get") else None
    seq = model_cfg.get("seq_len") if hasattr(model_cfg, "get") else None
    if batch is not None and seq is not None:
        return int(batch) * int(seq)
    inputs = model_cfg.get("inputs") if hasattr(model_cfg, "get") else None
    if inputs:
        shape = [int(s) for s in inputs[0]["shape"]]
        return shape[0] * (shape[1] if len(shape) > 1 else 1)
    return None


def step_time_record(sim: StepTime, mesh_names: list[str], tokens: int | None,
                     world_size: int, overlap: bool = True) -> dict[str, Any]:
    """The run record's ``step_time`` entry (module docstring)."""
    per_s = None
    if tokens is not None and sim.step_time_us > 0:
        per_s = tokens / world_size / (sim.step_time_us * 1e-6)
    return {
        "step_time_us": sim.step_time_us,
        "compute_us": sim.compute_us,
        "comm_us": sim.comm_us,
        "exposed_comm_us": sim.exposed_comm_us,
        "tokens_per_s_per_device": per_s,
        "global_tokens": tokens,
        "stream_busy_us": {str(m): b for m, b in zip(mesh_names, sim.stream_busy_us)},
        "comm_us_by_kind": dict(sim.comm_us_by_kind),
        "units": sim.units,
        "overlap": bool(overlap),
        "model": ("one compute stream, one communication stream per mesh dim, graph "
                  "order; weight all-gathers prefetched one FSDP unit ahead, gradient "
                  "reductions overlapped with the rest of the backward, activation "
                  "redistributions on the critical path (pipeline/costmodel/steptime.py)"
                  if overlap else
                  "no overlap (hardware.overlap=false): every redistribution blocks the "
                  "compute stream, step = compute + comm (pipeline/costmodel/steptime.py)"),
    }
