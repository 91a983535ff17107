"""Stage 2 - topology: strategies, edges, groups and constraints from the graph IR.

For every node of the traced joint graph this stage enumerates its DTensor
sharding strategies on the N-D mesh, records the producer -> consumer edges,
groups nodes that are decided jointly, and applies the placement constraints.
Nothing here builds a solver model; the cost stage turns the result into an MRF.

Strategies (DESIGN.md "Words"; DTensor's ``OpSpec``):

* ops with a *single-dim* strategy function (``op_single_dim_strategy_funcs``)
  return, for one mesh dim, the valid ``[outputs..., inputs...]`` placement
  lists with ``_ShardingPlaceholder(d)`` for "some Shard(d)". We fill each
  placeholder with ``Shard(d)``, add the all-Replicate rule, and expand over
  the mesh dims (the
  Cartesian product, filtered for shardability and mixed partials).
* ops with a full strategy function (``op_strategy_funcs``: views, softmax,
  SDPA, ...) are called once with an ``OpStrategy`` per tensor argument that
  holds *every* candidate placement of that argument, so the function returns
  one ``OpSpec`` per reachable (output, expected inputs) combination.
* placeholders (parameters, buffers, inputs, tangents) get every valid
  non-Partial placement; ``getitem`` selects one element of its producer's
  tuple strategies; the graph output becomes one *sink* per element (the loss,
  each gradient), a gradient sink having its parameter's placements.
* a genuine op without any DTensor strategy falls back to all-Replicate and is
  counted and listed in ``topology.json``.

A placement is dropped when a tensor dim is smaller than the product of the
mesh dims sharding it (DTensor's ``is_tensor_shardable``).

Groups: forward/backward twins share an output placement (a parameter and its
gradient sink; a float model input and its gradient). With
``repeated_subgraphs`` the copies of a repeated block share the strategy index
of the first copy. Copies are recognised from the graph: nodes are labelled by
module path (``layers.3``), each node gets a structural hash (op, shapes,
dtypes, constant arguments and the hashes of its in-block inputs, a
Weisfeiler-Lehman style colouring over the DAG), and two blocks are copies
only when their multisets of hashes are equal. Corresponding nodes are paired
by (hash, graph order). Members of a group always have identical strategy
lists, so a group's domain is the first member's list and every member's
strategy index equals the group label (the filtered product of the tie).

Artifacts (in ``out_dir``): ``nodes.parquet`` (one row per MRF node: graph
nodes and sinks), ``strategies.parquet`` (one row per strategy of each distinct
strategy list), ``edges.parquet`` and ``topology.json`` (counts, fallbacks,
constraints; written last, the stage's sentinel).
"""

from __future__ import annotations

import contextlib
import fnmatch
import hashlib
import itertools
import json
import logging
import math
import re
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline import progress, runtime
from pipeline.errors import PlanError
from pipeline.placements import format_placements, local_shape, parse_placements

log = logging.getLogger(__name__)

TOPOLOGY_FILE = "topology.json"
NODES_FILE = "nodes.parquet"
STRATEGIES_FILE = "strategies.parquet"
EDGES_FILE = "edges.parquet"
_REF_RE = re.compile(r'\{"node": \d+\}')  # a tensor reference in JSON text


class TopologyError(PlanError):
    """A constraint or graph fact that makes the placement problem ill-posed."""


# --------------------------------------------------------------------------- graph IR


@dataclass
class GNode:
    """One node of the graph IR (decoded)."""

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


def _refs(obj: Any) -> list[int]:
    if isinstance(obj, dict):
        if set(obj) == {"node"}:
            return [obj["node"]]
        return [r for v in obj.values() for r in _refs(v)]
    if isinstance(obj, list):
        return [r for v in obj for r in _refs(v)]
    return []


def load_nodes(table: pa.Table) -> list[GNode]:
    """Decode the graph IR table into :class:`GNode` objects (graph order).

    Equal ``outputs`` / ``output_desc`` texts (the copies of a repeated layer) are
    decoded once and share one (read-only) object.
    """
    cols = table.to_pydict()
    shared: dict[str, Any] = {}

    def decode(text: str) -> Any:
        hit = shared.get(text)
        if hit is None:
            hit = shared[text] = json.loads(text)
        return hit

    nodes = []
    for i in range(table.num_rows):
        args_text, kwargs_text, outputs_text = (cols["args"][i], cols["kwargs"][i],
                                                cols["outputs"][i])
        args = json.loads(args_text)
        kwargs = json.loads(kwargs_text)
        od = cols["output_desc"][i]
        n = GNode(
            idx=cols["idx"][i], name=cols["name"][i], kind=cols["kind"][i],
            target=cols["target"][i], args=args, kwargs=kwargs,
            outputs=decode(outputs_text), tuple_output=cols["tuple_output"][i],
            role=cols["role"][i], fqn=cols["fqn"][i], layer=cols["layer"][i],
            phase=cols["phase"][i], output_desc=decode(od) if od else None,
            module_path=cols["module_path"][i] or "", args_text=args_text,
            kwargs_text=kwargs_text, outputs_text=outputs_text)
        n.refs = _refs(args) + _refs(kwargs)
        nodes.append(n)
    return nodes


# --------------------------------------------------------------------------- placements


def candidate_placements(shape: list[int], mesh_shape: tuple[int, ...],
                         partial: bool) -> list[tuple]:
    """Every placement of a tensor of ``shape`` on the mesh, one token per mesh dim.

    Per mesh dim: Replicate, Shard(d) for each tensor dim, and Partial(sum) if
    ``partial``. Placements where a tensor dim is smaller than the product of
    the mesh sizes sharding it are dropped. Order: itertools.product over mesh
    dims of (R, S(0), ..., S(r-1), P) - deterministic.
    """
    from torch.distributed.tensor import Partial, Replicate, Shard

    opts: list = [Replicate()] + [Shard(d) for d in range(len(shape))]
    if partial:
        opts.append(Partial())
    out = []
    for combo in itertools.product(opts, repeat=len(mesh_shape)):
        if shardable(shape, combo, mesh_shape):
            out.append(tuple(combo))
    return out


def shardable(shape: list[int] | tuple[int, ...], placements: tuple,
              mesh_shape: tuple[int, ...]) -> bool:
    """True when every sharded tensor dim is at least as large as its shard count."""
    counts: dict[int, int] = {}
    for mdim, p in enumerate(placements):
        d = getattr(p, "dim", None)
        if d is None or not p.is_shard():
            continue
        d = d % max(len(shape), 1)
        counts[d] = counts.get(d, 1) * mesh_shape[mdim]
    return all(d < len(shape) and shape[d] >= c for d, c in counts.items())


# --------------------------------------------------------------------------- strategies


_DTYPE_MAP: dict[str, Any] = {}


def _decode_value(obj: Any) -> Any:
    """Decode a non-tensor IR argument back to a Python/torch value."""
    import torch

    if isinstance(obj, list):
        return [_decode_value(v) for v in obj]
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
        return {k: _decode_value(v) for k, v in obj.items()}
    return obj


def resolve_op(target: str) -> Any:
    """``"aten.mm.default"`` -> ``torch.ops.aten.mm.default`` (None if unknown)."""
    import torch

    parts = target.split(".")
    if len(parts) != 3 or parts[0] != "aten":
        return None
    try:
        return getattr(getattr(torch.ops.aten, parts[1]), parts[2])
    except AttributeError:
        return None


@dataclass(frozen=True)
class StrategyList:
    """The strategies of one node signature.

    Attributes:
        outputs: per strategy the output placement; for a tuple-returning op a
            tuple with one placement (or None) per element.
        inputs: per strategy the expected placement of each tensor argument
            (flattened args then kwargs order).
        fallback: True when the op had no DTensor strategy (replicate-only).
    """

    outputs: tuple
    inputs: tuple
    fallback: bool = False

    def __len__(self) -> int:
        return len(self.outputs)


class StrategyEnumerator:
    """Enumerates DTensor strategies per node signature on one mesh, memoised.

    The memo key is the node's op, its argument structure with each tensor
    replaced by (shape, dtype, stride), its constant arguments and output
    metadata - so the copies of a repeated layer cost one enumeration.
    """

    def __init__(self, mesh: Any, mesh_shape: tuple[int, ...]):
        from torch.distributed.tensor import DTensor

        self.mesh = mesh
        self.mesh_shape = mesh_shape
        self.prop = DTensor._op_dispatcher.sharding_propagator
        self.cache: dict[str, StrategyList] = {}
        # Cheap first-level memo: (op, argument texts with references blanked, output
        # text, identities of the argument metadata) -> (StrategyList, the metadata,
        # kept alive so their ids stay unique).
        self.text_cache: dict[tuple, tuple[StrategyList, tuple]] = {}
        self.placeholder_cache: dict[tuple, list[tuple]] = {}
        self.shardable_cache: dict[tuple, bool] = {}
        self.seconds = 0.0

    def placements_of(self, shape: list[int], partial: bool) -> list[tuple]:
        key = (tuple(shape), partial)
        if key not in self.placeholder_cache:
            self.placeholder_cache[key] = candidate_placements(shape, self.mesh_shape, partial)
        return self.placeholder_cache[key]

    def op_strategies(self, node: GNode, metas: list[dict]) -> StrategyList:
        """Strategies of a call_function node; ``metas`` are its tensor args' metadata."""
        tkey = None
        if node.args_text is not None and node.kwargs_text is not None \
                and node.outputs_text is not None:
            # Equal texts and identical metadata objects imply an equal signature key
            # below, so this memo only skips building that key (for layer copies).
            tkey = (node.target, _REF_RE.sub("T", node.args_text),
                    _REF_RE.sub("T", node.kwargs_text), node.outputs_text,
                    tuple(id(m) for m in metas))
            hit2 = self.text_cache.get(tkey)
            if hit2 is not None:
                return hit2[0]
        key = json.dumps([node.target, _sig_args(node.args, metas), _sig_args(node.kwargs, metas),
                          node.outputs], sort_keys=True)
        hit = self.cache.get(key)
        if hit is not None:
            if tkey is not None:
                self.text_cache[tkey] = (hit, tuple(metas))
            return hit
        start = time.perf_counter()
        op = resolve_op(node.target)
        result = None
        if op is not None:
            with _without_dtensor_costs():
                if op in self.prop.op_single_dim_strategy_funcs:
                    result = self._single_dim(op, node, metas)
                elif op in self.prop.op_strategy_funcs:
                    result = self._full(op, node, metas)
        if result is None or len(result) == 0:
            result = self._replicate_only(node, metas)
        self.cache[key] = result
        if tkey is not None:
            self.text_cache[tkey] = (result, tuple(metas))
        self.seconds += time.perf_counter() - start
        return result

    # -- helpers ---------------------------------------------------------------------------

    def _spec(self, placements: tuple, meta: dict) -> Any:
        import torch
        from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

        tm = TensorMeta(torch.Size(meta["shape"]), tuple(meta["stride"]),
                        getattr(torch, meta["dtype"]))
        return DTensorSpec(self.mesh, placements, tensor_meta=tm)

    def _out_meta(self, node: GNode) -> Any:
        import torch
        from torch.distributed.tensor._dtensor_spec import TensorMeta

        def tm(m: dict | None) -> Any:
            if m is None:
                return None
            return TensorMeta(torch.Size(m["shape"]), tuple(m["stride"]),
                              getattr(torch, m["dtype"]))

        if node.tuple_output:
            return tuple(tm(m) for m in node.outputs)
        return tm(node.outputs[0])

    def _schema(self, op: Any, node: GNode, metas: list[dict], all_placements: bool,
                pick: dict[int, tuple] | None = None) -> Any:
        from torch.distributed.tensor import Replicate
        from torch.distributed.tensor._op_schema import OpSchema, OpSpec, OpStrategy, TupleStrategy

        counter = itertools.count()

        def build(obj: Any) -> Any:
            if isinstance(obj, dict) and set(obj) == {"node"}:
                k = next(counter)
                meta = metas[k]
                if pick is not None and k in pick:
                    pls = [pick[k]]
                elif all_placements:
                    floating = meta["dtype"] in ("float32", "bfloat16", "float16", "float64")
                    pls = self.placements_of(meta["shape"], partial=floating)
                else:
                    pls = [(Replicate(),) * len(self.mesh_shape)]
                return OpStrategy([OpSpec(self._spec(p, meta)) for p in pls])
            if isinstance(obj, list):
                items = [build(v) for v in obj]
                if items and all(isinstance(v, OpStrategy) for v in items):
                    return TupleStrategy(items)  # a Tensor[] argument
                return items
            return _decode_value(obj)

        args = tuple(build(a) for a in node.args)
        kwargs = {k: build(v) for k, v in node.kwargs.items()}
        return OpSchema(op, args, kwargs, schema_info=self.prop.op_to_schema_info.get(op))

    def _single_dim(self, op: Any, node: GNode, metas: list[dict]) -> StrategyList | None:
        from torch.distributed.tensor import Replicate
        from torch.distributed.tensor._ops.single_dim_strategy import _ShardingPlaceholder
        from torch.distributed.tensor.placement_types import Shard

        info = self.prop.op_single_dim_strategy_funcs[op]
        schema = self._schema(op, node, metas, all_placements=False)
        rules = info.func(op, schema.args_meta, schema.kwargs_meta)
        n_in = len(metas)
        if not rules:
            return None
        n_out = len(rules[0]) - n_in
        filled = []
        for rule in rules:
            filled.append([Shard(p.dim) if isinstance(p, _ShardingPlaceholder) else p
                           for p in rule])
        out_meta = self._out_meta(node)
        rep = [Replicate()] * (n_out + n_in)
        if isinstance(out_meta, tuple):
            for i, m in enumerate(out_meta[:n_out]):
                if m is None:
                    rep[i] = None
        if not any(all(p is None or isinstance(p, Replicate) for p in r) for r in filled):
            filled.insert(0, rep)
        return self._expand(node, metas, filled, n_out)

    def _expand(self, node: GNode, metas: list[dict], rules: list[list], n_out: int
                ) -> StrategyList:
        """Expand single-mesh-dim rules to the N-D mesh (Cartesian product).

        Mirrors DTensor's ``expand_to_full_mesh_op_strategy`` filters without
        building a DTensorSpec per combination: a combination is skipped when a
        tensor mixes Partial kinds (other than sum with avg) or when an input
        or output dim is smaller than its shard count.
        """
        from torch.distributed.tensor import Partial

        ndim = len(self.mesh_shape)
        shapes = [m["shape"] if m is not None else None for m in node.outputs[:n_out]]
        shapes += [m["shape"] for m in metas]
        outs, ins, seen = [], [], set()
        for combo in itertools.product(range(len(rules)), repeat=ndim):
            per_pos = []
            ok = True
            for pos in range(len(rules[0])):
                pl = tuple(rules[c][pos] for c in combo)
                if pl[0] is None:
                    per_pos.append(None)
                    continue
                kinds = {(type(p), p.reduce_op) for p in pl if isinstance(p, Partial)}
                if len(kinds) > 1 and not ({k[1] for k in kinds} == {"sum", "avg"}
                                           and len({k[0] for k in kinds}) == 1):
                    ok = False
                    break
                shape = shapes[pos] if pos < len(shapes) else None
                if shape is not None and not self._shardable(tuple(shape), pl):
                    ok = False
                    break
                per_pos.append(pl)
            if not ok:
                continue
            out = tuple(per_pos[:n_out]) if node.tuple_output else per_pos[0]
            if node.tuple_output and n_out == 1:
                out = (per_pos[0],) + (None,) * (len(node.outputs) - 1)
            inp = tuple(per_pos[n_out:])
            key = (out, inp)
            if key in seen:
                continue
            seen.add(key)
            outs.append(out)
            ins.append(inp)
        return StrategyList(tuple(outs), tuple(ins))

    def _shardable(self, shape: tuple, pl: tuple) -> bool:
        key = (shape, pl)
        hit = self.shardable_cache.get(key)
        if hit is None:
            hit = self.shardable_cache[key] = shardable(shape, pl, self.mesh_shape)
        return hit

    def _full(self, op: Any, node: GNode, metas: list[dict]) -> StrategyList | None:
        """Call the op's full strategy function with every candidate input placement.

        Some strategy functions reject particular input placements by raising
        (e.g. a view that cannot unflatten an unevenly sharded dim), or expect
        every argument to offer the same number of placements (``nll_loss_backward``
        zips its arguments' strategies). Then the function is called once per
        candidate placement of each tensor argument in turn (the others
        Replicate), and rejected candidates are skipped: they are not strategies
        DTensor accepts for this op.

        "Follow" strategy functions (``cat``, ``stack``, ...) derive a single
        strategy from the placements their inputs currently have; offered every
        candidate at once they answer for one of them. When the all-candidate call
        gives exactly one OpSpec, the function is also called once per candidate
        placement (given to every tensor input of the first input's rank) and the
        union is kept.
        """
        from torch.distributed.tensor._op_schema import OpStrategy, TupleStrategy

        func = self.prop.op_strategy_funcs[op]

        def floating(meta: dict) -> bool:
            return meta["dtype"] in ("float32", "bfloat16", "float16", "float64")

        def call_each(picks: Iterator[dict[int, tuple]]) -> list:
            found = []
            for pick in picks:
                schema = self._schema(op, node, metas, all_placements=False, pick=pick)
                try:
                    found.append(func(schema))
                except Exception:  # noqa: BLE001 - see above
                    continue
            return found

        def one_arg_at_a_time() -> Iterator[dict[int, tuple]]:
            for k, meta in enumerate(metas):
                for cand in self.placements_of(meta["shape"], partial=floating(meta)):
                    yield {k: cand}

        def same_rank_together() -> Iterator[dict[int, tuple]]:
            rank = len(metas[0]["shape"])
            same = [k for k, m in enumerate(metas) if len(m["shape"]) == rank]
            for cand in self.placements_of(metas[0]["shape"], partial=floating(metas[0])):
                yield {k: cand for k in same}

        try:
            schema = self._schema(op, node, metas, all_placements=True)
            strats = [func(schema)]
        except Exception:  # noqa: BLE001 - DTensor signals rejected placements by raising
            strats = call_each(one_arg_at_a_time())
        else:
            if (len(strats) == 1 and isinstance(strats[0], OpStrategy)
                    and len(strats[0].strategies) == 1 and len(metas) > 0):
                # A "follow" strategy (cat, stack, ...): DTensor derives ONE strategy
                # from the inputs' current placements, so offered every candidate at
                # once it answers for one of them only. Ask once per candidate,
                # given to every input of the first input's rank, and keep the union.
                strats += call_each(same_rank_together())
        specs: list = []
        for strat in strats:
            if isinstance(strat, OpStrategy):
                specs.extend(strat.strategies)
            elif isinstance(strat, TupleStrategy):
                return self._collect_tuple(node, metas, strat) if len(strats) == 1 else None
            else:
                return None
        return self._collect(node, metas, specs)

    def _collect(self, node: GNode, metas: list[dict], specs: list) -> StrategyList:
        from torch.distributed.tensor import Replicate

        outs, ins, seen = [], [], set()
        rep = (Replicate(),) * len(self.mesh_shape)
        for spec in specs:
            o = spec.output_specs
            if isinstance(o, (tuple, list)):
                out = tuple(None if s is None else tuple(s.placements) for s in o)
                metas_out = node.outputs
                ok = all(p is None or m is None or shardable(m["shape"], p, self.mesh_shape)
                         for p, m in zip(out, metas_out))
            else:
                out = tuple(o.placements)
                ok = node.outputs[0] is None or shardable(
                    node.outputs[0]["shape"], out, self.mesh_shape)
                if node.tuple_output:
                    out = (out,) + (None,) * (len(node.outputs) - 1)
            if not ok:
                continue
            in_specs = list(spec.input_specs or [])
            inp = [tuple(s.placements) if s is not None else rep for s in in_specs[: len(metas)]]
            inp += [rep] * (len(metas) - len(inp))
            if not all(shardable(m["shape"], p, self.mesh_shape) for p, m in zip(inp, metas)):
                continue
            key = (out, tuple(inp))
            if key in seen:
                continue
            seen.add(key)
            outs.append(out)
            ins.append(tuple(inp))
        return StrategyList(tuple(outs), tuple(ins))

    def _collect_tuple(self, node: GNode, metas: list[dict], strat: Any) -> StrategyList | None:
        children = [c for c in strat.children]
        if not children or any(len(c.strategies) != len(children[0].strategies)
                               for c in children):
            return None
        outs, ins = [], []
        for k in range(len(children[0].strategies)):
            out = tuple(tuple(c.strategies[k].output_spec.placements) for c in children)
            first = children[0].strategies[k]
            inp = tuple(tuple(s.placements) for s in (first.input_specs or []))
            if len(inp) != len(metas):
                return None
            outs.append(out)
            ins.append(inp)
        return StrategyList(tuple(outs), tuple(ins))

    def _replicate_only(self, node: GNode, metas: list[dict]) -> StrategyList:
        from torch.distributed.tensor import Replicate

        rep = (Replicate(),) * len(self.mesh_shape)
        if node.tuple_output:
            out: Any = tuple(None if m is None else rep for m in node.outputs)
        else:
            out = rep
        return StrategyList((out,), (tuple(rep for _ in metas),), fallback=True)


@contextlib.contextmanager
def _without_dtensor_costs() -> Iterator[None]:
    """Skip DTensor's redistribute-cost rows while enumerating strategies.

    Strategy functions fill ``OpSpec.redistribute_cost`` by calling
    ``generate_redistribute_costs`` for every (candidate input, strategy) pair -
    quadratic in the candidates and >95% of enumeration time. This project
    costs redistributions with its own model (pipeline/costmodel), so inside
    this context the helper returns zeros. The set of strategies is unchanged.
    """
    from torch.distributed.tensor._ops import utils as ops_utils

    original = ops_utils.generate_redistribute_costs

    def zeros(src_strategy: Any, dst_spec: Any) -> list[float]:
        return [0.0] * len(src_strategy.strategies)

    patched = [m for name, m in list(sys.modules.items())
               if name.startswith("torch.distributed.tensor") and m is not None
               and getattr(m, "generate_redistribute_costs", None) is original]
    for m in patched:
        m.generate_redistribute_costs = zeros
    try:
        yield
    finally:
        for m in patched:
            m.generate_redistribute_costs = original


def _sig_args(obj: Any, metas: list[dict], counter: list[int] | None = None) -> Any:
    """Argument structure with tensors replaced by their metadata (for memo keys)."""
    if counter is None:
        counter = [0]
    if isinstance(obj, dict) and set(obj) == {"node"}:
        m = metas[counter[0]]
        counter[0] += 1
        return ["T", m["shape"], m["dtype"], m["stride"]]
    if isinstance(obj, list):
        return [_sig_args(v, metas, counter) for v in obj]
    if isinstance(obj, dict):
        return {k: _sig_args(v, metas, counter) for k, v in obj.items()}
    return obj


# --------------------------------------------------------------------------- the problem


@dataclass
class MNode:
    """A node of the placement problem: a graph node or an output sink."""

    id: int
    name: str
    target: str
    role: str
    layer: str | None
    phase: str
    slist: int  # index of its StrategyList in Topology.slists
    producers: list[tuple[int, int]]  # (producer id, element or -1) per tensor arg
    in_metas: list[dict]
    out_metas: list[dict | None]
    args: Any = None
    kwargs: Any = None
    graph_idx: int | None = None
    fqn: str | None = None
    tied_to: int | None = None  # fwd/bwd twin (gradient sink -> parameter)
    min_ratio: float | None = None  # parameters: smallest local/full size, before pins
    args_text: str | None = None  # json.dumps(args) when known (the graph IR's text)
    kwargs_text: str | None = None


def _output_element_meta(nodes: list[GNode], ref: int, element: int) -> dict | None:
    n = nodes[ref]
    return n.outputs[element] if element >= 0 else n.outputs[0]


def structural_hashes(nodes: list[GNode], members: dict[str, list[int]]) -> dict[int, str]:
    """Weisfeiler-Lehman style hash of every node inside a block (see module docstring)."""
    out: dict[int, str] = {}
    for layer, idxs in members.items():
        inside = set(idxs)
        for i in sorted(idxs):
            n = nodes[i]
            parts: list[Any] = [n.kind, n.target, n.outputs, n.role]
            if n.kind == "placeholder":
                parts.append((n.fqn or "")[len(layer):])
            inputs = []
            for r in n.refs:
                if r in inside and r in out:
                    inputs.append(("in", out[r]))
                else:
                    inputs.append(("ext", nodes[r].outputs if not nodes[r].tuple_output else
                                   nodes[r].outputs, nodes[r].role))
            parts.append(inputs)
            parts.append(_strip_refs(n.args))
            parts.append(_strip_refs(n.kwargs))
            out[i] = hashlib.sha1(json.dumps(parts, sort_keys=True, default=str).encode()
                                  ).hexdigest()[:16]
    return out


def _strip_refs(obj: Any) -> Any:
    if isinstance(obj, dict) and set(obj) == {"node"}:
        return "T"
    if isinstance(obj, list):
        return [_strip_refs(v) for v in obj]
    if isinstance(obj, dict):
        return {k: _strip_refs(v) for k, v in obj.items()}
    return obj


def repeated_blocks(nodes: list[GNode]) -> tuple[list[list[list[int]]], dict[str, list[int]]]:
    """Recognise copies of repeated blocks.

    Returns ``(classes, members)``: ``classes`` is a list of block classes, each a
    list of blocks (lists of graph indices ordered so that position k of every
    block is the same node role); the first block of a class is its
    representative. ``members`` maps a block's module path to its graph indices.
    Blocks are grouped by module-path prefix (``layers``) and then by equality of
    their structural-hash multisets, so a block of another width is not a copy.
    """
    members: dict[str, list[int]] = {}
    for n in nodes:
        if n.layer is not None and n.kind != "output":
            members.setdefault(n.layer, []).append(n.idx)
    hashes = structural_hashes(nodes, members)
    by_key: dict[tuple, list[str]] = {}
    for layer, idxs in members.items():
        prefix = layer.rsplit(".", 1)[0]
        key = (prefix, tuple(sorted(hashes[i] for i in idxs)))
        by_key.setdefault(key, []).append(layer)
    classes = []
    for layers in by_key.values():
        if len(layers) < 2:
            continue
        layers.sort(key=lambda p: min(members[p]))
        blocks = [sorted(members[p], key=lambda i: (hashes[i], i)) for p in layers]
        classes.append(blocks)
    classes.sort(key=lambda blocks: blocks[0][0])
    return classes, members


@dataclass
class Topology:
    """The extracted placement problem (before costs).

    Attributes:
        mesh_shape, mesh_names: the device mesh.
        nodes: MRF nodes (graph nodes in graph order, then sinks).
        slists: distinct strategy lists; ``nodes[i].slist`` indexes it.
        edges: ``(producer, element, consumer, arg)`` per tensor argument use.
        group_of: group index per node; groups are numbered by first member.
        copies: per group, its member node ids (representative first).
        fallback_ops: targets that fell back to replicate-only.
        constraints: applied pins ``{node name: placement text}``.
    """

    mesh_shape: tuple[int, ...]
    mesh_names: tuple[str, ...]
    nodes: list[MNode]
    slists: list[StrategyList]
    edges: list[tuple[int, int, int, int]]
    group_of: list[int]
    groups: list[list[int]]
    fallback_ops: dict[str, int]
    constraints: dict[str, str]
    layer_classes: list[dict]
    seconds: dict[str, float]


def build_topology(nodes: list[GNode], mesh: Any, mesh_shape: tuple[int, ...],
                   mesh_names: tuple[str, ...], constraints: dict[str, Any],
                   repeated_subgraphs: bool) -> Topology:
    """Build the placement problem from the decoded graph (see module docstring).

    ``constraints`` keys used here: ``inputs`` (placement text for plain model
    inputs, default Shard(0) on the first mesh dim and Replicate elsewhere),
    ``nodes`` (list of ``{match, placement}`` pins), ``fwd_bwd_consistency``.
    Raises TopologyError for a pin that matches nothing or no strategy.
    """
    from torch.distributed.tensor import Partial, Replicate, Shard

    t0 = time.perf_counter()
    ndim = len(mesh_shape)
    enum = StrategyEnumerator(mesh, mesh_shape)
    slists: list[StrategyList] = []
    slist_index: dict[int, int] = {}

    def intern(sl: StrategyList) -> int:
        key = id(sl)
        if key not in slist_index:
            slist_index[key] = len(slists)
            slists.append(sl)
        return slist_index[key]

    rep = (Replicate(),) * ndim
    inputs_text = constraints.get("inputs")
    input_pin = (parse_placements(inputs_text, ndim) if inputs_text
                 else (Shard(0),) + (Replicate(),) * (ndim - 1))
    pins: dict[str, str] = {}
    requests: list[tuple[int, tuple, str, str]] = []  # (node id, placement, key, text)
    mnodes: list[MNode] = []
    fallback: dict[str, int] = {}
    id_of: dict[int, int] = {}
    placeholder_lists: dict[tuple, StrategyList] = {}

    def placeholder_list(shape: list[int]) -> StrategyList:
        key = tuple(shape)
        if key not in placeholder_lists:
            pls = enum.placements_of(shape, partial=False)
            placeholder_lists[key] = StrategyList(tuple(pls), tuple(() for _ in pls))
        return placeholder_lists[key]

    for n in progress.bar(nodes, desc="topology: strategies", unit="node"):
        if n.kind == "output":
            continue
        metas = []
        producers = []
        if n.kind == "call_function" and n.target == "getitem":
            element = int(n.args[1])
            producers = [(id_of[n.refs[0]], element)]
            metas = [_output_element_meta(nodes, n.refs[0], element)]
        else:
            for r in n.refs:
                producers.append((id_of[r], -1))
                metas.append(nodes[r].outputs[0])
        if n.kind == "placeholder":
            meta = n.outputs[0]
            sl = placeholder_list(meta["shape"]) if meta is not None else StrategyList(
                (rep,), ((),))
            if n.role == "input":
                requests.append((len(mnodes), input_pin, "constraints.inputs",
                                 format_placements(input_pin)))
        elif n.target == "getitem":
            prod = mnodes[producers[0][0]]
            element = producers[0][1]
            seen: dict[tuple, None] = {}
            for o in slists[prod.slist].outputs:
                p = o[element] if isinstance(o[0], tuple) or o[0] is None else o
                if p is not None:
                    seen.setdefault(p, None)
            pls = list(seen) or [rep]
            sl = StrategyList(tuple(pls), tuple((p,) for p in pls))
            key = ("getitem", prod.slist, element)
            sl = placeholder_lists.setdefault(key, sl)  # share identical lists
        else:
            sl = enum.op_strategies(n, metas)
            if sl.fallback:
                fallback[n.target] = fallback.get(n.target, 0) + 1
        id_of[n.idx] = len(mnodes)
        mnodes.append(MNode(
            id=len(mnodes), name=n.name, target=n.target, role=n.role, layer=n.layer,
            phase=n.phase, slist=intern(sl), producers=producers, in_metas=metas,
            out_metas=n.outputs, args=n.args, kwargs=n.kwargs, graph_idx=n.idx, fqn=n.fqn,
            args_text=n.args_text, kwargs_text=n.kwargs_text))
    t_strat = time.perf_counter() - t0

    # The loss is Replicate (DESIGN.md): its sink accepts only Replicate. The op
    # producing it may output Partial (a batch-sharded mean), and the edge into the
    # sink then pays the all-reduce, as gradient sinks pay their reduce-scatter.
    out_node = next(n for n in nodes if n.kind == "output")
    param_of = {m.fqn: m.id for m in mnodes if m.role == "param"}
    flat_outs = out_node.args[0] if out_node.args else []
    descs = out_node.output_desc or [{"kind": "none"}] * len(flat_outs)
    for k, (ref, desc) in enumerate(zip(flat_outs, descs)):
        if not isinstance(ref, dict) or "node" not in ref:
            continue
        src = id_of[ref["node"]]
        meta = nodes[ref["node"]].outputs[0]
        if meta is None:
            continue
        if desc["kind"] == "grad" and desc.get("grad_of") in param_of:
            param = mnodes[param_of[desc["grad_of"]]]
            sl = slists[param.slist]
            sink_sl = StrategyList(sl.outputs, tuple((o,) for o in sl.outputs))
            sink_sl = placeholder_lists.setdefault(("sink", param.slist), sink_sl)
            name, role, layer, tied = f"output:grad:{param.fqn}", "grad", param.layer, param.id
        else:
            sink_sl = placeholder_lists.setdefault(("loss",), StrategyList((rep,), ((rep,),)))
            name, role, layer, tied = f"output:{k}", "output", None, None
        mnodes.append(MNode(
            id=len(mnodes), name=name, target="output", role=role, layer=layer, phase="bwd",
            slist=intern(sink_sl), producers=[(src, -1)], in_metas=[meta], out_metas=[meta],
            tied_to=tied, fqn=desc.get("grad_of")))

    # The model output (logits): constraints.outputs.
    outputs_text = constraints.get("outputs")
    if outputs_text:
        want = parse_placements(outputs_text, ndim)
        logits = find_logits(nodes, flat_outs, descs)
        if logits is None:
            raise TopologyError(f"constraints.outputs={outputs_text}: no model output found "
                                "before the loss")
        requests.append((id_of[logits], want, "constraints.outputs", outputs_text))

    # User pins on node outputs.
    for entry in constraints.get("nodes") or []:
        match, text = entry["match"], entry["placement"]
        want = parse_placements(text, ndim)
        if any(isinstance(p, Partial) for p in want):
            hit_roles = {m.role for m in mnodes if _matches(m, match)}
            if hit_roles & {"param", "buffer", "input", "tangent", "grad"}:
                raise TopologyError(
                    f"constraints.nodes[match={match}]: placement={text} is Partial, "
                    "not allowed for parameters, inputs or gradients")
        hits = [m for m in mnodes if _matches(m, match)]
        if not hits:
            raise TopologyError(f"constraints.nodes[match={match}]: matches no node")
        for m in hits:
            requests.append((m.id, want, f"constraints.nodes[match={match}]", text))

    edges = []
    for m in mnodes:
        for a, (p, element) in enumerate(m.producers):
            edges.append((p, element, m.id, a))

    # Groups: union-find over ties, members must share the strategy list.
    parent = list(range(len(mnodes)))

    def find(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    def union(a: int, b: int) -> bool:
        sa, sb = slists[mnodes[a].slist], slists[mnodes[b].slist]
        if sa is not sb and sa.outputs != sb.outputs:
            return False
        ra, rb = find(a), find(b)
        if ra != rb:
            parent[max(ra, rb)] = min(ra, rb)
        return True

    if constraints.get("fwd_bwd_consistency", True):
        for m in mnodes:
            if m.tied_to is not None:
                union(m.tied_to, m.id)
    classes_info = []
    if repeated_subgraphs:
        classes, _ = repeated_blocks(nodes)
        sinks_by_param = {m.tied_to: m.id for m in mnodes if m.tied_to is not None}
        for blocks in classes:
            rep_block = blocks[0]
            tied = 0
            for block in blocks[1:]:
                for a, b in zip(rep_block, block):
                    ia, ib = id_of[a], id_of[b]
                    if not union(ia, ib):
                        continue
                    tied += 1
                    if ia in sinks_by_param and ib in sinks_by_param:
                        union(sinks_by_param[ia], sinks_by_param[ib])
            classes_info.append({
                "blocks": [nodes[b[0]].layer for b in blocks],
                "nodes_per_block": len(rep_block), "tied_pairs": tied})
    roots: dict[int, int] = {}
    group_of = []
    groups: list[list[int]] = []
    for m in mnodes:
        r = find(m.id)
        if r not in roots:
            roots[r] = len(groups)
            groups.append([])
        group_of.append(roots[r])
        groups[roots[r]].append(m.id)

    for m in mnodes:
        if m.role == "param" and m.out_metas and m.out_metas[0] is not None:
            m.min_ratio = min(_local_ratio(m.out_metas[0]["shape"], o, mesh_shape)
                              for o in slists[m.slist].outputs)

    # Pins restrict a whole group to the labels where the pinned member has the
    # placement, so every member keeps the same label indexing and ties survive.
    for node_id, want, key, text in requests:
        g = group_of[node_id]
        sl = slists[mnodes[node_id].slist]
        keep = [k for k, o in enumerate(sl.outputs) if o == want]
        if not keep:
            raise TopologyError(f"{key}: placement={text} is not a strategy of node "
                                f"{mnodes[node_id].name} (or of the nodes tied to it)")
        if len(keep) == len(sl):
            pins[mnodes[node_id].name] = text
            continue
        filtered: dict[int, int] = {}
        for member in groups[g]:
            old = mnodes[member].slist
            if old not in filtered:
                src = slists[old]
                filtered[old] = intern(StrategyList(tuple(src.outputs[k] for k in keep),
                                                    tuple(src.inputs[k] for k in keep),
                                                    src.fallback))
            mnodes[member].slist = filtered[old]
        pins[mnodes[node_id].name] = text

    return Topology(
        mesh_shape=mesh_shape, mesh_names=mesh_names, nodes=mnodes, slists=slists, edges=edges,
        group_of=group_of, groups=groups, fallback_ops=fallback, constraints=pins,
        layer_classes=classes_info,
        seconds={"strategies": t_strat, "total": time.perf_counter() - t0,
                 "dtensor_enumeration": enum.seconds})


def _local_ratio(shape: list[int], placements: tuple, mesh_shape: tuple[int, ...]) -> float:
    """Local elements / full elements of a tensor under ``placements``."""
    if not shape:
        return 1.0
    return math.prod(local_shape(shape, placements, mesh_shape)) / math.prod(shape)


def find_logits(nodes: list[GNode], flat_outs: list, descs: list) -> int | None:
    """The model's output before the loss: walking back from the loss value through
    forward ops outside any module (the loss function), the first node produced inside
    a module (for LLaMA the lm-head projection, ``[batch, seq, vocab]``)."""
    loss = next((r["node"] for r, d in zip(flat_outs, descs)
                 if isinstance(r, dict) and d.get("kind") == "loss"), None)
    if loss is None:
        return None
    frontier, seen = [loss], set()
    while frontier:
        i = frontier.pop(0)
        if i in seen:
            continue
        seen.add(i)
        n = nodes[i]
        if n.kind == "call_function" and n.module_path and n.phase == "fwd":
            return i
        frontier.extend(r for r in n.refs if nodes[r].role == "activation")
    return None


def _matches(m: MNode, pattern: str) -> bool:
    """A pin matches a node name, a parameter FQN (glob) or an op name (``aten.mm``)."""
    if fnmatch.fnmatchcase(m.name, pattern):
        return True
    if m.fqn and fnmatch.fnmatchcase(m.fqn, pattern) and m.role in ("param", "buffer"):
        return True
    return m.target == pattern or m.target.rsplit(".", 1)[0] == pattern


# --------------------------------------------------------------------------- artifacts


def device_mesh(mesh_shape: tuple[int, ...], mesh_names: tuple[str, ...]) -> Any:
    """A DeviceMesh on the fake process group (initialised to the mesh size)."""
    from torch.distributed.device_mesh import init_device_mesh

    from pipeline.trace import fake_process_group

    fake_process_group(math.prod(mesh_shape))
    return init_device_mesh("cpu", mesh_shape, mesh_dim_names=mesh_names)


def _fmt_out(o: Any) -> str:
    if o is None:
        return "-"
    if len(o) and (isinstance(o[0], tuple) or o[0] is None):
        return "(" + "|".join(_fmt_out(e) for e in o) + ")"
    return format_placements(o)


def write_topology(topo: Topology, out_dir: Path, meta: dict[str, Any]) -> None:
    """Write the topology artifacts; ``topology.json`` last (the sentinel)."""
    out_dir = Path(out_dir)
    nodes = topo.nodes
    # json.dumps of the metadata, once per object (copies of a layer share them); the
    # nodes keep the objects alive, so their ids stay unique meanwhile.
    texts: dict[int, str] = {}

    def dumps(obj: Any) -> str:
        hit = texts.get(id(obj))
        if hit is None:
            hit = texts[id(obj)] = json.dumps(obj)
        return hit

    runtime.write_parquet(out_dir / NODES_FILE, pa.table({
        "id": pa.array([m.id for m in nodes], pa.int32()),
        "name": [m.name for m in nodes],
        "target": [m.target for m in nodes],
        "role": [m.role for m in nodes],
        "layer": [m.layer for m in nodes],
        "phase": [m.phase for m in nodes],
        "fqn": [m.fqn for m in nodes],
        "graph_idx": pa.array([m.graph_idx for m in nodes], pa.int32()),
        "group": pa.array(topo.group_of, pa.int32()),
        "slist": pa.array([m.slist for m in nodes], pa.int32()),
        "num_strategies": pa.array([len(topo.slists[m.slist]) for m in nodes], pa.int32()),
        "fallback": [topo.slists[m.slist].fallback for m in nodes],
        "min_param_ratio": pa.array([m.min_ratio for m in nodes], pa.float64()),
        "args": [m.args_text if m.args_text is not None else json.dumps(m.args) for m in nodes],
        "kwargs": [m.kwargs_text if m.kwargs_text is not None else json.dumps(m.kwargs)
                   for m in nodes],
        # json.dumps of a list is its items' texts joined by ", " in brackets
        "in_metas": ["[" + ", ".join(dumps(x) for x in m.in_metas) + "]" for m in nodes],
        "out_metas": [dumps(m.out_metas) for m in nodes],
    }))
    sl_col, k_col, out_col, in_col = [], [], [], []
    for s, sl in enumerate(topo.slists):
        for k in range(len(sl)):
            sl_col.append(s)
            k_col.append(k)
            out_col.append(_fmt_out(sl.outputs[k]))
            in_col.append([format_placements(p) for p in sl.inputs[k]])
    runtime.write_parquet(out_dir / STRATEGIES_FILE, pa.table({
        "slist": pa.array(sl_col, pa.int32()), "strategy": pa.array(k_col, pa.int32()),
        "output": pa.array(out_col).dictionary_encode(),
        "inputs": pa.array(in_col, pa.list_(pa.string()))}))
    e = topo.edges
    runtime.write_parquet(out_dir / EDGES_FILE, pa.table({
        "producer": pa.array([x[0] for x in e], pa.int32()),
        "element": pa.array([x[1] for x in e], pa.int32()),
        "consumer": pa.array([x[2] for x in e], pa.int32()),
        "arg": pa.array([x[3] for x in e], pa.int32())}))
    summary = dict(meta)
    summary.update({
        "mesh": list(topo.mesh_shape), "mesh_names": list(topo.mesh_names),
        "counts": {
            "nodes": len(nodes), "edges": len(e), "groups": len(topo.groups),
            "strategy_lists": len(topo.slists),
            "strategies": sum(len(topo.slists[m.slist]) for m in nodes),
            "group_strategies": sum(len(topo.slists[nodes[g[0]].slist]) for g in topo.groups),
            "fallback_nodes": sum(topo.fallback_ops.values())},
        "fallback_ops": topo.fallback_ops, "pins": topo.constraints,
        "repeated_blocks": topo.layer_classes, "seconds": topo.seconds})
    runtime.write_json(out_dir / TOPOLOGY_FILE, summary)


def run_topology(cfg: Any, trace_dir: Path, out_dir: Path) -> None:
    """Stage entry point: read ``graph.parquet`` from ``trace_dir``, write the topology."""
    from omegaconf import OmegaConf

    from pipeline.trace import read_graph

    timer = runtime.PhaseTimer()
    with timer.phase("topology"):
        table, _ = read_graph(Path(trace_dir))
        nodes = load_nodes(table)
        mesh_shape = tuple(int(s) for s in cfg.mesh)
        mesh_names = tuple(cfg.mesh_names)
        constraints = OmegaConf.to_container(cfg.constraints, resolve=True) or {}
        mesh = device_mesh(mesh_shape, mesh_names)
        topo = build_topology(nodes, mesh, mesh_shape, mesh_names, constraints,
                              bool(cfg.repeated_layers))
    write_topology(topo, Path(out_dir), {
        "stage": "topology", "phase_seconds": timer.seconds,
        "peak_rss_bytes": runtime.peak_rss_bytes(), "git": runtime.git_revision()})


# --------------------------------------------------------------------------- reading back


@dataclass
class TopologyTables:
    """The topology artifacts read back (plain Python / numpy; no DTensor objects)."""

    summary: dict
    nodes: dict[str, list]
    slist_outputs: list[list[str]]
    slist_inputs: list[list[list[str]]]
    edges: dict[str, list]


def read_topology(topology_dir: Path) -> TopologyTables:
    """Load the topology artifacts written by :func:`write_topology`."""
    d = Path(topology_dir)
    summary = json.loads((d / TOPOLOGY_FILE).read_text())
    nodes = pq.read_table(d / NODES_FILE).to_pydict()
    st = pq.read_table(d / STRATEGIES_FILE)
    sl = st.column("slist").to_numpy()
    outs = st.column("output").to_pylist()
    ins = st.column("inputs").to_pylist()
    n_lists = int(sl.max()) + 1 if len(sl) else 0
    slist_outputs: list[list[str]] = [[] for _ in range(n_lists)]
    slist_inputs: list[list[list[str]]] = [[] for _ in range(n_lists)]
    for s, o, i in zip(sl.tolist(), outs, ins):
        slist_outputs[s].append(o)
        slist_inputs[s].append(i)
    edges = pq.read_table(d / EDGES_FILE).to_pydict()
    return TopologyTables(summary, nodes, slist_outputs, slist_inputs, edges)
