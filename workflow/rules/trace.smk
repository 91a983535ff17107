rule trace:
    output:
        run_outputs("trace"),
    params:
        overrides=run_params("trace"),
        code=stage_code("trace"),
    log:
        run_log("trace"),
    benchmark:
        run_benchmark("trace")
    conda:
        CONDA_ENV
    shell:
        "python -m pipeline.cli trace {params.overrides:q} > {log:q} 2>&1"
