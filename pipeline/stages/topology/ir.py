"""The graph IR read back: ``graph.parquet`` (pipeline/stages/trace/stage.py) as
:class:`IRNode` objects.

The JSON conventions of the IR (tensor references, tagged values) are in
:mod:`pipeline.core.ir`; this module decodes the table into one object per FX node.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa

from pipeline.core.ir import decode_shared, tensor_refs


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
    from pipeline.stages.trace.stage import read_graph

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
