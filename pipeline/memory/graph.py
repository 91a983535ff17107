"""Static memory facts of the traced joint graph: storages, what the backward keeps, layers.

Everything here follows from the topology tables alone (no placements chosen): which
tensor values share one storage, which forward values the backward reads (and so are
*saved*), which of them are copies of weights, and what activation checkpointing
keeps or recomputes. :mod:`pipeline.memory.terms` prices these facts per strategy,
:mod:`pipeline.memory.liveness` walks one plan.

Storages (a *slot* is one tensor output ``(node, element)``; ``element`` is 0 for a
single output):

* an op whose schema says its first result aliases its first tensor argument (``view``,
  ``t``, ``transpose``, ``expand``, ``slice``, ``select``, ``detach``, ``alias``,
  ``split`` / ``unbind`` elements, ...) and ``_unsafe_view`` (a view without the
  annotation) share their input's storage, and so does ``getitem`` (it selects an
  element of its producer's tuple);
* every other tensor output is a new storage (the ``empty`` factories allocate).

The *root* of a slot is the slot owning its storage. Under a plan a view shares its
input's storage only when the edge into it carries no redistribution; the linear terms
assume it does (:mod:`pipeline.memory.terms`), the liveness walk checks per edge.

Saved values: a slot of a forward node read by a backward node (phase ``bwd``; output
sinks excluded). Their storage classes (one per root) are

* *persistent* when the root is a parameter, buffer or model input placeholder (held
  anyway: nothing extra);
* *weight copies* when the root is weight-derived: a forward op all of whose tensor
  inputs are parameters or weight-derived (the compute-dtype cast of a parameter, its
  transpose, the gathered weight);
* *activations* otherwise.

Activation checkpointing acts on the repeated layers of the topology
(``repeated_blocks``), the same way on each:

* ``full``: an activation class whose root is a forward node of layer L and whose
  backward readers all belong to L is recomputed (not kept); the layer's *inputs*
  (activation storages produced outside L and read by L's forward ops) are kept, as
  ``torch.utils.checkpoint`` keeps the arguments of the checkpointed block;
* ``selective``: torchtitan's op-level selective activation checkpointing (SAC), the
  policy of its published Llama 3.1 benchmarks (torchtitan commit 9dec370, 2024-12-26,
  ``torchtitan/parallelisms/parallelize_llama.py``: ``_save_list`` and
  ``_apply_ac_to_transformer_block``; the same rule today in
  ``torchtitan/distributed/activation_checkpoint.py``, ``SelectiveAC``). As ``full``,
  but, each layer's forward ops taken in order, the outputs of the ops of
  :data:`SAC_SAVE_LIST` are kept (``CheckpointPolicy.MUST_SAVE``: every tensor output,
  including attention's log-sum-exp, read by the backward or not) **except every
  second** ``aten.mm``: the layer's forward ``mm`` ops are counted 1, 2, 3, ... and
  the even-numbered ones are recomputed (``PREFER_RECOMPUTE``), as is every other op
  of L. On a Llama block (``wq, wk, wv, wo, w1, w3, w2``) that keeps the outputs of
  ``wq``, ``wv``, ``w1``, ``w2`` and attention and recomputes ``wk``, ``wo``, ``w3``
  (:func:`sac_saved`).
  Collectives (torchtitan also saves ``reduce_scatter_tensor``) are edges here, never
  recomputed;
* ``selective_all_matmuls``: the rule ``selective`` had before (kept for comparison):
  as ``full``, but the outputs of every matmul of L (:data:`MATMUL_OPS`) and of its
  attention ops (:data:`ATTENTION_OPS`) are kept.

Weight copies are never recomputed by checkpointing: they follow
``fsdp.reshard_after_forward`` (:mod:`pipeline.memory`).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = [
    "ATTENTION_OPS",
    "MATMUL_OPS",
    "SAC_SAVE_LIST",
    "StepGraph",
    "aliases_first_input",
    "sac_saved",
    "step_graph",
]

#: torchtitan's op-level SAC save list at the benchmarked commit (``_save_list`` of
#: torchtitan 9dec370 ``torchtitan/parallelisms/parallelize_llama.py``: ``mm``, the
#: efficient and flash SDPA ops, ``reduce_scatter_tensor`` (a collective: an edge
#: here), and ``abs`` / ``max`` (the amax of low-precision scaling)).
SAC_SAVE_LIST = frozenset({
    "aten.mm.default",
    "aten._scaled_dot_product_efficient_attention.default",
    "aten._scaled_dot_product_flash_attention.default",
    "aten.abs.default",
    "aten.max.default"})
#: The op whose every second call in a layer SAC recomputes.
SAC_COUNTED = "aten.mm.default"

#: Ops whose outputs ``selective_all_matmuls`` keeps (module docstring).
MATMUL_OPS = frozenset({
    "aten.mm.default", "aten.bmm.default", "aten.addmm.default", "aten.baddbmm.default",
    "aten._scaled_mm.default", "aten.linear.default", "aten.matmul.default"})
ATTENTION_OPS = frozenset({
    "aten._scaled_dot_product_flash_attention.default",
    "aten._scaled_dot_product_efficient_attention.default",
    "aten._scaled_dot_product_cudnn_attention.default",
    "aten._scaled_dot_product_flash_attention_for_cpu.default",
    "aten._flash_attention_forward.default",
    "aten._efficient_attention_forward.default"})

_PERSISTENT_ROLES = ("param", "buffer", "input")


@functools.lru_cache(maxsize=4096)
def aliases_first_input(target: str) -> bool:
    """Whether op ``target`` (an IR op name) returns a view of its first tensor argument.

    Decided from the schema: the first return carries a non-writing alias annotation
    (``Tensor(a)``), as ``view``, ``t``, ``expand``, ``slice``, ``detach``, ``split``
    (``Tensor(a)[]``) do; ``_unsafe_view`` is a view without the annotation. Factories
    (``empty``), in-place and out= ops, and names that are not ops, are not.
    """
    if target in ("placeholder", "output", "getitem"):
        return False
    from pipeline.core.ir import resolve_op
    from pipeline.dtensor.torch_compat import OpOverload, op_schema

    op = resolve_op(target, strict=False)
    if not isinstance(op, OpOverload):
        return False
    schema = op_schema(op)
    if schema.name == "aten::_unsafe_view":
        return True
    returns = schema.returns
    if not returns:
        return False
    info = returns[0].alias_info
    if info is None or info.is_write:
        return False
    args = [a for a in schema.arguments if a.alias_info is not None]
    return bool(args) and not any(a.alias_info.is_write for a in args)


@dataclass
class StepGraph:
    """The static memory facts of one topology (see the module docstring).

    Slots are numbered ``0..num_slots-1``; ``slot_node[s]``, ``slot_element[s]`` give
    the node and output element of slot s, ``slots_of[v]`` the slots of node v (empty
    for a non-tensor node). All node-indexed lists run over the problem nodes (graph
    nodes in graph order, then the output sinks).

    Attributes:
        num_nodes: problem nodes.
        target, role, phase, layer: per node, as in ``nodes.parquet``.
        is_sink: per node, an output sink (loss or gradient).
        slot_node, slot_element: per slot.
        slots_of: per node, its slots.
        root: per slot, the slot owning its storage (itself for a new storage).
        alias_edge: per slot, the graph edge index through which it aliases its root's
            storage chain (the edge into the view / getitem), or -1.
        in_edges: per node, its input edge indices (graph-edge order).
        out_edges: per slot, the edges reading it.
        weight_derived: per node, a forward op computed from parameters only.
        saved_reads: per root slot, the backward edges reading its storage class.
        kept: the root slots kept from forward to backward (saved activations after
            checkpointing, weight copies excluded), each with its representative slot.
        weight_copies: the root slots of weight copies read by the backward, each with
            its representative slot.
        recomputed: the root slots that checkpointing recomputes in backward, each with
            the layer whose backward recomputes it.
        held_for: the root slots checkpointing keeps (layer inputs; with the selective
            modes also the outputs the policy saves), each with the layers whose backward
            (recomputation) reads them: they live at least until those layers' backward
            starts, read by the backward or not.
        layer_bwd_start: per checkpointed layer, the first backward node (graph order).
        repeated_layers: the layers checkpointing applies to.
        checkpointing: the mode the facts were built for.
        policy_saved: the forward nodes of repeated layers whose outputs the selective
            policy keeps (empty for ``none`` and ``full``).
    """

    num_nodes: int
    target: list[str]
    role: list[str]
    phase: list[str]
    layer: list[str | None]
    is_sink: list[bool]
    slot_node: list[int]
    slot_element: list[int]
    slots_of: list[list[int]]
    root: list[int]
    alias_edge: list[int]
    in_edges: list[list[int]]
    out_edges: list[list[int]]
    edges: list[tuple[int, int, int, int]]
    weight_derived: list[bool]
    saved_reads: dict[int, list[int]]
    kept: dict[int, int]
    weight_copies: dict[int, int]
    recomputed: dict[int, str]
    held_for: dict[int, list[str]]
    layer_bwd_start: dict[str, int]
    repeated_layers: list[str]
    checkpointing: str
    out_metas: list[list[dict | None]] = field(repr=False, default_factory=list)
    policy_saved: frozenset[int] = frozenset()

    def slot(self, node: int, element: int) -> int:
        """The slot of output ``element`` of ``node`` (``-1``: its single output)."""
        return self.slots_of[node][max(element, 0)]

    def is_persistent(self, root_slot: int) -> bool:
        """Whether a storage belongs to a parameter, buffer or model input."""
        return self.role[self.slot_node[root_slot]] in _PERSISTENT_ROLES and \
            self.target[self.slot_node[root_slot]] == "placeholder"

    def backward_weight_reads(self) -> list[int]:
        """Graph edges where a backward op reads a weight copy made in forward.

        With ``fsdp.reshard_after_forward=true`` FSDP2 frees the gathered weight after
        forward and all-gathers it again before the backward use: these are the edges
        whose consumers need that second all-gather (the hook of the FSDP re-gather
        cost, shared with the memory model).
        """
        out = []
        for reads in self.saved_reads.values():
            for e in reads:
                u = self.edges[e][0]
                if self.weight_derived[u]:
                    out.append(e)
        return sorted(out)

    def regather_edges(self) -> np.ndarray:
        """bool ``[num_edges]``: the forward edges that make a weight copy the backward
        reads (the edges into it and into its weight-derived ancestors, from the
        parameter on). With ``reshard_after_forward=true`` FSDP2 repeats them before the
        backward use (all-gather and cast again), so a cost model charging the re-gather
        pays their redistribution twice."""
        out = np.zeros(len(self.edges), dtype=bool)
        stack = sorted({self.edges[e][0] for e in self.backward_weight_reads()})
        seen: set[int] = set()
        while stack:
            v = stack.pop()
            if v in seen:
                continue
            seen.add(v)
            for e in self.in_edges[v]:
                out[e] = True
                u = self.edges[e][0]
                if self.weight_derived[u]:
                    stack.append(u)
        return out

    def weight_source(self, node: int) -> list[int]:
        """The parameter placeholders a weight-derived node is computed from."""
        seen: set[int] = set()
        out: set[int] = set()
        stack = [node]
        while stack:
            v = stack.pop()
            if v in seen:
                continue
            seen.add(v)
            if self.role[v] == "param" and self.target[v] == "placeholder":
                out.add(v)
                continue
            stack.extend(self.edges[e][0] for e in self.in_edges[v])
        return sorted(out)

    def recomputed_nodes(self) -> np.ndarray:
        """bool ``[num_nodes]``: forward ops that checkpointing runs a second time.

        ``full``: every forward op of a repeated layer; the selective modes: those whose
        outputs the policy does not save (:attr:`policy_saved`). Weight-derived ops
        (casts and gathers of weights) are excluded: FSDP's backward pre-hook provides
        the weights (re-gathered with ``reshard_after_forward``), and views launch no
        kernel anyway.
        """
        out = np.zeros(self.num_nodes, dtype=bool)
        if self.checkpointing == "none":
            return out
        layers = set(self.repeated_layers)
        for v in range(self.num_nodes):
            if (self.phase[v] != "fwd" or self.target[v] in ("placeholder", "output")
                    or self.layer[v] not in layers or self.weight_derived[v]):
                continue
            if v in self.policy_saved:
                continue
            out[v] = True
        return out

    def recomputed_edges(self) -> np.ndarray:
        """bool ``[num_edges]``: forward edges into a recomputed op whose producer is not
        a weight copy: the recomputation redistributes them again."""
        nodes = self.recomputed_nodes()
        return np.array([bool(nodes[v]) and not self.weight_derived[u]
                         for u, _, v, _ in self.edges], dtype=bool)


def sac_saved(targets: list[str], mode: str = "selective") -> list[bool]:
    """Which of one layer's forward ops (their targets, in execution order) a selective
    policy saves (module docstring).

    ``selective`` (torchtitan's op-level SAC): an op of :data:`SAC_SAVE_LIST` is saved,
    except the even-numbered ``aten.mm`` calls (counted from 1 within the layer);
    ``selective_all_matmuls``: every op of :data:`MATMUL_OPS` or :data:`ATTENTION_OPS`.

    Example: ``[mm, add, mm, flash_attention, mm, mm]`` -> ``[True, False, False, True,
    True, False]``.
    """
    if mode == "selective_all_matmuls":
        return [t in MATMUL_OPS or t in ATTENTION_OPS for t in targets]
    if mode != "selective":
        raise ValueError(f"sac_saved: mode={mode!r} is not a selective mode")
    out, count = [], 0
    for t in targets:
        if t == SAC_COUNTED:
            count += 1
            out.append(count % 2 == 1)
        else:
            out.append(t in SAC_SAVE_LIST)
    return out


def _policy_saved(graph: StepGraph) -> frozenset[int]:
    """The nodes a selective mode saves: per repeated layer, its forward ops in graph
    order (weight-derived ops excluded: the casts FSDP makes before the block runs)."""
    if not graph.checkpointing.startswith("selective"):
        return frozenset()
    layers = set(graph.repeated_layers)
    ops: dict[str, list[int]] = {}
    for v in range(graph.num_nodes):
        if (graph.layer[v] in layers and graph.phase[v] == "fwd" and not graph.weight_derived[v]
                and graph.target[v] not in ("placeholder", "output")):
            ops.setdefault(graph.layer[v], []).append(v)
    out: set[int] = set()
    for nodes in ops.values():
        keep = sac_saved([graph.target[v] for v in nodes], graph.checkpointing)
        out.update(v for v, k in zip(nodes, keep) if k)
    return frozenset(out)


def _repeated_layers(summary: dict) -> list[str]:
    out: list[str] = []
    for rb in summary.get("repeated_blocks") or []:
        out.extend(rb.get("blocks") or [])
    return out


def step_graph(tt: Any, checkpointing: str = "none") -> StepGraph:
    """The static memory facts of topology tables ``tt`` (module docstring).

    Args:
        tt: :class:`pipeline.stages.topology.TopologyTables`.
        checkpointing: ``none``, ``full``, ``selective`` or ``selective_all_matmuls``.
    """
    from pipeline.memory.options import CHECKPOINTING

    if checkpointing not in CHECKPOINTING:
        raise ValueError(f"memory.activation_checkpointing={checkpointing!r}: "
                         f"allowed {', '.join(CHECKPOINTING)}")
    n = tt.nodes
    num = len(n["id"])
    target, role, phase, layer = list(n["target"]), list(n["role"]), list(n["phase"]), \
        list(n["layer"])
    is_sink = [t == "output" for t in target]
    texts: dict[str, list] = {}
    out_metas = []
    for text in n["out_metas"]:
        hit = texts.get(text)
        if hit is None:
            hit = texts[text] = json.loads(text)
        out_metas.append(hit)
    e = tt.edges
    edges = list(zip(e["producer"], e["element"], e["consumer"], e["arg"]))
    in_edges: list[list[int]] = [[] for _ in range(num)]
    for k, (_, _, v, _) in enumerate(edges):
        in_edges[v].append(k)
    # Slots: one per tensor output element of a non-sink node.
    slot_node, slot_element, slots_of = [], [], []
    for v in range(num):
        mine = []
        if not is_sink[v]:
            for el, meta in enumerate(out_metas[v]):
                if meta is not None:
                    mine.append(len(slot_node))
                    slot_node.append(v)
                    slot_element.append(el)
                else:
                    mine.append(-1)
        slots_of.append(mine)
    num_slots = len(slot_node)
    out_edges: list[list[int]] = [[] for _ in range(num_slots)]
    for k, (u, el, _, _) in enumerate(edges):
        s = slots_of[u][max(el, 0)] if slots_of[u] else -1
        if s >= 0:
            out_edges[s].append(k)
    # Roots (graph order: producers come first).
    root = list(range(num_slots))
    alias_edge = [-1] * num_slots
    for v in range(num):
        t = target[v]
        if is_sink[v] or not slots_of[v]:
            continue
        if t == "getitem" or aliases_first_input(t):
            first = next((k for k in in_edges[v] if edges[k][3] == 0), None)
            if first is None:
                continue
            u, el = edges[first][0], edges[first][1]
            src = slots_of[u][max(el, 0)] if slots_of[u] else -1
            if src < 0:
                continue
            for s in slots_of[v]:
                if s >= 0:
                    root[s] = root[src]
                    alias_edge[s] = first
    # Weight-derived forward ops.
    weight_derived = [False] * num
    for v in range(num):
        if phase[v] != "fwd" or target[v] in ("placeholder", "output") or not in_edges[v]:
            continue
        weight_derived[v] = all(
            (role[edges[k][0]] == "param" and target[edges[k][0]] == "placeholder")
            or weight_derived[edges[k][0]] for k in in_edges[v])
    # Saved reads per root.
    saved_reads: dict[int, list[int]] = {}
    for k, (u, el, v, _) in enumerate(edges):
        if phase[u] != "fwd" or phase[v] != "bwd" or is_sink[v]:
            continue
        s = slots_of[u][max(el, 0)] if slots_of[u] else -1
        if s >= 0:
            saved_reads.setdefault(root[s], []).append(k)
    graph = StepGraph(
        num_nodes=num, target=target, role=role, phase=phase, layer=layer, is_sink=is_sink,
        slot_node=slot_node, slot_element=slot_element, slots_of=slots_of, root=root,
        alias_edge=alias_edge, in_edges=in_edges, out_edges=out_edges, edges=edges,
        weight_derived=weight_derived, saved_reads=saved_reads, kept={}, weight_copies={},
        recomputed={}, held_for={}, layer_bwd_start={},
        repeated_layers=_repeated_layers(tt.summary), checkpointing=checkpointing,
        out_metas=out_metas)
    graph.policy_saved = _policy_saved(graph)
    _classify(graph)
    return graph


def _representative(graph: StepGraph, reads: list[int]) -> int:
    """The slot read first (graph order of the read slots' nodes) among ``reads``."""
    best = None
    for k in reads:
        u, el = graph.edges[k][0], graph.edges[k][1]
        s = graph.slot(u, el)
        if best is None or (graph.slot_node[s], s) < (graph.slot_node[best], best):
            best = s
    assert best is not None
    return best


def _classify(graph: StepGraph) -> None:
    """Fill ``kept``, ``weight_copies``, ``recomputed`` and ``layer_bwd_start``."""
    mode = graph.checkpointing
    layers = set(graph.repeated_layers) if mode != "none" else set()
    edges = graph.edges
    for v in range(graph.num_nodes):
        lay = graph.layer[v]
        if lay in layers and graph.phase[v] == "bwd" and not graph.is_sink[v]:
            graph.layer_bwd_start.setdefault(lay, v)
    # Layer inputs (every mode) and the outputs the selective policy saves.
    forced: dict[int, list[str]] = {}
    if layers:
        for u, el, v, _ in edges:
            lay = graph.layer[v]
            if (lay not in layers or graph.phase[v] != "fwd" or graph.phase[u] != "fwd"
                    or graph.layer[u] == lay):
                continue
            s = graph.slot(u, el) if graph.slots_of[u] else -1
            if s < 0:
                continue
            r = graph.root[s]
            if graph.is_persistent(r) or graph.weight_derived[graph.slot_node[r]]:
                continue
            held = forced.setdefault(r, [])
            if lay not in held:
                held.append(lay)
        if mode.startswith("selective"):
            for v in sorted(graph.policy_saved):
                if graph.layer[v] in layers and graph.phase[v] == "fwd":
                    for s in graph.slots_of[v]:
                        if s >= 0 and graph.root[s] == s:
                            held = forced.setdefault(s, [])
                            if graph.layer[v] not in held:
                                held.append(graph.layer[v])
    for r, reads in sorted(graph.saved_reads.items()):
        if graph.is_persistent(r):
            continue
        rep = _representative(graph, reads)
        root_node = graph.slot_node[r]
        if graph.weight_derived[root_node]:
            graph.weight_copies[r] = rep
            continue
        lay = graph.layer[root_node]
        if (r not in forced and lay in layers and graph.phase[root_node] == "fwd"
                and all(graph.layer[edges[k][2]] == lay for k in reads)):
            graph.recomputed[r] = lay
            continue
        graph.kept[r] = rep
    for r in forced:
        graph.kept.setdefault(r, r)
    graph.held_for = dict(sorted(forced.items()))
    graph.kept = dict(sorted(graph.kept.items()))
