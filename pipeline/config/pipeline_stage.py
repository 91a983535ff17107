"""The configuration of a pipeline stage's SPMD solve (docs/pipelining.md, "Pipelined
runs"), torch-free.

With a ``pp`` mesh dim of size ``p > 1`` (outermost), every stage runs an SPMD program on
the sub-mesh of the other dims. :func:`stage_config` is that problem: the mesh without
its first dim, and **one microbatch** of the step: ``model.batch_size / (model.microbatches
x pipeline.microbatches)`` samples over the whole sub-mesh (the data-parallel dims split
it as they split the full batch, so each device traces ``local batch / microbatches /
model.microbatches`` samples per pipeline: the microbatch torch.distributed.pipelining
runs). The placement texts of ``constraints`` (``inputs``, ``outputs``, each node pin) lose
their first token (the ``pp`` dim's: a stage's tensors are never split over the
pipeline), ``constraints.device_memory`` is dropped (the whole model on the sub-mesh
is not what a device holds: it bounds every pipeline rank's peak instead,
pipeline/stages/solve/pipelined.py), the parameter-memory bound defaults to the
sub-mesh's ``1 / prod(sub-mesh)`` and the pipeline keys go back to their defaults.
Solved once per distinct sub-mesh and microbatch (the repeated-layer grouping makes one
solve of the whole model price every layer: pipeline/stages/solve/profile.py).
"""

from __future__ import annotations

import math
from typing import Any

from omegaconf import DictConfig, OmegaConf

from pipeline.config.pipelining import PP_DIM
from pipeline.config.schema import ConfigError
from pipeline.config.validate import resolve
from pipeline.core.placement_text import drop_first_token, tokenize

__all__ = ["pipeline_degree", "stage_config"]


def pipeline_degree(cfg: Any) -> int:
    """The pipeline degree of a resolved config: the size of its ``pp`` mesh dim (1:
    none)."""
    names = list(cfg.mesh_names)
    return int(cfg.mesh[0]) if names and names[0] == PP_DIM else 1


def _sub(text: str | None, key: str) -> str | None:
    if text is None:
        return None
    try:
        first = tokenize(str(text))[0]
        rest = drop_first_token(str(text))
    except ValueError as err:
        raise ConfigError(f"{key}={text}: {err}") from None
    if not first.is_replicate():
        raise ConfigError(f"{key}={text}: a pipeline stage's tensors are not split over the "
                          f"{PP_DIM} dim; allowed R as its (first) token")
    return rest


def stage_config(cfg: DictConfig) -> DictConfig:
    """The resolved config of the stage solve of a resolved pipelined config (module
    docstring).

    Raises:
        ConfigError: the config has no pipeline, or a placement the sub-mesh cannot take.
    """
    if pipeline_degree(cfg) == 1:
        raise ConfigError(f"mesh_names={list(cfg.mesh_names)}: no {PP_DIM} dim of size > 1, "
                          "so no pipeline stage to solve")
    out = OmegaConf.to_container(cfg, resolve=True)
    mesh = list(out["mesh"])
    per = int(out["pipeline"]["microbatches"]) * int(out["model"].get("microbatches", 1))
    if len(mesh) == 1:  # the pp dim alone: each stage on one device (a mesh of size 1)
        out["mesh"], out["mesh_names"] = 1, None
    else:
        out["mesh"] = ",".join(str(d) for d in mesh[1:]) if len(mesh) > 2 else int(mesh[1])
        out["mesh_names"] = list(out["mesh_names"])[1:]
    out["model"]["batch_size"] = int(out["model"]["batch_size"]) // per
    out["model"]["microbatches"] = 1
    out["model"].pop("trace_env", None)
    out["pipeline"] = {"schedule": "1f1b", "microbatches": "auto", "virtual_stages": 1,
                       "split": "auto"}
    c = out["constraints"]
    c["device_memory"] = None  # bounds each pipeline rank (stages/solve/pipelined.py)
    if len(mesh) == 1:  # one device: every placement is R
        c["inputs"] = c["outputs"] = None
        c["nodes"] = []
    else:
        c["inputs"] = _sub(c.get("inputs"), "constraints.inputs")
        c["outputs"] = _sub(c.get("outputs"), "constraints.outputs")
        for i, node in enumerate(c.get("nodes") or []):
            node["placement"] = _sub(node.get("placement"), f"constraints.nodes.{i}.placement")
    pm = c.get("param_memory")
    if pm is not None and math.isclose(float(pm.get("high") or 0.0), 1.0 / math.prod(mesh)):
        pm["high"] = None
    return resolve(OmegaConf.create(out))
