"""Configuration: Hydra structured configs, validation, resolution and result paths.

Hydra is the single source of configuration (every key: docs/config.md).

=================  ==================================================================
module             job
=================  ==================================================================
``schema``         the schema (:class:`Config` and its parts), registered in Hydra's
                   ``ConfigStore`` (:func:`register_configs`); the YAML files under
                   ``conf/`` are merged onto it, so a misspelt key or a value of the
                   wrong type is refused
``overrides``      values in Hydra's override grammar (:func:`override_value`);
                   overrides normalised, checked, sweeps expanded
``compose``        a config composed from Hydra overrides (:func:`load_config`)
``validate``       validation and resolution (:func:`resolve`): ``mesh`` becomes a
                   list of ints, ``mesh_names``, ``lazy_costs`` and
                   ``constraints.param_memory.high`` get their defaults, and every bad
                   value raises :class:`ConfigError` with a one-line message naming
                   the key, the value and what is allowed
``paths``          the deterministic result directories of a resolved config
                   (:func:`stage_dirs`) and each stage's code hash
                   (:func:`stage_code_hash`)
``snakemake``      Snakemake ``--config`` keys as Hydra overrides
                   (:func:`overrides_from_snakemake`), and the part of a resolved config
                   a stage depends on as overrides (:func:`stage_overrides`)
``pipelining``     ``pipeline.*`` and ``model.microbatches`` against the mesh (``pp``
                   outermost) and the model; ``auto`` resolved
``readers``        plain values the stages pass to the libraries (parameter-memory
                   budget, pointwise fusion, workers), torch-free
=================  ==================================================================

Result layout (one directory level per stage, each named by a readable key plus
the first 8 hex digits of the SHA-256 of the canonical JSON of the resolved config
that stage depends on, cumulatively, see :data:`STAGE_KEYS`)::

    <results_dir>/runs/<model.name>-<h8>/            trace:    model.*
      <mesh, e.g. 2x4x8>-<h8>/                       topology: + mesh, mesh_names,
                                                               constraints.*, repeated_layers
        <hardware.name>-<h8>/<lazy|eager>/           costs:    + hardware.*, lazy_costs
          <solver.name>-<h8>/                        solve:    + solver.*, optimality_check
    <results_dir>/report/                            report:   all runs
"""

from pipeline.config.compose import load_config, load_resolved
from pipeline.config.environment import check_environment, log_level
from pipeline.config.overrides import (
    QUOTE_MODES,
    normalise_overrides,
    override_value,
    sweep_overrides,
)
from pipeline.config.paths import (
    STAGE_ENTRIES,
    STAGE_KEYS,
    StageDirs,
    config_hash,
    stage_code_hash,
    stage_dirs,
    stage_keys,
)
from pipeline.config.schema import (
    CONF_DIR,
    DEFAULT_MESH_NAMES,
    GROUPS,
    MIP_BACKENDS,
    SOLVER_NAMES,
    SOLVER_OBJECTIVES,
    STAGES,
    Config,
    ConfigError,
    ConstraintsConfig,
    NodeConstraint,
    PaperConfig,
    ParamMemoryConfig,
    SolverConfig,
    group_options,
    register_configs,
)
from pipeline.config.snakemake import SNAKEMAKE_KEYS, overrides_from_snakemake, stage_overrides
from pipeline.config.validate import default_mesh_names, mesh_label, parse_mesh, resolve

__all__ = [
    "CONF_DIR",
    "DEFAULT_MESH_NAMES",
    "GROUPS",
    "MIP_BACKENDS",
    "QUOTE_MODES",
    "SNAKEMAKE_KEYS",
    "SOLVER_NAMES",
    "SOLVER_OBJECTIVES",
    "STAGES",
    "STAGE_KEYS",
    "STAGE_ENTRIES",
    "Config",
    "ConfigError",
    "ConstraintsConfig",
    "NodeConstraint",
    "PaperConfig",
    "ParamMemoryConfig",
    "SolverConfig",
    "StageDirs",
    "check_environment",
    "config_hash",
    "default_mesh_names",
    "group_options",
    "load_config",
    "load_resolved",
    "log_level",
    "mesh_label",
    "normalise_overrides",
    "override_value",
    "overrides_from_snakemake",
    "parse_mesh",
    "register_configs",
    "resolve",
    "stage_code_hash",
    "stage_dirs",
    "stage_keys",
    "stage_overrides",
    "sweep_overrides",
]
