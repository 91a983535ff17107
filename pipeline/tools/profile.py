"""Profile one placement search: ``python -m pipeline.tools.profile``.

The flags are those of the public reference's ``tests/search_profile.py`` harness, so a
script written for it runs here too::

    python -m pipeline.tools.profile --model llama1b --mesh 2,4,8 --solver approx \\
        --lazy-costs false --detailed-solution \\
        --revision-label "$(git rev-parse --short HEAD)" --output results/eager.json

The flags become Hydra overrides (:func:`flags_to_overrides`: ``--model`` -> ``model=``,
``--mesh`` -> ``mesh=``, ``--solver`` -> ``solver=``, ``--lazy-costs`` -> ``lazy_costs=``,
``--revision-label`` -> ``revision_label=``, ``--results-dir`` -> ``results_dir=``; any
further ``KEY=VALUE`` arguments are passed through), the config is composed and
validated (:func:`pipeline.config.load_resolved`) and the pipeline runs in this process
(:func:`pipeline.stages.runner.run_pipeline`), into the same result directories as
``snakemake`` and ``python -m pipeline``: the same config gives the same run and the
same placement hash. Stages whose artifacts are current are reused (``reused_stages``
in the output says which); ``--fresh`` reruns every stage so that the timings and the
peak RSS are this process's own.

The output JSON (written atomically) is the run record (``run.json``: expanded config,
environment, objective and its parts, bound and gap, status, placement hash, counts,
phase timings, peak RSS) plus ``schema_version``, ``status``, ``request`` (the flags),
``overrides``, ``expanded_config`` (model, mesh shape and dim names, hardware, solver,
cost mode), ``git`` (revision, dirty flag, ``git status --porcelain`` text and branch of
this checkout now), ``process`` (this process's wall time per stage, peak RSS and
elapsed seconds), ``reused_stages`` and ``run_record`` (its path). ``--detailed-solution``
adds ``solution_detail``: one entry per graph node from ``solution.parquet`` (name, op,
layer, role, group, strategy, output and input placements, compute / comm / transition
µs). One line of JSON (status, output, objective, placement hash) goes to stdout.

Exit codes: 0 success; 2 a bad flag or value (one line on stderr, nothing written);
1 the search failed (the output JSON then has ``status: "error"`` and the traceback).
``--moe-layout`` exists for compatibility with the reference and is refused: there is
no mixture-of-experts model here.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pipeline.config import (
    SOLVER_NAMES,
    STAGES,
    ConfigError,
    group_options,
    load_resolved,
    override_value,
    stage_dirs,
)
from pipeline.core import runtime
from pipeline.stages.runner import configure_logging, run_pipeline, sentinel

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1
_PROG = "python -m pipeline.tools.profile"


class _OneLineParser(argparse.ArgumentParser):
    """argparse with one-line errors (its default prints the usage block first)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise _UsageError(f"{self.prog}: {' '.join(message.split())}")


class _UsageError(Exception):
    pass


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (the reference harness's flags plus ``--results-dir``,
    ``--fresh`` and pass-through Hydra overrides)."""
    p = _OneLineParser(prog=_PROG, description="Profile one placement search and write "
                       "its run record as JSON.")
    p.add_argument("--model", required=True, choices=group_options("model"),
                   help="model preset (conf/model/)")
    p.add_argument("--mesh", help="mesh shape, e.g. 2,4,8 or 2x4x8 (default: the "
                   "config's, 2,4,8)")
    p.add_argument("--moe-layout", choices=("2d",),
                   help="reference compatibility only: refused (no MoE model here)")
    p.add_argument("--solver", required=True, choices=SOLVER_NAMES)
    p.add_argument("--lazy-costs", choices=("true", "false"),
                   help="default: true for approx, false for ilp/lp")
    p.add_argument("--revision-label", help="recorded in place of the git revision")
    p.add_argument("--output", type=Path, required=True, help="JSON file to write")
    p.add_argument("--detailed-solution", action="store_true",
                   help="add the per-node placements (solution.parquet)")
    p.add_argument("--results-dir", default=None,
                   help="root of the result directories (default: the config's, results)")
    p.add_argument("--fresh", action="store_true",
                   help="rerun every stage instead of reusing current artifacts")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                   help="further Hydra overrides, e.g. solver.max_iters=100")
    return p


def flags_to_overrides(args: argparse.Namespace) -> list[str]:
    """Hydra overrides for parsed flags.

    Raises:
        ConfigError: ``--moe-layout`` (no MoE model), or an extra argument that is not
            ``KEY=VALUE``.
    """
    if args.moe_layout is not None:
        raise ConfigError(f"--moe-layout {args.moe_layout}: no mixture-of-experts model "
                          f"here; allowed models {', '.join(group_options('model'))} "
                          "without --moe-layout")
    out = [f"model={args.model}", f"solver={args.solver}"]
    if args.mesh is not None:
        out.append(f"mesh={override_value(args.mesh.strip(), quote='always')}")
    if args.lazy_costs is not None:
        out.append(f"lazy_costs={args.lazy_costs}")
    if args.revision_label is not None:
        out.append(f"revision_label={override_value(args.revision_label, quote='always')}")
    if args.results_dir is not None:
        out.append(f"results_dir={override_value(args.results_dir, quote='always')}")
    for ov in args.overrides:
        if "=" not in ov:
            raise ConfigError(f"{ov}: not an override; allowed KEY=VALUE Hydra overrides")
        out.append(ov)
    return out


def git_status(root: Path = runtime.PROJECT_ROOT) -> dict[str, Any]:
    """Revision, dirty flag, ``git status --porcelain`` text and branch of the checkout."""
    info = dict(runtime.git_revision(root))
    for key, cmd in (("status", ["git", "status", "--porcelain"]),
                     ("branch", ["git", "branch", "--show-current"])):
        try:
            info[key] = subprocess.run(cmd, cwd=root, capture_output=True, text=True,
                                       check=True, timeout=10).stdout.rstrip("\n")
        except (OSError, subprocess.SubprocessError):
            info[key] = None
    return info


def expanded_config(cfg: Any) -> dict[str, Any]:
    """The parts of a resolved config that define the search, as plain data."""
    from omegaconf import OmegaConf

    def plain(node: Any) -> Any:
        return OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) \
            else node

    return {
        "model": plain(cfg.model),
        "mesh_shape": list(cfg.mesh),
        "mesh_dim_names": list(cfg.mesh_names),
        "hardware": cfg.hardware.name,
        "solver": plain(cfg.solver),
        "lazy_costs": bool(cfg.lazy_costs),
        "constraints": plain(cfg.constraints),
        "repeated_layers": bool(cfg.repeated_layers),
    }


def solution_detail(solve_dir: Path) -> list[dict[str, Any]]:
    """One entry per graph node of ``solution.parquet`` (graph order)."""

    from pipeline.core.artifacts import SOLUTION

    rows = runtime.read_parquet(SOLUTION.path(solve_dir)).to_pylist()
    for row in rows:
        row.pop("run_id", None)
    return rows


def _mtimes(dirs: Any) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for stage in STAGES:
        path = sentinel(dirs, stage)
        out[stage] = path.stat().st_mtime_ns if path.exists() else None
    return out


def profile(args: argparse.Namespace, overrides: list[str], cfg: Any) -> dict[str, Any]:
    """Run the search for a resolved config and return the output document."""
    import json

    started = time.perf_counter()
    dirs = stage_dirs(cfg)
    before = _mtimes(dirs)
    # run_pipeline prints where it wrote; keep stdout for the one-line summary
    with contextlib.redirect_stdout(sys.stderr):
        timer = run_pipeline(cfg, force=args.fresh)
    after = _mtimes(dirs)
    reused = [s for s in STAGES if s != "report" and before[s] is not None
              and before[s] == after[s]]
    record_path = sentinel(dirs, "solve")
    doc: dict[str, Any] = json.loads(record_path.read_text())
    doc["git_at_run"] = doc.get("git")
    doc.update({
        "schema_version": SCHEMA_VERSION,
        "status": "success",
        "request": _request(args),
        "overrides": overrides,
        "expanded_config": expanded_config(cfg),
        "git": git_status(),
        "run_record": str(record_path),
        "reused_stages": reused,
        "process": {"phases": dict(timer.seconds),
                    "peak_rss_bytes": runtime.peak_rss_bytes(),
                    "elapsed_s": time.perf_counter() - started, "pid": os.getpid()},
    })
    if args.detailed_solution:
        doc["solution_detail"] = solution_detail(dirs.solve)
    return doc


def _request(args: argparse.Namespace) -> dict[str, Any]:
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m pipeline.tools.profile``; returns the exit code."""
    import json

    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if any(a in ("-h", "--help") for a in argv):
        parser.print_help()
        return 0
    try:
        args = parser.parse_args(argv)
        overrides = flags_to_overrides(args)
        cfg = load_resolved(overrides)
    except (_UsageError, ConfigError) as err:
        print(err, file=sys.stderr)
        return 2
    configure_logging()
    started = time.perf_counter()
    try:
        doc = profile(args, overrides, cfg)
        code = 0
    except Exception as err:  # noqa: BLE001 - reported in the output JSON, exit 1
        doc = {"schema_version": SCHEMA_VERSION, "status": "error", "request": _request(args),
               "overrides": overrides, "expanded_config": expanded_config(cfg),
               "environment": runtime.environment(), "git": git_status(),
               "error": {"type": type(err).__name__, "message": str(err),
                         "traceback": traceback.format_exc()},
               "process": {"peak_rss_bytes": runtime.peak_rss_bytes(),
                           "elapsed_s": time.perf_counter() - started}}
        log.error("profile: %s: %s", type(err).__name__, err)
        code = 1
    runtime.write_json(args.output, doc)
    print(json.dumps({"status": doc["status"], "output": str(args.output),
                      "objective": doc.get("objective"),
                      "placement_hash": doc.get("placement_hash")}, sort_keys=True),
          flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
