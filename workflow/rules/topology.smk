rule topology:
    input:
        stage_outputs("trace"),
    output:
        stage_outputs("topology"),
    params:
        overrides=stage_params("topology"),
        code=stage_code("topology"),
    log:
        stage_log("topology"),
    benchmark:
        stage_benchmark("topology")
    shell:
        "python -m pipeline.cli topology {params.overrides:q} > {log} 2>&1"
