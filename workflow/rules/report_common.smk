# Helpers of the report and paper rules: what `snakemake --report` shows
# (report(...) flags, captions in workflow/report/), declared only under --report.

#: Whether this Snakemake process writes an HTML report (--report FILE), not a run.
REPORT_MODE = any(a == "--report" or a.startswith("--report=") for a in sys.argv[1:])
REPORT_CAPTIONS = Path(workflow.basedir) / "report"


def runs_page():
    """results/report/runs.html, the runs table as a page (pipeline/stages/report/html.py)."""
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


def paper_tables():
    """The paper's Markdown tables (each gets a page beside it, <table>.html)."""
    return [p for p in paper_outputs() if p.endswith(".md")]


def paper_pages():
    return [str(Path(p).with_suffix(".html")) for p in paper_tables()]


def paper_rule_outputs():
    """The paper's files but its Markdown tables (named in the rule), figures flagged for
    the HTML report; under --report also the table pages."""
    out = []
    for path in paper_outputs():
        if path.endswith(".md"):
            continue
        if path.endswith(".png"):
            out.append(report(path, caption=str(REPORT_CAPTIONS / f"{Path(path).stem}.rst"),
                              category="Paper"))
        else:
            out.append(path)
    if REPORT_MODE:
        out += [report(p, caption=str(REPORT_CAPTIONS / f"{Path(p).stem}.rst"),
                       category="Paper") for p in paper_pages()]
    return out


def report_extra_targets():
    """Extra inputs of the default target under --report (the paper, when it has been made)."""
    if not REPORT_MODE:
        return []
    paper = paper_outputs() + paper_pages()
    return paper if all(Path(p).is_file() for p in paper) else []


def report_tables_before_sentinel():
    """The report stage's outputs but its sentinel runs.parquet (named in the report rule)."""
    return [p for p in report_outputs() if p != stage_output("report")]
