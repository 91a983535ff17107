# The paper: tables and figures of an experiment, from runs.parquet (pipeline/paper.py).
#
#   snakemake paper                                  # experiment paper_toy (default)
#   snakemake paper --config experiment=paper        # LLaMA-3 1B
#   snakemake paper --cores 2 --config experiment=paper_toy overrides="hardware.kernel_floor_us=5"
#
# The experiment's runs (conf/experiment/<name>.yaml, paper.runs) are Snakemake jobs of
# the rules paper_trace ... paper_solve below: the same CLI and the same result
# directories as the main rules, so a run already made by `snakemake`, `python -m
# pipeline` or a sweep is reused, and a run shared by several run sets (or a trace shared
# by several runs) is one job. Where a paper run is the --config run itself, the main
# rule makes it (ruleorder). The experiment is composed only when a paper job needs it.

include: "paper_common.smk"


ruleorder: trace > paper_trace
ruleorder: topology > paper_topology
ruleorder: costs > paper_costs
ruleorder: solve > paper_solve


wildcard_constraints:
    ptrace=r"[^/]+",
    ptopology=r"[^/]+",
    phardware=r"[^/]+",
    pmode=r"lazy|eager",
    psolver=r"[^/]+",


rule paper_trace:
    output:
        paper_run_path("{ptrace}/graph.parquet"),
    params:
        overrides=paper_stage_params("trace"),
        code=stage_code("trace"),
    log:
        paper_run_path("{ptrace}/trace.log"),
    benchmark:
        paper_run_path("{ptrace}/benchmark-trace.tsv")
    shell:
        "python -m pipeline.cli trace {params.overrides:q} > {log} 2>&1"


rule paper_topology:
    input:
        paper_run_path("{ptrace}/graph.parquet"),
    output:
        paper_run_path("{ptrace}/{ptopology}/topology.json"),
    params:
        overrides=paper_stage_params("topology"),
        code=stage_code("topology"),
    log:
        paper_run_path("{ptrace}/{ptopology}/topology.log"),
    benchmark:
        paper_run_path("{ptrace}/{ptopology}/benchmark-topology.tsv")
    shell:
        "python -m pipeline.cli topology {params.overrides:q} > {log} 2>&1"


rule paper_costs:
    input:
        paper_run_path("{ptrace}/{ptopology}/topology.json"),
    output:
        paper_run_path("{ptrace}/{ptopology}/{phardware}/{pmode}/costs.json"),
    params:
        overrides=paper_stage_params("costs"),
        code=stage_code("costs"),
    log:
        paper_run_path("{ptrace}/{ptopology}/{phardware}/{pmode}/costs.log"),
    benchmark:
        paper_run_path("{ptrace}/{ptopology}/{phardware}/{pmode}/benchmark-costs.tsv")
    shell:
        "python -m pipeline.cli costs {params.overrides:q} > {log} 2>&1"


rule paper_solve:
    input:
        paper_run_path("{ptrace}/{ptopology}/{phardware}/{pmode}/costs.json"),
    output:
        paper_run_path("{ptrace}/{ptopology}/{phardware}/{pmode}/{psolver}/run.json"),
    params:
        overrides=paper_stage_params("solve"),
        code=stage_code("solve"),
    log:
        paper_run_path("{ptrace}/{ptopology}/{phardware}/{pmode}/{psolver}/solve.log"),
    benchmark:
        paper_run_path("{ptrace}/{ptopology}/{phardware}/{pmode}/{psolver}/benchmark-solve.tsv")
    shell:
        "python -m pipeline.cli solve {params.overrides:q} > {log} 2>&1"


rule paper:
    input:
        paper_run_records,
    output:
        output_files(PLAN_CFG.results_dir, experiment_name(PAPER_OVERRIDES)),
    params:
        overrides=PAPER_OVERRIDES,
        code=stage_code("paper"),
    log:
        paper_log(),
    shell:
        "python -m pipeline.paper --no-run {params.overrides:q} > {log} 2>&1"
