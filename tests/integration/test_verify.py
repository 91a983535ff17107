"""Plans that run: each toy plan executed with DTensor on gloo processes (pipeline/verify/run.py).

The toy is shrunk (dim 32, 2 layers, 4 heads, 2 KV heads, vocab 64, 8 sequences of 16
tokens) and the hardware made slow with no kernel floor, so that compute dominates and
the solver shards activations as on a real model (FSDP all-gathers and
reduce-scatters, all-reduced partial sums, tensor-parallel layouts) instead of
replicating everything. Each case runs the stages in this process, then
``pipeline.verify.run.verify`` forks one process per device.

Independent checks: the loss and every gradient of *every parameter of the model*
(names from the module itself) agree with the single-process step within 1e-5
(relative, float32); the reference loss equals the loss this test computes itself
from the same seeded model; every graph node of ``graph.parquet`` was checked; the
collectives counted equal the counts this test reads from ``redistributions.parquet``
and those of ``run.json``; a plan edited to a placement DTensor does not produce
fails naming the node; and the counter's semantics are checked on redistributions
whose collectives are known by hand.
"""

from __future__ import annotations

import collections
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from fixtures import dtensor_planned

from pipeline.config import load_resolved, stage_dirs

ROOT = Path(__file__).resolve().parents[2]

TINY = ("model=toy", "model.dim=32", "model.n_heads=4", "model.n_kv_heads=2",
        "model.multiple_of=32", "model.vocab_size=64", "model.seq_len=16",
        "model.batch_size=8", "hardware.kernel_floor_us=0.0", "hardware.hbm_bandwidth=1e9",
        "hardware.peak_flops_fp32=1e9", "hardware.peak_flops_bf16=1e9")
MESHES = ("4", "2x2", "2x4")
BUDGETS = ("default", "null")


def _overrides(results: Path, mesh: str, budget: str, *extra: str) -> list[str]:
    out = [*TINY, f"mesh={mesh}", f"results_dir={results}", *extra]
    if budget == "null":
        out.append("constraints.param_memory=null")
    return out


def _prepare(overrides: list[str]):
    from pipeline.stages.runner import run_stage

    cfg = load_resolved(overrides)
    dirs = stage_dirs(cfg)
    for stage in ("trace", "topology", "costs", "solve"):
        run_stage(stage, cfg, dirs)
    return cfg, dirs


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("verify")


def _tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.name != ".lock"}


@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("mesh", MESHES)
def test_plan_runs_as_planned(results: Path, mesh: str, budget: str) -> None:
    from pipeline.verify.run import RTOL, build_real_model, verify

    cfg, dirs = _prepare(_overrides(results, mesh, budget))
    record = verify(cfg, applied=False)  # the applied path: test_parallelize.py
    assert record["ok"], record.get("error") or record["checks"]
    assert record["processes"] == {"4": 4, "2x2": 4, "2x4": 8}[mesh]
    # Every parameter of the model (named by the module, not by the plan) has a gradient
    # equal to the single-process one.
    names = [n for n, _ in build_real_model(dict(cfg.model), 0).named_parameters()]
    assert sorted(record["grads"]) == sorted(names)
    assert len(names) == 21
    for fqn, g in record["grads"].items():
        assert g["rel_diff"] <= RTOL, (fqn, g)
    assert record["loss"]["rel_diff"] <= RTOL
    # Every graph node (all but the output node) had its placement checked.
    graph = pq.read_table(Path(dirs.trace) / "graph.parquet")
    assert record["placements"]["nodes_checked"] == graph.num_rows - 1
    # Collectives: counted == one per step in redistributions.parquet; run.json counts
    # each step as many times as the step model runs it (``times``: 2 for a weight FSDP2
    # re-gathers for backward, which the executed plan, holding its gathered copy, runs
    # once).
    redist = pq.read_table(Path(dirs.solve) / "redistributions.parquet")
    steps_of = redist.column("collectives").to_pylist()
    # a collective over a flattened group (all_gather(dp+tp)) runs as DTensor's steps
    planned = dtensor_planned(redist.to_pylist(), tuple(int(x) for x in mesh.split("x")),
                              list(cfg.mesh_names))
    paid: collections.Counter = collections.Counter()
    for steps, times in zip(steps_of, redist.column("times").to_pylist(), strict=True):
        for c in steps:
            paid[c] += times
    run = json.loads((Path(dirs.solve) / "run.json").read_text())
    assert record["collectives"]["counted"] == dict(planned)
    assert dict(paid) == {k: v["count"] for k, v in run["collectives"].items()}
    assert record["collectives"]["inside_ops"] == {}
    assert record["collectives"]["same_on_every_rank"]
    # The gradients leave the step in their parameters' planned placements.
    plan = json.loads((Path(dirs.solve) / "plan.json").read_text())
    stored = {p["fqn"]: p["placement"] for p in plan["parameters"]}
    assert {k: g["placement"] for k, g in record["grads"].items()} == stored
    assert all(b > 0 for b in record["memory"]["peak_local_bytes_per_rank"])
    on_disk = json.loads((Path(dirs.solve) / "verify.json").read_text())
    assert on_disk["ok"] and on_disk["collectives"]["counted"] == dict(planned)


def test_default_budget_on_a_1d_mesh_is_fsdp(results: Path) -> None:
    """Mesh 4, default budget: every gradient leaves the step reduce-scattered or
    already sharded (no gradient all-reduce but the 4-byte loss ones)."""
    cfg, dirs = _prepare(_overrides(results, "4", "default"))
    redist = pq.read_table(Path(dirs.solve) / "redistributions.parquet").to_pylist()
    into_grads = [r for r in redist if r["consumer_name"].startswith("output:grad:")]
    assert into_grads and all(r["collectives"] in ([], ["reduce_scatter(dp)"])
                              for r in into_grads)
    assert any(r["collectives"] == ["reduce_scatter(dp)"] for r in into_grads)


def test_reference_is_the_models_own_step(results: Path) -> None:
    """The reference loss in verify.json is the eager model's loss on the seeded inputs."""
    from pipeline.dtensor.cpu_kernels import cpu_kernels
    from pipeline.verify.run import build_real_model, real_inputs, verify

    cfg, dirs = _prepare(_overrides(results, "2x2", "default"))
    done = Path(dirs.solve) / "verify.json"
    record = json.loads(done.read_text()) if done.exists() else verify(cfg, applied=False)
    model_cfg = dict(cfg.model)
    with cpu_kernels(), torch.no_grad():
        loss = build_real_model(model_cfg, 0)(*real_inputs(model_cfg, 0))
    # the same computation; the worker runs one thread, this process maybe more
    assert float(loss) == pytest.approx(record["loss"]["reference"], rel=1e-6)
    # A random-init LM over 64 tokens starts near log(64).
    assert abs(float(loss) - 4.1589) < 0.7


def test_a_placement_dtensor_does_not_produce_fails_naming_the_node(results: Path) -> None:
    """A plan whose node placement is legal but not what DTensor computes (an mm output
    marked Replicate while its inputs make it sharded or partial) fails at that node."""
    from pipeline.verify.run import verify

    cfg, dirs = _prepare(_overrides(results, "2x2", "default"))
    doc = json.loads((Path(dirs.solve) / "plan.json").read_text())
    target = next(n for n in doc["nodes"] if n["op"] == "aten.mm.default"
                  and n["output"] != "RR")
    target["output"] = "RR"
    edited = Path(tempfile.mkdtemp(dir=results)) / "plan.json"
    edited.write_text(json.dumps(doc))
    doc["placement_hash"] = _rehash(edited)  # as a planner that chose RR would write it
    edited.write_text(json.dumps(doc))
    shutil.copy(Path(dirs.solve) / "redistributions.parquet", edited.parent)
    record = verify(cfg, plan_path=edited, applied=False)
    assert not record["ok"]
    assert f"node {target['name']} (aten.mm.default" in record["error"]
    assert "the plan says RR" in record["error"]
    assert (edited.parent / "verify.json").exists()


def _rehash(path: Path) -> str:
    """The placement hash of a plan file's nodes, computed by hand (same formula as the
    run record: SHA-256 over name, output, inputs of every node, then the sinks)."""
    import hashlib

    doc = json.loads(path.read_text())
    h = hashlib.sha256()
    for n in doc["nodes"]:
        h.update(f"{n['name']}\t{n['output']}\t{','.join(n['inputs'])}\n".encode())
    for o in sorted(doc["outputs"], key=lambda o: o["index"]):
        h.update(f"{o['node']}\t{o['placement']}\t{o['placement']}\n".encode())
    return h.hexdigest()


# --------------------------------------------------------------------------- counting


def _count_worker(rank: int, store: str, out: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    from pipeline.apply import CollectiveCounter

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=4)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    x = torch.arange(64.0).reshape(8, 8)
    counts = {}
    cases = {
        "SS->RR": (lambda: distribute_tensor(x, mesh, [Shard(0), Shard(0)], src_data_rank=None),
                   [Replicate(), Replicate()]),
        "PR->S(0)R": (lambda: DTensor.from_local(x, mesh, [Partial(), Replicate()],
                                                 run_check=False), [Shard(0), Replicate()]),
        "RP->RR": (lambda: DTensor.from_local(x, mesh, [Replicate(), Partial()],
                                              run_check=False), [Replicate(), Replicate()]),
        "S(0)R->S(1)R": (lambda: distribute_tensor(x, mesh, [Shard(0), Replicate()],
                                                   src_data_rank=None),
                         [Shard(1), Replicate()]),
        "RR->S(0)S(1)": (lambda: distribute_tensor(x, mesh, [Replicate(), Replicate()],
                                                   src_data_rank=None), [Shard(0), Shard(1)]),
    }
    for name, (make, dst) in cases.items():
        src = make()
        with CollectiveCounter(mesh) as counter:
            got = src.redistribute(mesh, dst)
        counts[name] = dict(counter.counts)
        counts[name + ":value_ok"] = bool(torch.equal(got.full_tensor(),
                                                      src.full_tensor()))
    dist.destroy_process_group()
    if rank == 0:
        Path(out).write_text(json.dumps(counts))


def test_collective_counter_counts_kind_and_mesh_dim(tmp_path: Path) -> None:
    """By hand: S(0)S(0) -> RR gathers on tp then dp; P -> S is one reduce-scatter;
    P -> R one all-reduce on its dim; S(0) -> S(1) one all-to-all (which gloo runs as a
    gather); R -> S is a local slice (no collective)."""
    import torch.multiprocessing as mp

    import pipeline.apply  # noqa: F401 - imported before the fork

    out = tmp_path / "counts.json"
    mp.start_processes(_count_worker, args=(str(tmp_path / "store"), str(out)), nprocs=4,
                       start_method="fork", join=True)
    counts = json.loads(out.read_text())
    assert counts["SS->RR"] == {"all_gather(dp)": 1, "all_gather(tp)": 1}
    assert counts["PR->S(0)R"] == {"reduce_scatter(dp)": 1}
    assert counts["RP->RR"] == {"all_reduce(tp)": 1}
    assert counts["S(0)R->S(1)R"] == {"all_to_all(dp)": 1}
    assert counts["RR->S(0)S(1)"] == {}
    assert counts["SS->RR:value_ok"] and counts["S(0)R->S(1)R:value_ok"]


# --------------------------------------------------------------------------- bad input


def _main(argv: list[str], capsys: pytest.CaptureFixture) -> tuple[int, str]:
    from pipeline.verify.run import main

    code = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    return code, err[-1] if err else ""


@pytest.fixture(scope="module")
def plan_2x2(results: Path) -> Path:
    _, dirs = _prepare(_overrides(results, "2x2", "default"))
    return Path(dirs.solve) / "plan.json"


def _bad_input(results: Path, argv: list[str], capsys: pytest.CaptureFixture,
               watch: Path) -> str:
    before = _tree(watch)
    code, line = _main(argv, capsys)
    assert code == 2, line
    assert line and "\n" not in line and "Traceback" not in line
    assert _tree(watch) == before, "nothing may be written"
    return line


def test_bad_plan_edited_to_an_illegal_placement(results: Path, plan_2x2: Path,
                                                 capsys: pytest.CaptureFixture) -> None:
    doc = json.loads(plan_2x2.read_text())
    param = doc["parameters"][1]
    param["placement"] = "S(3)R"  # a 1-d norm weight has no dim 3
    for n in doc["nodes"]:
        if n["name"] == param["node"]:
            n["output"] = "S(3)R"
    bad = Path(tempfile.mkdtemp(dir=results)) / "plan.json"
    bad.write_text(json.dumps(doc))
    line = _bad_input(results, [*_overrides(results, "2x2", "default"), "--plan", str(bad)],
                      capsys, results)
    assert f"parameters[{param['fqn']}].placement=S(3)R" in line
    assert "Shard(3)" in line and "allowed S(d) with 0 <= d < 1" in line


@pytest.mark.parametrize(("change", "expect"), [
    ("model.dim=64", "does not match the model being applied"),  # other parameter shapes
    ("model.batch_size=16", "model.batch_size=8 in the plan, 16 in the config being applied"),
])
def test_bad_plan_of_another_model(results: Path, plan_2x2: Path, change: str, expect: str,
                                   capsys: pytest.CaptureFixture) -> None:
    argv = [*_overrides(results, "2x2", "default", change), "--plan", str(plan_2x2)]
    line = _bad_input(results, argv, capsys, results)
    assert expect in line and "another model" in line


def test_bad_plan_of_another_mesh(results: Path, plan_2x2: Path,
                                  capsys: pytest.CaptureFixture) -> None:
    argv = [*_overrides(results, "4", "default"), "--plan", str(plan_2x2)]
    line = _bad_input(results, argv, capsys, results)
    assert "mesh=2x2 (dp,tp) does not match the mesh being applied (4)" in line


def test_bad_plan_truncated(results: Path, plan_2x2: Path,
                            capsys: pytest.CaptureFixture) -> None:
    text = plan_2x2.read_text()
    bad = Path(tempfile.mkdtemp(dir=results)) / "plan.json"
    bad.write_text(text[: len(text) // 2])
    line = _bad_input(results, [*_overrides(results, "2x2", "default"), "--plan", str(bad)],
                      capsys, results)
    assert f"plan={bad}: not a complete JSON document" in line and "truncated" in line


def test_bad_process_count(results: Path, plan_2x2: Path,
                           capsys: pytest.CaptureFixture) -> None:
    line = _bad_input(results, [*_overrides(results, "2x2", "default"), "--nproc", "3"],
                      capsys, results)
    assert line == ("--nproc=3: mesh=2x2 has 4 devices; allowed exactly 4 processes "
                    "(one per device)")


def test_bad_input_from_the_command_line(results: Path, plan_2x2: Path) -> None:
    """The real CLI: exit 2, one line on stderr, nothing on stdout."""
    proc = subprocess.run(
        [sys.executable, "-m", "pipeline.verify.run", *_overrides(results, "2x2", "default"),
         "--nproc", "8"], capture_output=True, text=True, timeout=300, cwd=results,
        env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "--nproc=8: mesh=2x2 has 4 devices; allowed exactly 4 processes (one per device)"]
    assert proc.stdout == ""
