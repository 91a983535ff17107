rule solve:
    input:
        costs_outputs,
    output:
        run_outputs("solve"),
    params:
        overrides=run_params("solve"),
        code=stage_code("solve"),
    log:
        run_log("solve"),
    benchmark:
        run_benchmark("solve")
    conda:
        CONDA_ENV
    shell:
        "python -m pipeline.cli solve {params.overrides:q} > {log:q} 2>&1"
