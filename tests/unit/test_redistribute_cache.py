"""Redistribution tables from per-pair cached records, and the rule-based planner.

* ``plan_greedy`` / ``plan_strided`` (our re-implementations of DTensor's greedy and
  graph planners) must give exactly the steps of DTensor's own planner
  (``tests/support/dtensor_reference.py``: kind, mesh dim, order, placements before/after,
  divisors, reshuffle flags) for all pairs of placements.
* ``redistribute_table`` must equal the element-wise ``redistribute_us`` bit for bit,
  whatever order tables are built in (records are shared across tables).
* ``placements_differ`` must equal the ``s != d`` double loop.
"""

from __future__ import annotations

import itertools
import math
import random

import numpy as np
import pytest
from dtensor_reference import DTensorReference

from pipeline.costmodel.hardware import HardwareConfig
from pipeline.costmodel.redistribute import (
    DEFAULT_INTERNER,
    PlacementInterner,
    clear_caches,
    normalize_placements,
    placements_differ,
    plan,
    planner,
    records,
    redistribute_table,
    redistribute_us,
)
from pipeline.costmodel.redistribute.steps import category
from pipeline.dtensor.placements import parse_placements as pp

MP = "MP(0,128x2)"


# session-scoped (cheap to build): tests sharing a module-scoped fixture are one xdist
# group on one worker (tests/support/xdist_groups.py); these checks spread over both
@pytest.fixture(scope="session")
def hw() -> HardwareConfig:
    return HardwareConfig()


@pytest.fixture(scope="session")
def ref() -> DTensorReference:
    return DTensorReference()


def _tokens(rank: int, extra: list[str]) -> list[str]:
    return ["R", *(f"S({d})" for d in range(rank)), "P", *extra]


def _all_placements(mesh_ndim: int, rank: int, extra: list[str]) -> list[tuple]:
    toks = _tokens(rank, extra)
    return [normalize_placements(pp("".join(c))) for c in itertools.product(toks, repeat=mesh_ndim)]


def _check_rules_equal_dtensor(ref: DTensorReference, mesh_ndim: int, rank: int,
                               extra: list[str]) -> int:
    pls = _all_placements(mesh_ndim, rank, extra)
    canon_mesh = (2,) * mesh_ndim
    n = 0
    for s in pls:
        for d in pls:
            if s == d:
                continue
            ours = planner.plan_greedy(DEFAULT_INTERNER, s, d)
            theirs = ref.plan(s, d, canon_mesh, None)
            assert ours == theirs, (s, d, ours, theirs)
            if ours is not None:  # Step equality compares placements by value: check kinds
                assert [(a.mesh_dim, a.kind, a.divs, a.own_dim) for a in ours] == [
                    (b.mesh_dim, b.kind, b.divs, b.own_dim) for b in theirs
                ]
            n += 1
    return n


# 1-d and 2-d meshes: every placement kind the notation has besides _StridedShard
# (plain/avg/max/min Partial, _MaskPartial with and without offset shape, _NormPartial).
EXTRA_1D = ["P(avg)", "P(max)", "P(min)", MP, "MP(1)", "NP(2)"]
EXTRA_2D = ["P(avg)", "P(max)", MP, "NP(2)"]


@pytest.mark.parametrize("rank", range(5))
def test_rule_planner_equals_dtensor_1d_2d(rank, ref):
    assert _check_rules_equal_dtensor(ref, 1, rank, EXTRA_1D) > 0
    assert _check_rules_equal_dtensor(ref, 2, rank, EXTRA_2D) > 0


@pytest.mark.parametrize("rank", range(3))
def test_rule_planner_equals_dtensor_3d(rank, ref):
    assert _check_rules_equal_dtensor(ref, 3, rank, ["P(avg)"]) > 0


@pytest.mark.slow
@pytest.mark.parametrize("rank", [3, 4])
def test_rule_planner_equals_dtensor_3d_large(rank, ref):
    # 3-d, ranks 3 and 4 with a _MaskPartial too: 117k and 262k pairs (about a minute)
    assert _check_rules_equal_dtensor(ref, 3, rank, ["P(avg)", MP]) > 0


def test_plan_avoids_dtensor(monkeypatch):
    # plan() uses the rule-based planner, and the graph planner re-implementation for a
    # decodable _StridedShard: DTensor's planner is only the reference
    from torch.distributed.tensor import _redistribute

    clear_caches()

    def fail(*a, **k):
        raise AssertionError("DTensor planner called")

    for name in ("_gen_transform_infos_non_cached", "_gen_transform_infos"):
        monkeypatch.setattr(_redistribute, name, fail)
    assert plan(pp("S(0)RP"), pp("RS(1)R")) is not None
    steps = plan(pp("SS(0,4)S(0)"), pp("RR"), (2, 4), (64, 64))
    assert [(s.mesh_dim, s.kind) for s in steps] == [(0, "all_gather"), (1, "all_gather")]
    assert plan(pp("SS(0,2)S(0)"), pp("RR"), (2, 4), (64, 64))  # undecodable: greedy


# --------------------------------------------------------------------------- strided


def _strided_pairs(mesh, toks):
    pls = [normalize_placements(pp("".join(c))) for c in itertools.product(toks, repeat=len(mesh))]
    is_ss = [any(category(x) == "SS" for x in p) for p in pls]
    pairs = [(s, d) for a, s in enumerate(pls) if is_ss[a] for b, d in enumerate(pls) if a != b]
    pairs += [
        (d, s) for a, s in enumerate(pls) if is_ss[a] for b, d in enumerate(pls) if not is_ss[b]
    ]
    return pairs


def _check_strided_equal_dtensor(ref, mesh, shape, pairs):
    n_none = 0
    for s, d in pairs:
        ours = planner.plan_strided(DEFAULT_INTERNER, s, d, mesh, shape)
        theirs = ref.plan(s, d, mesh, shape)
        assert ours == theirs, (s, d, ours, theirs)
        n_none += ours is None
    assert 0 < n_none < len(pairs)


# SS(0,2) on a (2, 4) mesh cannot be decoded into a shard order (DTensor's greedy
# fallback); SS(0,4) / SS(1,4) can (graph planner); a _MaskPartial target is unreachable
# for the graph planner (None).
TOKS_2X4 = ["R", "S(0)", "S(1)", "P", "P(avg)", "SS(0,4)", "SS(1,4)", "SS(0,2)", "MP(0,8x8)"]


@pytest.mark.parametrize("shape", [(64, 48), (7, 4096)])
def test_strided_planner_equals_dtensor_2x4(shape, ref):
    _check_strided_equal_dtensor(ref, (2, 4), shape, _strided_pairs((2, 4), TOKS_2X4))


def test_strided_planner_equals_dtensor_2x2x2_sample(ref):
    pairs = _strided_pairs((2, 2, 2), ["R", "S(0)", "S(1)", "P", "SS(0,2)", "SS(0,4)", "SS(1,2)"])
    _check_strided_equal_dtensor(ref, (2, 2, 2), (16, 16), random.Random(0).sample(pairs, 3000))


@pytest.mark.slow
@pytest.mark.parametrize("part", range(4))
def test_strided_planner_equals_dtensor_2x2x2_all(ref, part):
    # 173k pairs in four interleaved parts (every pair in exactly one), about a minute
    pairs = _strided_pairs((2, 2, 2), ["R", "S(0)", "S(1)", "P", "SS(0,2)", "SS(0,4)", "SS(1,2)"])
    _check_strided_equal_dtensor(ref, (2, 2, 2), (16, 16), pairs[part::4])


@pytest.mark.slow
def test_strided_planner_equals_dtensor_2x4x8_sample(ref):
    # placements of the toy model on 2x4x8 (FSDP-style _StridedShards)
    srcs = [
        pp(t)
        for t in (
            "S(0)SS(0,8)S(0)",
            "SS(2,8)RS(2)",
            "SS(2,4)S(2)SS(2,1)",
            "SS(1,4)S(1)P",
            "RSS(2,8)S(2)",
            "SS(3,16)RS(0)",
            "SS(3,16)S(0)P",
        )
    ]
    toks = ["R", "S(0)", "S(1)", "S(2)", "P", "P(avg)", "P(max)"]
    dsts = [pp("".join(c)) for c in itertools.product(toks, repeat=3)]
    pairs = [(s, d) for s in srcs for d in random.Random(1).sample(dsts, 15)]
    _check_strided_equal_dtensor(ref, (2, 4, 8), (16, 64, 256, 8), pairs)


# --------------------------------------------------------------------------- tables


def _check_table(shape, itemsize, srcs, dsts, mesh, hw):
    table = redistribute_table(shape, itemsize, srcs, dsts, mesh, hw)
    assert table.shape == (len(srcs), len(dsts)) and table.dtype == np.float64
    for i, s in enumerate(srcs):
        for j, d in enumerate(dsts):
            ref = redistribute_us(shape, itemsize, s, d, mesh, hw)
            assert table[i, j] == ref, (shape, mesh, s, d, table[i, j], ref)
    return table


CASES = [
    ((2, 4, 8), (1000, 2047), ["P(avg)", "P(max)"]),
    ((2, 4, 8), (4, 64, 33, 129), ["P(avg)", MP]),
    ((2, 4, 8), (7,), ["P(avg)"]),
    ((2, 4, 8), (), ["P(avg)"]),
    ((2, 1, 8), (96, 17, 5), ["P(avg)"]),
    ((1, 4), (64, 30), ["P(avg)", "P(max)", MP]),
    ((8, 8), (16, 1024, 3), ["P(avg)", "NP(2)"]),
    ((16,), (3, 5, 4096), ["P(avg)", "P(max)", MP, "NP(2)"]),
]


@pytest.mark.parametrize(("mesh", "shape", "extra"), CASES)
def test_table_equals_scalar_on_random_subsets(mesh, shape, extra, hw):
    clear_caches()
    rng = random.Random(hash((mesh, shape)) & 0xFFFF)
    toks = _tokens(len(shape), extra)
    if len(shape):
        toks += [f"S({-1})"]  # negative dims share the normalized placement's records
    pls = [pp("".join(c)) for c in itertools.product(toks, repeat=len(mesh))]
    # overlapping random subsets in sequence: later tables reuse earlier pairs' records
    for _ in range(6):
        srcs = rng.sample(pls, min(len(pls), rng.randint(1, 30)))
        dsts = rng.sample(pls, min(len(pls), rng.randint(1, 30)))
        _check_table(shape, rng.choice([2, 4]), srcs, dsts, mesh, hw)
    # repeated placements within one table, lists instead of tuples
    srcs = [list(p) for p in rng.choices(pls, k=12)]
    _check_table(shape, 2, srcs, srcs[::-1], mesh, hw)


def test_pairs_are_planned_once_across_tables(hw, monkeypatch):
    clear_caches()
    toks = ["R", "S(0)", "S(1)", "P"]
    pls = [pp("".join(c)) for c in itertools.product(toks, repeat=3)]
    mesh, shape = (2, 4, 8), (256, 512)
    calls = []
    orig = records.TableContext._batch_records

    def counting(self, i, j):
        calls.extend(zip((self.norms[k] for k in i), (self.norms[k] for k in j)))
        return orig(self, i, j)

    monkeypatch.setattr(records.TableContext, "_batch_records", counting)
    full = redistribute_table(shape, 2, pls, pls, mesh, hw)
    assert len(calls) == len(pls) ** 2 - len(pls)  # src == dst needs no plan
    assert len(set(calls)) == len(calls)
    calls.clear()
    # other (srcs, dsts) combinations, another shape and dtype: no planning at all
    rng = random.Random(1)
    for _ in range(5):
        si = rng.sample(range(len(pls)), 20)
        di = rng.sample(range(len(pls)), 17)
        t = redistribute_table(shape, 2, [pls[i] for i in si], [pls[j] for j in di], mesh, hw)
        assert np.array_equal(t, full[np.ix_(si, di)])
    redistribute_table((100, 3), 4, pls[::2], pls[1::3], mesh, hw)
    assert calls == []
    # a 3-d tensor is another context: planned again (once)
    redistribute_table((8, 8, 8), 2, pls[:3], pls[:3] + pls[:3], mesh, hw)
    assert len(calls) == 6
    ctx = DEFAULT_INTERNER.table_contexts[(mesh, 2)]
    # one record per distinct step sequence (equal ones shared), one step row per step
    assert len(ctx.records) < len(pls) ** 2
    assert len(ctx.step_rows) < len(ctx.records)
    # fresh arrays
    a = redistribute_table(shape, 2, pls, pls, mesh, hw)
    a[0, 1] = -1.0
    assert redistribute_table(shape, 2, pls, pls, mesh, hw)[0, 1] == full[0, 1]


def test_strided_tables(hw):
    clear_caches()
    mesh = (2, 4)
    pls = [
        pp(t)
        for t in (
            "RR",
            "S(0)S(0)",
            "SS(0,4)S(0)",
            "PR",
            "RS(1)",
            "SS(1,4)S(1)",
            "SS(0,2)S(0)",
            "SS(1,2)R",
            "MP(0,8x8)R",
            "P(max)R",
        )
    ]
    for shape in ((1024, 4096), (64, 64), (1000, 4096), (4, 4)):
        _check_table(shape, 2, pls, pls, mesh, hw)
        _check_table(shape, 2, pls[:2], pls[3:], mesh, hw)
    # graph-planned pairs are kept per shape; the others once
    ctx = DEFAULT_INTERNER.table_contexts[(mesh, 2)]
    assert set(ctx.shape_pair) == {(1024, 4096), (64, 64), (1000, 4096), (4, 4)}
    ids = ctx.intern(pls, "src")
    sp = ctx.shape_pair[(64, 64)][np.ix_(ids, ids)]
    base = ctx.pair[np.ix_(ids, ids)]
    assert ((sp >= 0) != (base >= 0)).all()  # each pair in exactly one of them
    assert sp[2, 0] >= 0 and base[6, 0] >= 0  # decodable / undecodable _StridedShard
    # uneven and 3-d meshes, and a _StridedShard on a size-1 mesh dim
    for mesh, shape, texts in [
        (
            (2, 4, 8),
            (16, 64, 256),
            (
                "S(0)SS(0,8)S(0)",
                "SS(2,8)RS(2)",
                "SS(2,4)S(2)SS(2,1)",
                "RRR",
                "S(0)S(1)S(2)",
                "PRS(2)",
                "S(2)S(2)S(2)",
                "RRP",
            ),
        ),
        ((2, 1, 8), (64, 48), ("SS(0,8)S(1)S(0)", "SS(1,2)RR", "S(0)RS(0)", "RRR", "PRS(1)")),
    ]:
        pls = [pp(t) for t in texts]
        _check_table(shape, 4, pls, pls, mesh, hw)


def test_batch_planner_equals_plan(hw):
    # every greedy-planned pair's record equals the one built from plan()'s Steps
    cases = [
        ((2, 4, 8), ["R", "S(0)", "S(1)", "S(2)", "P", "P(avg)", MP]),
        ((2, 1, 4), ["R", "S(0)", "S(1)", "P", "P(max)", "SS(0,2)", "SS(1,8)"]),
        ((4, 4), ["R", "S(0)", "S(1)", "S(-1)", "P", "P(avg)", "P(max)", "NP(2)", "SS(0,2)"]),
        ((8,), ["R", "S(0)", "S(1)", "P", "P(min)", MP, "SS(0,2)"]),
    ]
    for mesh, toks in cases:
        clear_caches()
        pls = [pp("".join(c)) for c in itertools.product(toks, repeat=len(mesh))]
        shape = (12, 40, 6)
        redistribute_table(shape, 2, pls, pls, mesh, hw)
        ctx = DEFAULT_INTERNER.table_contexts[(mesh, 3)]
        ids = sorted(set(ctx.intern(pls, "src").tolist()))
        pairs = list(itertools.product(ids, ids))
        if len(pairs) > 6000:
            pairs = random.Random(0).sample(pairs, 6000)
        n = 0
        for a, b in pairs:
            r = ctx.pair[a, b]
            if r < 0:
                continue  # graph-planned
            steps = planner.plan_normalized(DEFAULT_INTERNER, ctx.norms[a], ctx.norms[b], mesh,
                                            shape)
            assert ctx.records[r] == ctx.steps_record(steps), (ctx.norms[a], ctx.norms[b])
            n += 1
        assert n > 0.5 * len(pairs)


def test_table_edge_cases(hw):
    clear_caches()
    mesh = (2, 4)
    assert redistribute_table((8, 8), 2, [], [pp("RR")], mesh, hw).shape == (0, 1)
    assert redistribute_table((8, 8), 2, [pp("RR")], [], mesh, hw).shape == (1, 0)
    z = redistribute_table((8, 8), 2, [pp("RR")], [pp("RR"), pp("PR")], mesh, hw)
    assert z.tolist() == [[0.0, 0.0]]
    t = redistribute_table((8, 8), 2, [pp("S(0)R"), pp("PR")], [pp("PR"), pp("P(max)R")], mesh, hw)
    assert t[0, 0] == math.inf and t[1, 0] == 0.0 and np.isinf(t[:, 1]).all()
    # validation errors name the side and leave the cache usable
    with pytest.raises(ValueError, match="src placement"):
        redistribute_table((8, 8), 2, [pp("S(2)R")], [pp("RR")], mesh, hw)
    with pytest.raises(ValueError, match="dst placements"):
        redistribute_table((8, 8), 2, [pp("RR")], [pp("R")], mesh, hw)
    with pytest.raises(ValueError, match="itemsize"):
        redistribute_table((8, 8), 0, [pp("RR")], [pp("RR")], mesh, hw)
    _check_table((8, 8), 2, [pp("S(1)R"), pp("RR")], [pp("RS(0)"), pp("S(-1)R")], mesh, hw)


# --------------------------------------------------------------------------- differ


def test_placements_differ_equals_double_loop():
    texts = [
        "RR",
        "S(0)R",
        "S(-1)R",
        "S(1)R",
        "PR",
        "P(sum)R",
        "P(avg)R",
        MP + "R",
        "NP(2)R",
        "NP(2.0)R",
        "SS(0,4)S(0)",
        "RS(0)",
    ]
    pls = [pp(t) for t in texts]
    pls.append(pp(MP + " R"))  # an equal-valued _MaskPartial with another mask buffer
    pls.append(tuple(pls[1]))  # an equal copy
    rng = random.Random(3)
    for _ in range(5):
        srcs = rng.choices(pls, k=9)
        dsts = rng.choices(pls, k=11)
        ref = np.array([[s != d for d in dsts] for s in srcs], dtype=bool)
        got = placements_differ(srcs, dsts)
        assert got.dtype == bool and got.shape == (9, 11)
        assert np.array_equal(got, ref)
    assert placements_differ([], pls).shape == (0, len(pls))
    assert placements_differ([list(pls[1])], [pls[1]]).tolist() == [[False]]


def test_record_costs_cached_per_shape_dtype_and_hardware(hw):
    # interleaved shapes, dtypes and hardware while records are being added: every table
    # still equals redistribute_us
    import dataclasses

    clear_caches()
    slow_hw = dataclasses.replace(hw, hbm_bandwidth=hw.hbm_bandwidth / 3)
    toks = ["R", "S(0)", "S(1)", "P", "P(avg)"]
    pls = [pp("".join(c)) for c in itertools.product(toks, repeat=3)]
    rng = random.Random(5)
    mesh = (2, 4, 8)
    for k in range(8):
        srcs = rng.sample(pls, 15)
        dsts = rng.sample(pls, 15)
        shape = [(64, 128), (1000, 33)][k % 2]
        h = [hw, slow_hw][(k // 2) % 2]
        _check_table(shape, [2, 4][(k // 4) % 2], srcs, dsts, mesh, h)
    a = redistribute_table((64, 128), 2, pls[:5], pls[5:9], mesh, hw)
    b = redistribute_table((64, 128), 2, pls[:5], pls[5:9], mesh, slow_hw)
    assert (a <= b).all() and (a < b).any()


# --------------------------------------------------------------------------- interner


def test_clear_resets_every_cache(hw):
    # a private interner used by every entry point fills every cache; clear() leaves it
    # exactly as fresh as a new one (no pid, plan, context or mesh survives)
    it = PlacementInterner()
    mesh = (2, 4)
    pls = [pp(t) for t in ("RR", "S(0)S(0)", "SS(0,4)S(0)", "PR", "RS(1)", MP + "R", "P(max)R")]
    before = {k: len(v) for k, v in vars(DEFAULT_INTERNER).items() if isinstance(v, dict)}
    table = redistribute_table((64, 64), 2, pls, pls, mesh, hw, interner=it)
    placements_differ(pls, pls, interner=it)
    assert plan(pp("S(0)RP"), pp("RS(1)R"), interner=it) is not None
    assert redistribute_us((64, 64), 2, pls[2], pls[0], mesh, hw, interner=it) == table[2, 0]
    fresh = PlacementInterner()
    assert set(vars(it)) == set(vars(fresh))
    for name, value in vars(it).items():
        if name != "replicate":
            assert value is not None and value != getattr(fresh, name), f"{name} unused"
    it.clear()
    for name, value in vars(it).items():
        ref = getattr(fresh, name)
        if isinstance(value, (dict, list)):
            assert len(value) == len(ref), name
        else:
            assert value == ref, name
    assert it.objs == fresh.objs and it.replicate == 0
    # the default interner was not touched, and gives the same values
    after = {k: len(v) for k, v in vars(DEFAULT_INTERNER).items() if isinstance(v, dict)}
    assert after == before
    assert np.array_equal(redistribute_table((64, 64), 2, pls, pls, mesh, hw), table)
    # a cleared interner rebuilds the same table
    assert np.array_equal(redistribute_table((64, 64), 2, pls, pls, mesh, hw, interner=it), table)


def test_pairs_planned_in_blocks_give_the_same_table(hw, monkeypatch):
    """The batch planner run on blocks of pairs (records.PAIR_BLOCK) gives every entry of
    a 4-d table bit for bit as one call over all pairs, and each entry equals the
    scalar redistribute_us."""
    mesh = (2, 2, 2, 2)
    texts = ["".join(p) for p in itertools.product(["R", "S(0)", "S(1)", "P"], repeat=4)]
    pls = [pp(t) for t in texts]
    whole = redistribute_table((64, 32), 2, pls, pls, mesh, hw, interner=PlacementInterner())
    monkeypatch.setattr(records, "PAIR_BLOCK", 7)
    blocks = redistribute_table((64, 32), 2, pls, pls, mesh, hw,
                                interner=PlacementInterner())
    assert whole.shape == (256, 256)
    assert np.array_equal(whole, blocks)
    rng = random.Random(5)
    for _ in range(40):
        i, j = rng.randrange(256), rng.randrange(256)
        assert blocks[i, j] == redistribute_us((64, 32), 2, pls[i], pls[j], mesh, hw)
