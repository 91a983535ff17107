"""Executing a plan: the traced training step run on DTensors as the plan says, and the
plan exported for training code.

==================================  ==================================================
module                              job
==================================  ==================================================
:mod:`pipeline.apply.step`          the graph interpreter: :func:`run_step` runs the
                                    graph IR node by node on DTensors and checks every
                                    output placement against the plan
                                    (:class:`PlacementMismatchError`);
                                    :func:`run_graph` (the graph IR of a plan's run),
                                    :func:`distribute_full`, :func:`resolve_target`
:mod:`pipeline.apply.counter`       the collective counter
                                    (:class:`CollectiveCounter`: collectives per
                                    ``kind(mesh dim)``, :data:`COLLECTIVE_KINDS`)
:mod:`pipeline.apply.state_dict`    export: :func:`state_dict_layout` (the placement of
                                    every state-dict entry, tied names included),
                                    :func:`distribute_state_dict`
:mod:`pipeline.apply.parallelize`   :func:`parallelize`: the plan applied to the
                                    user's module in place (FSDP2, tensor-parallel
                                    placements, fallback), with its report
:mod:`pipeline.apply.layouts`       the plan's activation layouts at module
                                    boundaries and the hooks that apply them
                                    (:func:`~pipeline.apply.layouts.layout_hooks`,
                                    :func:`~pipeline.apply.layouts.gather_for_use`)
:mod:`pipeline.apply.styles`        export: :func:`torch_styles` (FSDP2 ``fully_shard``
                                    mesh dims and tensor-parallel ``parallelize_module``
                                    styles, when the plan matches them, with the
                                    modules that do not)
==================================  ==================================================
"""

from __future__ import annotations

from pipeline.apply.counter import COLLECTIVE_KINDS, CollectiveCounter
from pipeline.apply.parallelize import ParallelizeReport, check_names, parallelize
from pipeline.apply.state_dict import distribute_state_dict, state_dict_layout
from pipeline.apply.step import (
    PlacementMismatchError,
    StepResult,
    distribute_full,
    resolve_target,
    run_graph,
    run_step,
)
from pipeline.apply.styles import ModuleStyle, TorchStyles, torch_styles

__all__ = ["COLLECTIVE_KINDS", "CollectiveCounter", "ModuleStyle", "ParallelizeReport",
           "PlacementMismatchError", "StepResult", "TorchStyles", "check_names",
           "distribute_full", "distribute_state_dict", "parallelize", "resolve_target",
           "run_graph", "run_step", "state_dict_layout", "torch_styles"]
