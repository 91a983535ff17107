"""The applied path: the planner's toy plans applied to the real module with
``pipeline.apply.parallelize`` (FSDP2, DTensor placements), one step on gloo processes
beside the unsharded step (pipeline/verify/applied.py), and the "Use a plan" example run
as written.

Independent checks: the loss and the gradient of every parameter of the module (names
from the module) within 1e-5 of the single-process step; every parameter's local shard
equals ``distribute_tensor(full, mesh, planned placements)``'s on every rank (so a
parameter the plan shards over both dims is never HSDP); per-rank parameter bytes equal
the sum of the planned local shapes; the parameter collectives counted equal the plan's
as FSDP2 buckets them but for one all-gather, FSDP2's re-gather of the embedding
before its backward (which reads no weight; the plan counts that gather once); a model
with a renamed layer is refused naming it.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from test_verify import TINY, _prepare

ROOT = Path(__file__).resolve().parents[2]
MESHES = ("4", "2x2", "2x2x2")


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("parallelize")


def _overrides(results: Path, mesh: str) -> list[str]:
    return [*TINY, f"mesh={mesh}", f"results_dir={results}"]


@pytest.mark.parametrize("mesh", MESHES)
def test_planner_plan_applied_matches_the_unsharded_step(results: Path, mesh: str) -> None:
    from pipeline.verify.run import RTOL, build_real_model, verify

    cfg, dirs = _prepare(_overrides(results, mesh))
    record = verify(cfg)
    applied = record["applied"]
    assert applied["ok"], applied.get("error") or applied["checks"]
    names = [n for n, _ in build_real_model(dict(cfg.model), 0).named_parameters()]
    assert sorted(applied["grads"]) == sorted(names)
    assert all(g["rel_diff"] <= RTOL for g in applied["grads"].values())
    assert applied["loss"]["rel_diff"] <= RTOL
    plan = json.loads((Path(dirs.solve) / "plan.json").read_text())
    world = math.prod(int(s) for s in mesh.split("x"))
    assert record["processes"] == world
    assert applied["checks"]["same_shards"] and applied["checks"]["local_shapes"]
    # bytes: by hand from the plan, every parameter float32 and sharded over all dims
    # (the planner's toy plans are FSDP over the flattened mesh)
    assert all(p["placement"] == "S(0)" * len(cfg.mesh) for p in plan["parameters"])
    own = sum(4 * math.prod(p["shape"]) // world for p in plan["parameters"])
    assert applied["parameter_bytes_per_rank"] == [own] * world
    assert applied["predicted_parameter_bytes_per_rank"] == [own] * world
    dims = "+".join(cfg.mesh_names)
    # FSDP2 units: 2 layers, tok_embeddings, norm, output: a forward gather, a backward
    # re-gather and a reduce-scatter each, over the flattened group
    coll = applied["collectives"]
    assert coll["counted_parameters"] == {f"all_gather({dims})": 10,
                                          f"reduce_scatter({dims})": 5}
    assert coll["planned_parameters"] == {f"all_gather({dims})": 9,
                                          f"reduce_scatter({dims})": 5}
    assert applied["report"]["fallback"] == {}


def test_renamed_layer_is_refused_naming_it(results: Path) -> None:
    import torch

    from pipeline.apply import check_names
    from pipeline.core.errors import PlanError
    from pipeline.models.llama_decoder import build_model
    from pipeline.plan.format import load

    cfg, dirs = _prepare(_overrides(results, "4"))
    plan = load(Path(dirs.solve) / "plan.json")
    model = build_model(dict(cfg.model))
    check_names(plan, model)  # the traced names pass
    model.head = model.output  # a user renamed ``output`` to ``head``
    del model.output
    with pytest.raises(PlanError) as err:
        check_names(plan, model)
    line = str(err.value)
    assert "\n" not in line and "parameter output.weight of the plan is not" in line
    del torch


@pytest.mark.parametrize("mesh", MESHES)
def test_use_a_plan_example_runs_as_written(results: Path, mesh: str) -> None:
    _, dirs = _prepare(_overrides(results, mesh))
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "use_a_plan.py"),
                           str(Path(dirs.solve) / "plan.json")], capture_output=True,
                          text=True, timeout=300, env={"PYTHONPATH": str(ROOT),
                                                       "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    line = [x for x in proc.stdout.splitlines() if x.startswith("loss ")]
    assert line and "fallback {}" in line[0]
    assert abs(float(line[0].split()[1].rstrip(";")) - math.log(64)) < 0.7
