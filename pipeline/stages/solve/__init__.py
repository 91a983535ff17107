"""Stage 4 - solve: a solver on the MRF; the solution, the run record and the plan file.

=========  =======================================================================
module     job
=========  =======================================================================
``stage``  :func:`run_solve`: solve, price the plan (step time, memory, breakdown),
           write ``solution.parquet``, ``plan.json`` and ``run.json`` (last)
=========  =======================================================================
"""
