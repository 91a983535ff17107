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
  one ``OpSpec`` per reachable (output, expected inputs) combination. DTensor rejects
  input placements by raising: only the exceptions it uses for that count as a
  rejection (counted per op, ``strategy_rejections`` in ``topology.json``); any other
  is an error naming the op (pipeline/dtensor/torch_compat.py).
* a genuine op without any DTensor strategy falls back to all-Replicate
  (:meth:`StrategyEnumerator.op_strategies` marks the list ``fallback``).
* the SDPA flash-attention ops and the cross-entropy ops (``_log_softmax``,
  ``nll_loss``, their backwards) get strategies DTensor lacks appended after its own:
  context-parallel attention and vocab-parallel cross-entropy
  (pipeline/stages/topology/extra_strategies.py).

Placeholders, ``getitem`` and output sinks get their lists in
pipeline/stages/topology/problem.py; :class:`StrategyList` and the candidate placements
of a tensor (shardable ones only) are in pipeline/stages/topology/candidates.py, the
transport of the lists from worker processes in pipeline/stages/topology/portable.py.
DTensor's internals are reached through pipeline/dtensor/torch_compat.py.
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Iterator
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
from pipeline.dtensor.torch_compat import (
    DTensorSpec,
    OpSchema,
    OpSpec,
    OpStrategy,
    ShardingPlaceholder,
    StrategyFunctionError,
    TupleStrategy,
    op_schema_info,
    op_strategy_func,
    single_dim_strategy_func,
    strategy_rejection,
    zero_redistribute_costs,
)
from pipeline.stages.topology.candidates import (
    StrategyList,
    candidate_placements,
    is_floating,
    shardable,
    tensor_meta,
)
from pipeline.stages.topology.extra_strategies import with_extra_strategies
from pipeline.stages.topology.portable import portable, restored

__all__ = ["StrategyEnumerator", "StrategyList", "candidate_placements", "shardable"]


class StrategyEnumerator:
    """Enumerates DTensor strategies per node signature on one mesh, memoised.

    The memo key is the node's op, its argument structure with each tensor
    replaced by (shape, dtype, stride), its constant arguments and output
    metadata - so the copies of a repeated layer cost one enumeration.

    ``rejected`` counts, per memo key, the strategy-function calls DTensor refused
    (:meth:`_full`); :meth:`rejections` sums them per op.
    """

    def __init__(self, mesh: Any, mesh_shape: tuple[int, ...]):
        self.mesh = mesh
        self.mesh_shape = mesh_shape
        self.cache: dict[str, StrategyList] = {}
        # memo key -> (op name, strategy-function calls DTensor refused)
        self.rejected: dict[str, tuple[str, int]] = {}
        # Cheap first-level memo: (op, argument texts with references blanked, output
        # text, identities of the argument metadata) -> (StrategyList, the metadata,
        # kept alive so their ids stay unique).
        self.text_cache: dict[tuple, tuple[StrategyList, tuple]] = {}
        self.placeholder_cache: dict[tuple, list[tuple]] = {}
        self.shardable_cache: dict[tuple, bool] = {}
        self.seconds = 0.0

    def rejections(self) -> dict[str, int]:
        """Strategy-function calls DTensor refused (a rejected candidate placement), per
        op name, summed over the op's distinct signatures (each enumerated once), ops
        without any left out; sorted by op name."""
        out: dict[str, int] = {}
        for target, count in self.rejected.values():
            if count:
                out[target] = out.get(target, 0) + count
        return dict(sorted(out.items()))

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

        def enumerate_chunk(chunk: tuple[int, range]) -> list[tuple[str, Any, Any]]:
            worker, indices = chunk
            out: list[tuple[str, Any, Any]] = []
            buffers: dict[int, int] = {}
            for k in indices:
                node, metas = items[k]
                strategies = self.op_strategies(node, metas)
                key = _signature(node, metas)
                # a worker's lists are pickled on the way back: _MaskPartial as fields
                out.append((key, portable(strategies, buffers) if worker else strategies,
                            self.rejected.get(key)))
            return out

        chunks = [(w, range(w, len(items), workers)) for w in range(workers)]
        for part in map_chunks(enumerate_chunk, chunks)[1:]:  # the first chunk ran here
            buffers: dict[int, Any] = {}
            for key, strategies, rejected in part:
                self.cache[key] = restored(strategies, buffers)
                if rejected is not None:
                    self.rejected[key] = rejected
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
            with zero_redistribute_costs():
                single_dim, full = single_dim_strategy_func(op), op_strategy_func(op)
                if single_dim is not None:
                    result = self._single_dim(op, single_dim, node, metas)
                elif full is not None:
                    result = self._full(op, full, node, metas, key)
        if result is None or len(result) == 0:
            result = self._replicate_only(node, metas)
        else:
            # context-parallel attention, vocab-parallel cross-entropy
            # (pipeline/stages/topology/extra_strategies.py)
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
        return DTensorSpec(self.mesh, placements, tensor_meta=tensor_meta(meta))

    def _out_meta(self, node: IRNode) -> Any:
        if node.tuple_output:
            return tuple(tensor_meta(m) for m in node.outputs)
        return tensor_meta(node.outputs[0])

    def _schema(self, op: Any, node: IRNode, metas: list[dict], all_placements: bool,
                pick: dict[int, tuple] | None = None) -> Any:
        from torch.distributed.tensor import Replicate

        counter = itertools.count()

        def build(obj: Any) -> Any:
            if is_tensor_ref(obj):
                k = next(counter)
                meta = metas[k]
                if pick is not None and k in pick:
                    placements = [pick[k]]
                elif all_placements:
                    placements = self.placements_of(meta["shape"], partial=is_floating(meta))
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
        return OpSchema(op, args, kwargs, schema_info=op_schema_info(op))

    def _single_dim(self, op: Any, func: Any, node: IRNode, metas: list[dict]
                    ) -> StrategyList | None:
        """DTensor's single-mesh-dim rules of ``op`` (``func``, called once with every
        argument Replicate), expanded to the mesh (:meth:`_expand`). Any exception the
        function raises is a :class:`StrategyFunctionError`: it rejects nothing here."""
        from torch.distributed.tensor import Replicate
        from torch.distributed.tensor.placement_types import Shard

        schema = self._schema(op, node, metas, all_placements=False)
        try:
            rules = func(op, schema.args_meta, schema.kwargs_meta)
        except Exception as err:  # noqa: BLE001 - re-raised, typed, naming the op
            raise StrategyFunctionError.of(op, err) from err
        n_in = len(metas)
        if not rules:
            return None
        n_out = len(rules[0]) - n_in
        filled = []
        for rule in rules:
            filled.append([Shard(p.dim) if isinstance(p, ShardingPlaceholder) else p
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

    def _full(self, op: Any, func: Any, node: IRNode, metas: list[dict], key: str
              ) -> StrategyList | None:
        """Call the op's full strategy function ``func`` with every candidate input
        placement.

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

        A rejection is an exception raised the way DTensor rejects placements
        (:data:`~pipeline.dtensor.torch_compat.STRATEGY_REJECTIONS`: its type and the
        DTensor module raising it; the ``IndexError`` of the zipping functions in the
        all-candidate call only); each is counted in ``rejected[key]``. Any other
        exception raises a :class:`~pipeline.dtensor.torch_compat.StrategyFunctionError`
        naming the op.
        """
        refused = 0
        rejected = object()  # what call() answers for a rejection

        def call(schema: Any, every_candidate: bool) -> Any:
            nonlocal refused
            try:
                return func(schema)
            except Exception as err:  # noqa: BLE001 - a rejection, else re-raised typed
                if not strategy_rejection(err, every_candidate):
                    raise StrategyFunctionError.of(op, err) from err
            refused += 1
            return rejected

        def call_each(picks: Iterator[dict[int, tuple]]) -> list:
            found = []
            for pick in picks:
                schema = self._schema(op, node, metas, all_placements=False, pick=pick)
                strat = call(schema, every_candidate=False)
                if strat is not rejected:
                    found.append(strat)
            return found

        def one_arg_at_a_time() -> Iterator[dict[int, tuple]]:
            for k, meta in enumerate(metas):
                for cand in self.placements_of(meta["shape"], partial=is_floating(meta)):
                    yield {k: cand}

        def same_rank_together() -> Iterator[dict[int, tuple]]:
            rank = len(metas[0]["shape"])
            same = [k for k, m in enumerate(metas) if len(m["shape"]) == rank]
            for cand in self.placements_of(metas[0]["shape"], partial=is_floating(metas[0])):
                yield {k: cand for k in same}

        every = call(self._schema(op, node, metas, all_placements=True), every_candidate=True)
        if every is rejected:
            strats = call_each(one_arg_at_a_time())
        else:
            strats = [every]
            if (isinstance(every, OpStrategy) and len(every.strategies) == 1
                    and len(metas) > 0):
                # A "follow" strategy (cat, stack, ...): DTensor derives ONE strategy
                # from the inputs' current placements, so offered every candidate at
                # once it answers for one of them only. Ask once per candidate,
                # given to every input of the first input's rank, and keep the union.
                strats += call_each(same_rank_together())
        self.rejected[key] = (node.target, refused)
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


def _signature(node: IRNode, metas: list[dict]) -> str:
    """Memo key of a node's strategies: op, arguments with every tensor replaced by its
    metadata (shape, dtype, stride), and output metadata."""

    def tensor(k: int) -> list:
        return ["T", metas[k]["shape"], metas[k]["dtype"], metas[k]["stride"]]

    args = map_tensor_refs(node.args, tensor)
    kwargs = map_tensor_refs(node.kwargs, tensor, start=len(tensor_refs(node.args)))
    return json.dumps([node.target, args, kwargs, node.outputs], sort_keys=True)
