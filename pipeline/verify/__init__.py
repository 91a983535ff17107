"""Layer 7, verify: execute a plan on gloo processes and compare with the unsharded step.

=========  =======================================================================
module     job
=========  =======================================================================
``run``    :func:`verify` and ``python -m pipeline.verify``
``models`` the real models it executes (every family), their inputs, the model hash
=========  =======================================================================
"""
