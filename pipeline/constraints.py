"""Old import path of :mod:`pipeline.budget` (the parameter-memory budget), kept so that
code importing ``pipeline.constraints`` still runs; import from ``pipeline.budget``."""

from pipeline.budget import (  # noqa: F401 - re-exported
    ParamBudget,
    budget_high_text,
    check_budget_feasible,
    param_budget,
    param_ratios,
    used_memory,
)
