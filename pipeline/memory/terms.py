"""The linear part of the memory model: bytes per device of each node under each strategy.

For a plan x (one strategy per problem node) the linear model is

    M_lin(x) = sum_kind sum_{(v, c) in terms[kind]} c[x_v]

with one term per contribution, a vector ``c`` over the strategies of node v
(bytes per device, :func:`slot_bytes`):

==================  ==========================================================
kind                terms (module docstring of :mod:`pipeline.memory`)
==================  ==========================================================
parameters          each parameter placeholder, storage dtype, its local shape
gradients           each gradient sink, the gradient's dtype (the reduce dtype the
                    traced step casts to), its local shape (the parameter's)
optimizer_state     each parameter: ``state_tensors * state_itemsize`` bytes per local
                    element (AdamW: two float32 moments, sharded like the parameter)
buffers             buffer and model-input placeholders
saved_activations   each storage class the backward keeps (:mod:`pipeline.memory.graph`,
                    after checkpointing), at its representative slot
gathered_weights    weight copies read by the backward, only with
                    ``fsdp.reshard_after_forward=false`` (else re-gathered in backward,
                    a transient of the liveness walk)
==================  ==========================================================

Because each term depends on one node's strategy, folding the nodes into their groups
(each member's strategy index is its group's label) gives a row of per-group
coefficient vectors: :meth:`LinearTerms.group_coef`, the ``device_memory`` row.

The representative of a saved class is its first slot read by the backward (graph
order), priced at its own placement: a view whose input edge redistributes holds a new
buffer of that size (the gathered weight ``t(W)`` in ``R`` after a ``S(0)`` cast) and
the representative's own placement gets it right; when two members of one class end up
in different storages, the liveness walk (:mod:`pipeline.memory.liveness`) sees it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pipeline.core.dtypes import itemsize
from pipeline.dtensor.placements import local_shape, parse_placements
from pipeline.memory.graph import StepGraph
from pipeline.memory.options import MemoryOptions

__all__ = ["KINDS", "LinearTerms", "SlotBytes", "linear_terms"]

KINDS = ("parameters", "gradients", "optimizer_state", "buffers", "saved_activations",
         "gathered_weights")


def element_text(text: str, element: int, ndim: int) -> str:
    """Placement text of output ``element`` (``-1``: the single output) of a strategy's
    output text; a non-tensor / unsharded element (``-``, e.g. SDPA's RNG state: a plain
    tensor on every rank) is Replicate."""
    if not text.startswith("("):
        return text
    part = text[1:-1].split("|")[max(element, 0)]
    return "R" * ndim if part == "-" else part


class SlotBytes:
    """Bytes per device of tensors under placement texts, memoised.

    ``of_node(v, element)`` is a float64 vector over the strategies of node v: the local
    size of output ``element`` under each strategy's output placement. The copies of a
    repeated layer share one vector (memo key: strategy list, element, shape, dtype).
    """

    def __init__(self, tt: Any) -> None:
        self.tt = tt
        self.mesh = tuple(int(s) for s in tt.summary["mesh"])
        self.ndim = len(self.mesh)
        self.slist = tt.nodes["slist"]
        self._out_metas_text = tt.nodes["out_metas"]
        self._metas: dict[str, list] = {}
        self._memo: dict[tuple, np.ndarray] = {}
        self._text_memo: dict[tuple, int] = {}

    def out_meta(self, node: int, element: int) -> dict | None:
        text = self._out_metas_text[node]
        metas = self._metas.get(text)
        if metas is None:
            metas = self._metas[text] = json.loads(text)
        return metas[max(element, 0)] if metas else None

    def bytes_of(self, shape: list[int], dtype: str, text: str) -> int:
        """Local bytes of a ``shape`` / ``dtype`` tensor under placement ``text``."""
        key = (tuple(shape), dtype, text)
        hit = self._text_memo.get(key)
        if hit is None:
            loc = local_shape(shape, parse_placements(text, self.ndim), self.mesh) if shape \
                else ()
            hit = self._text_memo[key] = (math.prod(loc) if loc else 1) * itemsize(dtype)
        return hit

    def of_node(self, node: int, element: int = -1) -> np.ndarray:
        meta = self.out_meta(node, element)
        s = int(self.slist[node])
        if meta is None:
            return np.zeros(len(self.tt.slist_outputs[s]))
        key = (s, max(element, 0), tuple(meta["shape"]), meta["dtype"])
        hit = self._memo.get(key)
        if hit is None:
            texts = self.tt.slist_outputs[s]
            hit = np.array([self.bytes_of(meta["shape"], meta["dtype"],
                                          element_text(t, element, self.ndim))
                            for t in texts], dtype=np.float64)
            hit.setflags(write=False)
            self._memo[key] = hit
        return hit

    def numel_of_node(self, node: int) -> np.ndarray:
        """Local elements of a single-output node under each strategy."""
        meta = self.out_meta(node, -1)
        return self.of_node(node) / itemsize(meta["dtype"])

    def of_input(self, node: int, arg: int) -> np.ndarray:
        """Local bytes of tensor argument ``arg`` of ``node`` as each strategy of the
        node expects it (the redistributed input), float64 over its strategies."""
        text = self.tt.nodes["in_metas"][node]
        metas = self._metas.get(text)
        if metas is None:
            metas = self._metas[text] = json.loads(text)
        meta = metas[arg]
        s = int(self.slist[node])
        key = ("in", s, arg, tuple(meta["shape"]), meta["dtype"])
        hit = self._memo.get(key)
        if hit is None:
            hit = np.array([self.bytes_of(meta["shape"], meta["dtype"], ins[arg])
                            for ins in self.tt.slist_inputs[s]], dtype=np.float64)
            hit.setflags(write=False)
            self._memo[key] = hit
        return hit

    def of_source(self, source: tuple[str, int, int], state_bytes: int = 0) -> np.ndarray:
        """Bytes over the strategies of its node of an allocation source of the liveness
        walk (:attr:`pipeline.memory.liveness.Liveness.peak_sources`); ``state_bytes``: optimizer
        state bytes per parameter element."""
        kind, node, index = source
        if kind == "out":
            return self.of_node(node, index)
        if kind == "in":
            return self.of_input(node, index)
        if kind == "opt":
            return self.numel_of_node(node) * state_bytes
        raise ValueError(f"unknown allocation source {source!r}")


@dataclass
class LinearTerms:
    """The terms of the linear memory model (module docstring).

    Attributes:
        terms: kind -> list of ``(node, bytes per strategy of node)``.
        options: the options the terms were built with.
    """

    terms: dict[str, list[tuple[int, np.ndarray]]]
    options: MemoryOptions
    #: per node with a term, the kinds of its terms joined by ``+``
    node_kind: dict[int, str] = field(default_factory=dict)

    def group_coef(self, group_of: np.ndarray, domain: np.ndarray) -> dict[int, np.ndarray]:
        """The device-memory row: per group, bytes per label (all kinds, summed in kind
        then node order)."""
        coef: dict[int, np.ndarray] = {}
        for kind in KINDS:
            for v, c in self.terms[kind]:
                g = int(group_of[v])
                acc = coef.get(g)
                if acc is None:
                    coef[g] = np.array(c, dtype=np.float64)
                else:
                    acc += c
        for g, c in coef.items():
            if len(c) != int(domain[g]):
                raise ValueError(f"group {g}: {len(c)} memory coefficients for "
                                 f"{int(domain[g])} labels")
        return dict(sorted(coef.items()))

    def by_kind(self, strategy: np.ndarray) -> dict[str, float]:
        """Bytes per device of each kind under a plan (strategy per node)."""
        return {kind: float(sum(float(c[strategy[v]]) for v, c in self.terms[kind]))
                for kind in KINDS}

    def total(self, strategy: np.ndarray) -> float:
        return float(sum(self.by_kind(strategy).values()))

    def per_node(self, strategy: np.ndarray, num_nodes: int) -> np.ndarray:
        """Each node's linear contribution (bytes) under a plan, float64 [num_nodes]."""
        out = np.zeros(num_nodes)
        for kind in KINDS:
            for v, c in self.terms[kind]:
                out[v] += float(c[strategy[v]])
        return out


def linear_terms(tt: Any, graph: StepGraph, options: MemoryOptions,
                 sizes: SlotBytes | None = None) -> LinearTerms:
    """The linear terms of topology ``tt`` with static facts ``graph`` (module docstring)."""
    if graph.checkpointing != options.checkpointing:
        raise ValueError(f"graph built for checkpointing={graph.checkpointing!r}, options "
                         f"say {options.checkpointing!r}")
    sizes = sizes or SlotBytes(tt)
    terms: dict[str, list[tuple[int, np.ndarray]]] = {k: [] for k in KINDS}
    node_kind: dict[int, str] = {}
    state = options.state_tensors * options.state_itemsize
    for v in range(graph.num_nodes):
        role, target = graph.role[v], graph.target[v]
        if target == "placeholder" and role == "param":
            terms["parameters"].append((v, sizes.of_node(v)))
            if state:
                terms["optimizer_state"].append((v, sizes.numel_of_node(v) * state))
            node_kind[v] = "parameters+optimizer_state" if state else "parameters"
        elif target == "placeholder" and role in ("buffer", "input"):
            terms["buffers"].append((v, sizes.of_node(v)))
            node_kind[v] = "buffers"
        elif graph.is_sink[v] and role == "grad":
            terms["gradients"].append((v, sizes.of_node(v)))
            node_kind[v] = "gradients"
    for rep in graph.kept.values():
        v = graph.slot_node[rep]
        terms["saved_activations"].append((v, sizes.of_node(v, graph.slot_element[rep])))
        node_kind.setdefault(v, "saved_activations")
    if not options.reshard_after_forward:
        for rep in graph.weight_copies.values():
            v = graph.slot_node[rep]
            terms["gathered_weights"].append((v, sizes.of_node(v, graph.slot_element[rep])))
            node_kind.setdefault(v, "gathered_weights")
    return LinearTerms(terms, options, node_kind)
