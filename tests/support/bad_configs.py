"""Bad config values, each with the one line the user sees: through ``load_config`` and
``python -m pipeline`` (tests/unit/test_config.py) and through ``snakemake --config``
(tests/e2e/test_workflow.py)."""

from __future__ import annotations

#: (id, hydra overrides, snakemake --config arguments, the one-line message)
BAD_CASES = [
    ("mesh-zero", ["mesh=2,0,8"], ["mesh=2,0,8"],
     "mesh=2,0,8: allowed positive integers joined by ',' or 'x' (e.g. 2,4,8 or 2x4x8 or 8)"),
    ("mesh-abc", ["mesh=abc"], ["mesh=abc"],
     "mesh=abc: allowed positive integers joined by ',' or 'x' (e.g. 2,4,8 or 2x4x8 or 8)"),
    ("mesh-negative", ["mesh=-2"], ["mesh=-2"],
     "mesh=-2: allowed positive integers joined by ',' or 'x' (e.g. 2,4,8 or 2x4x8 or 8)"),
    ("names-count", ["mesh=2,4", "mesh_names=[a,b,c]"], ["mesh=2,4", "mesh_names=[a,b,c]"],
     "mesh_names=[a,b,c]: need 2 names, one per dim of mesh 2x4"),
    ("names-duplicated", ["mesh_names=[dp,dp,tp]"], ["mesh_names=[dp,dp,tp]"],
     "mesh_names=[dp,dp,tp]: names must be unique (dp repeated)"),
    ("solver-foo", ["solver=foo"], ["solver=foo"], "solver=foo: allowed approx, ilp, lp"),
    ("model-nosuch", ["model=nosuch"], ["model=nosuch"],
     "model=nosuch: allowed llama1b, llama405b, llama70b, llama8b, toy"),
    ("lazy-maybe", ["lazy_costs=maybe"], ["lazy_costs=maybe"],
     "lazy_costs=maybe: allowed true, false, null"),
    ("lazy-ilp", ["lazy_costs=true", "solver=ilp"], ["lazy_costs=true", "solver=ilp"],
     "lazy_costs=true: lazy costs need solver=approx (got solver=ilp)"),
    ("heads", ["model=toy", "model.n_heads=6"], ["model=toy", "overrides=model.n_heads=6"],
     "model.n_heads=6: must divide model.dim=256"),
    ("dim-negative", ["model.dim=-8"], ["overrides=model.dim=-8"],
     "model.dim=-8: must be a positive integer"),
    ("iters-zero", ["solver.max_iters=0"], ["overrides=solver.max_iters=0"],
     "solver.max_iters=0: allowed an integer >= 1"),
    ("objective-sideways", ["solver.objective=sideways"],
     ["overrides=solver.objective=sideways"],
     "solver.objective=sideways: allowed step_time, additive"),
    ("rounds-negative", ["solver.step_time_rounds=-1"],
     ["overrides=solver.step_time_rounds=-1"],
     "solver.step_time_rounds=-1: allowed an integer >= 0"),
    ("uncertainty-one", ["costs.step_time_uncertainty=1.5"],
     ["overrides=costs.step_time_uncertainty=1.5"],
     "costs.step_time_uncertainty=1.5: allowed a number in [0, 1) (relative)"),
    ("unknown-key", ["foo=1"], ["overrides=foo=1"],
     "foo=1: unknown key; allowed keys at the top level: model, hardware, solver, "
     "optimizer, constraints, memory, fsdp, costs, pipeline, mesh, mesh_names, lazy_costs, "
     "stamp_layers, repeated_layers, recipe, optimality_check, results_dir, experiment, "
     "revision_label, workers, paper"),
    ("workers-negative", ["workers=-1"], ["workers=-1"],
     "workers=-1: allowed 0 (one process per available CPU) or an integer >= 1 (1: no "
     "worker processes)"),
    ("fuse-maybe", ["costs.fuse_pointwise=maybe"], ["overrides=costs.fuse_pointwise=maybe"],
     "costs.fuse_pointwise=maybe: allowed true, false"),
    ("reserve-negative", ["memory.reserve_fraction=-0.1"],
     ["overrides=memory.reserve_fraction=-0.1"],
     "memory.reserve_fraction=-0.1: allowed a number >= 0 (the fraction of the liveness "
     "peak a device reserves beyond it)"),
    ("costs-unknown", ["costs.fuse=1"], ["overrides=costs.fuse=1"],
     "costs.fuse=1: unknown key; allowed keys at costs: compile, fuse_pointwise, "
     "flatten_mesh, step_time_uncertainty"),
    ("compile-maybe", ["costs.compile=maybe"], ["overrides=costs.compile=maybe"],
     "costs.compile=maybe: allowed true, false"),
    ("bool-2", ["repeated_layers=2"], ["repeated_layers=2"],
     "repeated_layers=2: allowed true, false"),
    # recipes (pipeline/core/recipes.py) and constraints.model_parallel (issue #24)
    ("recipe-no-tp", ["model=toy", "mesh=2x4", "mesh_names=[dp,cp]", "recipe=fsdp_tp"],
     ["model=toy", "mesh=2,4", "mesh_names=[dp,cp]", "recipe=fsdp_tp"],
     "recipe=fsdp_tp: needs mesh dims named tp and at least one data dim; got "
     "mesh_names=[dp,cp]"),
    ("recipe-no-roles", ["model=hf/mixtral", "mesh=2x4", "recipe=fsdp_tp"],
     ["model=hf/mixtral", "mesh=2,4", "recipe=fsdp_tp"],
     "recipe=fsdp_tp: model=mixtral (hf:mixtral) has no tensor-parallel module roles; "
     "allowed for llama, hf:llama, hf:qwen2, hf:mistral, or recipe ddp, fsdp, hsdp"),
    ("model-parallel-sideways", ["constraints.model_parallel=sideways"],
     ["overrides=constraints.model_parallel=sideways"],
     "constraints.model_parallel=sideways: allowed intra_node, null"),
    ("recipe-tp-across-nodes", ["model=toy", "mesh=2x4", "recipe=fsdp_tp",
                                "hardware.gpus_per_node=2",
                                "constraints.model_parallel=intra_node"],
     ["model=toy", "mesh=2,4", "recipe=fsdp_tp",
      "overrides=hardware.gpus_per_node=2 constraints.model_parallel=intra_node"],
     "constraints.model_parallel=intra_node: recipe=fsdp_tp runs tp on mesh dim tp=4, whose "
     "groups span nodes of hardware.gpus_per_node=2; allowed a mesh whose tp dim stays in "
     "one node, or null"),
    ("recipe-batch", ["model=toy", "model.batch_size=6", "mesh=2x4", "recipe=ddp"],
     ["model=toy", "mesh=2,4", "recipe=ddp", "overrides=model.batch_size=6"],
     "model.batch_size=6: recipe=ddp shards the batch over the data dims dp=2 x tp=4; "
     "allowed a multiple of 8"),
]
