"""DTensor sharding strategies of the graph's nodes on an N-D mesh.

A strategy (DTensor's ``OpSpec``) is an output placement plus the
expected placement of each tensor argument:

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
* a genuine op without any DTensor strategy falls back to all-Replicate
  (:meth:`StrategyEnumerator.op_strategies` marks the list ``fallback``).
* the SDPA flash-attention ops and the cross-entropy ops (``_log_softmax``,
  ``nll_loss``, their backwards) get strategies DTensor lacks appended after its own:
  context-parallel attention and vocab-parallel cross-entropy
  (pipeline/stages/topology/extra_strategies.py).

Placeholders, ``getitem`` and output sinks get their lists in
pipeline/stages/topology/problem.py.

A placement is dropped when a tensor dim is smaller than the product of the
mesh dims sharding it (DTensor's ``is_tensor_shardable``).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from pipeline.core.ir import (
    TENSOR_REF_RE,
    IRNode,
    decode_value,
    is_tensor_ref,
    map_tensor_refs,
    resolve_op,
    tensor_refs,
)

_FLOATING = ("float32", "bfloat16", "float16", "float64")


def _is_floating(meta: dict) -> bool:
    """Floating tensors may be Partial; integer ones (indices, masks) may not."""
    return meta["dtype"] in _FLOATING


def _tensor_meta(meta: dict | None) -> Any:
    """DTensor's ``TensorMeta`` of an IR tensor description (None stays None)."""
    import torch
    from torch.distributed.tensor._dtensor_spec import TensorMeta

    if meta is None:
        return None
    return TensorMeta(torch.Size(meta["shape"]), tuple(meta["stride"]),
                      getattr(torch, meta["dtype"]))


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
        self.propagator = DTensor._op_dispatcher.sharding_propagator
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

    def prefetch(self, nodes: list[IRNode], workers: int, min_signatures: int = 32) -> None:
        """Enumerate the strategies of the graph's distinct op signatures in ``workers``
        processes (pipeline/core/parallel.py), into the memo :meth:`op_strategies` reads.

        The distinct signatures (in graph order) are dealt round-robin to the workers;
        each enumerates its share exactly as :meth:`op_strategies` would and sends the
        lists back. Below ``min_signatures`` distinct signatures, or with one worker,
        nothing happens (the graph walk enumerates them as it meets them)."""
        from pipeline.core.parallel import map_chunks

        if workers <= 1:
            return
        todo: dict[str, tuple[IRNode, list[dict]]] = {}
        for n in nodes:
            if n.kind != "call_function" or n.target == "getitem":
                continue
            metas = [nodes[r].outputs[0] for r in n.refs]
            key = _signature(n, metas)
            if key not in self.cache and key not in todo:
                todo[key] = (n, metas)
        if len(todo) < min_signatures:
            return
        items = list(todo.values())
        start, before = time.perf_counter(), self.seconds

        def enumerate_chunk(chunk: tuple[int, range]) -> list[tuple[str, Any]]:
            worker, indices = chunk
            out: list[tuple[str, Any]] = []
            buffers: dict[int, int] = {}
            for k in indices:
                node, metas = items[k]
                strategies = self.op_strategies(node, metas)
                # a worker's lists are pickled on the way back: _MaskPartial as fields
                out.append((_signature(node, metas),
                            _portable(strategies, buffers) if worker else strategies))
            return out

        chunks = [(w, range(w, len(items), workers)) for w in range(workers)]
        for part in map_chunks(enumerate_chunk, chunks)[1:]:  # the first chunk ran here
            buffers: dict[int, Any] = {}
            for key, strategies in part:
                self.cache[key] = _restored(strategies, buffers)
        self.seconds = before + time.perf_counter() - start

    def op_strategies(self, node: IRNode, metas: list[dict]) -> StrategyList:
        """Strategies of a call_function node; ``metas`` are its tensor args' metadata."""
        text_key = None
        if node.args_text is not None and node.kwargs_text is not None \
                and node.outputs_text is not None:
            # Equal texts and identical metadata objects imply an equal signature key
            # below, so this memo only skips building that key (for layer copies).
            text_key = (node.target, TENSOR_REF_RE.sub("T", node.args_text),
                        TENSOR_REF_RE.sub("T", node.kwargs_text), node.outputs_text,
                        tuple(id(m) for m in metas))
            text_hit = self.text_cache.get(text_key)
            if text_hit is not None:
                return text_hit[0]
        key = _signature(node, metas)
        hit = self.cache.get(key)
        if hit is not None:
            if text_key is not None:
                self.text_cache[text_key] = (hit, tuple(metas))
            return hit
        start = time.perf_counter()
        op = resolve_op(node.target, strict=False)
        result = None
        if op is not None:
            with _without_dtensor_costs():
                if op in self.propagator.op_single_dim_strategy_funcs:
                    result = self._single_dim(op, node, metas)
                elif op in self.propagator.op_strategy_funcs:
                    result = self._full(op, node, metas)
        if result is None or len(result) == 0:
            result = self._replicate_only(node, metas)
        else:
            # context-parallel attention, vocab-parallel cross-entropy
            # (pipeline/stages/topology/extra_strategies.py)
            from pipeline.stages.topology.extra_strategies import with_extra_strategies

            result = with_extra_strategies(result, node.target, node.args, metas,
                                           node.outputs, node.tuple_output,
                                           len(self.mesh_shape), self._shardable)
        self.cache[key] = result
        if text_key is not None:
            self.text_cache[text_key] = (result, tuple(metas))
        self.seconds += time.perf_counter() - start
        return result

    # -- helpers ---------------------------------------------------------------------------

    def _spec(self, placements: tuple, meta: dict) -> Any:
        from torch.distributed.tensor._dtensor_spec import DTensorSpec

        return DTensorSpec(self.mesh, placements, tensor_meta=_tensor_meta(meta))

    def _out_meta(self, node: IRNode) -> Any:
        if node.tuple_output:
            return tuple(_tensor_meta(m) for m in node.outputs)
        return _tensor_meta(node.outputs[0])

    def _schema(self, op: Any, node: IRNode, metas: list[dict], all_placements: bool,
                pick: dict[int, tuple] | None = None) -> Any:
        from torch.distributed.tensor import Replicate
        from torch.distributed.tensor._op_schema import OpSchema, OpSpec, OpStrategy, TupleStrategy

        counter = itertools.count()

        def build(obj: Any) -> Any:
            if is_tensor_ref(obj):
                k = next(counter)
                meta = metas[k]
                if pick is not None and k in pick:
                    placements = [pick[k]]
                elif all_placements:
                    placements = self.placements_of(meta["shape"], partial=_is_floating(meta))
                else:
                    placements = [(Replicate(),) * len(self.mesh_shape)]
                return OpStrategy([OpSpec(self._spec(p, meta)) for p in placements])
            if isinstance(obj, list):
                items = [build(v) for v in obj]
                if items and all(isinstance(v, OpStrategy) for v in items):
                    return TupleStrategy(items)  # a Tensor[] argument
                return items
            return decode_value(obj)

        args = tuple(build(a) for a in node.args)
        kwargs = {k: build(v) for k, v in node.kwargs.items()}
        return OpSchema(op, args, kwargs, schema_info=self.propagator.op_to_schema_info.get(op))

    def _single_dim(self, op: Any, node: IRNode, metas: list[dict]) -> StrategyList | None:
        from torch.distributed.tensor import Replicate
        from torch.distributed.tensor._ops.single_dim_strategy import _ShardingPlaceholder
        from torch.distributed.tensor.placement_types import Shard

        info = self.propagator.op_single_dim_strategy_funcs[op]
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
        replicate = [Replicate()] * (n_out + n_in)
        if isinstance(out_meta, tuple):
            for i, m in enumerate(out_meta[:n_out]):
                if m is None:
                    replicate[i] = None
        if not any(all(p is None or isinstance(p, Replicate) for p in r) for r in filled):
            filled.insert(0, replicate)
        return self._expand(node, metas, filled, n_out)

    def _expand(self, node: IRNode, metas: list[dict], rules: list[list], n_out: int
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

    def _full(self, op: Any, node: IRNode, metas: list[dict]) -> StrategyList | None:
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

        func = self.propagator.op_strategy_funcs[op]

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
                for cand in self.placements_of(meta["shape"], partial=_is_floating(meta)):
                    yield {k: cand}

        def same_rank_together() -> Iterator[dict[int, tuple]]:
            rank = len(metas[0]["shape"])
            same = [k for k, m in enumerate(metas) if len(m["shape"]) == rank]
            for cand in self.placements_of(metas[0]["shape"], partial=_is_floating(metas[0])):
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

    def _collect(self, node: IRNode, metas: list[dict], specs: list) -> StrategyList:
        from torch.distributed.tensor import Replicate

        outs, ins, seen = [], [], set()
        replicate = (Replicate(),) * len(self.mesh_shape)
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
            if spec.input_specs is None and not isinstance(o, (tuple, list)):
                # DTensor's convention (propagate_op_sharding): an OpSpec without
                # input_specs expects every input in the output's placement
                # (slice_backward, ...), not Replicate.
                inp = [tuple(o.placements)] * len(metas)
            else:
                in_specs = list(spec.input_specs or [])
                inp = [tuple(s.placements) if s is not None else replicate
                       for s in in_specs[: len(metas)]]
                inp += [replicate] * (len(metas) - len(inp))
            if not all(shardable(m["shape"], p, self.mesh_shape) for p, m in zip(inp, metas)):
                continue
            key = (out, tuple(inp))
            if key in seen:
                continue
            seen.add(key)
            outs.append(out)
            ins.append(tuple(inp))
        return _reachable(outs, ins)

    def _collect_tuple(self, node: IRNode, metas: list[dict], strat: Any) -> StrategyList | None:
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

    def _replicate_only(self, node: IRNode, metas: list[dict]) -> StrategyList:
        from torch.distributed.tensor import Replicate

        replicate = (Replicate(),) * len(self.mesh_shape)
        if node.tuple_output:
            out: Any = tuple(None if m is None else replicate for m in node.outputs)
        else:
            out = replicate
        return StrategyList((out,), (tuple(replicate for _ in metas),), fallback=True)


def _reachable(outs: list, ins: list) -> StrategyList:
    """The strategies DTensor can run: of those expecting the same input placements only
    the last. With its inputs already in place DTensor's sharding propagation
    (``_select_min_cost_strategy``) takes the last strategy that needs no
    redistribution, so the others never run (``new_zeros`` offers outputs R and S(0) for
    an S(0) input; DTensor produces S(0)). Order is kept."""
    last = {inp: k for k, inp in enumerate(ins)}
    keep = [k for k, inp in enumerate(ins) if last[inp] == k]
    if len(keep) == len(ins):
        return StrategyList(tuple(outs), tuple(ins))
    return StrategyList(tuple(outs[k] for k in keep), tuple(ins[k] for k in keep))


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


@dataclass(frozen=True)
class _PortableMask:
    """A ``_MaskPartial`` on its way from a worker process: pickling the placement keeps
    neither its mask buffer nor its offset (its C++ base class pickles only the reduce
    op), so it travels as its fields, the buffer as a number that is the same for the
    placements that shared one."""

    reduce_op: str
    offset_shape: tuple[int, ...] | None
    offset_dim: int
    buffer: int


def _map_leaves(obj: Any, leaf: Any) -> Any:
    """``obj`` (a StrategyList, nested tuples / lists of placements) with ``leaf`` applied
    to every element that is none of those."""
    if isinstance(obj, StrategyList):
        return StrategyList(_map_leaves(obj.outputs, leaf), _map_leaves(obj.inputs, leaf),
                            obj.fallback)
    if isinstance(obj, tuple):
        return tuple(_map_leaves(x, leaf) for x in obj)
    if isinstance(obj, list):
        return [_map_leaves(x, leaf) for x in obj]
    return leaf(obj)


def _portable(obj: Any, buffers: dict[int, int]) -> Any:
    """``obj`` (a StrategyList, tuples, placements) with every ``_MaskPartial`` as a
    :class:`_PortableMask` (``buffers``: ``id`` of a mask buffer -> its number)."""
    from torch.distributed.tensor.placement_types import _MaskPartial

    def leaf(p: Any) -> Any:
        if not isinstance(p, _MaskPartial):
            return p
        shape = None if p.offset_shape is None else tuple(int(s) for s in p.offset_shape)
        number = buffers.setdefault(id(p.mask_buffer), len(buffers))
        return _PortableMask(p.reduce_op, shape, int(p.offset_dim), number)

    return _map_leaves(obj, leaf)


def _restored(obj: Any, buffers: dict[int, Any]) -> Any:
    """The inverse of :func:`_portable`: each :class:`_PortableMask` a ``_MaskPartial``
    again, one new mask buffer per buffer number (``buffers``)."""
    import torch
    from torch.distributed.tensor.placement_types import MaskBuffer, _MaskPartial

    def leaf(p: Any) -> Any:
        if not isinstance(p, _PortableMask):
            return p
        buffer = buffers.setdefault(p.buffer, MaskBuffer())
        shape = None if p.offset_shape is None else torch.Size(p.offset_shape)
        return _MaskPartial(p.reduce_op, buffer, shape, p.offset_dim)

    return _map_leaves(obj, leaf)


def _signature(node: IRNode, metas: list[dict]) -> str:
    """Memo key of a node's strategies: op, arguments with every tensor replaced by its
    metadata (shape, dtype, stride), and output metadata."""

    def tensor(k: int) -> list:
        return ["T", metas[k]["shape"], metas[k]["dtype"], metas[k]["stride"]]

    args = map_tensor_refs(node.args, tensor)
    kwargs = map_tensor_refs(node.kwargs, tensor, start=len(tensor_refs(node.args)))
    return json.dumps([node.target, args, kwargs, node.outputs], sort_keys=True)
