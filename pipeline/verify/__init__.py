"""Layer 7, verify: execute a plan on gloo processes and compare with the unsharded step.

==================  ==============================================================
module              job
==================  ==============================================================
``run``             :func:`verify` and ``python -m pipeline.verify``: checks the
                    inputs, runs the stages and the processes, writes ``verify.json``
``execute``         what each process runs: the planned step on ``gloo``, rank 0's
                    reference step
``models``          the real models it executes (every family), their inputs, the
                    model hash
``pipelined``       verify of a pipelined plan (a ``pp`` mesh dim): the plan's
                    pipeline section checked, the processes, the ``pipelined`` record
``pipelined_rank``  what each of its processes runs: its stages under torch's schedule
==================  ==============================================================
"""
