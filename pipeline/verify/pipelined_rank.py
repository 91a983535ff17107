"""What each process of a pipelined verify runs (:mod:`pipeline.verify.pipelined`): its
stages of the real model under torch.distributed.pipelining, and the unsharded step.

Processes are laid out as the mesh (``pp`` outermost, row-major): rank ``k`` is pipeline
rank ``k // d`` and data-parallel replica ``k mod d``, ``d`` the product of the other
dims. Every process builds the same seeded model (:func:`pipeline.verify.models.
build_real_model`, float32) and inputs, keeps the stages of its pipeline rank
(:func:`stage_modules`: stage ``s`` on rank ``s mod p``, torch's loop placement; the
embedding on stage 0, final norm and head on the last, whose loss is the schedule's
``loss_fn``), wraps each in ``PipelineStage`` on the ``pp`` group (:func:`counting_stage`: its
sends recorded) and runs the plan's
schedule (``ScheduleGPipe``, ``Schedule1F1B``, ``ScheduleInterleaved1F1B``) on its
replica's share of the batch, split by the schedule into the plan's microbatches.

**Loss scaling** (torch 2.13, ``torch/distributed/pipelining/schedules.py``, the
``PipelineScheduleSingle`` / ``PipelineScheduleMulti`` docstrings and
``stage.py`` ``_PipelineStageBase.scale_grads`` / ``perform_reduce_grad``): ``loss_fn``
is called once per microbatch and each microbatch's backward starts from that loss
unscaled; with ``scale_grads=True`` (the default, what a mean loss needs) the schedule
divides the accumulated gradients by the number of microbatches ``m`` after the last
backward. The mean cross-entropy of the whole batch of equal microbatches is ``(1/m)
sum_i L_i``, so its gradient is ``(1/m) sum_i grad L_i``: what the stages hold after
the step. The ``losses`` list the schedule fills holds the ``L_i`` themselves; the
step's loss is their mean.

**Data parallelism** (the other dims, ``d > 1``): the stage is replicated and the batch
split into ``d`` contiguous shards; after the step each gradient is all-reduced
(sum) over the replicas and divided by ``d`` (the global mean loss of equal shards), and
so is the loss. ``pipeline.apply.parallelize`` is not used: it applies a whole-model
plan to the whole traced module (every planned parameter must be the module's, and its
forward converts the model's inputs), while a stage module holds part of the
parameters and takes boundary activations.

Every process also runs the unsharded step (:func:`pipeline.verify.compare.
reference_step`) and compares the gradients of the parameters it holds, and the last
pipeline rank the loss, relative ``max|a - b| / max|b|``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pipeline.core.errors import PlanError
from pipeline.verify.execute import gloo_rank

__all__ = ["SCHEDULE_CLASSES", "counting_stage", "pipelined_worker", "stage_modules"]

#: The plan's schedule names and torch.distributed.pipelining's classes (torch 2.13).
SCHEDULE_CLASSES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B",
                    "interleaved_1f1b": "ScheduleInterleaved1F1B"}

def stage_modules(model: Any, stages: Sequence[dict[str, Any]], pp_rank: int,
                  degree: int) -> list[tuple[int, Any]]:
    """``[(stage index, module)]`` of the stages of pipeline rank ``pp_rank`` (stage
    ``s`` where ``s mod degree == pp_rank``), each built from ``model`` (the built-in
    LLaMA, :class:`pipeline.models.llama_decoder.Transformer`) by :func:`_stage`; its
    parameters keep the model's names."""
    n = len(stages)
    return [(int(st["stage"]), _stage(model, int(st["layers"][0]), int(st["layers"][1]),
                                      int(st["stage"]) == 0, int(st["stage"]) == n - 1))
            for st in stages if int(st["stage"]) % degree == pp_rank]


def _stage(model: Any, lo: int, hi: int, first: bool, last: bool) -> Any:
    """The stage of ``model`` holding ``layers[lo:hi]`` (and the embedding when
    ``first``; the final norm and head when ``last``): ``forward(tokens or hidden) ->
    hidden or logits``, as :class:`Transformer`'s forward runs those modules."""
    from torch import nn

    class Stage(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.compute_dtype = model.compute_dtype
            if first:
                self.tok_embeddings = model.tok_embeddings
            self.layers = nn.ModuleDict({str(i): model.layers[i] for i in range(lo, hi)})
            if last:
                self.norm, self.output = model.norm, model.output
            self.register_buffer("freqs_cos", model.freqs_cos, persistent=False)
            self.register_buffer("freqs_sin", model.freqs_sin, persistent=False)

        def forward(self, x: Any) -> Any:
            h = self.tok_embeddings(x).to(self.compute_dtype) if first else x
            for layer in self.layers.values():
                h = layer(h, self.freqs_cos, self.freqs_sin)
            return self.output(self.norm(h)) if last else h

    return Stage()


def counting_stage(*args: Any, **kwargs: Any) -> Any:
    """A ``PipelineStage(*args, **kwargs)`` that also records every send the schedule
    asks of it: ``stage.sent`` is a list of ``(kind, elements)``, ``kind``
    ``activation`` (``get_fwd_send_ops``: the forward output to the next stage) or
    ``gradient`` (``get_bwd_send_ops``: the input's gradient to the previous stage), one
    entry per tensor sent. Every torch 2.13 schedule takes its sends from these two
    methods (``schedules.py``); the stage's own sends are unchanged."""
    from torch.distributed.pipelining import PipelineStage

    class CountingStage(PipelineStage):
        def __init__(self) -> None:
            super().__init__(*args, **kwargs)
            self.sent: list[tuple[str, int]] = []

        def get_fwd_send_ops(self, fwd_chunk_id: int) -> Any:
            ops = super().get_fwd_send_ops(fwd_chunk_id)
            self.sent.extend(("activation", int(op.tensor.numel())) for op in ops)
            return ops

        def get_bwd_send_ops(self, bwd_chunk_id: int) -> Any:
            ops = super().get_bwd_send_ops(bwd_chunk_id)
            self.sent.extend(("gradient", int(op.tensor.numel())) for op in ops)
            return ops

    return CountingStage()


def _loss(logits: Any, labels: Any) -> Any:
    """The model's loss of one microbatch (mean cross-entropy over its tokens)."""
    from pipeline.models.llama_decoder import cross_entropy

    return cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def _schedule(name: str, stages: list[Any], microbatches: int) -> Any:
    import torch.distributed.pipelining as pipelining

    cls = getattr(pipelining, SCHEDULE_CLASSES[name])
    if name == "interleaved_1f1b":
        return cls(stages, n_microbatches=microbatches, loss_fn=_loss, scale_grads=True)
    return cls(stages[0], n_microbatches=microbatches, loss_fn=_loss, scale_grads=True)


def pipelined_worker(rank: int, job: dict[str, Any]) -> None:
    """One process (module docstring); writes ``rank<k>.json`` into ``job["out_dir"]``
    (:func:`pipeline.verify.execute.gloo_rank`)."""
    gloo_rank(rank, job, _run_with_kernels)


def _run_with_kernels(rank: int, job: dict[str, Any]) -> dict[str, Any]:
    from pipeline.dtensor.cpu_kernels import cpu_kernels

    with cpu_kernels():  # the fused attention op of the built-in model
        return _run(rank, job)


def _run(rank: int, job: dict[str, Any]) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from pipeline.verify.compare import difference, reference_step
    from pipeline.verify.models import build_real_model, real_inputs

    p, d, m = int(job["degree"]), int(job["replicas"]), int(job["microbatches"])
    pp_rank, replica = divmod(rank, d)
    mesh = init_device_mesh("cpu", (p, d), mesh_dim_names=("pp", "dp"))
    inputs = real_inputs(job["model_cfg"], job["seed"])
    ref_loss, ref_grads = reference_step(build_real_model(job["model_cfg"], job["seed"]),
                                         inputs)
    model = build_real_model(job["model_cfg"], job["seed"])
    mine = stage_modules(model, job["stages"], pp_rank, p)
    n_stages = len(job["stages"])
    stages = [counting_stage(mod, s, n_stages, torch.device("cpu"), group=mesh.get_group("pp"))
              for s, mod in mine]
    schedule = _schedule(job["schedule"], stages, m)
    share = int(inputs[0].shape[0]) // d
    tokens, labels = (t[replica * share:(replica + 1) * share] for t in inputs)
    indices = [s for s, _ in mine]
    first, last = 0 in indices, n_stages - 1 in indices
    losses: list[Any] = []
    schedule.step(*((tokens,) if first else ()), target=labels if last else None,
                  losses=losses)
    params = {n: prm for _, mod in mine for n, prm in mod.named_parameters()}
    missing = sorted(n for n, prm in params.items() if prm.grad is None)
    if d > 1:
        for n in sorted(params):
            if params[n].grad is not None:
                dist.all_reduce(params[n].grad, group=mesh.get_group("dp"))
                params[n].grad.div_(d)
    result: dict[str, Any] = {
        "rank": rank, "pp_rank": pp_rank, "replica": replica, "stages": indices,
        "parameters": sorted(params), "missing": missing,
        "sends": {str(s): {kind: [e for k, e in st.sent if k == kind]
                           for kind in ("activation", "gradient")}
                  for s, st in zip(indices, stages)},
        "grads": {n: {"shape": list(ref_grads[n].shape),
                      **difference(params[n].grad.detach(), ref_grads[n])}
                  for n in sorted(params) if params[n].grad is not None}}
    if last:
        if len(losses) != m:
            raise PlanError(f"{SCHEDULE_CLASSES[job['schedule']]} returned {len(losses)} "
                            f"microbatch losses; expected {m}")
        loss = torch.stack([x.detach() for x in losses]).mean()
        if d > 1:
            dist.all_reduce(loss, group=mesh.get_group("dp"))
            loss.div_(d)
        result["microbatch_losses"] = [float(x.detach()) for x in losses]
        result["loss"] = {"value": float(loss), "reference": float(ref_loss),
                          **difference(loss, ref_loss)}
    dist.barrier()
    return result
