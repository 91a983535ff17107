"""The config schema: structured-config dataclasses, registered in Hydra's ``ConfigStore``.

The YAML files under ``conf/`` are merged onto :class:`Config` (its first defaults entry
is ``config_schema``, :func:`register_configs`), so a misspelt key or a value of the
wrong type is refused; the ``model`` group is typed by the schema of its model family
(``pipeline/models/``: ``/schema/model/<family>``; ``model=hf`` and ``model=custom``
are those schemas). This module also holds the names the other config modules share
(stage and group names, :class:`ConfigError`) and the introspection of the schema that
their one-line messages use (:func:`schema_type`, :func:`allowed_text`).
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import MISSING

from pipeline import models as model_families
from pipeline.core import schema_types
from pipeline.core.runtime import PROJECT_ROOT
from pipeline.costmodel.hardware import HardwareConfig
from pipeline.memory.options import FsdpConfig, MemoryConfig, OptimizerConfig
from pipeline.models.custom import CustomModelConfig, InputSpec
from pipeline.models.hf import HFModelConfig
from pipeline.models.llama import ModelConfig
from pipeline.solvers.options import BACKENDS as MIP_BACKENDS  # noqa: F401 - re-exported

#: Absolute path of the Hydra config directory (``initialize_config_dir`` needs one).
CONF_DIR: Path = PROJECT_ROOT / "conf"

#: Stage names in execution order.
STAGES: tuple[str, ...] = ("trace", "topology", "costs", "solve", "report")

#: Config groups (directories under ``conf/``).
GROUPS: tuple[str, ...] = ("model", "hardware", "solver", "optimizer", "experiment")

SOLVER_NAMES: tuple[str, ...] = ("approx", "ilp", "lp")
#: ``solver.objective``: what the plan returned minimises (pipeline/stages/solve/objective.py).
SOLVER_OBJECTIVES: tuple[str, ...] = ("step_time", "additive")
DEFAULT_MESH_NAMES: dict[int, list[str]] = {1: ["dp"], 2: ["dp", "tp"], 3: ["dp", "cp", "tp"]}


class ConfigError(ValueError):
    """A bad configuration value; ``str(err)`` is one line naming key, value and what is
    allowed, e.g. ``mesh=2,0,8: allowed positive integers joined by ',' or 'x' ...``."""

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(str(message).split()))


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
        max_memory: bytes the problem may take (``16GiB``, ``16GB``, a byte count; ``None``:
            80 % of this machine's physical memory). Its size is estimated from the
            topology before the costs stage builds anything (pipeline/stages/costs/problem_size.py)
            and a problem estimated above it is refused in one line. A guard, not part
            of any directory key.
        objective: ``step_time`` (default): return the candidate plan with the smallest
            simulated step time, and bound the step time from below
            (pipeline/stages/solve/objective.py); ``additive``: the solver's plan of the
            additive objective alone, as before (no step-time bound).
        step_time_rounds: ``step_time``: re-weighted solves after the additive one at
            most (the search stops earlier at a fixed point or a cycle); 0: the additive
            plan and the bound only.
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
    max_memory: Any = None
    objective: str = "step_time"
    step_time_rounds: int = 4


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
        device_memory: bytes one device may hold (``80GiB``, ``80GB``, a byte count;
            ``None``: no bound; pipeline/memory/constraint.py). A key of the costs stage
            (the MRF's rows), not of the topology's.
        model_parallel: ``intra_node``: activation collectives only on mesh dims whose
            groups stay inside one node (``+inf`` factors otherwise,
            pipeline/costmodel/model_parallel.py); ``None``: anywhere. A costs key.
    """

    inputs: str | None = None
    outputs: str | None = None
    nodes: list[NodeConstraint] = field(default_factory=list)
    param_memory: ParamMemoryConfig | None = field(default_factory=ParamMemoryConfig)
    fwd_bwd_consistency: bool = True
    device_memory: Any = None
    model_parallel: str | None = None


@dataclass
class CostsConfig:
    """Cost-model options of the costs stage (``costs.*``).

    Attributes:
        compile: the step runs under ``torch.compile`` (TorchInductor fuses chains of
            elementwise ops into one kernel); ``False`` (default): eager, every kernel
            launched alone, as torchtitan without ``training.compile``.
        fuse_pointwise: with ``compile``, price a chain of elementwise ops with one
            placement as one fused kernel: one launch floor, no re-read of the
            intermediates (a pairwise term of the MRF, pipeline/costmodel/fusion.py).
            The credit applies only when ``compile`` is true (an eager step fuses
            nothing); ``False`` turns it off under compile too. Until ``compile``
            existed the credit applied whenever this was true (the default): such a
            run is now ``costs.compile=true``.
        flatten_mesh: a redistribution that changes several mesh dims the same way
            (and a run of one collective over several mesh dims) is one collective over
            their flattened group, as FSDP2 and torchtitan run them on a flattened
            DeviceMesh (pipeline/costmodel/redistribute/flatten.py). ``False``: one
            collective per mesh dim, as DTensor's ``redistribute`` on the full mesh.
        step_time_uncertainty: the step-time model's relative uncertainty: rankings by
            step time (pipeline/core/ranking.py: the shapes table, the recipe comparison,
            the paper's plan table) mark plans within it of each other as ties. Source:
            not measured; it stands for the spread between the step-time model's
            variants until the calibration issue measures it (a placeholder, 2 %). Not
            part of any directory key (it shapes no plan).
    """

    compile: bool = False
    fuse_pointwise: bool = True
    flatten_mesh: bool = True
    step_time_uncertainty: float = 0.02


@dataclass
class PipelineConfig:
    """Pipeline parallelism (``pipeline.*``; docs/pipelining.md). The pipeline degree is
    the size of the mesh dim named ``pp``, which must be the outermost; without one there
    is no pipeline and these keys keep their defaults. Checked and resolved by
    :mod:`pipeline.config.pipelining`.

    Attributes:
        schedule: ``gpipe``, ``1f1b`` or ``interleaved_1f1b``
            (``torch.distributed.pipelining``'s ``ScheduleGPipe``, ``Schedule1F1B``,
            ``ScheduleInterleaved1F1B``).
        microbatches: microbatches per step, dividing the local batch, or ``auto`` (one
            sample per microbatch, torchtitan's default microbatch size of 1).
        virtual_stages: stages per pp rank (``interleaved_1f1b``: at least 2; else 1).
        split: ``auto`` (the repeated layers in ``pp x virtual_stages`` contiguous stages
            of sizes differing by at most one, the larger first) or the explicit layer
            boundaries ``[0, b1, ..., n_layers]``, increasing, stage ``s`` holding layers
            ``[b_s, b_{s+1})``.
    """

    schedule: str = "1f1b"
    microbatches: Any = "auto"
    virtual_stages: int = 1
    split: Any = "auto"


@dataclass
class PaperConfig:
    """The runs behind the paper's tables and figures (set by ``conf/experiment/paper*.yaml``;
    read by :mod:`pipeline.tools.paper`, not part of any stage's key).

    Attributes:
        runs: named run sets; each is a list of Hydra overrides in the multirun grammar
            (``mesh=8,2x4``, ``lazy_costs=true,false``) applied on top of the experiment's
            config, and every combination of their values is one run; or a list of such
            lists, the union of their runs.
        table_mesh: mesh of the eager-vs-lazy table (``None``: the largest mesh of its set).
    """

    runs: dict[str, list[Any]] = field(default_factory=dict)
    table_mesh: str | None = None


@dataclass
class Config:
    """The whole run configuration (``conf/config.yaml`` is merged onto this schema).

    Attributes:
        model, hardware, solver, optimizer: the selected options of the config groups
            (the optimizer only enters the memory model, pipeline/memory/).
        constraints: see :class:`ConstraintsConfig`.
        memory, fsdp: activation checkpointing and FSDP resharding
            (:class:`pipeline.memory.options.MemoryConfig`,
            :class:`pipeline.memory.options.FsdpConfig`).
        costs: cost-model options, see :class:`CostsConfig`.
        pipeline: pipeline parallelism over the ``pp`` mesh dim, see
            :class:`PipelineConfig`.
        mesh: device mesh shape: ``"2,4,8"``, ``"2x4x8"``, ``8`` or a list; resolved
            to a list of ints.
        mesh_names: one name per mesh dim (``None``: dp / dp,tp / dp,cp,tp by rank).
        lazy_costs: lazy cost factors (``None``: true for approx, false for ilp/lp).
        stamp_layers: trace a model of N >= 5 identical repeated blocks with 4 blocks and
            stamp the middle block to N (pipeline/stages/trace/stamp.py; the same graph IR as a
            full trace, so not part of the trace key); ``False``: always trace in full.
        repeated_layers: tie the copies of a repeated layer to one decision.
        recipe: pin the placements of a standard hand-written plan (``ddp``, ``fsdp``,
            ``hsdp``, ``fsdp_tp``, ``fsdp_tp_cp``; pipeline/stages/topology/pins.py) to compare
            it with the planner's plan under the same cost model; ``None``: none.
        optimality_check: also compute a certificate of optimality where possible.
        results_dir: root of all results, relative to the working directory.
        experiment: name of the selected ``conf/experiment`` option (set by it).
        revision_label: recorded in place of the git revision when given.
        workers: processes for the phases whose parts are independent (the DTensor
            strategies of distinct ops, the pairwise group factors; pipeline/core/parallel.py):
            ``0`` = one per CPU this process may use, ``1`` = all in this process. Not
            part of any stage's key: the results are the same for every value.
        paper: run sets of the paper's tables and figures, see :class:`PaperConfig`.
    """

    # One schema per model family (pipeline/models/): each conf/model option starts from
    # its family's schema (defaults: /schema/model/<family>@_here_), so the group node is
    # typed there; resolve() merges it onto the family schema again.
    model: Any = MISSING
    hardware: HardwareConfig = MISSING
    solver: SolverConfig = MISSING
    optimizer: OptimizerConfig = MISSING
    constraints: ConstraintsConfig = field(default_factory=ConstraintsConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    fsdp: FsdpConfig = field(default_factory=FsdpConfig)
    costs: CostsConfig = field(default_factory=CostsConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    mesh: Any = "2,4,8"
    mesh_names: list[str] | None = None
    lazy_costs: bool | None = None
    stamp_layers: bool = True
    repeated_layers: bool = True
    recipe: str | None = None
    optimality_check: bool = False
    results_dir: str = "results"
    experiment: str | None = None
    revision_label: str | None = None
    workers: int = 0
    paper: PaperConfig = field(default_factory=PaperConfig)


def register_configs() -> None:
    """Register the schema in Hydra's ``ConfigStore`` (idempotent).

    ``config_schema`` is the first entry of ``conf/config.yaml``'s defaults list;
    the group options are validated through the typed fields of :class:`Config`.
    """
    from hydra.core.config_store import ConfigStore

    store = ConfigStore.instance()
    store.store(name="config_schema", node=Config)
    for family in model_families.FAMILIES:  # conf/model/*.yaml: /schema/model/<family>
        store.store(group="schema/model", name=family, node=model_families.schema_of(family))
        base = model_families.base_option(family)
        if base is not None:  # model=hf, model=custom: the family's schema defaults
            store.store(group="model", name=base, node=model_families.schema_of(family))


def group_options(group: str) -> list[str]:
    """Names of the YAML options of a config group (``conf/<group>/*.yaml``), sorted."""
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


# --------------------------------------------------------------------------- introspection


def schema_type(key: str) -> tuple[Any, bool] | None:
    """(type, optional) of a dotted key in the :class:`Config` schema, ``None`` if unknown.

    List indices (``constraints.nodes.0.match``) and dict entries are followed."""
    if key.split(".")[0] == "model":  # typed by the family schemas (pipeline/models)
        return model_families.field_type(key)
    return schema_types.field_type(Config, key.split("."))


#: Schema dataclasses by class name (OmegaConf names them in its errors).
SCHEMAS: dict[str, Any] = {c.__name__: c for c in (
    Config, ModelConfig, HFModelConfig, CustomModelConfig, InputSpec, HardwareConfig,
    SolverConfig, ConstraintsConfig, NodeConstraint, ParamMemoryConfig, PaperConfig,
    CostsConfig, PipelineConfig)}
SCHEMAS["LinkConfig"] = typing.get_type_hints(HardwareConfig)["intra_node"]


def known_keys(key: str) -> str:
    """``allowed keys of model: name, dim, ...`` for the parent of a dotted key."""
    parent = key.rsplit(".", 1)[0] if "." in key else ""
    if parent == "model":  # one schema per family (pipeline/models)
        keys = {fam: ", ".join(f.name for f in dataclasses.fields(model_families.schema_of(fam))
                               if f.name not in ("family", "trace_env"))
                for fam in model_families.FAMILIES}
        return (f"allowed keys at model: {keys.pop('llama')} (model=hf/..., model=custom: "
                + "; ".join(f"{fam}: {text}" for fam, text in keys.items()) + ")")
    found = schema_type(parent) if parent else (Config, False)
    t = found[0] if found else None
    if not dataclasses.is_dataclass(t):
        return "see docs/config.md"
    where = parent or "the top level"
    return f"allowed keys at {where}: " + ", ".join(f.name for f in dataclasses.fields(t))


def allowed_text(key: str) -> str:
    """``allowed true, false, null`` etc. for a schema key, from the dataclass types."""
    found = schema_type(key)
    if found is None:
        return "unknown key; " + known_keys(key)
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
