# Plan verification (pipeline/verify/run.py): execute the run's plan.json with DTensor on one
# gloo process per mesh device (CPU) and compare loss and gradients with the
# single-process step; writes verify.json beside the plan.
#
#   snakemake verify --config model=toy mesh=2,2
#   snakemake verify --config model=toy mesh=2 hardware=cpu_epyc2 measure=7   # + timing

rule verify:
    input:
        stage_output("solve"),
    output:
        verify_output(),
    params:
        overrides=stage_params("solve"),
        code=stage_code("verify"),
        measure=["--measure", str(VERIFY_MEASURE)] if VERIFY_MEASURE else [],
    log:
        str(PLAN_DIRS.solve / "verify.log"),
    benchmark:
        str(PLAN_DIRS.solve / "benchmark-verify.tsv")
    conda:
        CONDA_ENV
    shell:
        "python -m pipeline.verify {params.overrides:q} {params.measure:q} > {log:q} 2>&1"
