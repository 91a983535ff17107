"""The paper's tables and figures, regenerated from ``runs.parquet`` only.

    python -m pipeline.tools.paper                          # experiment paper_toy
    python -m pipeline.tools.paper experiment=paper         # LLaMA-3 1B, full size
    python -m pipeline.tools.paper --no-run experiment=paper_toy results_dir=/data/results
    snakemake paper [--config experiment=paper]       # the same, runs as Snakemake jobs

An *experiment* (``conf/experiment/paper*.yaml``, ``# @package _global_``) names its
runs in ``paper.runs``: run sets, each a list of Hydra overrides in the multirun grammar
(``mesh=8,2x4``) applied on top of the experiment's config (:func:`load_experiment`).
Three sets are read:

* ``eager_vs_lazy``: the eager-vs-lazy table at mesh ``paper.table_mesh``
  (:func:`eager_vs_lazy_table`; columns from the run record's phases: Optimizer init =
  topology + cost_build, Factor build = factor_build, TRW-S solve = solve, Search
  total = search_total, Peak RSS = ``peak_rss_bytes.max``; plus the delta lazy - eager
  in seconds and percent), the per-phase time figure and the peak-RSS figure;
* ``solvers``: objective and certified gap by solver and mesh;
* ``depth``: search time against the number of layers.

Missing runs are computed first, one ``python -m pipeline`` process per run so that each
run's peak RSS is its own (:func:`ensure_runs`; Snakemake runs them as jobs instead), the
report is refreshed, and everything after that reads ``<results_dir>/report/runs.parquet``
and nothing else. Outputs go to ``<results_dir>/paper/<experiment>/``: the table as
Markdown and Parquet, one PNG per figure (matplotlib, Agg). Provenance -- the run ids,
run keys (result directories below ``runs/``), config hashes (SHA-256 of the canonical
JSON of each run's resolved config, 8 hex digits) and git revisions of the runs, plus the
revision and code hash (:func:`pipeline.config.stage_code_hash` ``("paper")``) of this
package -- is in the Parquet schema metadata (key ``pipeline``), in a JSON sidecar next
to every Markdown and PNG file (``<name>.provenance.json``), and in ``provenance.json``
for the whole set. Each figure also names its configs in a footer.

Modules: :mod:`~pipeline.tools.paper.experiment` (experiments, run sets, output files, making
the runs), :mod:`~pipeline.tools.paper.tables` (the runs table, the eager-vs-lazy table),
:mod:`~pipeline.tools.paper.provenance`, :mod:`~pipeline.tools.paper.figures`,
:mod:`~pipeline.tools.paper.build` (every artifact from the runs table) and
:mod:`~pipeline.tools.paper.cli` (``main``).

Exit codes: 0 done; 2 bad configuration or an experiment the paper cannot be built from
(one line on stderr); 1 a run failed.
"""

from pipeline.config import (
    ConfigError,
    config_hash,
    load_resolved,
    stage_code_hash,
    stage_dirs,
    sweep_overrides,
)
from pipeline.tools.paper.build import build_paper, make_paper
from pipeline.tools.paper.cli import main
from pipeline.tools.paper.experiment import (
    ARTIFACTS,
    DEFAULT_EXPERIMENT,
    PROVENANCE_FILE,
    RUN_SETS,
    SIDECAR_SUFFIX,
    Experiment,
    PaperError,
    PaperRun,
    ensure_runs,
    experiment_name,
    experiment_overrides,
    load_experiment,
    output_files,
    paper_dir,
    refresh_report,
    run_is_current,
    run_key,
)
from pipeline.tools.paper.figures import plot_depth, plot_peak_rss, plot_phases, plot_solvers
from pipeline.tools.paper.provenance import (
    describe_runs,
    file_sha256,
    provenance,
    run_provenance,
    sidecar_path,
    write_sidecar,
)
from pipeline.tools.paper.tables import (
    MIB,
    RSS_NOTE,
    SEARCH_PHASES,
    TABLE_COLUMNS,
    eager_vs_lazy_table,
    mesh_order,
    read_runs,
    row_config,
    row_float,
    select_runs,
    table_markdown,
)

__all__ = [
    "ARTIFACTS",
    "DEFAULT_EXPERIMENT",
    "MIB",
    "PROVENANCE_FILE",
    "RSS_NOTE",
    "RUN_SETS",
    "SEARCH_PHASES",
    "SIDECAR_SUFFIX",
    "TABLE_COLUMNS",
    "ConfigError",
    "Experiment",
    "PaperError",
    "PaperRun",
    "build_paper",
    "config_hash",
    "describe_runs",
    "eager_vs_lazy_table",
    "ensure_runs",
    "experiment_name",
    "experiment_overrides",
    "file_sha256",
    "load_experiment",
    "load_resolved",
    "main",
    "make_paper",
    "mesh_order",
    "output_files",
    "paper_dir",
    "plot_depth",
    "plot_peak_rss",
    "plot_phases",
    "plot_solvers",
    "provenance",
    "read_runs",
    "refresh_report",
    "row_config",
    "row_float",
    "run_is_current",
    "run_key",
    "run_provenance",
    "select_runs",
    "sidecar_path",
    "stage_code_hash",
    "stage_dirs",
    "sweep_overrides",
    "table_markdown",
    "write_sidecar",
]
