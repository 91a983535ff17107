"""Layer 3, the cost model: what a placement plan costs per step, in µs (may use
pipeline/memory/; never the config or the stages, which pass values in).

=================  ==================================================================
module             job
=================  ==================================================================
``model``          :class:`CostModel`: unary vectors per node and edge tables over
                   placement classes, the objective's terms (``TRANSITION_COST``)
``factors``        groups fold node and edge costs into the group MRF's factors
                   (:class:`FactorProvider`: eager, in workers, or on first use)
``compute``        roofline compute cost of one op on one device
``comm``           alpha-beta time of NCCL collectives over mesh groups (the one
                   formula)
``hardware``       the hardware description and its validation
``redistribute``   the cost of redistributing a tensor between two placements: plans,
                   step costs, all-pairs tables (a package, its own table)
``op_comm``        collectives a strategy issues inside its op (vocab-parallel
                   softmax)
``fusion``         the pointwise-fusion term of elementwise edges
``model_parallel`` ``constraints.model_parallel``: which edges carry activations, +inf
                   on their collectives over cross-node mesh dims
``fsdp``           FSDP2's collective semantics per edge: buckets, re-gather, reduce
                   dtype
``breakdown``      a plan's objective split per node and per edge (run record)
``steptime``       overlap-aware step time of a plan (compute and comm streams)
``accumulation``   gradient accumulation: a step of k microbatches from one
                   microbatch's simulated step
``schedules``      pipeline schedules (gpipe, 1f1b, interleaved 1f1b): each rank's
                   order, its event simulation, the closed forms
``pipelining``     a pipelined step from per-stage costs: boundary sends, FSDP2
                   gathers and reductions under pipelining, memory per rank
``pipeline_split`` the split of the layers into stages: an exact DP over layer
                   boundaries (Alpa's pipeline latency, memory per stage)
=================  ==================================================================

This package file imports nothing: importing one module does not import the others.
"""
