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
from pipeline.config.overrides import override_value, printable
from pipeline.config.paths import stage_keys
from pipeline.config.pipeline_stage import pipeline_degree
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
    A hardware profile with measured tables is selected by its name (``hardware=<name>``,
    its file ``conf/hardware/<name>.yaml``) and its scalar keys set as leaves.
    """
    keys = dict(stage_keys(cfg, stage))
    keys["results_dir"] = cfg.results_dir
    for short in ("device_memory", "model_parallel"):  # stage keys' short names
        if short in keys:
            keys[f"constraints.{short}"] = keys.pop(short)
    out = []
    if "model" in keys:  # start from the family's own defaults (model=hf, model=custom)
        base = model_families.base_option(model_families.family_of(keys["model"]))
        if base is not None:
            out.append(f"model={base}")
    for key in sorted(keys):
        value = keys[key]
        if key == "hardware" and isinstance(value, dict) and value.get("tables") is not None:
            # a measured profile (conf/hardware/<name>.yaml): its tables come from its file
            out.append(f"hardware={override_value(value['name'])}")
            value = {k: v for k, v in value.items() if k != "tables"}
        for k, v in _leaves(key, value):
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


#: ``--config`` keys that are text as typed, whatever it looks like: a path, a label.
RAW_TEXT_KEYS: tuple[str, ...] = ("results_dir", "revision_label")


def _raw_text(key: str, value: Any, argv: Sequence[str] | None) -> Any:
    """The text of ``--config <key>=<text>`` as typed: Snakemake strips leading and
    trailing quotes from a value, then reads it as an int, a float, a bool or YAML
    (``a #b`` -> ``a``, ``[a]`` -> a list, ``a: b`` -> a mapping, a line break -> a
    space), so that a path would not be the one typed. The last ``<key>=`` entry of the
    command line (``argv``) wins, as in Snakemake; ``value`` when there is none (the
    value came from a ``--configfile``)."""
    prefixes = (f"{key}=", f"--config={key}=")
    raw = [a.split("=", 2)[-1] if a.startswith("--config=") else a[len(key) + 1:]
           for a in (argv or ()) if a.startswith(prefixes)]
    return raw[-1] if raw else value


def config_entries(argv: Sequence[str]) -> list[str]:
    """The ``--config`` entries of a Snakemake command line, as typed (``--config a=1
    b=2``, ``-C a=1``, ``--config=a=1``): the ones Snakemake hands to every cluster job."""
    out, inside = [], False
    for arg in argv:
        if arg in ("--config", "-C"):
            inside = True
        elif arg.startswith("--config="):
            out.append(arg[len("--config="):])
            inside = False
        elif inside and not arg.startswith("-"):
            out.append(arg)
        else:
            inside = False
    return out


def job_command_problem(entry: str, wrapped: bool) -> str | None:
    r"""Why a cluster job would not receive the ``--config`` entry ``entry`` as typed, or
    None. Snakemake writes each entry into a job's command line as Python's ``repr``
    (``snakemake_interface_executor_plugins.utils.format_cli_value``), which a POSIX
    shell reads back unchanged only in single quotes without escapes, and in double
    quotes without ``$`` or a backquote (the shell expands them). ``wrapped``: the slurm
    executor also puts the whole command in ``sbatch --wrap="..."`` (only ``"`` escaped),
    where the submitting shell expands ``$``, backquotes and ``\``."""
    text = repr(entry)
    try:
        same = shlex.split(text) == [entry]
    except ValueError:
        same = False
    if not same or (text.startswith('"') and any(c in entry for c in "$`")):
        return ("a cluster job gets --config values quoted by Python's repr, which its shell "
                "reads differently for this one")
    bad = sorted({c for c in entry if c in "$`\\"}) if wrapped else []
    if bad:
        return (f"the slurm executor passes each job's command in sbatch --wrap=\"...\", "
                f"where the shell expands {' '.join(bad)}")
    return None


def check_workflow_paths(cfg: DictConfig) -> None:
    """Refuse a ``results_dir`` the workflow cannot name: its rules' paths are Snakemake
    patterns, where ``{`` and ``}`` mark wildcards (``python -m pipeline`` takes them).

    Raises:
        ConfigError: ``results_dir=<value>: ...; allowed a path without braces``.
    """
    value = str(cfg.results_dir)
    if "{" in value or "}" in value:
        raise ConfigError(f"results_dir={printable(value)}: {{ and }} mark wildcards in the "
                          "workflow's paths; allowed a path without braces (python -m "
                          "pipeline takes it as it is)")


def check_cluster_config(argv: Sequence[str], executor: str, wrapped: bool) -> None:
    """Refuse a ``--config`` entry that a job of the cluster ``executor`` would not
    receive as typed (:func:`job_command_problem`).

    Raises:
        ConfigError: ``<entry>: <why>; allowed with a local run, or in a --configfile``.
    """
    for entry in config_entries(argv):
        problem = job_command_problem(entry, wrapped)
        if problem is not None:
            raise ConfigError(f"{printable(entry)}: {problem} (--executor {executor}); allowed "
                              "as it is with a local run, or in a --configfile")


def check_not_pipelined(cfg: Any) -> None:
    """Refuse a pipelined config (a ``pp`` mesh dim of size > 1) in the workflow: its
    solve prices the pipeline from a stage solve on the sub-mesh
    (pipeline/stages/solve/pipelined.py), a chain of runs the workflow's rules do not
    express yet; ``python -m pipeline`` runs it.

    Raises:
        ConfigError: one line naming mesh and mesh_names and what runs it.
    """
    if pipeline_degree(cfg) > 1:
        mesh = ",".join(str(m) for m in cfg.mesh)
        names = ",".join(str(n) for n in cfg.mesh_names)
        raise ConfigError(f"mesh={mesh} mesh_names=[{names}]: the Snakemake workflow does "
                          "not run pipelined configs (a pp dim) yet; allowed a mesh without "
                          "a pp dim here, or python -m pipeline with the same overrides")


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
        elif key in RAW_TEXT_KEYS and value is not None:
            out.append(f"{key}={override_value(str(_raw_text(key, value, argv)))}")
        else:
            out.append(f"{key}={override_value(value, quote='never')}")
    return out
