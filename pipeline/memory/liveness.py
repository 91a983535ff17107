"""The liveness walk: bytes held per device at every node of one plan, and the peak.

The joint graph is walked in graph order (forward, loss, backward) on one device. At
node v the walk first allocates what v creates, records the live total (the candidate
peak, v's *live bytes*), then frees every storage whose last use is v. What lives when:

* parameters, buffers and model inputs (local size under their placement) and the
  optimizer state: the whole step;
* a tensor output: from the node that makes it to its last reader. A view or
  ``getitem`` shares its input's storage when the edge into it carries no
  redistribution, else it owns the redistributed buffer (the all-gathered weight
  ``t(W)``);
* a redistributed input of any other op (the all-gather / all-to-all output DTensor
  materialises): during that op only;
* a forward storage read by the backward: until its last backward reader (a saved
  activation), except

  - weight copies with ``fsdp.reshard_after_forward=true``: freed after the last
    forward use and allocated again (re-gathered) at the first backward reader, until
    the last one (FSDP2 frees the unsharded parameter after forward and all-gathers it
    in the backward pre-hook);
  - storages that activation checkpointing recomputes: freed after the last forward
    use and allocated again at the first backward node of their layer (the
    recomputation runs before that layer's backward), until their last backward reader;

* a gradient: from the node producing it until the end of the step, at the size of its
  gradient sink (the parameter's placement: FSDP2 reduce-scatters in the post-backward
  hook and keeps the sharded gradient; the unreduced gradient is freed after the
  reduction). If the producer's placement is already the sink's, its storage is the
  gradient.

The peak is ``max_v live(v)``. Not modelled: allocator fragmentation and caching
(``torch.cuda.memory_reserved`` exceeds the allocated bytes by a few percent to tens of
percent), CUDA context and NCCL buffers (about 0.5-1 GiB per device, outside PyTorch's
allocator), kernel workspaces (cuBLAS, flash attention), the optimizer step's
temporaries (the foreach AdamW holds one parameter-sized temporary per group), and the
intermediate buffers of multi-step redistributions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pipeline.memory.graph import StepGraph
from pipeline.memory.options import MemoryOptions
from pipeline.memory.terms import SlotBytes, element_text

__all__ = ["WALK_KINDS", "Liveness", "walk"]

#: Kinds of the walk's breakdown at the peak (``transient``: every other tensor alive:
#: forward intermediates, redistributed inputs, backward values, unreduced gradients;
#: ``recomputed``: values activation checkpointing recomputed in backward).
WALK_KINDS = ("parameters", "gradients", "optimizer_state", "buffers", "saved_activations",
              "gathered_weights", "recomputed", "transient")
_K = {k: i for i, k in enumerate(WALK_KINDS)}


@dataclass
class Liveness:
    """Result of a walk.

    Attributes:
        peak_bytes: the largest live total.
        peak_node: problem node at which it occurs.
        peak_breakdown: bytes per :data:`WALK_KINDS` at the peak.
        live_bytes: float64 [num_nodes], live bytes while each node runs (sinks: the
            total at the end of the step).
        boundary_bytes: live bytes after the last forward node (what forward leaves for
            backward).
        peak_sources: what is live at the peak, one *source* per allocation: ``("out",
            v, element)`` (output ``element`` of node v, or the gradient of sink v),
            ``("in", v, arg)`` (argument ``arg`` of node v as v expects it: a
            redistributed input) or ``("opt", v, 0)`` (the optimizer state of parameter
            v). Each is a function of one node's strategy
            (:meth:`pipeline.memory.terms.SlotBytes.of_source`), so the memory live at the
            peak's node is a linear row over the labels (pipeline/memory/constraint.py).
    """

    peak_bytes: float
    peak_node: int
    peak_breakdown: dict[str, float]
    live_bytes: np.ndarray
    boundary_bytes: float
    peak_sources: list[tuple[str, int, int]] = field(default_factory=list)


def walk(tt: Any, graph: StepGraph, options: MemoryOptions, strategy: np.ndarray,
         sizes: SlotBytes | None = None) -> Liveness:
    """Walk plan ``strategy`` (strategy index per problem node) over the graph."""
    sizes = sizes or SlotBytes(tt)
    strat = [int(k) for k in np.asarray(strategy).tolist()]
    num = graph.num_nodes
    ndim = sizes.ndim
    outs_of = tt.slist_outputs
    ins_of = tt.slist_inputs
    slist = tt.nodes["slist"]
    edges = graph.edges
    end = num  # time index after the last node

    def out_text(v: int, element: int) -> str:
        return element_text(outs_of[slist[v]][strat[v]], element, ndim)

    def in_text(v: int, a: int) -> str:
        return ins_of[slist[v]][strat[v]][a]

    in_metas_text = tt.nodes["in_metas"]
    metas_memo: dict[str, list] = {}

    def in_meta(v: int, a: int) -> dict:
        import json

        text = in_metas_text[v]
        hit = metas_memo.get(text)
        if hit is None:
            hit = metas_memo[text] = json.loads(text)
        return hit[a]

    redistributes = [out_text(u, el) != in_text(v, a) for u, el, v, a in edges]

    # Storages: bytes, creation time, kind, persistent flag.
    st_bytes: list[float] = []
    st_time: list[int] = []
    st_kind: list[str] = []
    st_src: list[tuple[str, int, int]] = []
    st_of_slot = [-1] * len(graph.slot_node)

    def new_storage(nbytes: float, time: int, kind: str, src: tuple[str, int, int]) -> int:
        st_bytes.append(float(nbytes))
        st_time.append(time)
        st_kind.append(kind)
        st_src.append(src)
        return len(st_bytes) - 1

    for s, (v, el) in enumerate(zip(graph.slot_node, graph.slot_element)):
        k = graph.alias_edge[s]
        if k >= 0 and not redistributes[k]:
            u, uel = edges[k][0], edges[k][1]
            st_of_slot[s] = st_of_slot[graph.slot(u, uel)]
            continue
        if k >= 0:  # a view of a redistributed input owns the redistributed buffer
            meta = in_meta(v, edges[k][3])
            nbytes = sizes.bytes_of(meta["shape"], meta["dtype"], in_text(v, edges[k][3]))
            src = ("in", v, int(edges[k][3]))
        else:
            nbytes = float(sizes.of_node(v, el)[strat[v]])
            src = ("out", v, el)
        persistent = graph.target[v] == "placeholder" and graph.role[v] in (
            "param", "buffer", "input")
        kind = ("parameters" if graph.role[v] == "param" else "buffers") if persistent \
            else "transient"
        st_of_slot[s] = new_storage(nbytes, -1 if persistent else v, kind, src)
    num_st = len(st_bytes)
    view_edges = {k for k in graph.alias_edge if k >= 0}
    last_fwd = [-1] * num_st
    first_bwd = [end] * num_st
    last_bwd = [-1] * num_st
    last_use = [-1] * num_st
    to_end = [False] * num_st
    temps: list[tuple[int, float, tuple]] = []  # (node, bytes, source): redistributed inputs
    grads: list[tuple[int, float, tuple]] = []  # (time, bytes, source): gradient buffers
    for k, (u, el, v, a) in enumerate(edges):
        s = graph.slot(u, el) if graph.slots_of[u] else -1
        if s < 0:
            continue
        st = st_of_slot[s]
        if graph.is_sink[v]:
            if graph.role[v] != "grad":
                continue
            if redistributes[k]:
                grads.append((st_time[st] if st_time[st] >= 0 else u,
                              float(sizes.of_node(v)[strat[v]]), ("out", v, 0)))
            else:
                to_end[st] = True
                st_kind[st] = "gradients" if st_kind[st] == "transient" else st_kind[st]
            continue
        if redistributes[k] and k not in view_edges:
            meta = in_meta(v, a)
            temps.append((v, sizes.bytes_of(meta["shape"], meta["dtype"], in_text(v, a)),
                          ("in", v, int(a))))
        last_use[st] = max(last_use[st], v)
        if graph.phase[u] == "fwd" and graph.phase[v] == "bwd":
            first_bwd[st] = min(first_bwd[st], v)
            last_bwd[st] = max(last_bwd[st], v)
        elif graph.phase[v] == "fwd":
            last_fwd[st] = max(last_fwd[st], v)
    # Storages the backward reads: saved, re-gathered, or recomputed.
    root_of_storage: dict[int, int] = {}
    for s, st in enumerate(st_of_slot):
        root_of_storage.setdefault(st, graph.root[s])
    regather: list[tuple[int, int, float, tuple]] = []  # (alloc, free time, bytes, source)
    recompute: list[tuple[int, int, float, tuple]] = []
    for st in range(num_st):
        if last_bwd[st] < 0 or st_time[st] < 0:
            continue
        creator = st_time[st]
        r = root_of_storage[st]
        if graph.weight_derived[creator]:
            if options.reshard_after_forward:
                regather.append((first_bwd[st], last_bwd[st], st_bytes[st], st_src[st]))
                last_use[st] = last_fwd[st]
            else:
                st_kind[st] = "gathered_weights"
            continue
        lay = graph.recomputed.get(r)
        if lay is not None:
            start = min(graph.layer_bwd_start.get(lay, first_bwd[st]), first_bwd[st])
            recompute.append((start, last_bwd[st], st_bytes[st], st_src[st]))
            last_use[st] = last_fwd[st]
            continue
        if st_kind[st] == "transient":
            st_kind[st] = "saved_activations"

    # Checkpointing keeps layer inputs (and the outputs a selective policy saves) until
    # the backward of the layers that recompute from them.
    for r, held in graph.held_for.items():
        st = st_of_slot[r]
        if st_time[st] < 0:
            continue
        for lay in held:
            start = graph.layer_bwd_start.get(lay)
            if start is not None:
                last_use[st] = max(last_use[st], start)
        if st_kind[st] == "transient":
            st_kind[st] = "saved_activations"

    # Every allocation: (first node, last node it lives through, kind, bytes, source);
    # persistent ones (parameters, buffers, inputs, optimizer state) from -1 to the end.
    allocations: list[tuple[int, int, str, float, tuple[str, int, int]]] = []
    for st in range(num_st):
        t0 = st_time[st]
        t1 = end if (to_end[st] or t0 < 0) else max(last_use[st], t0)
        allocations.append((t0, t1, st_kind[st], st_bytes[st], st_src[st]))
    allocations.extend((v, v, "transient", nbytes, src) for v, nbytes, src in temps)
    allocations.extend((t, end, "gradients", nbytes, src) for t, nbytes, src in grads)
    allocations.extend((t0, t1, "gathered_weights", nbytes, src)
                       for t0, t1, nbytes, src in regather)
    allocations.extend((t0, t1, "recomputed", nbytes, src) for t0, t1, nbytes, src in recompute)
    state = options.state_tensors * options.state_itemsize
    if state:
        for v in range(num):
            if graph.target[v] == "placeholder" and graph.role[v] == "param":
                allocations.append((-1, end, "optimizer_state",
                                    float(sizes.numel_of_node(v)[strat[v]]) * state,
                                    ("opt", v, 0)))
    alloc = [np.zeros(len(WALK_KINDS)) for _ in range(end + 1)]
    free = [np.zeros(len(WALK_KINDS)) for _ in range(end + 1)]
    base = np.zeros(len(WALK_KINDS))
    for t0, t1, kind, nbytes, _ in allocations:
        if t0 < 0:
            base[_K[kind]] += nbytes
            continue
        alloc[t0][_K[kind]] += nbytes
        free[t1][_K[kind]] += nbytes
    live = base.copy()
    peak, peak_node, peak_vec = -1.0, 0, live.copy()
    live_bytes = np.zeros(num)
    last_fwd_node = max((v for v in range(num) if graph.phase[v] == "fwd"
                         and not graph.is_sink[v]), default=-1)
    boundary = 0.0
    for v in range(num):
        live += alloc[v]
        total = float(live.sum())
        live_bytes[v] = total
        if total > peak:
            peak, peak_node, peak_vec = total, v, live.copy()
        live -= free[v]
        if v == last_fwd_node:
            boundary = float(live.sum())
    sources = [src for t0, t1, _, _, src in allocations if t0 <= peak_node <= t1]
    return Liveness(peak_bytes=peak, peak_node=peak_node,
                    peak_breakdown={k: float(peak_vec[i]) for i, k in enumerate(WALK_KINDS)},
                    live_bytes=live_bytes, boundary_bytes=boundary, peak_sources=sources)
