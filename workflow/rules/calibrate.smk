# Calibration (pipeline/tools/calibrate/): measure this machine into a hardware profile
# conf/hardware/<profile>.yaml, then selectable as hardware=<profile>.
#
#   snakemake calibrate --config profile=cpu_epyc2
#   snakemake calibrate --config profile=ci quick=true
#
# The rule only calls the module; a profile that exists is not remeasured (delete it, or
# run with --forcerun calibrate).

rule calibrate:
    output:
        str(PROJECT_ROOT / "conf" / "hardware" / f"{CALIBRATE_NAME}.yaml"),
    params:
        name=CALIBRATE_NAME,
        quick=["--quick"] if CALIBRATE_QUICK else [],
    log:
        str(Path(PLAN_CFG.results_dir) / f"calibrate-{CALIBRATE_NAME}.log"),
    conda:
        CONDA_ENV
    shell:
        "python -m pipeline.calibrate --name {params.name:q} {params.quick:q} > {log:q} 2>&1"
