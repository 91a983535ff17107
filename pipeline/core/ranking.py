"""Rankings of plans by their simulated step time, with ties where the step-time model
cannot tell them apart.

A ranking (the shapes table of pipeline/tools/shapes.py, the recipe comparison of the
report, the paper's plan table) orders its plans by ``step_time_us``, best first. Two
plans whose step times differ by less than the model's relative uncertainty ``u``
(``costs.step_time_uncertainty``) are a *tie*: walking the sorted list, a plan joins
the tie class of the class's first (fastest) plan ``s_0`` while ``s - s_0 <= u * s_0``,
and every plan of a class gets the class's rank (competition ranking: ``1, 1, 3``).
A plan without a step time comes last, unranked.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["tie_ranks"]


def tie_ranks(step_times: Sequence[float | None], uncertainty: float
              ) -> list[tuple[int | None, bool]]:
    """``(rank, tied)`` per entry of ``step_times``, which must be sorted ascending with
    every missing (None / NaN) value last (module docstring); ``tied``: the entry's class
    has another plan. Raises ValueError on unsorted input or a negative uncertainty."""
    if not (uncertainty >= 0):
        raise ValueError(f"tie_ranks: uncertainty={uncertainty}: allowed a number >= 0")
    values = [None if v is None or (isinstance(v, float) and math.isnan(v)) else float(v)
              for v in step_times]
    known = [v for v in values if v is not None]
    if known != sorted(known) or values[:len(known)] != known:
        raise ValueError("tie_ranks: step times must be sorted ascending, missing ones last")
    lead_of: list[int] = []
    lead = 0
    for i, v in enumerate(known):
        if v - known[lead] > uncertainty * known[lead]:
            lead = i
        lead_of.append(lead)
    size: dict[int, int] = {}
    for lead in lead_of:
        size[lead] = size.get(lead, 0) + 1
    out: list[tuple[int | None, bool]] = [(lead + 1, size[lead] > 1) for lead in lead_of]
    return out + [(None, False)] * (len(values) - len(known))
