"""Layer 6, stages: trace -> topology -> costs -> solve -> report, and the runner.

Each stage is a package with a ``stage`` module holding its ``run_<stage>`` function; a
stage reads only the artifacts of the stages before it (:mod:`pipeline.core.artifacts`).

=================  ==================================================================
package / module   job
=================  ==================================================================
``trace``          joint forward + backward graph on meta tensors -> ``graph.parquet``
``topology``       DTensor strategies, edges, groups, pins -> ``nodes/strategies/edges``
``costs``          the MRF's unary and pairwise factors (eager) or the cost model (lazy)
``solve``          a solver on the MRF -> ``solution.parquet``, ``run.json``, ``plan.json``
``report``         every run record -> ``runs.parquet``, pictures, HTML
``runner``         runs a stage when its artifacts are missing or stale (locks, stamps),
                   every stage in order (``run_pipeline``), ``python -m pipeline.cli``
=================  ==================================================================
"""
