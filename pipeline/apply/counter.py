"""Counting collectives while a plan runs.

Collectives are counted by :class:`CollectiveCounter`, a
``torch.distributed.tensor.debug.CommDebugMode`` that also reads the process group of
each functional collective and maps it to the mesh dim it belongs to; one call of a
functional collective on one mesh dim's group is one collective. A group over several mesh dims
(FSDP2's flattened shard group, ``dp_mesh_dims=DataParallelMeshDims(shard=("dp", "tp"))``)
is named by its dims joined with ``+`` (``all_gather(dp+tp)``), as the cost model names a
collective over a flattened group; FSDP2's own collectives (``c10d`` ops taking the
process group object) are counted the same way. On CPU, DTensor runs
an all-to-all as an all-gather plus a local chunk (gloo has no all-to-all,
``_collective_utils.shard_dim_alltoall``); such a gather is counted as the
``all_to_all`` DTensor issued.

``root_counts`` are the DTensor collectives the root module issues by its own ops,
outside every submodule, in forward and in backward (the loss of a training step:
``log_softmax`` and ``nll_loss`` and their backward), told by CommDebugMode's module
tracker (``advanced_module_tracker.name``: the root module's name has no dot; FSDP2's
own ``c10d`` collectives, issued from the root unit's hooks, are not among them).

``module_counts`` are the DTensor collectives (not FSDP2's ``c10d`` ones) each submodule
issues, ``{module fqn: {"fwd" | "bwd": {kind(mesh dims): count}}}``, the module and the
phase as the same tracker tells them (``advanced_module_tracker.name`` less the root's
name, ``advanced_module_tracker.is_bw``): a module's backward includes the backward of
the redistributions its forward hooks ran (the embedding's output redistributed to its
layout).
"""

from __future__ import annotations

import collections
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode

from pipeline.dtensor.torch_compat import (
    C10D_COLLECTIVE_OPS,
    HigherOrderOperator,
    inside_shard_dim_alltoall,
    op_schema,
    process_group_name,
    qualified_op_name,
    resolve_process_group,
)

__all__ = ["COLLECTIVE_KINDS", "CollectiveCounter"]

#: Functional collectives (their op names) -> the collective kind of the cost model.
COLLECTIVE_KINDS: dict[str, str] = {
    "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "all_reduce": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "all_to_all_single": "all_to_all",
    "shard_dim_alltoall": "all_to_all",
    "broadcast": "broadcast",
    # c10d ops (FSDP2 calls torch.distributed's collectives on its process groups)
    "_allgather_base_": "all_gather",
    "allgather_": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather",
    "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "allreduce_": "all_reduce",
    "allreduce_coalesced_": "all_reduce",
    "alltoall_base_": "all_to_all",
    "alltoall_": "all_to_all",
    "broadcast_": "broadcast",
}


class CollectiveCounter(CommDebugMode):
    """``CommDebugMode`` that also counts collectives per ``kind(mesh dim name)``.

    ``counts`` maps e.g. ``"all_gather(dp)"`` to the number of functional collective
    calls of that kind on that mesh dim's process group (see the module docstring for
    the CPU all-to-all); ``root_counts`` those the root module's own ops issue.
    ``get_comm_counts()`` keeps CommDebugMode's own per-op totals
    (every collective still goes through ``CommDebugMode.__torch_dispatch__``); other
    ops skip its per-op tracing tables.
    """

    def __init__(self, mesh: Any):
        super().__init__()
        names = mesh.mesh_dim_names or tuple(str(d) for d in range(mesh.ndim))
        self.group_dims = {mesh.get_group(d).group_name: names[d] for d in range(mesh.ndim)}
        self.rank_sets = _rank_sets(mesh, names)
        self.counts: collections.Counter[str] = collections.Counter()
        self.root_counts: collections.Counter[str] = collections.Counter()
        self.module_counts: dict[str, dict[str, collections.Counter[str]]] = (
            collections.defaultdict(lambda: collections.defaultdict(collections.Counter)))

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None
                           ) -> Any:
        if isinstance(func, HigherOrderOperator):
            return func(*args, **(kwargs or {}))
        if any(t is DTensor for t in types):
            return NotImplemented  # let DTensor desugar into local ops and collectives
        packet = func.overloadpacket
        if packet not in self.comm_registry and packet not in C10D_COLLECTIVE_OPS:
            # Not a collective: skip CommDebugMode's per-op bookkeeping (its operation
            # lists cost more than the op on these small tensors).
            return func(*args, **(kwargs or {}))
        name = qualified_op_name(packet).split("::")[-1]
        kind = COLLECTIVE_KINDS.get(name, name)
        if kind == "all_gather" and _inside_cpu_alltoall():
            kind = "all_to_all"
        group = _group_name(func, args, kwargs or {})
        label = self.group_dims.get(group) or self.rank_sets.get(_group_ranks(group), group)
        self.counts[f"{kind}({label})"] += 1
        module = str(self.advanced_module_tracker.name)
        if packet not in C10D_COLLECTIVE_OPS and "." not in module and module != "Global":
            self.root_counts[f"{kind}({label})"] += 1
        elif packet not in C10D_COLLECTIVE_OPS and "." in module:
            phase = "bwd" if self.advanced_module_tracker.is_bw else "fwd"
            self.module_counts[module.split(".", 1)[1]][phase][f"{kind}({label})"] += 1
        return super().__torch_dispatch__(func, types, args, kwargs)


def _group_name(func: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> str:
    for i, arg in enumerate(op_schema(func).arguments):
        if arg.name in ("group_name", "process_group"):
            value = kwargs.get(arg.name, args[i] if i < len(args) else None)
            if arg.name == "process_group" and value is not None:
                return str(process_group_name(value))
            return str(value)
    return "?"


def _rank_sets(mesh: Any, names: Sequence[str]) -> dict[frozenset[int], str]:
    """``{ranks of this rank's group over a set of mesh dims: "dp+tp"}`` for every
    non-empty set of mesh dims (in mesh order)."""
    import itertools

    import torch

    grid = mesh.mesh
    coord = mesh.get_coordinate()
    out: dict[frozenset[int], str] = {}
    if coord is None:
        return out
    for k in range(len(names), 0, -1):
        for dims in itertools.combinations(range(len(names)), k):
            index = tuple(slice(None) if d in dims else coord[d] for d in range(len(names)))
            ranks = frozenset(int(r) for r in torch.as_tensor(grid[index]).flatten().tolist())
            out.setdefault(ranks, "+".join(names[d] for d in dims))
    return out


def _group_ranks(group_name: str) -> frozenset[int]:
    """The global ranks of the process group named ``group_name`` (empty if unknown)."""
    import torch.distributed as dist

    pg = resolve_process_group(group_name)
    return frozenset(dist.get_process_group_ranks(pg)) if pg is not None else frozenset()


def _inside_cpu_alltoall() -> bool:
    """Whether DTensor's CPU all-to-all (all-gather + chunk) is on the call stack."""
    return inside_shard_dim_alltoall(sys._getframe(2))

