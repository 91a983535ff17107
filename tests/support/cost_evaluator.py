"""An evaluator of a plan's cost written independently of the solver's bookkeeping
(``solution.parquet``'s cost columns, ``CostModel``, ``plan_breakdown``): from a plan's
placements and the topology's shapes alone it recomputes

    E(x) = sum_v compute_v + sum_{(u,v) graph edges} (redistribution + transition
           + pointwise fusion) + the all-reduces inside vocab-parallel softmaxes,

which tests/integration/test_cost_evaluator.py compares with ``run.json`` (the
objective and its parts). Written from the cost model's documented rules (roofline
compute, DTensor-style redistribution over flattened groups, FSDP2's defaults, pointwise
fusion), not from ``pipeline/stages/costs``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any


def elements(text: str) -> list[str]:
    """``(A|B|-)`` -> ``["A", "B", "-"]``; a plain placement -> ``[text]``."""
    return text[1:-1].split("|") if text.startswith("(") else [text]


def local_shape(shape: list[int], placements: tuple, mesh: tuple[int, ...]) -> tuple:
    """Shape on one device: every sharded dim divided (rounded up) by its shard count."""
    out = list(shape)
    for mdim, p in enumerate(placements):
        if p.is_shard():
            d = p.dim % len(shape)
            out[d] = -(-out[d] // mesh[mdim])
    return tuple(out)


def _with_local_shapes(obj: Any, shapes: list, counter: list[int]) -> Any:
    """Replace tensor references (``{"node": i}``) by local shapes, in flattened order."""
    if isinstance(obj, dict) and set(obj) == {"node"}:
        shape = shapes[counter[0]]
        counter[0] += 1
        return shape
    if isinstance(obj, list):
        return [_with_local_shapes(v, shapes, counter) for v in obj]
    if isinstance(obj, dict):
        return {k: _with_local_shapes(v, shapes, counter) for k, v in obj.items()}
    return obj


def _itemsize(dtype: str) -> int:
    import torch

    return getattr(torch, dtype).itemsize


@dataclass
class Evaluation:
    """The parts of E(x) of one plan, per node and per graph edge (in the topology's edge
    order), and their sums."""

    compute: list[float]  # per node
    edge_comm: list[float]  # per graph edge
    edge_transition: list[float]  # per graph edge
    edge_text: list[tuple[str, str]]  # per graph edge: (src, dst) placement text
    op_comm: list[float] | None = None  # per node: collectives inside the op
    edge_fusion: list[float] | None = None  # per graph edge: the fusion term (<= 0)

    @property
    def compute_us(self) -> float:
        return math.fsum(self.compute)

    @property
    def comm_us(self) -> float:
        return math.fsum(self.edge_comm) + math.fsum(self.op_comm or [])

    @property
    def fusion_us(self) -> float:
        return math.fsum(self.edge_fusion or [])

    @property
    def transition_us(self) -> float:
        return math.fsum(self.edge_transition)

    @property
    def objective(self) -> float:
        return self.compute_us + self.comm_us + self.transition_us + self.fusion_us


_SOFTMAX = {"aten._log_softmax.default": (1, 2), "aten._log_softmax_backward_data.default": (2, 1)}


def _is_elementwise(op: str) -> bool:
    import torch

    from pipeline.core.ir import resolve_op

    if op == "aten._to_copy.default":
        return True
    fn = resolve_op(op, strict=False) if op.startswith("aten.") else None
    return isinstance(fn, torch._ops.OpOverload) and torch.Tag.pointwise in fn.tags


def evaluate_plan(plan: list[dict], tt: Any, mesh: tuple[int, ...], hw: Any,
                  fuse: bool = True) -> Evaluation:
    """E(x) of a plan (the objective of pipeline/stages/costs/stage.py), from its placements and the
    topology's shapes only.

    Compute: roofline on the local shapes (inputs read + outputs written), 0 for
    placeholders, getitem, sinks and views. Edges: redistribution of the producer's
    output (its element for a tuple output; ``-`` is Replicate) into the consumer's
    expected placement of that argument (a redistribution changing several mesh dims
    the same way as one collective over their flattened group, ``costs.flatten_mesh``),
    plus 1.0 when the two differ. Op comm: a
    ``_log_softmax`` whose softmax dim is sharded all-reduces the row max and the row
    sum of exponentials (its backward the row sum of the gradient) over each mesh dim
    sharding it, one value per local row. Fusion (``fuse``): an edge between two
    elementwise ops (``torch.Tag.pointwise``, ``_to_copy``) with equal placements saves
    the read of its tensor, and, on the consumer's lowest such argument, its launch
    floor above its memory time (the least over the consumer's strategies with that
    argument's placement).
    """
    from pipeline.costmodel.comm import mesh_collective_us
    from pipeline.costmodel.compute import is_view_op, op_flops, roofline_us
    from pipeline.costmodel.redistribute import redistribute_us
    from pipeline.dtensor.placements import parse_placements

    nd = len(mesh)
    nodes = tt.nodes
    compute = []
    op_comm = [0.0] * len(plan)
    for v, row in enumerate(plan):
        op = row["op"]
        if op in ("placeholder", "getitem", "output") or is_view_op(op):
            compute.append(0.0)
            continue
        in_metas = json.loads(nodes["in_metas"][v])
        out_metas = json.loads(nodes["out_metas"][v])
        in_pl = [parse_placements(t, nd) for t in row["input_placements"]]
        assert len(in_pl) == len(in_metas), row["name"]
        out_pl = [None if t == "-" else parse_placements(t, nd)
                  for t in elements(row["output_placement"])]
        assert len(out_pl) == len(out_metas), row["name"]
        loc_in = [local_shape(m["shape"], p, mesh) for m, p in zip(in_metas, in_pl)]
        loc_out = [None if m is None or p is None else local_shape(m["shape"], p, mesh)
                   for m, p in zip(out_metas, out_pl)]
        nbytes = sum(math.prod(s) * _itemsize(m["dtype"]) for s, m in zip(loc_in, in_metas))
        nbytes += sum(math.prod(s) * _itemsize(m["dtype"])
                      for s, m in zip(loc_out, out_metas) if s is not None)
        counter = [0]
        args = _with_local_shapes(json.loads(nodes["args"][v]), loc_in, counter)
        kwargs = _with_local_shapes(json.loads(nodes["kwargs"][v]), loc_in, counter)
        assert counter[0] == len(loc_in), row["name"]
        flops = op_flops(op, args, kwargs, tuple(loc_out) if len(loc_out) > 1 else loc_out[0])
        dtype = next((m["dtype"] for m in out_metas if m), None) or in_metas[0]["dtype"]
        compute.append(float(roofline_us(flops, nbytes, dtype, hw, False)))
        if op in _SOFTMAX:
            position, count = _SOFTMAX[op]
            raw = json.loads(nodes["args"][v])
            d = raw[position] % len(in_metas[0]["shape"])
            rows = math.prod(loc_in[0]) // loc_in[0][d]
            for m, p in enumerate(in_pl[0]):
                if p.is_shard() and p.dim % len(in_metas[0]["shape"]) == d:
                    op_comm[v] += count * mesh_collective_us(
                        "all_reduce", rows * _itemsize(out_metas[0]["dtype"]), mesh, m, hw)

    comm, trans, texts = [], [], []
    e = tt.edges
    reduce_size, share, times = _fsdp_policy(tt)
    for k, (u, element, v, a) in enumerate(
            zip(e["producer"], e["element"], e["consumer"], e["arg"])):
        src = plan[u]["output_placement"]
        if src.startswith("("):
            assert element >= 0, (plan[u]["name"], plan[v]["name"])
            src = elements(src)[element]
            if src == "-":
                src = "R" * nd
        dst = plan[v]["input_placements"][a]
        meta = json.loads(nodes["in_metas"][v])[a]
        comm.append(times[k] * float(redistribute_us(
            meta["shape"], _itemsize(meta["dtype"]), parse_placements(src, nd),
            parse_placements(dst, nd), mesh, hw, reduce_itemsize=reduce_size[k],
            latency_scale=share[k], flatten=True)))
        trans.append(1.0 if src != dst else 0.0)
        texts.append((src, dst))
    fusion = [0.0] * len(comm)
    if fuse:
        _add_fusion(fusion, plan, tt, mesh, hw, texts)
    return Evaluation(compute, comm, trans, texts, op_comm, fusion)


def _fsdp_policy(tt: Any) -> tuple[list[int], list[float], list[int]]:
    """Per graph edge, FSDP2's defaults written out from the graph alone: the reduce
    itemsize (4, float32, on a bf16 tensor that flows only into parameter gradients), the
    latency share (1 / the parameters of its unit: the ``layer`` of a repeated layer, else
    the first name of the parameter's fqn) of an edge out of a parameter, out of a forward
    op computed from parameters only, or carrying a parameter gradient, and the runs (2
    on the edges into a weight copy the backward reads and into its weight-only
    ancestors: the re-gather)."""
    n, e = tt.nodes, tt.edges
    edges = list(zip(e["producer"], e["element"], e["consumer"], e["arg"]))
    num = len(n["id"])

    def unit(v: int) -> str:
        layer = n["layer"][v]
        return layer if isinstance(layer, str) and layer else n["fqn"][v].split(".")[0]

    params = [v for v in range(num) if n["role"][v] == "param"]
    size: dict[str, int] = {}
    for v in params:
        size[unit(v)] = size.get(unit(v), 0) + 1
    ins: list[list[int]] = [[] for _ in range(num)]
    outs: dict[tuple[int, int], list[int]] = {}
    for u, el, v, _ in edges:
        ins[v].append(u)
        outs.setdefault((u, el), []).append(v)
    # forward weight copies: forward ops all of whose inputs are parameters or copies
    source: list[set[str] | None] = [None] * num  # units a weight value is made from
    for v in range(num):
        if n["role"][v] == "param":
            source[v] = {unit(v)}
        elif n["phase"][v] == "fwd" and n["target"][v] != "placeholder" and ins[v] and all(
                source[u] is not None for u in ins[v]):
            source[v] = set().union(*(source[u] for u in ins[v]))
    # gradient values: backward values read only by parameter-gradient values / sinks
    grad: list[set[str] | None] = [None] * num
    for v in range(num - 1, -1, -1):
        if n["role"][v] == "grad":
            grad[v] = {unit(v)}
        elif n["phase"][v] == "bwd" and n["target"][v] != "placeholder":
            readers = [w for (u, _), ws in outs.items() if u == v for w in ws]
            if readers and all(grad[w] is not None for w in readers):
                grad[v] = set().union(*(grad[w] for w in readers))
    reduce_size, share, times = [], [], []
    for u, el, v, a in edges:
        dtype = json.loads(n["in_metas"][v])[a]["dtype"]
        units = None
        is_grad = False
        if source[u] is not None:
            units = source[u]
        elif n["phase"][u] == "bwd" and n["role"][u] != "grad" and all(
                grad[w] is not None for w in outs[(u, el)]):
            units = set().union(*(grad[w] for w in outs[(u, el)]))
            is_grad = True
        one = units is not None and len(units) == 1
        share.append(1.0 / size[next(iter(units))] if one else 1.0)
        reduce_size.append(4 if is_grad and one and dtype == "bfloat16" else 0)
    # the re-gather: copies a backward op reads, and the edges that make them
    regather = [False] * len(edges)
    stack = [u for u, _, v, _ in edges
             if n["phase"][v] == "bwd" and source[u] is not None and n["role"][u] != "param"]
    seen: set[int] = set()
    while stack:
        v = stack.pop()
        if v in seen:
            continue
        seen.add(v)
        for k, (u, _, w, _) in enumerate(edges):
            if w == v:
                regather[k] = True
                if n["role"][u] != "param":
                    stack.append(u)
    times = [2 if r else 1 for r in regather]
    return reduce_size, share, times


def _add_fusion(fusion: list[float], plan: list[dict], tt: Any, mesh: tuple[int, ...],
                hw: Any, texts: list[tuple[str, str]]) -> None:
    from pipeline.dtensor.placements import parse_placements

    nd = len(mesh)
    nodes, e = tt.nodes, tt.edges
    bw = float(hw.hbm_bandwidth) * float(hw.memory_efficiency)
    floor = float(hw.kernel_floor_us)
    edges = list(zip(e["producer"], e["element"], e["consumer"], e["arg"]))
    fusable = [el == -1 and _is_elementwise(nodes["target"][u])
               and _is_elementwise(nodes["target"][v])
               and json.loads(nodes["in_metas"][v])[a]["dtype"] in ("float32", "bfloat16")
               for u, el, v, a in edges]
    first: dict[int, int] = {}
    for k, (_, _, v, a) in enumerate(edges):
        if fusable[k]:
            first[v] = min(first.get(v, a), a)
    for k, (_, _, v, a) in enumerate(edges):
        src, dst = texts[k]
        if not fusable[k] or src != dst:
            continue
        in_metas = json.loads(nodes["in_metas"][v])
        out_metas = json.loads(nodes["out_metas"][v])
        meta = in_metas[a]
        loc = local_shape(meta["shape"], parse_placements(dst, nd), mesh)
        saving = math.prod(loc) * _itemsize(meta["dtype"]) / bw * 1e6
        if first[v] == a:
            s = nodes["slist"][v]
            best = math.inf
            for o, ins in zip(tt.slist_outputs[s], tt.slist_inputs[s]):
                if ins[a] != dst:
                    continue
                nbytes = sum(math.prod(local_shape(m["shape"], parse_placements(t, nd), mesh))
                             * _itemsize(m["dtype"]) for m, t in zip(in_metas, ins))
                nbytes += sum(math.prod(local_shape(m["shape"], parse_placements(t, nd), mesh))
                              * _itemsize(m["dtype"]) for m, t in zip(out_metas, elements(o))
                              if m is not None and t != "-")
                best = min(best, max(floor - nbytes / bw * 1e6, 0.0))
            saving += best
        fusion[k] = -saving
