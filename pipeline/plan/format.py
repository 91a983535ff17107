"""The plan file: a run's chosen placements in a loadable, versioned form (``plan.json``).

The solve stage writes ``plan.json`` beside ``solution.parquet`` (:func:`write_plan`);
training code, :mod:`pipeline.apply` and :mod:`pipeline.verify.run` read it back with
:func:`load`, which validates it. The schema is documented in ``docs/plan.md``; in
short (version 1):

* ``format`` (``"sharding-plan"``), ``version`` (:data:`PLAN_VERSION`);
* ``run_id``, ``config_hash`` (the solve directory's key), ``model`` (``name``,
  ``hash``: SHA-256 over every parameter and buffer's name, shape and dtype, see
  :func:`model_hash`, and ``config``: the resolved model config), ``trace_hash``
  (SHA-256 over the graph IR rows, see :func:`trace_hash`) and ``placement_hash``
  (the run record's, over every node's output and input placements:
  :func:`pipeline.stages.solve.stage.placement_hash`);
* ``mesh``: ``shape`` and dim ``names``;
* ``parameters`` / ``buffers``: per tensor its ``fqn``, the graph ``node`` (placeholder),
  ``shape``, ``dtype`` and storage ``placement``;
* ``inputs``: per model input its ``index``, ``node``, ``shape``, ``dtype`` and ``placement``;
* ``outputs``: per element of the graph output its ``index``, ``kind`` (``loss`` or
  ``grad``), ``grad_of`` (the parameter's fqn), ``node`` (the sink's name), ``producer``
  (the graph node it reads) and ``placement``; ``model_output``: the logits node and
  its placement, or null;
* ``nodes``: per graph node, in graph order, ``name``, ``op``, ``output`` (a placement,
  or ``(A|B|-)`` for a tuple), ``inputs`` (the placement expected for each tensor
  argument, flattened args then kwargs order) and ``fallback`` (no DTensor strategy:
  replicate-only);
* ``collectives``: the plan's collectives per ``kind(mesh dim)`` (count, bytes, µs),
  as in ``run.json``.

Placements use the compact notation of :mod:`pipeline.dtensor.placements` (``S(0)R``, ``P``,
``MP(0,64x32)``, ...). A placement is *legal* for a tensor when it has one token per
mesh dim and every sharded tensor dim exists and is at least as large as the number
of shards of it (DTensor's ``is_tensor_shardable``); parameters, buffers and model
inputs are never Partial (a stored tensor is never a pending sum).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from pipeline.core.artifacts import PLAN
from pipeline.core.errors import PlanError
from pipeline.core.ir import load_nodes
from pipeline.plan.legality import graph_table, node_problem, placement_problem

PLAN_FILE = PLAN.name
PLAN_FORMAT = "sharding-plan"
#: Version of the schema written by :func:`write_plan`; :func:`load` reads exactly these.
PLAN_VERSION = PLAN.schema_version
SUPPORTED_VERSIONS: tuple[int, ...] = (1,)

_TOP_KEYS = ("format", "version", "run_id", "config_hash", "model", "trace_hash",
             "placement_hash", "mesh", "parameters", "buffers", "inputs", "outputs",
             "nodes", "collectives")
_TENSOR_KEYS = ("node", "shape", "dtype", "placement")
_NODE_KEYS = ("name", "op", "output", "inputs")
_IR_HASH_COLUMNS = ("idx", "name", "kind", "target", "args", "kwargs", "outputs",
                    "tuple_output", "role", "fqn", "input_index", "output_desc")


class PlanFileError(PlanError):
    """A plan file that cannot be used: unreadable, damaged, illegal, or made for another
    model, trace or mesh. ``str(err)`` is one line starting with ``plan=<path>:``."""


# --------------------------------------------------------------------------- hashes


def model_hash(entries: Iterable[tuple[str, str, Sequence[int], str]]) -> str:
    """SHA-256 (16 hex digits) over ``(kind, fqn, shape, dtype)`` of every parameter and
    buffer, sorted by (kind, fqn): what a plan's placements are keyed by."""
    h = hashlib.sha256()
    for kind, fqn, shape, dtype in sorted((k, f, tuple(int(x) for x in s), str(d))
                                          for k, f, s, d in entries):
        h.update(f"{kind}\t{fqn}\t{'x'.join(map(str, shape))}\t{dtype}\n".encode())
    return h.hexdigest()[:16]


def model_hash_of_graph(nodes: Sequence[Any]) -> str:
    """:func:`model_hash` of the parameter and buffer placeholders of a decoded graph IR
    (:func:`pipeline.core.ir.load_nodes`)."""
    return model_hash((n.role, n.fqn, n.outputs[0]["shape"], n.outputs[0]["dtype"])
                      for n in nodes if n.kind == "placeholder"
                      and n.role in ("param", "buffer") and n.outputs and n.outputs[0])


def model_hash_of_module(module: Any) -> str:
    """:func:`model_hash` of a live ``nn.Module`` (tied parameters counted once, under
    their first name, as the trace records them)."""
    entries = [("param", name, p.shape, str(p.dtype).replace("torch.", ""))
               for name, p in module.named_parameters()]
    entries += [("buffer", name, b.shape, str(b.dtype).replace("torch.", ""))
                for name, b in module.named_buffers()]
    return model_hash(entries)


def trace_hash(table: Any) -> str:
    """SHA-256 (16 hex digits) over the graph IR's rows (:mod:`pipeline.stages.trace.stage` columns
    that define the graph; not the stage metadata, which holds timings)."""
    cols = table.to_pydict()
    h = hashlib.sha256()
    for i in range(table.num_rows):
        row = [cols[c][i] if c in cols else None for c in _IR_HASH_COLUMNS]
        h.update(json.dumps(row, separators=(",", ":")).encode() + b"\n")
    return h.hexdigest()[:16]


# --------------------------------------------------------------------------- writing


def build_plan(*, graph_table: Any, nodes: Sequence[Any], solution: Any, record: dict[str, Any],
               mesh_shape: Sequence[int], mesh_names: Sequence[str], config_hash: str,
               logits: int | None, fallback: Sequence[bool] | None = None,
               model_config: dict[str, Any] | None = None) -> dict[str, Any]:
    """The plan document of a solved run (the solve stage builds it:
    :func:`pipeline.stages.solve.stage.plan_of_run`).

    Args:
        graph_table: the graph IR (``graph.parquet``), for :func:`trace_hash`.
        nodes: the decoded graph IR (:func:`pipeline.core.ir.load_nodes`).
        solution: ``solution.parquet`` as a table: one row per placement-problem node,
            graph nodes in graph order then the output sinks.
        record: the run record (``run_id``, ``placement_hash``, ``collectives``).
        mesh_shape, mesh_names: the device mesh.
        config_hash: the key of the solve directory.
        logits: graph index of the model's output before the loss (``model_output``),
            or None.
        fallback: per solution row, whether the node had no DTensor strategy.
        model_config: the resolved ``model`` config the trace was made from.
    """
    sol = solution.to_pydict()
    names, outs, ins = sol["name"], sol["output_placement"], sol["input_placements"]
    row_of = {name: i for i, name in enumerate(names)}
    fb = list(fallback) if fallback is not None else [False] * len(names)
    graph_nodes = [n for n in nodes if n.kind != "output"]

    def tensor_entry(n: Any) -> dict[str, Any]:
        meta = n.outputs[0] or {}
        return {"node": n.name, "shape": list(meta.get("shape", [])),
                "dtype": meta.get("dtype"), "placement": outs[row_of[n.name]]}

    params = [{"fqn": n.fqn, **tensor_entry(n)} for n in graph_nodes
              if n.kind == "placeholder" and n.role == "param"]
    buffers = [{"fqn": n.fqn, **tensor_entry(n)} for n in graph_nodes
               if n.kind == "placeholder" and n.role == "buffer"]
    input_index = graph_table.column("input_index").to_pylist()
    inputs = [{"index": int(input_index[n.idx]), **tensor_entry(n)}
              for n in graph_nodes if n.kind == "placeholder" and n.role == "input"]
    out_node = next(n for n in nodes if n.kind == "output")
    flat = out_node.args[0] if out_node.args else []
    descs = out_node.output_desc or [{"kind": "none"}] * len(flat)
    outputs = []
    for k, (ref, desc) in enumerate(zip(flat, descs)):
        if not (isinstance(ref, dict) and "node" in ref):
            continue
        sink = (f"output:grad:{desc.get('grad_of')}" if desc.get("kind") == "grad"
                else f"output:{k}")
        if sink not in row_of:
            continue
        outputs.append({"index": k, "kind": "grad" if desc.get("kind") == "grad" else "loss",
                        "grad_of": desc.get("grad_of"), "node": sink,
                        "producer": nodes[ref["node"]].name, "placement": outs[row_of[sink]]})
    model_output = None if logits is None else {
        "node": nodes[logits].name, "placement": outs[row_of[nodes[logits].name]]}
    plan_nodes = [{"name": n.name, "op": n.target, "output": outs[row_of[n.name]],
                   "inputs": list(ins[row_of[n.name]]), "fallback": bool(fb[row_of[n.name]])}
                  for n in graph_nodes]
    return {
        "format": PLAN_FORMAT, "version": PLAN_VERSION,
        "run_id": record["run_id"], "config_hash": config_hash,
        "model": {"name": record.get("model"), "hash": model_hash_of_graph(nodes),
                  "config": model_config},
        "trace_hash": trace_hash(graph_table),
        "placement_hash": record["placement_hash"],
        "mesh": {"shape": [int(s) for s in mesh_shape], "names": [str(m) for m in mesh_names]},
        "parameters": params, "buffers": buffers, "inputs": inputs, "outputs": outputs,
        "model_output": model_output, "nodes": plan_nodes,
        "collectives": record.get("collectives", {}),
    }


def write_plan(path: Path | str, plan: dict[str, Any]) -> None:
    """Write a plan document atomically (temp file + rename)."""
    from pipeline.core import runtime

    runtime.write_json(Path(path), plan)


# --------------------------------------------------------------------------- reading


@dataclasses.dataclass(frozen=True)
class TensorPlan:
    """The planned storage placement of one parameter, buffer or model input."""

    name: str          # fqn (parameters, buffers) or the placeholder's node name (inputs)
    node: str
    shape: tuple[int, ...]
    dtype: str
    placement: str


@dataclasses.dataclass(frozen=True)
class NodePlan:
    """The chosen strategy of one graph node: its output and expected input placements."""

    name: str
    op: str
    output: str
    inputs: tuple[str, ...]
    fallback: bool = False


@dataclasses.dataclass(frozen=True)
class Plan:
    """A validated plan file (see the module docstring for the fields)."""

    path: Path
    version: int
    run_id: str
    config_hash: str
    model_name: str | None
    model_hash: str
    model_config: dict[str, Any] | None
    trace_hash: str
    placement_hash: str
    mesh_shape: tuple[int, ...]
    mesh_names: tuple[str, ...]
    parameters: tuple[TensorPlan, ...]
    buffers: tuple[TensorPlan, ...]
    inputs: tuple[TensorPlan, ...]
    outputs: tuple[dict[str, Any], ...]
    model_output: dict[str, Any] | None
    nodes: tuple[NodePlan, ...]
    collectives: dict[str, dict[str, Any]]

    @property
    def world_size(self) -> int:
        return math.prod(self.mesh_shape)

    def placements(self, text: str) -> tuple[Any, ...]:
        """Parse a placement of this plan (one token per mesh dim) into DTensor objects."""
        from pipeline.dtensor.placements import parse_placements

        return parse_placements(text, len(self.mesh_shape))

    def parameter_placements(self) -> dict[str, str]:
        """``{fqn: placement text}`` of every parameter."""
        return {p.name: p.placement for p in self.parameters}

    def node(self, name: str) -> NodePlan:
        return self._by_name()[name]

    def _by_name(self) -> dict[str, NodePlan]:
        return {n.name: n for n in self.nodes}

    def collective_counts(self) -> dict[str, int]:
        """Planned count per ``kind(mesh dim)`` (e.g. ``{"all_gather(dp)": 21}``)."""
        return {k: int(v["count"]) for k, v in sorted(self.collectives.items())}


def load(path: Path | str, *, model: Any = None, mesh: Any = None, graph: Any = None,
         world_size: int | None = None) -> Plan:
    """Read and validate a plan file.

    Checks, each failing with a one-line :class:`PlanFileError` naming the file, the
    entry and what is allowed: the file is complete JSON of a known ``format`` and
    ``version``; every required key is there; every placement parses with one token
    per mesh dim and is legal for its tensor (no Partial for parameters, buffers and
    inputs); the ``placement_hash`` matches the nodes (the file was not edited); and,
    when given, that it belongs to ``model`` (an ``nn.Module``: :func:`model_hash_of_module`;
    or a model hash string), to ``mesh`` (a ``DeviceMesh``, or a shape sequence), to
    ``graph`` (the graph IR table: :func:`trace_hash`; node shapes are checked too) and
    to ``world_size`` processes.
    """
    p = Path(path)
    where = f"plan={p}"
    try:
        data = p.read_bytes()
    except FileNotFoundError:
        raise PlanFileError(f"{where}: no such file; run the solve stage first "
                            "(python -m pipeline ...)") from None
    except OSError as err:
        raise PlanFileError(f"{where}: cannot read ({err.strerror or err})") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise PlanFileError(f"{where}: not a text file (byte 0x{data[err.start]:02x} at "
                            f"offset {err.start} is not UTF-8); a plan file is JSON "
                            "written by the solve stage") from None
    try:
        doc = json.loads(text)
    except RecursionError:
        raise PlanFileError(f"{where}: JSON nested too deeply to be a plan file") from None
    except json.JSONDecodeError as err:
        raise PlanFileError(f"{where}: not a complete JSON document ({err.msg} at line "
                            f"{err.lineno} column {err.colno}); the file is truncated or "
                            "damaged: re-run the solve stage to rewrite it") from None
    plan = _parse(doc, where, p)
    _check_placements(plan, where)
    _check_hash(plan, where)
    if mesh is not None:
        check_mesh(plan, mesh)
    if world_size is not None:
        check_world_size(plan, world_size)
    if model is not None:
        check_model(plan, model)
    if graph is not None:
        check_graph(plan, graph)
    return plan


def _need(doc: dict, key: str, where: str, kind: type | tuple[type, ...]) -> Any:
    if key not in doc:
        raise PlanFileError(f"{where}: missing key {key!r}; a plan file has "
                            + ", ".join(_TOP_KEYS))
    val = doc[key]
    if not isinstance(val, kind) or isinstance(val, bool) and kind is not bool:
        names = kind.__name__ if isinstance(kind, type) else "/".join(k.__name__ for k in kind)
        raise PlanFileError(f"{where}: {key}={_short(val)}: allowed a {names}")
    return val


def _short(val: Any) -> str:
    text = json.dumps(val) if not isinstance(val, str) else val
    return text if len(text) <= 60 else text[:57] + "..."


def _parse(doc: Any, where: str, path: Path) -> Plan:
    if not isinstance(doc, dict):
        raise PlanFileError(f"{where}: allowed a JSON object, got {type(doc).__name__}")
    fmt = doc.get("format")
    if fmt != PLAN_FORMAT:
        raise PlanFileError(f"{where}: format={_short(fmt)}: allowed {PLAN_FORMAT!r}")
    version = _need(doc, "version", where, int)
    if version not in SUPPORTED_VERSIONS:
        raise PlanFileError(f"{where}: version={version}: allowed "
                            + ", ".join(map(str, SUPPORTED_VERSIONS)))
    for key in _TOP_KEYS:
        _need(doc, key, where, object)
    mesh = _need(doc, "mesh", where, dict)
    shape = mesh.get("shape")
    names = mesh.get("names")
    if not (isinstance(shape, list) and shape and all(isinstance(s, int) and not
                                                      isinstance(s, bool) and s >= 1
                                                      for s in shape)):
        raise PlanFileError(f"{where}: mesh.shape={_short(shape)}: allowed a non-empty list "
                            "of positive integers")
    if not (isinstance(names, list) and len(names) == len(shape) and len(set(names)) ==
            len(names) and all(isinstance(n, str) and n for n in names)):
        raise PlanFileError(f"{where}: mesh.names={_short(names)}: allowed {len(shape)} "
                            "distinct non-empty names")
    model = _need(doc, "model", where, dict)
    if not isinstance(model.get("hash"), str):
        raise PlanFileError(f"{where}: model.hash={_short(model.get('hash'))}: allowed a "
                            "hex string")

    def tensors(key: str, name_key: str | None) -> tuple[TensorPlan, ...]:
        out = []
        for i, e in enumerate(_need(doc, key, where, list)):
            if not isinstance(e, dict) or any(k not in e for k in _TENSOR_KEYS) or (
                    name_key and name_key not in e):
                need = ((name_key,) if name_key else ()) + _TENSOR_KEYS
                raise PlanFileError(f"{where}: {key}[{i}]={_short(e)}: allowed an object "
                                    "with " + ", ".join(need))
            shp = e["shape"]
            if not (isinstance(shp, list) and all(isinstance(s, int) and s >= 0
                                                  for s in shp)):
                raise PlanFileError(f"{where}: {key}[{i}].shape={_short(shp)}: allowed a "
                                    "list of non-negative integers")
            if not isinstance(e["placement"], str):
                raise PlanFileError(f"{where}: {key}[{i}].placement={_short(e['placement'])}"
                                    ": allowed a placement text such as S(0)R")
            out.append(TensorPlan(name=str(e[name_key]) if name_key else str(e["node"]),
                                  node=str(e["node"]), shape=tuple(shp), dtype=str(e["dtype"]),
                                  placement=e["placement"]))
        return tuple(out)

    nodes = []
    for i, e in enumerate(_need(doc, "nodes", where, list)):
        if not isinstance(e, dict) or any(k not in e for k in _NODE_KEYS) or not isinstance(
                e["inputs"], list) or not isinstance(e["output"], str):
            raise PlanFileError(f"{where}: nodes[{i}]={_short(e)}: allowed an object with "
                                + ", ".join(_NODE_KEYS) + " (inputs a list)")
        nodes.append(NodePlan(name=str(e["name"]), op=str(e["op"]), output=e["output"],
                              inputs=tuple(str(x) for x in e["inputs"]),
                              fallback=bool(e.get("fallback", False))))
    outputs = []
    for i, e in enumerate(_need(doc, "outputs", where, list)):
        if not isinstance(e, dict) or any(k not in e for k in (
                "index", "kind", "node", "producer", "placement")) or not isinstance(
                e["index"], int) or not isinstance(e["placement"], str):
            raise PlanFileError(f"{where}: outputs[{i}]={_short(e)}: allowed an object with "
                                "index, kind, grad_of, node, producer, placement")
        outputs.append(dict(e))
    collectives = _need(doc, "collectives", where, dict)
    return Plan(
        path=path, version=version, run_id=str(doc["run_id"]),
        config_hash=str(doc["config_hash"]), model_name=model.get("name"),
        model_hash=model["hash"], model_config=model.get("config"),
        trace_hash=str(doc["trace_hash"]),
        placement_hash=str(doc["placement_hash"]),
        mesh_shape=tuple(shape), mesh_names=tuple(names),
        parameters=tensors("parameters", "fqn"), buffers=tensors("buffers", "fqn"),
        inputs=tensors("inputs", None), outputs=tuple(outputs),
        model_output=doc.get("model_output"), nodes=tuple(nodes), collectives=collectives)


def _check_placements(plan: Plan, where: str) -> None:
    from pipeline.dtensor.placements import NON_TENSOR, parse_output

    ms = plan.mesh_shape
    for key, items in (("parameters", plan.parameters), ("buffers", plan.buffers),
                       ("inputs", plan.inputs)):
        for t in items:
            why = placement_problem(t.placement, t.shape, ms, partial_ok=False)
            if why:
                raise PlanFileError(f"{where}: {key}[{t.name}].placement={t.placement}: {why}")
    for n in plan.nodes:
        try:
            parse_output(n.output, len(ms))
        except ValueError as err:
            raise PlanFileError(f"{where}: nodes[{n.name}].output={n.output}: {err}") from None
        for k, text in enumerate(n.inputs):
            if text == NON_TENSOR:
                continue
            why = placement_problem(text, None, ms, partial_ok=True)
            if why:
                raise PlanFileError(f"{where}: nodes[{n.name}].inputs[{k}]={text}: {why}")
    for o in plan.outputs:
        partial_ok = False
        why = placement_problem(str(o["placement"]), None, ms, partial_ok=partial_ok)
        if why:
            raise PlanFileError(f"{where}: outputs[{o['node']}].placement={o['placement']}: "
                                f"{why}")
    # A placeholder's node entry must agree with its tensor entry.
    by_name = {n.name: n for n in plan.nodes}
    for key, items in (("parameters", plan.parameters), ("buffers", plan.buffers),
                       ("inputs", plan.inputs)):
        for t in items:
            n = by_name.get(t.node)
            if n is None:
                raise PlanFileError(f"{where}: {key}[{t.name}].node={t.node}: not a node of "
                                    "the plan")
            if n.output != t.placement:
                raise PlanFileError(f"{where}: {key}[{t.name}].placement={t.placement}: "
                                    f"differs from nodes[{t.node}].output={n.output}")


def plan_placement_hash(plan: Plan) -> str:
    """The placement hash of the plan's nodes and output sinks (as the run record's)."""
    h = hashlib.sha256()
    for name, out, ins in ([(n.name, n.output, n.inputs) for n in plan.nodes]
                           + [(o["node"], o["placement"], [o["placement"]])
                              for o in sorted(plan.outputs, key=_sink_order)]):
        h.update(f"{name}\t{out}\t{','.join(ins)}\n".encode())
    return h.hexdigest()


def _sink_order(o: dict[str, Any]) -> tuple[int, int]:
    # solution.parquet lists the sinks in graph-output order (loss first, then grads)
    return (0, int(o["index"]))


def _check_hash(plan: Plan, where: str) -> None:
    got = plan_placement_hash(plan)
    if got != plan.placement_hash:
        raise PlanFileError(f"{where}: placement_hash={plan.placement_hash[:16]}... does not "
                            f"match the placements in the file ({got[:16]}...): the file was "
                            "edited or damaged; re-run the solve stage to rewrite it")


def check_mesh(plan: Plan, mesh: Any) -> None:
    """Fail unless ``mesh`` (a ``DeviceMesh`` or a shape) is the plan's mesh."""
    shape = tuple(int(s) for s in (mesh.shape if hasattr(mesh, "shape") and not isinstance(
        mesh, (list, tuple)) else mesh))
    names = getattr(mesh, "mesh_dim_names", None)
    if shape != plan.mesh_shape:
        raise PlanFileError(
            f"plan={plan.path}: mesh={'x'.join(map(str, plan.mesh_shape))} "
            f"({','.join(plan.mesh_names)}) does not match the mesh being applied "
            f"({'x'.join(map(str, shape))}); use the plan of a run with this mesh")
    if names is not None and tuple(names) != plan.mesh_names:
        raise PlanFileError(f"plan={plan.path}: mesh names {','.join(plan.mesh_names)} do "
                            f"not match the mesh being applied ({','.join(names)})")


def check_world_size(plan: Plan, world_size: int) -> None:
    """Fail unless the plan's mesh has ``world_size`` devices."""
    if int(world_size) != plan.world_size:
        raise PlanFileError(
            f"plan={plan.path}: mesh={'x'.join(map(str, plan.mesh_shape))} has "
            f"{plan.world_size} devices but {world_size} processes were given; allowed "
            f"exactly {plan.world_size}")


def check_model(plan: Plan, model: Any) -> None:
    """Fail unless ``model`` (an ``nn.Module`` or a model hash) is the plan's model."""
    got = model if isinstance(model, str) else model_hash_of_module(model)
    if got != plan.model_hash:
        raise PlanFileError(
            f"plan={plan.path}: model hash {plan.model_hash} (model {plan.model_name}) does "
            f"not match the model being applied ({got}): the plan belongs to another model "
            "(parameter names, shapes or dtypes differ)")


def check_model_config(plan: Plan, model_config: dict[str, Any]) -> None:
    """Fail unless the plan was traced from ``model_config`` (the resolved ``model``
    config), naming the first key that differs; a plan without a recorded config
    passes (its model and trace hashes are checked instead)."""
    if plan.model_config is None:
        return
    for key in sorted(set(plan.model_config) | set(model_config)):
        mine, theirs = plan.model_config.get(key), model_config.get(key)
        if mine != theirs:
            raise PlanFileError(
                f"plan={plan.path}: model.{key}={json.dumps(mine)} in the plan, "
                f"{json.dumps(theirs)} in the config being applied: the plan belongs to "
                "another model config")


def check_graph(plan: Plan, graph: Any) -> None:
    """Fail unless the graph IR ``graph`` (a pyarrow table, a pandas data frame or the
    path of ``graph.parquet``: :func:`pipeline.plan.legality.graph_table`) is the trace
    the plan was made from, and every node's output and input placements are legal for
    the shapes the graph gives them (:func:`pipeline.plan.legality.node_problem`)."""
    try:
        table = graph_table(graph)
    except TypeError as err:
        raise PlanFileError(f"plan={plan.path}: {err}") from None
    except (OSError, ValueError) as err:
        raise PlanFileError(f"plan={plan.path}: graph={graph}: cannot read the graph IR "
                            f"({str(err).splitlines()[0] if str(err) else type(err).__name__})"
                            ) from None
    try:
        got = trace_hash(table)
    except (KeyError, TypeError, ValueError) as err:
        raise PlanFileError(f"plan={plan.path}: graph: not a graph IR table ({type(err).__name__}"
                            f": {str(err).splitlines()[0] if str(err) else ''}); allowed the "
                            "table of graph.parquet") from None
    if got != plan.trace_hash:
        raise PlanFileError(
            f"plan={plan.path}: trace hash {plan.trace_hash} does not match the traced graph "
            f"({got}): the plan was made from another trace (model config or torch version "
            "differ)")
    nodes = load_nodes(table)
    for n, pn in zip([n for n in nodes if n.kind != "output"], plan.nodes):
        why = node_problem(n, nodes, pn.output, pn.inputs, plan.mesh_shape)
        if why:
            raise PlanFileError(f"plan={plan.path}: nodes[{pn.name}].{why}")
