"""Stage 5 - report: every run record of a results tree as tables, pictures and HTML.

===========  =====================================================================
module       job
===========  =====================================================================
``stage``    :func:`run_report`: ``runs.parquet``, ``placements.parquet``, recipes
``picture``  the plan picture of one run (``plan.png`` / ``plan.svg``)
``html``     the HTML pages of the report and of the paper tables
===========  =====================================================================
"""
