"""Collectives a strategy issues inside its op: vocab-parallel cross-entropy's all-reduces.

Most strategies communicate only through their edges (the redistributions of
pipeline/costmodel/redistribute/). The vocab-parallel strategies of the softmax of the
cross-entropy (pipeline/stages/topology/extra_strategies.py) shard the dim the softmax reduces
over, so the op itself must reduce across the shards, as Megatron-LM's
``VocabParallelCrossEntropy`` does (Shoeybi et al. 2019,
``megatron/core/tensor_parallel/cross_entropy.py``: an all-reduce MAX of the row
maxima, an all-reduce SUM of the target logits and one of the sums of exponentials,
each ``tokens x 1``):

============================================  ==========================================
op, softmax dim ``d`` sharded on mesh dim m   collectives over m, ``T`` local rows
============================================  ==========================================
``_log_softmax``                              all-reduce of ``T`` row maxima and
                                              all-reduce of ``T`` sums of exponentials
``_log_softmax_backward_data``                all-reduce of ``T`` row sums of the
                                              incoming gradient
============================================  ==========================================

(The target-logit all-reduce is the loss's own: ``nll_loss_forward`` outputs a
``Partial`` loss whose out-edge pays the all-reduce.) ``T`` is the local tensor's
element count over its local size on ``d``; each value has the op's output dtype. A
softmax dim sharded on several mesh dims pays the collectives on each of them (a
reduction over the product group as one reduction per mesh dim, each of ``T``
values). Time: the one collective formula, :func:`~pipeline.costmodel.comm.mesh_collective_us`
(alpha-beta with the ring volume factor of an all-reduce).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from pipeline.costmodel.comm import mesh_collective_us

#: Op name -> (position of the softmax dim among the IR args, all-reduces per mesh dim).
SOFTMAX_ALL_REDUCES: dict[str, tuple[int, int]] = {
    "aten._log_softmax.default": (1, 2),  # row max, sum of exponentials
    "aten._log_softmax_backward_data.default": (2, 1),  # row sum of the gradient
}


def op_collectives(target: str, args: list, in_shape: Sequence[int],
                   in_placements: Sequence[Any], local_in_shape: Sequence[int],
                   itemsize: int) -> list[tuple[str, int, int]]:
    """The collectives a strategy runs inside its op, as ``(kind, bytes, mesh dim)``.

    Args:
        target: the op name (``aten._log_softmax.default``).
        args: the node's IR args (the softmax dim is a constant among them).
        in_shape, in_placements, local_in_shape: the first tensor input's global
            shape, its expected placement under the strategy and its local shape.
        itemsize: bytes per value reduced (the op's output dtype).

    Returns:
        One entry per collective (empty for every other op or placement).
    """
    spec = SOFTMAX_ALL_REDUCES.get(target)
    if spec is None or not in_shape:
        return []
    position, count = spec
    dim = args[position] if position < len(args) else None
    if not isinstance(dim, int):
        return []
    dim %= len(in_shape)
    mesh_dims = [m for m, p in enumerate(in_placements)
                 if p.is_shard() and p.dim % len(in_shape) == dim]
    if not mesh_dims:
        return []
    rows = math.prod(local_in_shape) // max(int(local_in_shape[dim]), 1)
    return [("all_reduce", rows * itemsize, m) for m in mesh_dims for _ in range(count)]


def op_comm_us(collectives: list[tuple[str, int, int]], mesh_shape: Sequence[int],
               hw: Any) -> float:
    """Time (µs) of :func:`op_collectives`'s collectives, in order."""
    total = 0.0
    for kind, nbytes, m in collectives:
        total += mesh_collective_us(kind, nbytes, mesh_shape, m, hw)
    return total
