# The paper: tables and figures of an experiment, from runs.parquet (pipeline/tools/paper/).
#
#   snakemake paper                                  # experiment paper_toy (default)
#   snakemake paper --config experiment=paper        # LLaMA-3 1B
#   snakemake paper --cores 2 --config experiment=paper_toy overrides="hardware.kernel_floor_us=5"
#
# The experiment's runs (conf/experiment/<name>.yaml, paper.runs) are jobs of the stage
# rules trace ... solve, whose paths have wildcards (workflow/rules/common.smk): the same
# CLI and the same result directories as the --config run, so a run already made by
# `snakemake`, `python -m pipeline` or a sweep is reused, and a run shared by several run
# sets (or a trace shared by several runs) is one job. The experiment is composed only
# when a job needs it. The rule also writes each table as a page for the HTML report
# (workflow/rules/report.smk).


rule paper:
    input:
        paper_run_records,
    output:
        paper_rule_outputs(),
        tables=paper_tables(),
    params:
        overrides=PAPER_OVERRIDES,
        code=stage_code("paper"),
    log:
        paper_log(),
    conda:
        CONDA_ENV
    shell:
        "python -m pipeline.tools.paper --no-run {params.overrides:q} > {log:q} 2>&1 && "
        "python -m pipeline.stages.report.html table {output.tables:q} >> {log:q} 2>&1"
