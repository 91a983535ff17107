"""The memory facts of a solved plan for the run record and ``solution.parquet``.

Run record (``run.json``, key ``memory``; flattened with dots in ``runs.parquet``):

=========================  ===========================================================
field                      meaning
=========================  ===========================================================
peak_bytes                 liveness peak per device (:mod:`pipeline.memory.liveness`)
peak_node, peak_phase      where it occurs (node name, ``fwd`` / ``bwd``)
peak.<kind>                the peak's breakdown (:data:`~pipeline.memory.liveness.WALK_KINDS`)
boundary_bytes             live bytes after the forward (what it leaves the backward)
linear_bytes               the linear model (the device-memory row's value)
linear.<kind>              its terms by kind (:data:`~pipeline.memory.terms.KINDS`)
peak_minus_linear_bytes    ``peak_bytes - linear_bytes``: the transients the row cannot
                           see, less the gradients not yet produced at the peak
peak_over_linear           ``peak_bytes / linear_bytes``
reserve_fraction           ``memory.reserve_fraction`` ``f``
reserved_bytes             ``(1 + f) * peak_bytes``: what the device reserves (allocator
                           reserve, communication buffers, workspaces beyond the live
                           tensors; pipeline/memory/constraint.py), the figure to compare
                           with a measured ``torch.cuda.max_memory_reserved``
optimizer, optimizer_state_tensors, activation_checkpointing, reshard_after_forward
                           the options the model used
limit_bytes, fits          ``constraints.device_memory`` and whether the reserved bytes
                           are within it (only with a limit)
cuts, rounds               the nodes whose live memory the liveness check bounded
                           (one row each) and every solve's ``{rows, linear_bytes,
                           peak_bytes, peak_node, objective}`` (only with a limit)
=========================  ===========================================================

``solution.parquet`` columns: ``memory_bytes`` (the node's linear term under its
strategy), ``memory_kind`` (the kind of that term, null for none) and ``live_bytes``
(bytes live per device while the node runs).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pipeline.memory.constraint import reserved
from pipeline.memory.graph import StepGraph
from pipeline.memory.liveness import Liveness
from pipeline.memory.terms import LinearTerms

__all__ = ["memory_columns", "memory_record"]


def memory_record(graph: StepGraph, terms: LinearTerms, live: Liveness, strategy: np.ndarray,
                  names: list[str], limit: float | None = None,
                  rounds: list[dict[str, float]] | None = None) -> dict[str, Any]:
    """The ``memory`` entry of the run record (module docstring)."""
    opts = terms.options
    linear = terms.by_kind(strategy)
    total = float(sum(linear.values()))
    out: dict[str, Any] = {
        "peak_bytes": float(live.peak_bytes),
        "peak_node": names[live.peak_node],
        "peak_phase": graph.phase[live.peak_node],
        "peak": dict(live.peak_breakdown),
        "boundary_bytes": float(live.boundary_bytes),
        "linear_bytes": total,
        "linear": linear,
        "peak_minus_linear_bytes": float(live.peak_bytes) - total,
        "peak_over_linear": float(live.peak_bytes) / total if total > 0 else 0.0,
        "reserve_fraction": float(opts.reserve_fraction),
        "reserved_bytes": reserved(live.peak_bytes, opts.reserve_fraction),
        "optimizer": opts.optimizer,
        "optimizer_state_tensors": opts.state_tensors,
        "activation_checkpointing": opts.checkpointing,
        "reshard_after_forward": opts.reshard_after_forward,
    }
    if limit is not None:
        out["limit_bytes"] = float(limit)
        out["fits"] = bool(out["reserved_bytes"] <= limit)
        if rounds:
            out["cuts"] = [r["peak_node"] for r in rounds[:-1]]
            out["rounds"] = [dict(r) for r in rounds]
    return out


def memory_columns(terms: LinearTerms, live: Liveness, strategy: np.ndarray,
                   num_nodes: int) -> dict[str, Any]:
    """``memory_bytes``, ``memory_kind`` and ``live_bytes`` per node (module docstring)."""
    per_node = terms.per_node(strategy, num_nodes)
    kinds = [terms.node_kind.get(v) if per_node[v] > 0 or v in terms.node_kind else None
             for v in range(num_nodes)]
    return {"memory_bytes": per_node, "memory_kind": kinds,
            "live_bytes": np.asarray(live.live_bytes, dtype=np.float64)}
