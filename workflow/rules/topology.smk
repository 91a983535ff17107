rule topology:
    input:
        run_outputs("trace"),
    output:
        run_outputs("topology"),
    params:
        overrides=run_params("topology"),
        code=stage_code("topology"),
    log:
        run_log("topology"),
    benchmark:
        run_benchmark("topology")
    conda:
        CONDA_ENV
    shell:
        "python -m pipeline.cli topology {params.overrides:q} > {log:q} 2>&1"
