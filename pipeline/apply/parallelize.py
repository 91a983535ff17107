"""Applying a plan to the user's real module: :func:`parallelize`.

The plan's parameter placements are read per parameter and mesh dim
(:func:`pipeline.apply.styles.parameter_readings`: stored ``S(k)`` and gathered before
use is FSDP; stored and used ``R`` is replicated; stored and used ``S(d)`` of a matmul
weight or embedding table is column- / row-wise tensor parallel; anything else has no
standard style) and applied in place with torch's public APIs, on the **full** device
mesh (torch 2.13's SPMD form of FSDP2, ``fully_shard(module, mesh=mesh,
dp_mesh_dims=DataParallelMeshDims(shard=..., replicate=...))``):

1. **Names.** Every parameter and buffer of the plan must be one of the module's, with
   the same shape, and the reverse; the first name that does not match is refused in
   one line (:class:`pipeline.core.errors.PlanError`).
2. **Placements.** Each parameter (tied names once: every name keeps sharing the one
   tensor) becomes a DTensor on the full mesh with ``distribute_tensor`` (a local split:
   every rank holds the same full value): ``Replicate`` on the mesh dims FSDP2 will
   manage, the plan's stored placement on every other dim (tensor parallel: the weight
   of a ``ColwiseParallel`` layer ``Shard(0)``, of a ``RowwiseParallel`` one ``Shard(1)``,
   embedding tables the reverse; a layer that behaves like ``nn.Linear`` without being
   one, such as the built-in model's ``CastLinear``, is placed the same way). Buffers get
   their planned placements too.
3. **FSDP2** (``fully_shard``) on the data dims of each parameter: the mesh dims it is
   stored ``S(k)`` on and gathered before use are FSDP2's *shard* dims (several of them
   flattened into one dim by FSDP2 itself, as torchtitan's ``dp_shard_cp``: one
   collective over the flattened group, the parameter ``Shard(k)`` of the flattened dim;
   never HSDP for a parameter the plan shards over both dims); the *replicate* dims are
   the data dims (no tensor-parallel reading on them) where it is stored and used ``R``:
   HSDP only when a replicated data dim leads, DDP when nothing is sharded. Units are
   torchtitan's (every element of an ``nn.ModuleList``, every other module owning
   parameters; tied parameters belong to the root), each with the mixed-precision policy
   ``MixedPrecisionPolicy(param_dtype, reduce_dtype)`` of the model config and the
   plan's ``reshard_after_forward``. The step computes the loss over the whole batch as
   DTensor does (the loss is the global mean), so a unit sums the ranks' gradients
   (divide factor 1) instead of FSDP2's default average, after a hook on each
   unsharded parameter divides a gradient DTensor computed ``Replicate`` on one of the
   unit's dims (the same on every rank there) by that dim's size; a ``Partial`` one is
   a partial sum already; one computed ``Shard`` on a unit dim (a context-parallel dim)
   is gathered there first (FSDP2 reduce-scatters the local tensor as it is). A unit
   whose backward reads none of its weights (an embedding table; the traced graph says
   which: :func:`pipeline.apply.styles.backward_reads`) is not re-gathered before its
   backward (``set_unshard_in_backward(False)``), as the plan prices it; a unit
   recomputed by activation checkpointing always is.
4. **The rest** (a parameter whose placement is no FSDP and no tensor-parallel style:
   stored on one layout, used on another that is not its gather; one with no data dim
   at all) is placed by ``distribute_tensor`` with the plan's stored placement,
   redistributed to the placement the plan uses it in each time its module runs (the
   redistribution's backward returns the gradient), its module's inputs and output
   redistributed to the plan's layouts (``distribute_module`` hooks), and a gradient
   hook redistributes its gradient back to the stored placement; every such parameter
   is listed in the report's ``fallback`` with the reason, never dropped.
5. **Module layouts.** A module owning a tensor-parallel parameter gets the plan's
   activation layouts at its boundaries (``PrepareModuleInput`` / ``PrepareModuleOutput``
   semantics, the same hooks): its inputs redistributed to the layouts its first ops
   take, its output to the layout its first consumer outside takes (Megatron-SP: the
   row-wise embedding's masked partial reduce-scattered to ``Shard(1)`` once, at its
   output, as ``RowwiseParallel(output_layouts=Shard(1))``; DTensor's ``_MaskPartial``
   releases its mask at its first reduction, so a second reader failed). A ``Partial``
   target is left to the op that makes it. Listed in the report's ``layouts``.
6. **Activations.** The model's positional inputs become DTensors in the plan's input
   placements (full tensors split locally), DTensor's implicit replication is turned on
   for the process at the first forward (a plain tensor the module creates, such as
   GPT-2's position ids, is taken as replicated, in forward and in the backward the
   caller runs), and a DTensor loss is redistributed to ``Replicate`` as the plan's
   loss.
7. **Activation checkpointing** per the run's ``memory.activation_checkpointing``:
   ``full`` recomputes every ``nn.ModuleList`` element in backward
   (``torch.utils.checkpoint``, non-reentrant), ``selective`` saves the outputs of
   matmuls and attention and recomputes the rest
   (``create_selective_checkpoint_contexts``), ``none`` nothing.

The module must be the traced one: the same parameter and buffer names, shapes and
dtypes (the plan's model hash), its ``forward(*inputs)`` returning the loss of the
traced step (the built-in LLaMA does; an ``hf`` model through its family's step).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
from collections.abc import Mapping, Sequence
from typing import Any

from pipeline.apply.layouts import gather_for_use, input_uses, layout_hooks, module_layouts
from pipeline.core.errors import PlanError
from pipeline.plan.format import Plan, check_mesh

__all__ = ["AC_MODES", "ParallelizeReport", "check_names", "fsdp_unit", "input_uses",
           "parallelize"]

#: ``memory.activation_checkpointing`` values :func:`parallelize` applies.
AC_MODES: tuple[str, ...] = ("none", "full", "selective")
_TP = ("ColwiseParallel", "RowwiseParallel", "SequenceParallel")


@dataclasses.dataclass
class ParallelizeReport:
    """What :func:`parallelize` applied.

    Attributes:
        parameters: ``{fqn: {"readings": [per mesh dim], "placement": the plan's,
            "dtensor": placements before FSDP2, "shard": FSDP2 shard dims,
            "replicate": FSDP2 replicate dims, "unit": its FSDP2 unit or None,
            "style": tensor-parallel style name or None}}``.
        units: ``{unit module fqn ("" the root): {"shard": dims, "replicate": dims,
            "parameters": [fqn]}}`` in the order ``fully_shard`` was called.
        fallback: ``{fqn: reason}`` of parameters no FSDP2 / tensor-parallel style
            expresses, placed with ``distribute_tensor`` and a gradient hook.
        layouts: ``{module fqn: {"inputs": [placements], "output": placements or
            None}}`` of the tensor-parallel modules' boundary layouts.
        mixed_precision: ``{"param_dtype", "reduce_dtype"}``.
        activation_checkpointing: the mode and the modules it wraps.
    """

    parameters: dict[str, dict[str, Any]]
    units: dict[str, dict[str, Any]]
    fallback: dict[str, str]
    layouts: dict[str, dict[str, Any]]
    mixed_precision: dict[str, str]
    activation_checkpointing: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def check_names(plan: Plan, model: Any) -> None:
    """Fail in one line naming the first plan parameter or buffer that the module does
    not have (or has in another shape), or the first module parameter the plan lacks.

    Raises:
        PlanError: ``plan=<path>: parameter <fqn> ...``.
    """
    params = dict(model.named_parameters(remove_duplicate=False))
    buffers = dict(model.named_buffers(remove_duplicate=False))
    where = f"plan={plan.path}"
    for kind, entries, have in (("parameter", plan.parameters, params),
                                ("buffer", plan.buffers, buffers)):
        for t in entries:
            if t.name not in have:
                near = sorted(n for n in have if n.rsplit(".", 1)[-1] == t.name.rsplit(".", 1)[-1])
                raise PlanError(
                    f"{where}: {kind} {t.name} of the plan is not a {kind} of the model"
                    + (f" (it has {near[0]}...)" if near else "")
                    + "; the model must have the traced module names (a renamed layer?)")
            if tuple(have[t.name].shape) != tuple(t.shape):
                raise PlanError(
                    f"{where}: {kind} {t.name} has shape {list(have[t.name].shape)} in the "
                    f"model, {list(t.shape)} in the plan")
    planned = {t.name for t in plan.parameters}
    first = {}
    for name, p in params.items():
        first.setdefault(id(p), name)
    for name, p in params.items():
        if first[id(p)] == name and name not in planned:
            raise PlanError(f"{where}: parameter {name} of the model is not in the plan; the "
                            "model must have the traced module names (a renamed layer?)")


def fsdp_unit(fqn: str, tied: bool = False) -> str:
    """The FSDP2 unit of a parameter, as torchtitan wraps them: the element of an
    ``nn.ModuleList`` it lies in (``layers.3``), else the module owning it
    (``tok_embeddings``); the root (``""``) for a tied parameter."""
    if tied:
        return ""
    parts = fqn.split(".")
    for k, part in enumerate(parts[:-1]):
        if part.isdigit():
            return ".".join(parts[: k + 1])
    return ".".join(parts[:-1])


def _data_dims(readings: dict[str, list[str]], ndim: int) -> set[int]:
    """Mesh dims with no tensor-parallel or other reading on any parameter."""
    return {d for d in range(ndim)
            if all(r[d] == "replicate" or r[d].startswith("fsdp:") for r in readings.values())}


def _classify(fqn: str, readings: list[str], data: set[int], names: Sequence[str]
              ) -> tuple[tuple[str, ...], tuple[str, ...], int, str | None, str | None]:
    """(FSDP2 shard dims, replicate dims, shard tensor dim, style, fallback reason)."""
    shard = [d for d, r in enumerate(readings) if r.startswith("fsdp:")]
    dims = {int(readings[d].split(":")[1]) for d in shard}
    other = [f"{names[d]}: {r}" for d, r in enumerate(readings) if r.startswith("other")]
    styles = sorted({r for r in readings if r in _TP})
    style = ",".join(styles) or None
    if len(dims) > 1:
        return (), (), 0, style, ("FSDP2 shards one tensor dim; the plan shards dims "
                                  + ", ".join(map(str, sorted(dims))))
    if other:
        return (), (), 0, style, "; ".join(other)
    replicate = [d for d, r in enumerate(readings) if r == "replicate" and d in data]
    if shard and replicate and min(replicate) > min(shard):
        return (), (), 0, style, ("a replicated data dim after a sharded one (HSDP "
                                  "replicates on the leading dim)")
    if not shard and not replicate:
        return (), (), 0, style, "no data dim to apply FSDP2 on"
    return (tuple(names[d] for d in shard), tuple(names[d] for d in replicate),
            dims.pop() if dims else 0, style, None)


def parallelize(model: Any, plan: Plan, mesh: Any, *, nodes: Sequence[Any] | None = None,
                param_dtype: str | None = None, reduce_dtype: str | None = None,
                activation_checkpointing: str = "none",
                reshard_after_forward: bool = True) -> ParallelizeReport:
    """Apply ``plan`` to ``model`` in place (see the module docstring); returns the
    report of what was applied.

    Args:
        model: the traced module on the CPU/accelerator of ``mesh``, with its weights
            (the same on every rank).
        plan: a loaded plan; ``mesh`` a ``DeviceMesh`` of its shape and names.
        nodes: the decoded graph IR of the plan's trace (default: the run's).
        param_dtype, reduce_dtype: FSDP2's mixed precision (default: the plan's
            ``model.param_dtype`` / ``model.reduce_dtype``).
        activation_checkpointing: ``none``, ``full`` or ``selective``.
        reshard_after_forward: FSDP2's (the run's ``fsdp.reshard_after_forward``).

    Raises:
        PlanError: another mesh, a module name or shape the plan does not have, an
            unknown activation checkpointing mode.
    """
    import torch
    from torch.distributed.fsdp import DataParallelMeshDims, MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    from pipeline.apply.styles import backward_reads, parameter_readings, parameter_uses
    from pipeline.core.ir import load_nodes

    if activation_checkpointing not in AC_MODES:
        raise PlanError(f"activation_checkpointing={activation_checkpointing!r}: allowed "
                        + ", ".join(AC_MODES))
    check_mesh(plan, mesh)
    check_names(plan, model)
    if nodes is None:
        from pipeline.apply.step import run_graph

        nodes = load_nodes(run_graph(plan))
    names = plan.mesh_names
    readings = parameter_readings(plan, nodes)
    data = _data_dims(readings, len(names))
    uses = input_uses(plan, nodes)
    config = plan.model_config or {}
    mp = MixedPrecisionPolicy(
        param_dtype=getattr(torch, param_dtype or config.get("param_dtype", "float32")),
        reduce_dtype=getattr(torch, reduce_dtype or config.get("reduce_dtype", "float32")))

    occurrences: dict[int, list[tuple[Any, str]]] = collections.defaultdict(list)
    for full_name, p in model.named_parameters(remove_duplicate=False):
        owner, _, leaf = full_name.rpartition(".")
        occurrences[id(p)].append((model.get_submodule(owner), leaf))
    current = dict(model.named_parameters())
    params: dict[str, dict[str, Any]] = {}
    fallback: dict[str, str] = {}
    # the meshes FSDP2 flattened a unit's shard dims into, {dims: mesh}, filled as units are
    # made (the mesh of its sharded parameters; torch asks to keep them, not to slice the
    # flattened dim from the root mesh)
    flat_meshes: dict[tuple[str, ...], Any] = {}
    new: dict[str, Any] = {}
    owners: dict[str, list[tuple[Any, str]]] = {}
    for t in plan.parameters:
        shard, replicate, tdim, style, why = _classify(t.name, readings[t.name], data, names)
        stored = plan.placements(t.placement)
        fsdp_dims = set(shard) | set(replicate)
        placements = tuple(Replicate() if names[d] in fsdp_dims else stored[d]
                           for d in range(len(names)))
        old = current[t.name]
        tied = len(occurrences[id(old)]) > 1
        dt = distribute_tensor(old.detach(), mesh, placements, src_data_rank=None)
        param = torch.nn.Parameter(dt, requires_grad=old.requires_grad)
        owners[t.name] = occurrences[id(old)]
        for owner, leaf in owners[t.name]:
            owner.register_parameter(leaf, param)
        new[t.name] = param
        if why is not None:
            fallback[t.name] = why
            param.register_hook(functools.partial(_to_placements, param, flat_meshes))
        params[t.name] = {
            "readings": list(readings[t.name]), "placement": t.placement,
            "dtensor": _text(placements), "shard": list(shard), "replicate": list(replicate),
            "shard_tensor_dim": tdim, "unit": None if why else fsdp_unit(t.name, tied),
            "style": style}
    buffer_place = {b.name: b.placement for b in plan.buffers}
    for full_name, b in list(model.named_buffers()):
        owner_name, _, leaf = full_name.rpartition(".")
        owner = model.get_submodule(owner_name)
        text = buffer_place.get(full_name)
        placements = plan.placements(text) if text else (Replicate(),) * len(names)
        persistent = leaf not in owner._non_persistent_buffers_set
        owner.register_buffer(leaf, distribute_tensor(b, mesh, placements, src_data_rank=None),
                              persistent=persistent)

    ac = _checkpoint(model, activation_checkpointing)
    units: dict[str, dict[str, Any]] = {}
    by_unit: dict[str, list[str]] = collections.defaultdict(list)
    for fqn, info in params.items():
        if info["unit"] is not None:
            by_unit[info["unit"]].append(fqn)
    managed: set[int] = set()

    def shard_fn(param: Any) -> Any:
        for fqn, p in new.items():
            if p is param:
                return Shard(params[fqn]["shard_tensor_dim"])
        return None

    def key(f: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
        return tuple(params[f]["shard"]), tuple(params[f]["replicate"])

    hooked: set[int] = set()

    def apply(module_name: str, members: list[str]) -> None:
        keys = collections.Counter(key(f) for f in members)
        (shard, replicate), _ = keys.most_common(1)[0]
        mine = [f for f in members if key(f) == (shard, replicate)]
        ignored = {p for f, p in new.items() if f not in mine and id(p) not in managed}
        module = model.get_submodule(module_name)
        dims = DataParallelMeshDims(shard=shard or None, replicate=replicate or None)
        # no shard dim (DDP): FSDP2's replicate-only mesh info refuses a placement fn
        fully_shard(module, mesh=mesh, dp_mesh_dims=dims, mp_policy=mp,
                    reshard_after_forward=reshard_after_forward,
                    shard_placement_fn=shard_fn if shard else None, ignored_params=ignored)
        # the loss is the global mean: FSDP2 sums the ranks' gradients, each made a
        # partial sum first (:func:`_partial_gradients`)
        module.set_gradient_divide_factor(1.0)
        module.register_forward_pre_hook(functools.partial(
            _partial_gradients, mesh, tuple(names.index(n) for n in shard + replicate),
            hooked))
        module.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
        managed.update(id(new[f]) for f in mine)
        units[module_name] = {"shard": list(shard), "replicate": list(replicate),
                              "parameters": mine}
        flat = "_".join(shard)
        for f in mine:  # FSDP2's sharded parameter lies on a mesh with the flattened dim
            on = getattr(model.get_parameter(f), "device_mesh", None)
            if len(shard) > 1 and on is not None and flat in (on.mesh_dim_names or ()):
                flat_meshes[tuple(shard)] = on if on.ndim == 1 else on[flat]
        for f in members:
            if f not in mine:  # another data-parallel layout in the same unit: its leaf
                leaf = f.rpartition(".")[0]
                if leaf != module_name and id(new[f]) not in managed:
                    apply(leaf, [g for g in members if g.rpartition(".")[0] == leaf])

    for unit in sorted((u for u in by_unit if u), key=_module_order(model)):
        apply(unit, by_unit[unit])
    root = by_unit.get("", [])
    rest = [f for f in params if params[f]["unit"] is not None and id(new[f]) not in managed]
    if root or units:
        apply("", root or rest or [next(f for f in params if params[f]["unit"] is not None)])
    reads = backward_reads(nodes)
    wrapped = set(ac["modules"])
    for name, unit in units.items():
        # FSDP2 re-gathers a unit before its backward; a unit whose backward reads none of
        # its weights (an embedding table) is not re-gathered, as the plan prices it
        # (``FSDPModule.set_unshard_in_backward``, torch/distributed/fsdp/_fully_shard/
        # _fully_shard.py: "all parameters in this FSDP module's parameter group are not
        # needed for backward computation (e.g. embedding)"); never one recomputed by
        # activation checkpointing, whose recomputed forward reads them
        unit["unshard_in_backward"] = bool(
            name in wrapped or any(f in reads for f in unit["parameters"])
            or any(name.startswith(w + ".") for w in wrapped))
        if not unit["unshard_in_backward"]:
            model.get_submodule(name).set_unshard_in_backward(False)
    for fqn in params:
        if params[fqn]["unit"] is not None and id(new[fqn]) not in managed:
            fallback[fqn] = "left outside every FSDP2 unit"
            params[fqn]["unit"] = None
            new[fqn].register_hook(functools.partial(_to_placements, new[fqn], flat_meshes))
    used = parameter_uses(plan, nodes)
    for fqn in fallback:
        want = plan.placements(used[fqn])
        if tuple(want) != tuple(new[fqn].placements) and not any(
                p.is_partial() for p in want):
            for owner, leaf in owners[fqn]:
                gather_for_use(owner, leaf, new[fqn], mesh, want)
            fallback[fqn] += f"; used {used[fqn]}: redistributed to it before its module runs"
    for module_name in sorted({f.rpartition(".")[0] for f in fallback}):
        layouts = module_layouts(plan, nodes, module_name)
        layout_hooks(model.get_submodule(module_name), mesh, *layouts)
        for f in fallback:
            if f.rpartition(".")[0] == module_name:
                fallback[f] += (f"; module {module_name or 'root'}: inputs to "
                                + ",".join(_text(p) for p in layouts[0])
                                + (f", output to {_text(layouts[1])}" if layouts[1] else "")
                                + " (distribute_module hooks)")
    layouts: dict[str, dict[str, Any]] = {}
    for module_name in sorted({f.rpartition(".")[0] for f, info in params.items()
                               if info["style"] and f not in fallback} - {
                                   f.rpartition(".")[0] for f in fallback},
                              key=_module_order(model)):
        ins, out = module_layouts(plan, nodes, module_name)
        layout_hooks(model.get_submodule(module_name), mesh, ins, out)
        layouts[module_name] = {"inputs": [_text(p) for p in ins],
                                "output": _text(out) if out else None}
    _wrap_forward(model, uses, mesh, DTensor)
    return ParallelizeReport(parameters=params, units=units, fallback=fallback,
                             layouts=layouts,
                             mixed_precision={"param_dtype": str(mp.param_dtype),
                                              "reduce_dtype": str(mp.reduce_dtype)},
                             activation_checkpointing=ac)


def _text(placements: Sequence[Any]) -> str:
    from pipeline.dtensor.placements import format_placements

    return format_placements(tuple(placements))


def _module_order(model: Any) -> Any:
    order = {name: k for k, (name, _) in enumerate(model.named_modules())}
    return lambda name: order.get(name, len(order))


def _partial_gradients(mesh: Any, dims: tuple[int, ...], hooked: set[int], module: Any,
                       args: Any) -> None:
    """Forward pre-hook of an FSDP2 unit (after FSDP2's own, so the unit's parameters are
    the unsharded ones, ``Replicate`` on its dims): hook each unsharded parameter once so
    that a gradient DTensor computes ``Replicate`` on one of the unit's dims (every rank
    there holds the same value) is divided by that dim's size. FSDP2 then sums the
    ranks' gradients: partial sums add up to the gradient, replicated copies to one."""
    from torch.distributed.tensor import DTensor

    if not dims:
        return
    for p in module.parameters():
        if id(p) in hooked or not isinstance(p, DTensor) or p.device_mesh != mesh \
                or not all(p.placements[d].is_replicate() for d in dims):
            continue
        hooked.add(id(p))
        p.register_hook(functools.partial(_divide_replicated, mesh, dims))


def _divide_replicated(mesh: Any, dims: tuple[int, ...], grad: Any) -> Any:
    """The gradient of an unsharded parameter as FSDP2 sums it over the unit's data
    dims ``dims``: a dim where it is ``Shard`` (torch 2.13's FSDP2 reduce-scatters the
    local tensor as it is there, and overruns its buffer with a smaller one) is gathered
    to ``Replicate`` first; then divided by the product of the sizes of the dims where it
    is ``Replicate`` (every rank there holds the whole value, which the sum would count
    that many times); a ``Partial`` dim is a partial sum already."""
    from torch.distributed.tensor import DTensor, Replicate

    if not isinstance(grad, DTensor):
        return grad
    if any(grad.placements[d].is_shard() for d in dims):
        # FSDP2 reduce-scatters the local gradient as it is on its data dims (a partial
        # sum or a replicated copy): one DTensor computed sharded there (a context-
        # parallel dim of the sequence-sharded activations) is gathered first
        grad = grad.redistribute(grad.device_mesh, tuple(
            Replicate() if d in dims and p.is_shard() else p
            for d, p in enumerate(grad.placements)))
    k = math.prod(mesh.shape[d] for d in dims if grad.placements[d].is_replicate())
    if k == 1:
        return grad
    return DTensor.from_local(grad.to_local() / k, grad.device_mesh, grad.placements,
                              run_check=False, shape=grad.shape, stride=grad.stride())


def _to_placements(param: Any, flat_meshes: Mapping[tuple[str, ...], Any], grad: Any) -> Any:
    """Gradient hook of a parameter outside FSDP2: its gradient in its own placements
    (a pending sum over the data dims becomes the all-reduce or reduce-scatter).

    A gradient ``Partial`` (sum) on several mesh dims ``D`` that the parameter stores
    ``Shard(k)`` on, each of them (``S(1)S(1)`` over ``dp, cp``, a row-sharded weight of
    a context-parallel plan), is one reduce-scatter over the flattened group of ``D``
    where FSDP2 made that group's mesh (``flat_meshes``: ``{a unit's shard dims: the
    mesh}``, flattened by FSDP2 as ``mesh[dims]._flatten("_".join(dims))``,
    torch/distributed/fsdp/_fully_shard/_fsdp_init.py), as the plan prices it
    (``reduce_scatter(dp+cp)``). DTensor's own redistribute does not merge it: it
    all-reduces over the inner dim and reduce-scatters over the outer one (the
    nested shards of one tensor dim, torch/distributed/tensor/_redistribute.py). The
    shards agree: ``Shard(k)`` over ``D`` in mesh order chunks dim ``k`` by the outer
    dim, then each chunk by the inner, which is the chunk of the flattened rank (outer
    major) when the dim divides evenly (required; otherwise DTensor's redistribute)."""
    from torch.distributed.tensor import DTensor, Partial, Shard

    if not isinstance(grad, DTensor) or tuple(grad.placements) == tuple(param.placements):
        return grad
    mesh = param.device_mesh
    names = mesh.mesh_dim_names or ()
    dims = tuple(d for d, (g, p) in enumerate(zip(grad.placements, param.placements,
                                                   strict=True)) if g != p)
    want = {param.placements[d] for d in dims}
    group = tuple(names[d] for d in dims) if names else ()
    k = next(iter(want)).dim if len(want) == 1 and isinstance(next(iter(want)), Shard) \
        else None
    if (len(dims) > 1 and group in flat_meshes and k is not None
            and all(isinstance(grad.placements[d], Partial)
                    and grad.placements[d].reduce_op == "sum" for d in dims)
            and sum(isinstance(p, Shard) and p.dim == k for p in param.placements)
            == len(dims)
            and grad.shape[k] % math.prod(mesh.shape[d] for d in dims) == 0):
        flat = flat_meshes[group]
        local = DTensor.from_local(grad.to_local(), flat, (Partial(),), run_check=False)
        shard = local.redistribute(flat, (Shard(k),)).to_local()
        return DTensor.from_local(shard, mesh, param.placements, run_check=False,
                                  shape=grad.shape, stride=grad.stride())
    return grad.redistribute(mesh, param.placements)


def _wrap_forward(model: Any, uses: Sequence[tuple[Any, ...]], mesh: Any, dtensor: type
                  ) -> None:
    """Inputs to their placements of use (:func:`input_uses`; full tensors split locally),
    the forward under implicit replication, a DTensor loss to ``Replicate``."""
    from torch.distributed.tensor import Replicate, distribute_tensor

    from pipeline.dtensor.torch_compat import allow_implicit_replication

    placements = dict(enumerate(uses))
    inner = model.forward

    @functools.wraps(inner)
    def forward(*args: Any, **kwargs: Any) -> Any:
        import torch

        args = tuple(distribute_tensor(a, mesh, placements[k], src_data_rank=None)
                     if isinstance(a, torch.Tensor) and not isinstance(a, dtensor)
                     and k in placements else a for k, a in enumerate(args))
        # plain tensors the module creates (GPT-2's position ids) are replicated, in
        # forward and in the backward the caller runs later
        allow_implicit_replication(True)
        out = inner(*args, **kwargs)
        if isinstance(out, dtensor) and out.ndim == 0:
            out = out.redistribute(mesh, (Replicate(),) * mesh.ndim)
        return out

    model.forward = forward


def _checkpoint(model: Any, mode: str) -> dict[str, Any]:
    """Activation checkpointing of every ``nn.ModuleList`` element (module docstring)."""
    import torch
    from torch.utils.checkpoint import (
        CheckpointPolicy,
        checkpoint,
        create_selective_checkpoint_contexts,
    )

    if mode == "none":
        return {"mode": mode, "modules": []}
    blocks = [name for name, m in model.named_modules()
              if isinstance(m, torch.nn.ModuleList) for name in
              [f"{name}.{k}" for k in range(len(m))]]
    aten = torch.ops.aten
    save = {aten.mm.default, aten.addmm.default, aten.bmm.default,
            aten._scaled_dot_product_flash_attention.default,
            aten._scaled_dot_product_efficient_attention.default}

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        return CheckpointPolicy.MUST_SAVE if op in save else CheckpointPolicy.PREFER_RECOMPUTE

    for name in blocks:
        block = model.get_submodule(name)
        inner = block.forward
        extra = ({"context_fn": functools.partial(create_selective_checkpoint_contexts, policy)}
                 if mode == "selective" else {})
        block.forward = functools.partial(checkpoint, inner, use_reentrant=False, **extra)
    return {"mode": mode, "modules": blocks}
