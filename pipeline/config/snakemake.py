"""Snakemake glue: ``--config`` keys to Hydra overrides (:func:`overrides_from_snakemake`)
and the part of a resolved config a stage depends on back to overrides
(:func:`stage_overrides`, a rule's ``params.overrides``).
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping, Sequence
from typing import Any

from omegaconf import DictConfig

from pipeline import models as model_families
from pipeline.config.overrides import override_value
from pipeline.config.paths import stage_keys
from pipeline.config.schema import ConfigError


def _leaves(prefix: str, value: Any) -> list[tuple[str, Any]]:
    """Flatten nested dicts to dotted keys; lists and empty/int-keyed dicts stay whole."""
    if isinstance(value, dict) and value and all(isinstance(k, str) for k in value):
        out: list[tuple[str, Any]] = []
        for k in sorted(value):
            out.extend(_leaves(f"{prefix}.{k}", value[k]))
        return out
    return [(prefix, value)]


def stage_overrides(cfg: DictConfig, stage: str) -> list[str]:
    """Hydra overrides that rebuild, from the defaults, everything ``stage`` depends on.

    Used as the Snakemake ``params.overrides`` of each rule: they change exactly when
    the stage's key changes (so ``rerun-triggers: params`` does not rerun the trace when
    only the solver changes), and ``load_resolved(stage_overrides(cfg, s))`` gives the
    same :func:`stage_dirs` entry for ``s`` as ``cfg``. ``results_dir`` is always included.
    """
    keys = dict(stage_keys(cfg, stage))
    keys["results_dir"] = cfg.results_dir
    if "device_memory" in keys:  # the stage key's short name for the constraint
        keys["constraints.device_memory"] = keys.pop("device_memory")
    out = []
    if "model" in keys:  # start from the family's own defaults (model=hf, model=custom)
        base = model_families.base_option(model_families.family_of(keys["model"]))
        if base is not None:
            out.append(f"model={base}")
    for key in sorted(keys):
        for k, v in _leaves(key, keys[key]):
            out.append(f"{k}={override_value(v)}")
    if stage == "trace" and cfg.get("stamp_layers") is False:
        # a full trace gives the same graph (in no key): passed on when switched off
        out.append("stamp_layers=false")
    if stage in ("costs", "solve") and cfg.solver.get("max_memory") is not None:
        # the size guard of the costs stage (in no key): passed on when set
        out.append(f"solver.max_memory={override_value(cfg.solver.max_memory)}")
    if stage in ("topology", "costs", "solve") and cfg.get("workers", 0) != 0:
        out.append(f"workers={int(cfg.workers)}")  # in no key: passed on when set
    return out


#: Snakemake ``--config`` keys and how each maps to Hydra.
SNAKEMAKE_KEYS: tuple[str, ...] = ("model", "mesh", "mesh_names", "solver", "lazy_costs",
                                   "hardware", "optimizer", "experiment", "stamp_layers",
                                   "repeated_layers", "recipe",
                                   "optimality_check", "results_dir", "revision_label",
                                   "workers", "overrides")


def _raw_overrides(value: Any, argv: Sequence[str] | None) -> Any:
    """The ``overrides`` text as typed. Snakemake strips *every* leading and trailing
    quote character of a ``--config`` value (``val.strip("'\"")``), which breaks
    ``overrides="a=1 'b=S(0)R'"``; the unstripped text is still in the command line."""
    if argv is None or not isinstance(value, str):
        return value
    for arg in argv:
        if arg.startswith("overrides="):
            raw = arg[len("overrides="):]
            if raw.strip("'\"") == value:
                return raw
    return value


def overrides_from_snakemake(config: Mapping[str, Any],
                             argv: Sequence[str] | None = None) -> list[str]:
    """Map Snakemake ``--config`` values (already parsed by Snakemake: str, int, bool,
    list) to Hydra overrides.

    ``overrides`` holds further space-separated Hydra overrides (shell quoting allowed):
    ``--config mesh=2,4,8 overrides="solver.backend=highs solver.time_limit_s=60"``.
    ``argv``: Snakemake's command line (``sys.argv``), from which the ``overrides``
    text is read with the quotes Snakemake strips.

    Raises:
        ConfigError: for an unknown key (one line listing the allowed keys), or
            unbalanced quotes in ``overrides``.
    """
    out: list[str] = []
    for key in config:
        if key not in SNAKEMAKE_KEYS:
            shown = override_value(config[key], quote="never")
            raise ConfigError(f"{key}={shown}: unknown --config key; allowed "
                              + ", ".join(SNAKEMAKE_KEYS))
    for key in SNAKEMAKE_KEYS:
        if key not in config:
            continue
        value = config[key]
        if key == "overrides":
            if isinstance(value, (list, tuple)):
                out.extend(str(v) for v in value)
            elif value is not None:
                text = str(_raw_overrides(value, argv))
                try:
                    out.extend(shlex.split(text))
                except ValueError as err:
                    raise ConfigError(f"overrides={text}: {err} (allowed: space-separated "
                                      "Hydra overrides, each quoted as a whole if needed)"
                                      ) from None
        elif key in ("model", "solver", "hardware", "optimizer", "experiment"):
            out.append(f"{key}={override_value(value, quote='never')}")
        elif key == "mesh":
            if isinstance(value, (list, tuple)):
                value = "x".join(str(v) for v in value)
            out.append(f"mesh={override_value(str(value))}")
        elif key == "mesh_names":
            if isinstance(value, str):
                value = [v.strip() for v in value.strip("[]").split(",")]
            out.append(f"mesh_names={override_value(value)}")
        elif isinstance(value, str) and key in ("results_dir", "revision_label"):
            out.append(f"{key}={override_value(value)}")
        else:
            out.append(f"{key}={override_value(value, quote='never')}")
    return out
