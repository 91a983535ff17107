"""Validation and resolution of a composed config (:func:`resolve`).

``mesh`` becomes a list of ints, ``mesh_names``, ``lazy_costs`` and
``constraints.param_memory.high`` get their defaults, and every bad value raises
:class:`~pipeline.config.schema.ConfigError` with a one-line message naming the key, the
value and what is allowed.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from pipeline import models as model_families
from pipeline.config.overrides import override_value, printable
from pipeline.config.pipelining import resolve_pipeline
from pipeline.config.schema import (
    DEFAULT_MESH_NAMES,
    MIP_BACKENDS,
    SOLVER_NAMES,
    SOLVER_OBJECTIVES,
    Config,
    ConfigError,
    allowed_text,
)
from pipeline.core.placement_text import split_output, tokenize
from pipeline.core.recipes import RECIPES, check_recipe_model, recipe_dim_roles
from pipeline.costmodel.hardware import validate_hardware
from pipeline.costmodel.model_parallel import MODEL_PARALLEL, cross_node_dims
from pipeline.memory.options import parse_bytes, validate_memory_config

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_IDENT_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def _shown(value: Any) -> str:
    """A value as a one-line message shows it (:func:`override_value`, ``quote="never"``),
    a character that is not printable (a newline, a tab) as its Python escape, so that
    the message stays one line."""
    return printable(override_value(value, quote="never"))


#: Characters a ``results_dir`` cannot hold: NUL ends a path for the operating system,
#: and a line break would split the one-line records that name a run's paths
#: (``run record: <path>``, the one-line errors, the logs). Every character
#: ``str.splitlines`` breaks at, and NUL.
_PATH_BREAKS = frozenset("\x00\n\r\v\f\x1c\x1d\x1e\x85\u2028\u2029")


def check_results_dir(value: Any) -> None:
    """``results_dir``: a non-empty path on one line that is, or can become, a directory
    (:func:`_check_results_dir_on_disk`). Every other character is allowed (spaces,
    quotes, ``;``, ``$``, non-ASCII): paths reach a shell only quoted.

    Raises:
        ConfigError: ``results_dir=<value, escaped>: allowed ...``.
    """
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"results_dir={_shown(value)}: allowed a non-empty path")
    bad = sorted({c for c in value if c in _PATH_BREAKS})
    if bad:
        shown = ", ".join(repr(c)[1:-1] for c in bad)
        raise ConfigError(f"results_dir={_shown(value)}: allowed a path on one line, without "
                          f"NUL or line breaks (it holds {shown})")
    _check_results_dir_on_disk(value)


#: The longest file name most file systems allow (POSIX NAME_MAX on ext4, xfs, btrfs,
#: tmpfs: 255 bytes).
_NAME_MAX = 255


def _check_results_dir_on_disk(value: str) -> None:
    """``results_dir`` must be a directory or creatable as one: no component longer than
    :data:`_NAME_MAX` bytes, and the path itself and its nearest existing ancestor are
    directories. Read-only: nothing is created here."""
    import os

    path = os.path.abspath(os.path.expanduser(value))
    for part in path.split(os.sep):
        if len(os.fsencode(part)) > _NAME_MAX:
            raise ConfigError(f"results_dir={_shown(value)}: allowed a path whose every "
                              f"component is at most {_NAME_MAX} bytes (one is "
                              f"{len(os.fsencode(part))})")
    probe = path
    while not os.path.lexists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            return
        probe = parent
    if not os.path.isdir(probe):
        what = "is" if probe == path else f"lies under {probe}, which is"
        raise ConfigError(f"results_dir={_shown(value)}: allowed a directory (or a path "
                          f"that can become one); it {what} not a directory")


_MESH_ALLOWED = "allowed positive integers joined by ',' or 'x' (e.g. 2,4,8 or 2x4x8 or 8)"


def parse_mesh(value: Any) -> list[int]:
    """Parse a mesh shape: ``"2,4,8"``, ``"2x4x8"``, ``"8"``, ``8`` or ``[2, 4, 8]``.

    Raises:
        ConfigError: ``mesh=<value>: allowed positive integers ...`` for anything else
            (a zero or negative size, a non-integer, an empty mesh).
    """
    bad = ConfigError(f"mesh={_shown(value)}: {_MESH_ALLOWED}")
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
    shown = f"mesh_names={_shown(names)}"
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
            raise ConfigError(f"solver.{key}={_shown(s[key])}: {allowed}")

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
    need(s.objective in SOLVER_OBJECTIVES, "objective", "allowed " + ", ".join(SOLVER_OBJECTIVES))
    need(_is_int(s.step_time_rounds) and s.step_time_rounds >= 0, "step_time_rounds",
         "allowed an integer >= 0")
    if s.max_memory is not None:
        try:
            parse_bytes(s.max_memory, "solver.max_memory")
        except ValueError as err:
            raise ConfigError(str(err)) from None


def _check_placement(key: str, text: Any, rank: int, tuple_ok: bool) -> None:
    """Parse a placement in compact notation (:mod:`pipeline.core.placement_text`); refuse
    Partial (never legal for pins)."""
    shown = f"{key}={_shown(text)}"
    try:
        groups = split_output(text, rank) if tuple_ok else [tokenize(text, rank)]
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
            raise ConfigError(f"constraints.nodes.{i}.match={_shown(node.match)}: allowed a "
                              "non-empty pattern of node names")
        _check_placement(f"constraints.nodes.{i}.placement", node.placement, rank,
                         tuple_ok=True)
    pm = c.param_memory
    if pm is not None:
        if not (_is_num(pm.low) and 0 <= pm.low <= 1):
            raise ConfigError(f"constraints.param_memory.low={_shown(pm.low)}: allowed a "
                              "fraction in [0, 1]")
        if pm.high is not None and not (_is_num(pm.high) and 0 < pm.high <= 1
                                        and pm.high >= pm.low):
            raise ConfigError(f"constraints.param_memory.high={_shown(pm.high)}: allowed a "
                              f"fraction in (0, 1] and >= low={_shown(pm.low)}, or null "
                              "(1/mesh size)")


def _check_recipe(recipe: Any, mesh: list[int], names: list[str], c: Any, model: Any) -> None:
    """``recipe``: one of the recipes, applicable to the mesh (its dim names) and to the
    model (its module roles, its batch and sequence: ``check_recipe_model``), and not
    combined with ``constraints.inputs`` (the recipe places the inputs)."""
    if recipe is None:
        return
    if not isinstance(recipe, str) or recipe not in RECIPES:
        raise ConfigError(f"recipe={_shown(recipe)}: allowed {', '.join(RECIPES)}, null")
    try:
        recipe_dim_roles(recipe, names)
        check_recipe_model(recipe, mesh, names, model)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    if c.inputs is not None:
        raise ConfigError(f"constraints.inputs={_shown(c.inputs)}: recipe={recipe} places "
                          "the inputs itself; allowed null with a recipe")


def _check_recipe_intra_node(recipe: str, mesh: list[int], names: list[str],
                             gpus_per_node: int) -> None:
    """``constraints.model_parallel=intra_node`` with a recipe that runs model parallelism
    (``tp``, ``cp``) on a mesh dim crossing nodes has no plan: refused here."""
    crossing = cross_node_dims(tuple(mesh), gpus_per_node)
    for d, role in enumerate(recipe_dim_roles(recipe, names)):
        if role in ("tp", "cp") and d in crossing:
            raise ConfigError(f"constraints.model_parallel=intra_node: recipe={recipe} runs "
                              f"{role} on mesh dim {names[d]}={mesh[d]}, whose groups span "
                              f"nodes of hardware.gpus_per_node={gpus_per_node}; allowed a "
                              f"mesh whose {names[d]} dim stays in one node, or null")


def check_finite(node: Any, prefix: str = "") -> None:
    """Refuse a non-finite number (``inf``, ``-inf``, ``nan``) anywhere in a config.

    ``node``: a plain container (``OmegaConf.to_container``); keys are dotted, list
    entries by index (``constraints.nodes.0.placement``).

    Raises:
        ConfigError: ``<key>=inf: allowed a finite number ...``.
    """
    if isinstance(node, dict):
        for k, v in node.items():
            check_finite(v, f"{prefix}{k}.")
    elif isinstance(node, (list, tuple)):
        for i, v in enumerate(node):
            check_finite(v, f"{prefix}{i}.")
    elif isinstance(node, float) and not math.isfinite(node):
        raise ConfigError(f"{prefix[:-1]}={_shown(node)}: allowed a finite number "
                          "(inf, -inf and nan are refused)")


def _input_dims(model: Any) -> list[tuple[list[int], list[str], bool]]:
    """(shape, key of each dim) of every model input known from the config alone: llama
    and hf token batches ``[batch_size, seq_len]`` (hf: the batch dim only, the other dims
    depend on the task), a custom model's ``inputs``; the flag: whether the shape is the
    input's whole shape."""
    family = model_families.family_of(model)
    if family == "llama":
        return [([int(model.batch_size), int(model.seq_len)],
                 ["model.batch_size", "model.seq_len"], True)]
    if family == "hf":
        return [([int(model.batch_size)], ["model.batch_size"], False)]
    return [([int(s) for s in spec.shape], [f"model.inputs.{i}.shape.{d}"
                                           for d in range(len(spec.shape))], True)
            for i, spec in enumerate(model.get("inputs") or [])]


def check_input_sharding(out: Any, mesh: list[int], names: list[str]) -> None:
    """Every input dim must be at least the product of the mesh dims sharding it under
    ``constraints.inputs`` (default ``S(0)`` on the first mesh dim): checked here, before
    the trace, as the topology stage would only find no strategy for the input.

    Raises:
        ConfigError: ``model.batch_size=2: the inputs are sharded S(0) on mesh dim dp
            (8 devices) ...``.
    """
    text = out.constraints.inputs
    placements = tokenize(text or "S(0)" + "R" * (len(mesh) - 1), len(mesh))
    shards: dict[int, list[int]] = {}
    for mdim, p in enumerate(placements):
        if p.is_shard():
            shards.setdefault(int(p.dim), []).append(mdim)
    if not shards:
        return
    shown = text if text else "S(0) on the first mesh dim (the default)"
    for shape, keys, whole in _input_dims(out.model):
        for d, mdims in shards.items():
            inside = -len(shape) <= d < len(shape) if whole else 0 <= d < len(shape)
            dim = d % len(shape) if inside else None
            on = ", ".join(f"{names[m]} ({mesh[m]})" for m in mdims)
            count = math.prod(mesh[m] for m in mdims)
            if dim is None:
                if whole:
                    raise ConfigError(f"constraints.inputs={shown}: shards dim {d} of an "
                                      f"input of shape {shape}; allowed dims "
                                      f"0..{len(shape) - 1}")
                continue
            if shape[dim] < count:
                raise ConfigError(
                    f"{keys[dim]}={shape[dim]}: the inputs are sharded on mesh dims {on} "
                    f"(constraints.inputs={shown}), {count} shards; allowed "
                    f"{keys[dim]} >= {count}, or constraints.inputs sharding that dim on "
                    "fewer mesh dims (e.g. R on each)")


def resolve(cfg: DictConfig) -> DictConfig:
    """Validate a composed config and fill in everything ``null`` means.

    * ``mesh`` -> list of ints; ``mesh_names`` -> default names by rank if ``null``;
    * ``lazy_costs: null`` -> ``true`` for approx, ``false`` for ilp/lp;
    * ``constraints.param_memory.high: null`` -> ``1 / prod(mesh)``;
    * ``pipeline.microbatches: auto`` -> a count, ``pipeline.split: auto`` -> the layer
      boundaries, when a ``pp`` mesh dim makes a pipeline
      (:func:`pipeline.config.pipelining.resolve_pipeline`).

    Idempotent: resolving a resolved config returns an equal config.

    Args:
        cfg: a config from :func:`load_config` (not modified).

    Returns:
        A new resolved config (struct mode, interpolations resolved).

    Raises:
        ConfigError: one line naming the key, the value and what is allowed, for a bad
            mesh or mesh_names (size < 1, wrong count, duplicated names, rank > 3 without
            names), ``lazy_costs=true`` with ilp/lp, a bad model (via its family's
            ``validate``, :mod:`pipeline.models`), hardware (``validate_hardware``), solver
            or constraint value, or an empty ``results_dir`` or one holding NUL or a line
            break (:func:`check_results_dir`).
    """
    try:
        out = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
        out = OmegaConf.merge(OmegaConf.structured(Config), out)
        # The model node onto its family's schema (types, defaults, unknown keys).
        family = model_families.family_of(out.model)
        out.model = OmegaConf.merge(
            OmegaConf.structured(model_families.schema_of(family)), out.model)
    except Exception as err:  # noqa: BLE001 - an interpolation or type error: one line
        raise ConfigError(str(err).strip().splitlines()[0]) from None
    missing = sorted(re.sub(r"\[(\d+)\]", r".\1", k) for k in OmegaConf.missing_keys(out))
    if missing:
        raise ConfigError(f"{missing[0]}: missing value; {allowed_text(missing[0])}")
    mesh = parse_mesh(out.mesh)
    names = (default_mesh_names(len(mesh)) if out.mesh_names is None
             else _check_mesh_names(out.mesh_names, mesh))
    name_ok = isinstance(out.model.name, str) and _NAME_RE.match(out.model.name)
    if not name_ok:
        raise ConfigError(f"model.name={_shown(out.model.name)}: allowed letters, digits, "
                          "'.', '_', '-' (used in result paths)")
    try:
        model = OmegaConf.to_container(out.model, resolve=True)
        model_families.validate(model)
        # What the graph depends on outside the config (the torch / transformers version,
        # a custom builder's source) is part of model.*, hence of the trace key.
        out.model.trace_env = model_families.trace_key(model)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    if not (isinstance(out.hardware.name, str) and _NAME_RE.match(out.hardware.name)):
        raise ConfigError(f"hardware.name={_shown(out.hardware.name)}: allowed letters, "
                          "digits, '.', '_', '-' (used in result paths)")
    # non-finite numbers first, with the one message every section gives them
    check_finite(OmegaConf.to_container(out.hardware, resolve=True), "hardware.")
    try:
        validate_hardware(out.hardware)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    _check_solver(out.solver)
    u = out.costs.step_time_uncertainty
    if not (_is_num(u) and 0 <= u < 1):
        raise ConfigError(f"costs.step_time_uncertainty={_shown(u)}: allowed a number in "
                          "[0, 1) (relative)")
    if not (_is_int(out.workers) and out.workers >= 0):
        raise ConfigError(f"workers={_shown(out.workers)}: allowed 0 (one process per "
                          "available CPU) or an integer >= 1 (1: no worker processes)")
    lazy = out.lazy_costs
    if lazy is None:
        lazy = out.solver.name == "approx"
    elif lazy and out.solver.name != "approx":
        raise ConfigError(f"lazy_costs=true: lazy costs need solver=approx "
                          f"(got solver={out.solver.name})")
    _check_constraints(out.constraints, mesh)
    _check_recipe(out.recipe, mesh, names, out.constraints, out.model)
    if out.constraints.model_parallel not in (None, *MODEL_PARALLEL):
        raise ConfigError(f"constraints.model_parallel={_shown(out.constraints.model_parallel)}"
                          f": allowed {', '.join(MODEL_PARALLEL)}, null")
    if out.constraints.model_parallel == "intra_node" and out.recipe is not None:
        _check_recipe_intra_node(out.recipe, mesh, names, int(out.hardware.gpus_per_node))
    pipeline_microbatches, split = resolve_pipeline(out, mesh, names)
    try:
        validate_memory_config(out)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    check_results_dir(out.results_dir)
    check_finite(OmegaConf.to_container(out, resolve=True))
    out.mesh = mesh
    out.mesh_names = names
    out.lazy_costs = bool(lazy)
    out.pipeline.microbatches = pipeline_microbatches
    out.pipeline.split = split
    if out.constraints.param_memory is not None and out.constraints.param_memory.high is None:
        out.constraints.param_memory.high = 1.0 / math.prod(mesh)
    OmegaConf.set_struct(out, True)
    return out
