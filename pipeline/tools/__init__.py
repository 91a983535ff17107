"""Layer 7, tools: commands built on the stages; nothing below imports them.

=============  ===================================================================
package        job
=============  ===================================================================
``bench``      ``python -m pipeline.tools.bench``: timed benchmark suites
``paper``      ``python -m pipeline.tools.paper``: the paper's figures and tables
``shapes``     ``python -m pipeline.tools.shapes``: every mesh shape of a world size
``profile``    ``python -m pipeline.tools.profile``: the reference planner's flags
``results``    ``python -m pipeline.tools.results``: the pages of ``docs/results/``
=============  ===================================================================
"""
