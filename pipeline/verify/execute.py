"""What the processes of a verify run execute: the model with real weights, the planned
step on a ``gloo`` process group, and rank 0's single-process reference step.

:mod:`pipeline.verify.run` checks the inputs, runs the stages, forks one process per
mesh device with :func:`worker` and writes ``verify.json`` from what the processes
return. Every process builds the same model with small random weights and the same
inputs from a fixed seed (:mod:`pipeline.verify.models`: the built-in LLaMA family, an
``hf`` architecture built on CPU with transformers' ``from_config`` and the attention and
experts implementation the trace used, or a ``custom`` module from its builder), and runs
the plan
(:func:`pipeline.apply.run_step`: every node's output placement checked against the
plan, collectives counted); rank 0 also runs the reference step (eager forward, loss,
``backward()`` on the unsharded model). Both compute in float32.
"""

from __future__ import annotations

import datetime
import json
import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from pipeline.core.errors import PlanError
from pipeline.verify.compare import difference, reference_step
from pipeline.verify.models import VerifyUsageError, build_real_model, real_inputs

#: Seconds a process waits in a collective before giving up (a peer failed).
COLLECTIVE_TIMEOUT_S = 180


#: Model families verify builds real weights for (``custom`` builders give no recipe
#: for real weights on CPU).
VERIFY_FAMILIES: tuple[str, ...] = ("llama", "hf")


def check_deterministic(nodes: Sequence[Any]) -> None:
    """Fail (one line) when the traced step draws random numbers (dropout with p > 0):
    the planned and the single-process step would draw different masks.

    Raises:
        VerifyUsageError: names the first such node and its probability.
    """
    for n in nodes:
        if n.kind == "call_function" and n.target == "aten.native_dropout.default":
            p = n.args[1] if len(n.args) > 1 else n.kwargs.get("p")
            train = n.args[2] if len(n.args) > 2 else n.kwargs.get("train", True)
            if train and isinstance(p, (int, float)) and p > 0:
                raise VerifyUsageError(
                    f"node {n.name} ({n.target}, {n.module_path or 'model'}): dropout "
                    f"p={p} draws random masks the planned and reference steps cannot "
                    "share; allowed: dropout 0 (e.g. model.config.resid_pdrop=0 "
                    "model.config.embd_pdrop=0 model.config.attn_pdrop=0)")


# --------------------------------------------------------------------------- workers


def worker(rank: int, job: dict[str, Any]) -> None:
    """One process of the verify run (see the module docstring); writes
    ``rank<k>.json`` into ``job["out_dir"]``."""
    gloo_rank(rank, job, _run_rank)


def gloo_rank(rank: int, job: dict[str, Any],
              run: Callable[[int, dict[str, Any]], dict[str, Any]]) -> None:
    """A gloo rank of a verify run: one thread, torch's noisy loggers quiet, the fake
    process group a fork inherited dropped, the gloo group of ``job`` (``store``,
    ``world``) joined; ``run(rank, job)``'s result (or a :class:`PlanError`'s one line)
    written to ``<job["out_dir"]>/rank<k>.json``. Shared by this module's worker and the
    pipelined check's (pipeline/verify/pipelined_rank.py)."""
    import torch
    import torch.distributed as dist

    from pipeline.dtensor.torch_compat import NOISY_LOGGERS

    torch.set_num_threads(1)
    for name in NOISY_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    if dist.is_initialized():  # a fake process group inherited from the parent (fork)
        dist.destroy_process_group()
    out = Path(job["out_dir"]) / f"rank{rank}.json"
    dist.init_process_group("gloo", init_method=f"file://{job['store']}", rank=rank,
                            world_size=job["world"],
                            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    try:
        result = run(rank, job)
    except PlanError as err:
        result = {"error": str(err).splitlines()[0], "error_type": type(err).__name__}
    finally:
        dist.destroy_process_group()
    out.write_text(json.dumps(result, sort_keys=True))


def _applied(rank: int, job: dict[str, Any], mesh: Any) -> dict[str, Any]:
    """The applied path (:mod:`pipeline.verify.applied`); a failure is recorded, one
    line with its type, as the result of that check."""
    from pipeline.verify.applied import applied_rank

    try:
        return applied_rank(rank, job, mesh)
    except Exception as err:  # noqa: BLE001 - recorded in verify.json as the check's result
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        return {"error": f"{type(err).__name__}: {first}"}


def _timed(rank: int, job: dict[str, Any], mesh: Any, result: dict[str, Any],
           timings: dict[str, float]) -> None:
    """``--measure``: the applied step timed (:mod:`pipeline.verify.timing`) into
    ``result["timing"]``; a failure is recorded, one line with its type."""
    if not job.get("measure"):
        return
    from pipeline.verify.timing import time_rank

    start = time.perf_counter()
    try:
        result["timing"] = time_rank(rank, job, mesh)
    except Exception as err:  # noqa: BLE001 - recorded in verify.json as the timing's result
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        result["timing"] = {"error": f"{type(err).__name__}: {first}"}
    timings["measure"] = time.perf_counter() - start


def _run_rank(rank: int, job: dict[str, Any]) -> dict[str, Any]:
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from pipeline.apply import CollectiveCounter, resolve_target, run_step
    from pipeline.dtensor.cpu_kernels import cpu_kernels
    from pipeline.dtensor.placements import format_placements

    plan = job["plan"]
    mesh = init_device_mesh("cpu", plan.mesh_shape, mesh_dim_names=plan.mesh_names)
    timings: dict[str, float] = {}
    ops = {resolve_target(n.target) for n in job["nodes"] if n.kind == "call_function"}
    with cpu_kernels(op for op in ops if op is not None):
        if not job.get("interpret", True):
            result = {"rank": rank}
            _applied_and_timed(rank, job, mesh, result, timings)
            result["seconds"] = timings
            return result
        start = time.perf_counter()
        model = build_real_model(job["model_cfg"], job["seed"])
        inputs = real_inputs(job["model_cfg"], job["seed"])
        params = {n: p.detach() for n, p in model.named_parameters()}
        buffers = {n: b.detach() for n, b in model.named_buffers()}
        timings["build"] = time.perf_counter() - start
        start = time.perf_counter()
        with torch.no_grad(), CollectiveCounter(mesh) as counter:
            step = run_step(job["nodes"], plan, mesh, params=params, buffers=buffers,
                            inputs=inputs, compute_dtype=torch.float32, counter=counter)
        timings["planned_step"] = time.perf_counter() - start
        loss = step.loss.full_tensor()
        grads = {k: (v.full_tensor(), format_placements(v.placements))
                 for k, v in sorted(step.grads.items())}
        result: dict[str, Any] = {
            "rank": rank, "collectives": step.collectives, "op_collectives": step.op_collectives,
            "nodes_checked": step.nodes_checked, "redistributions": step.redistributions,
            "peak_local_bytes": step.peak_local_bytes}
        if rank == 0:
            start = time.perf_counter()
            ref_loss, ref_grads = reference_step(model, inputs)
            timings["reference_step"] = time.perf_counter() - start
            result["loss"] = {"value": float(loss), "reference": float(ref_loss),
                              **difference(loss, ref_loss)}
            result["grads"] = {}
            for fqn, ref in ref_grads.items():
                if fqn not in grads:
                    result["grads"][fqn] = {"missing": True}
                    continue
                full, placement = grads[fqn]
                result["grads"][fqn] = {"shape": list(ref.shape), "placement": placement,
                                        **difference(full, ref)}
        _applied_and_timed(rank, job, mesh, result, timings)
    result["seconds"] = timings
    return result


def _applied_and_timed(rank: int, job: dict[str, Any], mesh: Any, result: dict[str, Any],
                       timings: dict[str, float]) -> None:
    """The applied check (unless ``job["applied"]`` is false) and the timed steps, into
    ``result`` and ``timings``."""
    if job.get("applied", True):
        start = time.perf_counter()
        result["applied"] = _applied(rank, job, mesh)
        timings["applied_step"] = time.perf_counter() - start
    _timed(rank, job, mesh, result, timings)
