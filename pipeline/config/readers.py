"""Plain values the stages read from a resolved config (:func:`pipeline.config.resolve`):
the parameter-memory budget, the pointwise-fusion switch (``costs.compile`` and
``costs.fuse_pointwise``) and the worker count, as Python
data, so that the libraries below the config layer take values, never a config.

The memory model's and FSDP's options are read by their own packages
(:func:`pipeline.memory.options_of_config`,
:func:`pipeline.costmodel.fsdp.collective_options_of_config`).
"""

from __future__ import annotations

from typing import Any

from omegaconf import OmegaConf

from pipeline.core.parallel import resolve_workers

__all__ = ["fuse_pointwise_config", "param_memory_config", "workers_config"]


def param_memory_config(cfg: Any) -> dict[str, Any] | None:
    """``constraints.param_memory`` of a resolved config as plain data (None: no budget)."""
    pm = cfg.constraints.param_memory
    return None if pm is None else OmegaConf.to_container(pm, resolve=True)


def fuse_pointwise_config(cfg: Any) -> bool:
    """Whether the cost model adds the pointwise-fusion credit: ``costs.compile`` and
    ``costs.fuse_pointwise`` of a resolved config (an eager step fuses nothing; False
    when either key is absent)."""
    costs = cfg.get("costs")
    if costs is None:
        return False
    return bool(costs.get("compile", False)) and bool(costs.get("fuse_pointwise", False))


def workers_config(cfg: Any) -> int:
    """Processes for the independent parts of a stage (``workers``; 1 when absent)."""
    return resolve_workers(int(cfg.get("workers", 1)))
