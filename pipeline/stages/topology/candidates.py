"""What a strategy list is, and the candidate placements of one tensor on the mesh.

A strategy (DTensor's ``OpSpec``) is an output placement plus the expected placement of
each tensor argument; a :class:`StrategyList` holds those of one node signature
(pipeline/stages/topology/strategies.py enumerates them, extra_strategies.py adds to
them, problem.py makes those of placeholders, ``getitem`` and output sinks).

A placement is dropped when a tensor dim is smaller than the product of the mesh dims
sharding it (DTensor's ``is_tensor_shardable``): :func:`shardable`.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

__all__ = ["FLOATING_DTYPES", "StrategyList", "candidate_placements", "is_floating",
           "shardable", "tensor_meta"]

#: Dtypes whose tensors may be Partial (integer ones, indices and masks, may not).
FLOATING_DTYPES = ("float32", "bfloat16", "float16", "float64")


def is_floating(meta: dict) -> bool:
    """Floating tensors may be Partial; integer ones (indices, masks) may not."""
    return meta["dtype"] in FLOATING_DTYPES


def tensor_meta(meta: dict | None) -> Any:
    """DTensor's ``TensorMeta`` of an IR tensor description (None stays None)."""
    import torch

    from pipeline.dtensor.torch_compat import TensorMeta

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
