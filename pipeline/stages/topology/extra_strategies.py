"""Strategies beyond DTensor's: context-parallel attention and vocab-parallel cross-entropy.

torch 2.13's sharding rules for the fused attention ops shard the batch and the heads
only, and those of ``_log_softmax`` / ``nll_loss`` never shard the class (vocabulary)
dim. This module adds, for one mesh dim at a time, a *single-mesh-dim rule* (a column:
one placement per output element and per tensor input on that mesh dim) and combines
it with DTensor's own strategies (:func:`with_extra_strategies`).

Context-parallel attention (``aten._scaled_dot_product_flash_attention`` and its
backward; q, k, v laid out ``[B, H, S, D]``), the all-gather form of Dubey et al. 2024
("The Llama 3 Herd of Models", §3.3.2: K and V are all-gathered over the cp group, each
rank computes attention for its chunk of queries):

========================  ========================================================
forward                   out ``S(2)``, logsumexp ``S(2)``; q ``S(2)``, k ``R``, v ``R``
backward                  grad_q ``S(2)``, grad_k ``P``, grad_v ``P``; grad_out, q, out,
                          logsumexp ``S(2)``; k, v (and the RNG state) ``R``
========================  ========================================================

The op itself issues no collective: the all-gather of K and V over the mesh dim is the
redistribution ``S(2) -> R`` of the edges into k and v, and the reduce-scatter of
grad_k / grad_v the redistribution ``P -> S(2)`` of their out-edges; the edge tables
price both. Semantics: a query row only reads its own row of ``q k^T``, so the rows of
one rank's query chunk, computed against the full K and V, equal the same rows of
the full attention *provided the causal mask is offset by the chunk's first query
position* (query ``i`` of the chunk at global position ``i + r S/n`` sees keys
``j <= i + r S/n``). The op's own ``is_causal`` aligns the mask top-left (query ``i``
sees keys ``j <= i``), which is right on rank 0 only: a context-parallel kernel passes
the offset (tests/unit/test_strategies_cp_loss.py checks both facts with real tensors). In
the backward, grad_q of the chunk is exact and each rank's grad_k / grad_v is its
queries' contribution: their sum over the ranks is the full gradient (``Partial``).

Cost: the roofline on the local shapes as for every op (pipeline/costmodel/compute.py):
``q`` has ``S/n`` rows and k, v ``S``, so the FLOPs are the full op's over ``n`` (with
``is_causal`` the full op counts ``(S + 1) / (2 S)`` of the dense formula,
pipeline/costmodel/compute.py ``causal_fraction``, and so does each rank's chunk). With
a causal mask that is the work of a *load-balanced* split: a contiguous chunk ``r``
does ``(2r+1)/n^2`` of the causal work, so the cost assumes the zig-zag (load-balanced)
sequence order of Megatron-LM / Llama 3 CP (rank ``r`` holds chunks ``r`` and
``2n-1-r`` of ``2n``), under which every rank does ``1/n`` of it; the token
permutation is transparent to the row-wise ops around attention.

Vocab-parallel cross-entropy (Shoeybi et al. 2019, Megatron-LM,
``VocabParallelCrossEntropy`` in ``megatron/core/tensor_parallel/cross_entropy.py``):
the logits ``[N, V]`` stay sharded on the vocabulary dim through the loss:

================================  ================================================
``_log_softmax(x, -1)``           out ``S(1)``; x ``S(1)``; the row max and the row
                                  sum of exponentials are all-reduced over the mesh
                                  dim (``N x 1`` values each: charged with the
                                  strategy, pipeline/costmodel/op_comm.py)
``nll_loss_forward(lp, t)``       loss ``P``, total_weight ``R``; lp ``S(1)``, t ``R``:
                                  each rank picks the target log-probabilities in
                                  its vocabulary range (0 elsewhere); Megatron's
                                  all-reduce of the target logits is, for a summed
                                  or averaged loss, the all-reduce of the ``Partial``
                                  loss, paid by the loss's out-edge
``nll_loss_backward(g, lp, t, w)``  out ``S(1)``; g ``R``, lp ``S(1)``, t ``R``, w ``R``:
                                  the one-hot gradient of the local vocabulary range
``_log_softmax_backward_data``    out ``S(1)``; grad, out ``S(1)``; needs the row
                                  sum of the incoming gradient: one ``N x 1``
                                  all-reduce (Megatron's fused backward avoids it by
                                  knowing that gradient is one-hot; the traced graph
                                  has the generic op)
================================  ================================================
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

from pipeline.stages.topology.candidates import StrategyList

#: One single-mesh-dim rule: (placement per output element, None for a non-tensor
#: element, :data:`KEEP` for an element left as DTensor's strategy has it; placement
#: per tensor input).
Rule = tuple[tuple[Any, ...], tuple[Any, ...]]

#: A rule's output element that keeps the placement of the strategy it modifies.
KEEP = "keep"

FLASH_FWD = "aten._scaled_dot_product_flash_attention.default"
FLASH_BWD = "aten._scaled_dot_product_flash_attention_backward.default"
LOG_SOFTMAX = "aten._log_softmax.default"
LOG_SOFTMAX_BWD = "aten._log_softmax_backward_data.default"
NLL_FWD = "aten.nll_loss_forward.default"
NLL_BWD = "aten.nll_loss_backward.default"

#: The sequence dim of the SDPA ops' ``[B, H, S, D]`` tensors.
SEQ_DIM = 2


def _flash_fwd(args: list, metas: list[dict], outputs: list) -> list[Rule]:
    from torch.distributed.tensor import Replicate, Shard

    if len(metas) != 3 or any(len(m["shape"]) != 4 for m in metas):
        return []
    seq = Shard(SEQ_DIM)
    # cum_seq_q/k, max_q/k, rng state, unused, debug mask (empty without
    # return_debug_mask): as DTensor's strategy has them (None or Replicate)
    out = (seq, seq) + (KEEP,) * (len(outputs) - 2)
    return [(out, (seq, Replicate(), Replicate()))]


def _flash_bwd(args: list, metas: list[dict], outputs: list) -> list[Rule]:
    from torch.distributed.tensor import Partial, Replicate, Shard

    if len(metas) < 6 or any(len(m["shape"]) != 4 for m in metas[:5]):
        return []
    seq, rep = Shard(SEQ_DIM), Replicate()
    ins = (seq, seq, rep, rep, seq, seq) + (rep,) * (len(metas) - 6)
    return [((seq, Partial(), Partial()), ins)]


def _softmax_dim(args: list, metas: list[dict], position: int) -> int | None:
    rank = len(metas[0]["shape"])
    if rank == 0 or not isinstance(args[position], int):
        return None
    return int(args[position]) % rank


def _log_softmax(args: list, metas: list[dict], outputs: list) -> list[Rule]:
    from torch.distributed.tensor import Shard

    d = _softmax_dim(args, metas, 1)  # _log_softmax(self, dim, half_to_float)
    return [] if d is None else [((Shard(d),), (Shard(d),))]


def _log_softmax_bwd(args: list, metas: list[dict], outputs: list) -> list[Rule]:
    from torch.distributed.tensor import Shard

    if len(metas) != 2:
        return []
    d = _softmax_dim(args, metas, 2)  # (grad_output, output, dim, input_dtype)
    return [] if d is None else [((Shard(d),), (Shard(d), Shard(d)))]


def _nll_fwd(args: list, metas: list[dict], outputs: list) -> list[Rule]:
    from torch.distributed.tensor import Partial, Replicate, Shard

    if len(metas) != 2 or len(metas[0]["shape"]) != 2:  # [N, C] and target, no weight
        return []
    return [((Partial(), Replicate()), (Shard(1), Replicate()))]


def _nll_bwd(args: list, metas: list[dict], outputs: list) -> list[Rule]:
    from torch.distributed.tensor import Replicate, Shard

    if len(metas) != 4 or len(metas[1]["shape"]) != 2:  # grad, [N, C], target, total_weight
        return []
    rep = Replicate()
    return [((Shard(1),), (rep, Shard(1), rep, rep))]


#: Op name -> the function giving its extra single-mesh-dim rules from
#: (the node's IR args, its tensor inputs' metadata, its outputs' metadata).
EXTRA_RULES: dict[str, Callable[[list, list[dict], list], list[Rule]]] = {
    FLASH_FWD: _flash_fwd,
    FLASH_BWD: _flash_bwd,
    LOG_SOFTMAX: _log_softmax,
    LOG_SOFTMAX_BWD: _log_softmax_bwd,
    NLL_FWD: _nll_fwd,
    NLL_BWD: _nll_bwd,
}


def _replace(p: tuple, dims: tuple[int, ...], value: Any) -> tuple:
    return tuple(value if m in dims else x for m, x in enumerate(p))


def _mixed_partials(p: tuple) -> bool:
    """DTensor's filter: one tensor may not mix Partial kinds other than sum with avg."""
    from torch.distributed.tensor import Partial

    ops = {x.reduce_op for x in p if isinstance(x, Partial)}
    return len(ops) > 1 and ops != {"sum", "avg"}


def with_extra_strategies(base: StrategyList, target: str, args: list, metas: list[dict],
                          outputs: list, tuple_output: bool, ndim: int,
                          shardable: Callable[[tuple, tuple], bool]) -> StrategyList:
    """DTensor's strategies of a node followed by those using an extra rule.

    For every non-empty set of mesh dims (in increasing bitmask order), every extra
    rule and every DTensor strategy (in order), the strategy with its columns on those
    mesh dims replaced by the rule; kept when new, shardable (``shardable(shape,
    placement)``) and free of mixed Partial kinds. DTensor's strategies keep their
    indices. A fallback list (no DTensor strategy) is returned unchanged.
    """
    rules_of = EXTRA_RULES.get(target)
    if rules_of is None or base.fallback or not len(base):
        return base
    rules = rules_of(args, metas, outputs)
    if not rules:
        return base
    out_shapes = [None if m is None else tuple(m["shape"]) for m in outputs]
    in_shapes = [tuple(m["shape"]) for m in metas]
    seen = set(zip(base.outputs, base.inputs))
    outs, ins = list(base.outputs), list(base.inputs)
    subsets = [tuple(m for m in range(ndim) if mask >> m & 1) for mask in range(1, 1 << ndim)]
    for dims, (rule_out, rule_in), (out, inp) in itertools.product(
            subsets, rules, list(zip(base.outputs, base.inputs))):
        if len(rule_in) != len(inp):
            continue
        elements = out if tuple_output else (out,)
        if len(rule_out) != len(elements):
            continue
        new_elems = []
        ok = True
        for elem, col, shape in zip(elements, rule_out, out_shapes):
            if col is KEEP:
                new_elems.append(elem)
                continue
            if elem is None or col is None:
                if (elem is None) != (col is None):
                    ok = False
                    break
                new_elems.append(None)
                continue
            p = _replace(elem, dims, col)
            if _mixed_partials(p) or (shape is not None and not shardable(shape, p)):
                ok = False
                break
            new_elems.append(p)
        if not ok:
            continue
        new_in = []
        for p0, col, shape in zip(inp, rule_in, in_shapes):
            p = _replace(p0, dims, col)
            if _mixed_partials(p) or not shardable(shape, p):
                ok = False
                break
            new_in.append(p)
        if not ok:
            continue
        new_out = tuple(new_elems) if tuple_output else new_elems[0]
        key = (new_out, tuple(new_in))
        if key in seen:
            continue
        seen.add(key)
        outs.append(new_out)
        ins.append(tuple(new_in))
    return StrategyList(tuple(outs), tuple(ins), base.fallback)
