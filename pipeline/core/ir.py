"""The graph IR read back: its JSON conventions, and ``graph.parquet`` as IR nodes.

The trace stage (:mod:`pipeline.stages.trace.stage`, which needs torch) writes the IR;
every other stage, the plan format, apply and verify read it through this module, which
is torch-free (only :func:`decode_value` and :func:`resolve_op` import torch, to give
back torch objects).

The trace stage writes each node's ``args`` and ``kwargs`` as JSON. A tensor argument
is a *tensor reference* ``{"node": i}`` (:func:`tensor_ref`) to the node producing it
(its graph index); a few values JSON cannot hold are tagged one-key objects
(:func:`tagged`): ``{"dtype": "bfloat16"}``, ``{"enum": "cpu"}`` (devices, layouts,
memory formats), ``{"float": "inf"}`` (non-finite floats) and ``{"repr": ...}``
(anything else).

Tensor references are numbered in *flattened order*: a depth-first walk of ``args``
and then of ``kwargs``. Position ``k`` in that order is the node's tensor argument
``k``: its producer edge, its input metadata and its expected placement in a strategy
all use that index.

The ``target`` column names the op (``aten.mm.default``); :func:`resolve_op` turns it
back into the torch ``OpOverload``. The table's columns are listed in
:mod:`pipeline.stages.trace.stage`; :func:`read_graph` reads it, :func:`load_nodes`
decodes it into one :class:`IRNode` per FX node.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa

from pipeline.core import runtime
from pipeline.core.artifacts import GRAPH_FILE

__all__ = [
    "TAGS",
    "TENSOR_REF_RE",
    "IRNode",
    "decode_shared",
    "decode_value",
    "graph_outputs",
    "is_tensor_ref",
    "load_nodes",
    "map_tensor_refs",
    "output_meta",
    "read_graph",
    "read_nodes",
    "resolve_op",
    "tagged",
    "tensor_ref",
    "tensor_refs",
    "with_shapes",
]

#: A tensor reference in the IR's JSON text (``json.dumps`` spacing); group 1 is the
#: producer's graph index.
TENSOR_REF_RE = re.compile(r'\{"node": (\d+)\}')
#: The tags of the one-key objects that hold values JSON cannot (module docstring).
TAGS = ("dtype", "enum", "float", "repr")


def tensor_ref(index: int) -> dict[str, int]:
    """The tensor reference to the node at graph index ``index``."""
    return {"node": index}


def tagged(tag: str, text: str) -> dict[str, str]:
    """A value JSON cannot hold, as the one-key object ``{tag: text}`` (:data:`TAGS`)."""
    if tag not in TAGS:
        raise ValueError(f"IR tag {tag!r}: allowed {', '.join(TAGS)}")
    return {tag: text}


def is_tensor_ref(obj: Any) -> bool:
    """Whether a decoded IR value is a tensor reference ``{"node": i}``."""
    return isinstance(obj, dict) and set(obj) == {"node"}


def tensor_refs(obj: Any) -> list[int]:
    """The producer graph indices of the tensor references in ``obj``, flattened order."""
    if is_tensor_ref(obj):
        return [obj["node"]]
    if isinstance(obj, list):
        return [r for v in obj for r in tensor_refs(v)]
    if isinstance(obj, dict):
        return [r for v in obj.values() for r in tensor_refs(v)]
    return []


def map_tensor_refs(obj: Any, replace: Callable[[int], Any], start: int = 0) -> Any:
    """A copy of ``obj`` with tensor reference number ``k`` replaced by ``replace(k)``.

    References are numbered in flattened order from ``start`` (pass the number of
    references in ``args`` when mapping ``kwargs``); other values are kept as they are.
    """
    position = start

    def walk(x: Any) -> Any:
        nonlocal position
        if is_tensor_ref(x):
            position += 1
            return replace(position - 1)
        if isinstance(x, list):
            return [walk(v) for v in x]
        if isinstance(x, dict):
            return {k: walk(v) for k, v in x.items()}
        return x

    return walk(obj)


def with_shapes(obj: Any, shapes: Sequence[Any], start: int = 0) -> Any:
    """Replace tensor references by ``shapes`` (flattened order from ``start``); a
    reference beyond the end of ``shapes`` becomes None."""
    return map_tensor_refs(obj, lambda k: shapes[k] if k < len(shapes) else None, start)


def decode_shared(texts: Sequence[str | None]) -> list[Any]:
    """``json.loads`` of each text (None stays None), each distinct text decoded once.

    Equal texts (the copies of a repeated layer) share one decoded object: read the
    results, never modify them.
    """
    memo: dict[str, Any] = {}
    out = []
    for text in texts:
        if text is None:
            out.append(None)
            continue
        hit = memo.get(text)
        if hit is None:
            hit = memo[text] = json.loads(text)
        out.append(hit)
    return out


def decode_value(obj: Any) -> Any:
    """A non-tensor IR argument back as the Python / torch value the op takes."""
    import torch

    if isinstance(obj, list):
        return [decode_value(v) for v in obj]
    if isinstance(obj, dict):
        if "dtype" in obj and len(obj) == 1:
            return getattr(torch, obj["dtype"])
        if "enum" in obj and len(obj) == 1:
            text = obj["enum"]
            if text.startswith("torch."):
                return getattr(torch, text.split(".", 1)[1])
            return torch.device(text)
        if "float" in obj and len(obj) == 1:
            return float(obj["float"])
        return {k: decode_value(v) for k, v in obj.items()}
    return obj


# --------------------------------------------------------------------------- the table


@dataclass
class IRNode:
    """One node of the traced graph IR (a row of ``graph.parquet``, decoded)."""

    idx: int
    name: str
    kind: str
    target: str
    args: Any
    kwargs: Any
    outputs: list
    tuple_output: bool
    role: str
    fqn: str | None
    layer: str | None
    phase: str
    output_desc: list | None
    module_path: str = ""
    refs: list[int] = field(default_factory=list)  # tensor-arg producers, flattened order
    # The IR's JSON texts of args, kwargs and outputs (None when built by hand).
    args_text: str | None = None
    kwargs_text: str | None = None
    outputs_text: str | None = None


def read_graph(trace_dir: Path) -> tuple[pa.Table, dict]:
    """The graph IR table of a trace stage directory and its stage metadata."""
    table = runtime.read_parquet(Path(trace_dir) / GRAPH_FILE)
    meta = json.loads((table.schema.metadata or {}).get(b"pipeline", b"{}"))
    return table, meta


def load_nodes(table: pa.Table) -> list[IRNode]:
    """Decode the graph IR table into :class:`IRNode` objects (graph order).

    Equal ``outputs`` / ``output_desc`` texts (the copies of a repeated layer) are
    decoded once and share one (read-only) object.
    """
    cols = table.to_pydict()
    outputs = decode_shared(cols["outputs"])
    output_desc = decode_shared(cols["output_desc"])
    nodes = []
    for i in range(table.num_rows):
        args = json.loads(cols["args"][i])
        kwargs = json.loads(cols["kwargs"][i])
        nodes.append(IRNode(
            idx=cols["idx"][i], name=cols["name"][i], kind=cols["kind"][i],
            target=cols["target"][i], args=args, kwargs=kwargs, outputs=outputs[i],
            tuple_output=cols["tuple_output"][i], role=cols["role"][i], fqn=cols["fqn"][i],
            layer=cols["layer"][i], phase=cols["phase"][i], output_desc=output_desc[i],
            module_path=cols["module_path"][i] or "", refs=tensor_refs(args) + tensor_refs(kwargs),
            args_text=cols["args"][i], kwargs_text=cols["kwargs"][i],
            outputs_text=cols["outputs"][i]))
    return nodes


def read_nodes(trace_dir: Path) -> list[IRNode]:
    """The graph IR of a trace stage directory, decoded (:func:`load_nodes`)."""
    table, _ = read_graph(Path(trace_dir))
    return load_nodes(table)


def output_meta(nodes: list[IRNode], ref: int, element: int) -> dict | None:
    """Metadata of output ``element`` of node ``ref`` (``-1``: its single output)."""
    outputs = nodes[ref].outputs
    return outputs[element] if element >= 0 else outputs[0]


def graph_outputs(nodes: list[IRNode]) -> list[tuple[Any, dict]]:
    """The elements of the graph output: ``(tensor reference or value, description)``
    with the description ``{"kind": "loss" | "grad" | "none", "grad_of": fqn}``."""
    out_node = next(n for n in nodes if n.kind == "output")
    flat_outs = out_node.args[0] if out_node.args else []
    descs = out_node.output_desc or [{"kind": "none"}] * len(flat_outs)
    return list(zip(flat_outs, descs))


# --------------------------------------------------------------------------- op names


@functools.lru_cache(maxsize=4096)
def _op_of_name(name: str) -> tuple[Any, str | None]:
    """``(op, None)`` for the op a name denotes, ``(None, why not)`` for none."""
    import torch

    parts = name.strip().removeprefix("torch.ops.").split(".")
    if len(parts) < 2:
        return None, "expected 'namespace.op[.overload]', e.g. 'aten.mm.default'"
    obj: Any = torch.ops
    try:
        for part in parts:
            obj = getattr(obj, part)
    except (AttributeError, RuntimeError):
        return None, "no such torch.ops entry (expected e.g. 'aten.mm.default')"
    if isinstance(obj, torch._ops.OpOverloadPacket):
        return _packet_representative(obj), None
    return obj, None


def _packet_representative(packet: Any) -> Any:
    """``packet.default`` if it returns a tensor, else the first overload that does.

    (``aten.mul.default`` is the scalar ``mul(Scalar, Scalar)``; ``aten.mul.Tensor`` is
    the tensor op a graph would hold.)
    """
    names = ["default", *[n for n in packet.overloads() if n != "default"]]
    for name in names:
        overload = getattr(packet, name, None)
        if overload is not None and any("Tensor" in str(r.type) for r in overload._schema.returns):
            return overload
    return getattr(packet, names[0])


def resolve_op(op: Any, strict: bool = True) -> Any:
    """Turn ``op`` into an ``OpOverload`` where possible.

    Accepts an ``OpOverload`` (returned as is), an ``OpOverloadPacket`` (its
    ``.default``, or its first tensor-returning overload), or a name such as the IR's
    ``"aten.mm.default"`` or ``"torch.ops.aten.mm"``. Anything else
    (``operator.getitem``, a higher-order op, ...) is returned unchanged.

    Raises:
        ValueError: for a name that names no op, unless ``strict`` is False: then
            the result is None (the topology stage gives such a node the
            replicate-only fallback strategy).
    """
    import torch

    if isinstance(op, str):
        found, why_not = _op_of_name(op)
        if why_not is None:
            return found
        if not strict:
            return None
        raise ValueError(f"cannot resolve op {op!r}: {why_not}")
    if isinstance(op, torch._ops.OpOverloadPacket):
        return _packet_representative(op)
    return op
