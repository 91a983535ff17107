"""Groups: the problem nodes decided jointly.

Forward/backward twins share an output placement (a parameter and its gradient
sink; a float model input and its gradient). With ``repeated_layers`` the
copies of a repeated layer share the strategy index of the first copy. Copies
are recognised from the graph: nodes are labelled by module path (``layers.3``),
each node gets a structural hash (op, shapes, dtypes, constant arguments and the
hashes of its in-layer inputs, a Weisfeiler-Lehman style colouring over the
DAG), and two layers are copies only when their multisets of hashes are equal.
Corresponding nodes are paired by (hash, graph order). Members of a group always
have identical strategy lists, so a group's domain is the first member's list
and every member's strategy index equals the group label (the filtered product
of the tie).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from pipeline.core.ir import IRNode, map_tensor_refs
from pipeline.stages.topology.problem import ProblemNode, StrategyTable, problem_id_of


def structural_hashes(nodes: list[IRNode], members: dict[str, list[int]]) -> dict[int, str]:
    """Weisfeiler-Lehman style hash of every node inside a layer (see module docstring)."""
    out: dict[int, str] = {}
    for layer, idxs in members.items():
        inside = set(idxs)
        for i in sorted(idxs):
            n = nodes[i]
            parts: list[Any] = [n.kind, n.target, n.outputs, n.role]
            if n.kind == "placeholder":
                parts.append((n.fqn or "")[len(layer):])
            inputs = []
            for r in n.refs:
                if r in inside and r in out:
                    inputs.append(("in", out[r]))
                else:
                    inputs.append(("ext", nodes[r].outputs, nodes[r].role))
            parts.append(inputs)
            parts.append(map_tensor_refs(n.args, _blank))
            parts.append(map_tensor_refs(n.kwargs, _blank))
            out[i] = hashlib.sha1(json.dumps(parts, sort_keys=True, default=str).encode()
                                  ).hexdigest()[:16]
    return out


def _blank(_k: int) -> str:
    return "T"


def repeated_layers(nodes: list[IRNode]) -> tuple[list[list[list[int]]], dict[str, list[int]]]:
    """Recognise the copies of repeated layers.

    Returns ``(layers, members)``: ``layers`` holds one entry per repeated layer, the
    list of its copies (each a list of graph indices ordered so that position k of
    every copy is the same node role); the first copy is the representative.
    ``members`` maps a layer's module path to its graph indices. Layers are grouped
    by module-path prefix (``layers``) and then by equality of their structural-hash
    multisets, so a layer of another width is not a copy.
    """
    members: dict[str, list[int]] = {}
    for n in nodes:
        if n.layer is not None and n.kind != "output":
            members.setdefault(n.layer, []).append(n.idx)
    hashes = structural_hashes(nodes, members)
    by_key: dict[tuple, list[str]] = {}
    for layer, idxs in members.items():
        prefix = layer.rsplit(".", 1)[0]
        key = (prefix, tuple(sorted(hashes[i] for i in idxs)))
        by_key.setdefault(key, []).append(layer)
    layers = []
    for paths in by_key.values():
        if len(paths) < 2:
            continue
        paths.sort(key=lambda p: min(members[p]))
        layers.append([sorted(members[p], key=lambda i: (hashes[i], i)) for p in paths])
    layers.sort(key=lambda copies: copies[0][0])
    return layers, members


class _Ties:
    """Union-find over problem node ids; only nodes with equal strategy outputs unite."""

    def __init__(self, problem: list[ProblemNode], table: StrategyTable) -> None:
        self.problem = problem
        self.table = table
        self.parent = list(range(len(problem)))

    def find(self, x: int) -> int:
        parent = self.parent
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    def union(self, a: int, b: int) -> bool:
        """Tie ``a`` and ``b``; False (and no tie) when their domains differ."""
        sa = self.table[self.problem[a].strategy_list]
        sb = self.table[self.problem[b].strategy_list]
        if sa is not sb and sa.outputs != sb.outputs:
            return False
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.parent[max(ra, rb)] = min(ra, rb)
        return True


@dataclass
class Grouping:
    """The groups of a problem.

    Attributes:
        group_of: group index per node; groups are numbered by first member.
        groups: per group, its member node ids in id order.
        repeated_layers: per tied repeated layer ``{"blocks": module paths of its
            copies, "nodes_per_block", "tied_pairs"}`` (``topology.json`` keys).
    """

    group_of: list[int]
    groups: list[list[int]]
    repeated_layers: list[dict]


def group_nodes(nodes: list[IRNode], problem: list[ProblemNode], table: StrategyTable,
                tie_fwd_bwd: bool, tie_repeated_layers: bool) -> Grouping:
    """Tie forward/backward twins and the copies of repeated layers (module docstring)."""
    ties = _Ties(problem, table)
    if tie_fwd_bwd:
        for m in problem:
            if m.tied_to is not None:
                ties.union(m.tied_to, m.id)
    layers_info = []
    if tie_repeated_layers:
        id_of = problem_id_of(problem)
        layers, _ = repeated_layers(nodes)
        sink_of_param = {m.tied_to: m.id for m in problem if m.tied_to is not None}
        for copies in layers:
            first = copies[0]
            tied = 0
            for copy in copies[1:]:
                for a, b in zip(first, copy):
                    ia, ib = id_of[a], id_of[b]
                    if not ties.union(ia, ib):
                        continue
                    tied += 1
                    if ia in sink_of_param and ib in sink_of_param:
                        ties.union(sink_of_param[ia], sink_of_param[ib])
            layers_info.append({
                "blocks": [nodes[c[0]].layer for c in copies],
                "nodes_per_block": len(first), "tied_pairs": tied})
    roots: dict[int, int] = {}
    group_of = []
    groups: list[list[int]] = []
    for m in problem:
        r = ties.find(m.id)
        if r not in roots:
            roots[r] = len(groups)
            groups.append([])
        group_of.append(roots[r])
        groups[roots[r]].append(m.id)
    return Grouping(group_of, groups, layers_info)
