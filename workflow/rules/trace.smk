rule trace:
    output:
        stage_outputs("trace"),
    params:
        overrides=stage_params("trace"),
        code=stage_code("trace"),
    log:
        stage_log("trace"),
    benchmark:
        stage_benchmark("trace")
    shell:
        "python -m pipeline.cli trace {params.overrides:q} > {log} 2>&1"
