"""Stage 5 - report: every run record of a results tree as tables, pictures and HTML.

=================  ===============================================================
module             job
=================  ===============================================================
``stage``          :func:`run_report`: ``runs.parquet``, ``placements.parquet``, recipes
``picture``        the plan picture of one run (``plan.png`` / ``plan.svg``), drawn
``picture_model``  what the picture shows, as data (steps, redistributions, totals)
``html``           the HTML pages of the report and of the paper tables
=================  ===============================================================
"""
