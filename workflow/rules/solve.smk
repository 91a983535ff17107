rule solve:
    input:
        stage_outputs("costs"),
    output:
        stage_outputs("solve"),
    params:
        overrides=stage_params("solve"),
        code=stage_code("solve"),
    log:
        stage_log("solve"),
    benchmark:
        stage_benchmark("solve")
    shell:
        "python -m pipeline.cli solve {params.overrides:q} > {log} 2>&1"
