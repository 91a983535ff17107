"""The applied path of verify: the real module parallelized with
:func:`pipeline.apply.parallelize` and trained one step, as a user's script does.

On every rank (:func:`applied_rank`): the model is built with the seeded weights,
``parallelize(model, plan, mesh)`` applies the plan (float32 mixed precision, so the
comparison measures sharding, not rounding), and the module's own forward, loss and
``backward()`` run on the seeded batch, each rank computing its shard of it (the inputs
are split into their planned placements). Checked beside the unsharded step of rank 0:

* every parameter's local tensor against the plan: its local shape equals the planned
  one, and its values are the shard ``distribute_tensor(full, mesh, planned placements)``
  gives this rank (``same_shard``; false for a layout with the same local shape but
  another order of shards, such as FSDP2's strided shard under tensor parallelism);
* the loss (the DTensor loss, replicated) and every gradient (``full_tensor()``), relative
  difference at most 1e-5;
* the collectives counted per ``kind(mesh dims)`` during forward and backward
  (:class:`pipeline.apply.CollectiveCounter`; a flattened FSDP2 group is ``dp+tp``),
  beside the plan's as FSDP2 buckets them (:func:`applied_planned`);
* each rank's parameter bytes (local shards) beside the plan's.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Collection, Mapping, Sequence
from typing import Any

__all__ = ["EMBEDDING_REASON", "HSDP_REASON", "LOSS_REASON", "applied_planned", "applied_rank",
           "dtensor_collectives", "edge_parameter", "embedding_backward_entry",
           "hsdp_gradient_entry", "loss_region",
           "pair_gradient_reductions", "unplanned_collectives"]


def applied_rank(rank: int, job: dict[str, Any], mesh: Any) -> dict[str, Any]:
    """Parallelize the real model on this rank and run one step (module docstring)."""
    import torch
    from torch.distributed.tensor import DTensor, distribute_tensor

    from pipeline.apply import CollectiveCounter
    from pipeline.apply.parallelize import parallelize
    from pipeline.core.dtypes import itemsize
    from pipeline.dtensor.placements import format_placements, local_shape
    from pipeline.verify.compare import difference, reference_step
    from pipeline.verify.models import build_real_model, real_inputs

    plan = job["plan"]
    model = build_real_model(job["model_cfg"], job["seed"])
    inputs = real_inputs(job["model_cfg"], job["seed"])
    full = {n: p.detach().clone() for n, p in model.named_parameters()}
    report = parallelize(model, plan, mesh, nodes=job["nodes"], param_dtype="float32",
                         reduce_dtype="float32",
                         activation_checkpointing=job.get("activation_checkpointing", "none"))
    named = dict(model.named_parameters())
    placements: dict[str, Any] = {}
    local_bytes = predicted = 0
    for t in plan.parameters:
        p = named[t.name]
        planned = plan.placements(t.placement)
        want = distribute_tensor(full[t.name], mesh, planned, src_data_rank=None).to_local()
        local = p.to_local() if isinstance(p, DTensor) else p
        dims = p.device_mesh.mesh_dim_names if isinstance(p, DTensor) else ()
        placements[t.name] = {
            "planned": t.placement,
            "applied": (format_placements(tuple(p.placements)) + " on " + ",".join(dims or ()))
            if isinstance(p, DTensor) else "plain tensor",
            "local_shape": list(local.shape), "planned_local_shape": list(want.shape),
            "same_shard": bool(local.shape == want.shape and torch.equal(local.detach(), want))}
        local_bytes += local.numel() * local.element_size()
        predicted += math.prod(local_shape(t.shape, planned, plan.mesh_shape)) * itemsize(t.dtype)
    with CollectiveCounter(mesh) as counter:
        loss = model(*inputs)
        loss.backward()
    counted = dict(sorted(counter.counts.items()))
    counted_loss = dict(sorted(counter.root_counts.items()))
    by_module = {m: {ph: dict(sorted(c.items())) for ph, c in sorted(v.items())}
                 for m, v in sorted(counter.module_counts.items())}
    value = loss.full_tensor() if isinstance(loss, DTensor) else loss
    grads = {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad)
             for n, p in model.named_parameters() if p.grad is not None}
    out: dict[str, Any] = {
        "collectives": counted, "loss_collectives": counted_loss,
        "module_collectives": by_module, "placements": placements,
        "parameter_bytes": int(local_bytes), "predicted_parameter_bytes": int(predicted),
        "report": report.to_json() if rank == 0 else None}
    if rank == 0:
        ref_model = build_real_model(job["model_cfg"], job["seed"])
        ref_loss, ref_grads = reference_step(ref_model, inputs)
        out["loss"] = {"value": float(value), "reference": float(ref_loss),
                       **difference(value.detach(), ref_loss)}
        out["grads"] = {n: ({"missing": True} if n not in grads else
                            {"shape": list(ref.shape), **difference(grads[n].detach(), ref)})
                        for n, ref in ref_grads.items()}
    del torch
    return out


def dtensor_collectives(row: Mapping[str, Any], mesh_shape: Sequence[int],
                        mesh_names: Sequence[str],
                        flattened: Collection[frozenset[str]] = ()) -> list[str]:
    """The collectives DTensor's ``redistribute`` issues for one row of
    ``redistributions.parquet``: its ``collectives`` when each runs on one mesh dim;
    else (a collective over a flattened group such as ``all_gather(dp+tp)``, priced as
    FSDP2 runs it, pipeline/costmodel/redistribute/flatten.py) the per-mesh-dim plan of
    ``src_placement -> dst_placement``, which is what runs here.

    ``flattened``: the groups of mesh dims a flattened ``DeviceMesh`` exists for (FSDP2
    makes one for the shard dims of a unit). DTensor runs consecutive steps of one
    collective over such dims as one collective over the flattened mesh, and per mesh
    dim when no such mesh exists (``_optimize_transform_infos``,
    torch/distributed/tensor/_redistribute.py: "A flattened mesh covering the relevant
    dimensions must exist"), so a row's flattened collective whose dims are one of
    ``flattened`` stays one collective."""
    names = list(row["collectives"] or ())
    if not any("+" in n and _dims(n) not in flattened for n in names):
        return names
    from pipeline.core.dtypes import itemsize
    from pipeline.costmodel.hardware import HardwareConfig
    from pipeline.costmodel.redistribute import redistribute_steps
    from pipeline.dtensor.placements import parse_placements

    ndim = len(mesh_shape)
    steps = redistribute_steps(row["shape"], itemsize(row["dtype"]),
                               parse_placements(row["src_placement"], ndim),
                               parse_placements(row["dst_placement"], ndim),
                               tuple(mesh_shape), HardwareConfig()) or []
    return [f"{st.kind}({mesh_names[st.mesh_dim]})" for st in steps
            if st.kind in ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")]


def _dims(name: str) -> frozenset[str]:
    """``"all_gather(dp+tp)"`` -> ``{"dp", "tp"}``."""
    return frozenset(name[name.index("(") + 1:-1].split("+"))


def edge_parameter(row: Mapping[str, Any], nodes: Sequence[Any], plan: Any
                   ) -> tuple[str | None, str]:
    """(the parameter an edge of ``redistributions.parquet`` carries, ``weight`` or
    ``grad``), or (None, ``activation``): a weight edge leaves the parameter's
    placeholder or a forward op computed from it alone (its cast, its transpose); a
    gradient edge flows, through single-use ops (the cast to the reduce dtype), only into
    the parameter's gradient sink."""
    by_name = {n.name: n for n in nodes}
    by_idx = {n.idx: n for n in nodes}
    users: dict[int, list[Any]] = collections.defaultdict(list)
    for n in nodes:
        for r in set(n.refs):
            users[r].append(n)
    node = by_name.get(str(row["producer_name"]))
    while node is not None and node.kind != "placeholder" and len(set(node.refs)) == 1 \
            and node.phase == "fwd":
        node = by_idx[node.refs[0]]
    if node is not None and node.kind == "placeholder" and node.role == "param":
        return node.fqn, "weight"
    consumer = str(row["consumer_name"])
    if consumer.startswith("output:grad:"):
        return consumer[len("output:grad:"):], "grad"
    node = by_name.get(consumer)
    sinks = {int(o["index"]): o for o in plan.outputs}
    while node is not None:
        nxt = users.get(node.idx, [])
        if len(nxt) != 1:
            return None, "activation"
        if nxt[0].kind == "output":
            flat = nxt[0].args[0] if nxt[0].args else []
            for k, ref in enumerate(flat):
                if isinstance(ref, dict) and ref.get("node") == node.idx and k in sinks \
                        and sinks[k]["kind"] == "grad":
                    return str(sinks[k]["grad_of"]), "grad"
            return None, "activation"
        node = nxt[0]
    return None, "activation"


def loss_region(nodes: Sequence[Any]) -> set[str]:
    """The traced nodes of the loss: the ops the root module runs itself (``module_path``
    empty) after the last forward op of a submodule (the logits' cast and view,
    ``log_softmax``, ``nll_loss_forward``, the labels' view), and the root's backward
    ops before the first backward op of a submodule (``nll_loss_backward``,
    ``_log_softmax_backward_data``). Root ops elsewhere are not the loss: the embedding
    output's cast, the gradient sums of the residual stream between layers.

    The applied side (:class:`pipeline.apply.CollectiveCounter` ``root_counts``) counts
    every root op's collectives; in these models the root's other ops issue none, and
    one that did would be left in ``unexplained``, not hidden."""
    calls = [n for n in sorted(nodes, key=lambda n: n.idx) if n.kind == "call_function"]
    fwd = [n for n in calls if n.phase == "fwd"]
    bwd = [n for n in calls if n.phase == "bwd"]
    last_sub = max((k for k, n in enumerate(fwd) if n.module_path), default=-1)
    out = {n.name for n in fwd[last_sub + 1:] if not n.module_path}
    for n in bwd:
        if n.module_path:
            break
        out.add(n.name)
    return out


def applied_planned(rows: Sequence[Mapping[str, Any]], nodes: Sequence[Any], plan: Any,
                    units: Mapping[str, str | None],
                    data_dims: Mapping[str, Sequence[str]] | None = None,
                    flattened: Collection[frozenset[str]] = ()
                    ) -> tuple[dict[str, int], dict[str, int], dict[str, int],
                               dict[str, dict[str, int]]]:
    """The plan's collectives as the applied step issues them: (parameter collectives,
    activation collectives, loss collectives), each ``{kind(mesh dims): count}``, and
    the gradient buckets per unit (``{unit: {kind(mesh dims): count}}``, a part of the
    parameter collectives); the loss's are the edges into :func:`loss_region` and into
    the loss output.

    A weight or gradient edge of a parameter FSDP2 manages (``units``: ``{fqn: unit}``)
    is one member of its unit's bucket: FSDP2 issues one collective per (unit, kind,
    weight or gradient, phase) (``foreach_all_gather`` of the unit's parameters before
    its forward, and again before its backward; one ``foreach_reduce`` of its
    gradients). A weight edge is gathered in the phase of its consumer, and once more
    before the backward when the plan re-gathers it (``times`` 2: a forward weight copy
    the backward reads); a weight the backward reads through its own edge (a backward
    consumer of the cast weight, as in a bf16 trace) is that backward gather.

    Only a collective over the parameter's FSDP2 dims (``data_dims``: ``{fqn: shard and
    replicate dims}``; all of them when not given) is bucketed: FSDP2 reduces a
    gradient on its other mesh dims (a tensor-parallel dim where the gradient is a
    partial sum) per parameter, by ``grad.redistribute`` to the parameter's placements
    there before its own reduce-scatter (``FSDPParam._get_grad_inner_tensor``,
    torch/distributed/fsdp/_fully_shard/_fsdp_param.py: "Only redistribute non-DP
    dims; keep Partial on DP dims"), so such a collective counts once per row, as every
    other edge's does.

    Every edge FSDP2 does not run is DTensor's ``redistribute``: its collectives are
    :func:`dtensor_collectives` of the row, one over a flattened group only where
    ``flattened`` (the groups of mesh dims FSDP2 flattened into one mesh: a unit's
    shard dims, its replicate dims) has that group; a weight's edge as many times as
    the plan runs it (``times`` 2: DTensor saves the stored weight for the backward op
    and redistributes it again there).

    A gradient DTensor reduces (its parameter in no FSDP2 unit, or the collective on a
    mesh dim outside the unit's) by a ``reduce_scatter(d)`` followed by an
    ``all_gather(d)`` of the same gradient on the same mesh dims (a ``P -> S(0)`` edge,
    then, often after the cast to the reduce dtype, ``S(0) -> R``) counts as one
    ``all_reduce(d)``: that pair is the ring all-reduce, reduce-scatter then all-gather
    of one buffer (Patarasuk & Yuan 2009; the nccl-tests bus bandwidth factor ``2(n-1)/n``
    = the two passes' ``(n-1)/n`` each), and the cost model prices it so exactly
    (pipeline/costmodel/comm.py: ``all_reduce == reduce_scatter + all_gather``, latency
    and volume), while DTensor reduces a ``Partial`` gradient to its ``Replicate``
    parameter with one ``all_reduce`` (``Partial._reduce_value``,
    torch/distributed/tensor/placement_types.py; the redistribution of the gradient to
    the parameter's placement, :func:`pipeline.apply.parallelize`). The plan's pair moves
    the reduce-scatter in the gradient's compute dtype and the all-gather in the reduce
    dtype; the counts are the same collective, the bytes equal where the two dtypes are
    (verify runs float32). See :func:`pair_gradient_reductions`."""
    phase = {n.name: n.phase for n in nodes}
    region = loss_region(nodes)
    buckets: set[tuple[str, str, str, str]] = set()
    params: collections.Counter[str] = collections.Counter()
    activations: collections.Counter[str] = collections.Counter()
    loss: collections.Counter[str] = collections.Counter()
    index = {n.name: n.idx for n in nodes}
    dtensor_grads: dict[str, list[tuple[int, str]]] = collections.defaultdict(list)
    for row in rows:
        names = list(row["collectives"] or ())
        if not names:
            continue
        fqn, kind = edge_parameter(row, nodes, plan)
        unit = units.get(fqn) if fqn is not None else None
        consumer = str(row["consumer_name"])
        if unit is None:  # DTensor's redistribute runs it, not FSDP2
            names = dtensor_collectives(row, plan.mesh_shape, plan.mesh_names, flattened)
        if unit is None and (consumer in region or (
                consumer.startswith("output:") and not consumer.startswith("output:grad:"))):
            loss.update(names)
            continue
        when = {"bwd" if consumer.startswith("output:") else phase.get(consumer, "fwd")}
        if kind == "weight" and int(row.get("times") or 1) > 1:
            when.add("bwd")
        for name in names:
            if unit is not None and (data_dims is None or _dims(name) <= set(data_dims[fqn])):
                buckets.update((unit, name, kind, w) for w in when)
            elif kind == "grad" and fqn is not None:  # paired below
                dtensor_grads[fqn].append((index.get(str(row["producer_name"]), -1), name))
            else:  # a weight DTensor redistributes again for its backward: ``times``
                activations[name] += int(row.get("times") or 1) if kind == "weight" else 1
    for fqn in sorted(dtensor_grads):
        activations.update(pair_gradient_reductions(dtensor_grads[fqn]))
    grads: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for unit, name, kind, _ in buckets:
        params[name] += 1
        if kind == "grad":
            grads[unit][name] += 1
    return (dict(sorted(params.items())), dict(sorted(activations.items())),
            dict(sorted(loss.items())), {u: dict(sorted(c.items())) for u, c in grads.items()})


def pair_gradient_reductions(steps: Sequence[tuple[int, str]]) -> list[str]:
    """One gradient's collectives as DTensor issues them: ``steps`` are ``(producer
    node index, kind(mesh dims))`` of the plan's edges of that gradient; each
    ``reduce_scatter(d)`` followed (a later producer) by an ``all_gather(d)`` on the same
    dims ``d`` is one ``all_reduce(d)`` (the ring all-reduce is that pair:
    :func:`applied_planned`); every other collective is itself. Deterministic: the
    steps in producer order, each all-gather paired with the earliest unpaired
    reduce-scatter before it."""
    out: list[str] = []
    open_rs: dict[str, list[int]] = collections.defaultdict(list)
    ordered = sorted(enumerate(steps), key=lambda e: (e[1][0], e[0]))
    for _, (_producer, name) in ordered:
        dims = name[name.index("("):]
        if name.startswith("reduce_scatter("):
            open_rs[dims].append(len(out))
            out.append(name)
        elif name.startswith("all_gather(") and open_rs[dims]:
            out[open_rs[dims].pop(0)] = "all_reduce" + dims
        else:
            out.append(name)
    return out


#: Why an embedding's backward collectives differ (the ``embedding_backward`` entry).
EMBEDDING_REASON = (
    "DTensor runs the embedding's backward by its own rules, not the plan's: "
    "embedding_dense_backward on batch-sharded output gradient and indices gives a "
    "Partial weight gradient, reduced to the parameter's placement (an all-reduce "
    "where it is replicated; torch/distributed/tensor/_ops/_embedding_ops.py, "
    "embedding_dense_backward_strategy), where the plan gathers the output gradient "
    "and the indices and computes the gradient replicated; and the backward of the "
    "output's redistribution from the masked partial (a row-wise, vocabulary-sharded "
    "table) all-gathers the output gradient (Redistribute.backward turns a Partial "
    "source into Replicate, torch/distributed/tensor/_redistribute.py), where the "
    "plan keeps it sharded and reduce-scatters the weight gradient")


def embedding_backward_entry(rows: Sequence[Mapping[str, Any]], nodes: Sequence[Any],
                             plan: Any, units: Mapping[str, str | None],
                             data_dims: Mapping[str, Sequence[str]],
                             flattened: Collection[frozenset[str]],
                             module_counts: Mapping[str, Mapping[str, Mapping[str, int]]]
                             ) -> tuple[dict[str, int], dict[str, int]]:
    """(what the applied step issues, what the plan lists) for the backward of each
    embedding (a module whose traced backward runs ``embedding_dense_backward``):
    counted, the DTensor collectives the module's backward issues
    (:class:`pipeline.apply.CollectiveCounter` ``module_counts``: the backward op, the
    gradient's redistribution to the parameter's placement, the backward of its output
    hook's redistribution); planned, the plan's collectives on the edges into
    ``embedding_dense_backward`` and from it to the gradient, those DTensor runs (an
    FSDP2 unit's gradient collective over its data dims is the unit's bucket, counted
    so on both sides, :func:`applied_planned`). :data:`EMBEDDING_REASON` says why they
    differ. A collective either side attributes wrongly stays visible: the entry's
    difference is taken out of the total one, and what it does not match is left in
    ``unexplained``."""
    embeds = {n.name: str(n.module_path) for n in nodes
              if n.kind == "call_function" and n.phase == "bwd"
              and str(n.target).startswith("aten.embedding_dense_backward")}
    counted: collections.Counter[str] = collections.Counter()
    planned: collections.Counter[str] = collections.Counter()
    for module in sorted(set(embeds.values())):
        counted.update(module_counts.get(module, {}).get("bwd", {}))
    for row in rows:
        if not row["collectives"] or (str(row["consumer_name"]) not in embeds
                                      and str(row["producer_name"]) not in embeds):
            continue
        fqn, _ = edge_parameter(row, nodes, plan)
        unit = units.get(fqn) if fqn is not None else None
        if unit is None:
            planned.update(dtensor_collectives(row, plan.mesh_shape, plan.mesh_names,
                                               flattened))
        else:
            planned.update(n for n in row["collectives"]
                           if not _dims(n) <= set(data_dims.get(fqn or "", ())))
    return dict(sorted(counted.items())), dict(sorted(planned.items()))


#: Why the loss's collectives differ (the ``loss`` entry of ``unplanned``).
LOSS_REASON = (
    "the module computes its loss in its own forward, outside every submodule, under "
    "DTensor's sharding propagation: parallelize redistributes at module boundaries "
    "only, so the plan's loss layout (the log-probabilities and labels gathered before "
    "nll_loss, or the loss all-reduced over a flattened group) is not applied; the step "
    "issues DTensor's own (the partial loss all-reduced in forward and its total "
    "weight in backward, vocabulary-sharded logits gathered for log_softmax), which "
    "the cost model does not price")


#: Why an HSDP unit's gradient collectives differ (the ``hsdp_gradient`` entry).
HSDP_REASON = (
    "FSDP2 reduces an HSDP unit's gradients with one reduce-scatter over its shard dims "
    "and one all-reduce over its replicate dims (foreach_reduce, torch/distributed/fsdp/"
    "_fully_shard/_fsdp_collectives.py); the plan's gradient edges to the stored "
    "placement are priced as DTensor would run them over the flattened data dims, so "
    "the cost model charges other collectives than the step issues")


def hsdp_gradient_entry(units: Mapping[str, Mapping[str, Any]],
                        grad_buckets: Mapping[str, Mapping[str, int]]
                        ) -> tuple[dict[str, int], dict[str, int]]:
    """(what FSDP2 issues, what the plan lists) for the gradients of the units with both
    shard and replicate dims (``units``: the report's ``{unit: {"shard", "replicate"}}``;
    ``grad_buckets`` from :func:`applied_planned`): per such unit, one
    ``reduce_scatter(shard dims)`` and one ``all_reduce(replicate dims)`` (each group a
    flattened mesh when it has several dims) beside the unit's planned gradient
    buckets."""
    counted: collections.Counter[str] = collections.Counter()
    planned: collections.Counter[str] = collections.Counter()
    for unit, info in units.items():
        if info["shard"] and info["replicate"]:
            counted[f"reduce_scatter({'+'.join(info['shard'])})"] += 1
            counted[f"all_reduce({'+'.join(info['replicate'])})"] += 1
            planned.update(grad_buckets.get(unit, {}))
    return dict(sorted(counted.items())), dict(sorted(planned.items()))


def unplanned_collectives(counted: Mapping[str, int], planned: Mapping[str, int],
                          causes: Sequence[tuple[str, Mapping[str, int], Mapping[str, int],
                                                 str]]
                          ) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """(the named differences between the applied step's collectives and the plan's,
    what is left unexplained).

    ``causes``: ``(cause, counted, planned, reason)``, the collectives the applied step
    issues for one cause beside those the plan lists for it; an entry
    ``{"cause", "counted", "planned", "reason"}`` for each that differs. The causes
    today: ``loss`` (:data:`LOSS_REASON`: the collectives the root module's own ops
    issue, :class:`pipeline.apply.CollectiveCounter` ``root_counts``, beside the
    plan's edges into the loss, :func:`loss_region`), ``hsdp_gradient``
    (:data:`HSDP_REASON`, :func:`hsdp_gradient_entry`) and ``embedding_backward``
    (:data:`EMBEDDING_REASON`, :func:`embedding_backward_entry`). The rest is ``counted -
    planned`` less every entry's ``counted - planned``, per ``kind(mesh dims)``, zeros
    left out: empty when every difference is named."""
    entries = [{"cause": cause, "counted": dict(sorted(c.items())),
                "planned": dict(sorted(p.items())), "reason": reason}
               for cause, c, p, reason in causes if dict(c) != dict(p)]
    rest: collections.Counter[str] = collections.Counter()
    rest.update(counted)
    rest.subtract(planned)
    for e in entries:
        rest.subtract(e["counted"])
        rest.update(e["planned"])
    return entries, {k: v for k, v in sorted(rest.items()) if v}
