# Two rules of one stage: with eager costs the stage also writes factors.npz, and a
# rule's outputs cannot depend on a wildcard. Their paths differ in the cost-mode level.
rule costs_lazy:
    input:
        run_outputs("topology"),
    output:
        run_outputs("costs", "lazy"),
    params:
        overrides=run_params("costs"),
        code=stage_code("costs"),
    log:
        run_log("costs", "lazy"),
    benchmark:
        run_benchmark("costs", "lazy")
    conda:
        CONDA_ENV
    shell:
        "python -m pipeline.cli costs {params.overrides:q} > {log:q} 2>&1"


rule costs_eager:
    input:
        run_outputs("topology"),
    output:
        run_outputs("costs", "eager"),
    params:
        overrides=run_params("costs"),
        code=stage_code("costs"),
    log:
        run_log("costs", "eager"),
    benchmark:
        run_benchmark("costs", "eager")
    conda:
        CONDA_ENV
    shell:
        "python -m pipeline.cli costs {params.overrides:q} > {log:q} 2>&1"
