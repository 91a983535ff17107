rule topology:
    input:
        stage_output("trace"),
    output:
        stage_output("topology"),
    params:
        overrides=stage_params("topology"),
        code=stage_code("topology"),
    log:
        stage_log("topology"),
    benchmark:
        stage_benchmark("topology")
    shell:
        "python -m pipeline.cli topology {params.overrides:q} > {log} 2>&1"
