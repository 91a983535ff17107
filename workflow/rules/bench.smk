# Benchmark suites (pipeline/tools/bench/): one fresh `python -m pipeline` process per case,
# results in <results_dir>/bench/<suite>.{parquet,md}.
#
#   snakemake bench                        # suite `search`
#   snakemake bench --config suite=smoke   # search, solvers, big or smoke
#
# The rule has no declared outputs, so it runs every time it is asked for (a benchmark
# measures, it is never "up to date") and a failed case does not make Snakemake delete
# the tables of the cases that worked. BENCH_SUITE is taken out of --config in the
# Snakefile (it is not a pipeline config key). Other options (--only, --fresh,
# --timeout): run `python -m pipeline.tools.bench` directly.

from pipeline.tools.bench import SUITES as _BENCH_SUITES

if BENCH_SUITE not in _BENCH_SUITES:
    print(f"suite={BENCH_SUITE}: allowed {', '.join(_BENCH_SUITES)}", file=sys.stderr)
    sys.exit(2)


rule bench:
    params:
        suite=BENCH_SUITE,
        out=str(Path(PLAN_CFG.results_dir) / "bench"),
    log:
        str(Path(PLAN_CFG.results_dir) / "bench" / f"{BENCH_SUITE}.log"),
    conda:
        CONDA_ENV
    shell:
        "python -m pipeline.tools.bench --suite {params.suite:q} --out={params.out:q} 2>&1 | tee -- {log:q}"
