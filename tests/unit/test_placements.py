"""Compact placement notation: every token round-trips, errors are one-line ValueErrors."""

from __future__ import annotations

import random

import pytest
import torch
from torch.distributed.tensor._ops._math_ops import _NormPartial
from torch.distributed.tensor.placement_types import (
    Partial,
    Placement,
    Replicate,
    Shard,
    _MaskPartial,
    _StridedShard,
)

from pipeline.dtensor.placements import (
    REDUCE_OPS,
    format_output,
    format_placement,
    format_placements,
    format_strategy_output,
    parse_output,
    parse_placements,
)

# token text -> placement it stands for
TOKENS: dict[str, Placement] = {
    "R": Replicate(),
    "S(0)": Shard(0),
    "S(1)": Shard(1),
    "S(3)": Shard(3),
    "S(-1)": Shard(-1),
    "SS(0,2)": _StridedShard(0, split_factor=2),
    "SS(1,8)": _StridedShard(1, split_factor=8),
    "P": Partial(),
    **{f"P({op})": Partial(op) for op in REDUCE_OPS if op != "sum"},
    "NP(2)": _NormPartial(2),
    "NP(1.5)": _NormPartial(1.5),
    "NP(inf)": _NormPartial(float("inf")),
}
MASK_TOKENS = {
    "MP(0,128256x2048)": ("sum", (128256, 2048), 0),
    "MP(1,4x8x16)": ("sum", (4, 8, 16), 1),
    "MP(0)": ("sum", None, 0),
    "MP(max,1,10)": ("max", (10,), 1),
}


def _same(a: Placement, b: Placement) -> bool:
    """Equality, by value for _MaskPartial (its __eq__ compares the buffer's identity)."""
    if isinstance(a, _MaskPartial) or isinstance(b, _MaskPartial):
        return (
            isinstance(a, _MaskPartial)
            and isinstance(b, _MaskPartial)
            and (a.reduce_op, a.offset_shape, a.offset_dim)
            == (b.reduce_op, b.offset_shape, b.offset_dim)
        )
    return type(a) is type(b) and a == b


@pytest.mark.parametrize("text", sorted(TOKENS))
def test_token_round_trip(text):
    p = TOKENS[text]
    assert format_placement(p) == text
    (parsed,) = parse_placements(text)
    assert _same(parsed, p)
    assert format_placements(parse_placements(text)) == text


@pytest.mark.parametrize("text", sorted(MASK_TOKENS))
def test_mask_partial_round_trip(text):
    op, shape, dim = MASK_TOKENS[text]
    p = _MaskPartial(
        reduce_op=op, offset_shape=None if shape is None else torch.Size(shape), offset_dim=dim
    )
    assert format_placement(p) == text
    (parsed,) = parse_placements(text)
    assert _same(parsed, p)
    assert parsed.reduce_op == op
    assert parsed.offset_shape == (None if shape is None else torch.Size(shape))
    assert parsed.offset_dim == dim


def test_partial_sum_spellings():
    assert parse_placements("P(sum)") == (Partial("sum"),)
    assert format_placements(parse_placements("P(sum)")) == "P"


def test_examples_from_design():
    assert parse_placements("S(0)RS(1)") == (Shard(0), Replicate(), Shard(1))
    assert parse_placements("S(0)RS(1)", 3) == (Shard(0), Replicate(), Shard(1))
    assert format_placements((Partial("avg"), Partial("max"))) == "P(avg)P(max)"
    assert parse_output("(S(0)R|-|RR)") == [(Shard(0), Replicate()), None, (Replicate(),) * 2]
    assert format_output([(Shard(0), Replicate()), None, (Replicate(), Replicate())]) == (
        "(S(0)R|-|RR)"
    )


def test_whitespace_ignored():
    assert parse_placements(" S(0) R SS( 1 , 2 ) ") == (
        Shard(0),
        Replicate(),
        _StridedShard(1, split_factor=2),
    )


def test_output_forms():
    assert parse_output("()") == []
    assert format_output([]) == "()"
    assert parse_output("(RR)") == [(Replicate(), Replicate())]
    assert parse_output("S(0)R") == [(Shard(0), Replicate())]  # bare = one element
    assert parse_output("(-|P)", 1) == [None, (Partial(),)]
    out = parse_output("(RR|-)")
    out.append(None)  # a fresh list: the cache is not mutated
    assert parse_output("(RR|-)") == [(Replicate(), Replicate()), None]


def test_strategy_output_forms():
    # a single-output op: the bare placement; a tuple-returning op: one entry per element
    assert format_strategy_output((Shard(0), Replicate())) == "S(0)R"
    assert format_strategy_output([Partial("avg")]) == "P(avg)"
    sdpa_like = ((Shard(0), Replicate()), None, (Replicate(), Partial()))
    assert format_strategy_output(sdpa_like) == "(S(0)R|-|RP)"
    assert format_strategy_output((None, (Shard(1),))) == "(-|S(1))"
    assert format_strategy_output(None) == "-"
    assert parse_output(format_strategy_output(sdpa_like), 2) == list(sdpa_like)
    with pytest.raises(ValueError, match="empty"):
        format_strategy_output(())


def test_every_dtensor_placement_type_has_a_token():
    """Guard against a new Placement subclass in a future torch: each must format."""

    def subclasses(cls):
        for sub in cls.__subclasses__():
            yield sub
            yield from subclasses(sub)

    samples = {
        Shard: Shard(0),
        _StridedShard: _StridedShard(0, split_factor=2),
        Replicate: Replicate(),
        Partial: Partial("max"),
        _MaskPartial: _MaskPartial(offset_shape=torch.Size([4, 2]), offset_dim=0),
        _NormPartial: _NormPartial(2),
    }
    for cls in subclasses(Placement):
        if cls.__module__ == "torch._C._distributed":
            continue  # C++ bases of the Python classes below
        assert cls in samples, f"no token for placement type {cls.__module__}.{cls.__name__}"
        p = samples[cls]
        assert _same(parse_placements(format_placement(p))[0], p)


def test_raw_cpp_placements_format():
    c = torch._C._distributed
    placements = (c.Shard(1), c.StridedShard(0, split_factor=2), c.Replicate(), c.Partial("avg"))
    assert format_placements(placements) == "S(1)SS(0,2)RP(avg)"


def _random_placement(rng: random.Random) -> Placement:
    kind = rng.randrange(7)
    if kind == 0:
        return Replicate()
    if kind == 1:
        return Shard(rng.randrange(-3, 5))
    if kind == 2:
        return _StridedShard(rng.randrange(0, 5), split_factor=rng.randrange(1, 17))
    if kind == 3:
        return Partial(rng.choice(REDUCE_OPS))
    if kind == 4:
        shape = rng.choice([None, torch.Size([rng.randrange(1, 9999)]), torch.Size([7, 3, 2])])
        return _MaskPartial(
            reduce_op=rng.choice(("sum", "avg")), offset_shape=shape, offset_dim=rng.randrange(3)
        )
    if kind == 5:
        return _NormPartial(rng.choice([1, 2, 3, 0.5, 2.5, float("inf"), float("-inf")]))
    return Shard(rng.randrange(0, 3))


def test_property_random_combinations():
    rng = random.Random(1234)
    for _ in range(2000):
        ndim = rng.randrange(1, 5)
        placements = tuple(_random_placement(rng) for _ in range(ndim))
        text = format_placements(placements)
        parsed = parse_placements(text, ndim)
        assert len(parsed) == ndim
        assert all(_same(a, b) for a, b in zip(parsed, placements)), text
        assert format_placements(parsed) == text
        # tuple outputs with non-tensor holes
        outs = [None if rng.random() < 0.3 else placements for _ in range(rng.randrange(0, 4))]
        otext = format_output(outs)
        back = parse_output(otext, ndim)
        assert len(back) == len(outs)
        for a, b in zip(back, outs):
            assert (a is None) == (b is None)
            if a is not None:
                assert all(_same(x, y) for x, y in zip(a, b))
        assert format_output(back) == otext


def test_parse_is_cached():
    assert parse_placements("S(0)RP") is parse_placements("S(0)RP")


@pytest.mark.parametrize(
    ("text", "ndim", "fragment"),
    [
        ("", None, "empty"),
        ("X", None, "cannot parse at 'X'"),
        ("S(a)", None, "cannot parse"),
        ("S(0)Q", None, "cannot parse at 'Q'"),
        ("P(foo)", None, "unknown reduce op 'foo'"),
        ("SS(0,0)", None, "split factor"),
        ("RRR", 2, "3 token(s) for a 2-d mesh"),
        ("R", 3, "1 token(s) for a 3-d mesh"),
    ],
)
def test_errors_are_one_line_value_errors(text, ndim, fragment):
    with pytest.raises(ValueError) as info:
        parse_placements(text, ndim)
    msg = str(info.value)
    assert "\n" not in msg
    assert fragment in msg
    assert repr(text) in msg
    assert "allowed tokens" in msg


def test_output_errors():
    with pytest.raises(ValueError, match="element 1"):
        parse_output("(RR|XX)")
    with pytest.raises(ValueError, match="2 token"):
        parse_output("(RR|-)", 1)
    with pytest.raises(ValueError):
        parse_placements(3)  # type: ignore[arg-type]


def test_format_errors():
    with pytest.raises(ValueError, match="empty"):
        format_placements(())
    with pytest.raises(ValueError, match="cannot format"):
        format_placement("R")  # type: ignore[arg-type]
