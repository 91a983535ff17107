"""Layer 4, plan: the plan file (``plan.json``), the form in which a plan leaves the planner.

==========  ======================================================================
module      job
==========  ======================================================================
``format``  write, load and check a plan file (:func:`load` returns a :class:`Plan`)
==========  ======================================================================

``pipeline.plan.load(path)`` is the public way in; the schema is in ``docs/plan.md``.
"""

from pipeline.plan.format import (
    PLAN_FILE,
    PLAN_FORMAT,
    PLAN_VERSION,
    NodePlan,
    Plan,
    PlanFileError,
    TensorPlan,
    load,
)

__all__ = ["PLAN_FILE", "PLAN_FORMAT", "PLAN_VERSION", "NodePlan", "Plan", "PlanFileError",
           "TensorPlan", "load"]
