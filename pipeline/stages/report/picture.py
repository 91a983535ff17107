"""A picture of a plan: ``plan.png`` and ``plan.svg`` in each run's solve directory.

The picture shows one repeated layer (the first copy; with ``repeated_layers=true`` every
copy has its plan) as its op chain, forward in the left column and backward in the
middle one, the embedding above the layer and the final norm, head and loss below it;
the side panel holds the totals per collective kind.

**Drawing model**: :func:`~pipeline.stages.report.picture_model.build_picture` (data only,
no matplotlib; :mod:`pipeline.stages.report.picture_model` says which steps are drawn
and what each shows); this module draws it (:func:`draw`) and writes the files.

**Who writes it.** The report step (:func:`pipeline.stages.report.stage.run_report`) draws
the picture of every run under ``results/runs/`` whose picture is missing or older than its
``run.json`` (:func:`draw_plan_pictures`); the mesh-shape sweep draws its runs'
(:mod:`pipeline.tools.shapes`). ``python -m pipeline.stages.report.picture <solve dir>`` draws one.
Artifacts: :data:`pipeline.core.artifacts.PLAN_PICTURE`, :data:`pipeline.core.artifacts.PLAN_SVG`.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pipeline.core import runtime
from pipeline.core.artifacts import GRAPH, PLAN_PICTURE, PLAN_SVG, REDISTRIBUTIONS, RUN, SOLUTION
from pipeline.stages.report.picture_model import (
    LAYOUT_OPS,
    PlanPicture,
    Redistribution,
    Step,
    TensorView,
    build_picture,
    find_trace_dir,
    per_dim,
    placement_tokens,
)

__all__ = ["KIND_COLORS", "LAYOUT_OPS", "PlanPicture", "Redistribution", "Step", "TensorView",
           "build_picture", "draw", "draw_plan_pictures", "drawable", "ensure_plan_picture",
           "find_trace_dir", "human_bytes", "is_current", "main", "per_dim",
           "placement_tokens", "write_plan_picture"]

log = logging.getLogger(__name__)

#: Colour of each collective kind.
KIND_COLORS: dict[str, str] = {"all_gather": "#1f5fa8", "reduce_scatter": "#2e7d32",
                               "all_reduce": "#b23a2e", "all_to_all": "#7b3fa0"}
_LOCAL_COLOR = "#777777"


# --------------------------------------------------------------------------- drawing


def human_bytes(n: float) -> str:
    """``1536`` -> ``1.5 KiB`` (powers of 1024)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def _shape_text(t: TensorView) -> str:
    return "[" + "×".join(str(d) for d in t.shape) + "]" + (f" {t.dtype}" if t.dtype else "")


def _lines(step: Step, names: Sequence[str]) -> list[tuple[str, str, str]]:
    """(kind, text, colour) lines of one step: redistributions above, then the box."""
    out: list[tuple[str, str, str]] = []
    for r in step.redistributions:
        kinds = " + ".join(r.collectives) if r.collectives else "local reshard"
        kind0 = r.collectives[0].split("(")[0] if r.collectives else ""
        color = KIND_COLORS.get(kind0, _LOCAL_COLOR)
        rerun = f" ×{r.times}" if r.times > 1 else ""
        out.append(("comm", f"↓ {kinds}  {human_bytes(r.bytes)}  {r.us:,.1f} µs{rerun}",
                    color))
        out.append(("commsub", f"    {r.producer}: {r.src} → {r.dst}", color))
    out.append(("title", f"{step.label}  ·  {step.op}", "#000000"))
    if step.output is not None:
        placed = per_dim(step.output.placement, names)
        out.append(("body", f"out {_shape_text(step.output)}  {placed}", "#222222"))
    for w in step.weights:
        short = w.name.split(".")[-2] if w.name.count(".") >= 1 else w.name
        out.append(("body", f"W {short} {_shape_text(w)}  {per_dim(w.placement, names)}",
                    "#8a4b08"))
    return out


def _column(blocks: Sequence[tuple[str, Sequence[Step]]],
            names: Sequence[str]) -> list[tuple[str, str, str]]:
    out: list[tuple[str, str, str]] = []
    for header, steps in blocks:
        if not steps:
            continue
        out.append(("header", header, "#000000"))
        for s in steps:
            out.extend(_lines(s, names))
            out.append(("gap", "", ""))
    return out


def draw(pic: PlanPicture, png: Path, svg: Path | None = None) -> None:
    """Render the picture into ``png`` (and ``svg``), written atomically."""
    # a bare Figure (no pyplot: its import and global figure manager are not needed to
    # write a file; savefig renders with Agg)
    from matplotlib.figure import Figure
    from matplotlib.patches import Rectangle

    names = pic.mesh_names
    lay = pic.layer or "(no repeated layer)"
    copies = f" — 1 of {pic.layer_count} repeated layers" if pic.layer_count > 1 else ""
    fwd = _column([("embedding (forward)", pic.pre_forward),
                   (f"layer {lay}{copies} (forward)", pic.layer_forward),
                   ("final norm, head, loss (forward)", pic.post_forward)], names)
    bwd = _column([("loss, head, final norm (backward)", pic.post_backward),
                   (f"layer {lay} (backward)", pic.layer_backward),
                   ("embedding (backward)", pic.pre_backward)], names)
    side = _side_panel(pic)
    n = max(len(fwd), len(bwd), len(side), 10)
    line_in = 0.19
    fig = Figure(figsize=(20, 0.9 + n * line_in))
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(0, 1)
    ax.set_ylim(n + 3, -2.2)
    ax.axis("off")
    ax.text(0.01, -1.4, pic.title, fontsize=12, weight="bold", va="center")
    for x0, width, lines in ((0.01, 0.41, fwd), (0.43, 0.34, bwd)):
        _draw_column(ax, Rectangle, x0, width, lines)
    y = 0.0
    for kind, text, color in side:
        if kind == "gap":
            y += 1
            continue
        ax.text(0.785, y + 0.5, text, fontsize=8 if kind != "header" else 10,
                family="monospace" if kind != "header" else None,
                weight="bold" if kind == "header" else "normal", color=color, va="center")
        y += 1
    with runtime.atomic_path(png) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    if svg is not None:
        import matplotlib

        # text as SVG <text> elements (selectable, and ~10x faster to write than the
        # default glyph outlines of every character of this text-heavy picture)
        with runtime.atomic_path(svg) as tmp, matplotlib.rc_context({"svg.fonttype": "none"}):
            fig.savefig(tmp, format="svg")


def _draw_column(ax: Any, patch: Any, x0: float, width: float,
                 lines: Sequence[tuple[str, str, str]]) -> None:
    y = 0.0
    box_top: float | None = None
    for kind, text, color in lines:
        if kind == "title":
            box_top = y
        if kind in ("gap", "header") and box_top is not None:
            ax.add_patch(patch((x0, box_top + 0.05), width, y - box_top - 0.1,
                               facecolor="#eef3f8", edgecolor="#8899aa", linewidth=0.6,
                               zorder=0))
            box_top = None
        if kind == "header":
            ax.text(x0, y + 0.5, text, fontsize=10.5, weight="bold", va="center")
        elif kind == "title":
            ax.text(x0 + 0.004, y + 0.5, text, fontsize=9, weight="bold", va="center",
                    zorder=2)
        elif kind in ("body", "comm", "commsub"):
            ax.text(x0 + (0.004 if kind == "body" else 0.012), y + 0.5, text,
                    fontsize=8 if kind != "commsub" else 7, family="monospace",
                    color=color, va="center", zorder=2)
        y += 1
    if box_top is not None:
        ax.add_patch(patch((x0, box_top + 0.05), width, y - box_top - 0.1,
                           facecolor="#eef3f8", edgecolor="#8899aa", linewidth=0.6, zorder=0))


def _side_panel(pic: PlanPicture) -> list[tuple[str, str, str]]:
    out: list[tuple[str, str, str]] = [("header", "mesh", "#000000")]
    out.append(("body", "  " + " × ".join(f"{n}={s}" for n, s in
                                           zip(pic.mesh_names, pic.mesh_shape, strict=True)),
                "#222222"))
    out.append(("gap", "", ""))
    out.append(("header", "objective (µs, cost model)", "#000000"))
    for k, v in pic.summary.items():
        if isinstance(v, float):
            out.append(("body", f"  {k:<14}{v:>14,.1f}", "#222222"))
        elif v is not None:
            out.append(("body", f"  {k:<14}{v!s:>14}", "#222222"))
    out.append(("gap", "", ""))
    copies = f", ×{pic.layer_count} in the step" if pic.layer_count > 1 else ""
    for header, totals in (("collectives, whole step", pic.totals),
                           (f"collectives, one layer ({pic.layer}{copies})",
                            pic.layer_totals)):
        out.append(("header", header, "#000000"))
        out.append(("body", f"  {'kind(mesh dim)':<22}{'count':>6}{'bytes':>11}{'µs':>11}",
                    "#222222"))
        total_us = 0.0
        for k, v in totals.items():
            color = KIND_COLORS.get(k.split("(")[0], _LOCAL_COLOR)
            out.append(("body", f"  {k:<22}{v['count']:>6.0f}{human_bytes(v['bytes']):>11}"
                                f"{v['us']:>11,.1f}", color))
            total_us += v["us"]
        out.append(("body", f"  {'total':<22}{'':>6}{'':>11}{total_us:>11,.1f}", "#222222"))
        out.append(("gap", "", ""))
    out.append(("header", "legend", "#000000"))
    for k, c in KIND_COLORS.items():
        out.append(("body", f"  ↓ {k}", c))
    out.append(("body", "  ↓ local reshard (no collective)", _LOCAL_COLOR))
    out.append(("body", "  out: the step's output, placement per mesh dim", "#222222"))
    out.append(("body", "  W: a weight read, stored placement per mesh dim", "#8a4b08"))
    out.append(("body", "  a redistribution: collectives in order,", "#222222"))
    out.append(("body", "  bytes sent per device, µs charged", "#222222"))
    return out


# --------------------------------------------------------------------------- stage


def write_plan_picture(solve_dir: Path | str) -> tuple[Path, Path]:
    """Draw the run in ``solve_dir`` into its ``plan.png`` and ``plan.svg``; their paths."""
    solve_dir = Path(solve_dir)
    png, svg = PLAN_PICTURE.path(solve_dir), PLAN_SVG.path(solve_dir)
    draw(build_picture(solve_dir), png, svg)
    return png, svg


def is_current(solve_dir: Path | str) -> bool:
    """Both pictures exist and are not older than the run record."""
    solve_dir = Path(solve_dir)
    record = RUN.path(solve_dir)
    pictures = (PLAN_PICTURE.path(solve_dir), PLAN_SVG.path(solve_dir))
    return all(p.exists() and p.stat().st_mtime >= record.stat().st_mtime for p in pictures)


def ensure_plan_picture(solve_dir: Path | str) -> bool:
    """Draw the picture unless it is current; whether it was drawn."""
    if is_current(solve_dir):
        return False
    write_plan_picture(solve_dir)
    return True


def drawable(solve_dir: Path) -> bool:
    """Whether a run directory has what the picture reads (a run record, its tables and
    a trace above it); runs made by older code or copied partially have not."""
    return (all(a.path(solve_dir).exists() for a in (RUN, SOLUTION, REDISTRIBUTIONS))
            and any(GRAPH.path(p).exists() for p in solve_dir.resolve().parents))


def draw_plan_pictures(results_dir: Path | str,
                       solve_dirs: Sequence[Path] | None = None, workers: int = 1) -> list[Path]:
    """The report step's hook: draw the picture of every run under
    ``results_dir/runs`` (or of the runs ``solve_dirs``: the report passes the ones it
    trusts) whose picture is not current; the solve directories drawn. ``workers`` > 1
    draws them in that many processes (pipeline/core/parallel.py; each picture is written
    atomically by the process drawing it)."""
    from pipeline.core.parallel import map_chunks

    if solve_dirs is None:
        solve_dirs = [r.parent for r in sorted(Path(results_dir, "runs").glob(f"**/{RUN.name}"))]
    todo = []
    for solve_dir in solve_dirs:
        solve_dir = Path(solve_dir)
        if not drawable(solve_dir):
            log.info("plan picture: %s lacks the run's tables or trace; not drawn", solve_dir)
        elif not is_current(solve_dir):
            todo.append(solve_dir)
    parts = max(1, min(int(workers), len(todo)))

    def draw_chunk(chunk: list[Path]) -> list[Path]:
        for solve_dir in chunk:
            write_plan_picture(solve_dir)
        return chunk

    chunks = [todo[k::parts] for k in range(parts)] if todo else []
    drawn = sorted((d for part in map_chunks(draw_chunk, chunks) for d in part),
                   key=todo.index)
    if drawn:
        log.info("plan picture: drew %d run(s)", len(drawn))
    return drawn


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m pipeline.stages.report.picture <solve dir>...``: draw each run's picture."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print("usage: python -m pipeline.stages.report.picture <solve dir>...",
              file=sys.stderr if not args else sys.stdout)
        return 2 if not args else 0
    for a in args:
        if not drawable(Path(a)):
            print(f"solve_dir={a}: allowed a solve directory holding {RUN.name}, "
                  f"{SOLUTION.name} and {REDISTRIBUTIONS.name} below a trace", file=sys.stderr)
            return 2
    for a in args:
        png, _ = write_plan_picture(a)
        print(f"plan picture: {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
