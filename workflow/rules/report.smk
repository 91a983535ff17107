# The report stage, and what `snakemake --report` shows.
#
#   snakemake --config mesh=2,4,8 && snakemake --report results/report.html --config mesh=2,4,8
#   snakemake paper && snakemake --report results/report.html     # with the paper
#
# The report stage writes results/report/*.parquet (pipeline/stages/report/stage.py) and the runs table
# as an HTML page, runs.html (pipeline/stages/report/html.py: a Snakemake report shows HTML and
# pictures in the page, Parquet and Markdown only as downloads). The outputs shown in the
# HTML report (report(...), captions in workflow/report/) are declared only when
# Snakemake makes a report (REPORT_MODE), so that ordinary runs plan the same jobs:
# runs.html; the paper's table page and figures when the paper of the --config
# experiment exists; each run's plan picture (plan.png) that the report stage drew.

report: "../report/workflow.rst"

include: "report_common.smk"


rule report:
    input:
        stage_outputs("solve"),
    output:
        report_tables_before_sentinel(),
        report_rule_extra_outputs(),
        runs=stage_output("report"),
    params:
        overrides=stage_params("report"),
        code=stage_code("report"),
        page=runs_page(),
    log:
        stage_log("report"),
    benchmark:
        stage_benchmark("report")
    conda:
        CONDA_ENV
    shell:
        "python -m pipeline.cli report {params.overrides:q} > {log:q} 2>&1 && "
        "python -m pipeline.stages.report.html runs {output.runs:q} {params.page:q} >> {log:q} 2>&1"
