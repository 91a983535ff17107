"""Whether a plan's placements are legal for its tensors: each placement alone, and
every node's output and input placements against the traced graph's shapes.

A placement is *legal* for a tensor of shape ``s`` on a mesh of shape ``m`` when it has
one token per mesh dim, every ``S(d)`` names a dim of the tensor
(``-len(s) <= d < len(s)``), and every sharded tensor dim ``d`` has at least as many
elements as shards of it, ``s[d] >= prod(m[i] for the mesh dims i sharding d)``
(DTensor's ``is_tensor_shardable``; uneven shards are allowed). Partial tokens are legal
for intermediates, never for stored tensors (parameters, buffers, model inputs).

The plan file records shapes for its parameters, buffers and inputs only; the shapes
of the other nodes' outputs and arguments come from the graph IR the plan was made
from (``graph.parquet``), which :func:`graph_table` accepts as a pyarrow table, a
pandas data frame (as ``pandas.read_parquet`` gives it) or a path.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pipeline.core.ir import IRNode

__all__ = ["graph_table", "node_problem", "placement_problem"]

#: The integer columns of ``graph.parquet`` (:mod:`pipeline.stages.trace.stage`).
_INT_COLUMNS = {"idx": "int32", "input_index": "int64"}


def placement_problem(text: str, shape: Sequence[int] | None, mesh_shape: Sequence[int],
                      partial_ok: bool) -> str | None:
    """Why ``text`` is not a legal placement of a tensor of ``shape`` on the mesh, or None.

    ``shape=None`` checks the syntax and token count only.
    """
    from pipeline.dtensor.placements import parse_placements

    try:
        pls = parse_placements(text, len(mesh_shape))
    except ValueError as err:
        return str(err)
    counts: dict[int, int] = {}
    for md, pl in enumerate(pls):
        if pl.is_partial():  # DTensor's masked and norm partials too (Partial subclasses)
            if not partial_ok:
                return (f"mesh dim {md} is Partial; allowed R or S(d) for parameters, "
                        "buffers and inputs")
            continue
        if pl.is_shard() and shape is not None:
            rank = len(shape)
            d = pl.dim
            if not -rank <= d < rank:
                return (f"Shard({d}) on mesh dim {md} of a {rank}-d tensor "
                        f"{list(shape)}; allowed S(d) with 0 <= d < {rank}")
            d %= rank
            counts[d] = counts.get(d, 1) * int(mesh_shape[md])
    for d, c in sorted(counts.items()):
        if shape is not None and shape[d] < c:
            return (f"tensor dim {d} of size {shape[d]} cannot be split into {c} shards "
                    f"(tensor {list(shape)})")
    return None


def graph_table(graph: Any) -> Any:
    """The graph IR as a pyarrow table: ``graph`` itself, a pandas data frame of the
    same columns, or the path of a ``graph.parquet``.

    Raises:
        TypeError: anything else (the message names what is allowed).
    """
    import pyarrow as pa

    if isinstance(graph, pa.Table):
        return graph
    if isinstance(graph, (str, Path)):
        from pipeline.core import runtime

        return runtime.read_parquet(Path(graph))
    if type(graph).__name__ == "DataFrame" and hasattr(graph, "columns"):
        # pandas holds an integer column with nulls (input_index) as float64 with NaN;
        # the IR's integer columns are cast back so the trace hash reads the same rows.
        table = pa.Table.from_pandas(graph, preserve_index=False)
        for name, kind in _INT_COLUMNS.items():
            i = table.schema.get_field_index(name)
            if i >= 0 and pa.types.is_floating(table.schema.field(i).type):
                table = table.set_column(i, name, table.column(i).cast(kind))
        return table
    raise TypeError(f"graph={type(graph).__name__}: allowed the graph IR as a pyarrow "
                    "Table, a pandas DataFrame or the path of graph.parquet")


def _shape(meta: Any) -> list[int] | None:
    if isinstance(meta, dict) and isinstance(meta.get("shape"), list):
        return meta["shape"]
    return None


def _arg_shapes(node: IRNode, nodes: Sequence[IRNode]) -> list[list[int] | None]:
    """The shape of each tensor argument of ``node`` (flattened order); a ``getitem``
    reads element ``args[1]`` of its producer's tuple output."""
    shapes: list[list[int] | None] = []
    for r in node.refs:
        outs = nodes[r].outputs or []
        if node.target == "getitem" and nodes[r].tuple_output:
            k = node.args[1] if len(node.args) > 1 and isinstance(node.args[1], int) else -1
            shapes.append(_shape(outs[k]) if 0 <= k < len(outs) else None)
        else:
            shapes.append(_shape(outs[0]) if outs else None)
    return shapes


def node_problem(node: IRNode, nodes: Sequence[IRNode], output: str,
                 inputs: Sequence[str], mesh_shape: Sequence[int]) -> str | None:
    """Why a plan node's ``output`` and ``inputs`` placements are not legal for the
    traced ``node`` (of the decoded graph ``nodes``), as ``<field>=<text>: <why>``; or
    None. Inputs are checked in the IR's flattened order; a count that differs from the
    node's tensor arguments is a problem too (placeholders have none)."""
    from pipeline.dtensor.placements import NON_TENSOR, format_placements, parse_output

    try:
        elems = parse_output(output, len(mesh_shape))
    except ValueError as err:
        return f"output={output}: {err}"
    for k, el in enumerate(elems):
        meta = node.outputs[k] if k < len(node.outputs or []) else None
        if el is None or _shape(meta) is None:
            continue
        why = placement_problem(format_placements(el), _shape(meta), mesh_shape,
                                partial_ok=True)
        if why:
            return f"output={output}: {why}"
    if node.kind == "placeholder":
        return None
    shapes = _arg_shapes(node, nodes)
    if len(inputs) != len(shapes):
        return (f"inputs has {len(inputs)} placements; allowed {len(shapes)}, one per "
                f"tensor argument of {node.target}")
    for k, (text, shape) in enumerate(zip(inputs, shapes)):
        if text == NON_TENSOR:
            continue
        why = placement_problem(text, shape, mesh_shape, partial_ok=True)
        if why:
            return f"inputs[{k}]={text}: {why}"
    return None
