"""Verify of a pipelined plan (a ``pp`` mesh dim of size ``p > 1``, docs/pipelining.md,
"Verify"): the plan's stages run with torch.distributed.pipelining on ``gloo`` processes
and the loss and every gradient are compared with the unsharded step.

:func:`verify_pipelined` runs the stages as ``python -m pipeline`` does (the stage solve on
the sub-mesh, then the pipelined solve; current artifacts reused), reads the plan file's
``pipeline`` section (:func:`read_section`: checked against the config and the model, one
line naming the entry otherwise), forks one process per device of the whole mesh
(:mod:`pipeline.verify.pipelined_rank`: each pipeline rank's stages under the plan's
schedule and microbatches, the other dims replicating the stage over a split batch) and
writes ``verify.json`` beside the plan with a ``pipelined`` key: schedule and torch's
class, microbatches, virtual stages, the per-rank stages and layer ranges, how the other
dims ran, the loss (mean of the microbatch losses) and every gradient beside the
reference, the largest relative difference, and ``ok`` (every one at most
:data:`pipeline.verify.compare.RTOL`, float32, and every parameter compared).
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from pipeline.core import runtime
from pipeline.plan.format import PLAN_FILE, PlanFileError, check_model, load
from pipeline.verify.compare import RTOL
from pipeline.verify.models import (
    VerifyUsageError,
    build_real_model,
    family_of,
    model_hash_of_config,
)
from pipeline.verify.pipelined_rank import SCHEDULE_CLASSES, pipelined_worker
from pipeline.verify.signals import run_workers

__all__ = ["expected_modules", "pipelined_record", "read_section", "sends_record",
           "verify_pipelined"]

#: How the non-``pp`` dims run, written into the record.
DATA_PARALLEL = ("replicated: every replica holds its stages whole and runs its contiguous "
                 "share of the batch; the gradients (and the loss) are all-reduced over the "
                 "replicas and divided by their number. pipeline.apply.parallelize is not "
                 "applied: it needs the whole traced module (every planned parameter, the "
                 "model's inputs), a stage module holds part of it and takes activations")


def expected_modules(lo: int, hi: int, first: bool, last: bool) -> list[str]:
    """The modules of a stage holding layers ``[lo, hi)``: the embedding on the first
    stage, the final norm and head on the last (docs/pipelining.md, "Pipelined runs")."""
    return (["tok_embeddings"] if first else []) + [f"layers.{i}" for i in range(lo, hi)] \
        + (["norm", "output"] if last else [])


def read_section(path: Path, cfg: Any) -> dict[str, Any]:
    """The ``pipeline`` section of the plan file ``path``, checked against the resolved
    config ``cfg``: its degree the ``pp`` dim's size, its schedule, microbatches and
    virtual stages the config's, ``degree x virtual_stages`` stages in order, stage
    ``s`` on rank ``s mod degree``, the layer ranges contiguous from 0 to
    ``model.n_layers`` and each stage's modules :func:`expected_modules`.

    Raises:
        PlanFileError: one line naming the file, the entry and what is allowed.
    """
    where = f"plan={path}"
    doc = json.loads(Path(path).read_text())
    sec = doc.get("pipeline")
    if not isinstance(sec, dict):
        raise PlanFileError(f"{where}: no pipeline section; allowed the plan of a pipelined "
                            f"run (mesh_names=[pp,...], {cfg.mesh_names[0]}={cfg.mesh[0]})")
    p, n_layers = int(cfg.mesh[0]), int(cfg.model.n_layers)
    want = {"degree": p, "schedule": str(cfg.pipeline.schedule),
            "microbatches": int(cfg.pipeline.microbatches),
            "virtual_stages": int(cfg.pipeline.virtual_stages)}
    for key, value in want.items():
        if sec.get(key) != value:
            raise PlanFileError(f"{where}: pipeline.{key}={sec.get(key)!r}: allowed {value!r} "
                                "(the config's; verify the plan with its own overrides)")
    stages = sec.get("stages")
    n = p * want["virtual_stages"]
    if not isinstance(stages, list) or len(stages) != n:
        raise PlanFileError(f"{where}: pipeline.stages: allowed {n} stages ({p} ranks x "
                            f"{want['virtual_stages']} virtual stages)")
    start = 0
    for s, st in enumerate(stages):
        layers = st.get("layers") if isinstance(st, dict) else None
        ok = (isinstance(layers, list) and len(layers) == 2 and st.get("stage") == s
              and st.get("rank") == s % p and layers[0] == start and layers[1] > start)
        if not ok:
            raise PlanFileError(f"{where}: pipeline.stages[{s}]={st!r}: allowed stage {s} on "
                                f"rank {s % p} with layers [{start}, end > {start}]")
        start = int(layers[1])
        mods = expected_modules(int(layers[0]), start, s == 0, s == n - 1)
        if st.get("modules") != mods:
            raise PlanFileError(f"{where}: pipeline.stages[{s}].modules={st.get('modules')!r}: "
                                f"allowed {mods}")
    if start != n_layers:
        raise PlanFileError(f"{where}: pipeline.stages: layers end at {start}; allowed "
                            f"model.n_layers={n_layers}")
    return sec


def verify_pipelined(cfg: Any, *, plan_path: Path | None = None,
                     seed: int = 0, output: Path | None = None,
                     start_method: str = "fork") -> dict[str, Any]:
    """Verify the pipelined plan of a resolved config (module docstring); returns the
    ``verify.json`` record (also written). Called by :func:`pipeline.verify.run.verify`
    after its checks of the model family and the process count (``nproc``).

    Raises:
        PlanError: bad input (nothing written).
    """
    from omegaconf import OmegaConf

    from pipeline.config import stage_dirs
    from pipeline.config.pipeline_stage import stage_config
    from pipeline.stages.runner import run_stage

    started = time.perf_counter()
    model_cfg = OmegaConf.to_container(cfg.model, resolve=True)
    if family_of(model_cfg) != "llama":
        raise VerifyUsageError(f"model.family={family_of(model_cfg)}: verify of a pipelined "
                               "plan splits the built-in llama family only into stages "
                               "(model=toy|llama1b|llama8b|llama70b)")
    sub = stage_config(cfg)
    stage_mesh = tuple(int(s) for s in sub.mesh)
    if plan_path is not None:  # a plan file given: checked before any stage writes
        load(plan_path, mesh=stage_mesh, model=model_hash_of_config(model_cfg))
        read_section(Path(plan_path), cfg)
    for stage in ("trace", "topology", "costs", "solve"):
        run_stage(stage, sub, stage_dirs(sub))
    dirs = stage_dirs(cfg)
    run_stage("solve", cfg, dirs)
    path = Path(plan_path) if plan_path is not None else Path(dirs.solve) / PLAN_FILE
    plan = load(path, mesh=stage_mesh)
    section = read_section(path, cfg)
    model = build_real_model(model_cfg, seed)
    check_model(plan, model)
    names = [n for n, _ in model.named_parameters()]
    del model
    world = math.prod(int(s) for s in cfg.mesh)
    p = int(cfg.mesh[0])
    job = {"world": world, "degree": p, "replicas": world // p,
           "microbatches": int(section["microbatches"]), "schedule": section["schedule"],
           "stages": section["stages"], "model_cfg": model_cfg, "seed": int(seed)}
    prepared = time.perf_counter() - started
    with tempfile.TemporaryDirectory(prefix="verify-pp-") as tmp:
        job.update(store=os.path.join(tmp, "store"), out_dir=tmp)
        start = time.perf_counter()
        run_workers(pipelined_worker, (job,), world, start_method)
        spawned = time.perf_counter() - start
        ranks = [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(world)]
    pipelined = pipelined_record(section, ranks, names, list(cfg.mesh_names)[1:], RTOL)
    if "error" not in pipelined:
        pipelined["sends"] = sends_record(section, ranks, path.parent / "run.json",
                                          str(cfg.model.param_dtype))
        pipelined["ok"] = bool(pipelined["ok"] and pipelined["sends"]["counts_equal"])
    record: dict[str, Any] = {
        "run_id": plan.run_id, "plan": str(plan.path), "model": plan.model_name,
        "mesh": "x".join(str(int(s)) for s in cfg.mesh), "mesh_names": list(cfg.mesh_names),
        "stage_mesh": "x".join(map(str, plan.mesh_shape)), "processes": world,
        "backend": "gloo", "device": "cpu", "seed": int(seed), "compute_dtype": "float32",
        "traced_param_dtype": str(cfg.model.get("param_dtype", "float32")), "rtol": RTOL,
        "ok": pipelined["ok"], "checks": {"pipelined": pipelined["ok"]},
        "pipelined": pipelined}
    if "error" in pipelined:
        record["error"] = pipelined["error"]
    record["seconds"] = {"prepare": prepared, "processes": spawned,
                         "total": time.perf_counter() - started}
    record["environment"] = runtime.environment()
    record["git"] = runtime.git_revision()
    target = Path(output) if output is not None else path.parent / "verify.json"
    runtime.write_json(target, record)
    record["path"] = str(target)
    return record


def pipelined_record(section: dict[str, Any], ranks: list[dict[str, Any]],
                     names: list[str], replica_dims: list[str], rtol: float
                     ) -> dict[str, Any]:
    """The ``pipelined`` part of ``verify.json`` from the processes' results: ``ok`` when
    no process failed, every parameter of the model (``names``) was compared on some
    process (every replica compares its own), and the loss and every gradient differ by
    at most ``rtol`` (relative) on every process."""
    p = int(section["degree"])
    out: dict[str, Any] = {
        "schedule": section["schedule"],
        "schedule_class": f"torch.distributed.pipelining.{SCHEDULE_CLASSES[section['schedule']]}",
        "microbatches": int(section["microbatches"]),
        "virtual_stages": int(section["virtual_stages"]), "degree": p,
        "replicas": len(ranks) // p, "replica_dims": replica_dims,
        "data_parallel": DATA_PARALLEL if len(ranks) > p else "none (the mesh is pp alone)",
        "loss_scaling": ("loss_fn: the mean cross-entropy of one microbatch; the schedule "
                         "(scale_grads=True) divides the accumulated gradients by the "
                         "microbatch count; loss: the mean of the microbatch losses"),
        "ranks": [{"pp_rank": r, "stages": [
            {"stage": st["stage"], "layers": st["layers"], "modules": st["modules"]}
            for st in section["stages"] if st["stage"] % p == r]} for r in range(p)],
        "rtol": rtol}
    errors = [r["error"] for r in ranks if "error" in r]
    if errors:
        return {**out, "ok": False, "error": errors[0]}
    grads: dict[str, dict[str, Any]] = {}
    for r in ranks:
        for n, g in r["grads"].items():
            if n not in grads or g["rel_diff"] > grads[n]["rel_diff"]:
                grads[n] = {**g, "pp_rank": r["pp_rank"]}
    missing = sorted(set(names) - set(grads)) + sorted(
        {n for r in ranks for n in r["missing"]})
    losses = [r for r in ranks if "loss" in r]
    loss = max((r["loss"] for r in losses), key=lambda x: x["rel_diff"], default=None)
    rels = [g["rel_diff"] for g in grads.values()] + [r["loss"]["rel_diff"] for r in losses]
    max_rel = max(rels, default=math.inf)
    ok = bool(not missing and loss is not None and max_rel <= rtol)
    return {**out, "ok": ok, "loss": loss,
            "microbatch_losses": losses[0]["microbatch_losses"] if losses else None,
            "max_grad_rel_diff": max((g["rel_diff"] for g in grads.values()), default=None),
            "max_rel_diff": max_rel, "grads_missing": missing,
            "grads": dict(sorted(grads.items()))}


def sends_record(section: dict[str, Any], ranks: list[dict[str, Any]], run_json: Path,
                 param_dtype: str) -> dict[str, Any]:
    """The boundary sends counted per stage (:func:`pipeline.verify.pipelined_rank.
    counting_stage`, replica 0's; every replica sends the same) beside the plan's: stage
    ``s`` sends one activation per microbatch when it is not the last and one gradient
    when it is not the first (docs/pipelining.md, "Boundary sends"), each of
    ``send_bytes / itemsize(param_dtype)`` elements (``run.json``'s ``pipeline.
    send_bytes``: one device's hidden state ``[microbatch, seq_len, dim]``).
    ``counts_equal`` is part of the check; ``elements_equal`` is reported beside it (a
    stage plan that splits the boundary activation over the other dims sends a shard,
    and verify replicates the stage)."""
    from pipeline.core.dtypes import itemsize

    m, n = int(section["microbatches"]), len(section["stages"])
    planned = {str(s): {"activation": m if s < n - 1 else 0, "gradient": m if s > 0 else 0}
               for s in range(n)}
    counted: dict[str, dict[str, int]] = {}
    elements: set[int] = set()
    for r in ranks:
        if r["replica"] != 0:
            continue
        for s, kinds in r["sends"].items():
            counted[s] = {k: len(v) for k, v in kinds.items()}
            elements.update(e for v in kinds.values() for e in v)
    record = json.loads(run_json.read_text()) if run_json.exists() else {}
    send_bytes = (record.get("pipeline") or {}).get("send_bytes")
    planned_elements = (int(send_bytes) // itemsize(param_dtype)
                        if isinstance(send_bytes, (int, float)) else None)
    return {"counted": dict(sorted(counted.items(), key=lambda kv: int(kv[0]))),
            "planned": planned, "counts_equal": counted == planned,
            "elements_per_send": sorted(elements),
            "planned_elements_per_send": planned_elements,
            "planned_source": f"{run_json} pipeline.send_bytes / itemsize({param_dtype})"
            if planned_elements is not None else "none (no run.json beside the plan)",
            "elements_equal": planned_elements is not None
            and sorted(elements) == [planned_elements]}
