"""Result paths: the config hash, the keys each stage depends on, the deterministic
stage directories (:func:`stage_dirs`) and the hash of each stage's source code
(:func:`stage_code_hash`). The layout is in :mod:`pipeline.config`'s docstring.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from pipeline.config.schema import STAGES
from pipeline.config.validate import mesh_label
from pipeline.core.codehash import source_hash
from pipeline.core.runtime import PROJECT_ROOT
from pipeline.memory.options import RESERVE_FRACTION
from pipeline.models import FAMILIES

#: The entry modules of each stage: its code hash covers them and every project module
#: they import, transitively (:mod:`pipeline.core.codehash`).
STAGE_ENTRIES: dict[str, tuple[str, ...]] = {
    # the model families are imported by name (pipeline.models.FAMILIES)
    "trace": ("pipeline.stages.trace.stage", *FAMILIES.values()),
    "topology": ("pipeline.stages.topology.stage",),
    "costs": ("pipeline.stages.costs.stage",),
    "solve": ("pipeline.stages.solve.stage", "pipeline.stages.solve.pipelined"),
    "report": ("pipeline.stages.report.stage",),
    "paper": ("pipeline.tools.paper.build", "pipeline.tools.paper.cli"),
    "verify": ("pipeline.verify.run",),
}


def config_hash(obj: Any) -> str:
    """First 8 hex digits of SHA-256 over the canonical JSON of ``obj`` (sorted keys,
    no whitespace); independent of process and ``PYTHONHASHSEED``."""
    if isinstance(obj, (DictConfig, ListConfig)):
        obj = OmegaConf.to_container(obj, resolve=True)
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode()).hexdigest()[:8]


#: Top-level keys each stage depends on, cumulatively: a stage's directory is keyed by a
#: hash of exactly these (its artifacts: pipeline/core/artifacts.py).
#: ``constraints.device_memory`` is a costs key (it shapes the MRF's rows, not the
#: topology): it is left out of ``constraints`` and enters as ``device_memory`` at the
#: costs level with the memory model's keys (``optimizer``, ``memory``, ``fsdp``);
#: ``constraints.model_parallel`` likewise (``+inf`` factors of the MRF), as
#: ``model_parallel``.
STAGE_KEYS: dict[str, tuple[str, ...]] = {
    "trace": ("model",),
    "topology": ("model", "mesh", "mesh_names", "constraints", "repeated_layers", "recipe"),
    "costs": ("model", "mesh", "mesh_names", "constraints", "repeated_layers", "recipe",
              "hardware", "lazy_costs", "optimizer", "memory", "fsdp", "device_memory",
              "costs", "model_parallel"),
    "solve": ("model", "mesh", "mesh_names", "constraints", "repeated_layers", "recipe",
              "hardware",
              "lazy_costs", "optimizer", "memory", "fsdp", "device_memory", "costs",
              "model_parallel",
              "solver", "optimality_check", "pipeline"),
    "report": ("results_dir",),
}

#: The memory model's keys and the cost-model options (``costs``) enter a directory's
#: hash only when they differ from these defaults, so runs that do not set them keep
#: their directories.
MEMORY_KEY_DEFAULTS: dict[str, Any] = {
    "optimizer": {"name": "adamw", "momentum": 0.0, "state_dtype": "float32"},
    "memory": {"activation_checkpointing": "none", "reserve_fraction": RESERVE_FRACTION},
    "fsdp": {"reshard_after_forward": True, "bucket_collectives": True},
    "device_memory": None,
    "model_parallel": None,
    # the cost-model options (``costs.*``), likewise
    "costs": {"compile": False, "fuse_pointwise": True, "flatten_mesh": True},
}


#: Keys that enter a directory's hash only when set (so runs without them keep their
#: directories): ``recipe`` pins the placements of a hand-written plan, a topology key.
OPTIONAL_KEY_DEFAULTS: dict[str, Any] = {"recipe": None}


def stage_keys(cfg: DictConfig, stage: str) -> dict[str, Any]:
    """The part of a *resolved* config that ``stage`` depends on, as plain data.

    ``constraints`` leaves out ``device_memory`` (the costs key ``device_memory``),
    ``model`` leaves out ``microbatches`` when it is 1 (the default: runs without
    gradient accumulation keep their directories),
    ``solver`` leaves out ``max_memory`` (a guard, pipeline/stages/costs/problem_size.py),
    ``costs`` leaves out ``step_time_uncertainty`` (rankings only); the
    memory model's keys appear only when they differ from :data:`MEMORY_KEY_DEFAULTS`.
    """
    if stage not in STAGE_KEYS:
        raise ValueError(f"stage={stage}: allowed {', '.join(STAGES)}")
    out: dict[str, Any] = {}
    for k in STAGE_KEYS[stage]:
        if k in OPTIONAL_KEY_DEFAULTS and cfg.get(k) == OPTIONAL_KEY_DEFAULTS[k]:
            continue
        value = (cfg.constraints.get(k) if k in ("device_memory", "model_parallel")
                 else cfg[k])
        if isinstance(value, (DictConfig, ListConfig)):
            value = OmegaConf.to_container(value, resolve=True)
        if k == "constraints":
            value = {c: v for c, v in value.items()
                     if c not in ("device_memory", "model_parallel")}
        if k == "model" and value.get("microbatches") == 1:  # the default keeps its key
            value = {c: v for c, v in value.items() if c != "microbatches"}
        if k == "pipeline" and not (list(cfg.mesh_names)[:1] == ["pp"]
                                    and int(cfg.mesh[0]) > 1):
            continue  # no pipeline: the keys keep their defaults and the directories
        if k == "solver":  # a guard on the problem's size, not a result-shaping key
            value = {c: v for c, v in value.items() if c != "max_memory"}
        if k == "costs":  # how rankings read step times, not a cost-model option
            value = {c: v for c, v in value.items() if c != "step_time_uncertainty"}
        if k in MEMORY_KEY_DEFAULTS and value == MEMORY_KEY_DEFAULTS[k]:
            continue
        out[k] = value
    return out


@dataclass(frozen=True)
class StageDirs:
    """Directories of one run's stages (relative to the working directory when
    ``results_dir`` is relative). Each holds its stage's artifacts; they nest:
    ``solve`` is inside ``costs``, inside ``topology``, inside ``trace``."""

    trace: Path
    topology: Path
    costs: Path
    solve: Path
    report: Path

    def of(self, stage: str) -> Path:
        """The directory of ``stage`` (one of :data:`STAGES`)."""
        return getattr(self, stage)


def stage_dirs(cfg: DictConfig) -> StageDirs:
    """Result directories of a *resolved* config (see the module docstring for the layout).

    The hardware level is keyed by the topology keys plus ``hardware.*`` and the memory
    model's keys that differ from their defaults (:data:`MEMORY_KEY_DEFAULTS`: they
    shape the MRF); the cost mode is the next level (``lazy``/``eager``), so the costs
    directory is keyed by both.

    Example: ``results/runs/llama1b-3f2a9c1e/2x4x8-71b0d2aa/h100-0c9e4f12/lazy/approx-5d1e8b03``.
    """
    root = Path(cfg.results_dir)
    trace = root / "runs" / f"{cfg.model.name}-{config_hash(stage_keys(cfg, 'trace'))}"
    topology = trace / f"{mesh_label(cfg.mesh)}-{config_hash(stage_keys(cfg, 'topology'))}"
    costs_keys = stage_keys(cfg, "costs")
    hardware = {**stage_keys(cfg, "topology"), "hardware": costs_keys["hardware"],
                **{k: costs_keys[k] for k in MEMORY_KEY_DEFAULTS if k in costs_keys}}
    costs = (topology / f"{cfg.hardware.name}-{config_hash(hardware)}"
             / ("lazy" if cfg.lazy_costs else "eager"))
    solve = costs / f"{cfg.solver.name}-{config_hash(stage_keys(cfg, 'solve'))}"
    return StageDirs(trace=trace, topology=topology, costs=costs, solve=solve,
                     report=root / "report")


def stage_code_hash(stage: str, root: Path = PROJECT_ROOT) -> str:
    """SHA-256 (16 hex digits) of the source of ``stage``: its entry modules
    (:data:`STAGE_ENTRIES`) and every project module they import, transitively.

    Paths and contents enter the hash, so a change in any module the stage runs changes
    it, and a change in a module it does not import leaves it. Used as a Snakemake
    ``params:`` value and in the stage's stamp, so that a code change reruns the stage
    (it is not part of the directory key).
    """
    if stage not in STAGE_ENTRIES:
        raise ValueError(f"stage={stage}: allowed {', '.join(STAGE_ENTRIES)}")
    return source_hash(STAGE_ENTRIES[stage], root)
