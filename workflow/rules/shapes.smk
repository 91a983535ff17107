# The mesh-shape sweep: every factorisation of a world size into 1..3 (max_dims=4: 1..4)
# mesh dims, each planned, then a table and a figure best first (pipeline/tools/shapes.py).
#
#   snakemake shapes --config world=64 model=toy
#   snakemake shapes --config world=64 model=llama1b max_dims=4
#
# `world` defaults to the size of the --config mesh. The runs are planned by
# `python -m pipeline.tools.shapes` in the ordinary results tree (one shared trace, stages
# reused as by `python -m pipeline`); outputs in <results_dir>/shapes/<model>-<h8>/w<N>-d<K>/.
# A shape that fails is a row of the table (status failed, its reason) and the tool exits
# 1 after writing every output: the table is this rule's result, so exit status 1 is a
# finished job (the summary is at the end of shapes.log); any other status fails it.

from pipeline.tools.shapes import OUTPUT_FILES, code_hash as shapes_code_hash, shapes_request

try:
    SHAPES = shapes_request(SHAPES_KEYS, PLAN_CFG, overrides_from_snakemake(config, sys.argv))
except ConfigError as err:
    print(err, file=sys.stderr)
    sys.exit(2)


if SHAPES is not None:

    rule shapes:
        output:
            [str(SHAPES.out_dir / name) for name in OUTPUT_FILES],
        params:
            args=SHAPES.argv,
            code=shapes_code_hash(),
        log:
            str(SHAPES.out_dir / "shapes.log"),
        conda:
            CONDA_ENV
        shell:
            "python -m pipeline.tools.shapes {params.args:q} > {log:q} 2>&1 || [ $? -eq 1 ]"
