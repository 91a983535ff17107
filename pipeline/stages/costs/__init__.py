"""Stage 3 - costs: the pairwise MRF of the topology (eager factors, or lazy).

================  ================================================================
module            job
================  ================================================================
``stage``         :func:`run_costs` / :func:`load_costs`: build (:func:`build_mrf`,
                  from pipeline/costmodel/) and store the MRF
``factors_file``  ``factors.npz``: the eager MRF written and read back bit for bit
``problem_size``  estimate of the problem before the factors are built (a refusal
                  in one line when it would not fit)
================  ================================================================
"""
