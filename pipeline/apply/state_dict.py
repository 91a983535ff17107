"""Exporting a plan's state-dict layout: :func:`state_dict_layout` (the placement of every
state-dict entry, tied names included) and :func:`distribute_state_dict` (DTensors in
those placements, e.g. for ``torch.distributed.checkpoint.load``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from pipeline.core.errors import PlanError
from pipeline.plan.format import Plan

__all__ = ["distribute_state_dict", "state_dict_layout"]


def state_dict_layout(plan: Plan, model: Any = None) -> dict[str, tuple]:
    """``{state-dict key: DTensor placements}`` of every parameter and buffer.

    With ``model`` (an ``nn.Module``), tied names (``lm_head.weight`` when it *is*
    ``wte.weight``) get the placement of the tensor they share, and only the model's
    own state-dict keys are listed (non-persistent buffers are not state).
    """
    layout = {t.name: plan.placements(t.placement) for t in plan.parameters + plan.buffers}
    if model is None:
        return layout
    first_name: dict[int, str] = {}
    for name, t in list(model.named_parameters(remove_duplicate=False)) + list(
            model.named_buffers(remove_duplicate=False)):
        first_name.setdefault(id(t), name)
    tensors = dict(model.named_parameters(remove_duplicate=False))
    tensors.update(dict(model.named_buffers(remove_duplicate=False)))
    out = {}
    for key in model.state_dict(keep_vars=True):
        t = tensors.get(key)
        src = first_name.get(id(t), key) if t is not None else key
        if src in layout:
            out[key] = layout[src]
    return out


def distribute_state_dict(state_dict: Mapping[str, Any], mesh: Any, plan: Plan,
                          model: Any = None, src_data_rank: int | None = 0
                          ) -> dict[str, DTensor]:
    """The entries of ``state_dict`` as DTensors in their planned placements.

    ``src_data_rank=0`` scatters rank 0's values (``distribute_tensor``); ``None`` splits
    the full tensor every rank holds locally. A meta tensor gives an empty DTensor to
    load into (``torch.distributed.checkpoint.load``).
    """
    from torch.distributed.tensor import distribute_tensor

    layout = state_dict_layout(plan, model)
    out = {}
    for key, value in state_dict.items():
        if key not in layout:
            raise PlanError(f"state_dict[{key}]: not a parameter or buffer of the plan "
                            f"(plan={plan.path})")
        placements = layout[key]
        if value.device.type == "meta":
            from pipeline.dtensor.placements import local_shape

            local = torch.empty(local_shape(value.shape, placements, plan.mesh_shape),
                                dtype=value.dtype, device=mesh.device_type)
            out[key] = DTensor.from_local(local, mesh, placements, run_check=False,
                                          shape=value.shape, stride=value.stride())
        else:
            out[key] = distribute_tensor(value.detach(), mesh, placements,
                                         src_data_rank=src_data_rank)
    return out
