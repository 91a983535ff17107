"""Stage 3 - costs: the pairwise MRF of the topology (eager factors, or lazy).

================  ================================================================
module            job
================  ================================================================
``stage``         :func:`run_costs` / :func:`load_costs`: build and store the MRF
``problem_size``  estimate of the problem before the factors are built (a refusal
                  in one line when it would not fit)
================  ================================================================
"""
