"""Configuration: Hydra structured configs, validation, resolution and result paths.

Hydra is the single source of configuration (DESIGN.md, "Config"). This module

* declares the schema (:class:`Config` and its parts) and registers it in Hydra's
  ``ConfigStore`` (:func:`register_configs`); the YAML files under ``conf/`` are
  merged onto it, so a misspelt key or a value of the wrong type is refused;
* composes a config from Hydra overrides with the compose API (:func:`load_config`);
* validates and resolves it (:func:`resolve`): ``mesh`` becomes a list of ints,
  ``mesh_names``, ``lazy_costs`` and ``constraints.param_memory.high`` get their
  defaults, and every bad value raises :class:`ConfigError` with a one-line message
  naming the key, the value and what is allowed;
* derives the deterministic result directories from the resolved config
  (:func:`stage_dirs`) and a hash of each stage's source code
  (:func:`stage_code_hash`);
* maps Snakemake ``--config`` keys to Hydra overrides
  (:func:`overrides_from_snakemake`) and renders the part of a resolved config a
  stage depends on back into overrides (:func:`stage_overrides`).

Result layout (one directory level per stage, each named by a readable key plus
the first 8 hex digits of the SHA-256 of the canonical JSON of the resolved config
that stage depends on, cumulatively, see :data:`STAGE_KEYS`)::

    <results_dir>/runs/<model.name>-<h8>/            trace:    model.*
      <mesh, e.g. 2x4x8>-<h8>/                       topology: + mesh, mesh_names,
                                                               constraints.*, repeated_subgraphs
        <hardware.name>-<h8>/<lazy|eager>/           costs:    + hardware.*, lazy_costs
          <solver.name>-<h8>/                        solve:    + solver.*, optimality_check
    <results_dir>/report/                            report:   all runs
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import math
import re
import shlex
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import MISSING, DictConfig, ListConfig, OmegaConf

from pipeline.costmodel.hardware import HardwareConfig, validate_hardware
from pipeline.models.llama import ModelConfig, validate_model_config
from pipeline.runtime import PROJECT_ROOT

__all__ = [
    "CONF_DIR",
    "STAGES",
    "Config",
    "ConfigError",
    "ConstraintsConfig",
    "NodeConstraint",
    "PaperConfig",
    "ParamMemoryConfig",
    "SolverConfig",
    "StageDirs",
    "config_hash",
    "default_mesh_names",
    "group_options",
    "load_config",
    "load_resolved",
    "mesh_label",
    "normalise_overrides",
    "overrides_from_snakemake",
    "parse_mesh",
    "register_configs",
    "resolve",
    "stage_code_hash",
    "stage_dirs",
    "stage_keys",
    "stage_overrides",
]

#: Absolute path of the Hydra config directory (``initialize_config_dir`` needs one).
CONF_DIR: Path = PROJECT_ROOT / "conf"

#: Stage names in execution order.
STAGES: tuple[str, ...] = ("trace", "topology", "costs", "solve", "report")

#: Config groups (directories under ``conf/``).
GROUPS: tuple[str, ...] = ("model", "hardware", "solver", "experiment")

SOLVER_NAMES: tuple[str, ...] = ("approx", "ilp", "lp")
MIP_BACKENDS: tuple[str, ...] = ("highs", "cbc")
DEFAULT_MESH_NAMES: dict[int, list[str]] = {1: ["dp"], 2: ["dp", "tp"], 3: ["dp", "cp", "tp"]}

#: Source files (globs relative to the project root) whose content keys each stage's code.
STAGE_SOURCES: dict[str, tuple[str, ...]] = {
    "trace": ("pipeline/trace.py", "pipeline/models/*.py"),
    "topology": ("pipeline/topology.py", "pipeline/placements.py"),
    "costs": ("pipeline/costs.py", "pipeline/costmodel/*.py"),
    "solve": ("pipeline/solve.py", "pipeline/solvers/*.py", "pipeline/plan.py"),
    "report": ("pipeline/report.py",),
    "paper": ("pipeline/paper.py",),
    "verify": ("pipeline/verify.py", "pipeline/apply.py", "pipeline/plan.py",
               "pipeline/cpu_kernels.py"),
}

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_IDENT_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class ConfigError(ValueError):
    """A bad configuration value; ``str(err)`` is one line naming key, value and what is
    allowed, e.g. ``mesh=2,0,8: allowed positive integers joined by ',' or 'x' ...``."""

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(str(message).split()))


# --------------------------------------------------------------------------- schema


@dataclass
class SolverConfig:
    """Solver choice and options (one schema for all solvers; each reads its own fields).

    Attributes:
        name: ``approx`` (TRW-S + local search), ``ilp`` (exact, PuLP) or ``lp``
            (LP relaxation, PuLP).
        max_iters: approx: TRW-S iteration cap (deterministic).
        tol: approx: stop when the lower bound improves by less than this (relative).
        local_search_rounds: approx: rounds of the local-search polish.
        prune: ilp/lp, and the LP of ``optimality_check``: before building the
            program, run TRW-S and drop every label whose dual lower bound exceeds
            the energy of TRW-S's (feasible) plan: exact reduced-cost fixing, the
            optimum is unchanged (pipeline/solvers/pruning.py). ``False``: the
            unreduced program.
        time_limit_s: wall-clock safety net in seconds (``None``: off; breaks
            determinism when it triggers).
        backend: ilp/lp: PuLP backend, ``highs`` or ``cbc``.
        mip_gap: ilp: relative MIP gap at which the backend may stop (0: exact).
        threads: ilp/lp: backend threads.
    """

    name: str = "approx"
    max_iters: int = 500
    tol: float = 1e-7
    local_search_rounds: int = 50
    prune: bool = True
    time_limit_s: float | None = None
    backend: str = "highs"
    mip_gap: float = 0.0
    threads: int = 1


@dataclass
class NodeConstraint:
    """Pin the output placement of the graph nodes ``match`` selects (compact notation)."""

    match: str = MISSING
    placement: str = MISSING


@dataclass
class ParamMemoryConfig:
    """Bounds on the fraction of all parameter memory held by one device.

    ``high=None`` resolves to ``1 / prod(mesh)`` (fully sharded parameters).
    """

    low: float = 0.0
    high: float | None = None


@dataclass
class ConstraintsConfig:
    """User constraints of the topology stage.

    Attributes:
        inputs: placement of the model inputs (``None``: ``S(0)`` on the first mesh dim,
            ``R`` on the others).
        outputs: placement of the outputs (``None``: unconstrained).
        nodes: per-node pins ``{match, placement}``.
        param_memory: parameter-memory budget per device, or ``None`` for none.
        fwd_bwd_consistency: tie a parameter (model input) and its gradient to one
            placement.
    """

    inputs: str | None = None
    outputs: str | None = None
    nodes: list[NodeConstraint] = field(default_factory=list)
    param_memory: ParamMemoryConfig | None = field(default_factory=ParamMemoryConfig)
    fwd_bwd_consistency: bool = True


@dataclass
class PaperConfig:
    """The runs behind the paper's tables and figures (set by ``conf/experiment/paper*.yaml``;
    read by :mod:`pipeline.paper`, not part of any stage's key).

    Attributes:
        runs: named run sets; each is a list of Hydra overrides in the multirun grammar
            (``mesh=8,2x4``, ``lazy_costs=true,false``) applied on top of the experiment's
            config, and every combination of their values is one run.
        table_mesh: mesh of the eager-vs-lazy table (``None``: the largest mesh of its set).
    """

    runs: dict[str, list[str]] = field(default_factory=dict)
    table_mesh: str | None = None


@dataclass
class Config:
    """The whole run configuration (``conf/config.yaml`` is merged onto this schema).

    Attributes:
        model, hardware, solver: the selected options of the config groups.
        constraints: see :class:`ConstraintsConfig`.
        mesh: device mesh shape: ``"2,4,8"``, ``"2x4x8"``, ``8`` or a list; resolved
            to a list of ints.
        mesh_names: one name per mesh dim (``None``: dp / dp,tp / dp,cp,tp by rank).
        lazy_costs: lazy cost factors (``None``: true for approx, false for ilp/lp).
        repeated_subgraphs: tie the copies of a repeated layer to one decision.
        optimality_check: also compute a certificate of optimality where possible.
        results_dir: root of all results, relative to the working directory.
        experiment: name of the selected ``conf/experiment`` option (set by it).
        revision_label: recorded in place of the git revision when given.
        paper: run sets of the paper's tables and figures, see :class:`PaperConfig`.
    """

    model: ModelConfig = MISSING
    hardware: HardwareConfig = MISSING
    solver: SolverConfig = MISSING
    constraints: ConstraintsConfig = field(default_factory=ConstraintsConfig)
    mesh: Any = "2,4,8"
    mesh_names: list[str] | None = None
    lazy_costs: bool | None = None
    repeated_subgraphs: bool = True
    optimality_check: bool = False
    results_dir: str = "results"
    experiment: str | None = None
    revision_label: str | None = None
    paper: PaperConfig = field(default_factory=PaperConfig)


def register_configs() -> None:
    """Register the schema in Hydra's ``ConfigStore`` (idempotent).

    ``config_schema`` is the first entry of ``conf/config.yaml``'s defaults list;
    the group options are validated through the typed fields of :class:`Config`.
    """
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="config_schema", node=Config)


# --------------------------------------------------------------------------- composing


def group_options(group: str) -> list[str]:
    """Names of the YAML options of a config group (``conf/<group>/*.yaml``), sorted."""
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def _fmt(value: Any) -> str:
    """Render a value the way a user writes it in an override (``[2,4]``, ``null``)."""
    if isinstance(value, (ListConfig, DictConfig)):
        value = OmegaConf.to_container(value, resolve=False)
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_fmt(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{_fmt(v)}" for k, v in value.items()) + "}"
    return str(value)


_COMMA_LIST_RE = re.compile(r"^(?P<key>mesh|mesh_names)=(?P<val>[^'\"\[\]{}()]*,[^'\"\[\]{}()]*)$")
_PLACEMENT_KEY_RE = re.compile(
    r"^(?P<key>constraints\.(?:inputs|outputs|nodes\.\d+\.placement))=(?P<val>[^'\"\[\]{}]*)$")


def normalise_overrides(overrides: Sequence[str], multirun: bool = False) -> list[str]:
    """Accept spellings Hydra's grammar would refuse or misread, without changing meaning.

    * ``mesh=2,4,8`` / ``mesh_names=a,b`` outside a sweep: Hydra reads an unquoted comma
      list as a sweep and refuses it in a single run, where it can only mean one value;
      it becomes ``mesh='2,4,8'`` / ``mesh_names=[a,b]``. In a multirun
      (``multirun=True``) a comma list stays a sweep.
    * a placement with parentheses, ``constraints.inputs=S(0)RR``, is quoted.
    * ``experiment=null`` (no experiment) becomes ``~experiment``, which Hydra accepts.
    * a mapping for a dict-typed key, ``model.ffn_hidden_overrides={0:4096}``, becomes
      ``++model.ffn_hidden_overrides={0:4096}``: a plain override of a dict merges in
      struct mode and refuses new keys; ``++`` merges them in.
    """
    out = []
    for ov in overrides:
        m = _COMMA_LIST_RE.match(ov)
        if m and not multirun:
            if m["key"] == "mesh":
                ov = f"mesh='{m['val']}'"
            else:
                ov = "mesh_names=[" + ",".join(p.strip() for p in m["val"].split(",")) + "]"
        m = _PLACEMENT_KEY_RE.match(ov)
        if m and re.search(r"[()|]", m["val"]):
            ov = f"{m['key']}='{m['val']}'"
        key, sep, val = ov.partition("=")
        if key == "experiment" and val == "null":
            ov = "~experiment"
        if sep and val.startswith("{") and re.fullmatch(r"[\w.]+", key):
            found = _schema_type(key)
            if found is not None and typing.get_origin(found[0]) is dict:
                ov = "++" + ov
        out.append(ov)
    return out


def _unwrap_optional(t: Any) -> tuple[Any, bool]:
    args = typing.get_args(t)
    if type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return (rest[0] if len(rest) == 1 else Any), True
    return t, False


def _schema_type(key: str) -> tuple[Any, bool] | None:
    """(type, optional) of a dotted key in the :class:`Config` schema, ``None`` if unknown.

    List indices (``constraints.nodes.0.match``) and dict entries are followed."""
    t: Any = Config
    optional = False
    for part in key.split("."):
        origin = typing.get_origin(t)
        if dataclasses.is_dataclass(t):
            hints = typing.get_type_hints(t)
            if part not in hints:
                return None
            t = hints[part]
        elif origin is list and part.isdigit():
            t = typing.get_args(t)[0]
        elif origin is dict:
            t = typing.get_args(t)[1]
        elif t is Any:
            return Any, True
        else:
            return None
        t, optional = _unwrap_optional(t)
    return t, optional


_SCHEMAS: dict[str, Any] = {c.__name__: c for c in (
    Config, ModelConfig, HardwareConfig, SolverConfig, ConstraintsConfig, NodeConstraint,
    ParamMemoryConfig, PaperConfig)}
_SCHEMAS["LinkConfig"] = typing.get_type_hints(HardwareConfig)["intra_node"]


def _known_keys(key: str) -> str:
    """``allowed keys of model: name, dim, ...`` for the parent of a dotted key."""
    parent = key.rsplit(".", 1)[0] if "." in key else ""
    found = _schema_type(parent) if parent else (Config, False)
    t = found[0] if found else None
    if not dataclasses.is_dataclass(t):
        return "see docs/config.md"
    where = parent or "the top level"
    return f"allowed keys at {where}: " + ", ".join(f.name for f in dataclasses.fields(t))


def _allowed_text(key: str) -> str:
    """``allowed true, false, null`` etc. for a schema key, from the dataclass types."""
    found = _schema_type(key)
    if found is None:
        return "unknown key; " + _known_keys(key)
    t, optional = found
    names = {bool: "true, false", int: "an integer", float: "a number", str: "a string"}
    if typing.get_origin(t) is list:
        text = "a list"
    elif typing.get_origin(t) is dict:
        text = "a mapping {key: value}"
    elif dataclasses.is_dataclass(t):
        text = "a mapping with keys " + ", ".join(f.name for f in dataclasses.fields(t))
    else:
        text = names.get(t, "see docs/config.md")
    return "allowed " + text + (", null" if optional else "")


def _check_overrides(overrides: list[str]) -> None:
    """Check each override before composing, for errors Hydra reports badly or not at all.

    Raises:
        ConfigError: an override Hydra cannot parse, a sweep in a single run, an unknown
            key, a deletion of a schema key, or a bool key set to anything but true/false.
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    parser = OverridesParser.create()
    for ov in overrides:
        try:
            parsed = parser.parse_override(ov)
        except HydraException as err:
            reason = str(err).strip().splitlines()[0] if str(err).strip() else "syntax error"
            raise ConfigError(
                f"{ov}: not a valid override ({reason}); write key=value and quote a value "
                "holding ( ) , | or spaces, e.g. \"constraints.inputs='S(0)RR'\"") from None
        key = parsed.key_or_group
        if key.startswith("hydra") or "/" in key:
            continue
        if parsed.is_sweep_override():
            raise ConfigError(f"{ov}: a list of values is a sweep; run with -m to sweep, or "
                              "quote the value")
        if key in GROUPS:
            if parsed.value() is None and not parsed.is_delete():
                raise ConfigError(f"{ov}: allowed " + ", ".join(group_options(key)))
            continue
        found = _schema_type(key)
        if found is None:
            raise ConfigError(f"{ov}: unknown key; {_known_keys(key)}")
        if parsed.is_delete():
            raise ConfigError(f"{ov}: schema keys cannot be deleted; set the key instead")
        t, optional = found
        value = parsed.value()
        if t is bool and not (isinstance(value, bool) or (optional and value is None)):
            raise ConfigError(f"{ov}: {_allowed_text(key)}")


def _composition_error(err: Exception, overrides: Sequence[str]) -> ConfigError:
    """Turn a (multi-line) Hydra/OmegaConf composition error into one line."""
    text = str(err)
    m = re.search(r"Could not find '([\w/]+)/([^']+)'", text)
    if m:
        group, choice = m.group(1), m.group(2)
        options = group_options(group)
        allowed = ", ".join(options) if options else "none (the group has no options)"
        return ConfigError(f"{group}={choice}: allowed {allowed}")
    m = re.search(r"(?:Could not override|Error merging override) '?([^'=\s]+)", text)
    key = m.group(1).lstrip("+~") if m else getattr(err, "full_key", None)
    shown = next((ov for ov in overrides if key and ov.split("=", 1)[0].lstrip("+~") == key),
                 key)
    cause = err.__cause__ or err
    ctext = str(cause)
    unknown = re.search(r"Key '([^']+)' (?:is )?not in '(\w+)'", ctext)
    if unknown and unknown.group(2) in _SCHEMAS:
        keys = ", ".join(f.name for f in dataclasses.fields(_SCHEMAS[unknown.group(2)]))
        return ConfigError(f"{shown}: unknown key '{unknown.group(1)}'; allowed keys: {keys}")
    full_key = re.sub(r"\[(\d+)\]", r".\1", str(getattr(cause, "full_key", "") or ""))
    first = ctext.strip().splitlines()[0] if ctext.strip() else type(err).__name__
    if shown and m and full_key and full_key != key:
        hint = ("; to add list entries set the whole list, e.g. "
                "constraints.nodes=[{match:x,placement:'RRR'}]"
                if re.search(r"\.\d+(\.|$)", key or "") else "")
        return ConfigError(f"{shown}: {first} (at {full_key}){hint}")
    if shown and m:
        return ConfigError(f"{shown}: {_allowed_text(str(key))}")
    if full_key:
        return ConfigError(f"{full_key}: {first} (value from a config file); "
                           f"{_allowed_text(str(full_key))}")
    return ConfigError(first)


def load_config(overrides: Sequence[str] = ()) -> DictConfig:
    """Compose ``conf/config.yaml`` with Hydra overrides (compose API), unresolved.

    Args:
        overrides: Hydra overrides, e.g. ``["model=toy", "mesh=2x4x8",
            "solver.time_limit_s=60"]``; ``mesh=2,4,8`` is accepted (see
            :func:`normalise_overrides`).

    Returns:
        The composed config in struct mode (no ``hydra`` node). Pass it through
        :func:`resolve` before use.

    Raises:
        ConfigError: one line, for an unknown group option (``solver=foo``), an unknown
            key, a value of the wrong type (``lazy_costs=maybe``) or a malformed override.
        FileNotFoundError: ``conf/`` is missing (a non-editable install).
    """
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    if not (CONF_DIR / "config.yaml").is_file():
        raise FileNotFoundError(f"{CONF_DIR / 'config.yaml'} not found: the pipeline runs from "
                                "a checkout (install it with `pip install -e .`)")
    overrides = normalise_overrides(list(overrides))
    _check_overrides(overrides)
    register_configs()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
            cfg = compose(config_name="config", overrides=overrides)
    except (HydraException, OmegaConfBaseException, ValueError) as err:
        raise _composition_error(err, overrides) from None
    finally:
        GlobalHydra.instance().clear()
    return cfg


def load_resolved(overrides: Sequence[str] = ()) -> DictConfig:
    """``resolve(load_config(overrides))``; raises :class:`ConfigError` on any bad value."""
    return resolve(load_config(overrides))


# --------------------------------------------------------------------------- resolving


_MESH_ALLOWED = "allowed positive integers joined by ',' or 'x' (e.g. 2,4,8 or 2x4x8 or 8)"


def parse_mesh(value: Any) -> list[int]:
    """Parse a mesh shape: ``"2,4,8"``, ``"2x4x8"``, ``"8"``, ``8`` or ``[2, 4, 8]``.

    Raises:
        ConfigError: ``mesh=<value>: allowed positive integers ...`` for anything else
            (a zero or negative size, a non-integer, an empty mesh).
    """
    bad = ConfigError(f"mesh={_fmt(value)}: {_MESH_ALLOWED}")
    if isinstance(value, ListConfig):
        value = list(value)
    if isinstance(value, bool):
        raise bad
    if isinstance(value, int):
        parts: list[Any] = [value]
    elif isinstance(value, str):
        text = value.strip()
        if text.startswith(("[", "(")) and text.endswith(("]", ")")):
            text = text[1:-1]
        parts = [p.strip() for p in re.split(r"[,xX]", text)] if text else []
    elif isinstance(value, (list, tuple)):
        parts = list(value)
    else:
        raise bad
    dims = []
    for p in parts:
        if isinstance(p, bool):
            raise bad
        if isinstance(p, str) and re.fullmatch(r"\d+", p):
            p = int(p)
        if not isinstance(p, int) or p < 1:
            raise bad
        dims.append(p)
    if not dims:
        raise bad
    return dims


def mesh_label(mesh: Sequence[int]) -> str:
    """``[2, 4, 8]`` -> ``"2x4x8"``."""
    return "x".join(str(int(d)) for d in mesh)


def default_mesh_names(rank: int) -> list[str]:
    """Default dim names: 1 -> dp; 2 -> dp, tp; 3 -> dp, cp, tp.

    Raises:
        ConfigError: for other ranks, which need explicit ``mesh_names``.
    """
    if rank not in DEFAULT_MESH_NAMES:
        example = ",".join(f"d{i}" for i in range(rank))
        raise ConfigError(
            f"mesh_names=null: a {rank}-d mesh has no default dim names (defaults exist "
            f"for 1-3 dims); allowed a list of {rank} unique names, e.g. mesh_names=[{example}]")
    return list(DEFAULT_MESH_NAMES[rank])


def _check_mesh_names(names: Any, mesh: list[int]) -> list[str]:
    shown = f"mesh_names={_fmt(names)}"
    if isinstance(names, str):
        names = [n.strip() for n in names.split(",")]
    if not isinstance(names, (list, tuple, ListConfig)):
        raise ConfigError(f"{shown}: allowed a list of {len(mesh)} unique names or null")
    names = list(names)
    if len(names) != len(mesh):
        raise ConfigError(f"{shown}: need {len(mesh)} names, one per dim of mesh "
                          f"{mesh_label(mesh)}")
    for n in names:
        if not isinstance(n, str) or not _IDENT_RE.match(n):
            raise ConfigError(f"{shown}: names must be identifiers ([A-Za-z_][A-Za-z0-9_]*)")
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise ConfigError(f"{shown}: names must be unique ({', '.join(dup)} repeated)")
    return names


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and not math.isnan(v)


def _check_solver(s: Any) -> None:
    def need(ok: bool, key: str, allowed: str) -> None:
        if not ok:
            raise ConfigError(f"solver.{key}={_fmt(s[key])}: {allowed}")

    need(s.name in SOLVER_NAMES, "name", "allowed " + ", ".join(SOLVER_NAMES))
    need(_is_int(s.max_iters) and s.max_iters >= 1, "max_iters", "allowed an integer >= 1")
    need(_is_num(s.tol) and s.tol >= 0, "tol", "allowed a number >= 0")
    need(_is_int(s.local_search_rounds) and s.local_search_rounds >= 0, "local_search_rounds",
         "allowed an integer >= 0")
    need(s.time_limit_s is None or (_is_num(s.time_limit_s) and s.time_limit_s > 0),
         "time_limit_s", "allowed a number > 0 or null (no limit)")
    need(s.backend in MIP_BACKENDS, "backend", "allowed " + ", ".join(MIP_BACKENDS))
    need(_is_num(s.mip_gap) and 0 <= s.mip_gap < 1, "mip_gap", "allowed a number in [0, 1)")
    need(_is_int(s.threads) and s.threads >= 1, "threads", "allowed an integer >= 1")


def _check_placement(key: str, text: Any, rank: int, tuple_ok: bool) -> None:
    """Parse a placement in compact notation; refuse Partial (never legal for pins)."""
    from pipeline.placements import parse_output, parse_placements

    shown = f"{key}={_fmt(text)}"
    try:
        groups = parse_output(text, rank) if tuple_ok else [parse_placements(text, rank)]
    except ValueError as err:
        raise ConfigError(f"{shown}: {err}") from None
    for group in groups:
        if group is not None and any(p.is_partial() for p in group):
            raise ConfigError(f"{shown}: Partial (P...) is not allowed in a constraint; "
                              f"allowed R, S(d), SS(d,k), one token per mesh dim")


def _check_constraints(c: Any, mesh: list[int]) -> None:
    rank = len(mesh)
    for key in ("inputs", "outputs"):
        if c[key] is not None:
            _check_placement(f"constraints.{key}", c[key], rank, tuple_ok=key == "outputs")
    for i, node in enumerate(c.nodes):
        if not isinstance(node.match, str) or not node.match.strip():
            raise ConfigError(f"constraints.nodes.{i}.match={_fmt(node.match)}: allowed a "
                              "non-empty pattern of node names")
        _check_placement(f"constraints.nodes.{i}.placement", node.placement, rank,
                         tuple_ok=True)
    pm = c.param_memory
    if pm is not None:
        if not (_is_num(pm.low) and 0 <= pm.low <= 1):
            raise ConfigError(f"constraints.param_memory.low={_fmt(pm.low)}: allowed a "
                              "fraction in [0, 1]")
        if pm.high is not None and not (_is_num(pm.high) and 0 < pm.high <= 1
                                        and pm.high >= pm.low):
            raise ConfigError(f"constraints.param_memory.high={_fmt(pm.high)}: allowed a "
                              f"fraction in (0, 1] and >= low={_fmt(pm.low)}, or null "
                              "(1/mesh size)")


def resolve(cfg: DictConfig) -> DictConfig:
    """Validate a composed config and fill in everything ``null`` means.

    * ``mesh`` -> list of ints; ``mesh_names`` -> default names by rank if ``null``;
    * ``lazy_costs: null`` -> ``true`` for approx, ``false`` for ilp/lp;
    * ``constraints.param_memory.high: null`` -> ``1 / prod(mesh)``.

    Idempotent: resolving a resolved config returns an equal config.

    Args:
        cfg: a config from :func:`load_config` (not modified).

    Returns:
        A new resolved config (struct mode, interpolations resolved).

    Raises:
        ConfigError: one line naming the key, the value and what is allowed, for a bad
            mesh or mesh_names (size < 1, wrong count, duplicated names, rank > 3 without
            names), ``lazy_costs=true`` with ilp/lp, a bad model (via
            ``validate_model_config``), hardware (``validate_hardware``), solver or
            constraint value, or an empty ``results_dir``.
    """
    try:
        out = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
        out = OmegaConf.merge(OmegaConf.structured(Config), out)
    except Exception as err:  # noqa: BLE001 - an interpolation or type error: one line
        raise ConfigError(str(err).strip().splitlines()[0]) from None
    missing = sorted(re.sub(r"\[(\d+)\]", r".\1", k) for k in OmegaConf.missing_keys(out))
    if missing:
        raise ConfigError(f"{missing[0]}: missing value; {_allowed_text(missing[0])}")
    mesh = parse_mesh(out.mesh)
    names = (default_mesh_names(len(mesh)) if out.mesh_names is None
             else _check_mesh_names(out.mesh_names, mesh))
    name_ok = isinstance(out.model.name, str) and _NAME_RE.match(out.model.name)
    if not name_ok:
        raise ConfigError(f"model.name={_fmt(out.model.name)}: allowed letters, digits, "
                          "'.', '_', '-' (used in result paths)")
    try:
        validate_model_config(out.model)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    if not (isinstance(out.hardware.name, str) and _NAME_RE.match(out.hardware.name)):
        raise ConfigError(f"hardware.name={_fmt(out.hardware.name)}: allowed letters, "
                          "digits, '.', '_', '-' (used in result paths)")
    try:
        validate_hardware(out.hardware)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    _check_solver(out.solver)
    lazy = out.lazy_costs
    if lazy is None:
        lazy = out.solver.name == "approx"
    elif lazy and out.solver.name != "approx":
        raise ConfigError(f"lazy_costs=true: lazy costs need solver=approx "
                          f"(got solver={out.solver.name})")
    _check_constraints(out.constraints, mesh)
    if not isinstance(out.results_dir, str) or not out.results_dir.strip():
        raise ConfigError(f"results_dir={_fmt(out.results_dir)}: allowed a non-empty path")
    out.mesh = mesh
    out.mesh_names = names
    out.lazy_costs = bool(lazy)
    if out.constraints.param_memory is not None and out.constraints.param_memory.high is None:
        out.constraints.param_memory.high = 1.0 / math.prod(mesh)
    OmegaConf.set_struct(out, True)
    return out


# --------------------------------------------------------------------------- keys and paths


def config_hash(obj: Any) -> str:
    """First 8 hex digits of SHA-256 over the canonical JSON of ``obj`` (sorted keys,
    no whitespace); independent of process and ``PYTHONHASHSEED``."""
    if isinstance(obj, (DictConfig, ListConfig)):
        obj = OmegaConf.to_container(obj, resolve=True)
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode()).hexdigest()[:8]


#: Top-level keys each stage depends on, cumulatively (DESIGN.md, "Stages and artifacts").
STAGE_KEYS: dict[str, tuple[str, ...]] = {
    "trace": ("model",),
    "topology": ("model", "mesh", "mesh_names", "constraints", "repeated_subgraphs"),
    "costs": ("model", "mesh", "mesh_names", "constraints", "repeated_subgraphs", "hardware",
              "lazy_costs"),
    "solve": ("model", "mesh", "mesh_names", "constraints", "repeated_subgraphs", "hardware",
              "lazy_costs", "solver", "optimality_check"),
    "report": ("results_dir",),
}


def stage_keys(cfg: DictConfig, stage: str) -> dict[str, Any]:
    """The part of a *resolved* config that ``stage`` depends on, as plain data."""
    if stage not in STAGE_KEYS:
        raise ValueError(f"stage={stage}: allowed {', '.join(STAGES)}")
    return {k: OmegaConf.to_container(cfg[k], resolve=True)
            if isinstance(cfg[k], (DictConfig, ListConfig)) else cfg[k]
            for k in STAGE_KEYS[stage]}


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

    The hardware level is keyed by the topology keys plus ``hardware.*``; the cost mode
    is the next level (``lazy``/``eager``), so the costs directory is keyed by both.

    Example: ``results/runs/llama1b-3f2a9c1e/2x4x8-71b0d2aa/h100-0c9e4f12/lazy/approx-5d1e8b03``.
    """
    root = Path(cfg.results_dir)
    trace = root / "runs" / f"{cfg.model.name}-{config_hash(stage_keys(cfg, 'trace'))}"
    topology = trace / f"{mesh_label(cfg.mesh)}-{config_hash(stage_keys(cfg, 'topology'))}"
    hardware = {**stage_keys(cfg, "topology"), "hardware": stage_keys(cfg, "costs")["hardware"]}
    costs = (topology / f"{cfg.hardware.name}-{config_hash(hardware)}"
             / ("lazy" if cfg.lazy_costs else "eager"))
    solve = costs / f"{cfg.solver.name}-{config_hash(stage_keys(cfg, 'solve'))}"
    return StageDirs(trace=trace, topology=topology, costs=costs, solve=solve,
                     report=root / "report")


def stage_code_hash(stage: str, root: Path = PROJECT_ROOT) -> str:
    """SHA-256 (16 hex digits) of the source files of ``stage`` (:data:`STAGE_SOURCES`).

    Paths and contents enter the hash, so an added, removed or edited file changes it;
    a file that does not exist yet is simply absent. Used as a Snakemake ``params:``
    value so that a code change reruns the stage (it is not part of the directory key).
    """
    if stage not in STAGE_SOURCES:
        raise ValueError(f"stage={stage}: allowed {', '.join(STAGES)}")
    files = sorted({p for pattern in STAGE_SOURCES[stage] for p in root.glob(pattern)
                    if p.is_file()})
    h = hashlib.sha256()
    for p in files:
        h.update(p.relative_to(root).as_posix().encode() + b"\0")
        h.update(p.read_bytes() + b"\0")
    return h.hexdigest()[:16]


# --------------------------------------------------------------------------- overrides


_BARE_STR_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_HYDRA_WORDS = frozenset({"true", "false", "null", "inf", "nan"})


def _hydra_value(value: Any) -> str:
    """Render plain data in Hydra's override grammar; a string is single-quoted unless it
    is a plain identifier Hydra reads back as the same string."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, str):
        if _BARE_STR_RE.match(value) and value.lower() not in _HYDRA_WORDS:
            return value
        return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_hydra_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{_hydra_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"cannot render {type(value).__name__} as a Hydra override")


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
    out = []
    for key in sorted(keys):
        for k, v in _leaves(key, keys[key]):
            out.append(f"{k}={_hydra_value(v)}")
    return out


#: Snakemake ``--config`` keys and how each maps to Hydra.
SNAKEMAKE_KEYS: tuple[str, ...] = ("model", "mesh", "mesh_names", "solver", "lazy_costs",
                                   "hardware", "experiment", "repeated_subgraphs",
                                   "optimality_check", "results_dir", "revision_label",
                                   "overrides")


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
            raise ConfigError(f"{key}={_fmt(config[key])}: unknown --config key; allowed "
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
        elif key in ("model", "solver", "hardware", "experiment"):
            out.append(f"{key}={_fmt(value)}")
        elif key == "mesh":
            if isinstance(value, (list, tuple)):
                value = "x".join(str(v) for v in value)
            out.append(f"mesh={_hydra_value(str(value))}")
        elif key == "mesh_names":
            if isinstance(value, str):
                value = [v.strip() for v in value.strip("[]").split(",")]
            out.append(f"mesh_names={_hydra_value(value)}")
        elif isinstance(value, str) and key in ("results_dir", "revision_label"):
            out.append(f"{key}={_hydra_value(value)}")
        else:
            out.append(f"{key}={_fmt(value)}")
    return out


def sweep_overrides(overrides: Sequence[str]) -> list[list[str]]:
    """Expand a multirun's sweep overrides (``mesh=8,2x4``) into one override list per job,
    as Hydra's basic sweeper does.

    Raises:
        ConfigError: one line for an override Hydra cannot parse.
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
    except HydraException as err:
        raise ConfigError(str(err).strip().splitlines()[0]) from None
    choices = []
    for ov, text in zip(parsed, overrides, strict=True):
        if ov.is_sweep_override():
            key = ov.get_key_element()
            choices.append([f"{key}={v}" for v in ov.sweep_string_iterator()])
        else:
            choices.append([text])
    return [list(job) for job in itertools.product(*choices)]
