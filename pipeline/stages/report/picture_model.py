"""The drawing model of a plan's picture (:func:`build_picture`): data only, no matplotlib.

The nodes of the traced step (``graph.parquet`` of the run's trace, joined with
``solution.parquet``) are cut into *steps*: maximal runs of consecutive nodes, in graph
order and per phase, that share their module path (``layers.0.attention.wq``,
``layers.0.attention``, ...; a gradient sink ``output:grad:<fqn>`` belongs to its
parameter's module). A step is drawn when it holds a compute op other than a layout op
(view, transpose, cast, ...) or a redistribution feeds it; the others only move a
tensor's layout and are left out. Each step shows

* its main op (attention, else a matmul, a norm, the embedding, the loss, an activation
  function, else its first op) and the main op's output with its placement per mesh
  dim (``dp S(0) | cp S(1) | tp S(0)``);
* in the forward, each weight it reads: fqn, shape and stored placement per mesh dim;
* above it, every redistribution into it (a row of the run's ``redistributions.parquet``
  whose consumer is in the step): the DTensor collectives it runs, ``kind(mesh dim)`` in
  order, the bytes each device sends and the µs the cost model charged (``comm_us``),
  with the source and destination placements and the producing tensor.

The redistributions drawn for the layer are exactly the rows of
``redistributions.parquet`` whose consumer is a node of that layer (tested).
:mod:`pipeline.stages.report.picture` draws the model.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.core import runtime
from pipeline.core.artifacts import GRAPH, REDISTRIBUTIONS, RUN, SOLUTION
from pipeline.core.ir import tensor_refs

#: Ops that only change a tensor's layout, dtype or aliasing: a step of only these (and
#: no redistribution into it) is not drawn.
LAYOUT_OPS = frozenset({
    "aten.view.default", "aten._unsafe_view.default", "aten.reshape.default",
    "aten.t.default", "aten.transpose.int", "aten.permute.default",
    "aten.expand.default", "aten.unsqueeze.default", "aten.squeeze.dim",
    "aten.clone.default", "aten.detach.default", "aten.alias.default",
    "aten._to_copy.default", "getitem", "aten.unbind.int", "aten.split.Tensor",
    "aten.slice.Tensor", "aten.select.int", "aten.contiguous.default", "placeholder",
    "output"})
#: Main-op classes in order of priority (the first class found names the step).
_MAIN_OPS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("attention", re.compile(r"attention")),
    ("matmul", re.compile(r"\.(mm|bmm|addmm|matmul|linear|_grouped_mm)\.")),
    ("norm", re.compile(r"norm|rsqrt")),
    ("embedding", re.compile(r"embedding")),
    ("loss", re.compile(r"nll_loss|log_softmax|cross_entropy")),
    ("activation", re.compile(r"silu|gelu|relu|tanh|sigmoid|softmax")),
)
_TOKEN_RE = re.compile(r"SS\([^)]*\)|S\([^)]*\)|MP\([^)]*\)|NP\([^)]*\)|P(?:\([^)]*\))?|R")


# --------------------------------------------------------------------------- model


@dataclass(frozen=True)
class Redistribution:
    """One row of ``redistributions.parquet``: the tensor ``producer`` -> ``consumer``
    moved from ``src`` to ``dst`` by ``collectives`` (``kind(mesh dim)``, in order)."""

    producer: str
    consumer: str
    src: str
    dst: str
    collectives: tuple[str, ...]
    bytes: int
    us: float
    times: int = 1


@dataclass(frozen=True)
class TensorView:
    """A tensor drawn with its placement: ``name``, global ``shape``, ``dtype`` and the
    compact ``placement`` (one token per mesh dim)."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    placement: str


@dataclass(frozen=True)
class Step:
    """A drawn step of the op chain (see the module docstring)."""

    label: str
    phase: str
    op: str
    output: TensorView | None
    weights: tuple[TensorView, ...]
    redistributions: tuple[Redistribution, ...]
    nodes: tuple[str, ...]
    compute_us: float


@dataclass(frozen=True)
class PlanPicture:
    """What the picture shows, as data: the run, the mesh, the drawn layer's steps
    (``layer_forward``, ``layer_backward``), the steps before it (embedding) and after
    it (norm, head, loss), and the collective totals of the plan and of the layer."""

    title: str
    mesh_shape: tuple[int, ...]
    mesh_names: tuple[str, ...]
    layer: str | None
    layer_count: int
    pre_forward: tuple[Step, ...]
    layer_forward: tuple[Step, ...]
    post_forward: tuple[Step, ...]
    post_backward: tuple[Step, ...]
    layer_backward: tuple[Step, ...]
    pre_backward: tuple[Step, ...]
    totals: dict[str, dict[str, float]]
    layer_totals: dict[str, dict[str, float]]
    summary: dict[str, Any] = field(default_factory=dict)

    def layer_redistributions(self) -> list[Redistribution]:
        """Every redistribution drawn in the layer's steps (forward, then backward)."""
        return [r for s in (*self.layer_forward, *self.layer_backward)
                for r in s.redistributions]


def placement_tokens(text: str) -> list[str]:
    """The tokens of a compact placement (``S(0)RP(avg)`` -> ``S(0), R, P(avg)``), for
    display; the first element of a tuple output ``(A|B|-)``."""
    s = text.strip()
    if s.startswith("(") and s.endswith(")"):
        s = next((p for p in s[1:-1].split("|") if p != "-"), "")
    return _TOKEN_RE.findall(s)


def per_dim(placement: str, names: Sequence[str]) -> str:
    """``S(0)RS(1)`` on ``dp, cp, tp`` -> ``dp S(0) | cp R | tp S(1)``."""
    tokens = placement_tokens(placement)
    if len(tokens) != len(names):
        return placement
    return " | ".join(f"{n} {t}" for n, t in zip(names, tokens, strict=True))


def find_trace_dir(solve_dir: Path) -> Path:
    """The trace directory above ``solve_dir`` (the first parent holding
    ``graph.parquet``).

    Raises:
        FileNotFoundError: no parent holds it.
    """
    for parent in Path(solve_dir).resolve().parents:
        if GRAPH.path(parent).exists():
            return parent
    raise FileNotFoundError(f"{solve_dir}: no {GRAPH.name} in any parent directory")


def _module_of(name: str, module_path: Any) -> str:
    if isinstance(module_path, str) and module_path:
        return module_path
    if name.startswith("output:grad:"):
        return name[len("output:grad:"):].rsplit(".", 1)[0]
    return ""


def _main_op(ops: Sequence[str]) -> tuple[str, int]:
    """(class, index) of the step's main op, see :data:`_MAIN_OPS`."""
    for cls, pattern in _MAIN_OPS:
        for i, op in enumerate(ops):
            if op not in LAYOUT_OPS and pattern.search(op):
                return cls, i
    for i, op in enumerate(ops):
        if op not in LAYOUT_OPS:
            return "op", i
    return "layout", len(ops) - 1


def _short_op(op: str) -> str:
    """``aten.mm.default`` -> ``mm``; other names as they are."""
    parts = op.split(".")
    return parts[1] if len(parts) >= 3 and parts[0] == "aten" else op


def _shape_of(outputs: Any) -> tuple[tuple[int, ...], str]:
    items = json.loads(outputs) if isinstance(outputs, str) else (outputs or [])
    first = next((o for o in items if o), None)
    if not first:
        return (), ""
    return tuple(int(x) for x in first.get("shape", ())), str(first.get("dtype", ""))


def _steps(rows: list[dict[str, Any]], layer: str | None, names: Sequence[str],
           redist: dict[int, list[Redistribution]], params: dict[int, TensorView],
           weights: bool) -> list[Step]:
    """Cut ``rows`` (one phase, graph order) into steps; keep the drawn ones."""
    groups: list[list[dict[str, Any]]] = []
    for r in rows:
        # in the backward, a node of no submodule (the layer's own gradient sums, their
        # layout ops) joins the step before it instead of cutting the chain
        joins = (r["phase"] == "bwd" and r["module"] in ("", layer)
                 and (r["op"] in LAYOUT_OPS or r["op"].startswith("aten.add")))
        if groups and (groups[-1][0]["module"] == r["module"] or joins):
            groups[-1].append(r)
        else:
            groups.append([r])
    steps = []
    for g in groups:
        ops = [r["op"] for r in g]
        rds = tuple(x for r in g for x in redist.get(r["node"], ()))
        cls, i = _main_op(ops)
        if cls == "layout" and not rds:
            continue
        if cls == "norm" and g[0]["phase"] == "fwd":  # the normalised output, not the rsqrt
            i = max(j for j, op in enumerate(ops) if op not in LAYOUT_OPS)
        main = g[i]
        prefix = f"{layer}." if layer else ""
        module = g[0]["module"]
        label = module[len(prefix):] if layer and module.startswith(prefix) else module
        if not label or label == layer:
            label = ("residual" if layer and main["op"].startswith("aten.add") else
                     cls if cls not in ("op", "layout") else _short_op(main["op"]))
        shape, dtype = _shape_of(main["outputs"])
        out = (TensorView(main["name"], shape, dtype, main["output_placement"])
               if main["op"] not in ("placeholder", "output") else None)
        ws: list[TensorView] = []
        if weights:
            seen: set[int] = set()
            for r in g:
                for a in r["arg_nodes"]:
                    if a in params and a not in seen:
                        seen.add(a)
                        ws.append(params[a])
        steps.append(Step(label=label, phase=g[0]["phase"], op=_short_op(main["op"]),
                          output=out, weights=tuple(ws), redistributions=rds,
                          nodes=tuple(r["name"] for r in g),
                          compute_us=float(sum(r["compute_us"] or 0.0 for r in g))))
    return steps


def _arg_nodes(args: Any) -> list[int]:
    """The producers of the tensor arguments in an IR ``args`` / ``kwargs`` JSON text."""
    return tensor_refs(json.loads(args) if isinstance(args, str) else args)


def _totals(redistributions: Sequence[Redistribution]) -> dict[str, dict[str, float]]:
    """Count, bytes and µs per ``kind(mesh dim)``; a row's bytes and µs split evenly
    over its collectives (the table has them per row), times its runs."""
    out: dict[str, dict[str, float]] = {}
    for r in redistributions:
        for c in r.collectives:
            d = out.setdefault(c, {"count": 0, "bytes": 0.0, "us": 0.0})
            d["count"] += r.times
            d["bytes"] += r.times * r.bytes / len(r.collectives)
            d["us"] += r.times * r.us / len(r.collectives)
    return dict(sorted(out.items()))


def build_picture(solve_dir: Path | str) -> PlanPicture:
    """The drawing model of the run in ``solve_dir`` (see the module docstring).

    Raises:
        FileNotFoundError: an artifact of the run is missing.
    """

    solve_dir = Path(solve_dir)
    record = json.loads(RUN.path(solve_dir).read_text())
    names = tuple(record["mesh_names"])
    graph = runtime.read_parquet(GRAPH.path(find_trace_dir(solve_dir)),
                          columns=["idx", "outputs", "args", "kwargs", "module_path",
                                   "fqn", "role"]).to_pylist()
    by_idx = {g["idx"]: g for g in graph}
    solution = runtime.read_parquet(SOLUTION.path(solve_dir),
                             columns=["node", "name", "op", "layer", "role", "phase",
                                      "output_placement", "compute_us"]).to_pylist()
    solution.sort(key=lambda r: r["node"])
    rows = []
    for s in solution:
        g = by_idx.get(s["node"], {})
        rows.append({**s, "module": _module_of(s["name"], g.get("module_path")),
                     "outputs": g.get("outputs"),
                     "arg_nodes": _arg_nodes(g.get("args", "[]"))
                     + _arg_nodes(g.get("kwargs", "{}"))})
    params = {}
    for r in rows:
        g = by_idx.get(r["node"], {})
        if r["op"] == "placeholder" and r["role"] == "param":
            shape, dtype = _shape_of(g.get("outputs"))
            params[r["node"]] = TensorView(str(g.get("fqn") or r["name"]), shape, dtype,
                                           r["output_placement"])
    redist: dict[int, list[Redistribution]] = {}
    for x in runtime.read_parquet(REDISTRIBUTIONS.path(solve_dir)).to_pylist():
        source = params.get(x["producer"])
        redist.setdefault(x["consumer"], []).append(Redistribution(
            producer=source.name if source is not None else x["producer_name"],
            consumer=x["consumer_name"],
            src=x["src_placement"], dst=x["dst_placement"],
            collectives=tuple(x["collectives"]), bytes=int(x["bytes"]),
            us=float(x["comm_us"]), times=int(x.get("times") or 1)))
    layers = list(dict.fromkeys(r["layer"] for r in rows if r["layer"]))
    layer = layers[0] if layers else None
    compute = [r for r in rows if r["op"] != "placeholder"]
    in_layers = [i for i, r in enumerate(compute) if r["layer"]]
    first_fwd = next((i for i in in_layers if compute[i]["phase"] == "fwd"), len(compute))
    first_bwd = next((i for i in in_layers if compute[i]["phase"] == "bwd"), len(compute))

    def part(phase: str, where: str) -> list[dict[str, Any]]:
        """The rows of one phase in the layer, before it (``pre``: the embedding, in
        the backward after the layers) or after it (``post``: norm, head, loss)."""
        out = []
        for i, r in enumerate(compute):
            if r["phase"] != phase:
                continue
            if where == "layer":
                if layer is not None and r["layer"] == layer:
                    out.append(r)
            elif not r["layer"]:
                pre = i < first_fwd if phase == "fwd" else i > first_bwd
                if (where == "pre") == pre:
                    out.append(r)
        return out

    def steps(phase: str, where: str) -> tuple[Step, ...]:
        return tuple(_steps(part(phase, where), layer if where == "layer" else None, names,
                            redist, params, weights=phase == "fwd"))

    layer_rows = {r["node"] for r in rows if layer is not None and r["layer"] == layer}
    layer_rds = [x for n in sorted(layer_rows) for x in redist.get(n, ())]
    pic = PlanPicture(
        title=(f"{record.get('model')} on {record.get('mesh')} ({', '.join(names)}) · "
               f"{record.get('solver')} · {record.get('hardware')} · run {record.get('run_id')}"),
        mesh_shape=tuple(int(x) for x in str(record["mesh"]).split("x")),
        mesh_names=names, layer=layer, layer_count=len(layers),
        pre_forward=steps("fwd", "pre"), layer_forward=steps("fwd", "layer"),
        post_forward=steps("fwd", "post"), post_backward=steps("bwd", "post"),
        layer_backward=steps("bwd", "layer"), pre_backward=steps("bwd", "pre"),
        totals={k: {"count": float(v["count"]), "bytes": float(v["bytes"]),
                    "us": float(v["us"])}
                for k, v in sorted(record.get("collectives", {}).items())},
        layer_totals=_totals(layer_rds),
        summary={k: record.get(k) for k in ("objective", "compute_us", "comm_us",
                                             "transition_us", "status", "gap",
                                             "step_time_us") if k in record})
    return pic
