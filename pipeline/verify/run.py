"""Stage verify: execute a run's plan with DTensor on real processes and check it.

    python -m pipeline.verify model=toy mesh=2,2 [hydra overrides] [--plan PATH]
        [--nproc N] [--seed S] [--output PATH] [--measure N [--warmup W]]
    snakemake verify --config model=toy mesh=2,2

Runs the stages the plan needs (reusing current artifacts), then spawns one process
per mesh device on a ``gloo`` process group (CPU; forked, one thread each; what each
process runs is :mod:`pipeline.verify.execute`). Every
process builds the same model with small random weights and the same inputs from a
fixed seed (:func:`build_real_model`, :func:`real_inputs`: the built-in LLaMA family,
or an ``hf`` architecture built on CPU with transformers' ``from_config`` and the
attention and experts implementation the trace used), and runs the plan
(:func:`pipeline.apply.run_step`: every node's output placement checked against the
plan, collectives counted); rank 0 also runs the single-process reference step
(eager forward, loss, ``backward()`` on the unsharded model). Both execute in float32
(a bf16 plan's casts compute in float32), so the comparison measures sharding, not
rounding. Written (atomically) to ``verify.json`` beside the plan:

* ``loss`` and ``grads``: value and reference, max absolute difference and relative
  difference ``max|a - b| / max|b|`` (each gradient gathered with ``full_tensor()``);
  passes when every relative difference is at most :data:`RTOL`;
* ``placements``: nodes checked; any node where DTensor chose another placement
  fails the run before ``verify.json`` is complete (it is then written with the error);
* ``collectives``: counted per ``kind(mesh dim)`` (:class:`pipeline.apply.CollectiveCounter`:
  one call of a functional collective on one mesh dim's group is one collective;
  DTensor's CPU all-to-all is counted as an all-to-all) beside the planned counts,
  the ``collectives`` column of ``redistributions.parquet`` (one entry per
  redistribution step); passes when they are equal and no op redistributed on its own;
* ``memory``: peak bytes of live local tensors per rank, beside the plan's predicted
  bytes per device when the run record has a memory model (else null);
* ``styles``: the plan read as FSDP2 / tensor-parallel styles
  (:func:`pipeline.apply.torch_styles`);
* ``applied``: the applied path (:mod:`pipeline.verify.applied`): the real module
  parallelized with :func:`pipeline.apply.parallelize` and trained one step beside the
  unsharded one, parameters' local shapes and shards against the plan, collectives
  and parameter bytes beside the plan's (:func:`applied_record`);
* ``timing`` (with ``--measure N``): the applied step timed on the gloo processes,
  ``--warmup W`` untimed steps (default 2) then ``N`` timed ones, each between
  barriers; the median of the slowest rank's step time with its min, max and
  quartiles, beside the run's predicted ``step_time_us`` under the run's ``hardware``
  (``hardware=cpu_epyc2``: the profile calibrated on this machine), their ratio, and
  the load average (:mod:`pipeline.verify.timing`).

A pipelined config (a ``pp`` mesh dim of size > 1) is verified by
:mod:`pipeline.verify.pipelined` instead: the plan's stages under
torch.distributed.pipelining, the ``pipelined`` key of ``verify.json``.

Exit status: 0 the plan verified; 1 it did not (``verify.json`` says why) or a
process failed; 2 bad input (one line on stderr, nothing written): a bad override or
flag, a model family verify cannot build (``custom``), a traced step that draws random
numbers (dropout with p > 0), a plan file that is truncated, edited to an illegal
placement or made for another model, trace or mesh, or a process count other than the
mesh size; 130 / 143 SIGINT / SIGTERM: the worker processes are stopped within seconds
and one line says so (:mod:`pipeline.verify.signals`).
"""

from __future__ import annotations

import collections
import json
import logging
import math
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pipeline.core import interrupts, runtime
from pipeline.core.errors import PlanError
from pipeline.core.ir import load_nodes, read_graph
from pipeline.plan.format import (
    PLAN_FILE,
    check_model,
    check_model_config,
    check_world_size,
    load,
)
from pipeline.verify.applied import dtensor_collectives
from pipeline.verify.compare import RTOL
from pipeline.verify.execute import check_deterministic, worker
from pipeline.verify.models import (
    VerifyUsageError,
    build_real_model,
    check_model_family,
    model_hash_of_config,
    real_inputs,
)
from pipeline.verify.signals import Interrupted, handled, run_workers
from pipeline.verify.timing import DEFAULT_WARMUP, load_average, predicted_step, timing_record

__all__ = ["DEFAULT_SEED", "RTOL", "VERIFY_FILE", "VerifyUsageError",
           "build_real_model", "check_inputs", "dtensor_collectives", "main", "parse_args",
           "planned_collectives", "real_inputs", "verify"]

log = logging.getLogger(__name__)

VERIFY_FILE = "verify.json"
DEFAULT_SEED = 0
_USAGE = ("usage: python -m pipeline.verify [hydra overrides...] [--plan PATH] [--nproc N] "
          "[--seed S] [--output PATH] [--measure N] [--warmup W]")
_FLAGS = ("--plan", "--nproc", "--seed", "--output", "--measure", "--warmup")


# --------------------------------------------------------------------------- driver


def planned_collectives(plan: Any) -> tuple[dict[str, int], str]:
    """The planned collective counts per ``kind(mesh dim)`` and where they came from:
    ``redistributions.parquet`` beside the plan (the run's table, one entry per
    redistribution step, as DTensor issues them: :func:`dtensor_collectives`) when it
    belongs to the same run, else the plan's own summary."""

    table_path = Path(plan.path).parent / "redistributions.parquet"
    if table_path.exists():
        table = runtime.read_parquet(table_path)
        meta = json.loads((table.schema.metadata or {}).get(b"pipeline", b"{}"))
        if meta.get("run_id") == plan.run_id:
            counts: dict[str, int] = {}
            for row in table.select(["shape", "dtype", "src_placement", "dst_placement",
                                     "collectives"]).to_pylist():
                for name in dtensor_collectives(row, plan.mesh_shape, plan.mesh_names):
                    counts[name] = counts.get(name, 0) + 1
            return dict(sorted(counts.items())), str(table_path)
    return plan.collective_counts(), f"{plan.path} (collectives)"


def _predicted_memory(solve_dir: Path) -> dict[str, Any]:
    path = solve_dir / "run.json"
    record = json.loads(path.read_text()) if path.exists() else {}
    memory = record.get("memory")
    if isinstance(memory, dict):
        for key in ("peak_bytes_per_device", "peak_bytes", "bytes_per_device"):
            if isinstance(memory.get(key), (int, float)):
                return {"predicted_bytes_per_device": memory[key],
                        "predicted_source": f"run.json memory.{key}"}
    return {"predicted_bytes_per_device": None,
            "predicted_source": "none (the run record has no memory model)"}


def parse_args(argv: Sequence[str]) -> tuple[list[str], dict[str, Any]]:
    """Split ``argv`` into Hydra overrides and verify flags.

    Raises:
        VerifyUsageError: an unknown flag, a flag without a value, or a bad value.
    """
    overrides: list[str] = []
    flags: dict[str, Any] = {"plan": None, "nproc": None, "seed": DEFAULT_SEED, "output": None,
                             "measure": 0, "warmup": DEFAULT_WARMUP}
    args = list(argv)
    i = 0
    while i < len(args):
        a = args[i]
        if a.startswith("--"):
            key, _, value = a.partition("=")
            if key not in _FLAGS:
                raise VerifyUsageError(f"{key}: unknown flag; allowed " + ", ".join(_FLAGS))
            if not value:
                if i + 1 >= len(args):
                    raise VerifyUsageError(f"{key}: missing value")
                i += 1
                value = args[i]
            name = key[2:]
            if name in ("nproc", "seed", "measure", "warmup"):
                try:
                    number = int(value)
                except ValueError:
                    number = -1
                if number < (1 if name == "nproc" else 0):
                    raise VerifyUsageError(
                        f"{key}={value}: allowed a "
                        + ("positive" if name == "nproc" else "non-negative") + " integer")
                flags[name] = number
            else:
                flags[name] = value
        else:
            overrides.append(a)
        i += 1
    return overrides, flags


def check_inputs(cfg: Any, plan_path: Path | None, nproc: int | None) -> Any:
    """Checks that need no artifact (before any stage runs): the process count, and a
    plan file given with ``--plan`` against the config's mesh and model.

    Returns the loaded plan or None.
    """
    from omegaconf import OmegaConf

    check_model_family(OmegaConf.to_container(cfg.model, resolve=True))
    world = math.prod(int(s) for s in cfg.mesh)
    if nproc is not None and nproc != world:
        raise VerifyUsageError(
            f"--nproc={nproc}: mesh={'x'.join(str(s) for s in cfg.mesh)} has {world} devices; "
            f"allowed exactly {world} processes (one per device)")
    if plan_path is None:
        return None
    model_cfg = OmegaConf.to_container(cfg.model, resolve=True)
    plan = load(plan_path, mesh=tuple(int(s) for s in cfg.mesh),
                model=model_hash_of_config(model_cfg))
    check_model_config(plan, model_cfg)
    check_world_size(plan, world if nproc is None else nproc)
    return plan


def verify(cfg: Any, *, plan_path: Path | None = None, nproc: int | None = None,
           seed: int = DEFAULT_SEED, output: Path | None = None,
           start_method: str = "fork", interpret: bool = True, applied: bool = True,
           measure: int = 0, warmup: int = DEFAULT_WARMUP) -> dict[str, Any]:
    """Verify the plan of a resolved config (see the module docstring); returns the
    ``verify.json`` record (also written). ``interpret=False`` runs the applied path
    only (``parallelize`` and the module's own step), not the graph interpreter;
    ``applied=False`` the interpreter only; ``measure=N`` times ``N`` applied steps after
    ``warmup`` (``interpret=False, applied=False, measure=N``: the timing alone).

    Raises:
        PlanError: bad input (nothing written).
    """
    from omegaconf import OmegaConf

    import pipeline.apply  # noqa: F401 - imported once here, not in every forked process
    import pipeline.dtensor.cpu_kernels  # noqa: F401
    from pipeline.config import stage_dirs
    from pipeline.config.pipeline_stage import pipeline_degree
    from pipeline.stages.runner import run_stage
    from pipeline.verify.pipelined import verify_pipelined

    started = time.perf_counter()
    if pipeline_degree(cfg) > 1:  # a pipelined plan: pipeline/verify/pipelined.py
        check_inputs(cfg, None, nproc)
        if measure:
            raise VerifyUsageError(f"--measure={measure}: timing a pipelined plan is not "
                                   "built; allowed 0 (leave --measure out)")
        return verify_pipelined(cfg, plan_path=plan_path, seed=seed, output=output,
                                start_method=start_method)
    check_inputs(cfg, plan_path, nproc)
    dirs = stage_dirs(cfg)
    for stage in ("trace", "topology", "costs", "solve"):
        run_stage(stage, cfg, dirs)
    table, _ = read_graph(dirs.trace)
    path = Path(plan_path) if plan_path is not None else Path(dirs.solve) / PLAN_FILE
    world = math.prod(int(s) for s in cfg.mesh)
    plan = load(path, mesh=tuple(int(s) for s in cfg.mesh), graph=table,
                world_size=world if nproc is None else nproc)
    model_cfg = OmegaConf.to_container(cfg.model, resolve=True)
    check_model(plan, build_real_model(model_cfg, seed))
    nodes = load_nodes(table)
    check_deterministic(nodes)
    planned, planned_source = planned_collectives(plan)
    prepared = time.perf_counter() - started
    with tempfile.TemporaryDirectory(prefix="verify-") as tmp:
        job = {"world": world, "store": os.path.join(tmp, "store"), "out_dir": tmp,
               "plan": plan, "nodes": nodes, "model_cfg": model_cfg, "seed": int(seed),
               "interpret": bool(interpret), "applied": bool(applied),
               "activation_checkpointing": str(
                   OmegaConf.select(cfg, "memory.activation_checkpointing") or "none"),
               "measure": int(measure), "warmup": int(warmup)}
        start = time.perf_counter()
        load_before = load_average()
        run_workers(worker, (job,), world, start_method)  # stopped on SIGINT / SIGTERM
        machine_load = {"before": load_before, "after": load_average(),
                        "cores": len(os.sched_getaffinity(0))}
        spawned = time.perf_counter() - start
        ranks = [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(world)]
    if interpret:
        record = _record(cfg, plan, ranks, planned, planned_source, seed, Path(dirs.solve))
    else:
        record = _record_applied_only(cfg, plan, ranks, seed)
    if applied and not record.get("error"):
        record["applied"] = applied_record(plan, nodes, ranks, path.parent)
        record["checks"]["applied"] = record["applied"]["ok"]
        record["ok"] = bool(record["ok"] and record["applied"]["ok"])
    if measure and not record.get("error"):
        record["timing"] = timing_record(ranks, warmup, predicted_step(dirs.solve, cfg.hardware),
                                         machine_load)
    from pipeline.apply import torch_styles

    styles = torch_styles(plan, nodes)
    record["styles"] = {"fully_shard": {",".join(k): v for k, v in
                                        styles.fully_shard_groups().items()},
                        "parallelize_module": styles.parallelize_plans(),
                        "unmatched": styles.unmatched}
    record["seconds"] = {"prepare": prepared, "processes": spawned,
                         "total": time.perf_counter() - started,
                         "rank0": ranks[0].get("seconds", {})}
    record["environment"] = runtime.environment()
    record["git"] = runtime.git_revision()
    target = Path(output) if output is not None else path.parent / VERIFY_FILE
    interrupts.check()  # a signal swallowed while a worker started: no verdict written
    runtime.write_json(target, record)
    record["path"] = str(target)
    return record


def applied_record(plan: Any, nodes: Any, ranks: list[dict[str, Any]], solve_dir: Path
                   ) -> dict[str, Any]:
    """The applied path's part of ``verify.json`` (:mod:`pipeline.verify.applied`): ``ok``
    when the loss and every gradient match within :data:`RTOL` and every parameter has
    its planned local shape on every rank. Beside it, not part of ``ok``: the check
    ``collectives`` (the collectives counted equal the plan's as the applied step issues
    them, :func:`pipeline.verify.applied.applied_planned`, on every rank) and
    ``collectives_explained`` (every difference is a named entry of ``unplanned``, with
    its reason, and nothing is left in ``unexplained``:
    :func:`pipeline.verify.applied.unplanned_collectives`)."""
    from pipeline.verify.applied import (
        EMBEDDING_REASON,
        HSDP_REASON,
        LOSS_REASON,
        applied_planned,
        embedding_backward_entry,
        hsdp_gradient_entry,
        unplanned_collectives,
    )

    parts = [r.get("applied", {"error": "no applied result"}) for r in ranks]
    errors = [a["error"] for a in parts if "error" in a]
    if errors:
        return {"ok": False, "error": errors[0]}
    r0 = parts[0]
    grads = r0["grads"]
    rels = [r0["loss"]["rel_diff"]] + [g.get("rel_diff", math.inf) for g in grads.values()]
    numbers_ok = all(x <= RTOL for x in rels) and not any(g.get("missing")
                                                           for g in grads.values())
    shapes_ok = all(v["local_shape"] == v["planned_local_shape"]
                    for a in parts for v in a["placements"].values())
    units = {f: v["unit"] for f, v in r0["report"]["parameters"].items()}
    data_dims = {f: [*v["shard"], *v["replicate"]]
                 for f, v in r0["report"]["parameters"].items()}
    rows: list[dict[str, Any]] = []
    table_path = solve_dir / "redistributions.parquet"
    if table_path.exists():
        rows = runtime.read_parquet(table_path).to_pylist()
    # FSDP2 flattens a unit's shard dims, and its replicate dims, into one mesh each
    # (torch/distributed/fsdp/_fully_shard/_fsdp_init.py, _get_mesh_info_from_named_dims)
    flattened = {frozenset(u[k]) for u in r0["report"]["units"].values()
                 for k in ("shard", "replicate") if len(u[k]) > 1}
    planned_params, planned_acts, planned_loss, grad_buckets = applied_planned(
        rows, nodes, plan, units, data_dims, flattened)
    planned: collections.Counter[str] = collections.Counter()
    for part in (planned_params, planned_acts, planned_loss):
        planned.update(part)
    counted = r0["collectives"]
    same = all(a["collectives"] == counted and a["loss_collectives"] == r0["loss_collectives"]
               for a in parts)
    # the units FSDP2 reduces gradients for: those some parameter belongs to (the root
    # unit of a model whose parameters all lie in other units manages none)
    owning = {v["unit"] for v in r0["report"]["parameters"].values()}
    hsdp = hsdp_gradient_entry({u: v for u, v in r0["report"]["units"].items()
                                if u in owning}, grad_buckets)
    unplanned, unexplained = unplanned_collectives(counted, planned, [
        ("loss", r0["loss_collectives"], planned_loss, LOSS_REASON),
        ("hsdp_gradient", *hsdp, HSDP_REASON),
        ("embedding_backward", *embedding_backward_entry(
            rows, nodes, plan, units, data_dims, flattened, r0["module_collectives"]),
         EMBEDDING_REASON)])
    return {
        "ok": bool(numbers_ok and shapes_ok),
        "checks": {"loss_and_grads": bool(numbers_ok), "local_shapes": bool(shapes_ok),
                   "collectives": bool(same and counted == dict(planned)),
                   "collectives_explained": bool(same and not unexplained),
                   "same_shards": all(v["same_shard"] for a in parts
                                      for v in a["placements"].values())},
        "loss": r0["loss"], "grads": grads,
        "max_grad_rel_diff": max(rels[1:], default=0.0),
        "placements": r0["placements"],
        "collectives": {"counted": counted, "planned": dict(sorted(planned.items())),
                        "planned_parameters": planned_params,
                        "planned_activations": planned_acts, "planned_loss": planned_loss,
                        "counted_loss": r0["loss_collectives"],
                        "unplanned": unplanned, "unexplained": unexplained},
        "parameter_bytes_per_rank": [a["parameter_bytes"] for a in parts],
        "predicted_parameter_bytes_per_rank": [a["predicted_parameter_bytes"] for a in parts],
        "report": r0["report"]}


def _record_applied_only(cfg: Any, plan: Any, ranks: list[dict[str, Any]], seed: int
                         ) -> dict[str, Any]:
    """The record of a run without the graph interpreter (``interpret=False``)."""
    errors = [r["error"] for r in ranks if "error" in r]
    base = {"run_id": plan.run_id, "plan": str(plan.path), "model": plan.model_name,
            "mesh": "x".join(map(str, plan.mesh_shape)), "mesh_names": list(plan.mesh_names),
            "processes": len(ranks), "backend": "gloo", "device": "cpu", "seed": int(seed),
            "compute_dtype": "float32", "rtol": RTOL, "interpreted": False,
            "traced_param_dtype": str(cfg.model.get("param_dtype", "float32"))}
    if errors:
        return {**base, "ok": False, "error": errors[0], "checks": {"applied": False}}
    return {**base, "ok": True, "checks": {}}


def _record(cfg: Any, plan: Any, ranks: list[dict[str, Any]], planned: dict[str, int],
            planned_source: str, seed: int, solve_dir: Path) -> dict[str, Any]:
    errors = [r["error"] for r in ranks if "error" in r]
    base: dict[str, Any] = {
        "run_id": plan.run_id, "plan": str(plan.path), "placement_hash": plan.placement_hash,
        "model": plan.model_name, "mesh": "x".join(map(str, plan.mesh_shape)),
        "mesh_names": list(plan.mesh_names), "processes": len(ranks), "backend": "gloo",
        "device": "cpu", "seed": int(seed), "compute_dtype": "float32",
        "traced_param_dtype": str(cfg.model.get("param_dtype", "float32")), "rtol": RTOL}
    if errors:
        return {**base, "ok": False, "error": errors[0],
                "checks": {"placements": False, "loss_and_grads": False, "collectives": False}}
    r0 = ranks[0]
    grads = r0["grads"]
    missing = sorted(k for k, v in grads.items() if v.get("missing"))
    rels = [r0["loss"]["rel_diff"]] + [v["rel_diff"] for v in grads.values()
                                       if not v.get("missing")]
    numbers_ok = not missing and all(x <= RTOL for x in rels)
    counted = r0["collectives"]
    same_on_ranks = all(r["collectives"] == counted for r in ranks)
    op_coll = {k: v for r in ranks for k, v in r["op_collectives"].items()}
    coll_ok = counted == planned and same_on_ranks and not op_coll
    peak = [int(r["peak_local_bytes"]) for r in ranks]
    return {
        **base,
        "ok": bool(numbers_ok and coll_ok),
        "checks": {"placements": True, "loss_and_grads": bool(numbers_ok),
                   "collectives": bool(coll_ok)},
        "loss": r0["loss"],
        "grads": grads, "grads_missing": missing,
        "max_grad_rel_diff": max((v["rel_diff"] for v in grads.values()
                                  if not v.get("missing")), default=0.0),
        "placements": {"nodes_checked": r0["nodes_checked"], "as_planned": True,
                       "redistributions": r0["redistributions"]},
        "collectives": {
            "counted": counted, "planned": planned, "planned_source": planned_source,
            "equal": counted == planned, "same_on_every_rank": same_on_ranks,
            "inside_ops": op_coll,
            "how": ("one call of a functional collective on one mesh dim's process group is "
                    "one collective (CommDebugMode, per kind and mesh dim); DTensor's CPU "
                    "all-to-all (all-gather + chunk, gloo has no all-to-all) counts as "
                    "all_to_all; planned: one per redistribution step in the collectives "
                    "column of redistributions.parquet, a collective over a flattened "
                    "group as DTensor's per-mesh-dim steps")},
        "memory": {"peak_local_bytes_per_rank": peak, **_predicted_memory(solve_dir)},
    }


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m pipeline.verify``; returns the exit code."""
    from pipeline.config import ConfigError, load_resolved
    from pipeline.stages.runner import USER_ERRORS, configure_logging

    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in ("-h", "--help"):
        print(_USAGE)
        return 0
    try:
        overrides, flags = parse_args(args)
        cfg = load_resolved(overrides)
    except (ConfigError, PlanError) as err:
        print(str(err).splitlines()[0], file=sys.stderr)
        return 2
    configure_logging()
    try:
        with handled():
            record = verify(cfg, plan_path=Path(flags["plan"]) if flags["plan"] else None,
                            nproc=flags["nproc"], seed=flags["seed"],
                            output=Path(flags["output"]) if flags["output"] else None,
                            measure=flags["measure"], warmup=flags["warmup"])
    except USER_ERRORS as err:
        print(str(err).splitlines()[0] if str(err) else type(err).__name__, file=sys.stderr)
        return 2
    except Interrupted as err:  # pipeline/verify/signals.py: the workers are stopped
        print(f"verify: {err}; worker processes stopped, verify.json not written",
              file=sys.stderr)
        return err.exit_code
    if not record["ok"]:
        reason = record.get("error") or ", ".join(k for k, v in record["checks"].items()
                                                  if not v) + " failed"
        print(f"verify: FAILED ({reason}); see {record['path']}", file=sys.stderr)
        return 1
    timing = record.get("timing")
    if timing and "median_ms" in timing:
        pred = timing["predicted_ms"]
        print(f"verify: step {timing['median_ms']:.1f} ms median of {timing['steps']} "
              f"(min {timing['min_ms']:.1f}, max {timing['max_ms']:.1f}); predicted "
              + (f"{pred:.1f} ms under hardware={timing['hardware']}" if pred is not None
                 else "none") + f"; load {timing['load_average']['before'][0]}")
    if "pipelined" in record:
        pp = record["pipelined"]
        print(f"verify: ok: {pp['schedule']} ({pp['microbatches']} microbatches, "
              f"{pp['virtual_stages']} virtual stages per rank, {pp['degree']} x "
              f"{pp['replicas']} processes): max rel diff {pp['max_rel_diff']:.2e} "
              f"(<= {RTOL:g}); {record['path']}")
        return 0
    if "placements" not in record:
        print(f"verify: ok; {record['path']}")
        return 0
    nodes = record["placements"]["nodes_checked"]
    print(f"verify: ok: loss rel diff {record['loss']['rel_diff']:.2e}, max grad rel diff "
          f"{record['max_grad_rel_diff']:.2e} (<= {RTOL:g}), {nodes} nodes as planned, "
          f"collectives {record['collectives']['counted']} as planned; {record['path']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
