rule costs:
    input:
        stage_outputs("topology"),
    output:
        stage_outputs("costs"),
    params:
        overrides=stage_params("costs"),
        code=stage_code("costs"),
    log:
        stage_log("costs"),
    benchmark:
        stage_benchmark("costs")
    shell:
        "python -m pipeline.cli costs {params.overrides:q} > {log} 2>&1"
