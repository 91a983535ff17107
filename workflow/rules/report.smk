rule report:
    input:
        stage_outputs("solve"),
    output:
        report_outputs(),
    params:
        overrides=stage_params("report"),
        code=stage_code("report"),
    log:
        stage_log("report"),
    benchmark:
        stage_benchmark("report")
    conda:
        CONDA_ENV
    shell:
        "python -m pipeline.cli report {params.overrides:q} > {log} 2>&1"
