"""Strategy enumeration of single ops, counted by hand.

``aten.mm`` has, per mesh dim (DTensor's single-dim rules),
the rules ``[out, A, B]``: ``[R, R, R]``, ``[S(0), S(0), R]`` (row split),
``[S(1), R, S(1)]`` (column split), ``[P, S(1), S(0)]`` (contraction split),
``[P, P, R]`` and ``[P, R, P]`` (linearity in one Partial input), and the same two
for ``Partial(avg)`` (torch 2.13 lists them too): 8 rules. On a 2-D mesh a strategy is
one rule per mesh dim: 8 * 8 = 64 combinations, all distinct; sum and avg may mix
(DTensor allows that pair). A combination is dropped when a tensor dim is smaller than
the product of the mesh sizes sharding it.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import pytest

from pipeline.core.ir import tensor_refs
from pipeline.dtensor.placements import format_placements
from pipeline.stages.topology import (
    IRNode,
    StrategyEnumerator,
    Topology,
    build_topology,
    candidate_placements,
    device_mesh,
    repeated_layers,
)


def _mm_node(m: int, k: int, n: int) -> tuple[IRNode, list[dict]]:
    metas = [{"shape": [m, k], "dtype": "float32", "stride": [k, 1]},
             {"shape": [k, n], "dtype": "float32", "stride": [n, 1]}]
    node = IRNode(idx=2, name="mm", kind="call_function", target="aten.mm.default",
                 args=[{"node": 0}, {"node": 1}], kwargs={},
                 outputs=[{"shape": [m, n], "dtype": "float32", "stride": [n, 1]}],
                 tuple_output=False, role="activation", fqn=None, layer=None, phase="fwd",
                 output_desc=None, refs=[0, 1])
    return node, metas


RULES = [("R", "R", "R"), ("S(0)", "S(0)", "R"), ("S(1)", "R", "S(1)"),
         ("P", "S(1)", "S(0)"), ("P", "P", "R"), ("P", "R", "P"),
         ("P(avg)", "P(avg)", "R"), ("P(avg)", "R", "P(avg)")]


def _by_hand(m: int, k: int, n: int, mesh: tuple[int, int]) -> set[tuple[str, str, str]]:
    shapes = [(m, n), (m, k), (k, n)]
    out = set()
    for combo in itertools.product(RULES, repeat=2):
        ok = True
        for pos in range(3):
            split = [1, 1]
            for md, rule in enumerate(combo):
                tok = rule[pos]
                if tok.startswith("S("):
                    split[int(tok[2])] *= mesh[md]
            ok &= all(shapes[pos][d] >= split[d] for d in range(2))
        if ok:
            out.add(tuple("".join(rule[pos] for rule in combo) for pos in range(3)))
    return out


@pytest.mark.parametrize("shape,count", [((16, 32, 64), 64), ((4, 32, 64), 63)])
def test_mm_strategies_on_2d_mesh(shape: tuple[int, int, int], count: int) -> None:
    mesh_shape = (2, 4)
    mesh = device_mesh(mesh_shape, ("dp", "tp"))
    node, metas = _mm_node(*shape)
    sl = StrategyEnumerator(mesh, mesh_shape).op_strategies(node, metas)
    got = {(format_placements(o), format_placements(i[0]), format_placements(i[1]))
           for o, i in zip(sl.outputs, sl.inputs)}
    expected = _by_hand(*shape, mesh_shape)
    assert len(expected) == count  # m=4 < 2*4 drops S(0)S(0) on the rows
    assert got == expected
    assert len(sl) == count


def test_placeholder_placements_counted_by_hand() -> None:
    # A [4, 6] tensor on (2, 4): per mesh dim R, S(0), S(1) -> 9 combinations; S(0) on
    # both needs dim 0 >= 8 (4 < 8: dropped); S(1) on both needs 8 <= 6: dropped.
    pls = candidate_placements([4, 6], (2, 4), partial=False)
    assert len(pls) == 7
    # With Partial: 4 options per mesh dim, 16 combinations, the same 2 dropped.
    assert len(candidate_placements([4, 6], (2, 4), partial=True)) == 14


# --------------------------------------------------------------------------- whole problems


def _ir(idx: int, name: str, target: str, args: list, shape: list[int] | None,
        **fields: Any) -> IRNode:
    """A graph IR node as the trace stage writes it (contiguous float32 output)."""
    kind = fields.pop("kind", "placeholder" if target == "placeholder" else "call_function")
    stride = [math.prod(shape[d + 1:]) for d in range(len(shape))] if shape is not None else None
    outputs = [None if shape is None else {"shape": shape, "dtype": "float32", "stride": stride}]
    defaults: dict[str, Any] = {"role": "activation", "fqn": None, "layer": None, "phase": "fwd",
                                "output_desc": None, "module_path": ""}
    defaults.update(fields)
    return IRNode(idx=idx, name=name, kind=kind, target=target, args=args, kwargs={},
                  outputs=outputs, tuple_output=False, refs=tensor_refs(args), **defaults)


def _linear_graph() -> list[IRNode]:
    """loss = sum(mm(x, w)); a stand-in op (clone of w) plays w's gradient."""
    ref = [{"node": i} for i in range(5)]
    return [
        _ir(0, "w", "placeholder", [], [8, 4], role="param", fqn="w"),
        _ir(1, "x", "placeholder", [], [16, 8], role="input"),
        _ir(2, "mm", "aten.mm.default", [ref[1], ref[0]], [16, 4], module_path="lin"),
        _ir(3, "sum", "aten.sum.default", [ref[2]], []),
        _ir(4, "clone", "aten.clone.default", [ref[0]], [8, 4], phase="bwd"),
        _ir(5, "output", "output", [[ref[3], ref[4]]], None, kind="output", role="output",
            output_desc=[{"kind": "loss"}, {"kind": "grad", "grad_of": "w"}]),
    ]


def _outputs(topo: Topology, node: int) -> list[str]:
    return [format_placements(o) for o in topo.strategy_lists[topo.nodes[node].strategy_list]
            .outputs]


@pytest.fixture(scope="module")
def mesh_2x4() -> Any:
    return device_mesh((2, 4), ("dp", "tp"))


def _build(mesh: Any, constraints: dict, nodes: list[IRNode] | None = None,
           tie_repeated_layers: bool = False) -> Topology:
    return build_topology(nodes or _linear_graph(), mesh, (2, 4), ("dp", "tp"), constraints,
                          tie_repeated_layers)


# w [8, 4] on (2, 4), per mesh dim R, S(0), S(1): S(1) on both needs 4 >= 8 (dropped),
# the other 8 combinations fit. Smallest local size: 4 of 32 elements (S(0)S(0), ...).
W_PLACEMENTS = {"".join(c) for c in itertools.product(["R", "S(0)", "S(1)"], repeat=2)} - {
    "S(1)S(1)"}


def test_problem_nodes_sinks_edges_and_twins(mesh_2x4: Any) -> None:
    topo = _build(mesh_2x4, {})
    assert [m.name for m in topo.nodes] == ["w", "x", "mm", "sum", "clone", "output:0",
                                            "output:grad:w"]
    assert topo.edges == [(1, -1, 2, 0), (0, -1, 2, 1), (2, -1, 3, 0), (0, -1, 4, 0),
                          (3, -1, 5, 0), (4, -1, 6, 0)]
    # the gradient sink is w's twin: one group, the same strategy list outputs
    assert topo.group_of == [0, 1, 2, 3, 4, 5, 0]
    assert topo.groups[0] == [0, 6]
    assert set(_outputs(topo, 0)) == W_PLACEMENTS and _outputs(topo, 6) == _outputs(topo, 0)
    assert topo.nodes[0].min_ratio == pytest.approx(4 / 32)
    # the loss sink accepts only Replicate; the input is pinned to the default S(0)R
    assert _outputs(topo, 5) == ["RR"]
    assert _outputs(topo, 1) == ["S(0)R"]
    assert topo.pins == {"x": "S(0)R"}
    assert topo.fallback_ops == {}
    untied = _build(mesh_2x4, {"fwd_bwd_consistency": False})
    assert untied.group_of == list(range(7))


def test_pins_restrict_the_whole_group(mesh_2x4: Any) -> None:
    topo = _build(mesh_2x4, {"inputs": "RR", "outputs": "S(0)R",
                             "nodes": [{"match": "w", "placement": "RS(0)"}]})
    assert topo.pins == {"x": "RR", "mm": "S(0)R", "w": "RS(0)"}
    assert _outputs(topo, 0) == _outputs(topo, 6) == ["RS(0)"]  # the twin follows
    # mm output S(0)R: the row split on dp (x S(0), w R) and Replicate on tp, only
    strategies = topo.strategy_lists[topo.nodes[2].strategy_list]
    assert [(format_placements(o), [format_placements(p) for p in i])
            for o, i in zip(strategies.outputs, strategies.inputs)] == [
        ("S(0)R", ["S(0)R", "RR"])]
    assert topo.nodes[0].min_ratio == pytest.approx(4 / 32)  # taken before the pins


@pytest.mark.parametrize("constraints,fragment", [
    ({"nodes": [{"match": "w", "placement": "PR"}]}, "is Partial"),
    ({"nodes": [{"match": "nothing*", "placement": "RR"}]}, "matches no node"),
    ({"nodes": [{"match": "w", "placement": "S(1)S(1)"}]}, "is not a strategy of node w"),
    ({"inputs": "S(1)S(1)S(0)"}, "3 token(s) for a 2-d mesh"),
])
def test_bad_pins_are_one_line_errors(mesh_2x4: Any, constraints: dict, fragment: str) -> None:
    with pytest.raises(ValueError) as err:
        _build(mesh_2x4, constraints)
    assert fragment in str(err.value) and "\n" not in str(err.value)


def _layered_graph() -> list[IRNode]:
    """embed -> layers.0 -> layers.1 -> layers.2 -> loss; each layer ``h @ w`` plus a
    stand-in gradient of ``w``; layers.2 is twice as wide (not a copy)."""
    nodes = [_ir(0, "x", "placeholder", [], [4, 8], role="input"),
             _ir(1, "embed", "aten.clone.default", [{"node": 0}], [4, 8], module_path="embed")]
    h, grads = 1, []
    for i, width in enumerate([8, 8, 16]):
        layer, base = f"layers.{i}", len(nodes)
        fields = {"layer": layer, "module_path": layer}
        nodes += [
            _ir(base, f"w{i}", "placeholder", [], [8, width], role="param",
                fqn=f"{layer}.w", layer=layer),
            _ir(base + 1, f"mm{i}", "aten.mm.default", [{"node": h}, {"node": base}],
                [4, width], **fields),
            _ir(base + 2, f"grad{i}", "aten.clone.default", [{"node": base}], [8, width],
                phase="bwd", layer=layer),
        ]
        h = base + 1
        grads.append((base + 2, f"{layer}.w"))
    n = len(nodes)
    nodes.append(_ir(n, "loss", "aten.sum.default", [{"node": h}], []))
    outs = [{"node": n}] + [{"node": g} for g, _ in grads]
    descs = [{"kind": "loss"}] + [{"kind": "grad", "grad_of": fqn} for _, fqn in grads]
    nodes.append(_ir(n + 1, "output", "output", [outs], None, kind="output", role="output",
                     output_desc=descs))
    return nodes


def test_repeated_layers_are_recognised_from_the_graph() -> None:
    nodes = _layered_graph()
    layers, members = repeated_layers(nodes)
    assert members == {"layers.0": [2, 3, 4], "layers.1": [5, 6, 7], "layers.2": [8, 9, 10]}
    assert len(layers) == 1 and len(layers[0]) == 2  # layers.2 has other shapes
    first, second = layers[0]
    assert sorted(zip(first, second)) == [(2, 5), (3, 6), (4, 7)]  # node for node


def test_repeated_layers_share_groups(mesh_2x4: Any) -> None:
    nodes = _layered_graph()
    topo = _build(mesh_2x4, {}, nodes, tie_repeated_layers=True)
    sink = {m.fqn: m.id for m in topo.nodes if m.role == "grad"}
    group = topo.group_of
    assert group[2] == group[5] == group[sink["layers.0.w"]] == group[sink["layers.1.w"]]
    assert group[3] == group[6] and group[4] == group[7]
    assert group[8] != group[2] and group[9] != group[3]
    assert topo.repeated_layers == [{"blocks": ["layers.0", "layers.1"], "nodes_per_block": 3,
                                     "tied_pairs": 3}]
    # 16 nodes: x, embed, 3 x (w, mm, grad), loss, the loss sink and 3 gradient sinks
    assert len(topo.nodes) == 16
    untied = _build(mesh_2x4, {}, nodes)
    assert untied.repeated_layers == [] and untied.group_of[2] != untied.group_of[5]
    assert len(set(untied.group_of)) == 16 - 3  # each w with its sink
    assert len(set(group)) == 16 - 3 - 3  # and the 3 pairs of layers.0 / layers.1
    # without fwd/bwd twins the sinks of paired parameters are still paired
    no_twins = _build(mesh_2x4, {"fwd_bwd_consistency": False}, nodes, tie_repeated_layers=True)
    assert no_twins.group_of[sink["layers.0.w"]] == no_twins.group_of[sink["layers.1.w"]]
    assert no_twins.group_of[sink["layers.0.w"]] != no_twins.group_of[2]
    assert len(set(no_twins.group_of)) == 16 - 3 - 1


# ------------------------------------------------------------- rejected placements


@pytest.fixture(scope="module")
def toy_nodes() -> list[IRNode]:
    """The toy model's graph, traced for a 2x4 mesh."""
    from omegaconf import OmegaConf

    from pipeline.config.compose import load_resolved
    from pipeline.stages.topology import load_nodes
    from pipeline.stages.trace.stage import trace_model

    cfg = load_resolved(["model=toy", "mesh=2x4"])
    table, _ = trace_model(OmegaConf.to_container(cfg.model, resolve=True), 8)
    return load_nodes(table)


def _toy_topology(nodes: list[IRNode], mesh: Any) -> Topology:
    return build_topology(nodes, mesh, (2, 4), ("dp", "tp"), {"fwd_bwd_consistency": True},
                          True)


def test_rejections_are_counted_per_op_into_topology_json(
        toy_nodes: list[IRNode], mesh_2x4: Any, tmp_path: Any) -> None:
    """DTensor refuses unbind along a sharded dim (RuntimeError) 14 times, once per such
    candidate of the toy's one unbind signature, and nll_loss's all-candidate call once
    each (IndexError: it zips its arguments' candidates); the counts reach topology.json."""
    from pipeline.stages.topology import read_topology, write_topology

    topo = _toy_topology(toy_nodes, mesh_2x4)
    assert topo.strategy_rejections == {"aten.nll_loss_backward.default": 1,
                                        "aten.nll_loss_forward.default": 1,
                                        "aten.unbind.int": 14}
    write_topology(topo, tmp_path, {"stage": "topology"})
    assert read_topology(tmp_path).summary["strategy_rejections"] == topo.strategy_rejections


def test_a_strategy_function_raising_type_error_fails_the_stage(
        toy_nodes: list[IRNode], mesh_2x4: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A TypeError is no rejection (a torch upgrade that changed an API would otherwise
    shrink the search silently): the stage raises, naming the op and the exception."""
    import torch

    from pipeline.dtensor.torch_compat import StrategyFunctionError, sharding_propagator

    def broken(schema: Any) -> Any:
        raise TypeError("unexpected keyword argument 'placements'")

    op = torch.ops.aten.unbind.int
    monkeypatch.setitem(sharding_propagator().op_strategy_funcs, op, broken)
    with pytest.raises(StrategyFunctionError) as err:
        _toy_topology(toy_nodes, mesh_2x4)
    assert "aten.unbind.int" in str(err.value) and "TypeError" in str(err.value)
    assert isinstance(err.value.__cause__, TypeError)
