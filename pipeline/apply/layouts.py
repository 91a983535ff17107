"""Activation layouts of a plan at module boundaries, for :func:`pipeline.apply.parallelize`:
the placement each model input is used in (:func:`input_uses`), the layouts a module's
first ops take and its first consumer outside takes (:func:`module_layouts`), hooks that
redistribute a module's inputs and output to them (:func:`layout_hooks`, the
``PrepareModuleInput`` / ``PrepareModuleOutput`` of a tensor-parallel plan), and a
parameter redistributed to the placement it is used in while its module runs
(:func:`gather_for_use`).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from pipeline.plan.format import Plan

__all__ = ["gather_for_use", "input_uses", "layout_hooks", "module_layouts"]


def input_uses(plan: Plan, nodes: Sequence[Any]) -> list[tuple[Any, ...]]:
    """The placement each model input is *used* in: the one its first forward consumer
    expects (a local slice of the stored placement when they differ, as the traced step
    does), else its stored placement."""
    by_name = {n.name: n for n in nodes}
    pnode = {n.name: n for n in plan.nodes}
    out = []
    for t in plan.inputs:
        ph = by_name.get(t.node)
        users = sorted((n for n in nodes if ph is not None and ph.idx in n.refs
                        and n.kind != "output" and n.phase == "fwd"), key=lambda n: n.idx)
        text = t.placement
        if users and users[0].name in pnode:
            want = pnode[users[0].name].inputs[users[0].refs.index(ph.idx)]
            text = want if "P" not in want else text
        out.append(plan.placements(text))
    return out


def module_layouts(plan: Plan, nodes: Sequence[Any], module: str
                   ) -> tuple[list[tuple[Any, ...]], tuple[Any, ...] | None]:
    """The activation layouts the plan gives a module's forward: the placement its first
    op expects for each activation coming from outside (in order of first use: the
    module's tensor inputs), and the placement the first op outside expects for its
    output (None when nothing outside reads it)."""
    pnode = {n.name: n for n in plan.nodes}
    by_idx = {n.idx: n for n in nodes}

    def inside(n: Any) -> bool:
        path = n.module_path or ""
        return n.phase == "fwd" and n.kind == "call_function" and (
            path == module or (module != "" and path.startswith(module + ".")))

    mine = [n for n in nodes if inside(n)]
    ids = {n.idx for n in mine}
    inputs: list[tuple[Any, ...]] = []
    seen: set[int] = set()
    for n in mine:
        for k, r in enumerate(n.refs):
            src = by_idx[r]
            if r in ids or r in seen or (src.kind == "placeholder" and src.role != "input"):
                continue
            if src.kind == "call_function" and src.target in _PASS_THROUGH and all(
                    by_idx[q].kind == "placeholder" and by_idx[q].role != "input"
                    for q in src.refs):
                continue  # a cast of a parameter: not an activation
            seen.add(r)
            inputs.append(plan.placements(pnode[n.name].inputs[k]))
    output = None
    for n in sorted(nodes, key=lambda n: n.idx):
        if n.phase != "fwd" or n.kind != "call_function" or n.idx in ids:
            continue
        hits = [k for k, r in enumerate(n.refs) if r in ids]
        if hits:
            output = plan.placements(pnode[n.name].inputs[hits[-1]])
            break
    return inputs, output


#: Ops between a parameter and the op using it (casts, detach).
_PASS_THROUGH = frozenset({"aten._to_copy.default", "aten.detach.default", "aten.t.default"})


def layout_hooks(module: Any, mesh: Any, inputs: Sequence[tuple[Any, ...]],
                  output: tuple[Any, ...] | None) -> None:
    """Redistribute a module's DTensor inputs and output to the plan's layouts
    (``distribute_module``'s ``input_fn`` / ``output_fn``; its parameters are DTensors
    already)."""
    from torch.distributed.tensor import DTensor, distribute_module

    def target(placements: tuple[Any, ...] | None) -> tuple[Any, ...] | None:
        # a pending sum (Partial, the embedding's masked partial) is what an op makes,
        # not a layout to redistribute to: left to the op
        if placements is None or any(p.is_partial() for p in placements):
            return None
        return placements

    def input_fn(mod: Any, args: Any, device_mesh: Any) -> Any:
        out, k = [], 0
        for a in args:
            if isinstance(a, DTensor) and k < len(inputs):
                want = target(inputs[k])
                if want is not None and tuple(a.placements) != tuple(want):
                    a = a.redistribute(device_mesh, want)
                k += 1
            out.append(a)
        return tuple(out)

    def output_fn(mod: Any, out: Any, device_mesh: Any) -> Any:
        want = target(output)
        if want is not None and isinstance(out, DTensor) and tuple(out.placements) != \
                tuple(want):
            return out.redistribute(device_mesh, want)
        return out

    distribute_module(module, mesh, input_fn=input_fn, output_fn=output_fn)


def gather_for_use(module: Any, leaf: str, param: Any, mesh: Any,
                   placements: tuple[Any, ...]) -> None:
    """Run ``module``'s forward with parameter ``leaf`` redistributed to the placement
    the plan uses it in (a fallback parameter stored on one layout and gathered to
    another before use, as the traced step does); the redistribution's backward brings
    its gradient back to the stored placement. Leaving the choice to DTensor instead can
    pick a layout whose pending masked sum does not survive (the row-wise embedding's
    ``_MaskPartial`` whose mask, made on the tokens before another mesh dim gathers
    them, no longer fits the output)."""
    inner = module.forward

    @functools.wraps(inner)
    def forward(*args: Any, **kwargs: Any) -> Any:
        module._parameters[leaf] = param.redistribute(mesh, placements)
        try:
            return inner(*args, **kwargs)
        finally:
            module._parameters[leaf] = param

    module.forward = forward
