"""Strategy enumeration of single ops, counted by hand.

``aten.mm`` has, per mesh dim (DTensor's single-dim rules, shared/NOTES-torch.md),
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

import pytest

from pipeline.placements import format_placements
from pipeline.topology import IRNode, StrategyEnumerator, candidate_placements, device_mesh


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
