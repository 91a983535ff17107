"""Layer 1, core: what every other layer uses. Torch-free (numpy and pyarrow at most).

=================  ==================================================================
module             job
=================  ==================================================================
``errors``         the typed errors a user sees as one line (:class:`PlanError` ...)
``runtime``        atomic writes, JSON / Parquet I/O, timing, peak RSS, environment,
                   git revision (provenance of every artifact)
``artifacts``      every file a stage writes: name, owner, schema version, stamps
``ir``             the graph IR's JSON conventions (refs, ops) shared by the stages
``dtypes``         bytes per element of a dtype name (the torch table, without torch)
``parallel``       forked workers for independent parts of a stage
``progress``       progress bars and log lines of long phases
``schema_types``   type checks of structured-config dataclasses
``placement_text`` the compact placement notation's grammar (``S(0)R``, ``(A|-)``)
``recipes``        the mesh dim roles of the hand-written plans (config ``recipe``)
=================  ==================================================================
"""
