# Helpers of the report and paper rules: what `snakemake --report` shows
# (report(...) flags, captions in workflow/report/), declared only under --report.

#: Whether this Snakemake process writes an HTML report (--report FILE), not a run.
REPORT_MODE = any(a == "--report" or a.startswith("--report=") for a in sys.argv[1:])
REPORT_CAPTIONS = Path(workflow.basedir) / "report"


def runs_page():
    """results/report/runs.html, the runs table as a page (pipeline/report_html.py)."""
    return str(PLAN_DIRS.report / "runs.html")


def plan_pictures():
    """Every plan picture the report stage drew, <results_dir>/runs/**/plan.png."""
    return sorted(str(p) for p in Path(PLAN_CFG.results_dir, "runs").glob("**/plan.png"))


def report_rule_extra_outputs():
    """What the HTML report shows of the report stage (nothing outside --report), the runs
    page and every plan picture, labelled by its run directory."""
    if not REPORT_MODE:
        return []
    runs_dir = Path(PLAN_CFG.results_dir, "runs")
    pictures = [report(p, caption=str(REPORT_CAPTIONS / "plan.rst"), category="Plans",
                       labels={"run": str(Path(p).parent.relative_to(runs_dir))})
                for p in plan_pictures()]
    return [report(runs_page(), caption=str(REPORT_CAPTIONS / "runs.rst"), category="Runs")] + pictures


def paper_page():
    """The eager-vs-lazy table of the paper as a page, beside its Markdown file."""
    return str(Path(paper_md()).with_suffix(".html"))


def paper_md():
    return next(p for p in paper_outputs() if p.endswith("eager_vs_lazy.md"))


def report_tables_before_sentinel():
    """The report stage's outputs but its sentinel runs.parquet (named in the rule)."""
    return [p for p in report_outputs() if p != stage_output("report")]


def paper_rule_outputs():
    """The paper's files, figures flagged for the HTML report; under --report also the
    table page."""
    out = []
    for path in paper_outputs():
        if path == paper_md():
            continue  # named in the rule
        name = Path(path).stem
        if path.endswith(".png"):
            out.append(report(path, caption=str(REPORT_CAPTIONS / f"{name}.rst"),
                              category="Paper"))
        else:
            out.append(path)
    if REPORT_MODE:
        out.append(report(paper_page(), caption=str(REPORT_CAPTIONS / "eager_vs_lazy.rst"),
                          category="Paper"))
    return out


def report_extra_targets():
    """Extra inputs of the default target under --report (the paper, when it has been made)."""
    if not REPORT_MODE:
        return []
    paper = paper_outputs() + [paper_page()]
    return paper if all(Path(p).is_file() for p in paper) else []
