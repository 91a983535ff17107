rule costs:
    input:
        run_output("topology"),
    output:
        run_output("costs"),
    params:
        overrides=run_params("costs"),
        code=stage_code("costs"),
    log:
        run_log("costs"),
    benchmark:
        run_benchmark("costs")
    shell:
        "python -m pipeline.cli costs {params.overrides:q} > {log} 2>&1"
