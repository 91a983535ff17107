"""Tie ranks by step time (pipeline/core/ranking.py), worked by hand."""

from __future__ import annotations

import math

import pytest

from pipeline.core.ranking import tie_ranks


def test_tie_classes_by_hand():
    # 2 %: 100 leads; 101.5 <= 102 joins it; 102.5 > 102 leads a class (its own bound
    # 104.55); 104 joins; 110 alone; missing last, unranked
    got = tie_ranks([100.0, 101.5, 102.5, 104.0, 110.0, None, math.nan], 0.02)
    assert got == [(1, True), (1, True), (3, True), (3, True), (5, False),
                   (None, False), (None, False)]
    # no uncertainty: only equal step times tie
    assert tie_ranks([5.0, 5.0, 6.0], 0.0) == [(1, True), (1, True), (3, False)]
    assert tie_ranks([], 0.02) == []


def test_refuses_unsorted_or_negative():
    with pytest.raises(ValueError, match="sorted"):
        tie_ranks([2.0, 1.0], 0.02)
    with pytest.raises(ValueError, match="sorted"):
        tie_ranks([None, 1.0], 0.02)
    with pytest.raises(ValueError, match="uncertainty"):
        tie_ranks([1.0], -0.1)
